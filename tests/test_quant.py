"""Quantizers round-trip through gguf.quants.dequantize, the independent decoder."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

from trio_llm.errors import UnsupportedModelError
from trio_llm.model.quant import dequantize, quantize, row_bytes, tensor_bytes


def _weights(rows: int = 64, cols: int = 512, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, cols), dtype=np.float32) * np.float32(0.02)  # [rows, cols]
    # edge cases every encoder must survive: an all-zero block, one-signed rows,
    # a single outlier, and tiny values near float16's subnormal range
    x[1, :256] = 0.0
    x[2] = np.abs(x[2])
    x[3] = -np.abs(x[3])
    x[4, 7] = 1.5
    x[5] *= np.float32(1e-4)
    return x


# Relative RMS error ceilings for N(0, 0.02) data: 4-bit codes have a step of about
# range/15 (RMS error step/sqrt(12), about 8% of sigma); 5-bit about 4%; 6-bit codes
# about 2%; 8-bit codes under 1%; Q3_K's 8 levels over a 16-value sub-block about 15%
# and Q2_K's 4 levels about 36%. Each ceiling leaves ~1.5x headroom over the measured
# value.
RMSE_CEILING = {
    T.F32: 0.0, T.F16: 1e-3, T.BF16: 5e-3, T.Q8_0: 0.01, T.Q4_0: 0.13, T.Q4_1: 0.12,
    T.Q5_0: 0.065, T.Q5_1: 0.06, T.Q2_K: 0.5, T.Q3_K: 0.23, T.Q4_K: 0.12, T.Q5_K: 0.06,
    T.Q6_K: 0.03, T.IQ4_NL: 0.12, T.IQ4_XS: 0.12,
}


@pytest.mark.parametrize("qtype", list(RMSE_CEILING), ids=lambda t: t.name)
def test_round_trip_through_gguf_decoder(qtype: T) -> None:
    x = _weights()
    raw = quantize(x, qtype)
    assert raw.dtype == np.uint8
    assert raw.shape == (x.shape[0], row_bytes(qtype, x.shape[1]))
    y = gguf.quants.dequantize(raw, qtype)  # [rows, cols], ggml's reference decoder
    assert y.shape == x.shape
    err = y - x
    rel_rmse = float(np.sqrt(np.mean(err[6:] ** 2)) / x[6:].std())
    assert rel_rmse <= RMSE_CEILING[qtype]
    np.testing.assert_array_equal(y[1, :256], 0.0)  # zeros stay exactly zero
    # our own decoder agrees with gguf's, bit for bit
    np.testing.assert_array_equal(dequantize(raw, qtype, x.shape), y)


def _q4_k_steps(raw: np.ndarray) -> np.ndarray:
    """Per 32-value sub-block step d*sc, decoded independently of quant.py."""
    blocks = raw.reshape(-1, 144)
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)  # [n_blocks, 1]
    sc, _ = gguf.quants.Q4_K.get_scale_min(blocks[:, 4:16].copy())  # [n_blocks, 8]
    return d * sc.astype(np.float32)


def _q6_k_steps(raw: np.ndarray) -> np.ndarray:
    blocks = raw.reshape(-1, 210)
    d = blocks[:, 208:210].copy().view(np.float16).astype(np.float32)  # [n_blocks, 1]
    sc = blocks[:, 192:208].copy().view(np.int8).astype(np.float32)  # [n_blocks, 16]
    return d * sc


def _q5_k_steps(raw: np.ndarray) -> np.ndarray:
    blocks = raw.reshape(-1, 176)
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)  # [n_blocks, 1]
    sc, _ = gguf.quants.Q4_K.get_scale_min(blocks[:, 4:16].copy())  # [n_blocks, 8]
    return d * sc.astype(np.float32)


def _q2_k_steps(raw: np.ndarray) -> np.ndarray:
    blocks = raw.reshape(-1, 84)
    d = blocks[:, 80:82].copy().view(np.float16).astype(np.float32)  # [n_blocks, 1]
    return d * (blocks[:, 0:16] & 0x0F).astype(np.float32)  # [n_blocks, 16]


@pytest.mark.parametrize(
    ("qtype", "steps", "sub"),
    [(T.Q2_K, _q2_k_steps, 16), (T.Q4_K, _q4_k_steps, 32), (T.Q5_K, _q5_k_steps, 32), (T.Q6_K, _q6_k_steps, 16)],
    ids=["Q2_K", "Q4_K", "Q5_K", "Q6_K"],
)
def test_k_quant_error_is_at_most_half_a_step(qtype: T, steps, sub: int) -> None:
    """Scales are rounded up, so no value clips: every element lands within half a
    quantization step (d * sc of its sub-block) of the original, up to float32
    rounding of the decoder's multiply-add."""
    x = _weights(seed=1)
    raw = quantize(x, qtype)
    y = gguf.quants.dequantize(raw, qtype)
    step = steps(raw).reshape(-1)  # [n_sub_blocks]
    err = np.abs(y - x).reshape(-1, sub).max(axis=-1)  # [n_sub_blocks]
    slack = 1e-6 * np.abs(x).reshape(-1, sub).max(axis=-1) + 1e-12
    assert np.all(err <= 0.5 * step + slack)


def test_q4_k_packs_the_high_bits_of_six_bit_scales() -> None:
    """Sub-blocks 4..7 keep their scales' top bits in bytes 0..7: a block whose large
    values sit in the second half exercises exactly those bits."""
    x = np.zeros((1, 256), dtype=np.float32)
    x[0, :128] = np.linspace(-0.01, 0.01, 128, dtype=np.float32)
    x[0, 128:] = np.linspace(-1.0, 1.0, 128, dtype=np.float32)
    y = gguf.quants.dequantize(quantize(x, T.Q4_K), T.Q4_K)
    assert np.abs(y - x).max() < 1.0 / 15


@pytest.mark.parametrize("qtype", [T.Q3_K, T.IQ4_NL, T.IQ4_XS], ids=lambda t: t.name)
def test_signed_codes_map_the_extreme_value_exactly_either_sign(qtype: T) -> None:
    """Q3_K and the IQ4 types have asymmetric signed ranges (-4..3, -127..113): the
    value of largest magnitude lands on the wide end whichever its sign, so a block's
    extreme comes back within float16 rounding of the scale (and of the sub-block scale's
    6-bit rounding for the two-level types), not clipped to the narrow end."""
    rng = np.random.default_rng(4)
    x = rng.standard_normal((4, 256), dtype=np.float32) * np.float32(0.02)
    x[0, 5], x[1, 200] = 0.5, -0.5  # one dominant value per row, either sign
    x[2, 17], x[2, 40] = 0.3, -0.3  # both signs at the extreme: one end must give
    y = gguf.quants.dequantize(quantize(x, qtype), qtype)
    assert abs(y[0, 5] - 0.5) < 0.02 and abs(y[1, 200] + 0.5) < 0.02
    assert max(abs(y[2, 17] - 0.3), abs(y[2, 40] + 0.3)) < 0.05
    assert np.isfinite(y).all()


def test_dequantize_of_a_memory_view_is_a_fresh_array() -> None:
    x = _weights(rows=8, cols=256)
    raw = quantize(x, T.F32)
    raw.setflags(write=False)
    y = dequantize(raw, T.F32, x.shape)
    y[0, 0] = 42.0  # writable and independent of raw
    np.testing.assert_array_equal(raw.view(np.float32)[0, 0], x[0, 0])


def test_sizes_follow_ggml_blocks() -> None:
    assert tensor_bytes(T.Q4_K, (4096, 14336)) == 4096 * 14336 // 256 * 144
    assert tensor_bytes(T.Q6_K, (128256, 2048)) == 128256 * 2048 // 256 * 210
    assert tensor_bytes(T.Q8_0, (2048,)) == 2048 // 32 * 34
    assert tensor_bytes(T.F32, (7,)) == 28


def test_rows_that_do_not_fill_a_block_are_rejected() -> None:
    with pytest.raises(UnsupportedModelError, match="multiple of Q4_K"):
        quantize(np.zeros((2, 100), dtype=np.float32), T.Q4_K)
    with pytest.raises(UnsupportedModelError, match="cannot quantize to IQ2_XXS"):
        quantize(np.zeros((2, 256), dtype=np.float32), T.IQ2_XXS)
    with pytest.raises(UnsupportedModelError, match="needs 144 bytes"):
        dequantize(np.zeros(100, dtype=np.uint8), T.Q4_K, (256,))

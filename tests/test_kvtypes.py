"""KV cache types against llama.cpp itself: the bytes its CPU backend stores for a row
(the type's CPU ``from_float``, what ``set_rows`` calls when it writes the cache) and the
floats it reads back (``dequantize_row_*``), called through ctypes in the llama.cpp
library of the ``xllamacpp`` wheel."""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import numpy as np
import pytest

from trio_llm.model.kvtypes import (
    DEFAULT_KV_TYPE,
    KV_TYPES,
    dequantize_rows,
    kv_type,
    quantize_rows,
    roundtrip,
    row_bytes,
)

xllamacpp = pytest.importorskip("xllamacpp")

_FROM_FLOAT = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64)


@functools.cache
def _lib() -> ctypes.CDLL:
    lib = ctypes.CDLL(str(Path(xllamacpp.__file__).parent / "xllamacpp.abi3.so"))
    lib.ggml_cpu_init()
    lib.ggml_get_type_traits_cpu.restype = ctypes.c_void_p
    lib.ggml_get_type_traits_cpu.argtypes = [ctypes.c_int]
    return lib


def _llama_store(name: str, x: np.ndarray) -> np.ndarray:
    """The bytes llama.cpp's CPU backend writes for the rows ``x``: the first member of
    ``struct ggml_type_traits_cpu`` is ``from_float``."""
    t = kv_type(name)
    x = np.ascontiguousarray(x, np.float32)
    out = np.zeros((*x.shape[:-1], t.row_bytes(x.shape[-1])), np.uint8)
    traits = _lib().ggml_get_type_traits_cpu(int(t.ggml))
    fn = _FROM_FLOAT(ctypes.c_void_p.from_address(traits).value)
    fn(x.ctypes.data, out.ctypes.data, x.size)
    return out


def _llama_load(name: str, raw: np.ndarray, n: int) -> np.ndarray:
    """The floats llama.cpp decodes from cache rows (``dequantize_row_*`` and the f16 /
    bf16 row converters: what its attention's ``to_float`` reads)."""
    raw = np.ascontiguousarray(raw, np.uint8)
    out = np.zeros((*raw.shape[:-1], n), np.float32)
    fn = {"f16": "ggml_fp16_to_fp32_row", "bf16": "ggml_bf16_to_fp32_row"}.get(name, f"dequantize_row_{name}")
    getattr(_lib(), fn)(ctypes.c_void_p(raw.ctypes.data), ctypes.c_void_p(out.ctypes.data), ctypes.c_int64(out.size))
    return out


def _rows(seed: int) -> np.ndarray:
    """Rows of 256 values that reach the encoders' corners: several magnitudes, an
    all-zero block, a one-signed block, an outlier, values on q8_0 / q4 rounding ties
    (small multiples of 1/4 and 1/2), f16 subnormals and values past f16's range."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((64, 256)).astype(np.float32)  # [rows, n]
    x *= rng.choice(np.float32([1e-3, 0.05, 1.0, 30.0]), size=(64, 1))
    x[0, :32] = 0.0
    x[1, 32:64] = np.abs(x[1, 32:64])
    x[2, 64:96] = -np.abs(x[2, 64:96])
    x[3, 100] = 900.0
    x[4:12] = rng.integers(-64, 65, size=(8, 256)) * np.float32(0.25)
    x[12:20] = rng.integers(-254, 255, size=(8, 256)) * np.float32(0.5)
    x[20:24] = rng.integers(-16, 17, size=(4, 256)).astype(np.float32)
    x[24] *= np.float32(1e-6)
    x[25, :8] = np.float32([7e4, -7e4, 65504, 65520, 1e-8, -1e-8, 6e-5, 3e-5])
    return x


@pytest.mark.parametrize("name", list(KV_TYPES))
def test_quantize_rows_stores_what_llama_cpp_stores(name: str) -> None:
    for seed in range(4):
        x = _rows(seed)
        ours = quantize_rows(x, name)
        assert ours.dtype == np.uint8 and ours.shape == (64, row_bytes(name, 256))
        np.testing.assert_array_equal(ours, _llama_store(name, x))


@pytest.mark.parametrize("name", list(KV_TYPES))
def test_dequantize_rows_reads_what_llama_cpp_reads(name: str) -> None:
    x = _rows(7)
    raw = _llama_store(name, x)
    ours = dequantize_rows(raw, name, 256)
    theirs = _llama_load(name, raw, 256) if name != "f32" else x
    np.testing.assert_array_equal(ours.view(np.uint32), theirs.view(np.uint32))
    np.testing.assert_array_equal(roundtrip(x, name).view(np.uint32), theirs.view(np.uint32))


def test_q8_0_is_the_x86_encoder_not_the_reference() -> None:
    """On a tie the AVX2 encoder rounds to even where quantize_row_q8_0_ref rounds away
    from zero: a block whose max is 127 has id = 1 and stores 0.5 as 0, 1.5 as 2."""
    x = np.zeros((1, 32), np.float32)
    x[0, :4] = [127.0, 0.5, 1.5, -2.5]
    q = quantize_rows(x, "q8_0")[0, 2:6].view(np.int8)
    assert q.tolist() == [127, 0, 2, -2]
    np.testing.assert_array_equal(quantize_rows(x, "q8_0"), _llama_store("q8_0", x))


@pytest.mark.parametrize("name", list(KV_TYPES))
def test_roundtrip_error_and_idempotence(name: str) -> None:
    """Relative RMS error of each type on N(0, 1) rows (ceilings ~1.5x the measured
    0, 2e-4, 1.7e-3, 5.4e-3, 0.086, 0.078, 0.043, 0.038), and a second pass through
    the cache changes nothing: a float32 copy of a cache writes back the same bytes."""
    ceiling = {"f32": 0.0, "f16": 3e-4, "bf16": 2.5e-3, "q8_0": 8e-3, "q4_0": 0.13,
               "q4_1": 0.12, "q5_0": 0.065, "q5_1": 0.06}[name]
    rng = np.random.default_rng(3)
    x = rng.standard_normal((4, 3, 512)).astype(np.float32)  # [a, b, n]: any leading shape
    r = roundtrip(x, name)
    assert r.shape == x.shape and r.dtype == np.float32
    assert np.sqrt(np.mean((r - x) ** 2) / np.mean(x**2)) <= ceiling
    np.testing.assert_array_equal(roundtrip(r, name), r)
    np.testing.assert_array_equal(quantize_rows(r, name), quantize_rows(x, name))


def test_sizes_names_and_errors() -> None:
    assert DEFAULT_KV_TYPE == "f16"
    bytes_512 = {"f32": 2048, "f16": 1024, "bf16": 1024, "q8_0": 544, "q4_0": 288,
                 "q4_1": 320, "q5_0": 352, "q5_1": 384}
    assert {n: row_bytes(n, 512) for n in KV_TYPES} == bytes_512
    assert kv_type("Q8_0") is KV_TYPES["q8_0"]
    assert [t.code for t in KV_TYPES.values()] == list(range(8))
    with pytest.raises(ValueError, match="unsupported KV cache type 'q4_k'; allowed: f32, f16"):
        kv_type("q4_k")
    with pytest.raises(ValueError, match="a row of 80 is not a multiple of it"):
        row_bytes("q4_0", 80)
    assert row_bytes("f16", 80) == 160
    with pytest.raises(ValueError, match="q8_0 rows of 64 values are 68 bytes, got 64"):
        dequantize_rows(np.zeros((2, 64), np.uint8), "q8_0", 64)

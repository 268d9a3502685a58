"""Quantize float32 matrices to ggml block formats and back.

F32, F16, BF16, Q8_0 and Q4_0 use ``gguf.quants`` (llama.cpp's Python port, bit-exact
with ggml for those types). ``gguf.quants`` can *decode* Q4_K and Q6_K but has no
encoder for them, so the two K-quant encoders below are hand-written: vectorised over
every block of the tensor at once (no Python loop per block or row), because
``make-model`` pushes billions of values through them.

Both encoders choose scales from each sub-block's max/min, rounding every stored
scale *up* (``_f16_ceil``, ``np.ceil``) so that no value ever clips. The dequantized
error is therefore at most half a quantization step, per element:

* Q4_K: ``|x - x'| <= d * sc[j] / 2`` for sub-block ``j`` (32 values),
* Q6_K: ``|x - x'| <= d * sc[j] / 2`` for sub-block ``j`` (16 values),

up to float32 rounding, which the tests check against ``gguf.quants.dequantize``.
llama.cpp's own encoders search for scales that minimise the weighted squared error;
the layouts are the same, only the choice of scales differs.
"""

from __future__ import annotations

from collections.abc import Sequence

import gguf
import numpy as np
from gguf import GGMLQuantizationType as T
from gguf.constants import GGML_QUANT_SIZES, QK_K

from trio_llm.errors import UnsupportedModelError

#: what ``quantize`` accepts
QUANT_TYPES: frozenset[T] = frozenset({T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q4_K, T.Q6_K})


def block_size(ggml_type: T) -> int:
    """Values per block; a row's length must be a multiple of it."""
    return GGML_QUANT_SIZES[ggml_type][0]


def row_bytes(ggml_type: T, n_in: int) -> int:
    """Bytes of one row of ``n_in`` values."""
    bs, ts = GGML_QUANT_SIZES[ggml_type]
    if n_in % bs:
        raise UnsupportedModelError(
            "<tensor>", f"row length {n_in} is not a multiple of {ggml_type.name}'s block of {bs}"
        )
    return n_in // bs * ts


def tensor_bytes(ggml_type: T, shape: Sequence[int]) -> int:
    """Bytes of a tensor of numpy-order ``shape`` stored as ``ggml_type``."""
    n_rows = int(np.prod(shape[:-1])) if len(shape) > 1 else 1
    return n_rows * row_bytes(ggml_type, int(shape[-1]))


def quantize(array: np.ndarray, ggml_type: T) -> np.ndarray:
    """Encode ``array`` (float32, rows along the last axis) as ggml blocks.

    Returns uint8 of shape ``(*array.shape[:-1], row_bytes)``: exactly the bytes a
    GGUF stores for the tensor.
    """
    array = np.ascontiguousarray(array, dtype=np.float32)
    if ggml_type not in QUANT_TYPES:
        raise UnsupportedModelError("<tensor>", f"cannot quantize to {ggml_type.name}")
    n_in = array.shape[-1]
    out_shape = (*array.shape[:-1], row_bytes(ggml_type, n_in))
    if ggml_type == T.F32:
        return array.view(np.uint8).reshape(out_shape)
    if ggml_type == T.F16:
        return array.astype(np.float16).view(np.uint8).reshape(out_shape)
    if ggml_type == T.Q4_K:
        return _quantize_q4_k(array.reshape(-1, QK_K)).reshape(out_shape)
    if ggml_type == T.Q6_K:
        return _quantize_q6_k(array.reshape(-1, QK_K)).reshape(out_shape)
    return np.asarray(gguf.quants.quantize(array, ggml_type), dtype=np.uint8).reshape(out_shape)


def dequantize(raw: np.ndarray, ggml_type: T, shape: Sequence[int]) -> np.ndarray:
    """Decode the bytes of a tensor to a fresh float32 array of numpy-order ``shape``."""
    shape = tuple(int(d) for d in shape)
    n_bytes = tensor_bytes(ggml_type, shape)
    flat = np.asarray(raw).reshape(-1).view(np.uint8)
    if flat.size != n_bytes:
        raise UnsupportedModelError(
            "<tensor>", f"{ggml_type.name} {shape} needs {n_bytes} bytes, got {flat.size}"
        )
    n_rows = n_bytes // row_bytes(ggml_type, shape[-1])
    rows = flat.reshape(n_rows, -1)  # [n_rows, row_bytes]
    out = gguf.quants.dequantize(rows, ggml_type)
    return np.array(out, dtype=np.float32, copy=True).reshape(shape)


def _f16_ceil(x: np.ndarray) -> np.ndarray:
    """The smallest float16 >= ``x`` (a scale rounded down would clip the largest value)."""
    h = x.astype(np.float16)
    low = h.astype(np.float32) < x
    return np.where(low, np.nextafter(h, np.float16(np.inf)), h)


def _safe_div(num: np.ndarray | np.float32, den: np.ndarray) -> np.ndarray:
    """``num / den`` with 0 where ``den`` is 0 (an all-zero sub-block)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(den > 0, num / np.where(den > 0, den, 1), 0).astype(np.float32)


def _quantize_q4_k(blocks: np.ndarray) -> np.ndarray:
    """Q4_K: 256 values in 8 sub-blocks of 32; x = d*sc[j]*q - dmin*m[j], q in 0..15.

    Block (144 bytes): d f16, dmin f16, 12 bytes of 6-bit sc/m packed, 128 bytes of
    nibbles (byte c*32+i holds sub-block 2c in its low and 2c+1 in its high nibble).
    """
    n = blocks.shape[0]
    sub = blocks.reshape(n, 8, 32)  # [n_blocks, 8, 32]
    lo = np.minimum(sub.min(axis=-1), 0.0)  # [n_blocks, 8] (the offset is subtracted: m >= 0)
    hi = sub.max(axis=-1)  # [n_blocks, 8]
    # offsets: dm[j] = dmin*m[j] >= -lo, so x + dm[j] >= 0 never clips at 0
    dmin = _f16_ceil(-lo.min(axis=-1) / 63.0)  # [n_blocks] f16
    dmin32 = dmin.astype(np.float32)
    m = np.minimum(np.ceil(_safe_div(-lo, dmin32[:, None])), 63).astype(np.uint8)  # [n_blocks, 8]
    dm = dmin32[:, None] * m.astype(np.float32)  # [n_blocks, 8]
    # steps: d*sc[j] >= (hi + dm)/15, so (x + dm)/step <= 15 never clips at 15
    need = np.maximum(hi + dm, 0.0) / 15.0  # [n_blocks, 8]
    d = _f16_ceil(need.max(axis=-1) / 63.0)  # [n_blocks] f16
    d32 = d.astype(np.float32)
    sc = np.minimum(np.ceil(_safe_div(need, d32[:, None])), 63).astype(np.uint8)  # [n_blocks, 8]
    step = d32[:, None] * sc.astype(np.float32)  # [n_blocks, 8]
    q = sub + dm[..., None]  # [n_blocks, 8, 32]
    q *= _safe_div(np.float32(1.0), step)[..., None]
    np.rint(q, out=q)
    np.clip(q, 0, 15, out=q)
    q = q.astype(np.uint8)

    scales = np.empty((n, 12), dtype=np.uint8)
    scales[:, 0:4] = sc[:, 0:4] | ((sc[:, 4:8] >> 4) << 6)
    scales[:, 4:8] = m[:, 0:4] | ((m[:, 4:8] >> 4) << 6)
    scales[:, 8:12] = (sc[:, 4:8] & 0x0F) | ((m[:, 4:8] & 0x0F) << 4)
    pairs = q.reshape(n, 4, 2, 32)  # [n_blocks, chunk, nibble, 32]
    qs = (pairs[:, :, 0, :] | (pairs[:, :, 1, :] << 4)).reshape(n, 128)

    out = np.empty((n, 144), dtype=np.uint8)
    out[:, 0:2] = d.reshape(n, 1).view(np.uint8)
    out[:, 2:4] = dmin.reshape(n, 1).view(np.uint8)
    out[:, 4:16] = scales
    out[:, 16:144] = qs
    return out


def _quantize_q6_k(blocks: np.ndarray) -> np.ndarray:
    """Q6_K: 256 values in 16 sub-blocks of 16; x = d*sc[j]*(q - 32), q in 0..63.

    Block (210 bytes): 128 bytes ql (low 4 bits), 64 bytes qh (high 2 bits), 16 int8
    scales, d f16. Value v = 128*h + 32*r + c (h half, r 0..3, c 0..31) keeps its low
    nibble in ql[64*h + 32*(r % 2) + c] (high nibble when r >= 2) and its top two
    bits in qh[32*h + c] at bit 2*r.
    """
    n = blocks.shape[0]
    sub = blocks.reshape(n, 16, 16)  # [n_blocks, 16, 16]
    # symmetric: q - 32 in -31..31 (the -32 code is left unused so both signs fit)
    need = np.abs(sub).max(axis=-1) / 31.0  # [n_blocks, 16]
    d = _f16_ceil(need.max(axis=-1) / 127.0)  # [n_blocks] f16
    d32 = d.astype(np.float32)
    sc = np.minimum(np.ceil(_safe_div(need, d32[:, None])), 127).astype(np.int8)  # [n_blocks, 16]
    step = d32[:, None] * sc.astype(np.float32)  # [n_blocks, 16]
    q = sub * _safe_div(np.float32(1.0), step)[..., None]  # [n_blocks, 16, 16]
    np.rint(q, out=q)
    np.clip(q, -31, 31, out=q)
    q += 32
    q = q.astype(np.uint8).reshape(n, 2, 4, 32)  # [n, h, r, c]

    low = q & 0x0F
    ql = (low[:, :, 0:2, :] | (low[:, :, 2:4, :] << 4)).reshape(n, 128)
    top = q >> 4  # [n, h, r, c] two bits each
    qh = (top[:, :, 0] | (top[:, :, 1] << 2) | (top[:, :, 2] << 4) | (top[:, :, 3] << 6)).reshape(n, 64)

    out = np.empty((n, 210), dtype=np.uint8)
    out[:, 0:128] = ql
    out[:, 128:192] = qh
    out[:, 192:208] = sc.view(np.uint8)
    out[:, 208:210] = d.reshape(n, 1).view(np.uint8)
    return out

"""Quantize float32 matrices to ggml block formats and back.

Decoding is ``gguf.quants.dequantize`` (llama.cpp's Python port) for every type.
F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0 and Q5_1 are also *encoded* by ``gguf.quants``
(bit-exact with ggml for those types). It has no encoder for the K-quants and the
IQ4 types, so those below are hand-written: vectorised over every block of the
tensor at once (no Python loop per block or row), because ``make-model`` pushes
billions of values through them.

The affine K-quants (Q2_K, Q4_K, Q5_K: ``x = d*sc[j]*q - dmin*m[j]``) and Q6_K choose
scales from each sub-block's max/min, rounding every stored scale *up*
(``_f16_ceil``, ``np.ceil``) so that no value ever clips. The dequantized error is
therefore at most half a quantization step ``d * sc[j] / 2`` per element, up to
float32 rounding, which the tests check against ``gguf.quants.dequantize``.

Q3_K (``x = d*(sc[j]-32)*q``, q in -4..3) and the IQ4 types (``x = d*K[q]`` with
llama.cpp's 16 non-linear levels ``K``) are signed codes with an asymmetric range: as
llama.cpp does, the value of largest magnitude is mapped onto the wide end (-4, -127)
so the scale may be negative, and every value is rounded to its nearest level. For
the IQ4 types one least-squares refit of the scale to the chosen levels comes before
the final rounding (a cheap form of llama.cpp's search).

llama.cpp's own encoders search for scales that minimise a weighted squared error; the
layouts are the same, only the choice of scales differs (the weights here are random).
"""

from __future__ import annotations

from collections.abc import Sequence

import gguf
import numpy as np
from gguf import GGMLQuantizationType as T
from gguf.constants import GGML_QUANT_SIZES

from trio_llm.errors import UnsupportedModelError

#: what ``quantize`` accepts
QUANT_TYPES: frozenset[T] = frozenset({
    T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1,
    T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K, T.IQ4_NL, T.IQ4_XS,
})
#: llama.cpp's IQ4_NL / IQ4_XS levels (ggml-common.h kvalues_iq4nl)
IQ4_LEVELS = np.array(gguf.quants.IQ4_NL.kvalues, dtype=np.float32)


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
    own = _ENCODERS.get(ggml_type)
    if own is not None:
        blocks = array.reshape(-1, block_size(ggml_type))  # [n_blocks, block]
        return own(blocks).reshape(out_shape)
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
    """``num / den`` with 0 where ``den`` is 0 (an all-zero sub-block); signed scales
    divide too."""
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(den != 0, num / np.where(den != 0, den, 1), 0).astype(np.float32)


def _affine_codes(
    sub: np.ndarray, qmax: int, smax: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Scales and codes of an affine K-quant: ``x = d*sc[j]*q - dmin*m[j]``.

    ``sub`` is [n_blocks, n_sub, sub_len]; q in 0..qmax, sc and m in 0..smax. Returns
    (d f16 [n], dmin f16 [n], sc uint8 [n, n_sub], m uint8 [n, n_sub], q uint8 like sub).
    """
    lo = np.minimum(sub.min(axis=-1), 0.0)  # [n, n_sub] (the offset is subtracted: m >= 0)
    hi = sub.max(axis=-1)  # [n, n_sub]
    # offsets: dm[j] = dmin*m[j] >= -lo, so x + dm[j] >= 0 never clips at 0
    dmin = _f16_ceil(-lo.min(axis=-1) / smax)  # [n] f16
    dmin32 = dmin.astype(np.float32)
    m = np.minimum(np.ceil(_safe_div(-lo, dmin32[:, None])), smax).astype(np.uint8)  # [n, n_sub]
    dm = dmin32[:, None] * m.astype(np.float32)  # [n, n_sub]
    # steps: d*sc[j] >= (hi + dm)/qmax, so (x + dm)/step <= qmax never clips at qmax
    need = np.maximum(hi + dm, 0.0) / qmax  # [n, n_sub]
    d = _f16_ceil(need.max(axis=-1) / smax)  # [n] f16
    d32 = d.astype(np.float32)
    sc = np.minimum(np.ceil(_safe_div(need, d32[:, None])), smax).astype(np.uint8)  # [n, n_sub]
    step = d32[:, None] * sc.astype(np.float32)  # [n, n_sub]
    q = sub + dm[..., None]  # [n, n_sub, sub_len]
    q *= _safe_div(np.float32(1.0), step)[..., None]
    np.rint(q, out=q)
    np.clip(q, 0, qmax, out=q)
    return d, dmin, sc, m, q.astype(np.uint8)


def _pack_k_scales(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """Q4_K / Q5_K: eight 6-bit scales and mins in 12 bytes; sub-blocks 4..7 keep their
    top two bits in the top bits of bytes 0..7."""
    scales = np.empty((sc.shape[0], 12), dtype=np.uint8)
    scales[:, 0:4] = sc[:, 0:4] | ((sc[:, 4:8] >> 4) << 6)
    scales[:, 4:8] = m[:, 0:4] | ((m[:, 4:8] >> 4) << 6)
    scales[:, 8:12] = (sc[:, 4:8] & 0x0F) | ((m[:, 4:8] & 0x0F) << 4)
    return scales


def _halves(d: np.ndarray) -> np.ndarray:
    """[n] float16 -> [n, 2] bytes."""
    return d.astype(np.float16).reshape(-1, 1).view(np.uint8)


def _quantize_q4_k(blocks: np.ndarray) -> np.ndarray:
    """Q4_K: 256 values in 8 sub-blocks of 32; x = d*sc[j]*q - dmin*m[j], q in 0..15.

    Block (144 bytes): d f16, dmin f16, 12 bytes of 6-bit sc/m packed, 128 bytes of
    nibbles (byte c*32+i holds sub-block 2c in its low and 2c+1 in its high nibble).
    """
    n = blocks.shape[0]
    d, dmin, sc, m, q = _affine_codes(blocks.reshape(n, 8, 32), 15, 63)
    pairs = q.reshape(n, 4, 2, 32)  # [n_blocks, chunk, nibble, 32]
    out = np.empty((n, 144), dtype=np.uint8)
    out[:, 0:2] = _halves(d)
    out[:, 2:4] = _halves(dmin)
    out[:, 4:16] = _pack_k_scales(sc, m)
    out[:, 16:144] = (pairs[:, :, 0, :] | (pairs[:, :, 1, :] << 4)).reshape(n, 128)
    return out


def _quantize_q5_k(blocks: np.ndarray) -> np.ndarray:
    """Q5_K: Q4_K with 5-bit codes (q in 0..31); the fifth bit of value 32b + l is bit
    b of qh[l].

    Block (176 bytes): d f16, dmin f16, 12 scale bytes (as Q4_K), qh[32], qs[128] (the
    low nibbles, as Q4_K's).
    """
    n = blocks.shape[0]
    d, dmin, sc, m, q = _affine_codes(blocks.reshape(n, 8, 32), 31, 63)  # q [n, 8, 32]
    low = (q & 0x0F).reshape(n, 4, 2, 32)
    bit = (q >> 4).astype(np.uint8)  # [n, b, l]
    qh = np.zeros((n, 32), dtype=np.uint8)
    for b in range(8):
        qh |= bit[:, b, :] << b
    out = np.empty((n, 176), dtype=np.uint8)
    out[:, 0:2] = _halves(d)
    out[:, 2:4] = _halves(dmin)
    out[:, 4:16] = _pack_k_scales(sc, m)
    out[:, 16:48] = qh
    out[:, 48:176] = (low[:, :, 0, :] | (low[:, :, 1, :] << 4)).reshape(n, 128)
    return out


def _two_bit_planes(q: np.ndarray) -> np.ndarray:
    """Q2_K / Q3_K low bits: [n, 256] codes 0..3 -> [n, 64] bytes; value 128h + 32s + l
    sits at bits 2s of byte 32h + l."""
    n = q.shape[0]
    parts = q.reshape(n, 2, 4, 32)  # [n, h, s, l]
    out = parts[:, :, 0] | (parts[:, :, 1] << 2) | (parts[:, :, 2] << 4) | (parts[:, :, 3] << 6)
    return out.reshape(n, 64)


def _quantize_q2_k(blocks: np.ndarray) -> np.ndarray:
    """Q2_K: 256 values in 16 sub-blocks of 16; x = d*sc[j]*q - dmin*m[j], q in 0..3,
    sc and m 4-bit.

    Block (84 bytes): scales[16] (sc low nibble, m high), qs[64], d f16, dmin f16.
    """
    n = blocks.shape[0]
    d, dmin, sc, m, q = _affine_codes(blocks.reshape(n, 16, 16), 3, 15)
    out = np.empty((n, 84), dtype=np.uint8)
    out[:, 0:16] = sc | (m << 4)
    out[:, 16:80] = _two_bit_planes(q.reshape(n, 256))
    out[:, 80:82] = _halves(d)
    out[:, 82:84] = _halves(dmin)
    return out


def _signed_scales(sub: np.ndarray, wide: float) -> np.ndarray:
    """Per sub-block scale mapping the value of largest magnitude onto code ``wide``
    (the negative end of an asymmetric signed range); [n, n_sub, len] -> [n, n_sub]."""
    idx = np.abs(sub).argmax(axis=-1)[..., None]  # [n, n_sub, 1]
    ext = np.take_along_axis(sub, idx, axis=-1)[..., 0]  # [n, n_sub]
    return (ext / np.float32(wide)).astype(np.float32)


def _quantize_q3_k(blocks: np.ndarray) -> np.ndarray:
    """Q3_K: 256 values in 16 sub-blocks of 16; x = d*(sc[j] - 32)*q, q in -4..3,
    sc 6-bit.

    Block (110 bytes): hmask[32] (bit 4h+s of byte l: the high bit of value
    128h + 32s + l, set when q >= 0), qs[64] (low two bits of q + 4, as Q2_K),
    scales[12] (the low nibbles of sc[0..8) and sc[8..16) in bytes 0..7, their top two
    bits in bytes 8..11), d f16.
    """
    n = blocks.shape[0]
    sub = blocks.reshape(n, 16, 16)
    s = _signed_scales(sub, -4.0)  # [n, 16]
    d = (np.abs(s).max(axis=-1) / 31.0).astype(np.float16)  # [n]
    d32 = d.astype(np.float32)
    ls = np.clip(np.rint(_safe_div(s, d32[:, None])), -32, 31)  # [n, 16]
    step = d32[:, None] * ls.astype(np.float32)  # [n, 16]
    q = sub * _safe_div(np.float32(1.0), step)[..., None]  # [n, 16, 16]
    np.rint(q, out=q)
    np.clip(q, -4, 3, out=q)
    u = (q + 4).astype(np.uint8).reshape(n, 256)  # 0..7
    sc = (ls + 32).astype(np.uint8)  # [n, 16] 0..63
    hbit = (u >> 2).reshape(n, 8, 32)  # [n, b, l], value 32b + l
    hmask = np.zeros((n, 32), dtype=np.uint8)
    for b in range(8):
        hmask |= hbit[:, b, :] << b
    scales = np.empty((n, 12), dtype=np.uint8)
    scales[:, 0:8] = (sc[:, 0:8] & 0x0F) | ((sc[:, 8:16] & 0x0F) << 4)
    top = (sc >> 4).reshape(n, 4, 4)  # [n, k, i]: scale 4k + i
    scales[:, 8:12] = top[:, 0] | (top[:, 1] << 2) | (top[:, 2] << 4) | (top[:, 3] << 6)
    out = np.empty((n, 110), dtype=np.uint8)
    out[:, 0:32] = hmask
    out[:, 32:96] = _two_bit_planes(u & 3)
    out[:, 96:108] = scales
    out[:, 108:110] = _halves(d)
    return out


#: nearest IQ4 level of v, for v in half-unit bins: every midpoint between two levels
#: is a multiple of 0.5, so all of bin [k/2, (k+1)/2) has one nearest level (a table
#: lookup is ~8x faster than searchsorted over the levels)
_IQ4_SPAN = 130
_IQ4_TABLE = np.abs(
    (np.arange(-2 * _IQ4_SPAN, 2 * _IQ4_SPAN + 1) / 2 + 0.25)[:, None] - IQ4_LEVELS[None, :]
).argmin(axis=1).astype(np.uint8)


def _iq4_nearest(v: np.ndarray) -> np.ndarray:
    """Index of the nearest IQ4 level of each value of ``v`` (values in level units)."""
    k = np.floor(np.clip(v, -_IQ4_SPAN, _IQ4_SPAN) * 2).astype(np.int32)
    k += 2 * _IQ4_SPAN
    return _IQ4_TABLE[k]


def _iq4_scales(sub: np.ndarray) -> np.ndarray:
    """IQ4 scale of each [n, n_sub, 32] sub-block: the extreme value onto -127, nearest
    levels, then the least-squares scale for those levels. Returns [n, n_sub] float32."""
    d = _signed_scales(sub, -127.0)  # [n, n_sub]
    k = IQ4_LEVELS[_iq4_nearest(sub * _safe_div(np.float32(1.0), d)[..., None])]  # [n, n_sub, 32]
    refit = _safe_div((sub * k).sum(axis=-1), (k * k).sum(axis=-1))
    return np.where(refit != 0, refit, d).astype(np.float32)


def _iq4_nibbles(idx: np.ndarray) -> np.ndarray:
    """[..., 32] indices -> [..., 16] bytes: value i < 16 low nibble of byte i, value
    16 + i its high nibble."""
    return idx[..., :16] | (idx[..., 16:] << 4)


def _quantize_iq4_nl(blocks: np.ndarray) -> np.ndarray:
    """IQ4_NL: blocks of 32, x = d*K[q] with llama.cpp's 16 levels K. Block (18
    bytes): d f16, qs[16] (nibbles as Q4_0)."""
    n = blocks.shape[0]
    d16 = _iq4_scales(blocks.reshape(n, 1, 32))[:, 0].astype(np.float16)
    idx = _iq4_nearest(blocks * _safe_div(np.float32(1.0), d16.astype(np.float32))[:, None])
    out = np.empty((n, 18), dtype=np.uint8)
    out[:, 0:2] = _halves(d16)
    out[:, 2:18] = _iq4_nibbles(idx.astype(np.uint8))
    return out


def _quantize_iq4_xs(blocks: np.ndarray) -> np.ndarray:
    """IQ4_XS: 256 values in 8 sub-blocks of 32; x = d*(ls[j] - 32)*K[q], ls 6-bit.

    Block (136 bytes): d f16, scales_h u16 (the top two bits of ls[j] at bits 2j),
    scales_l[4] (the low nibbles, two per byte), qs[128] (16 bytes per sub-block, as an
    IQ4_NL block's).
    """
    n = blocks.shape[0]
    sub = blocks.reshape(n, 8, 32)
    dj = _iq4_scales(sub)  # [n, 8]
    d = (np.abs(dj).max(axis=-1) / 31.0).astype(np.float16)  # [n]
    d32 = d.astype(np.float32)
    ls = np.clip(np.rint(_safe_div(dj, d32[:, None])), -32, 31)  # [n, 8]
    step = d32[:, None] * ls.astype(np.float32)
    idx = _iq4_nearest(sub * _safe_div(np.float32(1.0), step)[..., None]).astype(np.uint8)
    u = (ls + 32).astype(np.uint16)  # [n, 8] 0..63
    scales_h = np.zeros(n, dtype=np.uint16)
    for j in range(8):
        scales_h |= (u[:, j] >> 4) << (2 * j)
    low = (u & 0x0F).astype(np.uint8)
    out = np.empty((n, 136), dtype=np.uint8)
    out[:, 0:2] = _halves(d)
    out[:, 2:4] = scales_h.reshape(n, 1).view(np.uint8)
    out[:, 4:8] = low[:, 0::2] | (low[:, 1::2] << 4)
    out[:, 8:136] = _iq4_nibbles(idx).reshape(n, 128)
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


#: the encoders of this module (the rest are gguf.quants'), by type
_ENCODERS = {
    T.Q2_K: _quantize_q2_k, T.Q3_K: _quantize_q3_k, T.Q4_K: _quantize_q4_k, T.Q5_K: _quantize_q5_k,
    T.Q6_K: _quantize_q6_k, T.IQ4_NL: _quantize_iq4_nl, T.IQ4_XS: _quantize_iq4_xs,
}

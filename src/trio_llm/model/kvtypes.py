"""KV cache types: llama-server's ``-ctk`` / ``-ctv`` names, their row sizes, and the
exact values a cache of each type stores.

A cache row is one position of one layer: ``kv_dim`` values (every KV head of it, head
after head), stored as ggml stores a tensor row of that type, so quantized types are
blocks of 32 values along the row and a head of ``head_dim`` (a multiple of 32) is a
whole number of blocks. That is llama.cpp's layout of ``cache_k_l*`` / ``cache_v_l*``
with flash attention on (V not transposed; llama.cpp requires flash attention for a
quantized V cache).

``roundtrip`` gives the float32 values a cache of the type holds after llama.cpp's
CPU backend has written ``x`` into it (``ggml_compute_forward_set_rows``, which calls
the type's CPU ``from_float``), so a numpy reference that stores K and V through it
reads what llama.cpp reads. Checked byte for byte against the ``from_float`` of the
llama.cpp in the ``xllamacpp`` wheel (``tests/test_kvtypes.py``):

* f16: round to nearest even (F16C ``vcvtps2ph``; numpy's cast is the same).
* bf16, q4_0, q4_1, q5_0, q5_1: the ``*_ref`` quantizers, which ``gguf.quants`` ports
  bit-exactly (``x * id + 8.5`` and the like rounded twice, in float32: the wheel's
  ggml does not fuse them into a multiply-add).
* q8_0: **not** ``quantize_row_q8_0_ref`` on x86. The CPU backend's AVX/AVX2
  ``quantize_row_q8_0`` takes ``id = 127 / amax`` (the reference: ``1 / (amax / 127)``,
  which can differ in the last bit) and rounds half to even (``_mm256_round_ps``;
  the reference's ``roundf`` rounds half away from zero). ``gguf.quants`` follows the
  reference, so q8_0 is written out here. A non-x86 llama.cpp build (NEON, or scalar)
  uses other code paths; which one differs only where a value sits on a rounding tie.
"""

from __future__ import annotations

import attrs
import gguf
import numpy as np
from gguf import GGMLQuantizationType as T
from gguf.constants import GGML_QUANT_SIZES


@attrs.frozen
class KVType:
    """One cache type: its llama-server name, its ggml type, and ``code`` (the
    ``KV_TYPE`` value the shaders switch on)."""

    name: str
    ggml: T
    code: int

    @property
    def block(self) -> int:
        """Values per block (1 for the float types)."""
        return GGML_QUANT_SIZES[self.ggml][0]

    @property
    def block_bytes(self) -> int:
        return GGML_QUANT_SIZES[self.ggml][1]

    @property
    def quantized(self) -> bool:
        return self.block > 1

    def row_bytes(self, n: int) -> int:
        """Bytes of a row of ``n`` values; ``n`` must be a whole number of blocks."""
        if n % self.block:
            raise ValueError(
                f"KV cache type {self.name} stores blocks of {self.block} values; "
                f"a row of {n} is not a multiple of it"
            )
        return n // self.block * self.block_bytes


#: every type, in llama-server's order of its ``-ctk`` help; codes are shader constants
KV_TYPES: dict[str, KVType] = {
    t.name: t
    for t in (
        KVType("f32", T.F32, 0),
        KVType("f16", T.F16, 1),
        KVType("bf16", T.BF16, 2),
        KVType("q8_0", T.Q8_0, 3),
        KVType("q4_0", T.Q4_0, 4),
        KVType("q4_1", T.Q4_1, 5),
        KVType("q5_0", T.Q5_0, 6),
        KVType("q5_1", T.Q5_1, 7),
    )
}

#: llama-server's default for both ``-ctk`` and ``-ctv``
DEFAULT_KV_TYPE = "f16"


def kv_type(name: str | KVType) -> KVType:
    """The type named ``name`` (llama-server's spelling, case-insensitive)."""
    if isinstance(name, KVType):
        return name
    t = KV_TYPES.get(name.lower())
    if t is None:
        raise ValueError(f"unsupported KV cache type {name!r}; allowed: {', '.join(KV_TYPES)}")
    return t


def row_bytes(name: str | KVType, n: int) -> int:
    """Bytes of one cache row of ``n`` values stored as ``name``."""
    return kv_type(name).row_bytes(n)


def quantize_rows(x: np.ndarray, name: str | KVType) -> np.ndarray:
    """Encode float32 rows (the last axis) as the cache stores them: uint8 of shape
    ``(*x.shape[:-1], row_bytes(name, x.shape[-1]))``."""
    t = kv_type(name)
    x = np.ascontiguousarray(x, dtype=np.float32)
    n = x.shape[-1]
    shape = (*x.shape[:-1], t.row_bytes(n))
    if t.ggml == T.F32:
        return x.view(np.uint8).reshape(shape).copy()
    # values past f16's range become inf, as llama.cpp stores them
    with np.errstate(over="ignore"):
        if t.ggml == T.F16:
            return x.astype(np.float16).view(np.uint8).reshape(shape)
        if t.ggml == T.Q8_0:
            return _quantize_q8_0_x86(x.reshape(-1, 32)).reshape(shape)
        out = np.asarray(gguf.quants.quantize(x.reshape(-1, n), t.ggml))
    return np.ascontiguousarray(out).view(np.uint8).reshape(shape)


def dequantize_rows(raw: np.ndarray, name: str | KVType, n: int) -> np.ndarray:
    """Decode cache rows of ``n`` values (``raw`` uint8, rows along the last axis of
    ``row_bytes(name, n)`` bytes) to float32 ``(*raw.shape[:-1], n)``; bit-exact with
    llama.cpp's ``dequantize_row_*`` (checked in the tests)."""
    t = kv_type(name)
    rb = t.row_bytes(n)
    raw = np.ascontiguousarray(raw, dtype=np.uint8)
    if raw.shape[-1] != rb:
        raise ValueError(f"{t.name} rows of {n} values are {rb} bytes, got {raw.shape[-1]}")
    lead = raw.shape[:-1]
    flat = raw.reshape(-1, rb)
    if t.ggml == T.F32:
        out = flat.view(np.float32)
    elif t.ggml == T.F16:
        out = flat.view(np.float16).astype(np.float32)
    else:
        out = np.asarray(gguf.quants.dequantize(flat, t.ggml), dtype=np.float32)
    return np.array(out, dtype=np.float32).reshape(*lead, n)


def roundtrip(x: np.ndarray, name: str | KVType) -> np.ndarray:
    """The float32 values a cache of type ``name`` holds once ``x`` is written to it."""
    t = kv_type(name)
    x = np.asarray(x, dtype=np.float32)
    if t.ggml == T.F32:
        return x.copy()
    return dequantize_rows(quantize_rows(x, t), t, x.shape[-1])


def _quantize_q8_0_x86(blocks: np.ndarray) -> np.ndarray:
    """Q8_0 as ggml-cpu's AVX/AVX2 ``quantize_row_q8_0``: d = amax / 127 stored as f16,
    q = round-half-even(x * (127 / amax)) (see the module docstring)."""
    amax = np.abs(blocks).max(axis=1, keepdims=True)  # [n_blocks, 1]
    d = (amax / np.float32(127)).astype(np.float16)  # [n_blocks, 1]
    safe = np.where(amax != 0, amax, np.float32(1))
    inv = np.where(amax != 0, np.float32(127) / safe, np.float32(0)).astype(np.float32)
    q = np.rint(blocks * inv).astype(np.int8)  # [n_blocks, 32]
    out = np.empty((blocks.shape[0], 34), np.uint8)
    out[:, :2] = d.view(np.uint8)
    out[:, 2:] = q.view(np.uint8)
    return out


def rotation_blocks(k_name: str | KVType, v_name: str | KVType, head_dim: int) -> tuple[int, int]:
    """llama.cpp's rotation of a quantized cache (llama-kv-cache.cpp ``attn_rot_k`` /
    ``attn_rot_v``, on since April 2026): with a quantized K and ``head_dim % 64 == 0``, q
    and k are multiplied by a normalised Walsh-Hadamard matrix in blocks of the largest
    power of two dividing ``head_dim`` before k is stored; with a quantized V, v is rotated
    in blocks of 64 before it is stored and the attention output rotated back (the
    matrix is its own inverse). It spreads outliers over a block before the 4- to 8-bit
    rounding. Returns the (K, V) block sizes, 0 where there is no rotation."""
    if head_dim % 64:
        return 0, 0
    kb = head_dim & -head_dim if kv_type(k_name).quantized else 0
    vb = 64 if kv_type(v_name).quantized else 0
    return kb, vb


def hadamard(x: np.ndarray, block: int) -> np.ndarray:
    """``x`` [..., n] times the normalised Walsh-Hadamard matrix (Sylvester order) of
    size ``block`` in every block of the last axis, as float32."""
    shape = x.shape
    y: np.ndarray = x.astype(np.float32).reshape(-1, block)
    h = 1
    while h < block:  # the fast transform: butterflies of distance h
        y = y.reshape(-1, block // (2 * h), 2, h)
        a, b = y[:, :, 0, :], y[:, :, 1, :]
        y = np.stack([a + b, a - b], axis=2)
        h *= 2
    return (y.reshape(shape) * np.float32(1.0 / np.sqrt(block))).astype(np.float32)

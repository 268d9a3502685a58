"""The SigLIP vision tower and gemma-3's projector, in numpy float32.

This is llama.cpp's ``clip_graph_siglip`` for ``PROJECTOR_TYPE_GEMMA3``
(``tools/mtmd/models/siglip.cpp`` over ``clip_graph::build_inp`` and ``build_vit`` in
``tools/mtmd/clip.cpp``), op for op:

- patch embedding: the ``patch x patch`` stride-``patch`` convolution as one matmul over
  the unfolded patches, plus ``v.patch_embd.bias``, plus the learned
  ``v.position_embd.weight``; patches in row-major order (row ``y``, column ``x``);
- per block: LayerNorm ``ln1`` -> q, k, v with biases -> non-causal multi-head
  attention at scale ``1/sqrt(head_dim)`` -> ``attn_out`` + bias -> residual;
  LayerNorm ``ln2`` -> ``ffn_up`` + bias -> the activation -> ``ffn_down`` + bias ->
  residual;
- ``v.post_ln``;
- the projector: the ``n x n`` patch grid average-pooled by ``n_merge x n_merge``
  (stride ``n_merge``), the pooled rows again row-major, RMS-normed with the file's
  ``eps`` and scaled by ``mm.soft_emb_norm.weight`` (the converter already stored
  Gemma's ``1 + w``), then multiplied by ``mm.input_projection.weight``, which the
  file keeps as HF's ``[n_embd, n_embd_text]`` (llama.cpp transposes it before its
  ``mul_mat``; here it is a plain ``x @ W``).

It runs on the CPU, like llama-server's ``--no-mmproj-offload``; a Vulkan encoder is
future work. Everything is float32 and batched as large BLAS matmuls: one matmul per
projection over all patches, attention one head at a time over all patches. ``encode`` blocks for
seconds on a real projector (about 5 TFLOP for gemma-3's 896x896 image), so callers
on trio run it with ``trio.to_thread.run_sync``.

Weights stay in the file's memory map in their stored type; each matrix is
dequantized to float32 just before its matmul and dropped after it. Holding a
float32 copy of gemma-3's 400M-parameter tower would take 1.7 GB on top of the
mapped f16 file; converting a block's matrices per image costs well under a
percent of the matmuls. The vectors (norms, biases, position embeddings) are small
and converted once.

Where llama.cpp's own numbers differ (by rounding, not by formula): its CPU matmuls
round activations to f16 for f16 weights (and to q8_0 for q8_0 weights), its
``ggml_gelu`` reads a float16 table, and its flash-attention path (the default where
the backend has it) stores K and V as f16. This module computes all of it in float32.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Literal

import attrs
import numpy as np

from trio_llm.model.gguf import TensorInfo

FfnOp = Literal["gelu", "silu", "gelu_quick"]


@attrs.frozen
class Hparams:
    """The vision tower's shape, as llama.cpp's ``clip_hparams`` reads it."""

    image_size: int
    patch_size: int
    n_embd: int
    n_head: int
    n_ff: int
    n_layer: int
    n_merge: int  # the pool's kernel and stride (llama.cpp's n_merge / proj_scale_factor)
    n_embd_out: int  # the text model's width (mm.input_projection.weight's columns)
    eps: float
    ffn_op: FfnOp

    @property
    def n_side(self) -> int:
        """Patches along one side of the image."""
        return self.image_size // self.patch_size

    @property
    def n_patches(self) -> int:
        return self.n_side * self.n_side

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def n_tokens(self) -> int:
        """Embeddings per image: the pooled grid's cells."""
        side = self.n_side // self.n_merge
        return side * side


def tensor_shapes(hp: Hparams) -> dict[str, tuple[int, ...]]:
    """Every tensor a gemma3 projector of ``hp`` has, with its numpy-order shape (the
    reverse of ggml's ``ne``). The loader validates files against it and
    ``synth.write_mmproj`` writes exactly it."""
    e, p = hp.n_embd, hp.patch_size
    shapes: dict[str, tuple[int, ...]] = {
        "v.patch_embd.weight": (e, 3, p, p),  # ggml ne [p, p, 3, n_embd]
        "v.patch_embd.bias": (e,),
        "v.position_embd.weight": (hp.n_patches, e),
    }
    for il in range(hp.n_layer):
        b = f"v.blk.{il}"
        for norm in ("ln1", "ln2"):
            shapes[f"{b}.{norm}.weight"] = (e,)
            shapes[f"{b}.{norm}.bias"] = (e,)
        for proj in ("attn_q", "attn_k", "attn_v", "attn_out"):
            shapes[f"{b}.{proj}.weight"] = (e, e)
            shapes[f"{b}.{proj}.bias"] = (e,)
        shapes[f"{b}.ffn_up.weight"] = (hp.n_ff, e)
        shapes[f"{b}.ffn_up.bias"] = (hp.n_ff,)
        shapes[f"{b}.ffn_down.weight"] = (e, hp.n_ff)
        shapes[f"{b}.ffn_down.bias"] = (e,)
    shapes["v.post_ln.weight"] = (e,)
    shapes["v.post_ln.bias"] = (e,)
    shapes["mm.soft_emb_norm.weight"] = (e,)
    shapes["mm.input_projection.weight"] = (e, hp.n_embd_out)  # ggml ne [n_embd_out, n_embd]
    return shapes


def _f32(t: TensorInfo) -> np.ndarray:
    """A tensor as float32 (a fresh array; for f32 tensors a copy of the mapped bytes)."""
    return t.dequantize()


def _linear(x: np.ndarray, w: TensorInfo, b: np.ndarray | None) -> np.ndarray:
    """``x @ w.T (+ b)``: x [R, n_in], w [n_out, n_in] -> [R, n_out]."""
    y = x @ _f32(w).T  # [R, n_out]
    if b is not None:
        y += b
    return y


def _layer_norm(x: np.ndarray, w: np.ndarray, b: np.ndarray, eps: float) -> np.ndarray:
    """ggml_norm then the affine: ``(x - mean) / sqrt(var + eps) * w + b`` per row."""
    mean = x.mean(axis=-1, keepdims=True, dtype=np.float64).astype(np.float32)  # [R, 1]
    y = x - mean  # [R, n]
    var = np.mean(np.square(y), axis=-1, keepdims=True, dtype=np.float64).astype(np.float32)
    y *= (np.float32(1.0) / np.sqrt(var + np.float32(eps)))
    y *= w
    y += b
    return y


def _rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """ggml_rms_norm then the weight: ``x / sqrt(mean(x^2) + eps) * w`` per row."""
    ms = np.mean(np.square(x), axis=-1, keepdims=True, dtype=np.float64).astype(np.float32)
    return x * (np.float32(1.0) / np.sqrt(ms + np.float32(eps))) * w


def _gelu_tanh(x: np.ndarray) -> np.ndarray:
    """ggml_gelu's formula (the tanh approximation), in place."""
    c = np.float32(math.sqrt(2.0 / math.pi))
    t = x * x  # [R, n]
    t *= np.float32(0.044715)
    t += np.float32(1.0)
    t *= x
    t *= c
    np.tanh(t, out=t)
    t += np.float32(1.0)
    t *= np.float32(0.5)
    x *= t
    return x


def _silu(x: np.ndarray) -> np.ndarray:
    return x / (np.float32(1.0) + np.exp(-x))


def _gelu_quick(x: np.ndarray) -> np.ndarray:
    return x / (np.float32(1.0) + np.exp(np.float32(-1.702) * x))


ACTIVATIONS: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "gelu": _gelu_tanh, "silu": _silu, "gelu_quick": _gelu_quick,
}


def _attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, n_head: int) -> np.ndarray:
    """Non-causal multi-head attention over all patches: q, k, v [T, n_head * d] ->
    [T, n_head * d]; softmax(q k^T / sqrt(d)) v.

    One head at a time as plain 2-D BLAS matmuls into one reused [T, T] score buffer
    (numpy's stacked matmul was half as fast here, and 16 heads of 4096^2 scores would
    be 1 GiB). The scale is folded into q and the softmax's division into the [T, d]
    output, so the [T, T] scores are swept only by max, subtract, exp and sum.
    """
    t, width = q.shape
    d = width // n_head
    scale = np.float32(1.0 / math.sqrt(d))
    qh = np.ascontiguousarray((q * scale).reshape(t, n_head, d).transpose(1, 0, 2))  # [H, T, d]
    kh = np.ascontiguousarray(k.reshape(t, n_head, d).transpose(1, 0, 2))  # [H, T, d]
    vh = np.ascontiguousarray(v.reshape(t, n_head, d).transpose(1, 0, 2))  # [H, T, d]
    out = np.empty((t, n_head, d), dtype=np.float32)  # [T, H, d]
    s = np.empty((t, t), dtype=np.float32)  # [T, T] scores of one head
    for h in range(n_head):
        np.matmul(qh[h], kh[h].T, out=s)
        s -= s.max(axis=1, keepdims=True)
        np.exp(s, out=s)
        den = s.sum(axis=1, keepdims=True)  # [T, 1]
        o = s @ vh[h]  # [T, d]
        o /= den
        out[:, h, :] = o
    return out.reshape(t, width)


def unfold_patches(pixels: np.ndarray, patch: int) -> np.ndarray:
    """[3, S, S] -> [n_side * n_side, 3 * patch * patch]: one row per patch (row-major
    over the grid), values in the convolution kernel's (channel, ky, kx) order."""
    c, s, _ = pixels.shape
    n = s // patch
    x = pixels.reshape(c, n, patch, n, patch)  # [c, py, ky, px, kx]
    return x.transpose(1, 3, 0, 2, 4).reshape(n * n, c * patch * patch)


def encode(hp: Hparams, tensors: Mapping[str, TensorInfo], pixels: np.ndarray) -> np.ndarray:
    """One preprocessed image [3, S, S] float32 -> [n_tokens, n_embd_out] float32."""
    s = hp.image_size
    pixels = np.asarray(pixels, dtype=np.float32)
    if pixels.shape != (3, s, s):
        raise ValueError(f"pixels must be [3, {s}, {s}] (planar RGB), got {list(pixels.shape)}")
    vec: dict[str, np.ndarray] = {}

    def v(name: str) -> np.ndarray:
        if name not in vec:
            vec[name] = _f32(tensors[name])
        return vec[name]

    e = hp.n_embd
    # patch embedding: the stride-p convolution as a matmul, then bias and positions
    patches = unfold_patches(pixels, hp.patch_size)  # [T, 3 p p]
    w_patch = _f32(tensors["v.patch_embd.weight"]).reshape(e, -1)  # [n_embd, 3 p p]
    x = patches @ w_patch.T  # [T, n_embd]
    del w_patch, patches
    x += v("v.patch_embd.bias")
    x += v("v.position_embd.weight")  # [T, n_embd]
    act = ACTIVATIONS[hp.ffn_op]
    for il in range(hp.n_layer):
        b = f"v.blk.{il}"
        cur = _layer_norm(x, v(f"{b}.ln1.weight"), v(f"{b}.ln1.bias"), hp.eps)  # [T, n_embd]
        q = _linear(cur, tensors[f"{b}.attn_q.weight"], v(f"{b}.attn_q.bias"))  # [T, n_embd]
        k = _linear(cur, tensors[f"{b}.attn_k.weight"], v(f"{b}.attn_k.bias"))  # [T, n_embd]
        val = _linear(cur, tensors[f"{b}.attn_v.weight"], v(f"{b}.attn_v.bias"))  # [T, n_embd]
        del cur
        attn = _attention(q, k, val, hp.n_head)  # [T, n_embd]
        del q, k, val
        x += _linear(attn, tensors[f"{b}.attn_out.weight"], v(f"{b}.attn_out.bias"))
        del attn
        cur = _layer_norm(x, v(f"{b}.ln2.weight"), v(f"{b}.ln2.bias"), hp.eps)  # [T, n_embd]
        up = act(_linear(cur, tensors[f"{b}.ffn_up.weight"], v(f"{b}.ffn_up.bias")))  # [T, n_ff]
        del cur
        x += _linear(up, tensors[f"{b}.ffn_down.weight"], v(f"{b}.ffn_down.bias"))  # [T, n_embd]
        del up
        for name in [n for n in vec if n.startswith(b + ".")]:
            del vec[name]
    x = _layer_norm(x, v("v.post_ln.weight"), v("v.post_ln.bias"), hp.eps)  # [T, n_embd]
    return project(hp, tensors, x)


def project(hp: Hparams, tensors: Mapping[str, TensorInfo], x: np.ndarray) -> np.ndarray:
    """gemma3's projector: [n_patches, n_embd] -> [n_tokens, n_embd_out]."""
    n, m, e = hp.n_side, hp.n_merge, hp.n_embd
    grid = x.reshape(n // m, m, n // m, m, e)  # [Y, ky, X, kx, n_embd]
    pooled = grid.mean(axis=(1, 3), dtype=np.float32).reshape(-1, e)  # [n_tokens, n_embd]
    normed = _rms_norm(pooled, _f32(tensors["mm.soft_emb_norm.weight"]), hp.eps)
    out = normed @ _f32(tensors["mm.input_projection.weight"])  # [n_tokens, n_embd_out]
    return np.ascontiguousarray(out, dtype=np.float32)

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
future work. Everything is float32 and in large BLAS matmuls. ``encode`` blocks for
seconds on a real projector (about 5 TFLOP for gemma-3's 896x896 image), so callers
on trio run it with ``trio.to_thread.run_sync``.

Threads: ``encode`` runs on a pool of its own, as many threads as BLAS has (``-t``
sets that through threadpoolctl; otherwise the library's default, the usable cores),
with BLAS limited to one thread meanwhile, because OpenBLAS runs calls from several
threads one after another on its single pool. Every step is split into independent
pieces: a projection by output columns, a LayerNorm by rows, attention by (head,
block of query rows), whose [rows, n_patches] scores stay in the core's cache from
their matmul through the softmax to the product with V. Before, the softmax's max,
subtract, exp and sum ran single-threaded over a 64 MiB score buffer per head, about
half of a block's time on two cores. The limit is process-wide, so one encode runs
at a time and a numpy text backend's products during it run on one thread.

Weights stay in the file's memory map in their stored type; each worker dequantizes
its rows of a matrix to float32 just before its matmul and drops them after it.
Holding a float32 copy of gemma-3's 400M-parameter tower would take 1.7 GB on top of
the mapped f16 file to save the conversion, a few per cent of an image's time (about
75 ms of one thread a block). The vectors (norms, biases, position embeddings) are
small and converted once.

Cancelling: ``encode`` takes a ``threading.Event``; once it is set, the encode stops at
the next check, before a transformer block and before each worker's next piece of
work (a projection's column slice, an attention task), and raises ``EncodeCancelled``:
the lock and the cores are free again within one piece of work, not after the whole
image (seconds a block for gemma-3's tower on a few cores). The server sets it when the
request is cancelled (``server.media.run_sync_cancellable``). An encode still waiting
for its turn leaves the wait as the event is set, when it is a ``cancel.CancelEvent``
(the server's is): the lock is a ``cancel.TurnLock``, not a ``threading.Lock`` whose
wait nothing interrupts.

The results match the single-threaded form within float32 rounding (a product's
columns computed apart can round differently in BLAS's last bits).

Where llama.cpp's own numbers differ (by rounding, not by formula): its CPU matmuls
round activations to f16 for f16 weights (and to q8_0 for q8_0 weights), its
``ggml_gelu`` reads a float16 table, and its flash-attention path (the default where
the backend has it) stores K and V as f16. This module computes all of it in float32.
"""

from __future__ import annotations

import math
import os
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Literal, TypeVar

import attrs
import numpy as np
from threadpoolctl import threadpool_info, threadpool_limits

from trio_llm.model.gguf import TensorInfo
from trio_llm.model.quant import dequantize
from trio_llm.vision.cancel import TurnLock
from trio_llm.vision.cancel import check as _check

FfnOp = Literal["gelu", "silu", "gelu_quick"]

#: one encode at a time: each takes every core, and the BLAS limit it sets is
#: process-wide; a waiter whose CancelEvent is set leaves at once
_ENCODE_LOCK = TurnLock()


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


def _f32_rows(w: TensorInfo, r0: int, r1: int) -> np.ndarray:
    """Rows ``r0:r1`` of a matrix [n_out, n_in] as float32 (every type stores whole
    rows: a row is whole blocks)."""
    n_out, n_in = w.shape
    raw = w.raw.reshape(n_out, -1)[r0:r1]  # [r1 - r0, row_bytes]
    return dequantize(raw, w.ggml_type, (r1 - r0, n_in))


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
    """x * sigmoid(x), in place."""
    t = np.negative(x)  # [R, n]
    np.exp(t, out=t)
    t += np.float32(1.0)
    x /= t
    return x


def _gelu_quick(x: np.ndarray) -> np.ndarray:
    """x * sigmoid(1.702 x), in place."""
    t = np.multiply(x, np.float32(-1.702))  # [R, n]
    np.exp(t, out=t)
    t += np.float32(1.0)
    x /= t
    return x


ACTIVATIONS: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "gelu": _gelu_tanh, "silu": _silu, "gelu_quick": _gelu_quick,
}

#: query rows per attention task: a [rows, n_patches] score block stays in a core's
#: cache between its matmul, softmax and product with V (4 MiB at 4096 patches)
ATTN_ROWS = 256
#: column slices per worker of a projection (slack for a core slowed by other work)
SLICES_PER_WORKER = 2
#: slices are multiples of this many columns (whole BLAS micro-tiles)
SLICE_ALIGN = 64

_Item = TypeVar("_Item")


@attrs.frozen
class _Workers:
    """The encoder's threads: ``n`` workers that take items from a shared list, each
    running single-threaded numpy and BLAS (the caller has limited BLAS to one thread;
    OpenBLAS serialises calls from several threads onto its one pool otherwise)."""

    n: int
    pool: ThreadPoolExecutor | None  # None: run inline (one worker)
    cancel: threading.Event | None = None  # set: stop before the next item (EncodeCancelled)

    def each(self, items: Sequence[_Item], make: Callable[[], Callable[[_Item], None]]) -> None:
        """Call a worker's ``make()`` once, then its result on items taken in order
        from ``items`` until none are left; return when all are done (the first
        exception is re-raised after every worker has stopped). Every worker checks
        ``cancel`` before each item it takes."""
        if self.pool is None or len(items) <= 1:
            fn = make()
            for item in items:
                _check(self.cancel)
                fn(item)
            return
        shared = iter(items)  # list iterators hand out each item once across threads

        def drain() -> None:
            fn = make()
            for item in shared:
                _check(self.cancel)
                fn(item)

        futures = [self.pool.submit(drain) for _ in range(min(self.n, len(items)))]
        wait(futures)
        for f in futures:
            f.result()

    def slices(self, n_cols: int) -> list[tuple[int, int]]:
        """[c0, c1) column ranges splitting ``n_cols`` for the workers."""
        n = max(1, min(self.n * SLICES_PER_WORKER, n_cols // SLICE_ALIGN))
        step = -(-n_cols // n)
        step = -(-step // SLICE_ALIGN) * SLICE_ALIGN
        return [(c0, min(c0 + step, n_cols)) for c0 in range(0, n_cols, step)]


def _linear(
    workers: _Workers, x: np.ndarray, w: TensorInfo, b: np.ndarray | None, *,
    then: Callable[[np.ndarray], object] | None = None, into: np.ndarray | None = None,
) -> np.ndarray:
    """``x @ w.T (+ b)``: x [R, n_in], w [n_out, n_in] -> [R, n_out].

    Split by output columns: each worker dequantizes only its rows of ``w`` (so the
    conversion runs on every core and a matrix is never whole in float32) and computes
    its columns, then applies ``then`` to them in place (the activation, or q's scale)
    while they are fresh; with ``into``, adds them to ``into[:, cols]`` (the residual)
    instead of returning a new array."""
    n_out = w.shape[0]
    y = np.empty((x.shape[0], n_out), dtype=np.float32)  # [R, n_out]

    def make() -> Callable[[tuple[int, int]], None]:
        def run(cols: tuple[int, int]) -> None:
            c0, c1 = cols
            yc = y[:, c0:c1]  # [R, c]
            np.matmul(x, _f32_rows(w, c0, c1).T, out=yc)
            if b is not None:
                yc += b[c0:c1]
            if then is not None:
                then(yc)
            if into is not None:
                into[:, c0:c1] += yc
        return run

    workers.each(workers.slices(n_out), make)
    return into if into is not None else y


def _layer_norm_rows(workers: _Workers, x: np.ndarray, w: np.ndarray, b: np.ndarray, eps: float) -> np.ndarray:
    """``_layer_norm`` over row blocks on the workers."""
    y = np.empty_like(x)  # [R, n]
    rows = x.shape[0]
    step = max(1, -(-rows // (workers.n * SLICES_PER_WORKER)))

    def make() -> Callable[[int], None]:
        def run(r0: int) -> None:
            y[r0:r0 + step] = _layer_norm(x[r0:r0 + step], w, b, eps)
        return run

    workers.each(range(0, rows, step), make)
    return y


def _attention(workers: _Workers, q: np.ndarray, k: np.ndarray, v: np.ndarray, n_head: int) -> np.ndarray:
    """Non-causal multi-head attention over all patches: q (already scaled by
    ``1/sqrt(d)``), k, v [T, n_head * d] -> [T, n_head * d]; softmax(q k^T) v.

    A task is one head's ``ATTN_ROWS`` query rows: their [rows, T] scores by one BLAS
    matmul into the worker's buffer, then max, subtract, exp and sum while the block
    is in cache, then its product with V; the softmax's division is folded into the
    [rows, d] output. Heads are column slices of q, k, v (BLAS takes the row stride),
    so nothing is transposed. (One head at a time over all T rows, each op with its
    own sweep of a 64 MiB score buffer, was memory bound and single threaded outside
    the matmuls.)
    """
    t, width = q.shape
    d = width // n_head
    out = np.empty((t, width), dtype=np.float32)  # [T, H d]
    rows = min(ATTN_ROWS, t)

    def make() -> Callable[[tuple[int, int]], None]:
        scores = np.empty((rows, t), dtype=np.float32)  # [rows, T] of one head
        mx = np.empty((rows, 1), dtype=np.float32)
        den = np.empty((rows, 1), dtype=np.float32)

        def run(task: tuple[int, int]) -> None:
            h, r0 = task
            r1 = min(r0 + rows, t)
            n, hs = r1 - r0, slice(h * d, (h + 1) * d)
            s = scores[:n]  # [n, T]
            np.matmul(q[r0:r1, hs], k[:, hs].T, out=s)
            np.max(s, axis=1, keepdims=True, out=mx[:n])
            s -= mx[:n]
            np.exp(s, out=s)
            np.sum(s, axis=1, keepdims=True, out=den[:n])
            o = s @ v[:, hs]  # [n, d]
            np.divide(o, den[:n], out=out[r0:r1, hs])
        return run

    workers.each([(h, r0) for h in range(n_head) for r0 in range(0, t, rows)], make)
    return out


def unfold_patches(pixels: np.ndarray, patch: int) -> np.ndarray:
    """[3, S, S] -> [n_side * n_side, 3 * patch * patch]: one row per patch (row-major
    over the grid), values in the convolution kernel's (channel, ky, kx) order."""
    c, s, _ = pixels.shape
    n = s // patch
    x = pixels.reshape(c, n, patch, n, patch)  # [c, py, ky, px, kx]
    return x.transpose(1, 3, 0, 2, 4).reshape(n * n, c * patch * patch)


def encode(hp: Hparams, tensors: Mapping[str, TensorInfo], pixels: np.ndarray, *,
           cancel: threading.Event | None = None) -> np.ndarray:
    """One preprocessed image [3, S, S] float32 -> [n_tokens, n_embd_out] float32.

    Runs on ``encoder_threads()`` threads of its own, with BLAS limited to one thread
    meanwhile (process-wide: a numpy text backend's products at the same time run on one
    thread too); encodes in several threads take turns. Once ``cancel`` is set it stops
    within one piece of work and raises ``EncodeCancelled``, its threads ended and the
    lock released; one set while waiting for its turn raises having encoded nothing: at
    once for a ``CancelEvent``, as the turn comes for a plain ``threading.Event``."""
    s = hp.image_size
    pixels = np.asarray(pixels, dtype=np.float32)
    if pixels.shape != (3, s, s):
        raise ValueError(f"pixels must be [3, {s}, {s}] (planar RGB), got {list(pixels.shape)}")
    with _ENCODE_LOCK.hold(cancel):  # raises if given up while another image was encoded
        n = encoder_threads()
        if n == 1:
            return _encode(_Workers(1, None, cancel), hp, tensors, pixels)
        with threadpool_limits(limits=1, user_api="blas"), ThreadPoolExecutor(n, "siglip") as pool:
            return _encode(_Workers(n, pool, cancel), hp, tensors, pixels)


def encoder_threads() -> int:
    """The encoder's thread count: BLAS's (what ``-t`` set through threadpoolctl, else
    the library's default, about the usable cores), at most the usable cores."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    blas = [int(i["num_threads"]) for i in threadpool_info() if i.get("user_api") == "blas"]
    return max(1, min(max(blas, default=cores), cores))


def _encode(workers: _Workers, hp: Hparams, tensors: Mapping[str, TensorInfo], pixels: np.ndarray) -> np.ndarray:
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
    scale = np.float32(1.0 / math.sqrt(hp.head_dim))

    def scale_q(y: np.ndarray) -> None:
        y *= scale

    for il in range(hp.n_layer):
        _check(workers.cancel)
        b = f"v.blk.{il}"
        cur = _layer_norm_rows(workers, x, v(f"{b}.ln1.weight"), v(f"{b}.ln1.bias"), hp.eps)  # [T, n_embd]
        q = _linear(workers, cur, tensors[f"{b}.attn_q.weight"], v(f"{b}.attn_q.bias"), then=scale_q)  # [T, n_embd]
        k = _linear(workers, cur, tensors[f"{b}.attn_k.weight"], v(f"{b}.attn_k.bias"))  # [T, n_embd]
        val = _linear(workers, cur, tensors[f"{b}.attn_v.weight"], v(f"{b}.attn_v.bias"))  # [T, n_embd]
        del cur
        attn = _attention(workers, q, k, val, hp.n_head)  # [T, n_embd]
        del q, k, val
        _linear(workers, attn, tensors[f"{b}.attn_out.weight"], v(f"{b}.attn_out.bias"), into=x)  # x += [T, n_embd]
        del attn
        cur = _layer_norm_rows(workers, x, v(f"{b}.ln2.weight"), v(f"{b}.ln2.bias"), hp.eps)  # [T, n_embd]
        up = _linear(workers, cur, tensors[f"{b}.ffn_up.weight"], v(f"{b}.ffn_up.bias"), then=act)  # [T, n_ff]
        del cur
        _linear(workers, up, tensors[f"{b}.ffn_down.weight"], v(f"{b}.ffn_down.bias"), into=x)  # x += [T, n_embd]
        del up
        for name in [n for n in vec if n.startswith(b + ".")]:
            del vec[name]
    _check(workers.cancel)
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

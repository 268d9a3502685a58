"""The numpy reference backend: the ground truth every other backend is tested against.

All weights are dequantized to float32 once, at load; the forward pass is the plain
transformer of llama/qwen2/qwen3 written for clarity, but vectorised: the tokens of
all batch entries go through each projection as one matrix product, and only the
attention runs per entry (each entry has its own KV cache and positions).

There is no device, so ``memory()`` reports the host arrays as if they were device
memory, and residency is real in the one way that matters to the server's logic:
``release(ALL)`` moves the KV cache out to a host dict and ``release(UNLOAD)`` drops
the weights, which ``restore()`` then reloads from the GGUF file.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import attrs
import numpy as np

from trio_llm.engine.backend import MEMORY_CATEGORIES, Level, Progress, SeqBatch, check_batch
from trio_llm.errors import BackendError, InvalidRequest, ModelLoadError
from trio_llm.model.config import ModelConfig
from trio_llm.model.gguf import GGUFModel, expected_shapes, load_gguf

#: how deep each level releases, so a deeper release after a shallower one escalates
_DEPTH = {Level.WEIGHTS: 1, Level.ALL: 2, Level.UNLOAD: 3}


@attrs.define(eq=False)
class LayerWeights:
    attn_norm: np.ndarray  # [n_embd]
    wq: np.ndarray  # [q_dim, n_embd]
    wk: np.ndarray  # [kv_dim, n_embd]
    wv: np.ndarray  # [kv_dim, n_embd]
    wo: np.ndarray  # [n_embd, q_dim]
    ffn_norm: np.ndarray  # [n_embd]
    w_gate: np.ndarray  # [n_ff, n_embd]
    w_up: np.ndarray  # [n_ff, n_embd]
    w_down: np.ndarray  # [n_embd, n_ff]
    bq: np.ndarray | None = None  # [q_dim] (qwen2)
    bk: np.ndarray | None = None  # [kv_dim] (qwen2)
    bv: np.ndarray | None = None  # [kv_dim] (qwen2)
    q_norm: np.ndarray | None = None  # [head_dim] (qwen3)
    k_norm: np.ndarray | None = None  # [head_dim] (qwen3)


@attrs.define(eq=False)
class Weights:
    token_embd: np.ndarray  # [n_vocab, n_embd]
    output_norm: np.ndarray  # [n_embd]
    output: np.ndarray  # [n_vocab, n_embd]; the same array as token_embd when tied
    layers: list[LayerWeights]
    # llama-3 style RoPE scaling stored in the file: one divisor per frequency
    rope_freq_factors: np.ndarray | None  # [head_dim // 2]

    def nbytes(self) -> int:
        arrays: dict[int, np.ndarray] = {}
        for a in (self.token_embd, self.output_norm, self.output, self.rope_freq_factors):
            if a is not None:
                arrays[id(a)] = a
        for layer in self.layers:
            for a in attrs.astuple(layer, recurse=False):
                if a is not None:
                    arrays[id(a)] = a
        return sum(a.nbytes for a in arrays.values())


def load_weights(model: GGUFModel, progress: Progress | None = None) -> Weights:
    """Dequantize every tensor the forward pass uses to float32."""
    cfg = model.config
    # exactly the tensors read below, so that progress ends at (total, total)
    total = sum(model.tensor(n).n_bytes for n in expected_shapes(cfg))
    done = 0

    def get(name: str) -> np.ndarray:
        nonlocal done
        info = model.tensor(name)
        arr = np.ascontiguousarray(info.dequantize(), dtype=np.float32)
        done += info.n_bytes
        if progress is not None:
            progress(done, total)
        return arr

    def opt(name: str) -> np.ndarray | None:
        return get(name) if name in model.tensors else None

    layers = []
    for i in range(cfg.n_layer):
        b = f"blk.{i}."
        layers.append(
            LayerWeights(
                attn_norm=get(b + "attn_norm.weight"),
                wq=get(b + "attn_q.weight"),
                wk=get(b + "attn_k.weight"),
                wv=get(b + "attn_v.weight"),
                wo=get(b + "attn_output.weight"),
                ffn_norm=get(b + "ffn_norm.weight"),
                w_gate=get(b + "ffn_gate.weight"),
                w_up=get(b + "ffn_up.weight"),
                w_down=get(b + "ffn_down.weight"),
                bq=opt(b + "attn_q.bias") if cfg.attn_bias else None,
                bk=opt(b + "attn_k.bias") if cfg.attn_bias else None,
                bv=opt(b + "attn_v.bias") if cfg.attn_bias else None,
                q_norm=opt(b + "attn_q_norm.weight") if cfg.qk_norm else None,
                k_norm=opt(b + "attn_k_norm.weight") if cfg.qk_norm else None,
            )
        )
    token_embd = get("token_embd.weight")
    output_norm = get("output_norm.weight")
    output = token_embd if cfg.tied_embeddings else get("output.weight")
    factors = None
    if "rope_freqs.weight" in model.tensors:
        factors = model.tensor("rope_freqs.weight").dequantize().astype(np.float32).reshape(-1)
        if factors.shape != (cfg.head_dim // 2,):
            raise ModelLoadError(
                model.path,
                f"tensor 'rope_freqs.weight' has {factors.shape[0]} values, expected {cfg.head_dim // 2}",
            )
    return Weights(token_embd, output_norm, output, layers, factors)


def rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """RMSNorm over the last axis, scaled by ``w`` (same length as that axis)."""
    ms = np.mean(np.square(x), axis=-1, keepdims=True)  # [..., 1]
    return (x / np.sqrt(ms + eps)) * w  # type: ignore[no-any-return]  # [..., d]


def silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))  # type: ignore[no-any-return]


def rope_tables(
    cfg: ModelConfig, n_pos: int, freq_factors: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin of every (position, frequency) pair, computed in float64."""
    half = cfg.head_dim // 2
    inv_freq = cfg.rope_theta ** (-np.arange(half, dtype=np.float64) * 2.0 / cfg.head_dim)  # [half]
    if freq_factors is not None:
        inv_freq = inv_freq / freq_factors.astype(np.float64)  # [half]
    angles = np.arange(n_pos, dtype=np.float64)[:, None] * inv_freq[None, :]  # [n_pos, half]
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


def apply_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, mode: str) -> np.ndarray:
    """Rotate each head of ``x`` [n, heads, head_dim] by its token's angles
    (``cos``/``sin`` [n, head_dim // 2]).

    "normal" pairs adjacent values (x[2i], x[2i+1]): llama GGUFs store Q/K rows
    permuted for exactly this. "neox" pairs the halves (x[i], x[i + d/2]).
    """
    c = cos[:, None, :]  # [n, 1, half]
    s = sin[:, None, :]  # [n, 1, half]
    out = np.empty_like(x)  # [n, heads, head_dim]
    if mode == "normal":
        x0, x1 = x[..., 0::2], x[..., 1::2]  # [n, heads, half] each
        out[..., 0::2] = x0 * c - x1 * s
        out[..., 1::2] = x0 * s + x1 * c
    else:
        half = x.shape[-1] // 2
        x0, x1 = x[..., :half], x[..., half:]  # [n, heads, half] each
        out[..., :half] = x0 * c - x1 * s
        out[..., half:] = x0 * s + x1 * c
    return out


#: most attention scores held at once (64 MiB of float32): long prompts are processed
#: in blocks of query rows so an 8k-token prefill does not need gigabytes of scores
ATTN_BLOCK_SCORES = 1 << 24


def attend(q: np.ndarray, k: np.ndarray, v: np.ndarray, pos0: int) -> np.ndarray:
    """Causal grouped-query attention of one sequence.

    ``q`` [n, n_head, hd] are the queries of positions pos0..pos0+n-1; ``k``/``v``
    [T, n_head_kv, hd] the cache of positions 0..T-1 (T = pos0 + n). Query head h
    reads KV head h // (n_head / n_head_kv), llama.cpp's and transformers' grouping.
    """
    n, n_head, hd = q.shape
    t = k.shape[0]
    rows = max(1, ATTN_BLOCK_SCORES // (n_head * t))
    if n <= rows:
        return _attend_block(q, k, v, pos0)
    out = np.empty_like(q)  # [n, n_head, hd]
    for a in range(0, n, rows):
        b = min(n, a + rows)
        # a block only sees the cache up to its own last position
        out[a:b] = _attend_block(q[a:b], k[: pos0 + b], v[: pos0 + b], pos0 + a)
    return out


def _attend_block(q: np.ndarray, k: np.ndarray, v: np.ndarray, pos0: int) -> np.ndarray:
    n, n_head, hd = q.shape
    t, n_kv, _ = k.shape
    n_gqa = n_head // n_kv
    qg = q.reshape(n, n_kv, n_gqa, hd).transpose(1, 2, 0, 3)  # [n_kv, n_gqa, n, hd]
    kt = k.transpose(1, 2, 0)[:, None]  # [n_kv, 1, hd, T]
    vt = v.transpose(1, 0, 2)[:, None]  # [n_kv, 1, T, hd]
    scores = np.matmul(qg, kt) * np.float32(1.0 / np.sqrt(hd))  # [n_kv, n_gqa, n, T]
    q_pos = pos0 + np.arange(n)[:, None]  # [n, 1]
    future = np.arange(t)[None, :] > q_pos  # [n, T]
    scores = np.where(future, np.float32(-np.inf), scores)  # [n_kv, n_gqa, n, T]
    scores = scores - scores.max(axis=-1, keepdims=True)
    p = np.exp(scores)  # [n_kv, n_gqa, n, T]
    p /= p.sum(axis=-1, keepdims=True)
    out = np.matmul(p, vt)  # [n_kv, n_gqa, n, hd]
    return out.transpose(2, 0, 1, 3).reshape(n, n_head, hd)  # type: ignore[no-any-return]


@attrs.define(eq=False, init=False)
class NumpyBackend:
    """``trio_llm.engine.backend.Backend`` in numpy, float32 throughout."""

    name: str = attrs.field(init=False, default="numpy")
    config: ModelConfig = attrs.field(init=False)
    n_ctx: int = attrs.field(init=False)
    n_seq: int = attrs.field(init=False)
    _path: Path = attrs.field(init=False)
    _progress: Progress | None = attrs.field(init=False)
    _weights: Weights | None = attrs.field(init=False, default=None)
    _k: np.ndarray | None = attrs.field(init=False, default=None)
    _v: np.ndarray | None = attrs.field(init=False, default=None)
    _host_kv: dict[str, np.ndarray] = attrs.field(init=False, factory=dict)
    _cos: np.ndarray = attrs.field(init=False)
    _sin: np.ndarray = attrs.field(init=False)
    _level: Level | None = attrs.field(init=False, default=None)  # None: resident
    _closed: bool = attrs.field(init=False, default=False)

    def __init__(
        self, model: GGUFModel, *, n_ctx: int, n_seq: int, progress: Progress | None = None
    ) -> None:
        self.__attrs_init__()
        if n_ctx < 1 or n_seq < 1:
            raise InvalidRequest(f"n_ctx and n_seq must be positive, got {n_ctx} and {n_seq}")
        self.config = model.config
        self.n_ctx = n_ctx
        self.n_seq = n_seq
        self._path = Path(model.path)
        self._progress = progress
        self._weights = load_weights(model, progress)
        self._cos, self._sin = rope_tables(self.config, n_ctx, self._weights.rope_freq_factors)
        self._k, self._v = self._new_kv()

    # -- the Backend interface -------------------------------------------------------

    def forward(self, batch: Sequence[SeqBatch]) -> np.ndarray:
        entries = list(batch)
        x = self._run(entries)  # [N, n_embd]
        last = np.cumsum([len(e.tokens) for e in entries]) - 1  # [B]
        return self._head(x[last])  # [B, n_vocab]

    def forward_all_logits(self, tokens: Sequence[int] | np.ndarray, seq_id: int = 0,
                           pos0: int = 0) -> np.ndarray:
        """The logits of every token of one sequence, ``[n, n_vocab]`` (for tests)."""
        entry = SeqBatch(seq_id=seq_id, tokens=np.asarray(tokens, dtype=np.int32), pos0=pos0)
        return self._head(self._run([entry]))  # [n, n_vocab]

    def memory(self) -> dict[str, int]:
        mem = dict.fromkeys(MEMORY_CATEGORIES, 0)
        if self._weights is not None and self._level is None:
            mem["weights"] = self._weights.nbytes()
        if self._k is not None and self._v is not None:
            mem["kv_cache"] = self._k.nbytes + self._v.nbytes
        return mem

    def host_memory(self) -> dict[str, int]:
        """Bytes that a release moved to the host shadow, by category."""
        mem = dict.fromkeys(MEMORY_CATEGORIES, 0)
        if self._weights is not None and self._level is not None:
            mem["weights"] = self._weights.nbytes()
        mem["kv_cache"] = sum(a.nbytes for a in self._host_kv.values())
        return mem

    def device_info(self) -> dict[str, object]:
        return {
            "name": "numpy reference (CPU)",
            "type": "cpu",
            "backend": self.name,
            "numpy": np.__version__,
            "dtype": "float32",
        }

    def release(self, level: Level) -> None:
        self._check_open()
        depth = _DEPTH[Level(level)]
        if self._level is not None and _DEPTH[self._level] >= depth:
            return  # already released at least this much
        if depth >= _DEPTH[Level.ALL] and self._k is not None and self._v is not None:
            # The "copy to host" of a device backend; numpy already lives on the host,
            # so handing the arrays over is that copy, and the "device" side is freed.
            self._host_kv = {"k": self._k, "v": self._v}
            self._k = self._v = None
        if depth >= _DEPTH[Level.UNLOAD]:
            self._weights = None
            self._host_kv = {}
        self._level = Level(level)

    def restore(self) -> None:
        self._check_open()
        if self._level is None:
            return
        if self._weights is None:
            self._weights = self._reload()
        if self._k is None or self._v is None:
            if self._host_kv:
                self._k, self._v = self._host_kv["k"], self._host_kv["v"]
                self._host_kv = {}
            else:
                self._k, self._v = self._new_kv()
        self._level = None

    def close(self) -> None:
        self._weights = None
        self._k = self._v = None
        self._host_kv = {}
        self._closed = True

    @property
    def level(self) -> Level | None:
        """The level of the last release still in effect; None while resident."""
        return self._level

    # -- internals -----------------------------------------------------------------

    def read_kv(self, seq_id: int, n: int) -> np.ndarray:
        if self._k is None or self._v is None:
            raise BackendError("read_kv while released; restore first")
        kv = np.stack([self._k[seq_id, :, :n], self._v[seq_id, :, :n]], axis=1)  # [L, 2, n, n_kv, hd]
        cfg = self.config
        return kv.reshape(cfg.n_layer, 2, n, cfg.n_head_kv * cfg.head_dim)  # [n_layer, 2, n, kv_dim]

    def write_kv(self, seq_id: int, kv: np.ndarray) -> None:
        if self._k is None or self._v is None:
            raise BackendError("write_kv while released; restore first")
        cfg = self.config
        n = kv.shape[2]
        kv = kv.reshape(cfg.n_layer, 2, n, cfg.n_head_kv, cfg.head_dim)
        self._k[seq_id, :, :n] = kv[:, 0]
        self._v[seq_id, :, :n] = kv[:, 1]

    def _new_kv(self) -> tuple[np.ndarray, np.ndarray]:
        cfg = self.config
        shape = (self.n_seq, cfg.n_layer, self.n_ctx, cfg.n_head_kv, cfg.head_dim)
        # [n_seq, n_layer, n_ctx, n_head_kv, head_dim] each; zeros pages in lazily
        return np.zeros(shape, np.float32), np.zeros(shape, np.float32)

    def _reload(self) -> Weights:
        model = load_gguf(self._path)
        try:
            if model.config != self.config:
                raise ModelLoadError(self._path, "the file changed since it was loaded")
            return load_weights(model, self._progress)
        finally:
            model.close()

    def _check_open(self) -> None:
        if self._closed:
            raise BackendError("the numpy backend is closed")

    def _check_batch(self, entries: list[SeqBatch]) -> None:
        self._check_open()
        if self._level is not None:
            raise BackendError(f"forward while released (level {self._level.value}); restore first")
        check_batch(entries, n_seq=self.n_seq, n_ctx=self.n_ctx, n_vocab=self.config.n_vocab)

    def _run(self, entries: list[SeqBatch]) -> np.ndarray:
        """All layers over every token of ``entries``; returns the normed final hidden
        state of every token, ``[N, n_embd]``, and writes each entry's KV cache."""
        self._check_batch(entries)
        w, k_cache, v_cache = self._weights, self._k, self._v
        assert w is not None and k_cache is not None and v_cache is not None
        cfg = self.config
        eps = cfg.rms_eps
        tokens = np.concatenate([np.asarray(e.tokens, dtype=np.int64) for e in entries])  # [N]
        pos = np.concatenate([e.pos0 + np.arange(len(e.tokens)) for e in entries])  # [N]
        bounds = np.cumsum([0] + [len(e.tokens) for e in entries])  # [B + 1]
        n_tok = tokens.shape[0]
        cos, sin = self._cos[pos], self._sin[pos]  # [N, half] each

        x = w.token_embd[tokens]  # [N, n_embd]
        for il, lw in enumerate(w.layers):
            h = rms_norm(x, lw.attn_norm, eps)  # [N, n_embd]
            q = h @ lw.wq.T  # [N, q_dim]
            k = h @ lw.wk.T  # [N, kv_dim]
            v = h @ lw.wv.T  # [N, kv_dim]
            if lw.bq is not None and lw.bk is not None and lw.bv is not None:
                q += lw.bq
                k += lw.bk
                v += lw.bv
            q = q.reshape(n_tok, cfg.n_head, cfg.head_dim)  # [N, n_head, hd]
            k = k.reshape(n_tok, cfg.n_head_kv, cfg.head_dim)  # [N, n_head_kv, hd]
            v = v.reshape(n_tok, cfg.n_head_kv, cfg.head_dim)  # [N, n_head_kv, hd]
            if lw.q_norm is not None and lw.k_norm is not None:
                q = rms_norm(q, lw.q_norm, eps)  # [N, n_head, hd]
                k = rms_norm(k, lw.k_norm, eps)  # [N, n_head_kv, hd]
            q = apply_rope(q, cos, sin, cfg.rope_mode)  # [N, n_head, hd]
            k = apply_rope(k, cos, sin, cfg.rope_mode)  # [N, n_head_kv, hd]

            attn = np.empty_like(q)  # [N, n_head, hd]
            for i, e in enumerate(entries):
                a, b = bounds[i], bounds[i + 1]
                end = e.pos0 + (b - a)
                k_cache[e.seq_id, il, e.pos0 : end] = k[a:b]
                v_cache[e.seq_id, il, e.pos0 : end] = v[a:b]
                attn[a:b] = attend(
                    q[a:b], k_cache[e.seq_id, il, :end], v_cache[e.seq_id, il, :end], e.pos0
                )  # [n, n_head, hd]
            x = x + attn.reshape(n_tok, cfg.q_dim) @ lw.wo.T  # [N, n_embd]

            h = rms_norm(x, lw.ffn_norm, eps)  # [N, n_embd]
            gate = h @ lw.w_gate.T  # [N, n_ff]
            up = h @ lw.w_up.T  # [N, n_ff]
            x = x + (silu(gate) * up) @ lw.w_down.T  # [N, n_embd]
        return rms_norm(x, w.output_norm, eps)  # [N, n_embd]

    def _head(self, h: np.ndarray) -> np.ndarray:
        assert self._weights is not None
        return np.ascontiguousarray(h @ self._weights.output.T, dtype=np.float32)  # [n, n_vocab]

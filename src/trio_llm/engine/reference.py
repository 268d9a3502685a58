"""The numpy reference backend: the ground truth every other backend is tested against.

All weights are dequantized to float32 once, at load. The forward pass is the
architecture's graph (``trio_llm.models``, the same graph the Vulkan backend lowers),
interpreted one node at a time with one plain numpy function per op, vectorised: the
tokens of all batch entries go through each projection as one matrix product, and only
attention runs per entry (each entry has its own cache and positions; each layer's
cache is laid out by its memory kind, ``engine/memory.py``).

There is no device, so ``memory()`` reports the host arrays as if they were device
memory, and residency is real in the one way that matters to the server's logic:
``release(ALL)`` moves the KV cache out to a host list and ``release(UNLOAD)`` drops
the weights, which ``restore()`` then reloads from the GGUF file.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs
import numpy as np

from trio_llm.engine.backend import (
    MEMORY_CATEGORIES,
    Level,
    Progress,
    SeqBatch,
    check_batch,
    check_noncausal,
    check_uniform_kv,
)
from trio_llm.engine.devsample import DeviceChain, check_decode, decode_steps
from trio_llm.engine.kvshift import Move, can_shift, k_ropes, rope_factors, shift_k
from trio_llm.engine.memory import (
    LayerMemory,
    plan_memory,
    plan_recurrent,
    reusable_prefix,
    state_layout,
)
from trio_llm.errors import BackendError, GraphError, InvalidRequest, ModelLoadError
from trio_llm.graph import Graph, Node, Output, Tensor, rope_divisors
from trio_llm.model.config import ModelConfig
from trio_llm.model.gguf import GGUFModel, TensorInfo, load_gguf
from trio_llm.model.kvtypes import DEFAULT_KV_TYPE, hadamard, kv_type, rotation_blocks, roundtrip
from trio_llm.model.quant import dequantize, tensor_bytes
from trio_llm.models import build_graph

log = logging.getLogger(__name__)

#: most tokens of one sequence per interpretation of the graph (a sliding-window
#: layer's cache holds this many beyond its window)
DEFAULT_CHUNK = 512

#: the type llama.cpp's CPU flash attention converts q to before its dot products with
#: a K cache of each type (``vec_dot_type``; q8_1 stores the values q8_0 does)
Q_TYPE_FOR_K = {"f32": "f32", "f16": "f16", "bf16": "bf16", "q8_0": "q8_0", "q4_0": "q8_0", "q5_0": "q8_0",
                "q4_1": "q8_0", "q5_1": "q8_0"}

#: how deep each level releases, so a deeper release after a shallower one escalates
_DEPTH = {Level.WEIGHTS: 1, Level.ALL: 2, Level.UNLOAD: 3}


def rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """RMSNorm over the last axis, scaled by ``w`` (same length as that axis)."""
    ms = np.mean(np.square(x), axis=-1, keepdims=True)  # [..., 1]
    return (x / np.sqrt(ms + eps)) * w  # type: ignore[no-any-return]  # [..., d]


def silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))  # type: ignore[no-any-return]


def sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))  # type: ignore[no-any-return]


def rope_tables(
    cfg: ModelConfig, n_pos: int, freq_factors: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin of every (position, frequency) pair of ``cfg``'s global RoPE."""
    return rope_angles(cfg.head_dim, cfg.rope_theta, n_pos, freq_factors)


def rope_angles(
    head_dim: int, theta: float, n_pos: int, freq_factors: np.ndarray | None = None,
    freq_scale: float = 1.0,
) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin ``[n_pos, head_dim // 2]``, computed in float64: the angle of
    frequency i at position p is ``p * freq_scale * theta^(-2i/d) / factor_i``."""
    half = head_dim // 2
    inv_freq = theta ** (-np.arange(half, dtype=np.float64) * 2.0 / head_dim)  # [half]
    if freq_factors is not None:
        inv_freq = inv_freq / freq_factors.astype(np.float64)  # [half]
    angles = np.arange(n_pos, dtype=np.float64)[:, None] * (freq_scale * inv_freq[None, :])  # [n_pos, half]
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


def gelu(x: np.ndarray) -> np.ndarray:
    """gelu's tanh form, as ggml's ``ggml_gelu``."""
    c = np.float32(np.sqrt(2.0 / np.pi))
    return 0.5 * x * (1.0 + np.tanh(c * (x + np.float32(0.044715) * x * x * x)))  # type: ignore[no-any-return]


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


def attend(q: np.ndarray, k: np.ndarray, v: np.ndarray, pos0: int, window: int = 0,
           k_pos: np.ndarray | None = None, scale: float | None = None, causal: bool = True,
           symmetric: bool = False) -> np.ndarray:
    """Causal grouped-query attention of one sequence.

    ``q`` [n, n_head, hd] are the queries of positions pos0..pos0+n-1; ``k``/``v``
    [T, n_head_kv, hd] the keys of positions ``k_pos`` [T] (default 0..T-1, T = pos0 + n).
    Query head h reads KV head h // (n_head / n_head_kv), llama.cpp's and transformers'
    grouping. ``window`` > 0 hides keys ``window`` or more positions back.
    ``causal=False``: every query also sees the keys after it, up to pos0 + n - 1
    (llama.cpp's mask with causal attention off; the window still hides only keys
    before the query, unless ``symmetric``: then also keys ``window`` or more after it).
    """
    n, n_head, hd = q.shape
    t = k.shape[0]
    kp = np.arange(t) if k_pos is None else k_pos  # [T]
    s = np.float32(1.0 / np.sqrt(hd) if scale is None else scale)
    rows = max(1, ATTN_BLOCK_SCORES // (n_head * t))
    out = np.empty_like(q)  # [n, n_head, hd]
    for a in range(0, n, rows):
        b = min(n, a + rows)
        q_pos = pos0 + a + np.arange(b - a)
        q_hi = q_pos if causal else np.full(b - a, pos0 + n - 1)
        if symmetric and window:
            q_hi = np.minimum(q_hi, q_pos + window - 1)
        out[a:b] = _attend_block(q[a:b], k, v, q_pos, q_hi, kp, window, s)
    return out


def _attend_block(q: np.ndarray, k: np.ndarray, v: np.ndarray, q_pos: np.ndarray, q_hi: np.ndarray,
                  k_pos: np.ndarray, window: int, scale: np.float32) -> np.ndarray:
    n, n_head, hd = q.shape
    t, n_kv, _ = k.shape
    n_gqa = n_head // n_kv
    qg = q.reshape(n, n_kv, n_gqa, hd).transpose(1, 2, 0, 3)  # [n_kv, n_gqa, n, hd]
    kt = k.transpose(1, 2, 0)[:, None]  # [n_kv, 1, hd, T]
    vt = v.transpose(1, 0, 2)[:, None]  # [n_kv, 1, T, hd]
    scores = np.matmul(qg, kt) * scale  # [n_kv, n_gqa, n, T]
    hidden = k_pos[None, :] > q_hi[:, None]  # [n, T] past the highest position the row sees
    if window:
        hidden |= q_pos[:, None] - k_pos[None, :] >= window
    scores = np.where(hidden, np.float32(-np.inf), scores)  # [n_kv, n_gqa, n, T]
    scores = scores - scores.max(axis=-1, keepdims=True)
    p = np.exp(scores)  # [n_kv, n_gqa, n, T]
    p /= p.sum(axis=-1, keepdims=True)
    out = np.matmul(p, vt)  # [n_kv, n_gqa, n, hd]
    return out.transpose(2, 0, 1, 3).reshape(n, n_head, hd)  # type: ignore[no-any-return]


@attrs.define(eq=False)
class Step:
    """What one interpretation of the graph runs over: the batch, flattened."""

    entries: list[SeqBatch]
    tokens: np.ndarray  # [N] int64
    pos: np.ndarray  # [N] positions
    bounds: np.ndarray  # [B + 1] where each entry's tokens start
    out_rows: np.ndarray  # [O] rows whose logits are wanted
    #: (first row, [n, n_embd] rows) of the entries carrying embeddings
    embd: list[tuple[int, np.ndarray]] = attrs.field(factory=list)


#: float32 bytes of dequantized experts kept between forward passes (least recently
#: used go first): a 30B-A3B model's experts would be 120 GB as float32, so they are
#: dequantized one expert at a time, when a token is routed to it
EXPERT_CACHE_BYTES = 1 << 29


@attrs.define(eq=False)
class Experts:
    """A 3-D expert tensor ``[n_expert, n_out, n_in]`` left quantized in the file's
    memory map; ``get(e)`` dequantizes one expert's matrix (cached, shared budget)."""

    name: str
    info: TensorInfo
    cache: OrderedDict[tuple[str, int], np.ndarray]

    @property
    def n_bytes(self) -> int:
        return self.info.n_bytes

    def get(self, e: int) -> np.ndarray:
        key = (self.name, e)
        m = self.cache.get(key)
        if m is not None:
            self.cache.move_to_end(key)
            return m
        shape = self.info.shape[1:]
        per = tensor_bytes(self.info.ggml_type, shape)
        raw = self.info.raw[e * per : (e + 1) * per]
        m = np.ascontiguousarray(dequantize(raw, self.info.ggml_type, shape), dtype=np.float32)  # [n_out, n_in]
        self.cache[key] = m
        while sum(a.nbytes for a in self.cache.values()) > EXPERT_CACHE_BYTES and len(self.cache) > 1:
            self.cache.popitem(last=False)
        return m


def load_experts(model: GGUFModel, names: Sequence[str]) -> dict[str, Experts]:
    """The 3-D expert tensors among ``names``, left quantized (see ``Experts``)."""
    cache: OrderedDict[tuple[str, int], np.ndarray] = OrderedDict()
    return {n: Experts(n, model.tensor(n), cache) for n in names if len(model.tensor(n).shape) == 3}


def load_weights(model: GGUFModel, names: Sequence[str], progress: Progress | None = None) -> dict[str, np.ndarray]:
    """Dequantize the tensors ``names`` to float32, in file shape (3-D expert tensors
    stay quantized: ``load_experts``)."""
    names = [n for n in names if len(model.tensor(n).shape) != 3]
    total = sum(model.tensor(n).n_bytes for n in names)
    done = 0
    out: dict[str, np.ndarray] = {}
    for name in names:
        info = model.tensor(name)
        out[name] = np.ascontiguousarray(info.dequantize(), dtype=np.float32)
        done += info.n_bytes
        if progress is not None:
            progress(done, total)
    return out


@attrs.define(eq=False, init=False)
class NumpyBackend:
    """``trio_llm.engine.backend.Backend`` in numpy, float32 throughout: it interprets
    the architecture's graph (``trio_llm.models``) one node at a time."""

    name: str = attrs.field(init=False, default="numpy")
    config: ModelConfig = attrs.field(init=False)
    n_ctx: int = attrs.field(init=False)
    n_seq: int = attrs.field(init=False)
    graph: Graph = attrs.field(init=False)
    layers: list[LayerMemory] = attrs.field(init=False)
    _chunk: int = attrs.field(init=False)
    _path: Path = attrs.field(init=False)
    _overrides: dict[str, Any] = attrs.field(init=False, factory=dict)
    _progress: Progress | None = attrs.field(init=False)
    _weights: dict[str, np.ndarray] | None = attrs.field(init=False, default=None)
    _experts: dict[str, Experts] = attrs.field(init=False, factory=dict)
    recurrent: list[LayerMemory] = attrs.field(init=False, factory=list)
    # recurrent state (gated delta-net layers) by node id: a conv node's last inputs
    # [n_seq, d_conv - 1, C], a delta rule's matrices [n_seq, n_v, d, d]; and how many
    # positions each sequence's state has absorbed
    _rs: dict[int, np.ndarray] | None = attrs.field(init=False, default=None)
    _host_rs: dict[int, np.ndarray] | None = attrs.field(init=False, default=None)
    _rs_pos: np.ndarray = attrs.field(init=False, factory=lambda: np.zeros(0, np.int64))
    _weight_bytes: int = attrs.field(init=False, default=0)
    _kv: list[tuple[np.ndarray, np.ndarray]] | None = attrs.field(init=False, default=None)
    _host_kv: list[tuple[np.ndarray, np.ndarray]] | None = attrs.field(init=False, default=None)
    _mem: dict[int, LayerMemory] = attrs.field(init=False, factory=dict)
    _embd_width: int = attrs.field(init=False, default=0)  # the graph's embd_rows width (0: none)
    _tables: dict[int, tuple[np.ndarray, np.ndarray]] = attrs.field(init=False, factory=dict)
    _level: Level | None = attrs.field(init=False, default=None)  # None: resident
    _closed: bool = attrs.field(init=False, default=False)
    #: (K, V) cache types: the cache holds exactly the values a cache of these types
    #: holds in llama.cpp (``kvtypes.roundtrip``), kept as float32 arrays
    cache_types: tuple[str, str] = attrs.field(init=False, default=("f32", "f32"))

    def __init__(
        self, model: GGUFModel, *, n_ctx: int, n_seq: int, progress: Progress | None = None,
        max_chunk: int = DEFAULT_CHUNK, cache_type_k: str = DEFAULT_KV_TYPE,
        cache_type_v: str = DEFAULT_KV_TYPE, output: Output = "logits",
    ) -> None:
        self.__attrs_init__()
        if n_ctx < 1 or n_seq < 1:
            raise InvalidRequest(f"n_ctx and n_seq must be positive, got {n_ctx} and {n_seq}")
        if max_chunk < 1:
            raise InvalidRequest(f"max_chunk must be positive, got {max_chunk}")
        self.config = model.config
        self.n_ctx = n_ctx
        self.n_seq = n_seq
        self._chunk = max_chunk
        try:
            self.cache_types = (kv_type(cache_type_k).name, kv_type(cache_type_v).name)
        except ValueError as exc:
            raise InvalidRequest(str(exc)) from None
        for what, t in zip("KV", self.cache_types, strict=True):
            for hd in sorted({self.config.layer_head_dim(il) for il in range(self.config.n_layer)}):
                if hd % kv_type(t).block:
                    raise InvalidRequest(f"a {t} {what} cache needs head_dim a multiple of {kv_type(t).block}, "
                                         f"not {hd}")
        self._path = Path(model.path)
        self._overrides = dict(model.overrides)
        self._progress = progress
        try:
            self.graph = build_graph(self.config, {n: t.shape for n, t in model.tensors.items()}, output)
        except GraphError as exc:
            raise ModelLoadError(model.path, str(exc)) from None
        self.layers = plan_memory(self.graph, n_ctx=n_ctx, chunk=max_chunk)
        self._mem = {m.layer: m for m in self.layers}
        self._embd_width = self.graph.embd_width()  # read once: every forward checks against it
        self._weights = load_weights(model, list(self.graph.weights), progress)
        self._experts = load_experts(model, list(self.graph.weights))
        self._weight_bytes = sum(a.nbytes for a in self._weights.values()) + sum(
            x.n_bytes for x in self._experts.values())
        self._kv = self._new_kv()
        log.info("numpy: KV cache %s/%s: %d bytes per token, %d MiB", *self.cache_types,
                 self.kv_bytes_per_token(), self.kv_bytes() >> 20)
        self.recurrent = plan_recurrent(self.graph)
        self._rs = self._new_rs()

    # -- the Backend interface -------------------------------------------------------

    def forward(self, batch: Sequence[SeqBatch]) -> np.ndarray:
        entries = list(batch)
        self._check_batch(entries)
        assert self.graph.logits is not None
        logits = np.empty((len(entries), self.graph.logits.width), np.float32)  # [B, n_vocab] (or the head's width)
        # entries longer than a chunk run as several passes (a sliding-window cache
        # holds one chunk beyond its window); the last piece of each gives its logits
        done = [0] * len(entries)
        while True:
            part = [(i, e, done[i]) for i, e in enumerate(entries) if done[i] < len(e.tokens)]
            if not part:
                return logits
            pieces = [_piece(e, d, self._chunk) for _, e, d in part]
            ends = np.cumsum([len(p.tokens) for p in pieces]) - 1  # [B'] each piece's last row
            last = [k for k, (i, e, d) in enumerate(part) if d + len(pieces[k].tokens) == len(e.tokens)]
            if last:
                out = self._run(pieces, ends[last])
                for row, k in enumerate(last):
                    logits[part[k][0]] = out[row]
            else:
                self._run(pieces, ends[:0])
            for k, (i, _, d) in enumerate(part):
                done[i] = d + len(pieces[k].tokens)

    def forward_rows(self, entry: SeqBatch) -> np.ndarray:
        """The graph's result for every token of one sequence (``Backend.forward_rows``)."""
        return self._all_rows(entry)

    @property
    def decode_steps_max(self) -> int:
        """Steps one ``decode`` may run: several only where every layer's memory lets
        the positions past a stop be overwritten later (a full KV cache); none for an
        embedding graph (nothing to sample)."""
        assert self.graph.logits is not None
        if self.graph.logits.width != self.config.n_vocab:
            return 0
        return 16 if all(m.kind == "kv" and not m.window for m in self.layers) and not self.recurrent else 1

    def decode(self, batch: Sequence[SeqBatch], chains: Sequence[DeviceChain], us: np.ndarray,
               ahead: np.ndarray | None = None) -> np.ndarray:
        """``Backend.decode`` by the host chain: the reference the device equals
        (``ahead`` is only a hint of the next call: nothing runs ahead here)."""
        check_decode(batch, chains, us, self.n_ctx)
        if us.shape[0] > self.decode_steps_max:
            raise InvalidRequest(f"this model decodes at most {self.decode_steps_max} steps per call")
        return decode_steps(self.forward, batch, chains, us)

    def forward_all_logits(self, tokens: Sequence[int] | np.ndarray, seq_id: int = 0,
                           pos0: int = 0) -> np.ndarray:
        """The logits of every token of one sequence, ``[n, n_vocab]`` (for tests)."""
        return self._all_rows(SeqBatch(seq_id=seq_id, tokens=np.asarray(tokens, dtype=np.int32), pos0=pos0))

    def _all_rows(self, entry: SeqBatch) -> np.ndarray:
        self._check_batch([entry])
        out = []
        for d in range(0, len(entry.tokens), self._chunk):
            piece = _piece(entry, d, self._chunk)
            out.append(self._run([piece], np.arange(len(piece.tokens))))
        return np.concatenate(out)  # [n, n_vocab]

    def memory(self) -> dict[str, int]:
        """The KV cache counts what its types would take on a device (the arrays here
        are float32 whatever the type)."""
        mem = dict.fromkeys(MEMORY_CATEGORIES, 0)
        if self._weights is not None and self._level is None:
            mem["weights"] = self._weight_bytes
        if self._kv is not None:
            mem["kv_cache"] = self.kv_bytes()
        if self._rs is not None:
            mem["kv_cache"] += sum(a.nbytes for a in self._rs.values())
        return mem

    def kv_bytes(self) -> int:
        kt, vt = (kv_type(t) for t in self.cache_types)
        return sum(self.n_seq * m.rows * (kt.row_bytes(m.kv_dim) + (0 if m.v_is_k else vt.row_bytes(m.kv_dim)))
                   for m in self.layers)

    def host_memory(self) -> dict[str, int]:
        """Bytes that a release moved to the host shadow, by category."""
        mem = dict.fromkeys(MEMORY_CATEGORIES, 0)
        if self._weights is not None and self._level is not None:
            mem["weights"] = self._weight_bytes
        if self._host_kv is not None:
            mem["kv_cache"] = self.kv_bytes()
        if self._host_rs is not None:
            mem["kv_cache"] += sum(a.nbytes for a in self._host_rs.values())
        return mem

    def device_info(self) -> dict[str, object]:
        return {
            "name": "numpy reference (CPU)",
            "type": "cpu",
            "backend": self.name,
            "numpy": np.__version__,
            "dtype": "float32",
            "max_chunk": self._chunk,
            "cache_type_k": self.cache_types[0],
            "cache_type_v": self.cache_types[1],
            "kv_bytes_per_token": self.kv_bytes_per_token(),
            "kv_bytes": self.kv_bytes(),
        }

    def kv_bytes_per_token(self) -> int:
        kt, vt = (kv_type(t) for t in self.cache_types)
        return sum(kt.row_bytes(m.kv_dim) + (0 if m.v_is_k else vt.row_bytes(m.kv_dim)) for m in self.layers)

    def reusable_prefix(self, n_cached: int, n_common: int, checkpoints: Sequence[int] = ()) -> int:
        return reusable_prefix(self.layers + self.recurrent, n_cached, n_common, checkpoints)

    def release(self, level: Level) -> None:
        self._check_open()
        depth = _DEPTH[Level(level)]
        if self._level is not None and _DEPTH[self._level] >= depth:
            return  # already released at least this much
        if depth >= _DEPTH[Level.ALL] and self._kv is not None:
            # The "copy to host" of a device backend; numpy already lives on the host,
            # so handing the arrays over is that copy, and the "device" side is freed.
            self._host_kv, self._kv = self._kv, None
            self._host_rs, self._rs = self._rs, None
        if depth >= _DEPTH[Level.UNLOAD]:
            self._weights = None
            self._experts = {}
            self._host_kv = None
            self._host_rs = None
        self._level = Level(level)

    def restore(self) -> None:
        self._check_open()
        if self._level is None:
            return
        if self._weights is None:
            self._weights = self._reload()
        if self._kv is None:
            self._kv = self._host_kv if self._host_kv is not None else self._new_kv()
            self._host_kv = None
        if self._rs is None:
            self._rs = self._host_rs if self._host_rs is not None else self._new_rs()
            self._host_rs = None
        self._level = None

    def close(self) -> None:
        self._weights = None
        self._experts = {}
        self._kv = self._host_kv = None
        self._rs = self._host_rs = None
        self._closed = True

    @property
    def level(self) -> Level | None:
        """The level of the last release still in effect; None while resident."""
        return self._level

    def read_kv(self, seq_id: int, n: int) -> np.ndarray:
        """Positions a layer's cache no longer holds (a sliding window's past) read as 0."""
        if self._kv is None:
            raise BackendError("read_kv while released; restore first")
        check_uniform_kv(self.config)
        out = np.zeros((self.config.n_layer, self.config.kv_parts, n, self.config.kv_dim),
                       np.float32)  # [L, kv_parts, n, kv_dim]
        for m, (k, v) in zip(self.layers, self._kv, strict=True):
            pos = np.arange(max(0, n - m.rows), n)
            out[m.layer, 0, pos] = k[seq_id, pos % m.rows].reshape(len(pos), m.kv_dim)
            if not m.v_is_k:  # a latent cache is K alone
                out[m.layer, 1, pos] = v[seq_id, pos % m.rows].reshape(len(pos), m.kv_dim)
        return out

    @property
    def can_shift(self) -> bool:
        """KV shifting (``--cache-reuse``): every layer a full positional KV cache."""
        return can_shift(self.layers, self.recurrent)

    def shift_kv(self, seq_id: int, moves: Sequence[Move]) -> None:
        """The cache holds each type's float values (Hadamard-rotated for a quantized
        K): K is roped by the delta and stored as its type again, V copied as is."""
        if self._kv is None or self._weights is None:
            raise BackendError("shift_kv while released; restore first")
        if not self.can_shift:
            raise BackendError("this model's memory cannot shift (a sliding window or a recurrent state)")
        ropes = k_ropes(self.graph)
        factors = rope_factors(self.graph, self._weights)
        kt = self.cache_types[0]
        kb, _ = rotation_blocks(*self.cache_types, self.config.head_dim)
        for mv in moves:
            for m, (k, v) in zip(self.layers, self._kv, strict=True):
                rope = ropes[m.layer]
                src = k[seq_id, mv.src : mv.src + mv.n].reshape(mv.n, -1)  # [n, kv_dim]
                shifted = shift_k(src, mv.dst - mv.src, rope, factors.get(rope.out.id) if rope else None, kb)
                k[seq_id, mv.dst : mv.dst + mv.n] = roundtrip(shifted, kt).reshape(mv.n, *k.shape[2:])
                v[seq_id, mv.dst : mv.dst + mv.n] = v[seq_id, mv.src : mv.src + mv.n].copy()

    def write_kv(self, seq_id: int, kv: np.ndarray) -> None:
        if self._kv is None:
            raise BackendError("write_kv while released; restore first")
        check_uniform_kv(self.config)
        n = kv.shape[2]
        for m, (k, v) in zip(self.layers, self._kv, strict=True):
            pos = np.arange(max(0, n - m.rows), n)
            k[seq_id, pos % m.rows] = kv[m.layer, 0, pos].reshape(len(pos), *k.shape[2:])
            if not m.v_is_k:  # a latent cache's V is its K, written above
                v[seq_id, pos % m.rows] = kv[m.layer, 1, pos].reshape(len(pos), *v.shape[2:])

    # -- internals -----------------------------------------------------------------

    def read_state(self, seq_id: int, raw: bool = False) -> np.ndarray:
        """``raw`` is the same layout here."""
        if self._rs is None:
            raise BackendError("read_state while released; restore first")
        parts = [self._rs[i][seq_id].reshape(-1) for i, _ in state_layout(self.graph)]
        return np.concatenate(parts) if parts else np.zeros(0, np.float32)

    def write_state(self, seq_id: int, state: np.ndarray, n_pos: int, raw: bool = False) -> None:
        if self._rs is None:
            raise BackendError("write_state while released; restore first")
        layout = state_layout(self.graph)
        total = sum(int(np.prod(shape)) for _, shape in layout)
        if state.size != total:
            raise BackendError(f"a recurrent state of {state.size} values; this model's has {total}")
        at = 0
        for i, shape in layout:
            n = int(np.prod(shape))
            self._rs[i][seq_id] = state[at : at + n].reshape(shape)
            at += n
        self._rs_pos[seq_id] = n_pos

    def _new_rs(self) -> dict[int, np.ndarray]:
        """Zero recurrent state for every sequence (a fresh one also forgets positions)."""
        self._rs_pos = np.zeros(self.n_seq, np.int64)
        out: dict[int, np.ndarray] = {}
        for nodes in self.graph.recurrent_layers().values():
            for n in nodes:
                if n.op == "ssm_conv":
                    shape: tuple[int, ...] = (self.n_seq, n.attr("d_conv") - 1, n.out.width)
                else:
                    d = n.attr("head_dim")
                    shape = (self.n_seq, n.attr("n_v_heads"), d, d)
                out[n.out.id] = np.zeros(shape, np.float32)
        return out

    def _enter_state(self, entries: list[SeqBatch]) -> None:
        """A recurrent state continues only where it stopped; position 0 starts afresh."""
        assert self._rs is not None
        for e in entries:
            if e.pos0 == 0:
                for a in self._rs.values():
                    a[e.seq_id] = 0.0
            elif self._rs_pos[e.seq_id] != e.pos0:
                raise BackendError(f"sequence {e.seq_id}'s recurrent state holds {self._rs_pos[e.seq_id]} "
                                   f"positions; it cannot continue at {e.pos0}")

    def _new_kv(self) -> list[tuple[np.ndarray, np.ndarray]]:
        out = []
        for m in self.layers:
            node = self.graph.attention_layers()[m.layer]
            shape = (self.n_seq, m.rows, node.attr("n_head_kv"), node.attr("head_dim"))
            # [n_seq, rows, n_head_kv, head_dim] each; zeros pages in lazily; a latent
            # cache's V is its K (one array)
            k = np.zeros(shape, np.float32)
            out.append((k, k if m.v_is_k else np.zeros(shape, np.float32)))
        return out

    def _reload(self) -> dict[str, np.ndarray]:
        model = load_gguf(self._path, self._overrides)
        try:
            if model.config != self.config:
                raise ModelLoadError(self._path, "the file changed since it was loaded")
            self._experts = load_experts(model, list(self.graph.weights))
            return load_weights(model, list(self.graph.weights), self._progress)
        finally:
            model.close()

    def _check_open(self) -> None:
        if self._closed:
            raise BackendError("the numpy backend is closed")

    def _check_batch(self, entries: list[SeqBatch]) -> None:
        self._check_open()
        if self._level is not None:
            raise BackendError(f"forward while released (level {self._level.value}); restore first")
        check_batch(entries, n_seq=self.n_seq, n_ctx=self.n_ctx, n_vocab=self.config.n_vocab,
                    n_embd=self._embd_width)
        if not all(e.causal for e in entries):
            refuse = ("this model's memory (recurrent state) has no non-causal form" if self.recurrent
                      else "this model's attention (a latent cache) has no non-causal form"
                      if any(m.v_is_k for m in self.layers) else "")
            check_noncausal(entries, max_rows=self._chunk, refuse=refuse)

    def _rope(self, node: Node, factors: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
        tables = self._tables.get(node.out.id)
        if tables is None:
            dim = node.attrs.get("n_rot", node.attr("head_dim"))  # partial RoPE: frequencies over n_rot
            if "yarn" in node.attrs:  # YaRN's per-frequency blend of the scaled positions
                tables = rope_angles(dim, node.attr("theta"), self.n_ctx, rope_divisors(node, factors))
            else:
                tables = rope_angles(dim, node.attr("theta"), self.n_ctx, factors, node.attr("freq_scale"))
            self._tables[node.out.id] = tables
        return tables

    def _run(self, entries: list[SeqBatch], out_rows: np.ndarray) -> np.ndarray:
        """Interpret the graph over every token of ``entries`` (each within one chunk)
        and return the logits of the rows ``out_rows``, ``[O, n_vocab]``; writes each
        entry's KV cache."""
        w, kv = self._weights, self._kv
        assert w is not None and kv is not None
        step = Step(
            entries=entries,
            tokens=np.concatenate([np.asarray(e.tokens, dtype=np.int64) for e in entries]),
            pos=np.concatenate([e.pos0 + np.arange(len(e.tokens)) for e in entries]),
            bounds=np.cumsum([0] + [len(e.tokens) for e in entries]),
            out_rows=np.asarray(out_rows, dtype=np.int64),
        )
        for i, e in enumerate(entries):
            if e.embd is not None:
                step.embd.append((int(step.bounds[i]), e.embd))
        env: dict[int, np.ndarray] = {}
        if self.recurrent:
            self._enter_state(entries)

        def val(t: Tensor) -> Any:
            if t.kind == "weight":
                return w[t.name] if len(t.shape) != 3 else self._experts[t.name]
            if t.kind == "input":
                return step.tokens
            return env[t.id]

        for node in self.graph.nodes:
            env[node.out.id] = self._op(node, [val(t) for t in node.inputs], step)
        for e in entries:
            self._rs_pos[e.seq_id] = e.pos0 + len(e.tokens)
        assert self.graph.logits is not None
        return np.ascontiguousarray(env[self.graph.logits.id], dtype=np.float32)

    def _op(self, node: Node, args: list[Any], step: Step) -> np.ndarray:
        op = node.op
        if op.startswith("moe_"):
            return _moe_op(node, args)
        if op == "get_rows":
            return args[0][args[1]]  # [N, n_embd]
        if op == "linear":
            return args[0] @ args[1].T  # type: ignore[no-any-return]  # [R, n_out]
        if op == "add":
            return args[0] + args[1]  # type: ignore[no-any-return]
        if op == "scale":
            return args[0] * np.float32(node.attr("scale"))  # type: ignore[no-any-return]
        if op == "rms_norm":
            x = args[0]
            g = args[1] if len(args) == 2 else np.ones(node.attr("group"), np.float32)
            n = node.attr("group")
            return rms_norm(x.reshape(x.shape[0], x.shape[1] // n, n), g, node.attr("eps")).reshape(x.shape)
        if op == "mul":
            return args[0] * args[1][0]  # type: ignore[no-any-return]
        if op == "softcap":
            cap = np.float32(node.attr("cap"))
            return np.tanh(args[0] / cap) * cap  # type: ignore[no-any-return]
        if op == "rope":
            x = args[0]
            cos, sin = self._rope(node, args[1] if len(args) > 1 else None)
            nh, hd = node.attr("n_heads"), node.attr("head_dim")
            nr = node.attrs.get("n_rot", hd)
            y = x.reshape(len(x), nh, hd).copy()
            y[..., :nr] = apply_rope(y[..., :nr], cos[step.pos], sin[step.pos], node.attr("mode"))
            return y.reshape(x.shape)
        if op == "glu":
            gate, up = args
            kind = node.attr("act")
            act = silu(gate) if kind == "silu" else gelu(gate) if kind == "gelu" else sigmoid(gate)
            return act * up  # type: ignore[no-any-return]
        if op == "take":
            x = args[0]
            grp, start, n = node.attr("group"), node.attr("start"), node.attr("n")
            g = x.shape[1] // grp  # groups per row (explicit: a chunk may have no output rows)
            return np.ascontiguousarray(x.reshape(len(x), g, grp)[:, :, start : start + n]).reshape(len(x), g * n)
        if op == "l2_norm":
            x = args[0]
            xg = x.reshape(len(x), x.shape[1] // node.attr("group"), node.attr("group"))
            norm_ = np.sqrt(np.sum(np.square(xg, dtype=np.float64), axis=-1, keepdims=True)).astype(np.float32)
            return (xg / np.maximum(norm_, np.float32(node.attr("eps")))).reshape(x.shape)  # type: ignore[no-any-return]
        if op == "head_linear":
            x, w_ = args  # [R, n_head * n_in], [n_head, n_out, n_in] (kept quantized, as experts)
            nh, n_out, n_in = (int(d) for d in node.inputs[1].shape)
            mats = np.stack([w_.get(h) for h in range(nh)])  # [n_head, n_out, n_in]
            y = np.einsum("rhi,hoi->rho", x.reshape(len(x), nh, n_in), mats)  # [R, n_head, n_out]
            return np.ascontiguousarray(y, dtype=np.float32).reshape(len(x), nh * n_out)
        if op == "concat":
            a, b = args
            grp = node.attr("groups")
            out = np.concatenate([a.reshape(len(a), grp, -1), b.reshape(len(b), grp, -1)], axis=2)
            return out.reshape(len(a), -1)
        if op == "gate_rows":
            x, h, w_ = args
            return x * sigmoid(h @ w_)[:, None]  # type: ignore[no-any-return]
        if op == "ssm_conv":
            return self._ssm_conv(node, args[0], args[1], step)
        if op == "delta_net":
            return self._delta_net(node, *args, step=step)
        if op == "outputs":
            return args[0][step.out_rows]
        if op == "embd_rows":
            if not step.embd:
                return args[0]  # type: ignore[no-any-return]
            x = args[0].copy()  # [N, n_embd]
            for a, rows in step.embd:
                x[a : a + len(rows)] = rows
            return x
        if op == "attention":
            return self._attention(node, *args, step=step)
        raise GraphError(f"{node.out.name}: the numpy backend has no op {op!r}")

    def _ssm_conv(self, node: Node, x: np.ndarray, w: np.ndarray, step: Step) -> np.ndarray:
        """Per sequence: its conv state then this step's inputs, each output the
        ``d_conv`` taps ending at its token (ggml_ssm_conv), then SiLU; the state keeps
        the last ``d_conv - 1`` inputs."""
        assert self._rs is not None
        state = self._rs[node.out.id]  # [n_seq, K - 1, C]
        k = node.attr("d_conv")
        out = np.empty_like(x)  # [N, C]
        for i, e in enumerate(step.entries):
            a, b = step.bounds[i], step.bounds[i + 1]
            inp = np.concatenate([state[e.seq_id], x[a:b]])  # [K - 1 + n, C]
            acc = np.zeros((b - a, x.shape[1]), np.float32)
            for j in range(k):
                acc += inp[j : j + b - a] * w[:, j]
            out[a:b] = acc
            state[e.seq_id] = inp[len(inp) - (k - 1) :]
        return silu(out)

    def _delta_net(self, node: Node, q: np.ndarray, k: np.ndarray, v: np.ndarray, alpha: np.ndarray,
                   beta: np.ndarray, dt: np.ndarray, a: np.ndarray, *, step: Step) -> np.ndarray:
        """The gated delta rule token by token (``Graph.delta_net``), all heads at once.
        The state S[h] is [d (key), d (value)]."""
        assert self._rs is not None
        state = self._rs[node.out.id]  # [n_seq, n_v, d, d]
        nk, nv, d = node.attr("n_k_heads"), node.attr("n_v_heads"), node.attr("head_dim")
        n = len(q)
        # v head h reads k head h % n_k (ggml_repeat tiles the k heads), or with k_grouped
        # h // (n_v / n_k): qwen3next's v heads sit by their k head
        kh = np.arange(nv) // (nv // nk) if node.attr("k_grouped") else np.arange(nv) % nk
        qs = (q.reshape(n, nk, d) * np.float32(1.0 / np.sqrt(d)))[:, kh]  # [N, n_v, d]
        ks = k.reshape(n, nk, d)[:, kh]  # [N, n_v, d]
        vs = v.reshape(n, nv, d)
        glog = (np.logaddexp(np.float32(0), alpha + dt) * a).astype(np.float32)  # [N, n_v] log decays
        decay = np.exp(glog)  # [N, n_v]
        b_ = sigmoid(beta)  # [N, n_v]
        out = np.empty((n, nv, d), np.float32)
        for i, e in enumerate(step.entries):
            s = state[e.seq_id]  # [n_v, d, d] (a view: updated in place)
            a_, b1 = int(step.bounds[i]), int(step.bounds[i + 1])
            if b1 - a_ > 1:  # prefill: the chunked form, DELTA_CHUNK tokens at a time
                for c0 in range(a_, b1, DELTA_CHUNK):
                    c1 = min(b1, c0 + DELTA_CHUNK)
                    out[c0:c1] = _delta_chunk(s, qs[c0:c1], ks[c0:c1], vs[c0:c1], glog[c0:c1], b_[c0:c1])
                continue
            for t in range(a_, b1):  # decode: the recurrence itself
                s *= decay[t][:, None, None]
                kv = np.einsum("hij,hi->hj", s, ks[t])  # [n_v, d]
                delta = (vs[t] - kv) * b_[t][:, None]  # [n_v, d]
                s += ks[t][:, :, None] * delta[:, None, :]
                out[t] = np.einsum("hij,hi->hj", s, qs[t])
        return out.reshape(n, nv * d)

    def _attention(self, node: Node, q: np.ndarray, k: np.ndarray | None = None, v: np.ndarray | None = None, *,
                   step: Step) -> np.ndarray:
        assert self._kv is not None
        m = self._mem[node.attrs.get("kv_layer", node.layer)]  # a shared-KV layer reads an earlier one's
        k_cache, v_cache = self._kv[self.layers.index(m)]
        nh, nkv, hd = node.attr("n_head"), node.attr("n_head_kv"), node.attr("head_dim")
        window = node.attr("window")
        n_tok = len(q)
        # llama.cpp's rotation of quantized caches (none for a latent cache, whose V is K)
        kb, vb = (0, 0) if m.v_is_k else rotation_blocks(*self.cache_types, hd)
        store = k is not None and v is not None
        if kb:
            q = hadamard(q, kb)
        if kb and k is not None:
            k = hadamard(k, kb)
        if vb and v is not None:
            v = hadamard(v, vb)
        # llama.cpp's flash attention converts q to the K cache's dot-product type first
        q = roundtrip(q, Q_TYPE_FOR_K[self.cache_types[0]]).reshape(n_tok, nh, hd)  # [N, n_head, hd]
        out = np.empty_like(q)  # [N, n_head, hd]
        for i, e in enumerate(step.entries):
            a, b = step.bounds[i], step.bounds[i + 1]
            end = e.pos0 + (b - a)
            rows = np.arange(e.pos0, end) % m.rows
            kt, vt = self.cache_types
            if store:
                assert k is not None and v is not None
                k_cache[e.seq_id, rows] = roundtrip(k[a:b], kt).reshape(b - a, nkv, hd)
                if not m.v_is_k:
                    v_cache[e.seq_id, rows] = roundtrip(v[a:b], vt).reshape(b - a, nkv, hd)
            lo = max(0, e.pos0 - window + 1) if window else 0
            lo = max(lo, end - m.rows)  # what the ring still holds
            kp = np.arange(lo, end)  # [T] key positions
            out[a:b] = attend(q[a:b], k_cache[e.seq_id, kp % m.rows], v_cache[e.seq_id, kp % m.rows],
                              e.pos0, window, kp, node.attr("scale"), e.causal,
                              bool(node.attrs.get("symmetric")))  # [n, n_head, hd]
        out = out.reshape(n_tok, nh * hd)
        return hadamard(out, vb) if vb else out


def _piece(e: SeqBatch, d: int, chunk: int) -> SeqBatch:
    """The rows ``[d, d + chunk)`` of an entry, as an entry (its embeddings with them)."""
    if d == 0 and len(e.tokens) <= chunk:
        return e
    embd = None if e.embd is None else e.embd[d : d + chunk]
    return attrs.evolve(e, tokens=e.tokens[d : d + chunk], pos0=e.pos0 + d, embd=embd)


#: tokens per chunk of the delta rule's prefill form (llama.cpp's chunk size)
DELTA_CHUNK = 64


def _delta_chunk(s: np.ndarray, q: np.ndarray, k: np.ndarray, v: np.ndarray, g: np.ndarray,
                 beta: np.ndarray) -> np.ndarray:
    """The gated delta rule over a chunk of C tokens at once, all heads batched (the
    chunked form llama.cpp's prefill and fla's ``chunk_gated_delta_rule`` use): with G
    the cumulative log decay, T = (I - A)^-1 for the strictly lower A = -(beta k k^T)
    exp(G_i - G_j) (solved row by row), the chunk's corrected values are
    ``T beta v - T beta k exp(G) S``, its outputs the decayed read of the state plus the
    causal in-chunk attention over them, and the state moves on by the chunk's decay.
    Equal to the token-by-token recurrence up to rounding (tested). ``s`` [n_v, d, d]
    is updated in place; q (already scaled), k, v [C, n_v, d], g and beta [C, n_v]."""
    c = len(q)
    qh, kh, vh = (np.ascontiguousarray(x.transpose(1, 0, 2), dtype=np.float64) for x in (q, k, v))  # [n_v, C, d]
    gc = np.cumsum(g.T.astype(np.float64), axis=1)  # [n_v, C]
    bh = beta.T.astype(np.float64)[:, :, None]  # [n_v, C, 1]
    low = np.tril(np.ones((c, c), bool))
    diff = np.where(low, gc[:, :, None] - gc[:, None, :], -np.inf)  # [n_v, C, C], i >= j
    dm = np.exp(diff)
    kb = kh * bh
    a = np.tril(-(kb @ kh.transpose(0, 2, 1)) * dm, -1)  # [n_v, C, C] strictly lower
    for i in range(1, c):
        a[:, i, :i] += np.einsum("hj,hjm->hm", a[:, i, :i], a[:, :i, :i])
    t = a + np.eye(c)
    s64 = s.astype(np.float64)
    vnew = t @ (vh * bh) - (t @ (kb * np.exp(gc)[:, :, None])) @ s64  # [n_v, C, d]
    o = (qh * np.exp(gc)[:, :, None]) @ s64 + ((qh @ kh.transpose(0, 2, 1)) * dm) @ vnew
    last = gc[:, -1]
    s[:] = s64 * np.exp(last)[:, None, None] + (kh * np.exp(last[:, None] - gc)[:, :, None]).transpose(0, 2, 1) @ vnew
    return o.transpose(1, 0, 2).astype(np.float32)  # type: ignore[no-any-return]  # [C, n_v, d]


def _moe_op(node: Node, args: list[Any]) -> np.ndarray:
    """The mixture-of-experts ops (``Graph.moe_topk`` / ``moe_linear`` / ``moe_combine``)."""
    op = node.op
    if op == "moe_topk":
        logits = args[0]  # [N, n_expert]
        k = node.attr("k")
        if node.attr("gating") == "sigmoid":
            p = sigmoid(logits)  # [N, n_expert]
        else:
            z = logits - logits.max(axis=1, keepdims=True)
            p = np.exp(z)
            p /= p.sum(axis=1, keepdims=True)  # [N, n_expert] softmax gating
        sel = p + args[1] if len(args) > 1 else p  # a selection bias picks, the weights stay unbiased
        ids = np.argsort(-sel, axis=1, kind="stable")[:, :k]  # [N, k] best first
        wts = np.take_along_axis(p, ids, axis=1)  # [N, k]
        if node.attr("norm"):  # as llama.cpp: the sum clamped to float16's smallest normal
            wts = wts / np.maximum(wts.sum(axis=1, keepdims=True), np.float32(6.103515625e-5))
        s = node.attr("scale")
        if s not in (0.0, 1.0):
            wts = wts * np.float32(s)
        return np.concatenate([ids.astype(np.float32), wts.astype(np.float32)], axis=1)  # [N, 2k]
    if op == "moe_linear":
        x, experts, routes = args
        k = node.attr("k")
        ids = routes[:, :k].astype(np.int64)  # [N, k]
        n_out = int(node.out.shape[2])
        out = np.empty((len(ids), k, n_out), np.float32)  # [N, k, n_out]
        for e in np.unique(ids):
            rows, slots = np.nonzero(ids == e)
            xe = x[rows] if x.ndim == 2 else x[rows, slots]  # [m, n_in]
            out[rows, slots] = xe @ experts.get(int(e)).T  # [m, n_out]
        return out
    if op == "moe_combine":
        y, routes = args  # [N, k, n], [N, 2k]
        k = node.attr("k")
        return np.einsum("nkd,nk->nd", y, routes[:, k:]).astype(np.float32)  # type: ignore[no-any-return]
    raise GraphError(f"{node.out.name}: the numpy backend has no op {op!r}")

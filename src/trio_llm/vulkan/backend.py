"""``VulkanBackend``: the Backend interface on Vulkan compute shaders.

It runs in the backend actor's worker thread: one thread, one call at a time, so it
holds no locks. Device memory comes in four categories (weights, kv_cache, compute,
scratch), each owned by one object (``WeightStore``, ``KVCache``, ``Activations``)
that can free and re-create it; residency is the choice of which of them to free.
Recorded graphs point at buffer handles, so every release drops them and the next
forward records again (a few milliseconds, once per wake).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Sequence

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
from trio_llm.engine.devsample import DeviceChain, check_decode
from trio_llm.engine.kvshift import Move, can_shift, k_ropes, shift_k
from trio_llm.engine.memory import plan_memory, plan_recurrent, reusable_prefix, state_layout
from trio_llm.engine.placement import cpu_moe_tensors, input_tensors
from trio_llm.errors import (
    BackendError,
    DeviceLost,
    GraphError,
    InvalidRequest,
    ModelLoadError,
    UnsupportedModelError,
)
from trio_llm.graph import Output
from trio_llm.model.config import ModelConfig
from trio_llm.model.gguf import GGUFModel
from trio_llm.model.kvtypes import (
    DEFAULT_KV_TYPE,
    dequantize_rows,
    kv_type,
    quantize_rows,
    rotation_blocks,
)
from trio_llm.models import build_graph
from trio_llm.vulkan.device import Device, shared_device, vk_errors
from trio_llm.vulkan.forward import (
    EMBD_ROW0,
    MATVEC_MAX_COLS,
    Activations,
    KVCache,
    build_ops,
    dequant_scratch,
    embd_bytes,
    fusion_groups,
    head_routes,
    missing_ops,
    moe_map_bytes,
    norm_consts,
    plan_buffers,
    q8_scratch,
    rope_consts,
    x16_scratch,
)
from trio_llm.vulkan.graph import Graph, Op
from trio_llm.vulkan.kernels import KernelCache
from trio_llm.vulkan.kvcache import LayerKV
from trio_llm.vulkan.memory import Allocator, Buffer, PlanAllocator, allocate_and_copy
from trio_llm.vulkan.ops import (
    ATTN_MAX_HEAD,
    Ops,
    attention_counters,
    attention_part_floats,
    decode_splits,
    fill_step,
)
from trio_llm.vulkan.recurrent import RecurrentState, chunk_scratch, chunked_prefill, state_bytes
from trio_llm.vulkan.sampling import MAX_STEPS, DeviceSampler, extra_buffers
from trio_llm.vulkan.shaders import MAX_STEP_CAP, STEP_CAP
from trio_llm.vulkan.weights import WeightStore

log = logging.getLogger(__name__)

_DEPTH = {Level.WEIGHTS: 1, Level.ALL: 2, Level.UNLOAD: 3}


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@attrs.frozen
class VulkanStatistics:
    forwards: int
    tokens: int
    submits: int
    graphs_recorded: int
    releases: int
    restores: int
    level: str | None


class VulkanBackend:
    """The model on a Vulkan device; see ``trio_llm.engine.backend.Backend``."""

    name = "vulkan"

    def __init__(
        self,
        model: GGUFModel,
        *,
        n_ctx: int,
        n_seq: int,
        progress: Progress | None = None,
        device: str | None = None,
        max_chunk: int = STEP_CAP,
        cache_type_k: str = DEFAULT_KV_TYPE,
        cache_type_v: str = DEFAULT_KV_TYPE,
        n_cpu_moe: float = 0.0,
        output: Output = "logits",
        plan_only: bool = False,
    ) -> None:
        if n_ctx < 1 or n_seq < 1:
            raise InvalidRequest(f"n_ctx and n_seq must be positive, got {n_ctx} and {n_seq}")
        cfg = model.config
        _check_shapes(model, cfg)
        self.config: ModelConfig = cfg
        self.n_ctx = n_ctx
        self.n_seq = n_seq
        self._progress = progress
        self._output: Output = output
        if max_chunk < 1:
            raise InvalidRequest(f"max_chunk must be positive, got {max_chunk}")
        # the physical batch (-ub): a forward of more tokens runs as several chunks
        self._max_chunk = min(MAX_STEP_CAP, _pow2(max_chunk))
        try:
            self.cache_types = (kv_type(cache_type_k).name, kv_type(cache_type_v).name)
        except ValueError as exc:
            raise InvalidRequest(str(exc)) from None
        self._level: Level | None = None
        self._closed = False
        self._lost = False
        self._graphs: dict[int, Graph] = {}
        # the graphs of steps with embedding rows or a non-causal entry, by (bucket, embd,
        # non-causal): recorded on first use, dropped at every release (an image's steps
        # are rare; the decode buckets' graphs are the ones worth keeping)
        self._special: dict[tuple[int, bool, bool], Graph] = {}
        self._rerecord: list[int] = []  # buckets to record again on restore
        self._before: dict[tuple[str, object], Buffer] = {}  # role -> buffer freed by a release
        self._forwards = self._tokens = self._submits = self._recorded = 0
        self._releases = self._restores = 0
        self._host_tensors = cpu_moe_tensors(cfg, n_cpu_moe) | input_tensors(set(model.tensors))
        self._plan_only = plan_only
        self._device: Device | None = shared_device(device)
        try:
            with self._device.lock, vk_errors("load model"):
                self._setup(model)
        except BaseException:
            self.close()
            raise

    def _setup(self, model: GGUFModel) -> None:
        cfg = self.config
        device = self._device
        assert device is not None
        self._alloc = PlanAllocator(device) if self._plan_only else Allocator(device)
        kernels = device.extras.get("kernels")
        if kernels is None:
            kernels = device.extras["kernels"] = KernelCache(device)
        self._kernels: KernelCache = kernels
        self._ops = Ops(self._kernels, subgroup=device.limits.subgroup_size,
                        matvec_rows=max(1, 64 // device.limits.subgroup_size),
                        coopmat=device.coopmat and 256 % device.limits.subgroup_size == 0)
        try:
            self._ir = build_graph(cfg, {n: t.shape for n, t in model.tensors.items()}, self._output)
        except GraphError as exc:
            raise ModelLoadError(model.path, str(exc)) from None
        missing = missing_ops(self._ir)
        if missing:  # refused at load, not at the first forward
            raise UnsupportedModelError(model.path, f"the Vulkan backend has no {', '.join(missing)} op for "
                                                    f"{cfg.arch} yet (the numpy backend runs it)")
        # gated delta-net layers' per-sequence state (qwen35), kept and released with the KV cache
        self._rs = RecurrentState(self._alloc, state_bytes(self._ir, self.n_seq))
        self._recurrent = plan_recurrent(self._ir)
        self._rs_pos = np.zeros(self.n_seq, np.int64)  # positions each sequence's state has absorbed
        self._plan = plan_buffers(self._ir, fusion_groups(self._ir) if self._ops.hybrid_fuse else ())
        # the largest bucket: a forward with more tokens runs as several chunks; every
        # activation of a chunk must fit one binding (128 MiB on lavapipe)
        limit = device.limits.max_storage_buffer_range
        self._cap = min(self._max_chunk, _pow2(self.n_ctx * self.n_seq))
        widest = max(w for kind, w in self._plan.slots.values() if kind == "T")
        while self._cap > 1 and 4 * self._cap * widest > limit:
            self._cap //= 2
        assert self._ir.logits is not None
        self._width = self._ir.logits.width  # n_vocab, or an embedding head's width
        # an embedding graph reads back every token's row (pooling mean, cls, none)
        out_cap = min(self.n_seq, self._cap) if self._output == "logits" else self._cap
        if 4 * out_cap * self._width > limit:
            raise BackendError(
                f"the logits of {out_cap} slots exceed this device's storage "
                f"buffer range ({limit >> 20} MiB): use fewer slots"
            )
        self._mem = plan_memory(self._ir, n_ctx=self.n_ctx, chunk=self._cap)
        # KV shifting (--cache-reuse) ropes K rows on the host: each layer's K RoPE, its factors
        self._k_ropes = k_ropes(self._ir)
        self._k_factors = {n.out.id: np.asarray(model.tensor(n.inputs[1].name).dequantize(), np.float32)
                           for n in self._k_ropes.values() if n is not None and len(n.inputs) > 1}
        # the delta rule's chunked prefill: its scratch, and its grid's most runs per step
        self._rs.n_seq = self.n_seq
        self._rs.work_sizes = chunk_scratch(self._ir, self._cap) if chunked_prefill(device.device_type) else {}
        kt, vt = self.cache_types
        # each cache's heads (gemma4's differ by layer; a shared-KV layer reads another's)
        heads = {(n.attr("n_head"), n.attr("n_head_kv"), n.attr("head_dim"))
                 for n in self._ir.nodes if n.op == "attention"} or {(cfg.n_head, cfg.n_head_kv, cfg.head_dim)}
        for what, t in (("K", kt), ("V", vt)):
            block = kv_type(t).block
            for _, _, hd in sorted(heads):
                if hd % block:
                    raise InvalidRequest(f"a {t} {what} cache needs head_dim a multiple of {block}, not {hd}")
        dec_cap = min(MATVEC_MAX_COLS, self._cap)  # the decode buckets' attention work
        self._kv = KVCache(
            self._alloc, [LayerKV(self.n_seq, m.rows, m.kv_dim, kt, vt, m.v_is_k) for m in self._mem],
            # the decode attention's splits, or (at depth, cooperative matrices) the prefill's
            part_floats=max(max(attention_part_floats(dec_cap, nh, hd, decode_splits(self.n_ctx)),
                                self._ops.prefill_part_floats(self.n_ctx, nh, nkv, hd, self._cap))
                            for nh, nkv, hd in heads),
            n_counters=max(attention_counters(dec_cap, nh, nkv) for nh, nkv, _ in heads),
        )
        if self._kv.largest_buffer > device.limits.max_storage_buffer_range:
            raise BackendError(
                f"one layer's KV cache ({self._kv.largest_buffer >> 20} MiB for {self.n_seq} x {self.n_ctx} "
                f"positions) exceeds this device's storage buffer range "
                f"({device.limits.max_storage_buffer_range >> 20} MiB): lower the context or the slots"
            )
        factors = {name: model.tensors[name].dequantize().astype(np.float32).reshape(-1)
                   for name in self._ir.weights if any(n.op == "rope" and len(n.inputs) > 1
                                                       and n.inputs[1].name == name for n in self._ir.nodes)}
        self._rope_buf, consts = rope_consts(self._ir, factors)
        consts.update(head_routes(self._ir))
        consts.update(norm_consts(self._ir))
        # --n-cpu-moe: these expert tensors are read from host-visible memory
        self._weights = WeightStore(self._alloc, model, host_tensors=self._host_tensors,
                                    only=frozenset(self._ir.weights))
        extra = extra_buffers() if self._output == "logits" else {}
        # SeqBatch.embd: a step's embedding rows, uploaded here for the graph's embd_rows
        self._embd_width = self._ir.embd_width()
        if self._embd_width:
            extra["embd"] = (embd_bytes(self._ir, self._cap), "scratch", "upload")
        hds = {n.attr("head_dim") for n in self._ir.attention_layers().values()}
        self._noncausal_refuse = (
            "this model's memory (a recurrent state) has no non-causal form" if self._recurrent
            else "this model's attention (a latent cache) has no non-causal form" if any(m.v_is_k for m in self._mem)
            else "this device has no non-causal attention kernel for this model"
            if not all(self._ops.prefill_ok(hd) for hd in hds) else "")
        if moe_bytes := moe_map_bytes(self._ir, self._cap):  # the prefill buckets' expert grouping
            extra["moe_map"] = (moe_bytes, "compute", "device")
        extra.update(q8_scratch(self._ir, self._weights, self._ops))  # TRIO_LLM_MATVEC_Q8=1's int8 activations
        extra.update(dequant_scratch(self._ir, self._weights, self._ops, self._cap))  # TRIO_LLM_MATMUL_DEQUANT
        extra.update(x16_scratch(self._ir, self._ops, self._cap))  # TRIO_LLM_MATMUL_X16
        self._act = Activations(self._alloc, self._plan, self._width, self._cap, out_cap, consts, extra=extra)
        self._sampler = DeviceSampler(device, self._ops, self._act, self.lowered)
        # several steps per submit run past a stop the host finds afterwards: only where
        # every layer's memory lets those positions be overwritten later (full KV cache);
        # an embedding model samples nothing (0: no decode)
        self.decode_steps_max = (0 if self._output != "logits" else MAX_STEPS
                                 if all(m.kind == "kv" and not m.window for m in self._mem) and not self._rs.sizes
                                 else 1)
        if self._plan_only:  # plan(): the buffers counted, nothing read, made or copied
            for seg in self._weights.segments:
                if not seg.host:
                    self._alloc.create(seg.size, "weights", "device")
            self._act.allocate()
            self._kv.allocate()
            self._rs.allocate()
            return
        total = self._weights.total_bytes()
        self._weights.ensure_shadow(self._progress)
        self._weights.upload()
        self._act.allocate()
        self._kv.allocate()
        self._rs.allocate()
        if self._progress is not None:
            self._progress(total, total)
        log.info(
            "vulkan: %s on %s, %d MiB of weights (shadow: %s), KV cache %s/%s: %d bytes per token, %d MiB; "
            "up to %d tokens a pass",
            cfg.name, device.name, total >> 20, self._weights.shadow_kind(), *self.cache_types,
            self._kv.bytes_per_token, self._kv.total_bytes >> 20, self._cap,
        )
        if self._host_tensors:
            log.info("vulkan: %d tensors (%d MiB) kept in host memory (%s)", len(self._host_tensors),
                     self._weights.host_bytes() >> 20, ", ".join(sorted(self._host_tensors))[:200])

    @classmethod
    def plan(cls, model: GGUFModel, **kwargs: object) -> dict[str, int]:
        """The device bytes a backend made with these arguments would hold once loaded
        (``memory()``'s categories), without taking any: the constructor's own sizing
        runs on a ``PlanAllocator``. ``--fit`` and ``--arena-budget`` project with it."""
        be = cls(model, plan_only=True, **kwargs)  # type: ignore[arg-type]
        try:
            return be.memory()
        finally:
            be.close()

    # -- the Backend interface -------------------------------------------------------

    def forward(self, batch: Sequence[SeqBatch]) -> np.ndarray:
        entries = list(batch)
        if self._check_batch(entries):
            return self._forward_special(entries)
        if len(entries) == 1 and len(entries[0].tokens) <= self._cap:
            return self._forward_one(entries[0])
        lens = [len(e.tokens) for e in entries]
        tokens = np.concatenate([np.asarray(e.tokens, np.uint32) for e in entries])  # [T]
        pos = np.concatenate([e.pos0 + np.arange(n, dtype=np.uint32) for e, n in zip(entries, lens, strict=True)])  # [T]
        seq = np.repeat(np.array([e.seq_id for e in entries], np.uint32), lens)  # [T]
        last = np.cumsum(lens) - 1  # [B] index of each entry's last token
        logits = np.empty((len(entries), self._width), np.float32)  # [B, n_vocab]
        with self._guard("forward"):
            for start in range(0, len(tokens), self._cap):
                end = min(len(tokens), start + self._cap)
                wanted = np.nonzero((last >= start) & (last < end))[0]  # entries ending here
                graph = self._graph(_pow2(end - start))
                fill_step(self._act.step_words, tokens[start:end], pos[start:end], seq[start:end],
                          (last[wanted] - start).astype(np.uint32))
                graph.run()
                self._submits += 1
                if len(wanted):
                    logits[wanted] = self._act.logits(len(wanted))
        self._forwards += 1
        self._tokens += len(tokens)
        return logits

    def _forward_one(self, e: SeqBatch) -> np.ndarray:
        """One sequence in one chunk (every decode step of a single slot): the general
        path's bookkeeping arrays cost more Python time than the step itself needs."""
        n = len(e.tokens)
        with self._guard("forward"):
            graph = self._graph(_pow2(n))
            fill_step(self._act.step_words, np.asarray(e.tokens, np.uint32),
                      np.arange(e.pos0, e.pos0 + n, dtype=np.uint32), np.full(n, e.seq_id, np.uint32),
                      np.array([n - 1], np.uint32))
            graph.run()
            self._submits += 1
            logits = self._act.logits(1).copy()  # [1, n_vocab]
        self._forwards += 1
        self._tokens += n
        return logits

    def forward_rows(self, entry: SeqBatch) -> np.ndarray:
        """Every token's row of the result (``Backend.forward_rows``): chunk by chunk,
        each chunk's tokens all output rows (the embedding graph's O buffers hold a
        whole chunk)."""
        special = self._check_batch([entry])
        if self._output == "logits":
            raise BackendError("forward_rows needs a backend built for embeddings")
        if special:
            return self._forward_special([entry], rows=True)
        toks = np.asarray(entry.tokens, np.uint32)
        out = np.empty((len(toks), self._width), np.float32)  # [n, width]
        with self._guard("forward"):
            for start in range(0, len(toks), self._cap):
                end = min(len(toks), start + self._cap)
                n = end - start
                graph = self._graph(_pow2(n))
                fill_step(self._act.step_words, toks[start:end],
                          np.arange(entry.pos0 + start, entry.pos0 + end, dtype=np.uint32),
                          np.full(n, entry.seq_id, np.uint32), np.arange(n, dtype=np.uint32))
                graph.run()
                self._submits += 1
                out[start:end] = self._act.logits(n)
        self._forwards += 1
        self._tokens += len(toks)
        return out

    def _forward_special(self, entries: list[SeqBatch], rows: bool = False) -> np.ndarray:
        """A forward with embedding rows or a non-causal entry: ``forward``'s chunks, each
        cut short where a non-causal entry would straddle two (each fits one:
        ``_check_batch``), each on the graph of its kind (``_graph``), with the chunk's
        embedding rows in the ``embd`` upload buffer (row i for the step's token i, whose
        id becomes ``EMBD_ROW0 + i``) and each token's highest visible position in the step
        buffer. ``rows``: every token's row of the result (``forward_rows``), else each
        entry's last."""
        lens = [len(e.tokens) for e in entries]
        starts = np.cumsum([0, *lens])  # [B + 1]
        total = int(starts[-1])
        tokens = np.concatenate([np.asarray(e.tokens, np.uint32) for e in entries])  # [T]
        pos = np.concatenate([e.pos0 + np.arange(n, dtype=np.uint32) for e, n in zip(entries, lens, strict=True)])
        seq = np.repeat(np.array([e.seq_id for e in entries], np.uint32), lens)  # [T]
        vis = pos.copy()  # [T] the highest position each token sees
        is_embd = np.zeros(total, bool)
        is_nc = np.zeros(total, bool)
        spans: list[tuple[int, int]] = []  # the non-causal entries' rows
        for e, a, b in zip(entries, starts[:-1], starts[1:], strict=True):
            if e.embd is not None:
                is_embd[a:b] = True
            if not e.causal:
                vis[a:b] = e.pos0 + (b - a) - 1
                is_nc[a:b] = True
                spans.append((int(a), int(b)))
        last = starts[1:] - 1  # [B] index of each entry's last token
        out = np.empty((total if rows else len(entries), self._width), np.float32)
        with self._guard("forward"):
            start = 0
            while start < total:
                end = min(total, start + self._cap)
                for a, b in spans:
                    if a < end < b:
                        end = a
                n = end - start
                toks = tokens[start:end]
                embd = bool(is_embd[start:end].any())
                if embd:
                    toks = self._upload_embd(entries, starts, start, toks.copy(), is_embd[start:end])
                nc = bool(is_nc[start:end].any())
                if rows:
                    wanted = np.arange(n)
                    out_rows = wanted.astype(np.uint32)
                else:
                    wanted = np.nonzero((last >= start) & (last < end))[0]  # entries ending here
                    out_rows = (last[wanted] - start).astype(np.uint32)
                graph = self._graph(_pow2(n), embd=embd, noncausal=nc)
                fill_step(self._act.step_words, toks, pos[start:end], seq[start:end], out_rows,
                          vis[start:end] if nc else None)
                graph.run()
                self._submits += 1
                if rows:
                    out[start:end] = self._act.logits(n)
                elif len(wanted):
                    out[wanted] = self._act.logits(len(wanted))
                start = end
        self._forwards += 1
        self._tokens += total
        return out

    def _upload_embd(self, entries: list[SeqBatch], starts: np.ndarray, start: int, toks: np.ndarray,
                     is_embd: np.ndarray) -> np.ndarray:
        """The embedding rows of the chunk of the step's tokens from ``start`` into the
        upload buffer, at their row of the chunk; ``toks``, the chunk's token ids, with
        those rows' ids ``EMBD_ROW0 + row``."""
        end = start + len(toks)
        arr = self._act.bufs["embd"].array
        assert arr is not None
        rows = arr.view(np.float32).reshape(self._cap, self._embd_width)
        for e, a, b in zip(entries, starts[:-1], starts[1:], strict=True):
            lo, hi = max(int(a), start), min(int(b), end)
            if e.embd is not None and lo < hi:
                rows[lo - start : hi - start] = e.embd[lo - a : hi - a]
        idx = np.nonzero(is_embd)[0]
        toks[idx] = EMBD_ROW0 + idx.astype(np.uint32)
        return toks

    def decode(self, batch: Sequence[SeqBatch], chains: Sequence[DeviceChain], us: np.ndarray,
               ahead: np.ndarray | None = None) -> np.ndarray:
        """``us.shape[0]`` decode steps of one token per entry in one submit, each
        sampled on the device by its entry's chain and fed to the next; returns the
        ids [n_steps, B] (see ``engine/devsample.py``, ``vulkan/sampling.py``). With
        ``ahead`` (the numbers of the next call, if it continues this one) that call's
        submit is queued behind this one before this one is waited for."""
        entries = list(batch)
        check_decode(entries, chains, us, self.n_ctx)
        if len(entries) > MATVEC_MAX_COLS or len(entries) > self._act.out_cap:
            raise InvalidRequest(f"decode samples at most {min(MATVEC_MAX_COLS, self._act.out_cap)} sequences "
                                 f"on the device, not {len(entries)}")
        if us.shape[0] > self.decode_steps_max:
            raise InvalidRequest(f"this model decodes at most {self.decode_steps_max} steps per submit")
        self._check_batch(entries)
        n = len(entries)
        seqs = [e.seq_id for e in entries]
        pos0 = [e.pos0 for e in entries]
        tokens = [int(e.tokens[0]) for e in entries]

        def fill() -> None:
            fill_step(self._act.step_words, np.array(tokens, np.uint32), np.array(pos0, np.uint32),
                      np.array(seqs, np.uint32), np.arange(n, dtype=np.uint32))

        if self.decode_steps_max == 1 or (ahead is not None and max(pos0) + us.shape[0] + ahead.shape[0] > self.n_ctx):
            ahead = None  # a recurrent state or a window must not run past a stop; nor a context's end
        with self._guard("decode", settle=False):
            ids = self._sampler.run(seqs, pos0, tokens, chains, us, ahead, fill)
            self._submits += 1
        if self._rs.sizes:
            for e in entries:
                self._rs_pos[e.seq_id] = e.pos0 + us.shape[0]
        self._forwards += us.shape[0]
        self._tokens += n * us.shape[0]
        return ids

    def reusable_prefix(self, n_cached: int, n_common: int, checkpoints: Sequence[int] = ()) -> int:
        return reusable_prefix(self._mem + self._recurrent, n_cached, n_common, checkpoints)

    def memory(self) -> dict[str, int]:
        mem = dict.fromkeys(MEMORY_CATEGORIES, 0)
        if not self._closed and self._device is not None:
            mem.update(self._alloc.bytes_by_category())
        return mem

    def host_memory(self) -> dict[str, int]:
        """Host bytes held for release/restore: copied weight shadows, KV copies."""
        mem = dict.fromkeys(MEMORY_CATEGORIES, 0)
        if self._closed:
            return mem
        mem["weights"] = sum(
            s.shadow.size for s in self._weights.segments if s.shadow is not None and not s.shadow.imported
        )
        mem["kv_cache"] = sum(b.size for b in self._kv.host) + self._rs.host_bytes
        return mem

    def device_info(self) -> dict[str, object]:
        if self._device is None:
            return {"backend": self.name, "name": "closed"}
        info = self._device.info()
        info.update(
            backend=self.name,
            weights_shadow=self._weights.shadow_kind() if not self._closed else "none",
            max_chunk=self._cap,
            graphs=sorted(self._graphs),
            cache_type_k=self.cache_types[0],
            cache_type_v=self.cache_types[1],
            kv_bytes_per_token=self._kv.bytes_per_token,
            kv_bytes=self._kv.total_bytes,
        )
        return info

    def release(self, level: Level) -> None:
        self._check_open()
        depth = _DEPTH[Level(level)]
        if self._level is not None and _DEPTH[self._level] >= depth:
            return
        with self._guard("release"):
            self._drop_special()
            # the graphs stay (their descriptor sets; at level all not their commands):
            # restore points them at the new buffers. Remember which buffer had which role.
            self._before.update(self._roles())
            if depth >= _DEPTH[Level.UNLOAD]:
                # upstream's idle unload keeps nothing: the graphs are recorded again
                # (the buckets in use while the weights copy, see _rebind)
                self._rerecord = sorted(set(self._rerecord) | set(self._graphs))
                self._drop_graphs()
                self._before.clear()
            self._weights.release_device()
            if depth >= _DEPTH[Level.ALL]:
                if depth < _DEPTH[Level.UNLOAD]:
                    self._kv.to_host()
                    self._rs.to_host()
                self._kv.free_device()
                self._rs.free_device()
                self._act.free()
                # every buffer moves on restore, so every graph is recorded again then:
                # their commands' device memory can go now
                for graph in self._graphs.values():
                    graph.trim()
                self._sampler.trim()
                if self._device is not None:
                    self._device.trim_command_pool()
            if depth >= _DEPTH[Level.UNLOAD]:
                self._kv.free_host()
                self._rs.free_host()
                self._rs_pos[:] = 0  # the state is gone: sequences start again at 0
                self._weights.release_shadow()
        self._level = Level(level)
        self._releases += 1

    def restore(self) -> None:
        self._check_open()
        if self._level is None:
            return
        with self._guard("restore"):
            self._weights.ensure_shadow()
            self._act.allocate()
            # weights largest first, then the KV cache's per-layer buffers (small): one
            # pipeline of allocations and copies
            jobs = self._weights.restore_jobs() + self._kv.restore_jobs() + self._rs.restore_jobs()
            allocate_and_copy(self._alloc, jobs, during=self._rebind)
            self._kv.restored()
            self._rs.restored()
        self._level = None
        self._restores += 1

    def _roles(self) -> dict[tuple[str, object], Buffer]:
        """The device buffers a graph can reference, by role."""
        out: dict[tuple[str, object], Buffer] = {}
        out.update(self._weights.roles())
        out.update(self._kv.roles())
        out.update(self._rs.roles())
        for name, buf in self._act.bufs.items():
            out[("a", name)] = buf
        return out

    def _rebind(self) -> None:
        """Runs while the last copies of a restore are in flight: point the kept graphs
        at the new buffers and re-encode them, the decode graph first and the others
        until the copies are done (the rest on first use); then record the graphs an
        unload dropped, likewise."""
        assert self._device is not None
        now = self._roles()
        new = {old: now[role] for role, old in self._before.items() if role in now}
        self._before.clear()
        self._sampler.rebind(new)
        for bucket, graph in list(self._graphs.items()):
            graph.rebind(new)
            if not all(self._alloc.is_live(b) for b in graph.buffers()):
                log.warning("graph of bucket %d references a freed buffer: recording it again", bucket)
                graph.close()
                del self._graphs[bucket]
                self._rerecord.append(bucket)
        first = True
        for graph in (self._graphs[b] for b in sorted(self._graphs)):
            if graph.stale and (first or not self._device.fence_done()):
                graph.encode()
                first = False
        buckets, self._rerecord = sorted(set(self._rerecord)), []
        for i, bucket in enumerate(buckets):
            if i and self._device.fence_done():
                break
            self._graph(bucket)

    def read_kv(self, seq_id: int, n: int) -> np.ndarray:
        check_uniform_kv(self.config)
        shape = (self.config.n_layer, self.config.kv_parts, n, self.config.kv_dim)
        out = np.zeros(shape, np.float32)  # [n_layer, kv_parts, n, kv_dim]; layers without a cache stay 0
        self._copy_kv(seq_id, n, out, to_device=False)
        return out

    def write_kv(self, seq_id: int, kv: np.ndarray) -> None:
        check_uniform_kv(self.config)
        data = np.ascontiguousarray(kv, dtype=np.float32)
        n = data.shape[2]
        assert data.shape == (self.config.n_layer, self.config.kv_parts, n, self.config.kv_dim) and n <= self.n_ctx
        self._copy_kv(seq_id, n, data, to_device=True)

    def _copy_kv(self, seq_id: int, n: int, data: np.ndarray, *, to_device: bool) -> None:
        """Positions 0..n-1 of one sequence, every layer's K then V (K alone for a
        latent cache), between the cache and ``data`` [n_layer, kv_parts, n, kv_dim]
        float32 (encoded to and decoded from
        the cache's types; lossless, kvtypes' roundtrip is idempotent), through the
        cache's raw row copies (one host buffer, one submit)."""
        self._check_open()
        if self._level is not None:
            raise BackendError(f"slot KV access while released (level {self._level.value}); restore first")
        what = "write KV cache" if to_device else "read KV cache"
        with self._guard(what):
            lays = self._kv.layers
            il = [m.layer for m in self._mem]  # the model layer of each cache layer (hybrids skip some)
            if to_device:
                self._kv.write_rows(seq_id, [(quantize_rows(data[il[i], 0], lay.k_type),
                                              np.zeros((n, 0), np.uint8) if lay.v_is_k
                                              else quantize_rows(data[il[i], 1], lay.v_type))
                                             for i, lay in enumerate(lays)])
            else:
                for i, (k, v) in enumerate(self._kv.read_rows(seq_id, n)):
                    data[il[i], 0] = dequantize_rows(k, lays[i].k_type, lays[i].kv_dim)
                    if not lays[i].v_is_k:  # a latent cache has no V (it is K's latent part)
                        data[il[i], 1] = dequantize_rows(v, lays[i].v_type, lays[i].kv_dim)

    @property
    def can_shift(self) -> bool:
        """KV shifting (``--cache-reuse``): every layer a full positional KV cache."""
        return can_shift(self._mem, self._recurrent)

    def shift_kv(self, seq_id: int, moves: Sequence[Move]) -> None:
        """``engine/kvshift.py`` on the host: each move's rows read as stored, K decoded,
        roped by the delta (through the cache's Hadamard rotation) and encoded again, V's
        bytes written back as they are. One read and one write submit per move."""
        self._check_open()
        if self._level is not None:
            raise BackendError(f"shift_kv while released (level {self._level.value}); restore first")
        if not self.can_shift:
            raise BackendError("this model's memory cannot shift (a sliding window or a recurrent state)")
        kb, _ = rotation_blocks(*self.cache_types, self.config.head_dim)
        with self._guard("shift KV cache"):
            lays = self._kv.layers
            for mv in moves:
                rows = self._kv.read_rows(seq_id, mv.n, start=mv.src)
                out = []
                for m, lay, (k, v) in zip(self._mem, lays, rows, strict=True):
                    rope = self._k_ropes[m.layer]
                    kf = dequantize_rows(k, lay.k_type, lay.kv_dim)  # [n, kv_dim]
                    kf = shift_k(kf, mv.dst - mv.src, rope, self._k_factors.get(rope.out.id) if rope else None, kb)
                    out.append((quantize_rows(kf, lay.k_type).reshape(k.shape), v))
                self._kv.write_rows(seq_id, out, start=mv.dst)

    def read_state(self, seq_id: int, raw: bool = False) -> np.ndarray:
        """The delta rule's matrices are kept [j][i] on the device (``delta_net.comp``):
        transposed here into the shared layout, unless ``raw`` (the device's own
        layout, one copy: for writing back here, as the slots' checkpoints do)."""
        self._check_state_access(seq_id)
        with self._guard("read recurrent state"):
            flat = self._rs.copy_seq(seq_id, self.n_seq)
        if raw:
            return flat
        parts, at = [], 0
        for _, shape in state_layout(self._ir):
            n = int(np.prod(shape))
            part = flat[at : at + n]
            parts.append(part.reshape(shape).transpose(0, 2, 1).reshape(-1) if len(shape) == 3 else part)
            at += n
        return np.concatenate(parts) if parts else np.zeros(0, np.float32)

    def write_state(self, seq_id: int, state: np.ndarray, n_pos: int, raw: bool = False) -> None:
        self._check_state_access(seq_id)
        layout = state_layout(self._ir)
        total = sum(int(np.prod(shape)) for _, shape in layout)
        if state.size != total:
            raise BackendError(f"a recurrent state of {state.size} values; this model's has {total}")
        flat = np.ascontiguousarray(state, np.float32)
        if not raw:
            parts, at = [], 0
            for _, shape in layout:
                n = int(np.prod(shape))
                part = flat[at : at + n]
                parts.append(part.reshape(shape).transpose(0, 2, 1).reshape(-1) if len(shape) == 3 else part)
                at += n
            flat = np.concatenate(parts) if parts else flat
        with self._guard("write recurrent state"):
            self._rs.copy_seq(seq_id, self.n_seq, flat)
        self._rs_pos[seq_id] = n_pos

    def _check_state_access(self, seq_id: int) -> None:
        self._check_open()
        if self._level is not None:
            raise BackendError(f"recurrent state access while released (level {self._level.value}); restore first")
        if not 0 <= seq_id < self.n_seq:
            raise BackendError(f"no sequence {seq_id}")

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        device, self._device = self._device, None
        if device is None:
            return
        if self._plan_only:  # nothing of it is on the device
            self._alloc.free_all()
            return
        with device.lock:
            with contextlib.suppress(Exception):
                device.vk.vkQueueWaitIdle(device.queue)
            try:
                self._drop_graphs()
                if hasattr(self, "_alloc"):
                    self._alloc.free_all()
            except Exception as exc:  # close must not raise: log and go on
                log.warning("vulkan close: %s", exc)
        # the device and its pipelines stay for the next backend (shared_device)

    # -- extras ----------------------------------------------------------------------

    @property
    def level(self) -> Level | None:
        return self._level

    def statistics(self) -> VulkanStatistics:
        return VulkanStatistics(
            forwards=self._forwards,
            tokens=self._tokens,
            submits=self._submits,
            graphs_recorded=self._recorded,
            releases=self._releases,
            restores=self._restores,
            level=self._level.value if self._level is not None else None,
        )

    def replay(self, n_tokens: int) -> None:
        """Submit the recorded graph of ``n_tokens``'s bucket again with the step buffer
        as it is: GPU time plus one submit, for measuring Python overhead."""
        with self._guard("replay"):
            self._graph(_pow2(n_tokens)).run()

    # -- internals -------------------------------------------------------------------

    @contextlib.contextmanager
    def _guard(self, what: str, settle: bool = True):  # type: ignore[no-untyped-def]
        if self._lost:
            raise DeviceLost("the Vulkan device was lost earlier; restart the server")
        assert self._device is not None
        try:
            with self._device.lock, vk_errors(what):
                if settle and hasattr(self, "_sampler"):
                    self._sampler.settle()  # a decode submit queued ahead is done first
                yield
        except DeviceLost:
            self._lost = True
            raise

    def _graph(self, bucket: int, embd: bool = False, noncausal: bool = False) -> Graph:
        if embd or noncausal:
            key = (bucket, embd, noncausal)
            special = self._special.get(key)
            if special is None:
                assert self._device is not None
                special = self._special[key] = Graph.record(
                    self._device, self.lowered(bucket, embd=embd, noncausal=noncausal))
                self._recorded += 1
                self._kernels.save()
            return special
        graph = self._graphs.get(bucket)
        if graph is None:
            assert self._device is not None
            ops = self.lowered(bucket)
            graph = Graph.record(self._device, ops)
            self._graphs[bucket] = graph
            self._recorded += 1
            self._kernels.save()  # a new bucket may have compiled pipelines: keep them
        return graph

    def lowered(self, bucket: int, ops: Ops | None = None, *, embd: bool = False,
                noncausal: bool = False) -> list[Op]:
        """The model's graph lowered for ``bucket`` tokens (with other kernel settings
        when ``ops`` is given: the decode benchmark compares them); ``embd`` / ``noncausal``:
        for a step with embedding rows / a non-causal entry."""
        return build_ops(ops or self._ops, self._ir, self._plan, self._weights, self._act, self._kv,
                         self._mem, self._rope_buf, bucket=bucket, rs=self._rs, embd=embd, noncausal=noncausal)

    def _drop_special(self) -> None:
        special, self._special = self._special, {}
        for g in special.values():
            g.close()

    def _drop_graphs(self) -> None:
        self._drop_special()
        if hasattr(self, "_sampler"):
            self._sampler.drop()
        graphs, self._graphs = self._graphs, {}
        for g in graphs.values():
            g.close()

    def _check_open(self) -> None:
        if self._closed:
            raise BackendError("the Vulkan backend is closed")

    def _check_batch(self, entries: list[SeqBatch]) -> bool:
        """``check_batch`` and this backend's own checks; whether the batch has embedding
        rows or a non-causal entry (``_forward_special``'s)."""
        self._check_open()
        if self._level is not None:
            raise BackendError(f"forward while released (level {self._level.value}); restore first")
        check_batch(entries, n_seq=self.n_seq, n_ctx=self.n_ctx, n_vocab=self.config.n_vocab,
                    n_embd=self._embd_width)
        special = False
        for e in entries:
            if e.embd is not None or not e.causal:
                special = True
        if special:
            check_noncausal(entries, max_rows=self._cap, refuse=self._noncausal_refuse)
        if self._rs.sizes:  # a recurrent state continues only where it stopped (position 0: afresh)
            for e in entries:
                if e.pos0 and self._rs_pos[e.seq_id] != e.pos0:
                    raise BackendError(f"sequence {e.seq_id}'s recurrent state holds {self._rs_pos[e.seq_id]} "
                                       f"positions; it cannot continue at {e.pos0}")
            for e in entries:
                self._rs_pos[e.seq_id] = e.pos0 + len(e.tokens)
        return special


def _check_shapes(model: GGUFModel, cfg: ModelConfig) -> None:
    """The kernels' shape assumptions, checked once with a readable error."""
    problems = []
    dims = [("n_embd", cfg.n_embd), ("q_dim", cfg.q_dim), ("n_ff", cfg.n_ff)]
    if cfg.n_expert:
        dims.append(("expert_feed_forward_length", cfg.n_ff_exp))
    for what, n in dims:
        if n % 32:
            problems.append(f"{what} {n} is not a multiple of 32")
    for hd in {cfg.head_dim, cfg.layer_head_dim(0) if cfg.head_dim_swa else cfg.head_dim, cfg.head_dim_swa or cfg.head_dim}:
        most = 768 if cfg.n_lora_kv else ATTN_MAX_HEAD  # MLA: latent rows up to 768
        if hd % 4 or hd > most:
            problems.append(f"head_dim {hd} must be a multiple of 4 and at most {most}")
    if cfg.kv_dim % 4:
        problems.append(f"kv_dim {cfg.kv_dim} is not a multiple of 4")
    if problems:
        raise UnsupportedModelError(model.path, "; ".join(problems))

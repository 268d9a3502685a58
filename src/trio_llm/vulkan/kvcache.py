"""The KV cache on the device: per layer a K and a V buffer of rows in the layer's
cache types (K alone for a latent layer, ``v_is_k``: its values are the first
``kv_lora_rank`` values of each K row, read from the K buffer, so it has no V buffer,
no V bytes in any count, host copy or slot row), and the work buffers of the decode
attention.

A layer's cache is ``n_seq * n_ctx`` rows, sequence after sequence; a row is one
position's ``kv_dim`` values stored as ``model/kvtypes.py`` says (a whole number of
blocks of 32 for the quantized types), and position p of a sequence lives in row
``p % n_ctx`` of its rows: a full cache (``n_ctx`` the context) never wraps, a
sliding-window layer's smaller cache is a ring. Every writer (rope.comp's cache
write, matvec.comp's ROPE_OUT epilogue) encodes the type, every reader (attention.comp,
attn_decode.comp) decodes it, so the bytes here are the bytes llama.cpp's cache holds.

Release and restore at level ``all`` copy those bytes to host buffers and back, and
slot files get a sequence's rows as raw bytes (``read_rows`` / ``write_rows``), so a
quantized cache is never re-encoded on the way.

The decode attention's partials and counters (``part``, ``counters``; category
"compute") live here too: the attention kernels are this cache's readers, and every
layer's attention reuses them. The counters must be zero whenever no attention is
running; they are zero-filled when allocated and each dispatch leaves them zero.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import numpy as np

from trio_llm.errors import BackendError
from trio_llm.model.kvtypes import kv_type
from trio_llm.vulkan.memory import Allocator, Buffer, CopyJob, View, whole


@attrs.frozen
class LayerKV:
    """The shape of one layer's cache: ``n_seq`` sequences of ``n_ctx`` rows of
    ``kv_dim`` values, K stored as ``k_type`` and V as ``v_type`` (none with
    ``v_is_k``: 0 V bytes)."""

    n_seq: int
    n_ctx: int
    kv_dim: int
    k_type: str = "f32"
    v_type: str = "f32"
    v_is_k: bool = False

    @property
    def k_row_bytes(self) -> int:
        return kv_type(self.k_type).row_bytes(self.kv_dim)

    @property
    def v_row_bytes(self) -> int:
        return 0 if self.v_is_k else kv_type(self.v_type).row_bytes(self.kv_dim)

    @property
    def k_bytes(self) -> int:
        return self.n_seq * self.n_ctx * self.k_row_bytes

    @property
    def v_bytes(self) -> int:
        return self.n_seq * self.n_ctx * self.v_row_bytes


@attrs.define(eq=False)
class KVCache:
    """Per layer, K and V of every sequence (``layers[i]`` gives the shapes; ``v[i]``
    None for a latent layer), plus the decode attention's ``part_floats`` float32
    partials and ``n_counters`` uint32 counters (``vulkan/ops.py``
    ``attention_part_floats`` / ``attention_counters``)."""

    alloc: Allocator
    layers: list[LayerKV]
    part_floats: int = 0
    n_counters: int = 0
    k: list[Buffer] = attrs.field(factory=list)
    v: list[Buffer | None] = attrs.field(factory=list)
    part: Buffer | None = None
    counters: Buffer | None = None
    host: list[Buffer] = attrs.field(factory=list)  # the ALL-level copy, K then V (if any) per layer
    saved: bool = False  # the host copy holds the cache (the device has none)

    @classmethod
    def uniform(
        cls, alloc: Allocator, n_layer: int, *, n_seq: int, n_ctx: int, kv_dim: int,
        k_type: str = "f32", v_type: str = "f32", part_floats: int = 0, n_counters: int = 0,
    ) -> KVCache:
        """Every layer the same shape and types (llama, qwen2, qwen3)."""
        layer = LayerKV(n_seq, n_ctx, kv_dim, kv_type(k_type).name, kv_type(v_type).name)
        return cls(alloc, [layer] * n_layer, part_floats, n_counters)

    @property
    def n_layer(self) -> int:
        return len(self.layers)

    @property
    def bytes_per_token(self) -> int:
        """Bytes one position takes in every layer (K and V), as the log reports."""
        return sum(lay.k_row_bytes + lay.v_row_bytes for lay in self.layers)

    @property
    def total_bytes(self) -> int:
        """Device bytes of K and V (not counting the attention's work buffers)."""
        return sum(lay.k_bytes + lay.v_bytes for lay in self.layers)

    @property
    def largest_buffer(self) -> int:
        """The largest one buffer (it must fit one storage-buffer binding)."""
        return max((max(lay.k_bytes, lay.v_bytes) for lay in self.layers), default=0)

    @property
    def on_device(self) -> bool:
        return bool(self.k)

    def k_view(self, il: int) -> View:
        return whole(self.k[il])

    def v_view(self, il: int) -> View:
        """The values' cache: K's own buffer for a latent layer."""
        return whole(self.v[il] or self.k[il])

    def part_view(self) -> View:
        assert self.part is not None, "KVCache made without part_floats"
        return whole(self.part)

    def counter_view(self) -> View:
        assert self.counters is not None, "KVCache made without n_counters"
        return whole(self.counters)

    def roles(self) -> dict[tuple[str, object], Buffer]:
        """The device buffers a recorded graph can reference, by role (for rebind)."""
        out: dict[tuple[str, object], Buffer] = {}
        for i, (k, v) in enumerate(zip(self.k, self.v, strict=True)):
            out[("k", i)] = k
            if v is not None:
                out[("v", i)] = v
        if self.part is not None:
            out[("kvw", "part")] = self.part
        if self.counters is not None:
            out[("kvw", "counters")] = self.counters
        return out

    def allocate(self) -> None:
        if self.k:
            return
        try:
            for lay in self.layers:
                self.k.append(self.alloc.create(lay.k_bytes, "kv_cache", "device"))
                self.v.append(None if lay.v_is_k else self.alloc.create(lay.v_bytes, "kv_cache", "device"))
            self._allocate_work()
        except BaseException:
            self.free_device()
            raise

    def _allocate_work(self) -> None:
        """The attention's partials and zero-filled counters."""
        if self.part is None and self.part_floats:
            self.part = self.alloc.create(4 * self.part_floats, "compute", "device")
        if self.counters is None and self.n_counters:
            self.counters = self.alloc.create(4 * self.n_counters, "compute", "device")
            if self.alloc.planning:
                return
            device = self.alloc.device
            with device.one_shot("zero attention counters") as cmd:
                device.vk.vkCmdFillBuffer(cmd, self.counters.handle, 0, self.counters.size, 0)

    def free_device(self) -> None:
        for buf in [*self.k, *self.v, self.part, self.counters]:
            self.alloc.free(buf)
        self.k, self.v = [], []
        self.part = self.counters = None

    def _device_buffers(self) -> list[Buffer]:
        """The cache's device buffers in the host copy's order: K, then V if any, per layer."""
        return [b for kv in zip(self.k, self.v, strict=True) for b in kv if b is not None]

    def free_host(self) -> None:
        for buf in self.host:
            self.alloc.free(buf)
        self.host = []
        self.saved = False

    def to_host(self) -> None:
        """Copy the device cache into host buffers and free the device cache. The host
        buffers are made on the first release and kept (host memory, like the weights'
        shadow), so later cycles allocate no host memory."""
        if not self.k:
            return
        device = self.alloc.device
        vk = device.vk
        pairs = self._device_buffers()
        try:
            if [b.size for b in self.host] != [b.size for b in pairs]:
                self.free_host()
                self.host = [self.alloc.create(b.size, "kv_cache", "host") for b in pairs]
            with device.one_shot("copy KV cache to host") as cmd:
                for src, dst in zip(pairs, self.host, strict=True):
                    vk.vkCmdCopyBuffer(cmd, src.handle, dst.handle, 1, [vk.VkBufferCopy(size=src.size)])
        except BaseException:
            self.free_host()
            raise
        self.free_device()
        self.saved = True

    def restore_jobs(self) -> list[CopyJob]:
        """Copy jobs that re-create the device cache from the host copy (K and V, or
        K alone, of each layer in order); with no saved copy, the cache is allocated
        empty here.
        The attention's work buffers are made here too, before the jobs run, so a
        graph rebind during the copies finds them."""
        if not self.saved:
            self.allocate()  # nothing when the cache stayed on the device
            return []
        self.free_device()  # what a failed restore left behind
        self._allocate_work()
        def latent_k(buf: Buffer) -> None:  # a latent layer's K, and its (absent) V
            self.k.append(buf)
            self.v.append(None)

        assigns = [f for lay in self.layers for f in ((latent_k,) if lay.v_is_k else (self.k.append, self.v.append))]
        assert len(assigns) == len(self.host)
        return [CopyJob(src.size, "kv_cache", src, f) for src, f in zip(self.host, assigns, strict=True)]

    def restored(self) -> None:
        """The jobs of ``restore_jobs`` have all finished: the device holds the cache."""
        self.saved = False

    # -- one sequence's rows, raw (slot files) ------------------------------------

    def read_rows(self, seq_id: int, n: int, start: int = 0) -> list[tuple[np.ndarray, np.ndarray]]:
        """Positions ``start .. start+n-1`` of sequence ``seq_id`` in every layer, as
        stored (position p at row p % n_ctx, so a ring's window comes out in position
        order): per layer (K uint8 [n, k_row_bytes], V uint8 [n, v_row_bytes]), copies
        (V [n, 0] for a latent layer)."""
        out = [(np.empty((n, lay.k_row_bytes), np.uint8), np.empty((n, lay.v_row_bytes), np.uint8))
               for lay in self.layers]
        self._copy_rows(seq_id, n, start, [a for pair in out for a in pair], to_device=False)
        return out

    def write_rows(self, seq_id: int, rows: Sequence[tuple[np.ndarray, np.ndarray]], start: int = 0) -> None:
        """Overwrite positions ``start ..`` of sequence ``seq_id`` with ``read_rows``'s
        arrays."""
        if len(rows) != self.n_layer:
            raise BackendError(f"KV rows for {len(rows)} layers, the cache has {self.n_layer}")
        n = rows[0][0].shape[0] if rows else 0
        arrays = []
        for lay, (k, v) in zip(self.layers, rows, strict=True):
            for a, rb in ((k, lay.k_row_bytes), (v, lay.v_row_bytes)):
                if a.shape != (n, rb):
                    raise BackendError(f"KV rows of shape {a.shape}, expected ({n}, {rb})")
                arrays.append(np.ascontiguousarray(a, np.uint8))
        self._copy_rows(seq_id, n, start, arrays, to_device=True)

    def _copy_rows(self, seq_id: int, n: int, start: int, arrays: list[np.ndarray], *, to_device: bool) -> None:
        """Between the cache (K then V of each layer) and ``arrays`` (K then V per
        layer, [n, row_bytes], positions start..start+n-1; a latent layer's V is
        [n, 0] and copies nothing), through one host buffer and one submit: one copy
        region per buffer, two where a ring wraps."""
        if not self.k:
            raise BackendError("KV cache access while it is not on the device")
        for lay in self.layers:
            if n > lay.n_ctx or start < 0:
                raise BackendError(f"{n} positions from {start} do not fit a cache of {lay.n_ctx} rows per sequence")
        device = self.alloc.device
        vk = device.vk
        what = "write KV cache" if to_device else "read KV cache"
        total = sum(a.nbytes for a in arrays)
        host = self.alloc.create(max(total, 4), "scratch", "upload" if to_device else "readback")
        try:
            assert host.array is not None
            offsets = np.cumsum([0] + [a.nbytes for a in arrays]).tolist()
            if to_device:
                for a, at in zip(arrays, offsets, strict=False):
                    host.array[at : at + a.nbytes] = a.reshape(-1)
            bufs = [b for pair in zip(self.k, self.v, strict=True) for b in pair]
            lays = [lay for lay in self.layers for _ in range(2)]
            with device.one_shot(what) as cmd:
                for i, (buf, lay) in enumerate(zip(bufs, lays, strict=True)):
                    row = lay.k_row_bytes if i % 2 == 0 else lay.v_row_bytes
                    if buf is None or not row:  # a latent layer's V
                        continue
                    first = start % lay.n_ctx
                    head = min(n, lay.n_ctx - first)  # rows before the ring wraps
                    for cache_row, host_row, count in ((first, 0, head), (0, head, n - head)):
                        if not count:
                            continue
                        at_cache = (seq_id * lay.n_ctx + cache_row) * row
                        at_host = offsets[i] + host_row * row
                        src, dst = (host, buf) if to_device else (buf, host)
                        region = vk.VkBufferCopy(srcOffset=at_host if to_device else at_cache,
                                                 dstOffset=at_cache if to_device else at_host, size=count * row)
                        vk.vkCmdCopyBuffer(cmd, src.handle, dst.handle, 1, [region])
            if not to_device:
                for a, at in zip(arrays, offsets, strict=False):
                    a.reshape(-1)[:] = host.array[at : at + a.nbytes]
        finally:
            self.alloc.free(host)

"""The model's weights on the device, and their host shadow.

Layout: tensors are grouped, in file order, into segments of at most ~1 GiB (and
never more than ``maxMemoryAllocationSize``). Inside a segment every tensor keeps the
offset it has in the file's memory map relative to the segment's page-aligned start,
so the segment is a byte-for-byte image of a stretch of the GGUF file. That makes
three things trivial:

* the host shadow of a segment can be the file's mapped pages themselves, imported
  with ``VK_EXT_external_memory_host`` (no copy, no extra host memory);
* when the driver refuses the import (or the offsets break the storage-buffer
  alignment), the shadow is one host-visible allocation filled once, tensor by tensor;
* restoring a segment is a single ``vkCmdCopyBuffer`` from shadow to device.

Tensors larger than ``maxStorageBufferRange`` (the 128256-row embedding of llama-1b is
279 MB, lavapipe binds at most 128 MiB) are bound as several row ranges; ``pieces``
gives them.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable

import attrs
import numpy as np

from trio_llm.errors import BackendError, UnsupportedModelError
from trio_llm.model.gguf import GGUFModel
from trio_llm.vulkan.memory import Allocator, Buffer, CopyJob, View, allocate_and_copy, host_span
from trio_llm.vulkan.ops import BLOCK_BYTES, row_bytes

log = logging.getLogger(__name__)

PAGE = 4096
# Segments of 256 MiB rather than one huge allocation: a restore copies each segment
# while it allocates the next (see memory.allocate_and_copy); on the H200 chunks of
# 64 MiB and more allocate at the same rate per byte, 16 MiB ones 50 % slower.
SEGMENT_BYTES = 256 << 20
#: the last segment of the file is split so that at most this much is left to copy
#: after the last allocation of a restore
TAIL_BYTES = 64 << 20
MAX_GAP = 1 << 20  # tensors further apart than this start a new segment


def _owner(a: np.ndarray) -> object:
    """The object whose memory the array ``a`` views (the file's map, a buffer)."""
    while isinstance(a.base, np.ndarray):
        a = a.base
    return a.base if a.base is not None else a


def _split_tail(groups: list[list]) -> None:
    """Make a small segment of the last group's trailing (else leading) tensors, at
    most ``TAIL_BYTES``, when the model is big enough for it to matter."""
    total = sum(t.n_bytes for g in groups for t in g)
    if not groups or total <= 4 * TAIL_BYTES or len(groups[-1]) < 2:
        return
    last = groups[-1]
    for part in (last[::-1], last):
        k, size = 0, 0
        while k < len(part) - 1 and size + part[k].n_bytes <= TAIL_BYTES:
            size += part[k].n_bytes
            k += 1
        if k:
            if part is last:  # leading tensors
                groups[-1:] = [last[:k], last[k:]]
            else:
                groups[-1:] = [last[:-k], last[-k:]]
            return


@attrs.frozen
class Slot:
    name: str
    qtype: str
    shape: tuple[int, ...]
    segment: int
    offset: int
    nbytes: int


@attrs.define(eq=False)
class Segment:
    size: int
    base: int  # host address the segment image starts at (file layout) or 0 (packed)
    tensors: list[str]
    host: bool = False  # bound from its host copy, never on the device (--n-cpu-moe)
    device: Buffer | None = None
    shadow: Buffer | None = None


@attrs.define(eq=False)
class WeightStore:
    """Device segments, host shadows, and where each tensor is."""

    alloc: Allocator
    model: GGUFModel
    #: tensors read by the GPU from host-visible memory instead of device memory
    host_tensors: frozenset[str] = frozenset()
    #: the tensors to place (the graph's weights); None: every tensor of the file. A
    #: file's multi-token-prediction blocks, which no forward pass reads, stay on disk
    only: frozenset[str] | None = None
    slots: dict[str, Slot] = attrs.field(factory=dict)
    segments: list[Segment] = attrs.field(factory=list)
    # the mapped bytes of every tensor: holding these views keeps the file mapping
    # (which imported shadows point into) alive even if the model object is closed
    raws: dict[str, np.ndarray] = attrs.field(factory=dict)

    def __attrs_post_init__(self) -> None:
        self._plan()

    # -- layout --------------------------------------------------------------------

    def _plan(self) -> None:
        limits = self.alloc.device.limits
        # 16 at least: matmul_cm3's "+w" reads Q4_K weights in 8-byte words, which must be
        # aligned (its super-blocks are 144 bytes, so their fields keep a tensor's alignment)
        align = max(limits.min_storage_offset_alignment, 16)
        infos = sorted((t for t in self.model.tensors.values() if self.only is None or t.name in self.only),
                       key=lambda t: int(t.raw.ctypes.data))
        self.raws = {t.name: t.raw for t in infos}
        biggest = max((t.n_bytes for t in infos), default=0)
        cap = min(limits.max_allocation_size, max(SEGMENT_BYTES, biggest + 2 * PAGE))
        for t in infos:
            qtype = t.ggml_type.name
            if qtype not in BLOCK_BYTES:
                raise UnsupportedModelError(self.model.path, f"tensor {t.name!r} has type {qtype}, which the Vulkan backend does not read")
            if len(t.shape) == 1 and qtype != "F32":
                raise UnsupportedModelError(self.model.path, f"vector {t.name!r} is {qtype}; the Vulkan backend reads vectors as F32")
            if len(t.shape) == 3 and t.n_bytes > limits.max_storage_buffer_range:
                # an expert matvec binds the whole 3-D tensor (ids pick the expert on the device)
                raise UnsupportedModelError(
                    self.model.path, f"expert tensor {t.name!r} is {t.n_bytes >> 20} MiB, more than this "
                                     f"device binds at once ({limits.max_storage_buffer_range >> 20} MiB)")
        groups: list[list] = []
        for t in infos:
            addr = int(t.raw.ctypes.data)
            # a segment never spans two allocations (the file's map, a LoRA adapter's
            # buffer): the memory between them may not be mapped, and an imported
            # shadow takes the whole span
            if (groups and (groups[-1][0].name in self.host_tensors) == (t.name in self.host_tensors)
                    and _owner(groups[-1][-1].raw) is _owner(t.raw)):
                g = groups[-1]
                start = int(g[0].raw.ctypes.data) & ~(PAGE - 1)
                prev_end = int(g[-1].raw.ctypes.data) + g[-1].n_bytes
                if 0 <= addr - prev_end <= MAX_GAP and addr + t.n_bytes - start <= cap:
                    g.append(t)
                    continue
            groups.append([t])
        _split_tail(groups)
        for g in groups:
            base = int(g[0].raw.ctypes.data) & ~(PAGE - 1)
            offsets = [int(t.raw.ctypes.data) - base for t in g]
            if any(o % align for o in offsets):
                # file offsets break the binding alignment: pack instead (copy shadow)
                base, pos, offsets = 0, 0, []
                for t in g:
                    pos = -(-pos // 256) * 256
                    offsets.append(pos)
                    pos += t.n_bytes
                size = pos
            else:
                end = int(g[-1].raw.ctypes.data) + g[-1].n_bytes
                size = -(-(end - base) // PAGE) * PAGE
            seg = len(self.segments)
            self.segments.append(Segment(size=size, base=base, tensors=[t.name for t in g],
                                         host=g[0].name in self.host_tensors))
            for t, off in zip(g, offsets, strict=True):
                self.slots[t.name] = Slot(t.name, t.ggml_type.name, tuple(t.shape), seg, off, t.n_bytes)

    def total_bytes(self) -> int:
        return sum(s.size for s in self.segments)

    # -- shadow and device ---------------------------------------------------------

    def ensure_shadow(self, progress: Callable[[int, int], None] | None = None) -> None:
        """Give every segment a host shadow: imported file pages, else a one-time copy."""
        total = self.total_bytes()
        done = 0
        for seg in self.segments:
            if seg.shadow is None:
                # a host segment is bound by shaders: imported pages are transfer sources
                # only, so it gets the one-time host-visible copy
                seg.shadow = self._copy(seg) if seg.host else self._import(seg) or self._copy(seg)
            done += seg.size
            if progress is not None:
                progress(done, total)

    def _import(self, seg: Segment) -> Buffer | None:
        if not seg.base:
            return None
        align = self.alloc.device.limits.imported_host_alignment
        if not align or seg.base % align or seg.size % align:
            return None
        return self.alloc.import_host(host_span(seg.base, seg.size), "weights")

    def _copy(self, seg: Segment) -> Buffer:
        buf = self.alloc.create(seg.size, "weights", "host")
        assert buf.array is not None
        for name in seg.tensors:
            slot = self.slots[name]
            raw = self.raws[name]
            buf.array[slot.offset : slot.offset + slot.nbytes] = raw.reshape(-1).view(np.uint8)
        return buf

    def shadow_kind(self) -> str:
        kinds = {("imported" if s.shadow.imported else "copy") for s in self.segments if s.shadow is not None}
        return "+".join(sorted(kinds)) or "none"

    def restore_jobs(self) -> list[CopyJob]:
        """A copy job per segment not on the device, largest first (the last copy of a
        pipelined restore is what the allocations cannot hide: keep it small)."""
        todo = sorted((s for s in self.segments if s.device is None and not s.host), key=lambda s: -s.size)
        jobs = []
        for seg in todo:
            assert seg.shadow is not None, "ensure_shadow() first"

            def assign(buf: Buffer, seg: Segment = seg) -> None:
                seg.device = buf

            jobs.append(CopyJob(seg.size, "weights", seg.shadow, assign))
        return jobs

    def upload(self, during: Callable[[], None] | None = None) -> None:
        """Allocate the device segments and copy every shadow into them (see
        ``allocate_and_copy``)."""
        allocate_and_copy(self.alloc, self.restore_jobs(), during)

    def release_device(self) -> None:
        # one thread: the driver serializes frees (bench/vkmem.py: 1, 2, 4, 8 or 16
        # threads free 1.25 GiB in the same 26-28 ms on the H200)
        for seg in self.segments:
            buf, seg.device = seg.device, None
            self.alloc.free(buf)

    def release_shadow(self) -> None:
        for seg in self.segments:
            self.alloc.free(seg.shadow)
            seg.shadow = None

    @property
    def resident(self) -> bool:
        return all(seg.device is not None or seg.host for seg in self.segments)

    def host_bytes(self) -> int:
        """Bytes of the tensors the GPU reads from host memory."""
        return sum(s.size for s in self.segments if s.host)

    def roles(self) -> dict[tuple[str, object], Buffer]:
        """The buffers a recorded graph binds, by segment: the device copy, or a host
        segment's host copy."""
        out: dict[tuple[str, object], Buffer] = {}
        for i, seg in enumerate(self.segments):
            buf = seg.shadow if seg.host else seg.device
            if buf is not None:
                out[("w", i)] = buf
        return out

    # -- binding -------------------------------------------------------------------

    def view(self, name: str) -> View:
        slot = self.slots[name]
        seg = self.segments[slot.segment]
        buf = seg.shadow if seg.host else seg.device
        assert buf is not None, "weights are not resident"
        return View(buf, slot.offset, slot.nbytes)

    def piece_rows(self, name: str) -> list[tuple[int, int]]:
        """(first row, end row) of each piece ``pieces`` binds, resident or not."""
        slot = self.slots[name]
        limit = self.alloc.device.limits.max_storage_buffer_range
        if slot.nbytes <= limit:
            return [(0, slot.shape[0])]
        rb = row_bytes(slot.qtype, slot.shape[-1])
        # each piece must start on the storage offset alignment: rows in multiples of m
        align = self.alloc.device.limits.min_storage_offset_alignment
        m = align // math.gcd(rb, align)
        per = (limit // rb) // m * m
        if per == 0:
            raise BackendError(f"{name}: a row of {rb} bytes cannot be bound within {limit} bytes")
        return [(r0, min(slot.shape[0], r0 + per)) for r0 in range(0, slot.shape[0], per)]

    def pieces(self, name: str) -> list[tuple[View, int, int]]:
        """(view, first row, end row) ranges of a matrix, each bindable on its own."""
        rows = self.piece_rows(name)
        view = self.view(name)
        if len(rows) == 1:
            return [(view, *rows[0])]
        rb = row_bytes(self.slots[name].qtype, self.slots[name].shape[-1])
        return [(view.sub(r0 * rb, (r1 - r0) * rb), r0, r1) for r0, r1 in rows]

"""The recurrent state of gated delta-net layers (qwen35) on the device.

Per graph node that keeps state, one buffer for every sequence: a conv node's last
``d_conv - 1`` inputs ``[n_seq][d_conv - 1][C]``, a delta rule's matrices
``[n_seq][n_v][d][d]`` (``shaders/ssm_conv.comp``, ``delta_net.comp``). The kernels
start a sequence from zeros whenever its run begins at position 0, so a fresh or a
restored-from-nothing buffer needs no clearing. Release at level ``all`` copies the
buffers to the host and back, as ``KVCache`` does; ``unload`` drops them (the server
then recomputes from position 0, which the kernels see).

Prefill runs the delta rule in chunks (``delta_prep.comp``, ``delta_chunk.comp``): the
per-chunk matrices they pass between them are compute scratch owned here too
(``chunk_scratch``), shared by every layer (one layer's chunk form finishes before the
next one's starts), freed at ``all`` and made again on restore, never copied.
"""

from __future__ import annotations

import os

import attrs
import numpy as np

from trio_llm.errors import BackendError
from trio_llm.graph import Graph
from trio_llm.vulkan.memory import Allocator, Buffer, CopyJob, View, whole
from trio_llm.vulkan.ops import DELTA_CHUNK


def state_bytes(graph: Graph, n_seq: int) -> dict[int, int]:
    """Bytes of each stateful node's buffer, by node output id."""
    out: dict[int, int] = {}
    for nodes in graph.recurrent_layers().values():
        for n in nodes:
            if n.op == "ssm_conv":
                out[n.out.id] = 4 * n_seq * (n.attr("d_conv") - 1) * n.out.width
            else:
                d = n.attr("head_dim")
                out[n.out.id] = 4 * n_seq * n.attr("n_v_heads") * d * d
    return out


def chunked_prefill(device_type: str) -> bool:
    """Whether prefill buckets run the delta rule's chunked form instead of the token by
    token recurrence. Measured, it is not faster anywhere yet, so the recurrence is the
    default on every device: on the H200 (pp512, ``bench/decode.py --prefill-breakdown``,
    2026-12-01) qwen35-9b Q4_K_M's delta rule took 30.4 ms chunked against 19.9 ms as the
    recurrence, qwen35-0.8b's 13.9 against 13.5 ms; on lavapipe (tiny-qwen35, 200 tokens)
    1.36 s against 0.34 s. ``TRIO_LLM_DELTA_CHUNKED=1`` / ``0`` chooses by hand (tests,
    A/B); ``device_type`` stays for a device where it pays."""
    env = os.environ.get("TRIO_LLM_DELTA_CHUNKED")
    if env in ("0", "1"):
        return env == "1"
    del device_type
    return False


def chunk_scratch(graph: Graph, cap: int) -> dict[str, int]:
    """Bytes of the chunked prefill form's scratch for steps of up to ``cap`` tokens:
    per (token, v head) a row of the chunk's triangular solve ("T") and in-chunk
    attention ("P"), and the cumulative log decay ("G"); sized for the most v heads."""
    n_v = max((n.attr("n_v_heads") for ns in graph.recurrent_layers().values() for n in ns
               if n.op == "delta_net"), default=0)
    if not n_v:
        return {}
    return {"T": 4 * cap * n_v * DELTA_CHUNK, "P": 4 * cap * n_v * DELTA_CHUNK, "G": 4 * cap * n_v}


@attrs.define(eq=False)
class RecurrentState:
    alloc: Allocator
    sizes: dict[int, int]  # node id -> bytes
    work_sizes: dict[str, int] = attrs.field(factory=dict)  # chunked prefill scratch, name -> bytes
    n_seq: int = 1  # sequences: the most runs of a step (the chunked form's grid)
    bufs: dict[int, Buffer] = attrs.field(factory=dict)
    work: dict[str, Buffer] = attrs.field(factory=dict)
    staging: dict[str, Buffer] = attrs.field(factory=dict)  # copy_seq's host buffers, by memory kind
    host: dict[int, Buffer] = attrs.field(factory=dict)
    saved: bool = False

    def view(self, node_id: int) -> View:
        return whole(self.bufs[node_id])

    def work_view(self, name: str) -> View:
        return whole(self.work[name])

    def roles(self) -> dict[tuple[str, object], Buffer]:
        out: dict[tuple[str, object], Buffer] = {("rs", i): b for i, b in self.bufs.items()}
        out.update({("rs_work", n): b for n, b in self.work.items()})
        return out

    def allocate(self) -> None:
        try:
            if not self.bufs:
                for i, n in self.sizes.items():
                    self.bufs[i] = self.alloc.create(n, "kv_cache", "device")
            self._allocate_work()
        except BaseException:
            self.free_device()
            raise

    def _allocate_work(self) -> None:
        if not self.work:
            for name, n in self.work_sizes.items():
                self.work[name] = self.alloc.create(n, "compute", "device")

    def free_device(self) -> None:
        for b in [*self.bufs.values(), *self.work.values(), *self.staging.values()]:
            self.alloc.free(b)
        self.bufs = {}
        self.work = {}
        self.staging = {}

    def free_host(self) -> None:
        for b in self.host.values():
            self.alloc.free(b)
        self.host = {}
        self.saved = False

    def to_host(self) -> None:
        """Copy the state to host buffers (made once, kept) and free the device's."""
        if not self.bufs:
            return
        device = self.alloc.device
        vk = device.vk
        try:
            if set(self.host) != set(self.bufs):
                self.free_host()
                self.host = {i: self.alloc.create(b.size, "kv_cache", "host") for i, b in self.bufs.items()}
            with device.one_shot("copy recurrent state to host") as cmd:
                for i, src in self.bufs.items():
                    vk.vkCmdCopyBuffer(cmd, src.handle, self.host[i].handle, 1, [vk.VkBufferCopy(size=src.size)])
        except BaseException:
            self.free_host()
            raise
        self.free_device()
        self.saved = True

    def restore_jobs(self) -> list[CopyJob]:
        if not self.saved:
            self.allocate()
            return []
        self.free_device()
        self._allocate_work()
        jobs = []
        for i, src in self.host.items():
            def put(buf: Buffer, i: int = i) -> None:
                self.bufs[i] = buf

            jobs.append(CopyJob(src.size, "kv_cache", src, put))
        return jobs

    def copy_seq(self, seq_id: int, n_seq: int, flat: np.ndarray | None = None) -> np.ndarray:
        """One sequence's part of every node's buffer, node after node in the device
        layout, as one float32 vector: read (``flat`` None) or written from ``flat``,
        through a host buffer kept for the next call (freed with the device buffers)
        and one submit."""
        if not self.bufs:
            raise BackendError("recurrent state access while it is not on the device")
        device = self.alloc.device
        vk = device.vk
        parts = [(b, b.size // n_seq) for b in self.bufs.values()]
        total = sum(n for _, n in parts)
        to_device = flat is not None
        # writes from host memory, not "upload" (device-local host-visible where the device
        # has it): on the H200 that kept a state's size of device memory (19 MiB on
        # qwen35-0.8b, 50 on qwen35-9b) in every server that had restored a checkpoint
        kind = "host" if to_device else "readback"
        host = self.staging.get(kind)
        if host is None or host.size < total:
            if host is not None:
                self.alloc.free(host)
            host = self.staging[kind] = self.alloc.create(max(total, 4), "scratch", kind)
        assert host.array is not None
        if flat is not None:
            if flat.nbytes != total:
                raise BackendError(f"a recurrent state of {flat.nbytes} bytes; this model's has {total}")
            host.array[:total] = np.ascontiguousarray(flat, np.float32).view(np.uint8).reshape(-1)
        with device.one_shot("write recurrent state" if to_device else "read recurrent state") as cmd:
            at = 0
            for buf, n in parts:
                if to_device:
                    vk.vkCmdCopyBuffer(cmd, host.handle, buf.handle, 1,
                                       [vk.VkBufferCopy(srcOffset=at, dstOffset=seq_id * n, size=n)])
                else:
                    vk.vkCmdCopyBuffer(cmd, buf.handle, host.handle, 1,
                                       [vk.VkBufferCopy(srcOffset=seq_id * n, dstOffset=at, size=n)])
                at += n
        return flat if flat is not None else host.array[:total].view(np.float32).copy()

    def restored(self) -> None:
        self.saved = False

    @property
    def host_bytes(self) -> int:
        return sum(b.size for b in self.host.values())

"""The recurrent state of gated delta-net layers (qwen35) on the device.

Per graph node that keeps state, one buffer for every sequence: a conv node's last
``d_conv - 1`` inputs ``[n_seq][d_conv - 1][C]``, a delta rule's matrices
``[n_seq][n_v][d][d]`` (``shaders/ssm_conv.comp``, ``delta_net.comp``). The kernels
start a sequence from zeros whenever its run begins at position 0, so a fresh or a
restored-from-nothing buffer needs no clearing. Release at level ``all`` copies the
buffers to the host and back, as ``KVCache`` does; ``unload`` drops them (the server
then recomputes from position 0, which the kernels see).
"""

from __future__ import annotations

import attrs

from trio_llm.graph import Graph
from trio_llm.vulkan.memory import Allocator, Buffer, CopyJob, View, whole


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


@attrs.define(eq=False)
class RecurrentState:
    alloc: Allocator
    sizes: dict[int, int]  # node id -> bytes
    bufs: dict[int, Buffer] = attrs.field(factory=dict)
    host: dict[int, Buffer] = attrs.field(factory=dict)
    saved: bool = False

    def view(self, node_id: int) -> View:
        return whole(self.bufs[node_id])

    def roles(self) -> dict[tuple[str, object], Buffer]:
        return {("rs", i): b for i, b in self.bufs.items()}

    def allocate(self) -> None:
        if self.bufs or not self.sizes:
            return
        try:
            for i, n in self.sizes.items():
                self.bufs[i] = self.alloc.create(n, "kv_cache", "device")
        except BaseException:
            self.free_device()
            raise

    def free_device(self) -> None:
        for b in self.bufs.values():
            self.alloc.free(b)
        self.bufs = {}

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
        jobs = []
        for i, src in self.host.items():
            def put(buf: Buffer, i: int = i) -> None:
                self.bufs[i] = buf

            jobs.append(CopyJob(src.size, "kv_cache", src, put))
        return jobs

    def restored(self) -> None:
        self.saved = False

    @property
    def host_bytes(self) -> int:
        return sum(b.size for b in self.host.values())

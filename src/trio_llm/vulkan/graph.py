"""Record once, replay: a list of dispatches, barriers and copies in one command buffer.

Python through cffi costs microseconds per recorded command, so a model's forward pass
(hundreds of dispatches) is described once per shape bucket as a plain list of ops,
recorded into a command buffer with its own descriptor pool, and then only submitted.
What changes between steps (token ids, positions, sequence ids, how many tokens are
live) is written into the step buffer, which the shaders read; so one recorded graph
serves every step whose token count fits its bucket.

A graph references buffers by handle, through its descriptor sets (and its copies).
When residency frees buffers and creates new ones of the same sizes, the graph is kept:
``rebind`` points its descriptors at the new buffers (same offsets: the layouts do not
change) and marks the command buffer stale; the next ``encode`` (or ``run``) replays a
prepared list of commands into it, which costs a fraction of building and recording the
graph from scratch (``build_ops`` plus ``record``: about 10 ms for a 28-layer model on
our CPU, against well under 1 ms to replay). Updating a descriptor set invalidates the
command buffers that bound it, so a rebound graph is always re-encoded before it runs;
no driver feature beyond Vulkan 1.0 is needed (lavapipe lacks update-after-bind).
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import Any

import attrs

from trio_llm.vulkan.device import Device, vk_errors
from trio_llm.vulkan.kernels import Kernel
from trio_llm.vulkan.memory import Buffer, View


@attrs.frozen
class Dispatch:
    kernel: Kernel
    views: tuple[View, ...]
    push: tuple[int | float, ...]
    groups: tuple[int, int, int]


@attrs.frozen
class Barrier:
    """Everything written before is visible to everything after (compute and transfer)."""


@attrs.frozen
class Copy:
    src: View
    dst: View


Op = Dispatch | Barrier | Copy


def pack_push(values: Sequence[int | float]) -> bytes:
    """32-bit push constants: Python floats become f32, ints u32 (negative as i32)."""
    out = bytearray()
    for v in values:
        if isinstance(v, float):
            out += struct.pack("<f", v)
        elif v < 0:
            out += struct.pack("<i", v)
        else:
            out += struct.pack("<I", v)
    return bytes(out)


@attrs.define(eq=False)
class Graph:
    """A recorded command buffer, the descriptor sets it uses and what it was made of."""

    device: Device
    command_buffer: Any
    pool: Any
    n_dispatches: int
    ops: list[Op] = attrs.field(factory=list)
    _sets: list[Any] = attrs.field(factory=list)  # the descriptor set of each dispatch, in order
    # the descriptor writes (cffi arrays kept alive for rebinding) and, per write, the
    # buffer it points at now
    _infos: Any = None
    _writes: Any = None
    _write_bufs: list[Buffer] = attrs.field(factory=list)
    _final_host_read: bool = True
    _program: list[tuple[Any, tuple[Any, ...]]] | None = None
    _keep: list[Any] = attrs.field(factory=list)  # cffi objects the program points into
    _stale: bool = False
    _closed: bool = False
    _submit: Any = None  # (VkSubmitInfo*, VkCommandBuffer[1]) built on first run
    #: distinct descriptor sets (dispatches with the same kernel layout and views share one)
    n_sets: int = 0

    @classmethod
    def record(cls, device: Device, ops: Sequence[Op], *, final_host_read: bool = True) -> Graph:
        vk = device.vk
        dev = device.handle
        dispatches = [op for op in ops if isinstance(op, Dispatch)]
        # One descriptor set per distinct (set layout, views): a device-sampled graph
        # repeats one forward's dispatches for each of its steps, and sets per dispatch
        # made its descriptor pool 16 times larger than it needs to be; on the H200 the
        # driver keeps a pool in device memory for as long as the graph lives, a
        # released model's graphs included.
        unique: dict[tuple[Any, ...], int] = {}
        set_of: list[int] = []
        firsts: list[Dispatch] = []
        for op in dispatches:
            key = (op.kernel.set_layout, *((v.buffer, v.offset, v.size) for v in op.views))
            idx = unique.get(key)
            if idx is None:
                idx = unique[key] = len(firsts)
                firsts.append(op)
            set_of.append(idx)
        n_sets = max(1, len(firsts))
        n_desc = max(1, sum(len(op.views) for op in firsts))
        with vk_errors("record graph"):
            pool = vk.vkCreateDescriptorPool(
                dev,
                vk.VkDescriptorPoolCreateInfo(
                    maxSets=n_sets,
                    poolSizeCount=1,
                    pPoolSizes=[
                        vk.VkDescriptorPoolSize(type=vk.VK_DESCRIPTOR_TYPE_STORAGE_BUFFER, descriptorCount=n_desc)
                    ],
                ),
                None,
            )
            try:
                sets = vk.vkAllocateDescriptorSets(
                    dev,
                    vk.VkDescriptorSetAllocateInfo(
                        descriptorPool=pool,
                        descriptorSetCount=len(firsts),
                        pSetLayouts=[op.kernel.set_layout for op in firsts],
                    ),
                ) if firsts else []
                # One flat cffi array of descriptor writes filled field by field: the
                # binding's struct constructors cost ~20 us a struct, which made
                # recording a llama-1b graph (~1000 writes) slower than copying its
                # weights on a restore.
                ffi = vk.ffi
                n_writes = sum(len(op.views) for op in firsts)
                infos = ffi.new("VkDescriptorBufferInfo[]", max(1, n_writes))
                writes = ffi.new("VkWriteDescriptorSet[]", max(1, n_writes))
                write_bufs: list[Buffer] = []
                w = 0
                for dset, op in zip(sets, firsts, strict=True):
                    assert len(op.views) == op.kernel.n_bindings, (op.kernel.name, len(op.views))
                    for i, view in enumerate(op.views):
                        info = infos[w]
                        info.buffer = view.buffer.handle
                        info.offset = view.offset
                        info.range = view.size
                        wr = writes[w]
                        wr.sType = vk.VK_STRUCTURE_TYPE_WRITE_DESCRIPTOR_SET
                        wr.dstSet = dset
                        wr.dstBinding = i
                        wr.descriptorCount = 1
                        wr.descriptorType = vk.VK_DESCRIPTOR_TYPE_STORAGE_BUFFER
                        wr.pBufferInfo = infos + w
                        write_bufs.append(view.buffer)
                        w += 1
                if n_writes:
                    vk.lib.vkUpdateDescriptorSets(dev, n_writes, writes, 0, ffi.NULL)
                cmd = device.allocate_command_buffer()
            except BaseException:
                vk.vkDestroyDescriptorPool(dev, pool, None)
                raise
            graph = cls(device, cmd, pool, len(dispatches), list(ops), [sets[i] for i in set_of], infos, writes,
                        write_bufs, final_host_read, n_sets=len(firsts))
            try:
                graph.encode()
            except BaseException:
                graph.close()
                raise
        return graph

    def buffers(self) -> set[Buffer]:
        """Every buffer the graph's descriptors and copies point at now."""
        out = set(self._write_bufs)
        for op in self.ops:
            if isinstance(op, Copy):
                out.update((op.src.buffer, op.dst.buffer))
        return out

    def rebind(self, new: dict[Buffer, Buffer]) -> None:
        """Point every descriptor and copy at ``new[old]`` where the graph used ``old``
        (same sizes and offsets); the command buffer is re-encoded before the next run."""
        if not any(b in new for b in self.buffers()):
            return
        vk = self.device.vk
        for w, buf in enumerate(self._write_bufs):
            repl = new.get(buf)
            if repl is not None:
                assert repl.size == buf.size, (repl.size, buf.size)
                self._infos[w].buffer = repl.handle
                self._write_bufs[w] = repl
        for i, op in enumerate(self.ops):
            if isinstance(op, Copy) and (op.src.buffer in new or op.dst.buffer in new):
                src = View(new.get(op.src.buffer, op.src.buffer), op.src.offset, op.src.size)
                dst = View(new.get(op.dst.buffer, op.dst.buffer), op.dst.offset, op.dst.size)
                self.ops[i] = Copy(src, dst)
        self._program = None  # copies hold buffer handles
        # after this update the command buffer that bound these sets is invalid until
        # it is recorded again (Vulkan 1.0 rules): it is stale from here on
        self._stale = True
        with vk_errors("rebind graph"):
            if self._write_bufs:
                vk.lib.vkUpdateDescriptorSets(self.device.handle, len(self._write_bufs), self._writes, 0, vk.ffi.NULL)

    @property
    def stale(self) -> bool:
        return self._stale

    def encode(self) -> None:
        """(Re-)record the command buffer from the prepared command list."""
        if self._program is None:
            self._program = self._prepare()
        vk = self.device.vk
        with vk_errors("encode graph"):
            vk.vkBeginCommandBuffer(self.command_buffer, vk.VkCommandBufferBeginInfo())
            for fn, args in self._program:
                fn(*args)
            vk.vkEndCommandBuffer(self.command_buffer)
        self._stale = False

    def _prepare(self) -> list[tuple[Any, tuple[Any, ...]]]:
        """The commands of the graph as (entry point, arguments) pairs, every argument
        converted to its C form once, so that encoding is a loop of foreign calls."""
        ops, sets = self.ops, self._sets
        vk = self.device.vk
        cmd = self.command_buffer
        compute = vk.VK_PIPELINE_BIND_POINT_COMPUTE
        shader = vk.VK_PIPELINE_STAGE_COMPUTE_SHADER_BIT
        stages = shader | vk.VK_PIPELINE_STAGE_TRANSFER_BIT
        # the commands go straight to the loader's entry points (lib): the binding's
        # wrappers convert every argument in Python, ~10 us a call
        lib = vk.lib
        ffi = vk.ffi
        # Between two dispatches the barrier names the compute stage and shader access
        # only: on the H200 a barrier that also named the transfer stage and its
        # accesses cost about 15 us each (148 of them were 2.3 of a llama-1b step's
        # 3.1 ms). A barrier next to a copy keeps the transfer stage.
        shader_b = ffi.new("VkMemoryBarrier*", {
            "sType": vk.VK_STRUCTURE_TYPE_MEMORY_BARRIER,
            "srcAccessMask": vk.VK_ACCESS_SHADER_WRITE_BIT,
            "dstAccessMask": vk.VK_ACCESS_SHADER_READ_BIT | vk.VK_ACCESS_SHADER_WRITE_BIT})
        full_b = ffi.new("VkMemoryBarrier*", {
            "sType": vk.VK_STRUCTURE_TYPE_MEMORY_BARRIER,
            "srcAccessMask": vk.VK_ACCESS_SHADER_WRITE_BIT | vk.VK_ACCESS_TRANSFER_WRITE_BIT,
            "dstAccessMask": vk.VK_ACCESS_SHADER_READ_BIT | vk.VK_ACCESS_SHADER_WRITE_BIT
            | vk.VK_ACCESS_TRANSFER_READ_BIT | vk.VK_ACCESS_TRANSFER_WRITE_BIT})
        host_b = ffi.new("VkMemoryBarrier*", {
            "sType": vk.VK_STRUCTURE_TYPE_MEMORY_BARRIER,
            "srcAccessMask": vk.VK_ACCESS_SHADER_WRITE_BIT | vk.VK_ACCESS_TRANSFER_WRITE_BIT,
            "dstAccessMask": vk.VK_ACCESS_HOST_READ_BIT})
        keep: list[Any] = [shader_b, full_b, host_b]
        prog: list[tuple[Any, tuple[Any, ...]]] = []
        it = iter(sets)
        bound = None
        for i, op in enumerate(ops):
            if isinstance(op, Dispatch):
                k = op.kernel
                if bound is not k.pipeline:
                    prog.append((lib.vkCmdBindPipeline, (cmd, compute, k.pipeline)))
                    bound = k.pipeline
                set_arr = ffi.new("VkDescriptorSet[1]", [next(it)])
                keep.append(set_arr)
                prog.append((lib.vkCmdBindDescriptorSets, (cmd, compute, k.layout, 0, 1, set_arr, 0, ffi.NULL)))
                if k.n_push:
                    data = pack_push(op.push)
                    assert len(data) == 4 * k.n_push, (k.name, len(op.push), k.n_push)
                    buf = ffi.new("char[]", data)
                    keep.append(buf)
                    prog.append((lib.vkCmdPushConstants,
                                 (cmd, k.layout, vk.VK_SHADER_STAGE_COMPUTE_BIT, 0, len(data), buf)))
                prog.append((lib.vkCmdDispatch, (cmd, *op.groups)))
            elif isinstance(op, Barrier):
                near_copy = any(isinstance(o, Copy) for o in ops[max(0, i - 1) : i + 2])
                if near_copy:
                    prog.append((lib.vkCmdPipelineBarrier, (cmd, stages, stages, 0, 1, full_b, 0, ffi.NULL, 0, ffi.NULL)))
                else:
                    prog.append((lib.vkCmdPipelineBarrier, (cmd, shader, shader, 0, 1, shader_b, 0, ffi.NULL, 0, ffi.NULL)))
            else:
                region = ffi.new("VkBufferCopy*", {"srcOffset": op.src.offset, "dstOffset": op.dst.offset,
                                                   "size": op.src.size})
                keep.append(region)
                prog.append((lib.vkCmdCopyBuffer, (cmd, op.src.buffer.handle, op.dst.buffer.handle, 1, region)))
        if self._final_host_read:
            prog.append((lib.vkCmdPipelineBarrier,
                         (cmd, stages, vk.VK_PIPELINE_STAGE_HOST_BIT, 0, 1, host_b, 0, ffi.NULL, 0, ffi.NULL)))
        self._keep = keep
        return prog

    def run(self, what: str = "forward") -> None:
        """Submit the recorded work and wait for it (one submit, one fence)."""
        if self._stale:
            self.encode()
        if self._submit is None:
            ffi = self.device.vk.ffi
            cmds = ffi.new("VkCommandBuffer[1]", [self.command_buffer])
            info = ffi.new("VkSubmitInfo*", {"sType": self.device.vk.VK_STRUCTURE_TYPE_SUBMIT_INFO,
                                             "commandBufferCount": 1, "pCommandBuffers": cmds})
            self._submit = (info, cmds)  # cmds must live as long as info points at it
        self.device.submit_prepared(self._submit[0], what)

    def trim(self) -> None:
        """Give back the memory of the recorded commands (on a GPU the driver keeps them in
        device memory: the H200's counter kept 49 MiB for a released qwen35-0.8b where the
        backend held none); the descriptor sets stay, and the next run records it again.
        For release at level ``all``, whose restore moves every buffer and so re-records
        every graph anyway."""
        if self._closed:
            return
        vk = self.device.vk
        with vk_errors("trim graph"):
            vk.vkResetCommandBuffer(self.command_buffer, vk.VK_COMMAND_BUFFER_RESET_RELEASE_RESOURCES_BIT)
        self._stale = True

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        vk = self.device.vk
        self.device.free_command_buffer(self.command_buffer)
        vk.vkDestroyDescriptorPool(self.device.handle, self.pool, None)

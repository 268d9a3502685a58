"""Record once, replay: a list of dispatches, barriers and copies in one command buffer.

Python through cffi costs microseconds per recorded command, so a model's forward pass
(hundreds of dispatches) is described once per shape bucket as a plain list of ops,
recorded into a command buffer with its own descriptor pool, and then only submitted.
What changes between steps (token ids, positions, sequence ids, how many tokens are
live) is written into the step buffer, which the shaders read; so one recorded graph
serves every step whose token count fits its bucket.

A graph references buffers by handle. When residency frees and re-creates buffers the
owner drops its graphs (``close``) and records new ones on next use: recording costs
milliseconds, a restore happens at most once per wake.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import Any

import attrs

from trio_llm.vulkan.device import Device, vk_errors
from trio_llm.vulkan.kernels import Kernel
from trio_llm.vulkan.memory import View


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
    """A recorded command buffer and the descriptor sets it uses."""

    device: Device
    command_buffer: Any
    pool: Any
    n_dispatches: int
    _closed: bool = False
    _submit: Any = None  # (VkSubmitInfo*, VkCommandBuffer[1]) built on first run

    @classmethod
    def record(cls, device: Device, ops: Sequence[Op], *, final_host_read: bool = True) -> Graph:
        vk = device.vk
        dev = device.handle
        dispatches = [op for op in ops if isinstance(op, Dispatch)]
        n_sets = max(1, len(dispatches))
        n_desc = max(1, sum(len(op.views) for op in dispatches))
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
                        descriptorSetCount=len(dispatches),
                        pSetLayouts=[op.kernel.set_layout for op in dispatches],
                    ),
                ) if dispatches else []
                # One flat cffi array of descriptor writes filled field by field: the
                # binding's struct constructors cost ~20 us a struct, which made
                # recording a llama-1b graph (~1000 writes) slower than copying its
                # weights on a restore.
                ffi = vk.ffi
                n_writes = sum(len(op.views) for op in dispatches)
                infos = ffi.new("VkDescriptorBufferInfo[]", max(1, n_writes))
                writes = ffi.new("VkWriteDescriptorSet[]", max(1, n_writes))
                w = 0
                for dset, op in zip(sets, dispatches, strict=True):
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
                        w += 1
                if n_writes:
                    vk.lib.vkUpdateDescriptorSets(dev, n_writes, writes, 0, ffi.NULL)
                cmd = device.allocate_command_buffer()
            except BaseException:
                vk.vkDestroyDescriptorPool(dev, pool, None)
                raise
            graph = cls(device, cmd, pool, len(dispatches))
            try:
                graph._encode(ops, sets, final_host_read)
            except BaseException:
                graph.close()
                raise
        return graph

    def _encode(self, ops: Sequence[Op], sets: Sequence[Any], final_host_read: bool) -> None:
        vk = self.device.vk
        cmd = self.command_buffer
        compute = vk.VK_PIPELINE_BIND_POINT_COMPUTE
        shader = vk.VK_PIPELINE_STAGE_COMPUTE_SHADER_BIT
        stages = shader | vk.VK_PIPELINE_STAGE_TRANSFER_BIT
        # Between two dispatches the barrier names the compute stage and shader access
        # only: on the H200 a barrier that also named the transfer stage and its
        # accesses cost about 15 us each (148 of them were 2.3 of a llama-1b step's
        # 3.1 ms). A barrier next to a copy keeps the transfer stage.
        shader_barrier = vk.VkMemoryBarrier(
            srcAccessMask=vk.VK_ACCESS_SHADER_WRITE_BIT,
            dstAccessMask=vk.VK_ACCESS_SHADER_READ_BIT | vk.VK_ACCESS_SHADER_WRITE_BIT,
        )
        barrier = vk.VkMemoryBarrier(
            srcAccessMask=vk.VK_ACCESS_SHADER_WRITE_BIT | vk.VK_ACCESS_TRANSFER_WRITE_BIT,
            dstAccessMask=vk.VK_ACCESS_SHADER_READ_BIT
            | vk.VK_ACCESS_SHADER_WRITE_BIT
            | vk.VK_ACCESS_TRANSFER_READ_BIT
            | vk.VK_ACCESS_TRANSFER_WRITE_BIT,
        )
        vk.vkBeginCommandBuffer(cmd, vk.VkCommandBufferBeginInfo())
        # the commands go straight to the loader's entry points (lib): the binding's
        # wrappers convert every argument in Python, ~10 us a call
        lib = vk.lib
        ffi = vk.ffi
        set_arr = ffi.new("VkDescriptorSet[1]")
        shader_b = ffi.new("VkMemoryBarrier*", {"sType": vk.VK_STRUCTURE_TYPE_MEMORY_BARRIER,
                                                "srcAccessMask": shader_barrier.srcAccessMask,
                                                "dstAccessMask": shader_barrier.dstAccessMask})
        full_b = ffi.new("VkMemoryBarrier*", {"sType": vk.VK_STRUCTURE_TYPE_MEMORY_BARRIER,
                                              "srcAccessMask": barrier.srcAccessMask,
                                              "dstAccessMask": barrier.dstAccessMask})
        region = ffi.new("VkBufferCopy*")
        it = iter(sets)
        bound = None
        for i, op in enumerate(ops):
            if isinstance(op, Dispatch):
                k = op.kernel
                if bound is not k.pipeline:
                    lib.vkCmdBindPipeline(cmd, compute, k.pipeline)
                    bound = k.pipeline
                set_arr[0] = next(it)
                lib.vkCmdBindDescriptorSets(cmd, compute, k.layout, 0, 1, set_arr, 0, ffi.NULL)
                if k.n_push:
                    data = pack_push(op.push)
                    assert len(data) == 4 * k.n_push, (k.name, len(op.push), k.n_push)
                    lib.vkCmdPushConstants(
                        cmd, k.layout, vk.VK_SHADER_STAGE_COMPUTE_BIT, 0, len(data), ffi.from_buffer(data)
                    )
                lib.vkCmdDispatch(cmd, *op.groups)
            elif isinstance(op, Barrier):
                near_copy = any(isinstance(o, Copy) for o in ops[max(0, i - 1) : i + 2])
                if near_copy:
                    lib.vkCmdPipelineBarrier(cmd, stages, stages, 0, 1, full_b, 0, ffi.NULL, 0, ffi.NULL)
                else:
                    lib.vkCmdPipelineBarrier(cmd, shader, shader, 0, 1, shader_b, 0, ffi.NULL, 0, ffi.NULL)
            else:
                region.srcOffset = op.src.offset
                region.dstOffset = op.dst.offset
                region.size = op.src.size
                lib.vkCmdCopyBuffer(cmd, op.src.buffer.handle, op.dst.buffer.handle, 1, region)
        if final_host_read:
            host = vk.VkMemoryBarrier(
                srcAccessMask=vk.VK_ACCESS_SHADER_WRITE_BIT | vk.VK_ACCESS_TRANSFER_WRITE_BIT,
                dstAccessMask=vk.VK_ACCESS_HOST_READ_BIT,
            )
            vk.vkCmdPipelineBarrier(
                cmd, stages, vk.VK_PIPELINE_STAGE_HOST_BIT, 0, 1, [host], 0, None, 0, None
            )
        vk.vkEndCommandBuffer(cmd)

    def run(self, what: str = "forward") -> None:
        """Submit the recorded work and wait for it (one submit, one fence)."""
        if self._submit is None:
            ffi = self.device.vk.ffi
            cmds = ffi.new("VkCommandBuffer[1]", [self.command_buffer])
            info = ffi.new("VkSubmitInfo*", {"sType": self.device.vk.VK_STRUCTURE_TYPE_SUBMIT_INFO,
                                             "commandBufferCount": 1, "pCommandBuffers": cmds})
            self._submit = (info, cmds)  # cmds must live as long as info points at it
        self.device.submit_prepared(self._submit[0], what)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        vk = self.device.vk
        self.device.free_command_buffer(self.command_buffer)
        vk.vkDestroyDescriptorPool(self.device.handle, self.pool, None)

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
                writes = []
                for dset, op in zip(sets, dispatches, strict=True):
                    assert len(op.views) == op.kernel.n_bindings, (op.kernel.name, len(op.views))
                    for i, view in enumerate(op.views):
                        info = vk.VkDescriptorBufferInfo(buffer=view.buffer.handle, offset=view.offset, range=view.size)
                        writes.append(
                            vk.VkWriteDescriptorSet(
                                dstSet=dset,
                                dstBinding=i,
                                descriptorCount=1,
                                descriptorType=vk.VK_DESCRIPTOR_TYPE_STORAGE_BUFFER,
                                pBufferInfo=[info],
                            )
                        )
                if writes:
                    vk.vkUpdateDescriptorSets(dev, len(writes), writes, 0, None)
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
        stages = vk.VK_PIPELINE_STAGE_COMPUTE_SHADER_BIT | vk.VK_PIPELINE_STAGE_TRANSFER_BIT
        barrier = vk.VkMemoryBarrier(
            srcAccessMask=vk.VK_ACCESS_SHADER_WRITE_BIT | vk.VK_ACCESS_TRANSFER_WRITE_BIT,
            dstAccessMask=vk.VK_ACCESS_SHADER_READ_BIT
            | vk.VK_ACCESS_SHADER_WRITE_BIT
            | vk.VK_ACCESS_TRANSFER_READ_BIT
            | vk.VK_ACCESS_TRANSFER_WRITE_BIT,
        )
        vk.vkBeginCommandBuffer(cmd, vk.VkCommandBufferBeginInfo())
        it = iter(sets)
        bound = None
        for op in ops:
            if isinstance(op, Dispatch):
                k = op.kernel
                if bound is not k.pipeline:
                    vk.vkCmdBindPipeline(cmd, compute, k.pipeline)
                    bound = k.pipeline
                vk.vkCmdBindDescriptorSets(cmd, compute, k.layout, 0, 1, [next(it)], 0, None)
                if k.n_push:
                    data = pack_push(op.push)
                    assert len(data) == 4 * k.n_push, (k.name, len(op.push), k.n_push)
                    vk.vkCmdPushConstants(
                        cmd, k.layout, vk.VK_SHADER_STAGE_COMPUTE_BIT, 0, len(data), vk.ffi.from_buffer(data)
                    )
                vk.vkCmdDispatch(cmd, *op.groups)
            elif isinstance(op, Barrier):
                vk.vkCmdPipelineBarrier(cmd, stages, stages, 0, 1, [barrier], 0, None, 0, None)
            else:
                region = vk.VkBufferCopy(srcOffset=op.src.offset, dstOffset=op.dst.offset, size=op.src.size)
                vk.vkCmdCopyBuffer(cmd, op.src.buffer.handle, op.dst.buffer.handle, 1, [region])
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
        self.device.submit_and_wait([self.command_buffer], what)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        vk = self.device.vk
        self.device.free_command_buffer(self.command_buffer)
        vk.vkDestroyDescriptorPool(self.device.handle, self.pool, None)

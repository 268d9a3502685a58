"""Compute pipelines: one per (shader, defines, specialization constants), made once.

Every kernel binds only storage buffers (bindings 0..n-1, in the order the shader
declares them) and takes its static parameters as 32-bit push constants, which are
baked into the recorded command buffer. Values that change per step are not push
constants: they live in the step buffer (see ``graph.py``).
"""

from __future__ import annotations

from typing import Any

import attrs

from trio_llm.vulkan import shaders
from trio_llm.vulkan.device import Device, vk_errors


@attrs.frozen
class Kernel:
    name: str
    n_bindings: int
    n_push: int  # 32-bit words of push constants
    local_size: int
    pipeline: Any
    layout: Any
    set_layout: Any
    module: Any


@attrs.define(eq=False)
class KernelCache:
    """Pipelines of one device, keyed by everything that makes them differ."""

    device: Device
    _kernels: dict[tuple[object, ...], Kernel] = attrs.field(factory=dict)

    def get(
        self,
        name: str,
        *,
        n_bindings: int,
        n_push: int,
        local_size: int,
        defines: dict[str, object] | None = None,
        spec: dict[int, int] | None = None,
    ) -> Kernel:
        """The pipeline for ``name``; ``local_size`` is specialization constant 0."""
        spec_all = {0: local_size, **(spec or {})}
        key = (name, tuple(sorted((defines or {}).items())), tuple(sorted(spec_all.items())), n_bindings, n_push)
        kernel = self._kernels.get(key)
        if kernel is None:
            kernel = self._create(name, n_bindings, n_push, local_size, defines, spec_all)
            self._kernels[key] = kernel
        return kernel

    def _create(
        self,
        name: str,
        n_bindings: int,
        n_push: int,
        local_size: int,
        defines: dict[str, object] | None,
        spec: dict[int, int],
    ) -> Kernel:
        vk = self.device.vk
        dev = self.device.handle
        code = shaders.spirv(name, defines)
        with vk_errors(f"create pipeline {name}"):
            module = vk.vkCreateShaderModule(
                dev, vk.VkShaderModuleCreateInfo(codeSize=len(code), pCode=code), None
            )
            bindings = [
                vk.VkDescriptorSetLayoutBinding(
                    binding=i,
                    descriptorType=vk.VK_DESCRIPTOR_TYPE_STORAGE_BUFFER,
                    descriptorCount=1,
                    stageFlags=vk.VK_SHADER_STAGE_COMPUTE_BIT,
                )
                for i in range(n_bindings)
            ]
            set_layout = vk.vkCreateDescriptorSetLayout(
                dev, vk.VkDescriptorSetLayoutCreateInfo(bindingCount=n_bindings, pBindings=bindings), None
            )
            ranges = (
                [vk.VkPushConstantRange(stageFlags=vk.VK_SHADER_STAGE_COMPUTE_BIT, offset=0, size=4 * n_push)]
                if n_push
                else None
            )
            layout = vk.vkCreatePipelineLayout(
                dev,
                vk.VkPipelineLayoutCreateInfo(
                    setLayoutCount=1,
                    pSetLayouts=[set_layout],
                    pushConstantRangeCount=1 if n_push else 0,
                    pPushConstantRanges=ranges,
                ),
                None,
            )
            ids = sorted(spec)
            data = vk.ffi.new("uint32_t[]", [int(spec[i]) & 0xFFFFFFFF for i in ids])
            entries = [
                vk.VkSpecializationMapEntry(constantID=cid, offset=4 * j, size=4) for j, cid in enumerate(ids)
            ]
            spec_info = vk.VkSpecializationInfo(
                mapEntryCount=len(ids), pMapEntries=entries, dataSize=4 * len(ids), pData=data
            )
            stage = vk.VkPipelineShaderStageCreateInfo(
                stage=vk.VK_SHADER_STAGE_COMPUTE_BIT, module=module, pName="main", pSpecializationInfo=spec_info
            )
            pipeline = vk.vkCreateComputePipelines(
                dev, None, 1, [vk.VkComputePipelineCreateInfo(stage=stage, layout=layout)], None
            )[0]
        return Kernel(name, n_bindings, n_push, local_size, pipeline, layout, set_layout, module)

    def close(self) -> None:
        vk = self.device.vk
        dev = self.device.handle
        for k in self._kernels.values():
            vk.vkDestroyPipeline(dev, k.pipeline, None)
            vk.vkDestroyPipelineLayout(dev, k.layout, None)
            vk.vkDestroyDescriptorSetLayout(dev, k.set_layout, None)
            vk.vkDestroyShaderModule(dev, k.module, None)
        self._kernels.clear()

"""Compute pipelines: one per (shader, defines, specialization constants), made once.

Every kernel binds only storage buffers (bindings 0..n-1, in the order the shader
declares them) and takes its static parameters as 32-bit push constants, which are
baked into the recorded command buffer. Values that change per step are not push
constants: they live in the step buffer (see ``graph.py``).

Pipelines are compiled through a ``VkPipelineCache`` kept on disk (the user cache
directory, one file per device name and driver version), so only the first process
on a machine pays the driver's compile: on the H200 a model's pipelines took seconds,
and every ``trio-llm serve`` of a group would pay them again at start-up. The
driver checks the file's header itself and starts empty on a mismatch; a missing,
unreadable or corrupt file only costs the compile. ``TRIO_LLM_PIPELINE_CACHE=0``
turns it off.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
from pathlib import Path
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


log = logging.getLogger(__name__)


def default_cache_path(device: Device) -> Path | None:
    """Where the device's pipeline cache lives; None when turned off."""
    if os.environ.get("TRIO_LLM_PIPELINE_CACHE", "1") == "0":
        return None
    import platformdirs

    slug = re.sub(r"[^A-Za-z0-9]+", "-", device.name).strip("-")[:60] or "device"
    base = Path(platformdirs.user_cache_dir("trio-llm")) / "pipelines"
    return base / f"{slug}-{device.driver_version:x}.bin"


@attrs.define(eq=False)
class KernelCache:
    """Pipelines of one device, keyed by everything that makes them differ."""

    device: Device
    cache_path: Path | None = attrs.field(
        default=attrs.Factory(lambda self: default_cache_path(self.device), takes_self=True)
    )
    _kernels: dict[tuple[object, ...], Kernel] = attrs.field(factory=dict)
    _pcache: Any = None
    loaded_bytes: int = 0  # pipeline-cache bytes read from disk at creation
    dirty: bool = False  # pipelines were compiled since the last save

    def __attrs_post_init__(self) -> None:
        vk = self.device.vk
        data = b""
        if self.cache_path is not None:
            with contextlib.suppress(OSError):
                data = self.cache_path.read_bytes()
        for initial in (data, b""):  # a file the driver refuses: start empty instead
            try:
                info = vk.VkPipelineCacheCreateInfo(
                    initialDataSize=len(initial),
                    pInitialData=vk.ffi.from_buffer(initial) if initial else vk.ffi.NULL,
                )
                self._pcache = vk.vkCreatePipelineCache(self.device.handle, info, None)
                self.loaded_bytes = len(initial)
                return
            except vk.VkError as exc:
                log.info("pipeline cache %s not used: %s", self.cache_path, type(exc).__name__)
        self._pcache = None

    def save(self) -> None:
        """Write the pipeline cache to disk (atomically) if pipelines were compiled
        since the last save. What the file holds now (another process's pipelines,
        saved since this one read it: the servers of an arena, pytest's workers) is
        merged in first (``vkMergePipelineCaches``), so the last writer does not drop
        the others' pipelines. Failures only lose the cache, so they are logged."""
        if not self.dirty or self.cache_path is None or self._pcache is None:
            return
        self.dirty = False
        vk = self.device.vk
        self._merge_file()
        size = vk.ffi.new("size_t*")
        try:
            _ok(vk, vk.lib.vkGetPipelineCacheData(self.device.handle, self._pcache, size, vk.ffi.NULL))
            buf = vk.ffi.new("char[]", size[0])
            _ok(vk, vk.lib.vkGetPipelineCacheData(self.device.handle, self._pcache, size, buf))
            self.cache_path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.cache_path.with_name(f".{self.cache_path.name}.{os.getpid()}")
            tmp.write_bytes(bytes(vk.ffi.buffer(buf, size[0])))
            os.replace(tmp, self.cache_path)
        except (OSError, RuntimeError) as exc:
            log.info("pipeline cache not saved to %s: %s", self.cache_path, exc)

    def _merge_file(self) -> None:
        """Merge the cache file's current contents into this cache (a file the driver
        refuses, or none, merges nothing)."""
        assert self.cache_path is not None
        vk = self.device.vk
        try:
            data = self.cache_path.read_bytes()
        except OSError:
            return
        if not data:
            return
        try:
            info = vk.VkPipelineCacheCreateInfo(initialDataSize=len(data), pInitialData=vk.ffi.from_buffer(data))
            other = vk.vkCreatePipelineCache(self.device.handle, info, None)
        except vk.VkError as exc:
            log.info("pipeline cache %s not merged: %s", self.cache_path, type(exc).__name__)
            return
        try:
            vk.vkMergePipelineCaches(self.device.handle, self._pcache, 1, [other])
        except vk.VkError as exc:
            log.info("pipeline cache %s not merged: %s", self.cache_path, type(exc).__name__)
        finally:
            vk.vkDestroyPipelineCache(self.device.handle, other, None)

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
            flags = vk.VK_PIPELINE_CREATE_CAPTURE_STATISTICS_BIT_KHR if self.device.pipeline_stats else 0
            pipeline = vk.vkCreateComputePipelines(
                dev, self._pcache, 1, [vk.VkComputePipelineCreateInfo(flags=flags, stage=stage, layout=layout)], None
            )[0]
        self.dirty = True
        return Kernel(name, n_bindings, n_push, local_size, pipeline, layout, set_layout, module)

    def close(self) -> None:
        self.save()
        vk = self.device.vk
        dev = self.device.handle
        if self._pcache is not None:
            vk.vkDestroyPipelineCache(dev, self._pcache, None)
            self._pcache = None
        for k in self._kernels.values():
            vk.vkDestroyPipeline(dev, k.pipeline, None)
            vk.vkDestroyPipelineLayout(dev, k.layout, None)
            vk.vkDestroyDescriptorSetLayout(dev, k.set_layout, None)
            vk.vkDestroyShaderModule(dev, k.module, None)
        self._kernels.clear()


def statistics(device: Device, kernel: Kernel) -> dict[str, float]:
    """The driver's statistics of a pipeline's first executable (register count, local
    memory and so on, under the driver's own names) where ``device.pipeline_stats``
    (TRIO_LLM_PIPELINE_STATS=1); else empty. A diagnosis (bench/pipemem.py)."""
    if not device.pipeline_stats:
        return {}
    vk = device.vk
    ex = vk.VkPipelineExecutableInfoKHR(pipeline=kernel.pipeline, executableIndex=0)
    out: dict[str, float] = {}
    with vk_errors("pipeline statistics"):
        for st in device.fn("vkGetPipelineExecutableStatisticsKHR")(device.handle, ex):
            name = st.name if isinstance(st.name, str) else vk.ffi.string(st.name).decode()
            fmt = int(st.format)
            value = st.value
            out[name] = (float(value.b32) if fmt == 0 else float(value.i64) if fmt == 1
                         else float(value.u64) if fmt == 2 else float(value.f64))
    return out


def _ok(vk: Any, result: int) -> None:
    if result not in (vk.VK_SUCCESS, vk.VK_INCOMPLETE):
        raise RuntimeError(f"vkGetPipelineCacheData returned {result}")

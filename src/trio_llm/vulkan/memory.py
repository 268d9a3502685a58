"""Buffers, the allocator that accounts every device byte, and host shadows.

Each ``Buffer`` is one ``VkBuffer`` bound to its own ``VkDeviceMemory``: the model has
a few hundred large tensors packed into a handful of arenas, so dedicated allocations
stay far below ``maxMemoryAllocationCount`` and freeing a category is just freeing its
buffers. Shaders see a ``View`` (buffer, offset, size); a view never exceeds
``maxStorageBufferRange`` (callers split larger tensors by rows).

Host shadows keep read-only weights in host memory the GPU can copy from directly, so
a restore is one ``vkCmdCopyBuffer`` per arena instead of a memmove through staging.
Where ``VK_EXT_external_memory_host`` exists we first try to import the GGUF file's
mapped pages themselves (no copy at all); when the driver refuses, we copy the bytes
once into a host-visible allocation and keep that for the life of the backend.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import numpy as np

from trio_llm.errors import DeviceOutOfMemory
from trio_llm.vulkan.device import Device, vk_errors

log = logging.getLogger(__name__)

DEVICE_LOCAL = 0x1
HOST_VISIBLE = 0x2
HOST_COHERENT = 0x4
HOST_CACHED = 0x8

#: where a buffer lives: device memory, host memory written by the CPU (upload), or
#: host memory read by the CPU (readback)
PLACES = ("device", "upload", "readback", "host")


@attrs.define(eq=False)
class Buffer:
    """A VkBuffer with its own memory; ``array`` is a uint8 view when host-mapped."""

    handle: Any
    memory: Any
    size: int
    category: str
    place: str
    array: np.ndarray | None = None
    imported: bool = False  # memory is foreign host pages: never unmap/own them


@attrs.frozen
class View:
    """A byte range of a buffer, as bound to one shader binding."""

    buffer: Buffer
    offset: int
    size: int

    def sub(self, offset: int, size: int) -> View:
        assert offset + size <= self.size, (offset, size, self.size)
        return View(self.buffer, self.offset + offset, size)


def whole(buf: Buffer) -> View:
    return View(buf, 0, buf.size)


@attrs.define(eq=False)
class Allocator:
    """Creates and frees buffers and keeps the per-category byte count."""

    device: Device
    _live: set[Buffer] = attrs.field(factory=set)
    #: True for ``PlanAllocator``: buffers without memory, owners skip their device work
    planning = False

    def _usage(self) -> int:
        vk = self.device.vk
        return (
            vk.VK_BUFFER_USAGE_STORAGE_BUFFER_BIT
            | vk.VK_BUFFER_USAGE_TRANSFER_SRC_BIT
            | vk.VK_BUFFER_USAGE_TRANSFER_DST_BIT
        )

    def _memory_types(self, bits: int, place: str) -> list[int]:
        """Memory type indices for ``place``, best first (each tried in turn on OOM)."""
        d = self.device
        order: Sequence[tuple[int, int]]
        if place == "device":
            order = [(DEVICE_LOCAL, 0), (0, 0)]
        elif place == "upload":
            # resizable BAR memory lets small per-step buffers skip a copy
            order = [(DEVICE_LOCAL | HOST_VISIBLE | HOST_COHERENT, 0), (HOST_VISIBLE | HOST_COHERENT, 0)]
        elif place == "readback":
            order = [(HOST_VISIBLE | HOST_COHERENT | HOST_CACHED, 0), (HOST_VISIBLE | HOST_COHERENT, 0)]
        else:  # "host": host memory for shadows, not device-local where there is a choice
            order = [
                (HOST_VISIBLE | HOST_COHERENT, DEVICE_LOCAL | HOST_CACHED),
                (HOST_VISIBLE | HOST_COHERENT | HOST_CACHED, DEVICE_LOCAL),
                (HOST_VISIBLE | HOST_COHERENT, 0),
                (HOST_VISIBLE, 0),
            ]
        out: list[int] = []
        for want, avoid in order:
            idx = d.find_memory_type(bits, want, avoid)
            if idx is not None and idx not in out:
                out.append(idx)
        if not out:
            raise DeviceOutOfMemory(f"no memory type for {place} buffers")
        return out

    def create(self, size: int, category: str, place: str = "device") -> Buffer:
        """A new buffer of ``size`` bytes (rounded up to 256), mapped unless ``device``."""
        vk = self.device.vk
        dev = self.device.handle
        size = max(256, -(-size // 256) * 256)
        if size > self.device.limits.max_allocation_size:
            raise DeviceOutOfMemory(
                f"{category}: {size} bytes exceed maxMemoryAllocationSize "
                f"{self.device.limits.max_allocation_size}"
            )
        with vk_errors(f"allocate {size} bytes of {category}"):
            handle = vk.vkCreateBuffer(
                dev,
                vk.VkBufferCreateInfo(
                    size=size, usage=self._usage(), sharingMode=vk.VK_SHARING_MODE_EXCLUSIVE
                ),
                None,
            )
            try:
                req = vk.vkGetBufferMemoryRequirements(dev, handle)
                memory = self._allocate(req, place, handle)
            except BaseException:
                vk.vkDestroyBuffer(dev, handle, None)
                raise
            vk.vkBindBufferMemory(dev, handle, memory, 0)
            buf = Buffer(handle, memory, size, category, place)
            if place != "device":
                mapped = vk.vkMapMemory(dev, memory, 0, size, 0)
                buf.array = np.frombuffer(mapped, dtype=np.uint8)
        self._live.add(buf)
        return buf

    def _allocate(self, req: Any, place: str, buffer: Any) -> Any:
        """Memory for a buffer: the best type for ``place``, the next on refusal (a
        driver may refuse one heap, e.g. pinned host memory, and grant another).

        Always a *dedicated* allocation (VkMemoryDedicatedAllocateInfo, core since
        Vulkan 1.1): every buffer has its own memory anyway, and NVIDIA's driver (580,
        H200) allocates and frees dedicated memory about ten times faster: 1.25 GiB in
        256 MiB buffers took 32 ms to allocate and 26 ms to free without it, 3.8 and
        2.0 ms with it (bench/vkmem.py)."""
        vk = self.device.vk
        types = self._memory_types(req.memoryTypeBits, place)
        dedicated = vk.ffi.new("VkMemoryDedicatedAllocateInfo*")
        dedicated.sType = vk.VK_STRUCTURE_TYPE_MEMORY_DEDICATED_ALLOCATE_INFO
        dedicated.buffer = buffer
        for i, mtype in enumerate(types):
            try:
                return vk.vkAllocateMemory(
                    self.device.handle,
                    vk.VkMemoryAllocateInfo(pNext=dedicated, allocationSize=req.size, memoryTypeIndex=mtype),
                    None,
                )
            except (vk.VkErrorOutOfDeviceMemory, vk.VkErrorOutOfHostMemory):
                if i + 1 == len(types):
                    raise
                log.info("memory type %d refused %d bytes; trying type %d", mtype, req.size, types[i + 1])
        raise AssertionError("unreachable")

    def import_host(self, array: np.ndarray, category: str) -> Buffer | None:
        """Wrap existing host pages (e.g. a read-only file mapping) as a transfer source.

        ``array`` must start on ``minImportedHostPointerAlignment`` and its size be a
        multiple of it. Returns None when the extension is absent or the driver refuses
        the pages (file-backed, read-only mappings are refused by some drivers).
        """
        d = self.device
        align = d.limits.imported_host_alignment
        # On GPUs the attempt is opt-in: NVIDIA's driver (580) refuses read-only file
        # pages, and after that refusal the process's later pinned host allocations
        # failed too. CPU drivers (lavapipe) import them fine and save a full copy.
        default = "1" if d.device_type == "cpu" else "0"
        if not align or os.environ.get("TRIO_LLM_VK_HOST_IMPORT", default) == "0":
            return None
        vk = d.vk
        ptr = array.ctypes.data
        size = array.nbytes
        if ptr % align or size % align or size > d.limits.max_allocation_size:
            return None
        dev = d.handle
        # Only HOST_ALLOCATION: a file mapping is host memory in Vulkan's terms
        # (FOREIGN is for other devices' apertures), and on NVIDIA a second, foreign
        # attempt after a refused one left later host allocations failing.
        handle_type = vk.VK_EXTERNAL_MEMORY_HANDLE_TYPE_HOST_ALLOCATION_BIT_EXT
        try:
            buf = self._import(vk, dev, ptr, size, handle_type, category)
        except Exception as exc:  # the fallback (a one-time copy) always works
            log.info("host import refused: %s", type(exc).__name__)
            return None
        if buf is not None:
            buf.array = array
            self._live.add(buf)
        return buf

    def _import(self, vk: Any, dev: Any, ptr: int, size: int, handle_type: int, category: str) -> Buffer | None:
        host_props = vk.ffi.new("VkMemoryHostPointerPropertiesEXT*")
        host_props.sType = vk.VK_STRUCTURE_TYPE_MEMORY_HOST_POINTER_PROPERTIES_EXT
        get_props = self.device.fn("vkGetMemoryHostPointerPropertiesEXT")
        get_props(dev, handle_type, vk.ffi.cast("void*", ptr), host_props)
        bits = int(host_props.memoryTypeBits)
        if not bits:
            return None
        ext = vk.ffi.new("VkExternalMemoryBufferCreateInfo*")
        ext.sType = vk.VK_STRUCTURE_TYPE_EXTERNAL_MEMORY_BUFFER_CREATE_INFO
        ext.handleTypes = handle_type
        handle = vk.vkCreateBuffer(
            dev,
            vk.VkBufferCreateInfo(
                pNext=ext,
                size=size,
                usage=vk.VK_BUFFER_USAGE_TRANSFER_SRC_BIT,
                sharingMode=vk.VK_SHARING_MODE_EXCLUSIVE,
            ),
            None,
        )
        try:
            req = vk.vkGetBufferMemoryRequirements(dev, handle)
            bits &= int(req.memoryTypeBits)
            mtype = self.device.find_memory_type(bits, 0)
            if mtype is None:
                raise DeviceOutOfMemory("no memory type accepts the imported pages")
            imp = vk.ffi.new("VkImportMemoryHostPointerInfoEXT*")
            imp.sType = vk.VK_STRUCTURE_TYPE_IMPORT_MEMORY_HOST_POINTER_INFO_EXT
            imp.handleType = handle_type
            imp.pHostPointer = vk.ffi.cast("void*", ptr)
            memory = vk.vkAllocateMemory(
                dev, vk.VkMemoryAllocateInfo(pNext=imp, allocationSize=size, memoryTypeIndex=mtype), None
            )
        except BaseException:
            vk.vkDestroyBuffer(dev, handle, None)
            raise
        vk.vkBindBufferMemory(dev, handle, memory, 0)
        return Buffer(handle, memory, size, category, "host", imported=True)

    def free(self, buf: Buffer | None) -> None:
        if buf is None or buf not in self._live:
            return
        self._live.discard(buf)
        vk = self.device.vk
        dev = self.device.handle
        if buf.array is not None and not buf.imported:
            buf.array = None
            vk.vkUnmapMemory(dev, buf.memory)
        buf.array = None
        vk.vkDestroyBuffer(dev, buf.handle, None)
        vk.vkFreeMemory(dev, buf.memory, None)

    def is_live(self, buf: Buffer) -> bool:
        return buf in self._live

    def free_all(self) -> None:
        for buf in list(self._live):
            self.free(buf)

    def bytes_by_category(self) -> dict[str, int]:
        """Bytes of device memory held, by category; host shadows are not counted."""
        out: dict[str, int] = {}
        for buf in self._live:
            if buf.place == "host":
                continue
            out[buf.category] = out.get(buf.category, 0) + buf.size
        return out

    def host_bytes(self) -> int:
        """Bytes of host-visible shadow memory (imported pages count as zero copies)."""
        return sum(b.size for b in self._live if b.place == "host" and not b.imported)


def address_of(array: np.ndarray) -> int:
    return int(array.ctypes.data)


def host_span(base: int, size: int) -> np.ndarray:
    """A uint8 array over ``size`` bytes of host memory at ``base`` (no copy).

    Used to widen a tensor's mapped pages to the import alignment; the caller
    guarantees the span stays inside one live mapping.
    """
    return np.ctypeslib.as_array((ctypes.c_uint8 * size).from_address(base))


@attrs.frozen
class CopyJob:
    """One buffer of a restore: ``size`` bytes of ``category`` in device memory, filled
    from ``src`` (a host buffer); ``assign`` hands the new buffer to its owner."""

    size: int
    category: str
    src: Buffer
    assign: Callable[[Buffer], None]



class PlanAllocator(Allocator):
    """An ``Allocator`` that makes no Vulkan object: ``create`` returns a buffer with no
    handle (a zeroed host array where a real one would be mapped) and counts it as the
    real one would, rounded to 256 bytes; ``free`` forgets it. ``VulkanBackend.plan``
    builds a backend on it, so that ``--fit`` and ``--arena-budget`` project a model's
    device memory by running the backend's own sizing code, not a formula beside it.
    Owners skip their device work (uploads, fills) when ``alloc.planning`` is set."""

    planning = True

    def create(self, size: int, category: str, place: str = "device") -> Buffer:
        size = max(256, -(-size // 256) * 256)
        if size > self.device.limits.max_allocation_size:
            raise DeviceOutOfMemory(
                f"{category}: {size} bytes exceed maxMemoryAllocationSize "
                f"{self.device.limits.max_allocation_size}"
            )
        # np.zeros takes its pages lazily: a large readback buffer costs nothing here
        buf = Buffer(None, None, size, category, place, None if place == "device" else np.zeros(size, np.uint8))
        self._live.add(buf)
        return buf

    def free(self, buf: Buffer | None) -> None:
        if buf is not None:
            self._live.discard(buf)
            buf.array = None

def allocate_and_copy(alloc: Allocator, jobs: Sequence[CopyJob], during: Callable[[], None] | None = None) -> None:
    """Allocate each job's device buffer and copy its source into it, in order.

    Each copy is submitted as soon as its buffer exists, with no wait, and the GPU
    copies while the CPU allocates the next buffer: a restore costs the copies plus
    the first allocation, or the allocations plus the last copy, whichever is more.
    (Before allocations were dedicated, NVIDIA's driver took ~24 ms per GiB to
    allocate, more than the ~20 ms per GiB of the copy.) Callers order their jobs
    largest first, so that the copy left at the end is a small one (bench/vkmem.py
    measures the alternatives). ``during`` runs after the last submit and before the
    wait. Buffers are handed to their owners as they are made, so after a failure
    each owner frees what it got."""
    device = alloc.device
    vk = device.vk
    cmds: list[Any] = []
    submitted = False
    try:
        for i, job in enumerate(jobs):
            buf = alloc.create(job.size, job.category, "device")
            job.assign(buf)
            cmd = device.allocate_command_buffer()
            cmds.append(cmd)
            vk.vkBeginCommandBuffer(cmd, vk.VkCommandBufferBeginInfo(flags=vk.VK_COMMAND_BUFFER_USAGE_ONE_TIME_SUBMIT_BIT))
            region = vk.VkBufferCopy(srcOffset=0, dstOffset=0, size=min(job.size, job.src.size))
            vk.vkCmdCopyBuffer(cmd, job.src.handle, buf.handle, 1, [region])
            vk.vkEndCommandBuffer(cmd)
            # the fence of the last submit covers every earlier one on the queue
            device.submit([cmd], f"restore {job.category}", signal=i == len(jobs) - 1)
            submitted = True
        if during is not None:
            during()
        if submitted:
            device.wait("restore")
    except BaseException:
        if submitted:  # nothing may still be copying when the caller cleans up
            with contextlib.suppress(Exception):
                vk.vkQueueWaitIdle(device.queue)
        raise
    finally:
        for cmd in cmds:
            device.free_command_buffer(cmd)

"""The Vulkan instance, the chosen physical device, its logical device and its queue.

Everything that touches the driver maps the driver's errors to the typed errors of
``trio_llm.errors`` through :func:`vk_errors`, so a failed allocation or a lost device
reaches the server as ``DeviceOutOfMemory`` / ``DeviceLost`` and never as a raw cffi
exception. A machine without a Vulkan loader, or with a loader and no device, raises
``BackendUnavailable`` from :func:`open_device`.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import threading
from collections.abc import Iterator
from typing import Any

import attrs

from trio_llm.errors import BackendError, BackendUnavailable, DeviceLost, DeviceOutOfMemory

log = logging.getLogger(__name__)

_vk: Any = None


def vk_module() -> Any:
    """Import the ``vulkan`` package lazily: it dlopens the loader at import time."""
    global _vk
    if _vk is None:
        try:
            import vulkan
        except (OSError, ImportError) as exc:
            raise BackendUnavailable(f"no Vulkan loader: {exc}") from exc
        _vk = vulkan
    return _vk


@contextlib.contextmanager
def vk_errors(what: str) -> Iterator[None]:
    """Translate driver errors raised inside the block into typed backend errors."""
    vk = vk_module()
    try:
        yield
    except (vk.VkErrorOutOfDeviceMemory, vk.VkErrorOutOfHostMemory, vk.VkErrorOutOfPoolMemory) as exc:
        raise DeviceOutOfMemory(f"{what}: {type(exc).__name__}") from exc
    except vk.VkErrorDeviceLost as exc:
        raise DeviceLost(f"{what}: the device was lost") from exc
    except (vk.VkError, vk.VkException) as exc:
        raise BackendError(f"{what}: {type(exc).__name__}") from exc


def _check(vk: Any, result: int) -> None:
    """Raise the binding's exception for a VkResult error code (inside ``vk_errors``)."""
    if result < 0:
        import vulkan._vulkan as raw  # the binding's code -> exception table

        raise raw.exception_codes.get(result, vk.VkError)()


#: VkSubgroupFeatureFlagBits
SUBGROUP_ARITHMETIC, SUBGROUP_SHUFFLE, SUBGROUP_CLUSTERED = 0x4, 0x10, 0x40

_TYPE_RANK = {2: 0, 1: 1, 3: 2, 4: 3, 0: 4}  # discrete, integrated, virtual, cpu, other
_TYPE_NAME = {0: "other", 1: "integrated", 2: "discrete", 3: "virtual", 4: "cpu"}


@attrs.frozen
class DeviceLimits:
    max_storage_buffer_range: int
    max_allocation_size: int
    min_storage_offset_alignment: int
    max_shared_memory: int
    max_workgroup_count: tuple[int, int, int]
    subgroup_size: int
    imported_host_alignment: int  # 0 when VK_EXT_external_memory_host is absent
    #: VkSubgroupFeatureFlags the device reports for compute (SUBGROUP_* below): what a
    #: kernel may use beyond the basic and arithmetic operations every kernel needs
    subgroup_ops: int = 0

    def has_subgroup(self, flag: int) -> bool:
        return self.subgroup_ops & flag == flag


@attrs.define(eq=False)
class Device:
    """One logical device with one compute queue; owned by a single thread."""

    vk: Any
    instance: Any
    physical: Any
    handle: Any
    queue: Any
    queue_family: int
    name: str
    device_type: str
    api_version: str
    driver_version: int
    limits: DeviceLimits
    extensions: frozenset[str]
    memory_types: list[tuple[int, int]]  # (propertyFlags, heapIndex)
    memory_heaps: list[tuple[int, int]]  # (size, flags)
    command_pool: Any
    fence: Any
    #: 16x16x16 f16 x f16 -> f32 cooperative matrices at subgroup scope, enabled
    #: (VK_KHR_cooperative_matrix): prefill matmuls use matmul_cm.comp
    coopmat: bool = False
    #: shaderIntegerDotProduct reported and enabled (VK_KHR_shader_integer_dot_product):
    #: matvec.comp's X_Q8 form multiplies with dotPacked4x8EXT, else with plain int math
    int_dot: bool = False
    #: VK_NV_cooperative_matrix2 enabled with workgroup-scope matrices, reductions,
    #: per-element operations and tensor addressing (what attn_prefill_nv2.comp and
    #: matmul_nv2.comp use); off where any is missing, and with TRIO_LLM_NV_COOPMAT2=0
    nv_coopmat2: bool = False
    #: cooperativeMatrixWorkgroupScopeMaxWorkgroupSize (0 where nv_coopmat2 is off)
    nv_coopmat2_max_wg: int = 0
    #: matmul_nv2.comp's further needs, enabled where present: the extension's block loads
    #: (tensor layouts in ggml blocks) and bufferDeviceAddress (its decode functions take a
    #: buffer_reference, so its SPIR-V declares PhysicalStorageBufferAddresses)
    nv_coopmat2_decode: bool = False
    #: pipelines capture the driver's statistics (VK_KHR_pipeline_executable_properties,
    #: TRIO_LLM_PIPELINE_STATS=1: registers, local memory; ``kernels.statistics``), a diagnosis
    pipeline_stats: bool = False
    _fns: dict[str, Any] = attrs.field(factory=dict)
    _closed: bool = False
    # the queue, the fence and the command pool need external synchronization; a
    # backend holds this for each of its operations (uncontended with one model)
    lock: threading.RLock = attrs.field(factory=threading.RLock)
    # per-device objects that outlive one backend (the pipeline cache)
    extras: dict[str, Any] = attrs.field(factory=dict)

    @property
    def closed(self) -> bool:
        return self._closed

    # -- helpers ------------------------------------------------------------------

    def fn(self, name: str) -> Any:
        """A device-level extension entry point (looked up once)."""
        if name not in self._fns:
            self._fns[name] = self.vk.vkGetDeviceProcAddr(self.handle, name)
        return self._fns[name]

    def find_memory_type(self, type_bits: int, want: int, avoid: int = 0) -> int | None:
        """Index of the first memory type allowed by ``type_bits`` with all of ``want``."""
        for i, (flags, _heap) in enumerate(self.memory_types):
            if type_bits & (1 << i) and flags & want == want and not flags & avoid:
                return i
        return None

    def budget(self) -> list[dict[str, int]] | None:
        """Per-heap budget and usage from VK_EXT_memory_budget, where the driver has it."""
        if "VK_EXT_memory_budget" not in self.extensions:
            return None
        vk = self.vk
        budget = vk.ffi.new("VkPhysicalDeviceMemoryBudgetPropertiesEXT*")
        budget.sType = vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_MEMORY_BUDGET_PROPERTIES_EXT
        props = vk.ffi.new("VkPhysicalDeviceMemoryProperties2*")
        props.sType = vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_MEMORY_PROPERTIES_2
        props.pNext = budget
        vk.lib.vkGetPhysicalDeviceMemoryProperties2(self.physical, props)
        n = props.memoryProperties.memoryHeapCount
        return [
            {"heap": i, "budget": int(budget.heapBudget[i]), "usage": int(budget.heapUsage[i])}
            for i in range(n)
        ]

    def info(self) -> dict[str, object]:
        return {
            "name": self.name,
            "type": self.device_type,
            "api_version": self.api_version,
            "driver_version": self.driver_version,
            "max_storage_buffer_range": self.limits.max_storage_buffer_range,
            "max_allocation_size": self.limits.max_allocation_size,
            "subgroup_size": self.limits.subgroup_size,
            "subgroup_ops": self.limits.subgroup_ops,
            "max_shared_memory": self.limits.max_shared_memory,
            "external_memory_host": self.limits.imported_host_alignment > 0,
            "memory_heaps": [size for size, _ in self.memory_heaps],
            "memory_budget": self.budget(),
            "cooperative_matrix": self.coopmat,
            "nv_cooperative_matrix2": self.nv_coopmat2,
        }

    def submit_and_wait(self, command_buffers: list[Any], what: str) -> None:
        """Submit command buffers in one batch and block until the GPU finished them."""
        vk = self.vk
        with vk_errors(what):
            submit = vk.VkSubmitInfo(
                commandBufferCount=len(command_buffers), pCommandBuffers=command_buffers
            )
            vk.vkResetFences(self.handle, 1, [self.fence])
            vk.vkQueueSubmit(self.queue, 1, [submit], self.fence)
            vk.vkWaitForFences(self.handle, 1, [self.fence], vk.VK_TRUE, 0xFFFFFFFFFFFFFFFF)

    def submit_prepared(self, submit_info: Any, what: str) -> None:
        """``submit_and_wait`` for a ``VkSubmitInfo*`` built once (a recorded graph's):
        straight through the loader's entry points, since the binding's wrappers cost
        tens of microseconds per call in Python, per decoded token."""
        vk = self.vk
        lib = vk.lib
        fences = self.extras.get("fence_array")
        if fences is None:
            fences = self.extras["fence_array"] = vk.ffi.new("VkFence[1]", [self.fence])
        with vk_errors(what):
            _check(vk, lib.vkResetFences(self.handle, 1, fences))
            _check(vk, lib.vkQueueSubmit(self.queue, 1, submit_info, self.fence))
            _check(vk, lib.vkWaitForFences(self.handle, 1, fences, vk.VK_TRUE, 0xFFFFFFFFFFFFFFFF))

    def submit(self, command_buffers: list[Any], what: str, *, signal: bool = False) -> None:
        """Submit without waiting; with ``signal`` the fence is reset and signalled when
        this and everything submitted before it has finished (``wait``)."""
        vk = self.vk
        with vk_errors(what):
            submit = vk.VkSubmitInfo(
                commandBufferCount=len(command_buffers), pCommandBuffers=command_buffers
            )
            if signal:
                vk.vkResetFences(self.handle, 1, [self.fence])
            vk.vkQueueSubmit(self.queue, 1, [submit], self.fence if signal else None)

    def fence_done(self) -> bool:
        """Whether the last signalling submit has finished (the binding's wrapper
        raises on VK_NOT_READY, so this calls the loader's entry point)."""
        vk = self.vk
        with vk_errors("fence status"):
            result = vk.lib.vkGetFenceStatus(self.handle, self.fence)
            _check(vk, result)
        return bool(result == vk.VK_SUCCESS)

    def wait(self, what: str) -> None:
        """Block until the fence of the last signalling ``submit`` is signalled."""
        vk = self.vk
        with vk_errors(what):
            vk.vkWaitForFences(self.handle, 1, [self.fence], vk.VK_TRUE, 0xFFFFFFFFFFFFFFFF)

    def allocate_command_buffer(self) -> Any:
        vk = self.vk
        info = vk.VkCommandBufferAllocateInfo(
            commandPool=self.command_pool,
            level=vk.VK_COMMAND_BUFFER_LEVEL_PRIMARY,
            commandBufferCount=1,
        )
        with vk_errors("allocate command buffer"):
            return vk.vkAllocateCommandBuffers(self.handle, info)[0]

    def free_command_buffer(self, cmd: Any) -> None:
        self.vk.vkFreeCommandBuffers(self.handle, self.command_pool, 1, [cmd])

    def trim_command_pool(self) -> None:
        """Return the command pool's unused memory to the driver (vkTrimCommandPool, Vulkan
        1.1): after ``Graph.trim`` the pool would otherwise keep it for reuse."""
        with vk_errors("trim command pool"):
            self.vk.vkTrimCommandPool(self.handle, self.command_pool, 0)

    @contextlib.contextmanager
    def one_shot(self, what: str) -> Iterator[Any]:
        """Record a command buffer in the block; it is submitted and waited for on exit."""
        vk = self.vk
        cmd = self.allocate_command_buffer()
        try:
            vk.vkBeginCommandBuffer(
                cmd, vk.VkCommandBufferBeginInfo(flags=vk.VK_COMMAND_BUFFER_USAGE_ONE_TIME_SUBMIT_BIT)
            )
            yield cmd
            vk.vkEndCommandBuffer(cmd)
            self.submit_and_wait([cmd], what)
        finally:
            self.free_command_buffer(cmd)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        vk = self.vk
        with contextlib.suppress(Exception):
            vk.vkDeviceWaitIdle(self.handle)
        vk.vkDestroyFence(self.handle, self.fence, None)
        vk.vkDestroyCommandPool(self.handle, self.command_pool, None)
        vk.vkDestroyDevice(self.handle, None)
        vk.vkDestroyInstance(self.instance, None)


_SHARED: dict[str, Device] = {}
_SHARED_LOCK = threading.Lock()


def shared_device(selector: str | None = None) -> Device:
    """The process's device for ``selector``: opened on first use, kept until exit.

    A backend's ``close`` frees all of its device memory but leaves the (nearly
    memoryless) VkDevice and its pipelines to the next backend of the process: some
    drivers (NVIDIA 580 under gVisor) fail instance creation after a dozen
    create/destroy cycles, and lavapipe compiles every pipeline again for a new device.
    """
    if selector is None:
        selector = os.environ.get("TRIO_LLM_VK_DEVICE") or ""
    with _SHARED_LOCK:
        device = _SHARED.get(selector)
        if device is None or device.closed:
            device = open_device(selector or None)
            _SHARED[selector] = device
        return device


def _close_shared() -> None:
    with _SHARED_LOCK:
        for device in _SHARED.values():
            kernels = device.extras.pop("kernels", None)
            if kernels is not None:
                with contextlib.suppress(Exception):
                    kernels.close()
            with contextlib.suppress(Exception):
                device.close()
        _SHARED.clear()


atexit.register(_close_shared)


def _device_extensions(vk: Any, physical: Any) -> frozenset[str]:
    return frozenset(
        e.extensionName if isinstance(e.extensionName, str) else vk.ffi.string(e.extensionName).decode()
        for e in vk.vkEnumerateDeviceExtensionProperties(physical, None)
    )


def _name(vk: Any, props: Any) -> str:
    name = props.deviceName
    return name if isinstance(name, str) else vk.ffi.string(name).decode()


def choose(candidates: list[tuple[int, str, int]], selector: str | None) -> int:
    """Pick a device from ``(index, name, vk device type)``: an explicit selector (an
    index or a case-insensitive name substring) wins, else discrete before integrated
    before virtual before CPU (lavapipe), ties broken by enumeration order."""
    if not candidates:
        raise BackendUnavailable("the Vulkan loader found no device")
    if selector:
        sel = selector.strip()
        if sel.isdigit():
            for index, _, _ in candidates:
                if index == int(sel):
                    return index
            raise BackendUnavailable(f"no Vulkan device with index {sel} ({len(candidates)} found)")
        for index, name, _ in candidates:
            if sel.lower() in name.lower():
                return index
        names = ", ".join(name for _, name, _ in candidates)
        raise BackendUnavailable(f"no Vulkan device matches {sel!r} (found: {names})")
    return min(candidates, key=lambda c: (_TYPE_RANK.get(c[2], 9), c[0]))[0]


def list_devices() -> list[tuple[int, str, str, int]]:
    """Every Vulkan device the loader sees: (index, name, type, largest device-local
    heap in bytes), in enumeration order (``-dev VulkanN`` names index N). An instance
    is made and destroyed; no logical device. ``BackendUnavailable`` without a driver."""
    vk = vk_module()
    app = vk.VkApplicationInfo(pApplicationName="trio-llm", applicationVersion=1, pEngineName="trio-llm",
                               engineVersion=1, apiVersion=vk.VK_MAKE_VERSION(1, 2, 0))
    try:
        instance = vk.vkCreateInstance(vk.VkInstanceCreateInfo(pApplicationInfo=app), None)
    except (vk.VkErrorIncompatibleDriver, vk.VkErrorInitializationFailed) as exc:
        raise BackendUnavailable(f"no usable Vulkan driver: {type(exc).__name__}") from exc
    try:
        out = []
        for i, p in enumerate(vk.vkEnumeratePhysicalDevices(instance)):
            props = vk.vkGetPhysicalDeviceProperties(p)
            mem = vk.vkGetPhysicalDeviceMemoryProperties(p)
            local = [int(mem.memoryHeaps[h].size) for h in range(mem.memoryHeapCount)
                     if int(mem.memoryHeaps[h].flags) & 1]
            out.append((i, _name(vk, props), _TYPE_NAME.get(int(props.deviceType), "other"), max(local, default=0)))
        return out
    finally:
        vk.vkDestroyInstance(instance, None)


def open_device(selector: str | None = None) -> Device:
    """Create an instance and a logical device on the best (or the selected) device.

    ``selector`` defaults to ``$TRIO_LLM_VK_DEVICE``.
    """
    vk = vk_module()
    if selector is None:
        selector = os.environ.get("TRIO_LLM_VK_DEVICE") or None
    try:
        return _open(vk, selector)
    except (vk.VkErrorIncompatibleDriver, vk.VkErrorInitializationFailed) as exc:
        raise BackendUnavailable(f"no usable Vulkan driver: {type(exc).__name__}") from exc
    except (vk.VkError, vk.VkException) as exc:
        raise BackendError(f"opening the Vulkan device failed: {type(exc).__name__}") from exc


def _open(vk: Any, selector: str | None) -> Device:
    app = vk.VkApplicationInfo(
        pApplicationName="trio-llm",
        applicationVersion=1,
        pEngineName="trio-llm",
        engineVersion=1,
        apiVersion=vk.VK_MAKE_VERSION(1, 2, 0),
    )
    # no vk_errors here: open_device maps a missing or incompatible driver to
    # BackendUnavailable, which lets "--backend auto" fall back to numpy
    instance = vk.vkCreateInstance(vk.VkInstanceCreateInfo(pApplicationInfo=app), None)
    try:
        physicals = vk.vkEnumeratePhysicalDevices(instance)
        infos = []
        for i, p in enumerate(physicals):
            props = vk.vkGetPhysicalDeviceProperties(p)
            infos.append((i, _name(vk, props), int(props.deviceType)))
        index = choose(infos, selector)
        physical = physicals[index]
        return _create_logical(vk, instance, physical)
    except BaseException:
        vk.vkDestroyInstance(instance, None)
        raise


#: VK_NV_cooperative_matrix2's structure types. The ``vulkan`` package (1.3.275) predates
#: the extension, so its feature and property structures are laid out by hand below.
_NV_CM2_FEATURES = 1000593000
_NV_CM2_PROPERTIES = 1000593002
#: the feature structure's VkBool32s, in order, after sType and pNext
NV_CM2_FEATURE_NAMES = ("workgroup_scope", "flexible_dimensions", "reductions", "conversions",
                        "per_element", "tensor_addressing", "block_loads")
#: the ones attn_prefill_nv2.comp and matmul_nv2.comp need
NV_CM2_NEEDED = ("workgroup_scope", "reductions", "per_element", "tensor_addressing")


def _raw_struct(vk: Any, s_type: int, n_words: int, next_ptr: Any = None) -> Any:
    """A zeroed Vulkan structure the binding does not know: sType, pNext, then
    ``n_words`` 32-bit members (VkBool32 or uint32_t), as a ``uint32_t[]`` whose
    address goes into a pNext chain."""
    buf = vk.ffi.new("uint32_t[]", 4 + n_words)
    buf[0] = s_type
    if next_ptr is not None:
        vk.ffi.cast("void **", vk.ffi.cast("char *", buf) + 8)[0] = next_ptr
    return buf


def _chain_after(vk: Any, head: Any, struct: str, s_type: int, **fields: int) -> Any:
    """A new ``struct`` with ``fields`` set, linked into ``head``'s pNext chain right
    after it; the caller keeps the returned object alive until the chain is used."""
    node = vk.ffi.new(f"{struct}*")
    node.sType = s_type
    for name, value in fields.items():
        setattr(node, name, value)
    node.pNext = head.pNext
    head.pNext = node
    return node


#: VkComponentTypeKHR and VkScopeKHR values
_F16, _F32, _SUBGROUP = 0, 1, 3


def _has_f16_coopmat(vk: Any, instance: Any, physical: Any) -> bool:
    """Whether the device lists 16x16x16 f16 x f16 -> f32 at subgroup scope (what
    matmul_cm.comp multiplies), from its reported properties, not its vendor."""
    try:
        query = vk.vkGetInstanceProcAddr(instance, "vkGetPhysicalDeviceCooperativeMatrixPropertiesKHR")
        shapes = {(p.MSize, p.NSize, p.KSize, p.AType, p.BType, p.CType, p.ResultType, p.scope)
                  for p in query(physical)}
    except Exception as exc:  # an old loader or binding: no cooperative matrices
        log.info("cooperative matrix properties unavailable: %s", exc)
        return False
    return (16, 16, 16, _F16, _F16, _F32, _F32, _SUBGROUP) in shapes


def _create_logical(vk: Any, instance: Any, physical: Any) -> Device:
    props = vk.vkGetPhysicalDeviceProperties(physical)
    limits = props.limits
    extensions = _device_extensions(vk, physical)

    # subgroup size and maxMemoryAllocationSize come through the *2 query chain
    sub = vk.ffi.new("VkPhysicalDeviceSubgroupProperties*")
    sub.sType = vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_SUBGROUP_PROPERTIES
    maint3 = vk.ffi.new("VkPhysicalDeviceMaintenance3Properties*")
    maint3.sType = vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_MAINTENANCE_3_PROPERTIES
    sub.pNext = maint3
    host_props = vk.ffi.new("VkPhysicalDeviceExternalMemoryHostPropertiesEXT*")
    host_props.sType = vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_EXTERNAL_MEMORY_HOST_PROPERTIES_EXT
    has_host_import = "VK_EXT_external_memory_host" in extensions
    if has_host_import:
        maint3.pNext = host_props
    props2 = vk.ffi.new("VkPhysicalDeviceProperties2*")
    props2.sType = vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_PROPERTIES_2
    props2.pNext = sub
    vk.lib.vkGetPhysicalDeviceProperties2(physical, props2)

    # storage of 16-bit values is what the shaders read quantized blocks through
    f11 = vk.ffi.new("VkPhysicalDeviceVulkan11Features*")
    f11.sType = vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_VULKAN_1_1_FEATURES
    f12 = vk.ffi.new("VkPhysicalDeviceVulkan12Features*")
    f12.sType = vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_VULKAN_1_2_FEATURES
    f11.pNext = f12
    feats = vk.ffi.new("VkPhysicalDeviceFeatures2*")
    feats.sType = vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_FEATURES_2
    feats.pNext = f11
    want_cm = "VK_KHR_cooperative_matrix" in extensions and os.environ.get("TRIO_LLM_COOPMAT", "1") != "0"
    if want_cm:
        fcm = vk.ffi.new("VkPhysicalDeviceCooperativeMatrixFeaturesKHR*")
        fcm.sType = vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_COOPERATIVE_MATRIX_FEATURES_KHR
        f12.pNext = fcm
    # 4x8-bit integer dot products (dotPacked4x8EXT: matvec.comp's X_Q8 form), core in
    # Vulkan 1.3 and an extension before; used where the device reports the feature
    want_idot = "VK_KHR_shader_integer_dot_product" in extensions
    if want_idot:
        fid = vk.ffi.new("VkPhysicalDeviceShaderIntegerDotProductFeatures*")
        fid.sType = vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_SHADER_INTEGER_DOT_PRODUCT_FEATURES
        fid.pNext = f12.pNext
        f12.pNext = fid
    want_nv2 = (want_cm and "VK_NV_cooperative_matrix2" in extensions
                and os.environ.get("TRIO_LLM_NV_COOPMAT2", "1") != "0")
    nv2_feats = None
    if want_nv2:
        nv2_feats = _raw_struct(vk, _NV_CM2_FEATURES, len(NV_CM2_FEATURE_NAMES), feats.pNext)
        feats.pNext = vk.ffi.cast("void *", nv2_feats)
    vk.lib.vkGetPhysicalDeviceFeatures2(physical, feats)
    int_dot = want_idot and bool(fid.shaderIntegerDotProduct)
    coopmat = (want_cm and bool(fcm.cooperativeMatrix) and bool(f12.shaderFloat16)
               and bool(f12.vulkanMemoryModel) and _has_f16_coopmat(vk, instance, physical))
    nv_have = ({n: bool(nv2_feats[4 + i]) for i, n in enumerate(NV_CM2_FEATURE_NAMES)}
               if nv2_feats is not None else {})
    nv_coopmat2 = coopmat and bool(nv_have) and all(nv_have[n] for n in NV_CM2_NEEDED)
    nv_max_wg = 0
    if nv_coopmat2:
        nv_props = _raw_struct(vk, _NV_CM2_PROPERTIES, 3)
        p2 = vk.ffi.new("VkPhysicalDeviceProperties2*")
        p2.sType = vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_PROPERTIES_2
        p2.pNext = vk.ffi.cast("void *", nv_props)
        vk.lib.vkGetPhysicalDeviceProperties2(physical, p2)
        nv_max_wg = int(nv_props[4])  # cooperativeMatrixWorkgroupScopeMaxWorkgroupSize
        nv_coopmat2 = nv_max_wg >= 128
    # matmul_nv2's decode functions (nv_coopmat2_decode): block loads and bufferDeviceAddress
    nv_decode = nv_coopmat2 and nv_have["block_loads"] and bool(f12.bufferDeviceAddress)
    if nv_have:
        log.info("VK_NV_cooperative_matrix2 features: %s; workgroup-scope matrices up to %d lanes",
                 ", ".join(n for n, on in nv_have.items() if on) or "none", nv_max_wg)
    if not f11.storageBuffer16BitAccess:
        raise BackendUnavailable(f"{_name(vk, props)}: no 16-bit storage buffer access")

    want11 = vk.ffi.new("VkPhysicalDeviceVulkan11Features*")
    want11.sType = vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_VULKAN_1_1_FEATURES
    want11.storageBuffer16BitAccess = 1
    want12 = vk.ffi.new("VkPhysicalDeviceVulkan12Features*")
    want12.sType = vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_VULKAN_1_2_FEATURES
    want12.storageBuffer8BitAccess = f12.storageBuffer8BitAccess
    want12.shaderInt8 = f12.shaderInt8
    want12.shaderFloat16 = f12.shaderFloat16
    want11.pNext = want12
    if nv_decode:  # matmul_nv2 only (its decode functions' buffer_reference); no buffer takes an address
        want12.bufferDeviceAddress = 1
    if coopmat:
        want12.vulkanMemoryModel = 1
        want12.vulkanMemoryModelDeviceScope = f12.vulkanMemoryModelDeviceScope
        want_cmf = vk.ffi.new("VkPhysicalDeviceCooperativeMatrixFeaturesKHR*")
        want_cmf.sType = vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_COOPERATIVE_MATRIX_FEATURES_KHR
        want_cmf.cooperativeMatrix = 1
        want12.pNext = want_cmf
    keep: list[Any] = []  # the chained structures live until the device is made
    if int_dot:
        keep.append(_chain_after(vk, want12, "VkPhysicalDeviceShaderIntegerDotProductFeatures",
                                 vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_SHADER_INTEGER_DOT_PRODUCT_FEATURES,
                                 shaderIntegerDotProduct=1))
    pipeline_stats = (os.environ.get("TRIO_LLM_PIPELINE_STATS") == "1"
                      and "VK_KHR_pipeline_executable_properties" in extensions)
    if pipeline_stats:
        keep.append(_chain_after(vk, want12, "VkPhysicalDevicePipelineExecutablePropertiesFeaturesKHR",
                                 vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_PIPELINE_EXECUTABLE_PROPERTIES_FEATURES_KHR,
                                 pipelineExecutableInfo=1))
    want = vk.ffi.new("VkPhysicalDeviceFeatures2*")
    want.sType = vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_FEATURES_2
    want.pNext = want11
    want_nv2_feats = None
    if nv_coopmat2:  # every feature the device has, enabled (chained ahead of want11)
        want_nv2_feats = _raw_struct(vk, _NV_CM2_FEATURES, len(NV_CM2_FEATURE_NAMES), want.pNext)
        for i, n in enumerate(NV_CM2_FEATURE_NAMES):
            want_nv2_feats[4 + i] = int(nv_have[n])
        want.pNext = vk.ffi.cast("void *", want_nv2_feats)
    want.features.shaderInt16 = feats.features.shaderInt16

    families = vk.vkGetPhysicalDeviceQueueFamilyProperties(physical)
    family = next(
        (i for i, f in enumerate(families) if f.queueFlags & vk.VK_QUEUE_COMPUTE_BIT), None
    )
    if family is None:
        raise BackendUnavailable(f"{_name(vk, props)}: no compute queue")

    enable: list[str] = [e for e in ("VK_EXT_external_memory_host", "VK_EXT_memory_budget") if e in extensions]
    if coopmat:
        enable.append("VK_KHR_cooperative_matrix")
    if nv_coopmat2:
        enable.append("VK_NV_cooperative_matrix2")
    if int_dot:
        enable.append("VK_KHR_shader_integer_dot_product")
    if pipeline_stats:
        enable.append("VK_KHR_pipeline_executable_properties")
    queue_info = vk.VkDeviceQueueCreateInfo(
        queueFamilyIndex=family, queueCount=1, pQueuePriorities=[1.0]
    )
    create = vk.VkDeviceCreateInfo(
        pNext=want,
        queueCreateInfoCount=1,
        pQueueCreateInfos=[queue_info],
        enabledExtensionCount=len(enable),
        ppEnabledExtensionNames=enable,
    )
    with vk_errors("create device"):
        handle = vk.vkCreateDevice(physical, create, None)
    queue = vk.vkGetDeviceQueue(handle, family, 0)
    pool = vk.vkCreateCommandPool(
        handle,
        vk.VkCommandPoolCreateInfo(
            flags=vk.VK_COMMAND_POOL_CREATE_RESET_COMMAND_BUFFER_BIT, queueFamilyIndex=family
        ),
        None,
    )
    fence = vk.vkCreateFence(handle, vk.VkFenceCreateInfo(), None)

    mem = vk.vkGetPhysicalDeviceMemoryProperties(physical)
    memory_types = [
        (int(mem.memoryTypes[i].propertyFlags), int(mem.memoryTypes[i].heapIndex))
        for i in range(mem.memoryTypeCount)
    ]
    memory_heaps = [
        (int(mem.memoryHeaps[i].size), int(mem.memoryHeaps[i].flags))
        for i in range(mem.memoryHeapCount)
    ]
    v = int(props.apiVersion)
    device = Device(
        vk=vk,
        instance=instance,
        physical=physical,
        handle=handle,
        queue=queue,
        queue_family=family,
        name=_name(vk, props),
        device_type=_TYPE_NAME.get(int(props.deviceType), "other"),
        api_version=f"{v >> 22}.{(v >> 12) & 0x3FF}.{v & 0xFFF}",
        driver_version=int(props.driverVersion),
        limits=DeviceLimits(
            max_storage_buffer_range=int(limits.maxStorageBufferRange),
            max_allocation_size=int(maint3.maxMemoryAllocationSize),
            min_storage_offset_alignment=int(limits.minStorageBufferOffsetAlignment),
            max_shared_memory=int(limits.maxComputeSharedMemorySize),
            max_workgroup_count=tuple(int(x) for x in limits.maxComputeWorkGroupCount),  # type: ignore[arg-type]
            subgroup_size=int(sub.subgroupSize),
            imported_host_alignment=(
                int(host_props.minImportedHostPointerAlignment) if has_host_import else 0
            ),
            subgroup_ops=(int(sub.supportedOperations)
                          if int(sub.supportedStages) & vk.VK_SHADER_STAGE_COMPUTE_BIT else 0),
        ),
        extensions=extensions,
        memory_types=memory_types,
        memory_heaps=memory_heaps,
        command_pool=pool,
        fence=fence,
        coopmat=coopmat,
        int_dot=int_dot,
        nv_coopmat2=nv_coopmat2,
        nv_coopmat2_max_wg=nv_max_wg,
        pipeline_stats=pipeline_stats,
        nv_coopmat2_decode=nv_decode,
    )
    log.info(
        "vulkan device: %s (%s, Vulkan %s), storage range %d MiB, subgroup %d, cooperative matrices %s",
        device.name,
        device.device_type,
        device.api_version,
        device.limits.max_storage_buffer_range >> 20,
        device.limits.subgroup_size,
        "on" if coopmat else "off",
    )
    log.info("vulkan device: integer dot products %s, NV cooperative matrices 2 %s",
             "on" if int_dot else "off", "on" if nv_coopmat2 else "off")
    return device

"""``--fit``: choose the context size the user did not set so the model fits the device.

llama-server's ``--fit on`` (its default) adjusts the arguments the user left unset
until the projected memory use fits the free device memory minus ``--fit-target``
MiB; it lowers the context no further than ``--fit-ctx``. Here the whole model always
runs on the device (no layers move to the CPU), so the context is the one thing to
adjust: ``choose_ctx`` is that decision, a search over a projection of the bytes a
context needs, and ``device_free_bytes`` reads the free memory of the Vulkan device the
backend will use.

The projection is the Vulkan backend's own plan (``VulkanBackend.plan``: its
constructor's sizing on an allocator that makes nothing), so it counts what the backend
will hold: the weights' device segments, the K and V of the attention layers only (a
hybrid's delta-net layers have none; a sliding-window layer keeps its window and a
pass), the recurrent state, the activations of its largest pass, the attention's
partials, and the upload and readback buffers. Where the backend cannot plan (no
Vulkan), ``linear_need`` is the formula: the weights as stored
(``GGUFModel.weight_bytes``), every layer's K and V (``kv_bytes_per_position`` x
positions, of the ``-ctk``/``-ctv`` types; K only for a latent cache), and a compute
reserve for one pass of ``n_batch`` tokens (``compute_bytes``).
A context the user set is kept even when it does not fit (llama-server would move
layers to the CPU, which cannot happen here): that is logged, and the load then fails
or succeeds on the device's own terms.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import attrs

from trio_llm.errors import BackendError
from trio_llm.model.config import ModelConfig

log = logging.getLogger(__name__)

MiB = 1 << 20

#: bytes per element of each KV cache type (ggml's block sizes: 32 elements a block)
CACHE_TYPE_BYTES: dict[str, float] = {
    "f32": 4.0, "f16": 2.0, "bf16": 2.0,
    "q8_0": 34 / 32, "q4_0": 18 / 32, "q4_1": 20 / 32, "q5_0": 22 / 32, "q5_1": 24 / 32,
}

#: contexts are chosen in steps of this many positions per slot (llama.cpp pads to 256)
CTX_STEP = 256


def kv_bytes_per_position(cfg: ModelConfig, type_k: str, type_v: str) -> int:
    """K and V of every layer that owns a cache, each of its own heads (gemma4's differ
    by layer, and its shared-KV layers have none), for one position; K alone for a
    latent cache (MLA: ``cfg.kv_parts`` 1, whose V is a view of K and takes no bytes, as
    in llama.cpp)."""
    v = CACHE_TYPE_BYTES[type_v] if cfg.kv_parts == 2 else 0.0
    dims = sum(cfg.layer_n_head_kv(il) * cfg.layer_head_dim(il) for il in range(cfg.n_layer) if cfg.has_kv(il))
    return int(dims * (CACHE_TYPE_BYTES[type_k] + v))


#: the most tokens whose logits the reserve counts: a pass reads back only each
#: sequence's last row, so a physical batch (-ub) above llama-server's default 512 adds
#: activations, not logits (at -ub 4096 the vocabulary's rows would otherwise be most of
#: the reserve: 2 GiB for a 128k vocabulary)
LOGIT_ROWS = 512


def compute_bytes(cfg: ModelConfig, n_batch: int) -> int:
    """The reserve of one forward pass: per token the residual stream, attention and
    feed-forward activations, and the logits of up to ``LOGIT_ROWS`` tokens, in float32."""
    return 4 * (n_batch * (4 * cfg.n_embd + 2 * cfg.n_ff) + min(n_batch, LOGIT_ROWS) * cfg.n_vocab)


@attrs.frozen
class FitChoice:
    ctx_size: int  # total positions over all slots
    fits: bool
    need: int  # projected bytes at ctx_size
    budget: int  # free bytes minus the margin
    changed: bool


def linear_need(*, weights: int, per_position: int, compute: int) -> Callable[[int], int]:
    """The formula projection: weights, a compute reserve, and every layer's K and V
    for each position (what ``choose_ctx`` is given where the backend cannot plan)."""
    return lambda ctx: weights + compute + per_position * ctx


def choose_ctx(
    *, ctx_size: int, ctx_set: bool, n_ctx_train: int, parallel: int, need: Callable[[int], int],
    free: int, margin: int, fit_ctx: int,
) -> FitChoice:
    """The context to load with. ``ctx_size`` 0 means the model's training context;
    ``need(positions)`` projects the device bytes at a total context, and does not fall
    as the context grows (the search for the largest that fits relies on it)."""
    total = ctx_size or n_ctx_train
    budget = free - margin
    at_total = need(total)
    if at_total <= budget or ctx_set:
        return FitChoice(total, at_total <= budget, at_total, budget, False)
    step = CTX_STEP * parallel
    lo, hi = 0, total // step  # the most steps that fit: lo fits (0 trivially), hi + 1 does not
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if need(mid * step) <= budget:
            lo = mid
        else:
            hi = mid - 1
    floor = min(fit_ctx, total)
    chosen = max(min(lo * step, total), floor)
    at = need(chosen)
    return FitChoice(chosen, at <= budget, at, budget, chosen != total)


def device_free_bytes(selector: str | None = None) -> int | None:
    """Free bytes of the device-local heap of the Vulkan device the backend uses
    (VK_EXT_memory_budget: budget minus usage; else the heap's size); None without
    a usable Vulkan device."""
    try:
        from trio_llm.vulkan.device import shared_device

        device = shared_device(selector)
    except (ImportError, OSError, BackendError) as exc:  # no loader, no device: nothing to fit
        log.debug("fit: no Vulkan device (%s)", exc)
        return None
    local = [i for i, (_size, flags) in enumerate(device.memory_heaps) if flags & 1] or [0]
    heap = max(local, key=lambda i: device.memory_heaps[i][0])
    budget = device.budget()
    if budget:
        return int(budget[heap]["budget"] - budget[heap]["usage"])
    return int(device.memory_heaps[heap][0])


@attrs.frozen
class DeviceMemory:
    """The device-local heap the backend would use: its size, and the budget the driver
    grants this process (``VK_EXT_memory_budget``; the size where it is missing)."""

    name: str
    heap_bytes: int
    budget_bytes: int


def device_memory(selector: str | None = None) -> DeviceMemory | None:
    """The largest device-local heap of the Vulkan device; None without one."""
    try:
        from trio_llm.vulkan.device import shared_device

        device = shared_device(selector)
    except (ImportError, OSError, BackendError) as exc:
        log.debug("fit: no Vulkan device (%s)", exc)
        return None
    local = [i for i, (_size, flags) in enumerate(device.memory_heaps) if flags & 1] or [0]
    heap = max(local, key=lambda i: device.memory_heaps[i][0])
    size = int(device.memory_heaps[heap][0])
    budget = device.budget()
    granted = int(budget[heap]["budget"]) if budget else size
    return DeviceMemory(str(getattr(device, "name", "the device")), size, granted)


def footprint_bytes(cfg: ModelConfig, *, weights: int, ctx_total: int, type_k: str, type_v: str,
                    n_batch: int) -> int:
    """The device bytes a loaded model uses, as ``choose_ctx`` projects them: what a
    co-resident counts against ``--arena-budget``."""
    return weights + compute_bytes(cfg, n_batch) + kv_bytes_per_position(cfg, type_k, type_v) * ctx_total

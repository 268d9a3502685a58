"""Pick and build the compute backend for a loaded model (``--backend``).

"auto" prefers Vulkan and falls back to the numpy reference when this machine has no
usable Vulkan (no loader, no device): the server then still runs, slowly, and says
so once in the log instead of refusing to start. An explicit "vulkan" never falls
back, so a deployment that expects a GPU fails loudly without one.
"""

from __future__ import annotations

import logging
from typing import Any, Literal

from trio_llm.engine.backend import Backend, Progress
from trio_llm.errors import BackendUnavailable, InvalidRequest
from trio_llm.model.gguf import GGUFModel
from trio_llm.model.kvtypes import DEFAULT_KV_TYPE

log = logging.getLogger(__name__)

BackendKind = Literal["auto", "numpy", "vulkan"]
BACKEND_KINDS: tuple[str, ...] = ("auto", "numpy", "vulkan")


def open_backend(
    kind: str,
    model: GGUFModel,
    *,
    n_ctx: int,
    n_seq: int,
    progress: Progress | None = None,
    cache_type_k: str = DEFAULT_KV_TYPE,
    cache_type_v: str = DEFAULT_KV_TYPE,
    n_cpu_moe: float = 0.0,
    output: str = "logits",
    max_chunk: int | None = None,
    device: str | None = None,
) -> Backend:
    """Build the backend named by ``kind``; raises ``BackendUnavailable`` when an
    explicit "vulkan" cannot run here and ``InvalidRequest`` for an unknown kind.
    ``output`` is what its graph computes (``trio_llm.graph.Output``: an embedding
    server's backend ends at the hidden states or the rank head). ``max_chunk`` is the
    physical batch (-ub): the most prompt tokens one forward pass takes (the backend's
    default, 512, when None; the Vulkan backend takes at most 4096 a pass). ``device``:
    the Vulkan device's selector (``-dev``: its index; None: the best one)."""
    if kind not in BACKEND_KINDS:
        raise InvalidRequest(f"unknown backend {kind!r} (choose from {', '.join(BACKEND_KINDS)})")
    kw: dict[str, Any] = dict(n_ctx=n_ctx, n_seq=n_seq, progress=progress, cache_type_k=cache_type_k,
                              cache_type_v=cache_type_v)
    if output != "logits":
        kw["output"] = output
    if max_chunk is not None:
        kw["max_chunk"] = max_chunk
    if n_cpu_moe:
        from trio_llm.engine.placement import cpu_moe_tensors

        cpu_moe_tensors(model.config, n_cpu_moe)  # a bad count is refused on either backend
    if kind == "numpy":
        return _numpy(model, **kw)  # everything is in host memory already
    try:
        return _vulkan(model, **kw, **({"n_cpu_moe": n_cpu_moe} if n_cpu_moe else {}),
                       **({"device": device} if device is not None else {}))
    except BackendUnavailable as exc:
        if kind == "vulkan":
            raise
        log.warning("Vulkan is unavailable (%s); using the numpy reference backend", exc)
    return _numpy(model, **kw)


def _numpy(model: GGUFModel, **kw: Any) -> Backend:
    from trio_llm.engine.reference import NumpyBackend

    return NumpyBackend(model, **kw)


def _vulkan(model: GGUFModel, **kw: Any) -> Backend:
    try:
        # Imported here so that "numpy" never loads cffi or libvulkan. The vulkan
        # package raises OSError at import when libvulkan.so is missing, and an
        # install without the cffi bindings fails with ImportError: both mean this
        # machine cannot run Vulkan, which is what the caller needs to hear.
        from trio_llm.vulkan.backend import VulkanBackend
    except (OSError, ImportError) as exc:
        raise BackendUnavailable(f"cannot load the Vulkan backend: {exc}") from None
    backend: Backend = VulkanBackend(model, **kw)
    return backend

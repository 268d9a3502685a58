"""``trio-llm serve``: the flags, and the root nursery that starts the actors in order.

Start-up order: bind the HTTP port first (``/health`` answers 503 while loading, so a
process manager sees the server come up), load the model on a worker thread with a
progress bar, start the backend actor, the residency gate, the queue and the slots
loop, warm up, then publish the engine to the HTTP edge.

Shutdown (SIGINT/SIGTERM, or ``ServerHandle.shutdown()``): hypercorn stops accepting
and gives in-flight requests ``--shutdown-timeout`` seconds (the engine keeps running
meanwhile, so they can finish); then the actors are cancelled, the backend is closed
through its actor (shielded, bounded), and ``serve`` returns. A second signal skips
the grace period. A load in progress is abandoned at its next progress report.
"""

from __future__ import annotations

import inspect
import logging
import os
import signal
import sys
from collections.abc import Mapping, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import attrs
import hypercorn.config
import hypercorn.trio
import numpy as np
import trio

from trio_llm import __version__
from trio_llm.config import ServerConfig
from trio_llm.engine.actor import BackendActor, BackendClient
from trio_llm.engine.backend import Backend, SeqBatch
from trio_llm.engine.constraint import Grammars
from trio_llm.engine.devsample import DeviceChain
from trio_llm.errors import (
    ArenaRefused,
    BackendError,
    ConfigError,
    InvalidRequest,
    ModelLoadError,
    TrioLLMError,
)
from trio_llm.residency.arbiter import Arbiter, Share, open_arbiter
from trio_llm.residency.residency import Residency, resolve_level
from trio_llm.residency.sleep import SleepConfig, SleepController
from trio_llm.server import embeddings, flags
from trio_llm.server.context import Engine, ServerContext
from trio_llm.server.decode import DEFAULT_DECODE_STEPS
from trio_llm.server.flags import UsageError
from trio_llm.server.gate import ResidencyGate
from trio_llm.server.http import create_app, end_requests
from trio_llm.server.media import MediaEncoder
from trio_llm.server.metrics import StatisticsSources, make_registry
from trio_llm.server.queue import SlotsMessage, TaskQueue, outbox_size
from trio_llm.server.slots import SlotsEngine

log = logging.getLogger("trio_llm.serve")

# ---------------------------------------------------------------------------
# flags


def _ctx_shift(config: ServerConfig, backend: Any, projector: Any) -> bool:
    """--context-shift where the model can take it (llama-server's words otherwise)."""
    if not config.ctx_shift:
        return False
    if projector is not None:
        log.warning("ctx_shift is not supported by multimodal, it will be disabled")
        return False
    if not getattr(backend, "can_shift", False):
        log.warning("ctx_shift is not supported by this context, it will be disabled")
        return False
    return True


def _device_list() -> str:
    """--list-devices, in llama.cpp's words: each Vulkan device as ``-dev`` names it."""
    lines = ["Available devices:"]
    try:
        from trio_llm.vulkan.device import list_devices

        devices = list_devices()
    except (ImportError, OSError, TrioLLMError) as exc:
        return "\n".join([*lines, f"  (no Vulkan device: {exc}; -dev none runs on the CPU)"])
    for index, name, kind, heap in devices:
        lines.append(f"  Vulkan{index}: {name} ({kind}, {heap >> 20} MiB)")
    return "\n".join(lines)


def parse_config(argv: Sequence[str], environ: Mapping[str, str] | None = None) -> ServerConfig:
    """Flags (and ``LLAMA_ARG_*`` variables) → a validated ``ServerConfig``;
    ``UsageError`` or ``ConfigError`` otherwise (``trio_llm.server.flags``)."""
    parsed = flags.parse(argv, environ)
    if "_help" in parsed.values or "_version" in parsed.values:
        raise _Exit(flags.usage() if "_help" in parsed.values else f"trio-llm {__version__}")
    if "_list_devices" in parsed.values:
        raise _Exit(_device_list())
    if "_completion_bash" in parsed.values:
        raise _Exit(flags.completion_bash().rstrip("\n"))
    if "_cache_list" in parsed.values:
        from trio_llm.model.hf_cache import cached_models

        models = cached_models(environ)
        raise _Exit("\n".join([f"number of models in cache: {len(models)}",
                                *(f"{i:4d}. {m}" for i, m in enumerate(models, 1))]))
    config: ServerConfig = flags.to_config(parsed, environ)
    if (config.cache_type_k, config.cache_type_v) != ("f16", "f16") and not backend_takes_cache_types():
        which = "-ctk" if config.cache_type_k != "f16" else "-ctv"
        raise UsageError(f"{which} {config.cache_type_k if which == '-ctk' else config.cache_type_v}: "
                         "the backends do not store a quantized KV cache yet (only f16)")
    return config


class _Exit(Exception):
    """--help / --version: print this and exit 0."""


def backend_takes_cache_types() -> bool:
    """Whether the backend loader accepts ``cache_type_k=``/``cache_type_v=``."""
    from trio_llm.engine.loader import open_backend

    return "cache_type_k" in inspect.signature(open_backend).parameters


# ---------------------------------------------------------------------------
# loading


class LoadAborted(Exception):
    """Raised from the progress callback to stop a load the server no longer wants."""


@attrs.define(eq=False)
class LoadProgress:
    """The progress callback of a load: a bar on stderr (``show``) and a fraction for
    ``/health``. Called from the loader's worker thread, so it only writes plain
    attributes and the terminal; it aborts the load once ``stop`` is set."""

    ctx: ServerContext
    stop: trio.Event
    show: bool
    _last: int = -1

    def __call__(self, done: int, total: int) -> None:
        if self.stop.is_set():
            raise LoadAborted
        frac = done / total if total > 0 else 1.0
        self.ctx.load_progress = frac
        if not self.show:
            return
        pct = int(100 * frac)
        tty = sys.stderr.isatty()
        if pct == self._last or (not tty and pct % 25 and pct != 100):
            return
        self._last = pct
        bar = "#" * (pct // 4) + "-" * (25 - pct // 4)
        end = "\n" if pct == 100 or not tty else ""
        sys.stderr.write(f"\rloading model [{bar}] {pct:3d}% {done / 1e6:8.1f}/{total / 1e6:.1f} MB{end}")
        sys.stderr.flush()


def _model_path(config: ServerConfig) -> Path:
    if config.model is not None:
        return config.model
    from trio_llm.model.synth import default_model_path

    return default_model_path()


@attrs.frozen
class Loaded:
    model: Any  # trio_llm.model.gguf.GGUFModel
    tokenizer: Any  # trio_llm.model.tokenizer.Tokenizer
    template: Any  # trio_llm.model.chat.ChatTemplate
    backend: Backend
    stat: os.stat_result
    output: str = "logits"  # what the backend's graph computes (trio_llm.graph.Output)
    projector: Any = None  # trio_llm.vision.Projector: with --mmproj


def _load(config: ServerConfig, progress: LoadProgress) -> Loaded:
    """Blocking: read the file, build tokenizer and template, build the backend."""
    from trio_llm.engine.loader import open_backend
    from trio_llm.model.chat import ChatTemplate
    from trio_llm.model.gguf import load_gguf
    from trio_llm.model.tokenizer import Tokenizer

    model = load_gguf(_model_path(config), config.model_overrides())
    _check_gpu_layers(config, model.config.n_layer)
    projector = _load_projector(config, model)
    tokenizer = Tokenizer.from_metadata(model.metadata)
    if config.chat_template is not None:  # --chat-template / --chat-template-file
        template = ChatTemplate.from_source(config.chat_template, tokenizer)
    else:
        template = ChatTemplate.from_metadata(model.metadata, tokenizer)
    n_ctx = fit_slot_ctx(config, model)
    if config.threads > 0:
        # -t: the numpy backend's matrix products run in BLAS; its pool is process-wide
        from threadpoolctl import threadpool_limits

        threadpool_limits(limits=config.threads, user_api="blas")
    extra = _backend_args(config, model)
    backend = open_backend(config.backend, model, n_ctx=n_ctx, n_seq=config.parallel, progress=progress,
                           max_chunk=config.n_batch, **extra)
    return Loaded(model, tokenizer, template, backend, os.stat(model.path), extra.get("output", "logits"),
                  projector)


def _backend_args(config: ServerConfig, model: Any) -> dict[str, Any]:
    """The backend's arguments from the flags, beside the context and the slots (the
    load and the memory projection of ``--fit`` / ``--arena-budget`` pass the same)."""
    extra: dict[str, Any] = {}
    if backend_takes_cache_types():
        extra = {"cache_type_k": config.cache_type_k, "cache_type_v": config.cache_type_v}
    if config.n_cpu_moe:
        extra["n_cpu_moe"] = config.n_cpu_moe
    if config.device is not None:
        extra["device"] = config.device
    output = embeddings.backend_output(config.embeddings, embeddings.resolve_pooling(config.pooling, model.metadata),
                                       model.tensors, model.config.causal_attn)
    if output != "logits":
        extra["output"] = output
    return extra


#: what a projection that cannot be planned counts: more than any device has
UNPLANNABLE = 1 << 62


def device_need(config: ServerConfig, model: Any) -> Any:
    """``positions -> device bytes`` of this model under these flags: the Vulkan backend's
    own plan (``VulkanBackend.plan``), memoised; a context the backend would refuse
    (one layer's cache past a binding, an allocation past the device's limit) needs
    ``UNPLANNABLE`` bytes, so that it never fits."""
    import functools

    from trio_llm.vulkan.backend import VulkanBackend

    extra = _backend_args(config, model)

    @functools.cache
    def need(ctx_total: int) -> int:
        try:
            plan = VulkanBackend.plan(model, n_ctx=max(1, ctx_total // config.parallel), n_seq=config.parallel,
                                      max_chunk=config.n_batch, **extra)
        except (BackendError, InvalidRequest) as exc:
            log.debug("fit: %d positions cannot be planned: %s", ctx_total, exc)
            return UNPLANNABLE
        return sum(plan.values())

    return need


#: text architectures whose graph takes an image's rows (``embd_rows``) and whose
#: projector type trio_llm.vision reads
VISION_ARCHS = ("gemma3",)


def _load_projector(config: ServerConfig, model: Any) -> Any:
    """--mmproj: the projector, checked against the text model (llama.cpp's mtmd_init
    refuses a width mismatch the same way), before the backend takes the device.

    A projector this server cannot run (another encoder than gemma3's, a text model
    without image input here, or --embeddings) leaves a warning and no projector: the
    text model is served, /props says ``vision: false``, and a request with an image
    is answered 400. A missing, corrupt or mismatched file stops the start."""
    if config.mmproj is None:
        return None
    from trio_llm.errors import UnsupportedModelError
    from trio_llm.vision import load_projector
    from trio_llm.vision.mmproj import UnsupportedProjector

    if config.embeddings:
        log.warning("--mmproj %s: ignored with --embeddings (images are for generation here)", config.mmproj)
        return None
    if model.config.arch not in VISION_ARCHS:
        log.warning("--mmproj %s: image input to a %s model is not supported here (only %s): serving text only, "
                    "requests with images are refused", config.mmproj, model.config.arch, ", ".join(VISION_ARCHS))
        return None
    try:
        projector = load_projector(config.mmproj)
    except UnsupportedProjector as exc:
        log.warning("--mmproj %s: serving text only, requests with images are refused", exc)
        return None
    if projector.n_embd_out != model.config.n_embd:
        raise UnsupportedModelError(config.mmproj, f"mismatch between text model (n_embd = {model.config.n_embd}) "
                                                   f"and mmproj (n_embd = {projector.n_embd_out})")
    log.info("mmproj %s: %d tokens an image, encoded on the CPU", config.mmproj, projector.n_tokens)
    if projector.n_tokens > config.n_batch:
        log.warning("--mmproj: an image takes %d positions, more than a pass holds (-b/-ub %d): requests with "
                    "images will be refused; raise -b and -ub", projector.n_tokens, config.n_batch)
    return projector


def _check_gpu_layers(config: ServerConfig, n_layer: int) -> None:
    """-ngl below the layer count would keep layers on the CPU, which the Vulkan backend
    does not do: refused in one line rather than ignored (any count at or above it, and
    "all"/"auto", is the whole model on the device; numpy runs everything on the CPU)."""
    ngl = config.n_gpu_layers
    if ngl is not None and 0 <= ngl < n_layer and config.backend != "numpy":
        raise InvalidRequest(f"-ngl {ngl}: keeping {n_layer - ngl} of the model's {n_layer} layers on the CPU is "
                             "not supported (the whole model runs on the device): use -ngl all, or "
                             "--n-cpu-moe for expert weights")


def fit_slot_ctx(config: ServerConfig, model: Any) -> int:
    """Positions per slot, after ``--fit`` (``trio_llm.engine.fit``) has had its say."""
    from trio_llm.engine import fit

    if not config.fit or config.backend == "numpy":
        return config.slot_ctx(model.config.n_ctx_train)
    free = fit.device_free_bytes(config.device)
    if free is None:
        return config.slot_ctx(model.config.n_ctx_train)
    cfg = model.config
    choice = fit.choose_ctx(
        # llama.cpp fits a context of 0 (the model's) whoever set it (common/fit.cpp: n_ctx_auto),
        # and keeps any other that was set
        ctx_size=config.ctx_size, ctx_set="ctx_size" in config.set_by_user and config.ctx_size != 0,
        n_ctx_train=cfg.n_ctx_train,
        parallel=config.parallel, need=device_need(config, model), free=free,
        margin=config.fit_target * fit.MiB, fit_ctx=config.fit_ctx,
    )
    mib = fit.MiB
    if choice.changed:
        log.info("fit: context %d -> %d positions (%d MiB projected, %d MiB free less %d MiB --fit-target)",
                 config.ctx_size or cfg.n_ctx_train, choice.ctx_size, choice.need // mib, free // mib,
                 config.fit_target)
    elif not choice.fits:
        log.warning("fit: %d positions need %d MiB, more than the %d MiB free less %d MiB --fit-target; "
                    "loading anyway (%s)", choice.ctx_size, choice.need // mib, free // mib, config.fit_target,
                    "the context was set by the user" if "ctx_size" in config.set_by_user else "at --fit-ctx")
    else:
        log.info("fit: %d positions fit (%d MiB projected, %d MiB free less %d MiB --fit-target)",
                 choice.ctx_size, choice.need // mib, free // mib, config.fit_target)
    return max(1, choice.ctx_size // config.parallel)


# ---------------------------------------------------------------------------
# residency: where the gate is built


async def build_gate(
    config: ServerConfig, client: BackendClient, nursery: trio.Nursery, arbiter: Arbiter
) -> ResidencyGate:
    """The residency gate the slots loop waits on before every forward pass.

    Idle sleep (``--sleep-idle-seconds``, ``--sleep-mode``), ``POST /sleep`` and the
    arbiter (``--vram-arena``) all go through a ``SleepController`` and its
    ``Residency`` actor, started in ``nursery`` (they live as long as the slots loop
    and are cancelled with it). The arbiter already holds the token here (coordinated
    load, in ``_run_engine``). The reference fork's ``LLAMA_SLEEP_VRAM_ONLY`` /
    ``LLAMA_SLEEP_EVICT_KV`` pick the level when ``--sleep-mode`` is left at its default.
    With neither idle sleep nor an arena the model stays resident until ``POST /sleep``
    (as vLLM's sleep endpoints do); the controller then costs one check per forward.
    """
    flag = None if config.sleep_mode == ServerConfig().sleep_mode else config.sleep_mode
    level = resolve_level(flag)
    idle = config.sleep_idle_seconds if config.sleep_idle_seconds >= 0 else None
    residency = Residency(client)
    await nursery.start(residency.run)
    cfg = SleepConfig(level, idle_seconds=idle, quantum=config.arena_quantum, priority=config.arena_priority)
    controller = SleepController(cfg, residency, arbiter)
    await nursery.start(controller.run)
    return controller


def arena_share(config: ServerConfig) -> Share | None:
    """Blocking: what ``--arena-budget`` / ``--arena-pin`` bring to the arena's ledger, or
    None (take turns, as without the flag). Read before the token is taken, so from the
    GGUF header and the device's properties, not from a loaded model: the footprint is
    ``--fit``'s projection (the Vulkan backend's plan) at the context the load will
    use. Bad input is one line: ``ConfigError`` (a budget beyond the device) or ``ArenaRefused`` (a model larger
    than the budget); ``auto`` without a Vulkan device is a warning and no share."""
    from trio_llm.engine import fit
    from trio_llm.model.gguf import load_gguf

    if config.arena_budget is None or config.vram_arena is None:
        return None
    device = None if config.backend == "numpy" else fit.device_memory(config.device)
    mib = fit.MiB
    if config.arena_budget == "auto":
        if device is None:
            log.warning("--arena-budget auto: the numpy backend has no device budget; give a figure in MiB. "
                        "This server takes turns (exclusive)")
            return None
        budget = device.budget_bytes - config.fit_target * mib
        if budget <= 0:
            raise ConfigError(f"--arena-budget auto: the device's budget ({device.budget_bytes // mib} MiB) is "
                              f"not more than --fit-target ({config.fit_target} MiB)")
    else:
        assert isinstance(config.arena_budget, float | int)
        budget = int(config.arena_budget * mib)
        if device is not None and budget > device.heap_bytes:
            raise ConfigError(f"--arena-budget {config.arena_budget:g} MiB is more than the device's "
                              f"{device.heap_bytes / mib:.0f} MiB ({device.name})")
    model = load_gguf(_model_path(config), config.model_overrides())
    try:
        ctx_total = fit_slot_ctx(config, model) * config.parallel
        if device is not None:  # what the Vulkan backend will hold
            footprint = device_need(config, model)(ctx_total)
        else:  # the numpy backend: the formula
            footprint = fit.footprint_bytes(model.config, weights=model.weight_bytes(), ctx_total=ctx_total,
                                            type_k=config.cache_type_k, type_v=config.cache_type_v,
                                            n_batch=config.n_batch)
    finally:
        model.close()
    if footprint >= UNPLANNABLE:
        raise ArenaRefused(f"--arena-budget: the device cannot hold this model at {ctx_total} positions "
                           "(lower -c or the slots)")
    if footprint > budget:
        raise ArenaRefused(f"--arena-budget: the model needs {footprint / mib:.1f} MiB on the device, more than "
                           f"the {budget / mib:.1f} MiB budget")
    log.info("VRAM arbiter: co-resident under a %.1f MiB budget with %.1f MiB%s", budget / mib, footprint / mib,
             ", pinned" if config.arena_pin else "")
    return Share(footprint=footprint, budget=budget, pinned=config.arena_pin)


async def _take_for_load(arbiter: Arbiter, stop: trio.Event) -> bool:
    """Coordinated load: take the VRAM token before any weight reaches the device, so a
    loading server never pushes a resident one out of memory. Waits as long as the
    holder needs (no timeout) but gives up on shutdown; False then."""
    async with trio.open_nursery() as nursery:

        async def give_up_on_stop() -> None:
            await stop.wait()
            nursery.cancel_scope.cancel()

        nursery.start_soon(give_up_on_stop)
        await arbiter.take()
        nursery.cancel_scope.cancel()
    return arbiter.holding


# ---------------------------------------------------------------------------
# the root nursery


@attrs.define(eq=False)
class ServerHandle:
    """What ``serve`` hands its starter: the URL, the context, and a way to stop."""

    url: str
    context: ServerContext
    _stop: trio.Event

    def shutdown(self) -> None:
        """Begin a graceful shutdown, as SIGTERM does."""
        self._stop.set()


@attrs.define(eq=False)
class _InFlight:
    """ASGI wrapper counting HTTP requests in flight.

    Hypercorn's graceful shutdown waits for every *connection* to close, so one idle
    keep-alive connection (llama-swap and other proxies keep them) holds a stop for
    the whole ``--shutdown-timeout``. What must finish is the requests, not the
    connections: once none is in flight after the stop, the HTTP server is ended.
    """

    app: Any
    n: int = 0
    _drained: trio.Event = attrs.Factory(trio.Event)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope.get("type") != "http":
            await self.app(scope, receive, send)
            return
        self.n += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.n -= 1
            if self.n == 0:
                self._drained.set()
                self._drained = trio.Event()

    async def wait_drained(self) -> None:
        while self.n:
            await self._drained.wait()


def _title_case(name: bytes) -> bytes:
    return b"-".join(part[:1].upper() + part[1:] for part in name.split(b"-"))


@attrs.define(eq=False)
class _HeaderCase:
    """ASGI wrapper that sends HTTP/1.x response header names in Title-Case, as
    llama-server does (``Access-Control-Allow-Origin``, ``Process-Start-Time-Unix``).

    ASGI gives header names lower-case and h11 writes them as given; HTTP says names
    are case-insensitive, but clients that look them up in a plain dict (llama.cpp's
    own server tests among them) miss ``access-control-allow-origin``. HTTP/2 requires
    lower case, so only HTTP/1.x answers are re-cased."""

    app: Any

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope.get("type") != "http" or scope.get("http_version", "1.1") not in ("1.0", "1.1"):
            await self.app(scope, receive, send)
            return

        async def cased(message: Any) -> None:
            if message.get("type") == "http.response.start":
                message = dict(message, headers=[(_title_case(bytes(k)), v) for k, v in message.get("headers", ())])
            await send(message)

        await self.app(scope, receive, cased)


@attrs.frozen
class _Mounted:
    """ASGI wrapper for ``--api-prefix`` and ``--path``, as llama-server mounts them.

    ``prefix``: every route is served under it (``/v1/x/health`` for ``--api-prefix
    /v1/x``); a path outside it is a 404. ``static``: a GET or HEAD for a file of that
    directory (``/`` is its ``index.html``) is answered with the file before any route
    (cpp-httplib's mount point); a path that leaves the directory never is."""

    app: Any
    prefix: str
    static: Path | None

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope.get("type") != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "/")
        if self.prefix:
            if path != self.prefix and not path.startswith(self.prefix + "/"):
                await _plain(send, 404, b"Not Found", "text/plain")
                return
            path = path[len(self.prefix):] or "/"
            raw = scope.get("raw_path") or b""
            scope = dict(scope, path=path, raw_path=raw[len(self.prefix.encode()):] or path.encode())
        if self.static is not None and scope.get("method") in ("GET", "HEAD"):
            body, kind = await trio.to_thread.run_sync(_static_file, self.static, path)
            if body is not None:
                await _plain(send, 200, body if scope["method"] == "GET" else b"", kind, length=len(body))
                return
        await self.app(scope, receive, send)


def _static_file(root: Path, path: str) -> tuple[bytes | None, str]:
    """The bytes and content type of ``path`` under ``root``; None if it is not a file
    there (or leaves it, by ``..`` or a link)."""
    import mimetypes
    import urllib.parse

    rel = urllib.parse.unquote(path).lstrip("/") or "index.html"
    base = root.resolve()
    target = (base / rel).resolve()
    if base != target and base not in target.parents or not target.is_file():
        return None, ""
    return target.read_bytes(), mimetypes.guess_type(target.name)[0] or "application/octet-stream"


async def _plain(send: Any, status: int, body: bytes, kind: str, length: int | None = None) -> None:
    headers = [(b"content-type", kind.encode()), (b"content-length", str(len(body) if length is None
                                                                          else length).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


#: after the shutdown grace, how long the requests it ended get to send their error
ANSWER_FLUSH_SECONDS = 1.0


async def _serve_http(
    app: Any, config: ServerConfig, stop: trio.Event, done: trio.Event,
    *, task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED,
) -> None:
    hc = hypercorn.config.Config()
    hc.bind = [f"[{h}]:{config.port}" if ":" in h else f"{h}:{config.port}" for h in config.hosts]
    # hypercorn's own deadline is only a backstop: ours (below) ends the requests
    # first, so that they can still send their answer
    hc.graceful_timeout = config.shutdown_timeout + 2 * ANSWER_FLUSH_SECONDS
    hc.accesslog = None
    hc.errorlog = logging.getLogger("hypercorn.error")
    if config.ssl_cert_file is not None and config.ssl_key_file is not None:
        hc.certfile, hc.keyfile = str(config.ssl_cert_file), str(config.ssl_key_file)
    if config.api_prefix or config.static_path is not None:
        app = _Mounted(app, config.api_prefix, config.static_path)
    counted = _InFlight(_HeaderCase(app))

    async def end_when_drained(scope: trio.CancelScope) -> None:
        await stop.wait()
        with trio.move_on_after(config.shutdown_timeout):
            await counted.wait_drained()
        if counted.n:
            # the grace ran out: every request still waiting is answered with a 503 (a
            # stream with its error event), and gets a moment to reach its client,
            # instead of a connection cut mid-answer
            end_requests(app)
            with trio.move_on_after(ANSWER_FLUSH_SECONDS):
                await counted.wait_drained()
        scope.cancel()

    try:
        async with trio.open_nursery() as nursery:
            binds = await nursery.start(
                partial(hypercorn.trio.serve, counted, hc, shutdown_trigger=stop.wait)
            )
            nursery.start_soon(end_when_drained, nursery.cancel_scope)
            task_status.started(binds)
    finally:
        done.set()


async def _watch_signals(stop: trio.Event, root: trio.CancelScope) -> None:
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async for signum in signals:
            if stop.is_set():
                log.warning("second %s: stopping now", signal.Signals(signum).name)
                root.cancel()
                return
            log.info("%s: finishing in-flight requests, then exiting", signal.Signals(signum).name)
            stop.set()


def fetch_urls(config: ServerConfig) -> None:
    """Blocking: ``-mu`` and ``--mmproj-url``'s downloads (``model/download.py``: a file
    already there is kept while the server's ETag says it is current), before anything
    reads the files. A projector is not fetched for a text model that takes no image
    here (``_load_projector`` then warns and serves text only). A cancelled startup
    stops a download at its next chunk; the partial file stays for a resume."""
    from trio_llm.model.download import download

    def cancelled(_done: int, _total: int | None) -> None:
        trio.from_thread.check_cancelled()

    kw: dict[str, Any] = dict(token=config.hf_token, offline=config.offline, progress=cancelled)
    if config.model_url and config.model is not None:
        download(config.model_url, config.model, **kw)
    if config.mmproj_url and config.mmproj is not None and not config.embeddings:
        from trio_llm.model.gguf import load_gguf

        model = load_gguf(_model_path(config), config.model_overrides())
        try:
            arch = model.config.arch
        finally:
            model.close()
        if arch in VISION_ARCHS:
            download(config.mmproj_url, config.mmproj, **kw)
        else:
            log.warning("--mmproj-url: not downloaded: image input to a %s model is not supported here", arch)


def fetch_hf(config: ServerConfig) -> ServerConfig:
    """Blocking: ``-hf``'s download (``model/hf_download.py``) when parsing found the
    model missing from the cache; ``config`` with the model (and, as llama-server, the
    repository's projector unless ``--no-mmproj``, ``--mmproj`` or ``--mmproj-url``)
    in the cache. A cancelled startup stops a download at its next chunk; the partial
    file stays for a resume."""
    from trio_llm.model.hf_download import fetch

    def cancelled(_done: int, _total: int | None) -> None:
        trio.from_thread.check_cancelled()

    assert config.hf_repo is not None
    with_mmproj = config.mmproj is None and config.mmproj_auto and not config.mmproj_url
    got = fetch(config.hf_repo, config.hf_file, mmproj=with_mmproj, token=config.hf_token, progress=cancelled)
    return attrs.evolve(config, model=got.model, mmproj=got.mmproj if with_mmproj else config.mmproj)


async def _run_engine(ctx: ServerContext, stop: trio.Event, http_done: trio.Event, show_progress: bool) -> None:
    """Load the model and run the actors until the HTTP server has shut down."""
    config = ctx.config
    if config.hf_repo and config.model is None:
        ctx.config = config = await trio.to_thread.run_sync(fetch_hf, config)
    if config.model_url or config.mmproj_url:
        await trio.to_thread.run_sync(fetch_urls, config)
    share = await trio.to_thread.run_sync(arena_share, config)
    arbiter = await open_arbiter(config.vram_arena, priority=config.arena_priority, share=share)
    try:
        if await _take_for_load(arbiter, stop):
            await _run_loaded(ctx, stop, http_done, show_progress, arbiter)
    finally:
        # after the backend has been closed: its device memory is gone before the
        # token (and any want.lock registration) goes back
        arbiter.close()


async def _run_loaded(
    ctx: ServerContext, stop: trio.Event, http_done: trio.Event, show_progress: bool, arbiter: Arbiter
) -> None:
    config = ctx.config
    progress = LoadProgress(ctx, stop, show_progress)
    try:
        loaded = await trio.to_thread.run_sync(_load, config, progress)
    except LoadAborted:
        return
    model, tokenizer, backend = loaded.model, loaded.tokenizer, loaded.backend
    log.info("model %s: %s backend, %d slot(s) of %d positions",
             model.path, backend.name, backend.n_seq, backend.n_ctx)
    if config.cache_reuse > 0 and not getattr(backend, "can_shift", False):
        # llama-server's words: a sliding window or a recurrent state cannot shift
        log.warning("--cache-reuse %d: cache_reuse is not supported by this context (a sliding window or a "
                    "recurrent state), it will be disabled: the common prefix is reused", config.cache_reuse)
    actor = BackendActor(backend)
    async with trio.open_nursery() as backend_nursery:
        await backend_nursery.start(actor.run)
        client = actor.client()
        try:
            async with trio.open_nursery() as actors:
                gate = await build_gate(config, client, actors, arbiter)
                assign_send, assign_recv = trio.open_memory_channel[SlotsMessage](outbox_size(backend.n_seq))
                queue = TaskQueue.create(backend.n_seq, assign_send, gate)
                grammars = Grammars(tokenizer)
                slots = SlotsEngine(
                    client, gate, tokenizer, queue.inbox(), assign_recv,
                    n_ctx=backend.n_ctx, n_batch=config.n_batch, grammars=grammars,
                    ctx_checkpoints=config.ctx_checkpoints, checkpoint_min_step=config.checkpoint_min_step,
                    decode_steps=decode_steps_setting(), special=config.special,
                    ctx_shift=_ctx_shift(config, backend, loaded.projector), add_bos=tokenizer.add_bos,
                )
                await actors.start(queue.start_loop)
                await actors.start(slots.start_loop)
                if config.warmup:
                    first = tokenizer.bos_id if tokenizer.bos_id is not None else 0
                    # One pass per shape the Vulkan backend specialises (matrix-vector
                    # products for 1, 2, 4 and 8 columns, the tiled product beyond), so
                    # its pipelines exist before the first request rather than under it:
                    # on the H200 a first prefill cost 4-6 s of pipeline creation, the
                    # GPU held all the while. Each is a forward pass like any other: no
                    # release (a waiter's yield after the start-up grace) begins under it.
                    for n in warmup_sizes(backend.n_ctx, config.n_batch):
                        async with gate.resident():
                            await client.forward([SeqBatch(0, np.full(n, first, np.int32), 0)])
                    # and the device-sampled decode graphs (bucket x steps per submit, both
                    # look-ahead lanes: the second call is queued ahead of the first)
                    for rows, steps in decode_warmup_shapes(backend, slots.decode_steps):
                        zeros = np.zeros((steps, rows), np.float32)
                        async with gate.resident():
                            await client.decode([SeqBatch(i, np.array([first], np.int32), 0) for i in range(rows)],
                                                [DeviceChain.greedy()] * rows, zeros, zeros)
                    proj = loaded.projector
                    if proj is not None and proj.n_tokens <= min(config.n_batch, backend.n_ctx - 1):
                        # an image's pass: its own graph (embedding rows, non-causal attention)
                        image = np.zeros((proj.n_tokens, model.config.n_embd), np.float32)
                        async with gate.resident():
                            await client.forward([SeqBatch(0, np.zeros(proj.n_tokens, np.int32), 0, embd=image,
                                                           causal=False)])
                device = await client.call(lambda b: b.device_info(), "device_info")
                embedder = None
                if config.embeddings:
                    embedder = embeddings.Embedder(
                        client, gate, embeddings.resolve_pooling(config.pooling, model.metadata),
                        output=loaded.output, arch=model.config.arch, n_seq=backend.n_seq,
                        causal=model.config.causal_attn, n_batch=config.n_batch)
                media = (MediaEncoder(loaded.projector, tokenizer, max_rows=config.n_batch)
                         if loaded.projector is not None else None)
                registry = make_registry(
                    StatisticsSources(slots.statistics, queue.statistics, actor.statistics, gate.is_sleeping,
                                      arena=getattr(gate, "arena_statistics", None),
                                      embeddings=embedder.statistics if embedder is not None else None,
                                      media=media.statistics if media is not None else None)
                )
                path = Path(model.path)
                ctx.set_engine(
                    Engine(
                        model_path=path,
                        model_config=model.config,
                        metadata=model.metadata,
                        tokenizer=tokenizer,
                        template=loaded.template,
                        queue=queue,
                        slots=slots,
                        gate=gate,
                        registry=registry,
                        n_ctx=backend.n_ctx,
                        backend_name=backend.name,
                        device=dict(device),
                        n_params=int(sum(int(np.prod(t.shape)) for t in model.tensors.values())),
                        file_bytes=loaded.stat.st_size,
                        created=int(loaded.stat.st_mtime),
                        grammars=grammars,
                        embedder=embedder,
                        media=media,
                    )
                )
                log.info("ready")
                await http_done.wait()
                actors.cancel_scope.cancel()
        finally:
            await _close_backend(client, backend)
            backend_nursery.cancel_scope.cancel()


def warmup_sizes(n_ctx: int, n_batch: int) -> list[int]:
    """Token counts of the warm-up passes: 1, 2, 4, 8 and 16, within the context and
    the batch size."""
    return [n for n in (1, 2, 4, 8, 16) if n <= min(n_ctx, n_batch)]


def decode_steps_setting() -> int:
    """Decode steps per submit of the device-sampled path (server/decode.py):
    ``TRIO_LLM_DECODE_STEPS`` (1..16; 1 turns the multi-step submits off, 0 sampling on
    the device too: every step reads its logits back and samples on the host), default 4."""
    raw = os.environ.get("TRIO_LLM_DECODE_STEPS", "")
    if not raw:
        return DEFAULT_DECODE_STEPS
    try:
        n = int(raw)
    except ValueError:
        n = -1
    if not 0 <= n <= 16:
        raise ConfigError(f"TRIO_LLM_DECODE_STEPS must be an integer 0..16, got {raw!r}")
    return n


def decode_warmup_shapes(backend: Backend, decode_steps: int) -> list[tuple[int, int]]:
    """(sequences, steps) of the warm-up ``decode`` calls: the Vulkan backend records a
    graph per decode bucket (1, 2, 4, 8 sequences, within the slots) and power-of-two
    step count up to ``decode_steps``; the numpy backend has nothing to record."""
    most = getattr(backend, "decode_steps_max", 0)
    if backend.name != "vulkan" or not most or decode_steps < 1:
        return []
    rows = sorted({min(b, backend.n_seq) for b in (1, 2, 4, 8)})
    rows = [r for r in rows if r == 1 or r & (r - 1) == 0 or r == backend.n_seq]
    top = min(decode_steps, most, backend.n_ctx)
    steps = [1 << i for i in range(top.bit_length()) if 1 << i <= top]
    return [(r, k) for r in rows for k in steps]


async def _close_backend(client: BackendClient, backend: Backend) -> None:
    """Free the device through the actor; if a hard stop (a second signal, an outer
    cancel) has already ended the actor, nothing else can touch the backend any more,
    so close it directly on a worker thread, shielded and bounded like the actor's."""
    try:
        await client.close()
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        with trio.CancelScope(shield=True), trio.move_on_after(30):
            await trio.to_thread.run_sync(backend.close)


async def serve(
    config: ServerConfig,
    *,
    handle_signals: bool = False,
    show_progress: bool = False,
    task_status: trio.TaskStatus[ServerHandle] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run the server until shut down. ``task_status`` gets a ``ServerHandle`` as soon
    as the port is bound (the model is still loading then: wait on
    ``handle.context.loaded``)."""
    ctx = ServerContext(config)
    stop = trio.Event()
    http_done = trio.Event()
    async with trio.open_nursery() as root:
        if handle_signals:
            root.start_soon(_watch_signals, stop, root.cancel_scope)
        binds = await root.start(_serve_http, create_app(ctx), config, stop, http_done)
        task_status.started(ServerHandle(binds[0], ctx, stop))
        log.info("listening on %s", binds[0])
        try:
            await _run_engine(ctx, stop, http_done, show_progress)
        except BaseException:
            stop.set()  # a failed start-up takes the HTTP server down with it
            raise
        await http_done.wait()
        root.cancel_scope.cancel()


# ---------------------------------------------------------------------------
# the command


def _first_leaf(group: BaseExceptionGroup[Any]) -> BaseException:
    exc: BaseException = group
    while isinstance(exc, BaseExceptionGroup):
        exc = exc.exceptions[0]
    return exc


def main(argv: list[str]) -> int:
    try:
        config = parse_config(argv)
    except _Exit as exc:
        print(exc)
        return 0
    except (UsageError, ConfigError) as exc:
        print(f"trio-llm serve: error: {exc}", file=sys.stderr)
        return 2
    except ModelLoadError as exc:  # -hf --offline: not in the local cache
        print(f"trio-llm serve: error: {exc}", file=sys.stderr)
        return 1
    _setup_logging(config)
    set_priority(config.prio)
    failure: BaseException | None = None
    try:
        trio.run(partial(serve, config, handle_signals=True, show_progress=True))
    except* (TrioLLMError, OSError) as group:
        failure = _first_leaf(group)
    except* KeyboardInterrupt:
        pass  # a signal before the handlers were installed: still a clean stop
    if failure is not None:
        print(f"trio-llm serve: error: {failure}", file=sys.stderr)
        return 1
    return 0


def _setup_logging(config: ServerConfig) -> None:
    """-v / -lv 4+: debug; --log-disable: nothing; --log-file: the same lines to a file too."""
    level = logging.DEBUG if config.verbose or config.verbosity >= 4 else logging.INFO
    if config.log_disable:
        level = logging.CRITICAL + 1
    logging.basicConfig(level=level, format="trio-llm: %(message)s", stream=sys.stderr)
    if config.log_file is not None:
        handler = logging.FileHandler(config.log_file)
        handler.setFormatter(logging.Formatter("trio-llm: %(message)s"))
        logging.getLogger().addHandler(handler)
    logging.getLogger("hypercorn.error").setLevel(logging.WARNING)
    # httpx logs every request's whole URL at INFO: a download's or an image's query
    # string may carry a credential (model/download.py logs them masked)
    for name in ("httpx", "httpcore"):
        logging.getLogger(name).setLevel(logging.WARNING)


#: --prio -1..3 -> the nice value ggml_set_process_priority gives on Linux
PRIO_NICE = {-1: 5, 0: 0, 1: -5, 2: -10, 3: -20}


def set_priority(prio: int) -> None:
    """--prio, as llama-server: setpriority(PRIO_PROCESS); a refusal is a warning."""
    if prio == 0:
        return
    try:
        os.setpriority(os.PRIO_PROCESS, 0, PRIO_NICE[prio])
    except OSError as exc:
        log.warning("--prio %d: failed to set process priority (nice %d): %s",
                    prio, PRIO_NICE[prio], exc.strerror or exc)

"""The HTTP front end: a quart-trio app served by hypercorn's trio worker.

Each request handler runs beside quart-trio's disconnect watcher; when the client
goes away the handler (or the streaming body) is cancelled, and its ``finally``
cancels the task in the queue, which frees the slot at once. A handler never touches
the backend: it parses and validates (``params``), posts a ``ServerTask`` and turns
the results into llama-server's or OpenAI's JSON (``responses``). Errors leave as
``{"error": {"code", "message", "type"}}`` with no traceback for bad input.
"""

from __future__ import annotations

import json
import logging
import re
import threading
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterable, Sequence
from contextlib import aclosing
from typing import Any

import attrs
import trio
from quart import Response, request
from quart_trio import QuartTrio
from werkzeug.exceptions import HTTPException

from trio_llm import __version__
from trio_llm.errors import (
    BackendError,
    ContextOverflow,
    InvalidRequest,
    TemplateError,
    TokenizerError,
    TrioLLMError,
)
from trio_llm.model import chat_output as CO
from trio_llm.model.chat import normalize_messages
from trio_llm.server import anthropic as AN
from trio_llm.server import embeddings as EM
from trio_llm.server import infill as IN
from trio_llm.server import media as MD
from trio_llm.server import params as P
from trio_llm.server import responses as R
from trio_llm.server import responses_api as RA
from trio_llm.server import slot_file
from trio_llm.server.context import Engine, ServerContext
from trio_llm.server.metrics import CONTENT_TYPE, PROCESS_START_UNIX, render
from trio_llm.server.tasks import (
    ServerTask,
    SlotAction,
    TaskActionDone,
    TaskError,
    TaskFinal,
    TaskParams,
    TaskPartial,
    TaskResult,
)

log = logging.getLogger("trio_llm.http")

PUBLIC_PATHS = frozenset({"/health", "/v1/health"})
#: what an embedding server (``--embeddings``) does not serve: its graph has no logits
GENERATION_PATHS = frozenset({"/completion", "/completions", "/v1/completions", "/v1/chat/completions",
                              "/chat/completions", "/infill", "/v1/messages", "/v1/responses",
                              "/responses"})
SLEEP_LEVELS = ("unload", "weights", "all")


class ApiError(TrioLLMError):
    """An HTTP-level refusal with its status and OpenAI error type."""

    def __init__(self, status: int, message: str, type_: str) -> None:
        super().__init__(message)
        self.status = status
        self.type = type_


def dumps(obj: Any) -> bytes:
    """JSON as UTF-8 bytes that never fail to encode: text is checked at the edge
    (``parse_json``), but a string the server made itself (a model's token piece, a
    library's message) could still hold a lone surrogate, and a failure here would
    come after the status line, cutting the answer. Such a body is sent with
    ``\\u`` escapes instead (still valid JSON)."""
    text = json.dumps(obj, ensure_ascii=False)
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError:
        return json.dumps(obj, ensure_ascii=True).encode("ascii")


def _json(obj: Any, status: int = 200) -> Response:
    return Response(dumps(obj), status=status, content_type="application/json")


def _error(status: int, message: str, type_: str, **extra: Any) -> Response:
    body = R.error_body(message, status, type_)
    body["error"].update(extra)
    return _json(body, status)


def _sse(obj: Any) -> bytes:
    return b"data: " + dumps(obj) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


def _http_error_type(status: int) -> str:
    return {
        401: "authentication_error",
        404: "not_found_error",
        405: "invalid_request_error",
        413: "invalid_request_error",
        501: "not_supported_error",
        503: "unavailable_error",
    }.get(status, "invalid_request_error" if status < 500 else "server_error")


def _error_of(exc: BaseException) -> Response:
    if isinstance(exc, ApiError):
        return _error(exc.status, str(exc), exc.type)
    if isinstance(exc, ContextOverflow):
        return _error(
            400, str(exc), "exceed_context_size_error", n_prompt_tokens=exc.n_tokens, n_ctx=exc.n_ctx
        )
    if isinstance(exc, InvalidRequest | TokenizerError | TemplateError):
        return _error(400, str(exc), "invalid_request_error")
    if isinstance(exc, BackendError):
        return _error(500, str(exc), "server_error")
    if isinstance(exc, TrioLLMError):
        return _error(500, str(exc), "server_error")
    if isinstance(exc, HTTPException):
        code = exc.code or 500
        return _error(code, exc.description or exc.name, _http_error_type(code))
    log.error("unexpected error in a request handler", exc_info=exc)
    return _error(500, f"internal error: {type(exc).__name__}", "server_error")


#: deepest nesting of arrays and objects a request body may have: far beyond any real
#: request (tools' JSON schemas included), far below Python's recursion limit, so
#: nothing that walks a body later (validation, templates, ``json.dumps``) can hit it
MAX_JSON_DEPTH = 64
#: a ``\\uD800``-``\\uDFFF`` escape: only then can a parsed string hold a lone surrogate
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def parse_json(raw: bytes) -> Any:
    """A request body as JSON, refused (``InvalidRequest``) unless it is valid UTF-8,
    valid JSON, at most ``MAX_JSON_DEPTH`` deep, and free of lone UTF-16 surrogates
    (``"\\ud800"`` parses to a Python string no UTF-8 encoder accepts: echoed in an
    answer, a template or a stop word it would fail there, mid-answer). Plain CPU
    work: the handlers run it on a worker thread (``_body``)."""
    if not raw:
        raise InvalidRequest("the request body is empty; send a JSON object")
    try:
        obj = json.loads(raw)
    except ValueError as exc:
        # JSONDecodeError, UnicodeDecodeError, and the plain ValueError of an integer
        # literal longer than Python converts (4300 digits, sys.int_info)
        raise InvalidRequest(f"the request body is not valid JSON: {exc}") from None
    except RecursionError:
        raise InvalidRequest(f"the request body nests arrays or objects deeper than {MAX_JSON_DEPTH}") from None
    check_strings = _SURROGATE_ESCAPE.search(raw) is not None
    stack: list[tuple[Any, int]] = [(obj, 1)]
    while stack:
        o, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise InvalidRequest(f"the request body nests arrays or objects deeper than {MAX_JSON_DEPTH}")
        if isinstance(o, dict):
            items: Iterable[Any] = o.values()
            if check_strings:
                for k in o:
                    _check_text(k)
        elif isinstance(o, list):
            items = o
        else:
            if check_strings and isinstance(o, str):
                _check_text(o)
            continue
        stack.extend((v, depth + 1) for v in items if isinstance(v, dict | list) or (check_strings and isinstance(v, str)))
    return obj


def _check_text(s: str) -> None:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as exc:
        bad = s[exc.start]
        raise InvalidRequest(
            f"the request body holds a lone UTF-16 surrogate (\\u{ord(bad):04x}) in a string; "
            "text must be valid Unicode"
        ) from None


async def _body() -> Any:
    raw = await request.get_data(as_text=False)
    assert isinstance(raw, bytes)
    if len(raw) < 4096:
        return parse_json(raw)  # not worth a thread hop
    return await trio.to_thread.run_sync(parse_json, raw)


Choice = tuple[tuple[int, ...], TaskParams]  # a task's prompt and parameters


SHUTDOWN_CUT = "the server is shutting down: the shutdown grace period ran out before this answer was done"


@attrs.define(eq=False)
class OpenRequests:
    """The answers being waited for, so that the end of the shutdown grace can end
    each with an error instead of a cut connection. ``end_all`` closes the receive
    side of every registered result channel: the handler (or streaming body) blocked
    on it wakes with ``ClosedResourceError``, turns it into a 503 (a whole answer) or
    a final error event (a stream), and the slots loop, on its next send, sees the
    task gone and frees the slot. No cancel scope spans a ``yield`` of a streaming
    body, so nothing is cancelled underneath the HTTP server's own writes."""

    _open: set[trio.MemoryReceiveChannel[TaskResult]] = attrs.field(factory=set)
    ended: bool = False

    def add(self, recv: trio.MemoryReceiveChannel[TaskResult]) -> None:
        if self.ended:
            raise ApiError(503, "the server is shutting down", "unavailable_error")
        self._open.add(recv)

    def discard(self, recv: trio.MemoryReceiveChannel[TaskResult]) -> None:
        self._open.discard(recv)

    def end_all(self) -> None:
        self.ended = True
        for recv in list(self._open):
            recv.close()


def end_requests(app: QuartTrio) -> None:
    """The shutdown grace is over: answer every request still waiting with a 503 (or
    a stream's error event) now. Called by the runtime just before it stops the HTTP
    server; the bodies then have a moment to reach their clients."""
    closer = app.extensions.get(OPEN_REQUESTS)
    if isinstance(closer, OpenRequests):
        closer.end_all()


OPEN_REQUESTS = "trio_llm.open_requests"


async def run_tasks(
    engine: Engine, choices: Sequence[Choice], *, action: SlotAction | None = None,
    open_requests: OpenRequests | None = None,
) -> AsyncGenerator[tuple[int, TaskResult], None]:
    """Post one task per entry of ``choices`` and yield (choice index, result) as they
    come, up to every task's final one. All answers share one
    channel (each task holds a clone of its sending end), so no nursery is needed to
    merge them. Leaving early (the client went away, the handler was cancelled)
    cancels the unfinished tasks in the queue. The channel is registered with
    ``open_requests`` while it is read, so that a shutdown can end it."""
    queue = engine.queue
    ids = [queue.new_id_task() for _ in choices]
    index = {id_task: i for i, id_task in enumerate(ids)}
    # a buffer no sender can fill: per task one partial per position plus the final
    # (and with return_progress one report per prompt pass, at most one per position)
    per_task = engine.n_ctx + 4 if any(p.stream for _, p in choices) else 4
    if any(p.stream and p.return_progress for _, p in choices):
        per_task += engine.n_ctx + 1
    send, recv = trio.open_memory_channel[TaskResult](per_task * len(choices))
    unfinished: set[int] = set()
    if open_requests is not None:
        open_requests.add(recv)
    try:
        async with recv:
            with send:  # only the tasks' clones stay open: the channel ends with them
                for id_task, (prompt, params) in zip(ids, choices, strict=True):
                    try:
                        await queue.post(ServerTask(id_task, prompt, params, send.clone(), action))
                    except (trio.BrokenResourceError, trio.ClosedResourceError):
                        # the queue is gone: nothing of this task to cancel
                        raise ApiError(503, "the server is shutting down", "unavailable_error") from None
                    unfinished.add(id_task)
            try:
                async for msg in recv:
                    if not isinstance(msg, TaskPartial):
                        unfinished.discard(msg.id_task)
                    yield index[msg.id_task], msg
                    if not unfinished:
                        return
            except trio.ClosedResourceError:
                raise ApiError(503, SHUTDOWN_CUT, "unavailable_error") from None
        raise ApiError(503, "the server is shutting down", "unavailable_error")
    finally:
        if open_requests is not None:
            open_requests.discard(recv)
        if unfinished:
            with trio.CancelScope(shield=True), trio.move_on_after(1.0):
                for id_task in sorted(unfinished):
                    await queue.cancel(id_task)


async def _finals(
    engine: Engine, choices: Sequence[Choice], open_requests: OpenRequests | None = None
) -> list[TaskFinal]:
    """Every choice's final answer, in choice order (the first error is raised)."""
    finals: dict[int, TaskFinal] = {}
    async with aclosing(run_tasks(engine, choices, open_requests=open_requests)) as results:
        async for i, msg in results:
            if isinstance(msg, TaskError):
                raise ApiError(msg.code, msg.message, msg.type)
            if isinstance(msg, TaskFinal):
                finals[i] = msg
    if len(finals) < len(choices):
        raise ApiError(503, "the server is shutting down", "unavailable_error")
    return [finals[i] for i in range(len(choices))]


async def _task_events(
    engine: Engine,
    choices: Sequence[Choice],
    on_partial: Callable[[int, TaskPartial], Iterable[bytes]],
    on_final: Callable[[int, TaskFinal], Iterable[bytes]],
    open_requests: OpenRequests | None = None,
) -> AsyncIterator[bytes]:
    """The server-sent events of streamed tasks (one per choice, interleaved as the
    tokens come), in each API's shape. Every stream ends with each choice's final
    event or with one error event: a task error, the server going away (or its
    shutdown grace running out), even a failure to build an event, is sent as an
    error event instead of a cut stream (a client cannot tell a cut from a
    network failure)."""
    try:
        async with aclosing(run_tasks(engine, choices, open_requests=open_requests)) as results:
            async for i, msg in results:
                if isinstance(msg, TaskPartial):
                    for event in on_partial(i, msg):
                        yield event
                elif isinstance(msg, TaskFinal):
                    for event in on_final(i, msg):
                        yield event
                elif isinstance(msg, TaskError):
                    yield _sse(R.error_body(msg.message, msg.code, msg.type))
    except ApiError as exc:
        yield _sse(R.error_body(str(exc), exc.status, exc.type))
    except TrioLLMError as exc:
        yield _sse(R.error_body(str(exc), 503, "unavailable_error"))
    except Exception as exc:
        log.error("unexpected error in a streamed answer", exc_info=exc)
        yield _sse(R.error_body(f"internal error: {type(exc).__name__}", 500, "server_error"))


def _stream(body: AsyncIterator[bytes]) -> Response:
    resp = Response(body, content_type="text/event-stream")
    resp.headers["Cache-Control"] = "no-cache"
    resp.timeout = None  # a generation may stream for longer than quart's default 60 s
    return resp


def create_app(ctx: ServerContext) -> QuartTrio:
    app = QuartTrio("trio_llm")
    app.config["RESPONSE_TIMEOUT"] = None
    app.config["MAX_CONTENT_LENGTH"] = 64 * 1024 * 1024
    open_requests = OpenRequests()
    app.extensions[OPEN_REQUESTS] = open_requests

    def eng() -> Engine:
        assert ctx.engine is not None  # before_request answers 503 until it is set
        return ctx.engine

    def piece(token: int) -> bytes:
        return bytes(eng().tokenizer.token_to_piece(token))

    def limits() -> P.Limits:
        e = eng()
        return P.Limits(e.n_ctx, e.model_config.n_vocab, ctx.config.parallel, ctx.config, e.media)

    @app.before_request
    async def gatekeeper() -> Response | None:
        if request.method == "OPTIONS":
            # a browser's CORS preflight carries no credentials: answer it before the
            # key check, as llama-server does (the request that follows is checked)
            resp = Response("", status=200)
            resp.headers["Access-Control-Allow-Methods"] = ctx.config.cors_methods
            resp.headers["Access-Control-Allow-Headers"] = ctx.config.cors_headers
            resp.headers["Access-Control-Max-Age"] = "600"
            return resp
        if request.path in PUBLIC_PATHS:
            return None
        keys = ctx.config.api_keys
        if keys:
            auth = request.headers.get("Authorization", "")
            given = auth[7:] if auth.lower().startswith("bearer ") else request.headers.get("X-Api-Key")
            if given not in keys:
                return _error(401, "Invalid API Key", "authentication_error")
        if ctx.engine is None:
            return _error(503, "Loading model", "unavailable_error")
        if not ctx.engine.model_config.causal_attn and request.path in GENERATION_PATHS:
            # an encoder (gemma-embedding) has no logits: llama-server's answer for a
            # model without memory, with --embeddings or without
            return _error(500, "the current context does not support logits computation. skipping", "server_error")
        if ctx.config.embeddings and request.path in GENERATION_PATHS:
            return _error(501, "This server was started with --embeddings (or --reranking), so its model computes "
                               "embeddings, not tokens: start it without them for generation", "not_supported_error")
        return None

    @app.errorhandler(Exception)
    async def on_error(exc: Exception) -> Response:
        return _error_of(exc)

    @app.after_request
    async def cors(resp: Response) -> Response:
        # web front ends on another origin (llama-server's CORS: the origin echoed,
        # credentials allowed); without an Origin header nothing is added
        origin = request.headers.get("Origin")
        if origin and ctx.config.cors_allows(origin):
            resp.headers["Access-Control-Allow-Origin"] = origin
            if ctx.config.cors_credentials:
                resp.headers["Access-Control-Allow-Credentials"] = "true"
            resp.headers["Vary"] = "Origin"
        return resp

    # -- state ------------------------------------------------------------------

    @app.get("/health")
    @app.get("/v1/health")
    async def health() -> Response:
        if ctx.engine is None:
            return _error(503, "Loading model", "unavailable_error", progress=round(ctx.load_progress, 3))
        return _json({"status": "ok"})

    @app.get("/v1/models")
    @app.get("/models")
    async def models() -> Response:
        e = eng()
        c = e.model_config
        meta = {
            "vocab_type": e.metadata.get("tokenizer.ggml.model", ""),
            "n_vocab": c.n_vocab,
            "n_ctx_train": c.n_ctx_train,
            "n_embd": c.n_embd,
            "n_params": e.n_params,
            "size": e.file_bytes,
        }
        model = {"id": ctx.model_id, "object": "model", "created": e.created, "owned_by": "llamacpp", "meta": meta}
        # llama-server's router reads these: what a model takes besides text
        model["capabilities"] = ["completion", "multimodal"] if e.media is not None else ["completion"]
        if ctx.config.model_ids:
            model["aliases"] = list(ctx.config.model_ids)
        if ctx.config.tags:
            model["tags"] = [t.strip() for t in ctx.config.tags.split(",") if t.strip()]
        return _json({"object": "list", "data": [model]})

    def generation_settings() -> dict[str, Any]:
        e = eng()
        return {
            "id": 0,
            "id_task": -1,
            "n_ctx": e.n_ctx,
            "speculative": False,
            "is_processing": False,
            "params": ctx.config.sampling_defaults() | {"n_batch": ctx.config.batch_size},
        }

    @app.get("/props")
    async def props() -> Response:
        e = eng()
        return _json(
            {
                "default_generation_settings": generation_settings(),
                "total_slots": ctx.config.parallel,
                "model_path": str(e.model_path),
                "model_alias": ctx.model_id,
                "chat_template": e.template.source,
                "modalities": {"vision": e.media is not None, "audio": False},
                "media_marker": e.media.marker if e.media is not None else MD.MARKER,
                "build_info": f"trio-llm {__version__}",
                "backend": e.backend_name,
                "is_sleeping": e.gate.is_sleeping(),
                "residency": e.gate.props(),
                "device": e.device,
            }
        )

    @app.post("/props")
    async def set_props() -> Response:
        # llama-server accepts the request and changes nothing ("update any props here")
        if not ctx.config.endpoint_props:
            return _error(501, "This server does not support changing global properties. Start it with `--props`",
                          "not_supported_error")
        await _body()
        return _json({"success": True})

    @app.post("/v1/chat/completions/control")
    async def chat_control() -> Response:
        """llama-server's runtime control of a live chat completion: ``{"id":
        "chatcmpl-...", "action": "reasoning_end"}`` ends its thought now (the request
        must have asked for ``reasoning_control``)."""
        body = await _body()
        if not isinstance(body, dict):
            raise InvalidRequest("the request body must be a JSON object")
        cmpl_id, action = body.get("id"), body.get("action")
        if not isinstance(cmpl_id, str) or not cmpl_id:
            raise InvalidRequest("missing completion id")
        if action != "reasoning_end":
            raise InvalidRequest("unknown control action")
        ok, message = eng().slots.end_reasoning(cmpl_id)
        return _json({"success": ok} | ({"message": message} if message else {}))

    @app.get("/lora-adapters")
    async def lora_adapters() -> Response:
        return _json([{"id": i, "path": path, "scale": scale} for i, (path, scale) in enumerate(ctx.config.lora)])

    @app.post("/lora-adapters")
    async def set_lora_adapters() -> Response:
        """llama-server sets the adapters' scales here; this server's are fixed at start
        (they are part of its graphs): the same scales succeed, others are a 400."""
        body = await _body()
        if P.lora_scales(body, ctx.config) != {i: s for i, (_, s) in enumerate(ctx.config.lora)}:
            raise InvalidRequest("changing LoRA scales at runtime is not supported: they are fixed at start "
                                 "(--lora-scaled)")
        return _json({"success": True})

    @app.get("/slots")
    async def slots() -> Response:
        if not ctx.config.endpoint_slots:
            return _error(501, "This server does not support slots endpoint. Start it with `--slots`",
                          "not_supported_error")
        return _json(eng().slots.slot_views())

    @app.post("/slots/<int:id_slot>")
    async def slot_action(id_slot: int) -> Response:
        """llama-server's slot save / restore / erase (``?action=``), run as a task
        pinned to the slot: it waits for a generation in the slot to finish."""
        e = eng()
        kind = request.args.get("action", "")
        if kind not in ("save", "restore", "erase"):
            raise ApiError(400, "'action' must be save, restore or erase", "invalid_request_error")
        if not 0 <= id_slot < ctx.config.parallel:
            raise ApiError(400, f"no slot {id_slot}: this server has {ctx.config.parallel}", "invalid_request_error")
        t0 = trio.current_time()
        action = SlotAction("erase")
        if kind != "erase":
            folder = ctx.config.slot_save_path
            if folder is None:
                raise ApiError(501, "slot save and restore need --slot-save-path", "not_supported_error")
            if not e.model_config.uniform_kv:
                raise ApiError(501, f"slot save and restore of {e.model_config.arch} (caches of per-layer shapes) "
                                    "are not supported", "not_supported_error")
            body = await _body()
            name = body.get("filename") if isinstance(body, dict) else None
            if not isinstance(name, str) or not P.valid_filename(name):
                raise ApiError(400, "'filename' must be a plain file name (no folders)", "invalid_request_error")
            path = folder / name
            action = SlotAction(kind, path, name)  # type: ignore[arg-type]
            if kind == "restore":
                # the file is read and checked here, off the slots loop (see SlotAction)
                tokens, kv, state = await trio.to_thread.run_sync(slot_file.load, path, e.model_config, e.n_ctx)
                action = SlotAction("restore", path, name, tuple(tokens), kv, state)
        params = TaskParams(n_predict=0, id_slot=id_slot, cache_prompt=False)
        async with aclosing(run_tasks(e, [((), params)], action=action, open_requests=open_requests)) as results:
            async for _, msg in results:
                if isinstance(msg, TaskError):
                    raise ApiError(msg.code, msg.message, msg.type)
                if isinstance(msg, TaskActionDone):
                    ms = 1e3 * (trio.current_time() - t0)
                    if action.kind == "restore":
                        return _json(msg.body | {"timings": {"restore_ms": ms}})  # the read included
                    if action.kind != "save":
                        return _json(msg.body)
                    assert action.path is not None and msg.kv is not None
                    n = await trio.to_thread.run_sync(slot_file.save, action.path, e.model_config, msg.tokens, msg.kv,
                                                      msg.state)
                    ms = 1e3 * (trio.current_time() - t0)
                    return _json(msg.body | {"n_written": n, "timings": {"save_ms": ms}})
        raise ApiError(503, "the server is shutting down", "unavailable_error")

    @app.get("/metrics")
    async def metrics() -> Response:
        if not ctx.config.metrics:
            return _error(501, "This server does not support metrics endpoint. Start it with `--metrics`", "not_supported_error")
        # llama-server's header: when this process started (dashboards detect restarts by it)
        return Response(render(eng().registry), content_type=CONTENT_TYPE,
                        headers={"Process-Start-Time-Unix": str(PROCESS_START_UNIX)})

    @app.post("/sleep")
    async def sleep() -> Response:
        level = request.args.get("level")
        if level is not None and level not in SLEEP_LEVELS:
            raise InvalidRequest(f"'level' must be one of {', '.join(SLEEP_LEVELS)}")
        e = eng()
        await e.gate.request_sleep(level)
        return _json({"status": "ok", "is_sleeping": e.gate.is_sleeping()})

    @app.post("/wake_up")
    async def wake_up() -> Response:
        e = eng()
        await e.gate.request_wake()
        return _json({"status": "ok", "is_sleeping": e.gate.is_sleeping()})

    # -- tokens and templates ---------------------------------------------------------

    # Tokenizing, detokenizing, templating and the JSON of their answers are CPU work
    # that grows with the request (a 5 MB prompt: seconds): each runs on a worker
    # thread, so /health and every stream keep being served meanwhile.

    @app.post("/tokenize")
    async def tokenize() -> Response:
        body = await _body()
        if not isinstance(body, dict) or not isinstance(body.get("content"), str):
            raise InvalidRequest("'content' must be a string")
        tok = eng().tokenizer
        add_special = P.get_bool(body, "add_special", False)
        parse_special = P.get_bool(body, "parse_special", True)
        with_pieces = P.get_bool(body, "with_pieces", False)

        def run() -> bytes:
            ids = tok.encode(body["content"], add_special=add_special, parse_special=parse_special)
            if not with_pieces:
                # in slices: one json.dumps of millions of ids holds the GIL for
                # 0.2 s in C, a slice for a few ms, and the event loop runs between
                parts = [json.dumps(ids[i : i + 65536])[1:-1] for i in range(0, len(ids), 65536)]
                return b'{"tokens": [' + ", ".join(parts).encode() + b"]}"
            out = []
            for t in ids:
                raw = bytes(tok.token_to_piece(t))
                try:
                    p: Any = raw.decode("utf-8")
                except UnicodeDecodeError:
                    p = list(raw)
                out.append({"id": t, "piece": p})
            return dumps({"tokens": out})

        return Response(await trio.to_thread.run_sync(run), content_type="application/json")

    @app.post("/detokenize")
    async def detokenize() -> Response:
        body = await _body()
        ids = body.get("tokens") if isinstance(body, dict) else None
        n_vocab = eng().model_config.n_vocab
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise InvalidRequest("'tokens' must be a list of token ids")
        bad = [t for t in ids if not 0 <= t < n_vocab]
        if bad:
            raise InvalidRequest(f"token {bad[0]} is outside the vocabulary of {n_vocab}")
        tok = eng().tokenizer
        text = await trio.to_thread.run_sync(tok.decode, ids)
        return _json({"content": text})

    async def remote_images(body: Any) -> dict[str, bytes]:
        """A chat request's ``http(s)://`` images, fetched here on trio, so that a
        cancelled request ends its downloads (``MD.fetch_images``); none without a
        projector, where an image part is refused unread."""
        if eng().media is None or not isinstance(body, dict):
            return {}
        return await MD.fetch_images(body.get("messages"))

    def chat_prompt(body: Any, fetched: dict[str, bytes]) -> tuple[str, CO.OutputSpec, str | None, list[bytes]]:
        """The rendered prompt of a chat request, how its answer is to be read, the
        grammar of a forced tool call, and the images its markers stand for (the
        remote ones from ``fetched``: ``remote_images``)."""
        template = eng().template
        images: list[bytes] = []
        if isinstance(body, dict) and "messages" in body:
            media = eng().media
            messages, images = MD.extract_images(body["messages"], media.marker if media is not None else None,
                                                 ctx.config.media_path, fetched)
            body = dict(body, messages=messages)
        inputs = P.chat_inputs(body, ctx.config, template.source)
        text = str(template.render(inputs.messages, add_generation_prompt=inputs.add_generation_prompt,
                                   **inputs.kwargs))
        if inputs.continue_final and not template.legacy:
            # prefill: the answer continues the last assistant message, so the prompt
            # ends with its text (the template's end-of-turn after it is cut); a
            # built-in format keeps it, as llama-server's legacy formatter does
            last = str(normalize_messages(inputs.messages[-1:])[0]["content"])  # a list of parts joined
            at = text.rfind(last) if last else -1
            if at >= 0:
                text = text[: at + len(last)]
        spec = attrs.evolve(inputs.output, thinking_open=text.rstrip().endswith(CO.THINK_OPEN))
        return text, spec, inputs.grammar, images

    def render_chat(body: Any, fetched: dict[str, bytes]) -> str:
        """Blocking (a template over the whole conversation): call on a worker thread."""
        return chat_prompt(body, fetched)[0]

    async def check_grammar(grammar: str | None) -> None:
        """A grammar the vocabulary cannot follow is a 400 before a slot is taken
        (the first check builds llguidance's view of the vocabulary: a worker thread)."""
        if grammar is not None:
            await trio.to_thread.run_sync(eng().grammars.compile, grammar)

    @app.post("/apply-template")
    async def apply_template() -> Response:
        body = await _body()
        fetched = await remote_images(body)
        return _json({"prompt": await trio.to_thread.run_sync(render_chat, body, fetched)})

    # -- embeddings and reranking (server/embeddings.py) ----------------------------------

    def embedder() -> EM.Embedder:
        e = eng().embedder
        if e is None:
            raise ApiError(501, "This server does not support embeddings. Start it with `--embeddings`",
                           "not_supported_error")
        assert isinstance(e, EM.Embedder)
        return e

    async def embed(oai: bool) -> Response:
        emb = embedder()
        if emb.pooling == "rank":
            raise ApiError(400, "this server scores with pooling rank (--reranking): use /rerank, or start it "
                                "with another --pooling for embeddings", "invalid_request_error")
        if oai and emb.pooling == "none":
            raise InvalidRequest("Pooling type 'none' is not OAI compatible. Please use a different pooling type")
        body = await _body()
        if not isinstance(body, dict):
            raise InvalidRequest("the request body must be a JSON object")
        if "input" in body:
            value = body["input"]
        elif "content" in body:
            oai = False  # llama-server: "content" is not OpenAI's, so the answer is the native one
            value = body["content"]
        else:
            raise InvalidRequest('"input" or "content" must be provided')
        use_base64 = EM.encoding_format(body)
        norm = EM.embd_normalize(body, ctx.config.embd_normalize)
        e = eng()
        prompts = await trio.to_thread.run_sync(EM.parse_inputs, value, e.tokenizer, e.model_config.n_vocab, e.n_ctx)
        results = await emb.embed(prompts, norm)
        if oai:
            return _json(EM.oai_response(results, model=EM.model_name(body, ctx.model_id), use_base64=use_base64))
        return _json(EM.native_response(results))

    @app.post("/embedding")
    @app.post("/embeddings")
    async def embeddings() -> Response:
        return await embed(oai=False)

    @app.post("/v1/embeddings")
    async def oai_embeddings() -> Response:
        return await embed(oai=True)

    @app.post("/rerank")
    @app.post("/reranking")
    @app.post("/v1/rerank")
    @app.post("/v1/reranking")
    async def rerank() -> Response:
        emb = eng().embedder
        # the flag, not the file's pooling type: llama-server checks --reranking (--pooling rank) too
        if not isinstance(emb, EM.Embedder) or ctx.config.pooling != "rank":
            raise ApiError(501, "This server does not support reranking. Start it with `--reranking`",
                           "not_supported_error")
        if not emb.has_rank_head:
            raise ApiError(400, f"this model has no rank head (tensor {EM.RANK_HEAD!r}, the classifier of a causal "
                                "reranker such as Qwen3-Reranker), so it cannot score documents",
                           "invalid_request_error")
        body = await _body()
        req = EM.parse_rerank(body)
        e = eng()

        def prompts() -> list[list[int]]:
            out = [EM.rerank_prompt(e.tokenizer, e.metadata, req.query, d) for d in req.documents]
            for ids in out:
                if not ids:
                    raise InvalidRequest("Input content cannot be empty")
                if len(ids) > e.n_ctx:
                    raise ContextOverflow(len(ids), e.n_ctx)
            return out

        toks = await trio.to_thread.run_sync(prompts)
        scores = await emb.rank(toks)
        return _json(EM.rerank_response(req, scores, [len(t) for t in toks], model=EM.model_name(body, ctx.model_id)))

    fim: list[IN.FimTokens] = []  # the vocabulary's FIM tokens, found on first use

    @app.post("/infill")
    async def infill() -> Response:
        e = eng()
        if not fim:
            fim.append(await trio.to_thread.run_sync(IN.fim_tokens, e.metadata))
        missing = fim[0].missing()
        if missing:
            raise ApiError(501, f"Infill is not supported by this model: {missing}", "not_supported_error")
        body = await _body()
        cfg = ctx.config
        # llama-server sizes the FIM prompt by its -b as given (params.n_batch), not
        # the pass size -b capped by -ub that config.n_batch is
        tokens = await trio.to_thread.run_sync(lambda: IN.infill_prompt(
            body, e.tokenizer, fim[0], n_vocab=e.model_config.n_vocab, n_batch=cfg.batch_size,
            n_predict=cfg.n_predict, n_ctx=e.n_ctx, spm=cfg.spm_infill))
        return await complete(dict(body, prompt=tokens))

    # -- generation ----------------------------------------------------------------------

    def render_prompt(prompt: tuple[int, ...]) -> str:
        """A prompt as llama-server writes it back: its images as the media marker."""
        e = eng()
        return MD.render(prompt, e.tokenizer.decode, e.media.marker if e.media is not None else MD.MARKER)

    def verbose_of(body: Any, req: P.CompletionRequest, finals: Sequence[TaskFinal]) -> dict[str, Any]:
        """llama-server's ``__verbose`` (the request's ``verbose``, on by default with
        ``-v``): the first answer in the native shape, with the prompt as text, special
        tokens written out. Empty when not asked for."""
        if not P.get_bool(body, "verbose", ctx.config.verbose):
            return {}
        native = R.native_final(finals[0], piece, model=ctx.model_id, settings=req.params.to_json(), stream=False,
                                n_probs=req.params.sampling.n_probs, return_tokens=req.params.return_tokens)
        return {"__verbose": native | {"prompt": render_prompt(req.prompt)}}

    @app.post("/completion")
    @app.post("/completions")
    async def completion() -> Response:
        return await complete(await _body())

    async def complete(body: Any) -> Response:
        """llama-server's native completion of ``body`` (also /infill's, with its prompt built)."""
        e = eng()
        lim = limits()
        # a request gone mid-parse stops its images' encodes (MD.run_sync_cancellable)
        req = await MD.run_sync_cancellable(
            lambda cancel: P.parse_completion(body, e.tokenizer, attrs.evolve(lim, cancel=cancel)))
        await check_grammar(req.params.grammar)
        n_probs = req.params.sampling.n_probs
        settings = req.params.to_json()
        choices = req.choices()
        if not req.params.stream:
            finals = await _finals(e, choices, open_requests)
            answers = [R.native_final(f, piece, model=ctx.model_id, settings=settings, stream=False,
                                      n_probs=n_probs, return_tokens=req.params.return_tokens, index=i) for i, f in enumerate(finals)]
            # llama-server's answer holds the prompt as text (special tokens written out)
            prompts = [p for p, _ in choices]
            texts = await trio.to_thread.run_sync(lambda: [render_prompt(p) for p in prompts])
            for answer, text in zip(answers, texts, strict=True):
                answer["prompt"] = text
            if req.params.response_fields:
                answers = [R.pick_fields(a, req.params.response_fields) for a in answers]
            # several prompts: a list of answers, as llama-server gives
            return _json(answers[0] if len(answers) == 1 else answers)

        return _stream(_task_events(
            e, choices,
            lambda i, msg: [_sse(R.native_partial(msg, piece, n_probs=n_probs, index=i))],
            # the last event holds the prompt as text too, as llama-server's
            lambda i, msg: [_sse(R.native_final(msg, piece, model=ctx.model_id, settings=settings, stream=True,
                                                n_probs=n_probs, return_tokens=req.params.return_tokens,
                                                index=i) | {"prompt": render_prompt(choices[i][0])})],
            open_requests,
        ))

    @app.post("/v1/completions")
    async def oai_completions() -> Response:
        e = eng()
        body = await _body()
        lim = limits()
        req = await MD.run_sync_cancellable(
            lambda cancel: P.parse_oai_completion(body, e.tokenizer, attrs.evolve(lim, cancel=cancel)))
        await check_grammar(req.params.grammar)
        id_ = f"cmpl-{e.queue.new_id_task()}"
        top = req.n_logprobs
        if not req.params.stream:
            finals = await _finals(e, req.choices(), open_requests)
            return _json(R.completion_response(finals, piece, id_=id_, model=ctx.model_id, logprobs=req.logprobs,
                                               top=top, n=req.n) | verbose_of(body, req, finals))

        created = R.unix_now()
        choices = req.choices()
        offsets = [0] * len(choices)
        done: dict[int, TaskFinal] = {}

        def on_partial(i: int, msg: TaskPartial) -> list[bytes]:
            lp = None
            if req.logprobs and msg.prob is not None:
                lp = R.completion_logprobs([msg.prob], piece, top, offsets[i])
            offsets[i] += len(msg.text)
            out = R.completion_chunk(id_=id_, model=ctx.model_id, created=created, text=msg.text, logprobs=lp, index=i)
            return [_sse(out | R.partial_extras(msg))]

        def on_final(i: int, msg: TaskFinal) -> list[bytes]:
            chunk = R.completion_chunk(
                id_=id_, model=ctx.model_id, created=created, text=msg.text_tail,
                finish_reason=R.FINISH_REASON[msg.stop_type], index=i,
            )
            chunk["timings"] = msg.timings.to_json()
            # llama-server's last chunk of each choice holds that choice's usage, asked or not
            chunk["usage"] = R.usage([msg])
            out = [_sse(chunk)]
            done[i] = msg
            if req.include_usage and len(done) == len(choices):
                usage = R.usage([done[j] for j in range(len(choices))], req.n)
                out.append(_sse(R.completion_chunk(id_=id_, model=ctx.model_id, created=created, text="") | {"choices": [], "usage": usage}))
            return out

        async def events() -> AsyncIterator[bytes]:
            async for event in _task_events(e, choices, on_partial, on_final, open_requests):
                yield event
            yield SSE_DONE

        return _stream(events())

    async def chat_request(body: Any) -> tuple[P.CompletionRequest, CO.OutputSpec]:
        """A chat body as its task parameters and how its answer is read (the chat
        completions, Anthropic and Responses routes all run this one path)."""
        e, lim = eng(), limits()
        fetched = await remote_images(body)

        def parse(cancel: threading.Event) -> tuple[P.CompletionRequest, CO.OutputSpec]:
            # the template, the tokenizer and the image encoder: CPU work, off the event loop
            prompt, spec, forced, images = chat_prompt(body, fetched)
            # the thinking budget's tags: a template that closes a thought (or opened one)
            thinks = spec.thinking_open or CO.THINK_CLOSE in (e.template.source or "")
            return P.parse_chat(body, e.tokenizer, attrs.evolve(lim, cancel=cancel), prompt, forced, images,
                                thinking=(thinks, spec.thinking_open)), spec

        req, spec = await MD.run_sync_cancellable(parse)
        await check_grammar(req.params.grammar)
        return req, spec

    async def chat_tokens(body: Any) -> int:
        """The rendered prompt's tokens of a chat body (images' positions included)."""
        tok, lim = eng().tokenizer, limits()
        fetched = await remote_images(body)

        def count(cancel: threading.Event) -> int:
            prompt, _, _, images = chat_prompt(body, fetched)
            return AN.count_tokens(prompt, images, tok, attrs.evolve(lim, cancel=cancel))

        return await MD.run_sync_cancellable(count)

    @app.post("/v1/chat/completions")
    @app.post("/chat/completions")
    async def chat_completions() -> Response:
        e = eng()
        body = await _body()
        req, spec = await chat_request(body)
        id_ = f"chatcmpl-{e.queue.new_id_task()}"
        req = attrs.evolve(req, params=attrs.evolve(req.params, cmpl_id=id_))  # for /v1/chat/completions/control
        top = req.n_logprobs
        if not req.params.stream:
            finals = await _finals(e, req.choices(), open_requests)
            answers = [CO.parse(f.content, spec)[0] for f in finals]
            return _json(R.chat_response(finals, piece, id_=id_, model=ctx.model_id, logprobs=req.logprobs, top=top,
                                         answers=answers) | verbose_of(body, req, finals))

        created = R.unix_now()
        done: dict[int, TaskFinal] = {}
        readers = [CO.StreamDeltas(spec) for _ in range(req.n)]

        def chunk(delta: dict[str, Any], index: int, **kw: Any) -> bytes:
            return _sse(R.chat_chunk(id_=id_, model=ctx.model_id, created=created, delta=delta, index=index, **kw))

        def on_partial(i: int, msg: TaskPartial) -> list[bytes]:
            if msg.progress is not None:
                # llama-server: a progress report is a role delta carrying prompt_progress
                role = R.chat_chunk(id_=id_, model=ctx.model_id, created=created,
                                    delta={"role": "assistant", "content": None}, index=i)
                return [_sse(role | R.partial_extras(msg))]
            lp = None
            if req.logprobs and msg.prob is not None:
                lp = R.chat_logprobs([msg.prob], piece, top)
            deltas = readers[i].feed(msg.text) if msg.text else []
            if lp is not None and not deltas:
                deltas = [{}]  # the token's log-probabilities, its text held back
            events = [R.chat_chunk(id_=id_, model=ctx.model_id, created=created, delta=d, index=i,
                                   logprobs=lp if k == 0 else None) for k, d in enumerate(deltas)]
            if events:
                events[-1] |= R.partial_extras(msg)  # as llama-server: the timings on the last delta
            return [_sse(e) for e in events]

        def on_final(i: int, msg: TaskFinal) -> list[bytes]:
            if msg.text_tail:
                readers[i].feed(msg.text_tail)
            out = [chunk(d, i) for d in readers[i].finish()]
            finish = "tool_calls" if readers[i].tool_calls else R.FINISH_REASON[msg.stop_type]
            last = R.chat_chunk(
                id_=id_, model=ctx.model_id, created=created, delta={},
                finish_reason=finish, index=i,
            )
            events = [last]
            done[i] = msg
            if req.include_usage and len(done) == req.n:
                usage = R.chat_chunk(id_=id_, model=ctx.model_id, created=created, delta={})
                events.append(usage | {"choices": [], "usage": R.usage([done[j] for j in range(req.n)], req.n)})
            events[-1]["timings"] = msg.timings.to_json()  # as llama-server: on the last event
            return out + [_sse(e) for e in events]

        async def events() -> AsyncIterator[bytes]:
            if not req.params.return_progress:  # else the first progress report is the role delta
                for i in range(req.n):
                    # llama-server's first delta: the role, content null (never an empty string)
                    yield chunk({"role": "assistant", "content": None}, i)
            async for event in _task_events(e, req.choices(), on_partial, on_final, open_requests):
                yield event
            yield SSE_DONE

        return _stream(events())

    @app.post("/v1/messages")
    async def anthropic_messages() -> Response:
        """Anthropic's Messages API: the body as the chat request it asks for, run as
        one, the answer in Anthropic's shapes (server/anthropic.py)."""
        e = eng()
        req, spec = await chat_request(await trio.to_thread.run_sync(AN.to_chat, await _body()))
        if not req.params.stream:
            final = (await _finals(e, req.choices(), open_requests))[0]
            return _json(AN.message(final, CO.parse(final.content, spec)[0], id_=AN.message_id(), model=ctx.model_id))
        out = AN.MessageStream(spec, AN.message_id(), ctx.model_id, len(req.prompt), dumps)
        return _stream(out.events(_task_events(e, req.choices(), out.on_partial, out.on_final, open_requests)))

    @app.post("/v1/messages/count_tokens")
    async def anthropic_count_tokens() -> Response:
        return _json({"input_tokens": await chat_tokens(await trio.to_thread.run_sync(AN.to_chat, await _body()))})

    @app.post("/v1/responses")
    @app.post("/responses")
    async def responses_create() -> Response:
        """OpenAI's Responses API: the body as the chat request it asks for, run as one,
        the answer in the Responses shapes (server/responses_api.py)."""
        e = eng()
        req, spec = await chat_request(await trio.to_thread.run_sync(RA.to_chat, await _body()))
        if not req.params.stream:
            final = (await _finals(e, req.choices(), open_requests))[0]
            return _json(RA.response(final, CO.parse(final.content, spec)[0], id_=RA.response_id(), model=ctx.model_id))
        out = RA.ResponseStream(spec, RA.response_id(), ctx.model_id, dumps)
        return _stream(_task_events(e, req.choices(), out.on_partial, out.on_final, open_requests))

    @app.post("/v1/responses/input_tokens")
    @app.post("/responses/input_tokens")
    async def responses_input_tokens() -> Response:
        return _json(RA.input_tokens(await chat_tokens(await trio.to_thread.run_sync(RA.to_chat, await _body()))))

    @app.post("/v1/chat/completions/input_tokens")
    @app.post("/chat/completions/input_tokens")
    async def chat_input_tokens() -> Response:
        return _json(RA.input_tokens(await chat_tokens(await _body())))

    return app


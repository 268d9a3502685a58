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
from trio_llm.server import params as P
from trio_llm.server import responses as R
from trio_llm.server.context import Engine, ServerContext
from trio_llm.server.metrics import CONTENT_TYPE, render
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
SLEEP_LEVELS = ("unload", "weights", "all")


class ApiError(TrioLLMError):
    """An HTTP-level refusal with its status and OpenAI error type."""

    def __init__(self, status: int, message: str, type_: str) -> None:
        super().__init__(message)
        self.status = status
        self.type = type_


def _json(obj: Any, status: int = 200) -> Response:
    return Response(json.dumps(obj, ensure_ascii=False), status=status, content_type="application/json")


def _error(status: int, message: str, type_: str, **extra: Any) -> Response:
    body = R.error_body(message, status, type_)
    body["error"].update(extra)
    return _json(body, status)


def _sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n"


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


async def _body() -> Any:
    raw = await request.get_data(as_text=False)
    if not raw:
        raise InvalidRequest("the request body is empty; send a JSON object")
    try:
        return json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InvalidRequest(f"the request body is not valid JSON: {exc}") from None


Choice = tuple[tuple[int, ...], TaskParams]  # a task's prompt and parameters


async def run_tasks(
    engine: Engine, choices: Sequence[Choice], *, action: SlotAction | None = None
) -> AsyncGenerator[tuple[int, TaskResult], None]:
    """Post one task per entry of ``choices`` and yield (choice index, result) as they
    come, up to every task's final one. All answers share one
    channel (each task holds a clone of its sending end), so no nursery is needed to
    merge them. Leaving early (the client went away, the handler was cancelled)
    cancels the unfinished tasks in the queue."""
    queue = engine.queue
    ids = [queue.new_id_task() for _ in choices]
    index = {id_task: i for i, id_task in enumerate(ids)}
    # a buffer no sender can fill: per task one partial per position plus the final
    per_task = engine.n_ctx + 4 if any(p.stream for _, p in choices) else 4
    send, recv = trio.open_memory_channel[TaskResult](per_task * len(choices))
    unfinished: set[int] = set()
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
            async for msg in recv:
                if not isinstance(msg, TaskPartial):
                    unfinished.discard(msg.id_task)
                yield index[msg.id_task], msg
                if not unfinished:
                    return
        raise ApiError(503, "the server is shutting down", "unavailable_error")
    finally:
        if unfinished:
            with trio.CancelScope(shield=True), trio.move_on_after(1.0):
                for id_task in sorted(unfinished):
                    await queue.cancel(id_task)


async def run_task(
    engine: Engine, prompt: tuple[int, ...], params: TaskParams
) -> AsyncGenerator[TaskResult, None]:
    """``run_tasks`` of one task: its results up to the final one."""
    async with aclosing(run_tasks(engine, [(prompt, params)])) as results:
        async for _, msg in results:
            yield msg


async def _finals(engine: Engine, choices: Sequence[Choice]) -> list[TaskFinal]:
    """Every choice's final answer, in choice order (the first error is raised)."""
    finals: dict[int, TaskFinal] = {}
    async with aclosing(run_tasks(engine, choices)) as results:
        async for i, msg in results:
            if isinstance(msg, TaskError):
                raise ApiError(msg.code, msg.message, msg.type)
            if isinstance(msg, TaskFinal):
                finals[i] = msg
    if len(finals) < len(choices):
        raise ApiError(503, "the server is shutting down", "unavailable_error")
    return [finals[i] for i in range(len(choices))]


async def _final(engine: Engine, prompt: tuple[int, ...], params: TaskParams) -> TaskFinal:
    return (await _finals(engine, [(prompt, params)]))[0]


async def _task_events(
    engine: Engine,
    choices: Sequence[Choice],
    on_partial: Callable[[int, TaskPartial], Iterable[bytes]],
    on_final: Callable[[int, TaskFinal], Iterable[bytes]],
) -> AsyncIterator[bytes]:
    """The server-sent events of streamed tasks (one per choice, interleaved as the
    tokens come), in each API's shape: a task error, or the server going away, becomes
    an error event instead of a cut stream."""
    try:
        async with aclosing(run_tasks(engine, choices)) as results:
            async for i, msg in results:
                if isinstance(msg, TaskPartial):
                    for event in on_partial(i, msg):
                        yield event
                elif isinstance(msg, TaskFinal):
                    for event in on_final(i, msg):
                        yield event
                elif isinstance(msg, TaskError):
                    yield _sse(R.error_body(msg.message, msg.code, msg.type))
    except TrioLLMError as exc:
        yield _sse(R.error_body(str(exc), 503, "unavailable_error"))


def _stream(body: AsyncIterator[bytes]) -> Response:
    resp = Response(body, content_type="text/event-stream")
    resp.headers["Cache-Control"] = "no-cache"
    resp.timeout = None  # a generation may stream for longer than quart's default 60 s
    return resp


def create_app(ctx: ServerContext) -> QuartTrio:
    app = QuartTrio("trio_llm")
    app.config["RESPONSE_TIMEOUT"] = None
    app.config["MAX_CONTENT_LENGTH"] = 64 * 1024 * 1024

    def eng() -> Engine:
        assert ctx.engine is not None  # before_request answers 503 until it is set
        return ctx.engine

    def piece(token: int) -> bytes:
        return bytes(eng().tokenizer.token_to_piece(token))

    def limits() -> P.Limits:
        e = eng()
        return P.Limits(e.n_ctx, e.model_config.n_vocab, ctx.config.parallel, ctx.config)

    @app.before_request
    async def gatekeeper() -> Response | None:
        if request.method == "OPTIONS":
            # a browser's CORS preflight carries no credentials: answer it before the
            # key check, as llama-server does (the request that follows is checked)
            resp = Response("", status=204)
            resp.headers["Access-Control-Allow-Methods"] = "GET, POST, OPTIONS"
            resp.headers["Access-Control-Allow-Headers"] = request.headers.get(
                "Access-Control-Request-Headers", "Authorization, Content-Type, X-Api-Key")
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
        return None

    @app.errorhandler(Exception)
    async def on_error(exc: Exception) -> Response:
        return _error_of(exc)

    @app.after_request
    async def cors(resp: Response) -> Response:
        # web front ends on another origin (llama-server's CORS: the origin echoed,
        # credentials allowed); without an Origin header nothing is added
        origin = request.headers.get("Origin")
        if origin:
            resp.headers["Access-Control-Allow-Origin"] = origin
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
        if len(ctx.config.model_ids) > 1:
            model["aliases"] = list(ctx.config.model_ids[1:])
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
                "modalities": {"vision": False, "audio": False},
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
        action = SlotAction("erase")
        if kind != "erase":
            folder = ctx.config.slot_save_path
            if folder is None:
                raise ApiError(501, "slot save and restore need --slot-save-path", "not_supported_error")
            body = await _body()
            name = body.get("filename") if isinstance(body, dict) else None
            if not isinstance(name, str) or not P.valid_filename(name):
                raise ApiError(400, "'filename' must be a plain file name (no folders)", "invalid_request_error")
            action = SlotAction(kind, folder / name, name)  # type: ignore[arg-type]
        params = TaskParams(n_predict=0, id_slot=id_slot, cache_prompt=False)
        async with aclosing(run_tasks(e, [((), params)], action=action)) as results:
            async for _, msg in results:
                if isinstance(msg, TaskError):
                    raise ApiError(msg.code, msg.message, msg.type)
                if isinstance(msg, TaskActionDone):
                    return _json(msg.body)
        raise ApiError(503, "the server is shutting down", "unavailable_error")

    @app.get("/metrics")
    async def metrics() -> Response:
        if not ctx.config.metrics:
            return _error(501, "This server does not support metrics endpoint. Start it with `--metrics`", "not_supported_error")
        return Response(render(eng().registry), content_type=CONTENT_TYPE)

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

    @app.post("/tokenize")
    async def tokenize() -> Response:
        body = await _body()
        if not isinstance(body, dict) or not isinstance(body.get("content"), str):
            raise InvalidRequest("'content' must be a string")
        tok = eng().tokenizer
        ids = tok.encode(
            body["content"],
            add_special=P.get_bool(body, "add_special", False),
            parse_special=P.get_bool(body, "parse_special", True),
        )
        if not P.get_bool(body, "with_pieces", False):
            return _json({"tokens": ids})
        out = []
        for t in ids:
            raw = piece(t)
            try:
                p: Any = raw.decode("utf-8")
            except UnicodeDecodeError:
                p = list(raw)
            out.append({"id": t, "piece": p})
        return _json({"tokens": out})

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
        return _json({"content": eng().tokenizer.decode(ids)})

    def chat_prompt(body: Any) -> tuple[str, CO.OutputSpec]:
        """The rendered prompt of a chat request, and how its answer is to be read."""
        template = eng().template
        inputs = P.chat_inputs(body, ctx.config, template.source)
        text = str(template.render(inputs.messages, add_generation_prompt=True, **inputs.kwargs))
        spec = attrs.evolve(inputs.output, thinking_open=text.rstrip().endswith(CO.THINK_OPEN))
        return text, spec

    def render_chat(body: Any) -> str:
        return chat_prompt(body)[0]

    @app.post("/apply-template")
    async def apply_template() -> Response:
        return _json({"prompt": render_chat(await _body())})

    # -- not built yet: a clear 501, not a 404 ------------------------------------------

    @app.post("/embedding")
    @app.post("/embeddings")
    @app.post("/v1/embeddings")
    async def embeddings() -> Response:
        return _error(501, "embeddings are not implemented yet in trio-llm (--embeddings is refused)",
                      "not_supported_error")

    @app.post("/rerank")
    @app.post("/reranking")
    @app.post("/v1/rerank")
    @app.post("/v1/reranking")
    async def rerank() -> Response:
        return _error(501, "reranking is not implemented yet in trio-llm (--rerank is refused)", "not_supported_error")

    @app.post("/infill")
    async def infill() -> Response:
        return _error(501, "/infill is not implemented yet in trio-llm", "not_supported_error")

    # -- generation ----------------------------------------------------------------------

    @app.post("/completion")
    @app.post("/completions")
    async def completion() -> Response:
        e = eng()
        req = P.parse_completion(await _body(), e.tokenizer, limits())
        n_probs = req.params.sampling.n_probs
        settings = req.params.to_json()
        choices = req.choices()
        if not req.params.stream:
            finals = await _finals(e, choices)
            answers = [R.native_final(f, piece, model=ctx.model_id, settings=settings, stream=False,
                                      n_probs=n_probs, index=i) for i, f in enumerate(finals)]
            # several prompts: a list of answers, as llama-server gives
            return _json(answers[0] if len(answers) == 1 else answers)

        return _stream(_task_events(
            e, choices,
            lambda i, msg: [_sse(R.native_partial(msg, piece, n_probs=n_probs, index=i))],
            lambda i, msg: [_sse(R.native_final(msg, piece, model=ctx.model_id, settings=settings, stream=True,
                                                n_probs=n_probs, index=i))],
        ))

    @app.post("/v1/completions")
    async def oai_completions() -> Response:
        e = eng()
        req = P.parse_oai_completion(await _body(), e.tokenizer, limits())
        id_ = f"cmpl-{e.queue.new_id_task()}"
        top = req.n_logprobs
        if not req.params.stream:
            finals = await _finals(e, req.choices())
            return _json(R.completion_response(finals, piece, id_=id_, model=ctx.model_id, logprobs=req.logprobs,
                                               top=top, n=req.n))

        created = R.unix_now()
        choices = req.choices()
        offsets = [0] * len(choices)
        done: dict[int, TaskFinal] = {}

        def on_partial(i: int, msg: TaskPartial) -> list[bytes]:
            lp = None
            if req.logprobs and msg.prob is not None:
                lp = R.completion_logprobs([msg.prob], piece, top, offsets[i])
            offsets[i] += len(msg.text)
            return [_sse(R.completion_chunk(id_=id_, model=ctx.model_id, created=created, text=msg.text, logprobs=lp, index=i))]

        def on_final(i: int, msg: TaskFinal) -> list[bytes]:
            chunk = R.completion_chunk(
                id_=id_, model=ctx.model_id, created=created, text=msg.text_tail,
                finish_reason=R.FINISH_REASON[msg.stop_type], index=i,
            )
            chunk["timings"] = msg.timings.to_json()
            out = [_sse(chunk)]
            done[i] = msg
            if req.include_usage and len(done) == len(choices):
                usage = R.usage([done[j] for j in range(len(choices))], req.n)
                out.append(_sse(R.completion_chunk(id_=id_, model=ctx.model_id, created=created, text="") | {"choices": [], "usage": usage}))
            return out

        async def events() -> AsyncIterator[bytes]:
            async for event in _task_events(e, choices, on_partial, on_final):
                yield event
            yield SSE_DONE

        return _stream(events())

    @app.post("/v1/chat/completions")
    @app.post("/chat/completions")
    async def chat_completions() -> Response:
        e = eng()
        body = await _body()
        prompt, spec = chat_prompt(body)
        req = P.parse_chat(body, e.tokenizer, limits(), prompt)
        id_ = f"chatcmpl-{e.queue.new_id_task()}"
        top = req.n_logprobs
        if not req.params.stream:
            finals = await _finals(e, req.choices())
            answers = [CO.parse(f.content, spec)[0] for f in finals]
            return _json(R.chat_response(finals, piece, id_=id_, model=ctx.model_id, logprobs=req.logprobs, top=top,
                                         answers=answers))

        created = R.unix_now()
        done: dict[int, TaskFinal] = {}
        readers = [CO.StreamDeltas(spec) for _ in range(req.n)]

        def chunk(delta: dict[str, Any], index: int, **kw: Any) -> bytes:
            return _sse(R.chat_chunk(id_=id_, model=ctx.model_id, created=created, delta=delta, index=index, **kw))

        def on_partial(i: int, msg: TaskPartial) -> list[bytes]:
            lp = None
            if req.logprobs and msg.prob is not None:
                lp = R.chat_logprobs([msg.prob], piece, top)
            deltas = readers[i].feed(msg.text) if msg.text else []
            if lp is not None and not deltas:
                deltas = [{"content": ""}]
            return [chunk(d, i, logprobs=lp if k == 0 else None) for k, d in enumerate(deltas)]

        def on_final(i: int, msg: TaskFinal) -> list[bytes]:
            if msg.text_tail:
                readers[i].feed(msg.text_tail)
            out = [chunk(d, i) for d in readers[i].finish()]
            finish = "tool_calls" if readers[i].tool_calls else R.FINISH_REASON[msg.stop_type]
            last = R.chat_chunk(
                id_=id_, model=ctx.model_id, created=created, delta={},
                finish_reason=finish, index=i,
            )
            last["timings"] = msg.timings.to_json()
            out.append(_sse(last))
            done[i] = msg
            if req.include_usage and len(done) == req.n:
                usage = R.chat_chunk(id_=id_, model=ctx.model_id, created=created, delta={})
                out.append(_sse(usage | {"choices": [], "usage": R.usage([done[j] for j in range(req.n)], req.n)}))
            return out

        async def events() -> AsyncIterator[bytes]:
            for i in range(req.n):
                yield chunk({"role": "assistant", "content": ""}, i)
            async for event in _task_events(e, req.choices(), on_partial, on_final):
                yield event
            yield SSE_DONE

        return _stream(events())

    return app


"""OpenAI's Responses API, as llama-server serves it: ``POST /v1/responses`` (Codex CLI,
the newer OpenAI SDKs) and the prompt counters ``POST /v1/responses/input_tokens`` and
``POST /v1/chat/completions/input_tokens``.

Inbox: a Responses request body. ``to_chat`` turns it into the OpenAI chat body that
``/v1/chat/completions`` already serves, so the request takes that endpoint's whole path
(template, tools, reasoning, images, grammar, sampling); nothing here touches a task.
Outbox: the answer in the Responses shapes, built from what that path yields:
``response`` for a whole answer (from the final result and its ``ChatAnswer``),
``ResponseStream`` for the server-sent events of a streamed one (from the same partials
and final the chat stream reads, through the same ``StreamDeltas``).

The conversion follows llama-server's ``server_chat_convert_responses_to_chatcmpl``:
``instructions`` is a system message; ``input`` a string (one user message) or a list of
items: messages (``user``, ``system``, ``developer`` with ``input_text``/``input_image``
parts; ``assistant`` with ``output_text``), ``function_call`` items (the assistant's
``tool_calls``), ``function_call_output`` items (``tool`` messages), ``reasoning`` items
(the assistant's ``reasoning_content``); assistant content, calls and reasoning that
follow an assistant message join it, so that one turn's items make one message.
``tools`` of type ``function`` (flat ``name``/``parameters``) become the chat request's
functions, ``max_output_tokens`` its ``max_tokens``, ``reasoning.effort`` its
``reasoning_effort``; llama.cpp's own fields (``top_k``, ``min_p``, ``dry_*``, the
thinking budgets...) pass through. Where it differs, on purpose:

- bad input is a 400 naming what is wrong: an unknown item or part type (llama-server:
  "Cannot determine type of 'item'"), a ``function_call_output`` whose ``function_call``
  is not in ``input`` before it (llama-server renders it);
- what would change the answer and cannot be done here is refused with a 400 naming it:
  ``previous_response_id`` (as llama-server: no response is kept), ``conversation``,
  ``prompt``, ``background``, ``max_tool_calls``, ``truncation: "auto"``, log
  probabilities (``top_logprobs``, ``include`` ``message.output_text.logprobs``),
  built-in and custom tools (``web_search``, ``file_search``, ``code_interpreter``,
  ``mcp``...: llama-server drops them silently), files (``input_file``, an image by
  ``file_id``);
- ``tool_choice`` naming a function (``{"type": "function", "name"}``) forces it and
  ``allowed_tools`` narrows the tools (llama-server reads only a string choice);
  ``text.format`` (``json_schema``, ``json_object``) constrains the answer
  (llama-server ignores it);
- an answer cut by ``max_output_tokens`` (or the context) is ``"status":
  "incomplete"`` with ``incomplete_details.reason`` ``max_output_tokens`` and its stream
  ends with ``response.incomplete``, as OpenAI's API says (llama-server says
  ``completed``);
- an assistant message without ``"type": "message"`` is read (OpenAI's short form), a
  ``refusal`` part as its text, a ``reasoning`` item without ``content`` (encrypted
  only) is skipped (llama-server refuses all three).

Harmless metadata (``model``, ``store``, ``metadata``, ``user``, ``service_tier``,
``include`` of encrypted reasoning, ``prompt_cache_key``, ``safety_identifier``,
``stream_options``, ``text.verbosity``, ``reasoning.summary``...) is ignored.

The answer, as llama-server's: ``{"completed_at", "created_at", "id": "resp_...",
"model", "object": "response", "output", "status", "usage"}``, output items
``reasoning`` (``content`` of one ``reasoning_text``, ``summary`` empty,
``encrypted_content`` empty), ``message`` (one ``output_text`` part) and
``function_call`` (``id`` ``fc_...``, ``call_id``, ``name``, ``arguments`` as JSON
text), usage ``input_tokens`` (the cached ones among them in ``input_tokens_details``),
``output_tokens``, ``total_tokens``. Events of a stream, llama-server's names, fields and
order, plus OpenAI's ``sequence_number``, ``output_index`` and ``content_index`` (which
llama-server leaves out; the OpenAI SDK's ``responses.stream()`` needs them): ``response.created`` and
``response.in_progress`` with the first token, for each item ``response.output_item.added``
then its deltas (``response.reasoning_text.delta``; ``response.content_part.added`` and
``response.output_text.delta``; ``response.function_call_arguments.delta``, a call's
whole arguments once it is complete), then at the end ``response.output_item.done`` of
the reasoning, ``response.output_text.done``, ``response.content_part.done`` and
``response.output_item.done`` of the message, one ``response.output_item.done`` per call,
and ``response.completed`` (carrying llama-server's ``timings``). An error mid-stream is
a ``data: {"error": ...}`` event, no ``[DONE]``.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Mapping
from typing import Any

import attrs

from trio_llm.errors import InvalidRequest
from trio_llm.model import chat_output as CO
from trio_llm.server import anthropic as AN
from trio_llm.server.responses import unix_now
from trio_llm.server.tasks import TaskFinal, TaskPartial

#: top-level fields that change the answer and that this server cannot honour: why
REFUSED = {
    "previous_response_id": "this server keeps no responses (nor does llama-server); send the whole "
                            "conversation in 'input'",
    "conversation": "this server keeps no conversations; send the whole conversation in 'input'",
    "prompt": "stored prompt templates live on OpenAI's servers",
    "background": "background responses need stored responses, which this server does not keep",
    "max_tool_calls": "a limit on built-in tool calls is not served",
}
#: Responses fields the chat request reads as they are
PASSED = ("temperature", "top_p", "top_k", "stream", "parallel_tool_calls", "stop", "response_format",
          "thinking_budget_tokens", "reasoning_budget_tokens", "return_progress", "timings_per_token", "lora")

#: the part types of a message's content, by role
INPUT_PARTS = frozenset({"input_text", "input_image"})
OUTPUT_PARTS = frozenset({"output_text", "input_text", "refusal"})
ROLES = frozenset({"user", "system", "developer", "assistant"})
#: item types of OpenAI's API that run tools on its servers (or the client's computer)
HOSTED_ITEMS = frozenset({
    "file_search_call", "web_search_call", "computer_call", "computer_call_output", "image_generation_call",
    "code_interpreter_call", "local_shell_call", "local_shell_call_output", "shell_call", "shell_call_output",
    "apply_patch_call", "apply_patch_call_output", "mcp_list_tools", "mcp_approval_request",
    "mcp_approval_response", "mcp_call", "custom_tool_call", "custom_tool_call_output", "item_reference",
    "compaction",
})


def _fail(where: str, what: str) -> InvalidRequest:
    return InvalidRequest(f"{where}: {what}" if where else what)


def _str(obj: Mapping[str, Any], key: str, where: str) -> str:
    value = obj.get(key)
    if not isinstance(value, str):
        raise _fail(where, f"'{key}' must be a string")
    return value


def _image(part: Mapping[str, Any], where: str) -> dict[str, Any]:
    """An ``input_image`` part as an OpenAI ``image_url`` part (a ``data:`` or remote URL)."""
    if part.get("image_url") is None and part.get("file_id") is not None:
        raise _fail(where, "an image by 'file_id' is not supported (files live on OpenAI's servers): "
                           "give its 'image_url' (a data: or http(s) URL)")
    return {"type": "image_url", "image_url": {"url": _str(part, "image_url", where)}}


def _input_parts(content: Any, where: str, *, tool_output: bool = False) -> list[dict[str, Any]]:
    """A user/system/developer message's content (or a call output's list) as chat parts."""
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise _fail(where, "must be a string or a list of content parts")
    parts = []
    for j, part in enumerate(content):
        at = f"{where}[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if not isinstance(part, dict) or not isinstance(kind, str):
            raise _fail(at, "a content part must be an object with a 'type'")
        if kind == "input_text":
            parts.append({"type": "text", "text": _str(part, "text", at)})
        elif kind == "input_image":
            parts.append(_image(part, at))
        elif kind == "input_file":
            raise _fail(at, "'input_file' parts are not supported (nor by llama-server): give the file's text "
                            "as 'input_text'")
        elif kind in OUTPUT_PARTS and not tool_output:
            raise _fail(at, f"a {kind!r} part belongs in an assistant message")
        else:
            raise _fail(at, f"content part type {kind!r} is not supported (input_text or input_image)")
    return parts


def _output_parts(content: Any, where: str) -> list[dict[str, Any]]:
    """An assistant message's content as chat text parts (a refusal as its text)."""
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise _fail(where, "must be a string or a list of output_text parts")
    parts = []
    for j, part in enumerate(content):
        at = f"{where}[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if not isinstance(part, dict) or kind not in OUTPUT_PARTS:
            raise _fail(at, f"an assistant message holds output_text and refusal parts, not {kind!r}")
        parts.append({"type": "text", "text": _str(part, "refusal" if kind == "refusal" else "text", at)})
    return parts


@attrs.define(eq=False)
class _Messages:
    """The chat messages of an ``input`` list, built item by item: an assistant item
    joins the assistant message before it (one turn's reasoning, text and calls are one
    message), and a call output must answer a call made before it."""

    out: list[dict[str, Any]] = attrs.field(factory=list)
    called: set[str] = attrs.field(factory=set)

    def assistant(self) -> dict[str, Any]:
        if self.out and self.out[-1]["role"] == "assistant":
            return self.out[-1]
        self.out.append({"role": "assistant"})
        return self.out[-1]

    def add(self, item: Any, where: str) -> None:
        if not isinstance(item, dict):
            raise _fail(where, "an input item must be an object")
        kind, role = item.get("type"), item.get("role")
        if kind == "message" or (kind is None and role is not None):
            self._message(item, role, where)
        elif kind == "function_call":
            call_id = _str(item, "call_id", where)
            call = {"id": call_id, "type": "function",
                    "function": {"name": _str(item, "name", where), "arguments": _str(item, "arguments", where)}}
            self.assistant().setdefault("tool_calls", []).append(call)
            self.called.add(call_id)
        elif kind == "function_call_output":
            call_id = _str(item, "call_id", where)
            if call_id not in self.called:
                raise _fail(where, f"function_call_output {call_id!r} answers no function_call item before it")
            output = item.get("output")
            content = output if isinstance(output, str) else _input_parts(output, f"{where}.output", tool_output=True)
            self.out.append({"role": "tool", "tool_call_id": call_id, "content": content})
        elif kind == "reasoning":
            self._reasoning(item, where)
        elif kind in HOSTED_ITEMS:
            raise _fail(where, f"item type {kind!r} is not supported: its tool runs on OpenAI's servers or is not "
                               "served here (function tools only)")
        elif kind is None:
            raise _fail(where, "an input item needs a 'type' (or a 'role', for a message)")
        else:
            raise _fail(where, f"item type {kind!r} is not supported (message, function_call, "
                               "function_call_output, reasoning)")

    def _message(self, item: Mapping[str, Any], role: Any, where: str) -> None:
        if not isinstance(role, str) or role not in ROLES:
            raise _fail(where, "'role' must be \"user\", \"system\", \"developer\" or \"assistant\"")
        if "content" not in item:
            raise _fail(where, "'content' is required")
        if role != "assistant":
            self.out.append({"role": role, "content": _input_parts(item["content"], f"{where}.content")})
            return
        parts = _output_parts(item["content"], f"{where}.content")
        msg = self.assistant()
        msg["content"] = [*(msg.get("content") or []), *parts]

    def _reasoning(self, item: Mapping[str, Any], where: str) -> None:
        """A ``reasoning`` item's text (its ``reasoning_text`` parts) as the assistant's
        ``reasoning_content``; one with none (only a summary or encrypted content, which a
        local model cannot read) adds nothing."""
        content = item.get("content") or []
        if not isinstance(content, list):
            raise _fail(where, "a reasoning item's 'content' must be a list of reasoning_text parts")
        text = ""
        for j, part in enumerate(content):
            at = f"{where}.content[{j}]"
            if not isinstance(part, dict):
                raise _fail(at, "must be an object")
            text += _str(part, "text", at)
        if text:
            msg = self.assistant()
            msg.setdefault("content", [])
            msg["reasoning_content"] = (msg.get("reasoning_content") or "") + text


def _tools(value: Any) -> list[dict[str, Any]]:
    if not isinstance(value, list):
        raise InvalidRequest("'tools' must be a list")
    out = []
    for i, tool in enumerate(value):
        where = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise _fail(where, "must be an object")
        kind = tool.get("type")
        if kind != "function":
            raise _fail(where, f"tool type {kind!r} is not supported: built-in tools run on OpenAI's servers and "
                               "custom (free-form) tools are not served; give a function tool (type, name, "
                               "parameters)")
        name = _str(tool, "name", where)
        if not name:
            raise _fail(where, "'name' must not be empty")
        description = tool.get("description") or ""
        if not isinstance(description, str):
            raise _fail(where, "'description' must be a string")
        parameters = tool.get("parameters") or {}
        if not isinstance(parameters, dict):
            raise _fail(where, "'parameters' must be a JSON schema object")
        # what llama-server hands the template: name, description, parameters
        out.append({"type": "function", "function": {"name": name, "description": description,
                                                     "parameters": parameters}})
    return out


def _tool_choice(value: Any, tools: list[dict[str, Any]]) -> tuple[str | dict[str, Any], list[dict[str, Any]]]:
    """The chat request's ``tool_choice`` and its tools (``allowed_tools`` narrows them)."""
    if value in ("auto", "none", "required"):
        return str(value), tools
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "function" and isinstance(value, dict):
        return {"type": "function", "function": {"name": _str(value, "name", "tool_choice")}}, tools
    if kind == "allowed_tools" and isinstance(value, dict):
        mode, allowed = value.get("mode", "auto"), value.get("tools")
        if mode not in ("auto", "required"):
            raise InvalidRequest("'tool_choice.mode' must be \"auto\" or \"required\"")
        if not isinstance(allowed, list) or not all(isinstance(t, dict) and t.get("type") == "function"
                                                    and isinstance(t.get("name"), str) for t in allowed):
            raise InvalidRequest("'tool_choice.tools' must be a list of {\"type\": \"function\", \"name\": ...}")
        names = {t["name"] for t in allowed}
        return str(mode), [t for t in tools if t["function"]["name"] in names]
    if isinstance(kind, str):
        raise InvalidRequest(f"'tool_choice' of type {kind!r} is not supported: built-in and custom tools are not "
                             "served (function tools only)")
    raise InvalidRequest("'tool_choice' must be \"auto\", \"none\", \"required\", {\"type\": \"function\", "
                         "\"name\": ...} or {\"type\": \"allowed_tools\", ...}")


def _text_format(value: Any, out: dict[str, Any]) -> None:
    """``text.format`` as the chat request's ``response_format`` (``text.verbosity``, a
    hint for OpenAI's models, is ignored)."""
    if not isinstance(value, dict):
        raise InvalidRequest("'text' must be an object")
    fmt = value.get("format")
    if fmt is None:
        return
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return
    if kind == "json_object":
        out["response_format"] = {"type": "json_object"}
    elif kind == "json_schema" and isinstance(fmt, dict) and isinstance(fmt.get("schema"), dict):
        out["response_format"] = {"type": "json_schema",
                                  "json_schema": {"name": fmt.get("name", "output"), "schema": fmt["schema"]}}
    else:
        raise InvalidRequest("'text.format' must be {\"type\": \"text\"}, {\"type\": \"json_object\"} or "
                             "{\"type\": \"json_schema\", \"name\": ..., \"schema\": {...}}")


def _refuse(body: Mapping[str, Any]) -> None:
    for key, why in REFUSED.items():
        if body.get(key) not in (None, "", False):
            raise InvalidRequest(f"'{key}' is not supported: {why}")
    if body.get("truncation") not in (None, "disabled"):
        raise InvalidRequest("'truncation' other than \"disabled\" is not supported: a prompt that does not fit "
                             "the context is an error here, never cut")
    if body.get("top_logprobs") not in (None, 0):
        raise InvalidRequest("'top_logprobs' is not supported on /v1/responses (use /v1/chat/completions)")
    include = body.get("include")
    if include is not None and not isinstance(include, list):
        raise InvalidRequest("'include' must be a list")
    if "message.output_text.logprobs" in (include or []):
        raise InvalidRequest("'include' of 'message.output_text.logprobs' is not supported on /v1/responses "
                             "(use /v1/chat/completions)")


def to_chat(body: Any) -> dict[str, Any]:
    """A Responses request as the OpenAI chat request it asks for (raises
    ``InvalidRequest`` for a body that is wrong or asks for what is not served)."""
    if not isinstance(body, dict):
        raise InvalidRequest("the request body must be a JSON object")
    _refuse(body)
    if "input" not in body:
        raise InvalidRequest("'input' is required")
    messages = _Messages()
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise InvalidRequest("'instructions' must be a string")
        messages.out.append({"role": "system", "content": instructions})
    given = body["input"]
    if isinstance(given, str):
        messages.out.append({"role": "user", "content": given})
    elif isinstance(given, list):
        for i, item in enumerate(given):
            messages.add(item, f"input[{i}]")
    else:
        raise InvalidRequest("'input' must be a string or a list of items")
    if not messages.out:
        raise InvalidRequest("'input' holds no message")
    out: dict[str, Any] = {key: value for key, value in body.items()
                           if key in AN.LLAMA_FIELDS or key.startswith(AN.LLAMA_PREFIXES) or key in PASSED}
    out["messages"] = messages.out
    tools = _tools(body["tools"]) if body.get("tools") is not None else []
    if body.get("tool_choice") is not None:
        out["tool_choice"], tools = _tool_choice(body["tool_choice"], tools)
    if tools:
        out["tools"] = tools
    limit = body.get("max_output_tokens")
    if limit is not None:
        if not isinstance(limit, int) or isinstance(limit, bool):
            raise InvalidRequest("'max_output_tokens' must be an integer")
        out["max_tokens"] = limit
    reasoning = body.get("reasoning")
    if reasoning is not None:
        if not isinstance(reasoning, dict):
            raise InvalidRequest("'reasoning' must be an object")
        if reasoning.get("effort") is not None:
            out["reasoning_effort"] = reasoning["effort"]
    if body.get("text") is not None:
        _text_format(body["text"], out)
    return out


def input_tokens(n: int) -> dict[str, Any]:
    """The answer of the ``input_tokens`` endpoints (llama-server's, for both)."""
    return {"input_tokens": n, "object": "response.input_tokens"}


# -- answers -------------------------------------------------------------------------


def new_id(prefix: str) -> str:
    return prefix + uuid.uuid4().hex


def response_id() -> str:
    return new_id("resp_")


def item_id(call: CO.ToolCall) -> str:
    """A function_call item's ``id``: ``fc_`` and the call's own part of its id."""
    return "fc_" + call.id.removeprefix("call_")


def usage(final: TaskFinal) -> dict[str, Any]:
    n_in, n_out = final.n_prompt, final.timings.predicted_n
    return {"input_tokens": n_in, "output_tokens": n_out, "total_tokens": n_in + n_out,
            "input_tokens_details": {"cached_tokens": final.timings.cache_n}}


def _status(final: TaskFinal) -> dict[str, Any]:
    if final.stop_type == "limit":
        return {"status": "incomplete", "incomplete_details": {"reason": "max_output_tokens"}}
    return {"status": "completed"}


def output_text(text: str) -> dict[str, Any]:
    return {"type": "output_text", "annotations": [], "logprobs": [], "text": text}


def call_item(call: CO.ToolCall, status: str) -> dict[str, Any]:
    return {"id": item_id(call), "type": "function_call", "status": status, "arguments": call.arguments,
            "call_id": call.id, "name": call.name}


def response(final: TaskFinal, answer: CO.ChatAnswer, *, id_: str, model: str) -> dict[str, Any]:
    """The non-streamed answer: output items reasoning, message, then each call."""
    output: list[dict[str, Any]] = []
    if answer.reasoning:
        output.append({"id": new_id("rs_"), "summary": [], "type": "reasoning",
                       "content": [{"text": answer.reasoning, "type": "reasoning_text"}],
                       "encrypted_content": "", "status": "completed"})
    if answer.content:
        output.append({"content": [output_text(answer.content)], "id": new_id("msg_"), "role": "assistant",
                       "status": "completed", "type": "message"})
    output += [call_item(call, "completed") for call in answer.tool_calls]
    now = unix_now()
    status = _status(final)
    return {"completed_at": now if status["status"] == "completed" else None, "created_at": now, "id": id_,
            "model": model, "object": "response", "output": output, **status, "usage": usage(final)}


Event = tuple[str, dict[str, Any]]


@attrs.define(eq=False)
class ResponseStream:
    """The server-sent events of one streamed answer. ``on_partial`` and ``on_final``
    are the chat stream's callbacks (``http._task_events``), whose error events are
    llama-server's for this API as they are."""

    spec: CO.OutputSpec
    id_: str
    model: str
    dumps: Callable[[Any], bytes]
    _reader: CO.StreamDeltas = attrs.field(init=False)
    _created: bool = False
    _reasoning_id: str = attrs.field(factory=lambda: new_id("rs_"))
    _message_id: str = attrs.field(factory=lambda: new_id("msg_"))
    _reasoning: str | None = None  # None: no reasoning item opened yet
    _content: str | None = None  # None: no message item opened yet
    #: OpenAI's stream fields llama-server leaves out (the OpenAI SDK's responses.stream()
    #: needs them): every event's sequence_number, an item's output_index by its id
    _sequence: int = 0
    _index: dict[str, int] = attrs.field(factory=dict)

    def __attrs_post_init__(self) -> None:
        self._reader = CO.StreamDeltas(self.spec)

    def on_partial(self, i: int, msg: TaskPartial) -> list[bytes]:
        events = self._start()
        if msg.progress is not None:
            if not events:  # a later report: llama-server's in_progress again, carrying it
                events = [self._in_progress()]
        elif msg.text:
            events += self._deltas(self._reader.feed(msg.text))
        if events:  # as llama-server: the token's extras on its last event
            if msg.timings is not None:
                events[-1][1]["timings"] = msg.timings.to_json()
            if msg.progress is not None:
                events[-1][1]["prompt_progress"] = msg.progress.to_json()
        return self._encode(events)

    def on_final(self, i: int, msg: TaskFinal) -> list[bytes]:
        events = self._start()
        if msg.text_tail:
            events += self._deltas(self._reader.feed(msg.text_tail))
        events += self._deltas(self._reader.finish())
        output: list[dict[str, Any]] = []
        if self._reasoning:
            item = {"id": self._reasoning_id, "summary": [], "type": "reasoning",
                    "content": [{"text": self._reasoning, "type": "reasoning_text"}], "encrypted_content": ""}
            events.append(self._item_done(item))
            output.append(item)
        if self._content:
            part = output_text(self._content)
            events.append(("response.output_text.done", {"type": "response.output_text.done",
                                                         "item_id": self._message_id, "text": self._content}))
            events.append(("response.content_part.done", {"type": "response.content_part.done",
                                                          "item_id": self._message_id, "part": part}))
            item = {"type": "message", "status": "completed", "id": self._message_id, "content": [part],
                    "role": "assistant"}
            events.append(self._item_done(item))
            output.append(item)
        for call in self._reader.tool_calls:
            item = call_item(call, "completed")
            events.append(self._item_done(item))
            output.append(item)
        status = _status(msg)
        name = "response.completed" if status["status"] == "completed" else "response.incomplete"
        body = {"id": self.id_, "object": "response", "created_at": unix_now(), **status, "model": self.model,
                "output": output, "usage": usage(msg)}
        events.append((name, {"type": name, "response": body, "timings": msg.timings.to_json()}))
        return self._encode(events)

    def _in_progress(self) -> Event:
        return "response.in_progress", {"type": "response.in_progress",
                                        "response": {"id": self.id_, "object": "response", "status": "in_progress"}}

    def _start(self) -> list[Event]:
        if self._created:
            return []
        self._created = True
        created = {"type": "response.created",
                   "response": {"id": self.id_, "object": "response", "status": "in_progress"}}
        return [("response.created", created), self._in_progress()]

    @staticmethod
    def _item_done(item: dict[str, Any]) -> Event:
        return "response.output_item.done", {"type": "response.output_item.done", "item": item}

    def _deltas(self, deltas: list[dict[str, Any]]) -> list[Event]:
        """OpenAI chat deltas (``StreamDeltas``) as Responses events."""
        events: list[Event] = []
        for d in deltas:
            if d.get("reasoning_content"):
                if self._reasoning is None:
                    self._reasoning = ""
                    item = {"id": self._reasoning_id, "summary": [], "type": "reasoning", "content": [],
                            "encrypted_content": "", "status": "in_progress"}
                    events.append(("response.output_item.added", {"type": "response.output_item.added",
                                                                  "item": item}))
                self._reasoning += d["reasoning_content"]
                events.append(("response.reasoning_text.delta", {"type": "response.reasoning_text.delta",
                                                                 "delta": d["reasoning_content"],
                                                                 "item_id": self._reasoning_id}))
            if d.get("content"):
                if self._content is None:
                    self._content = ""
                    item = {"content": [], "id": self._message_id, "role": "assistant", "status": "in_progress",
                            "type": "message"}
                    events.append(("response.output_item.added", {"type": "response.output_item.added",
                                                                  "item": item}))
                    events.append(("response.content_part.added", {"type": "response.content_part.added",
                                                                   "item_id": self._message_id,
                                                                   "part": {"type": "output_text", "text": ""}}))
                self._content += d["content"]
                events.append(("response.output_text.delta", {"type": "response.output_text.delta",
                                                              "item_id": self._message_id, "delta": d["content"]}))
            for call in d.get("tool_calls") or []:
                fn = call["function"]
                tool_call = CO.ToolCall(fn["name"], fn["arguments"], id=call["id"])
                item = {"id": item_id(tool_call), "arguments": "", "call_id": call["id"], "name": fn["name"],
                        "type": "function_call", "status": "in_progress"}
                events.append(("response.output_item.added", {"type": "response.output_item.added", "item": item}))
                if fn["arguments"]:
                    events.append(("response.function_call_arguments.delta",
                                   {"type": "response.function_call_arguments.delta", "delta": fn["arguments"],
                                    "item_id": item_id(tool_call)}))
        return events

    def _encode(self, events: list[Event]) -> list[bytes]:
        out = []
        for name, data in events:
            item = data.get("item")
            key = item.get("id") if isinstance(item, dict) else data.get("item_id")
            if isinstance(key, str):
                if name == "response.output_item.added":
                    self._index.setdefault(key, len(self._index))
                if key in self._index:
                    data["output_index"] = self._index[key]
                if "part" in data or name.startswith(("response.output_text.", "response.reasoning_text.")):
                    data["content_index"] = 0
            data["sequence_number"] = self._sequence
            self._sequence += 1
            out.append(b"event: " + name.encode() + b"\ndata: " + self.dumps(data) + b"\n\n")
        return out

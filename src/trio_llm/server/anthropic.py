"""Anthropic's Messages API, as llama-server serves it: ``POST /v1/messages`` and
``POST /v1/messages/count_tokens`` (Claude Code and the Anthropic SDKs pointed at a
local server).

Inbox: an Anthropic request body. ``to_chat`` turns it into the OpenAI chat body that
``/v1/chat/completions`` already serves, so the request takes that endpoint's whole path
(template, tools, reasoning, images, grammar, sampling); nothing here touches a task.
Outbox: the answer in Anthropic's shapes, built from what that path yields: ``message``
for a whole answer (from the final result and its ``ChatAnswer``), ``MessageStream``
for the server-sent events of a streamed one (from the same partials and final the
chat stream reads, through the same ``StreamDeltas``).

The conversion follows llama-server's ``server_chat_convert_anthropic_to_oai``: the
system prompt (a string, or text blocks joined) becomes a system message, with Claude
Code's ``x-anthropic-billing-header`` stamp (``cch=``, new on every request) written as
``fffff`` so that the prompt cache gets past it; text and image blocks become OpenAI
content parts (an image source as a ``data:`` or remote URL), ``thinking`` blocks the
assistant's ``reasoning_content``, ``tool_use`` blocks its ``tool_calls`` (input as
JSON text), ``tool_result`` blocks ``tool`` messages; ``tools`` become functions
(``input_schema`` is the parameters), ``stop_sequences`` the stop words, a missing
``max_tokens`` 4096, ``thinking.budget_tokens`` the chat request's
``thinking_budget_tokens``. Where they differ, on purpose:

- bad input is a 400 naming what is wrong (llama-server skips an unknown block and
  answers a missing ``messages`` with a 500): a body that is not an object, messages
  that are not a non-empty list of user/assistant turns, an unknown block or one in
  the wrong turn, a ``tool_result`` whose ``tool_use`` is not in the turn before;
- what would change the answer and cannot be done here is refused with a 400 naming
  it: server tools (a tool ``type`` other than ``custom``), ``mcp_servers``,
  ``container``, image and document sources other than base64, URL and plain text;
- ``tool_choice`` ``{"type": "tool", "name"}`` forces that tool (llama-server forces
  any tool) and ``{"type": "none"}`` leaves the tools out (llama-server ignores it);
  ``thinking`` ``{"type": "disabled"}`` sets the template's ``enable_thinking`` false;
  ``output_format`` / ``output_config.format`` (a JSON schema) constrain the answer,
  ``output_config.effort`` is the ``reasoning_effort``;
- a user turn's tool results come before its text (they answer the calls of the turn
  before; llama-server puts the text first);
- ``stop_reason`` is ``stop_sequence`` when a stop sequence ended the answer, as
  Anthropic's API says (llama-server says ``end_turn`` there, with ``stop_sequence``
  set); the message ``id`` is ``msg_...`` (llama-server's is ``chatcmpl-...``);
  a streamed ``tool_use`` block starts with ``"input": {}``, as Anthropic's do.

Harmless metadata (``model``, ``metadata``, ``service_tier``, ``cache_control``,
``context_management``...) is ignored; llama.cpp's own sampling fields (``seed``,
``min_p``, ``dry_*``...) and ``chat_template_kwargs`` pass through to the chat request.

Events of a stream, as llama-server sends them: ``message_start`` with the first token
(its usage: the prompt tokens, those read from the slot's cache apart), then for each
block in order ``content_block_start`` and its ``content_block_delta``s
(``thinking_delta``, ``text_delta``, ``input_json_delta``: a tool call's whole input
once the call is complete), all blocks closed at the end (a thinking block with an
empty ``signature_delta`` first), ``message_delta`` (``stop_reason``,
``stop_sequence``, ``usage.output_tokens``) and ``message_stop``. An error mid-stream
is an ``event: error`` carrying our error object. No ``[DONE]``.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from typing import Any

import attrs

from trio_llm.errors import InvalidRequest
from trio_llm.model import chat_output as CO
from trio_llm.server.params import Encoder, Limits, encode_prompt
from trio_llm.server.tasks import TaskFinal, TaskPartial

#: llama-server's ``max_tokens`` when a request has none (Anthropic requires it)
DEFAULT_MAX_TOKENS = 4096
#: llama-server's ``thinking_budget_tokens`` for ``thinking: {"type": "enabled"}`` without a budget
DEFAULT_THINKING_BUDGET = 10000

BILLING_HEADER = "x-anthropic-billing-header:"

#: top-level fields that change the answer and that a local server cannot honour
REFUSED = {
    "mcp_servers": "MCP servers are called by Anthropic's servers",
    "container": "code-execution containers run on Anthropic's servers",
}
#: Anthropic's sampling fields, passed as they are (llama-server's list, plus ``stream``)
PASSED = ("temperature", "top_p", "top_k", "stream")
#: llama.cpp's own request fields that the chat endpoint reads, passed through
LLAMA_FIELDS = frozenset({
    "chat_template_kwargs", "seed", "min_p", "typical_p", "repeat_penalty", "repeat_last_n", "presence_penalty",
    "frequency_penalty", "top_n_sigma", "min_keep", "samplers", "logit_bias", "ignore_eos", "cache_prompt",
    "id_slot", "n_cache_reuse", "reasoning_format", "grammar", "json_schema",
})
LLAMA_PREFIXES = ("dry_", "xtc_", "dynatemp_", "mirostat", "adaptive_")

#: the block types each turn may hold (others known to Anthropic's API are refused by name)
BLOCKS = {
    "user": frozenset({"text", "image", "document", "tool_result"}),
    "assistant": frozenset({"text", "thinking", "redacted_thinking", "tool_use"}),
}


def _fail(where: str, what: str) -> InvalidRequest:
    return InvalidRequest(f"{where}: {what}" if where else what)


def _str(obj: Mapping[str, Any], key: str, where: str, default: str | None = None) -> str:
    value = obj.get(key, default)
    if not isinstance(value, str):
        raise _fail(where, f"'{key}' must be a string")
    return value


def normalize_billing_header(text: str) -> str:
    """Claude Code's first system block, ``x-anthropic-billing-header: cc_version=...;
    cch=a5145;...``: its five-character ``cch`` stamp changes on every request, so that
    no prompt cache would get past it; written as ``fffff`` (llama-server's fix). Any
    other text is returned as it is."""
    if not text.startswith(BILLING_HEADER):
        return text
    at = text.find("cch=", len(BILLING_HEADER))
    if at < 0:
        return text
    start = at + len("cch=")
    if start + 5 < len(text) and text[start + 5] == ";":
        return text[:start] + "fffff" + text[start + 5:]
    return text


def _system(value: Any) -> str:
    if isinstance(value, str):
        return normalize_billing_header(value)
    if not isinstance(value, list):
        raise InvalidRequest("'system' must be a string or a list of text blocks")
    texts = []
    for j, block in enumerate(value):
        where = f"system[{j}]"
        if not isinstance(block, dict) or block.get("type") != "text":
            raise _fail(where, "only text blocks can make the system prompt")
        texts.append(normalize_billing_header(_str(block, "text", where)))
    return "".join(texts)  # as llama-server: the blocks glued together


def _image_url(source: Any, where: str) -> str:
    """An image block's source as an OpenAI ``image_url``: a ``data:`` URL or its URL."""
    if not isinstance(source, dict):
        raise _fail(where, "'source' must be an object")
    kind = source.get("type")
    if kind == "base64":
        media_type = _str(source, "media_type", where, "image/jpeg")
        return f"data:{media_type};base64,{_str(source, 'data', where)}"
    if kind == "url":
        return _str(source, "url", where)
    raise _fail(where, f"image source type {kind!r} is not supported (base64 or url)")


def _document_text(block: Mapping[str, Any], where: str) -> str:
    """A text document's text: a ``text`` source's data, or a ``content`` source's text
    (a string, or text blocks glued); PDFs and files are refused."""
    source = block.get("source")
    kind = source.get("type") if isinstance(source, dict) else None
    if kind == "text" and isinstance(source, dict):
        return _str(source, "data", where)
    if kind == "content" and isinstance(source, dict):
        content = source.get("content")
        if isinstance(content, str):
            return content
        if isinstance(content, list) and all(isinstance(b, dict) and b.get("type") == "text" for b in content):
            return "".join(_str(b, "text", where) for b in content)
    raise _fail(where, f"a document of source type {kind!r} is not supported (only text documents: a text "
                       "source, or a content source of text blocks)")


def _tool_result_content(value: Any, where: str) -> str | list[dict[str, Any]]:
    """A tool result as a tool message's content: its text (the text blocks glued, as
    llama-server does), or content parts when it holds images."""
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise _fail(where, "'content' must be a string or a list of text and image blocks")
    parts: list[dict[str, Any]] = []
    for k, block in enumerate(value):
        at = f"{where}.content[{k}]"
        kind = block.get("type") if isinstance(block, dict) else None
        part = _content_part(block, kind, at)
        if part is None:
            raise _fail(at, f"a tool result holds text and image blocks, not {kind!r}")
        parts.append(part)
    if all(p["type"] == "text" for p in parts):
        return "".join(p["text"] for p in parts)
    return parts


def _content_part(block: dict[str, Any], kind: Any, at: str) -> dict[str, Any] | None:
    """A text, image or document block as the OpenAI content part it becomes; None for
    another kind (the caller says what its place holds)."""
    if kind == "text":
        return {"type": "text", "text": _str(block, "text", at)}
    if kind == "image":
        return {"type": "image_url", "image_url": {"url": _image_url(block.get("source"), at)}}
    if kind == "document":
        return {"type": "text", "text": _document_text(block, at)}
    return None


def _turn(message: Any, i: int, called: frozenset[str]) -> tuple[list[dict[str, Any]], frozenset[str]]:
    """One Anthropic turn as OpenAI messages, and the ids of its tool calls. ``called``:
    the calls of the turn before, which this turn's tool results must answer."""
    where = f"messages[{i}]"
    if not isinstance(message, dict):
        raise _fail(where, "must be an object")
    role = message.get("role")
    if not isinstance(role, str) or role not in BLOCKS:
        raise _fail(where, "'role' must be \"user\" or \"assistant\"")
    if "content" not in message:
        raise _fail(where, "'content' is required")
    content = message["content"]
    if isinstance(content, str):
        return [{"role": role, "content": content}], frozenset()
    if not isinstance(content, list):
        raise _fail(where, "'content' must be a string or a list of content blocks")
    parts: list[dict[str, Any]] = []
    calls: list[dict[str, Any]] = []
    results: list[dict[str, Any]] = []
    reasoning = ""
    for j, block in enumerate(content):
        at = f"{where}.content[{j}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if not isinstance(block, dict) or not isinstance(kind, str):
            raise _fail(at, "a content block must be an object with a 'type'")
        if kind not in BLOCKS[role]:
            other = "assistant" if role == "user" else "user"
            if kind in BLOCKS[other]:
                raise _fail(at, f"a {kind!r} block belongs in a {other} turn, not a {role} turn")
            raise _fail(at, f"content block type {kind!r} is not supported "
                            f"(a {role} turn holds {', '.join(sorted(BLOCKS[role]))})")
        part = _content_part(block, kind, at)
        if part is not None:
            parts.append(part)
        elif kind == "thinking":
            reasoning += _str(block, "thinking", at)
        elif kind == "redacted_thinking":
            continue  # Anthropic's encrypted thoughts: nothing a local model can read
        elif kind == "tool_use":
            args = block.get("input", {})
            if not isinstance(args, dict):
                raise _fail(at, "a tool_use block's 'input' must be an object")
            calls.append({"id": _str(block, "id", at), "type": "function",
                          "function": {"name": _str(block, "name", at), "arguments": json.dumps(args, ensure_ascii=False)}})
        else:  # tool_result
            id_ = _str(block, "tool_use_id", at)
            if id_ not in called:
                raise _fail(at, f"tool_result {id_!r} answers no tool_use block of the turn before")
            results.append({"role": "tool", "tool_call_id": id_,
                            "content": _tool_result_content(block.get("content"), at)})
    out = list(results)  # the answers to the calls of the turn before come first
    if parts or calls or reasoning:
        msg: dict[str, Any] = {"role": role, "content": parts or ""}
        if calls:
            msg["tool_calls"] = calls
        if reasoning:
            msg["reasoning_content"] = reasoning
        out.append(msg)
    return out, frozenset(c["id"] for c in calls)


def _tools(value: Any) -> list[dict[str, Any]]:
    if not isinstance(value, list):
        raise InvalidRequest("'tools' must be a list")
    out = []
    for i, tool in enumerate(value):
        where = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise _fail(where, "must be an object")
        kind = tool.get("type", "custom")
        if kind not in ("custom", None):
            raise _fail(where, f"tool type {kind!r} is not supported: it runs on Anthropic's servers or is built "
                               "into Claude; give a custom tool (name, description, input_schema)")
        name = _str(tool, "name", where)
        if not name:
            raise _fail(where, "'name' must not be empty")
        schema = tool.get("input_schema", {})
        if not isinstance(schema, dict):
            raise _fail(where, "'input_schema' must be a JSON schema object")
        out.append({"type": "function", "function": {
            "name": name, "description": _str(tool, "description", where, ""), "parameters": schema}})
    return out


def _tool_choice(value: Any) -> str | dict[str, Any]:
    kind = value.get("type") if isinstance(value, dict) else None
    if kind in ("auto", "none"):
        return str(kind)
    if kind == "any":
        return "required"
    if kind == "tool" and isinstance(value, dict):
        return {"type": "function", "function": {"name": _str(value, "name", "tool_choice")}}
    raise InvalidRequest("'tool_choice' must be {\"type\": \"auto\" | \"any\" | \"none\"} or "
                         "{\"type\": \"tool\", \"name\": ...}")


def _thinking(value: Any, out: dict[str, Any]) -> None:
    """``thinking`` into the chat request ``out``: a budget (llama-server's
    ``thinking_budget_tokens``), thinking switched off, or the model's own choice."""
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "enabled" and isinstance(value, dict):
        budget = value.get("budget_tokens", DEFAULT_THINKING_BUDGET)
        if not isinstance(budget, int) or isinstance(budget, bool):
            raise InvalidRequest("'thinking.budget_tokens' must be an integer")
        out["thinking_budget_tokens"] = budget
    elif kind == "disabled":
        kwargs = out.get("chat_template_kwargs", {})
        if isinstance(kwargs, dict):  # else the chat request refuses it
            out["chat_template_kwargs"] = {"enable_thinking": False, **kwargs}
    elif kind not in ("adaptive", "between_tools"):  # the model's own choice: no budget
        raise InvalidRequest("'thinking' must be {\"type\": \"enabled\", \"budget_tokens\": N}, "
                             "{\"type\": \"adaptive\"}, {\"type\": \"between_tools\"} or {\"type\": \"disabled\"}")


def _output_config(body: Mapping[str, Any], out: dict[str, Any]) -> None:
    """Structured output (``output_format``, ``output_config.format``) as OpenAI's
    ``response_format``; ``output_config.effort`` as the ``reasoning_effort``."""
    config = body.get("output_config")
    if config is not None and not isinstance(config, dict):
        raise InvalidRequest("'output_config' must be an object")
    config = config or {}
    formats = [(k, v) for k, v in (("output_format", body.get("output_format")),
                                   ("output_config.format", config.get("format"))) if v is not None]
    if len(formats) > 1:
        raise InvalidRequest("give one of 'output_format' and 'output_config.format'")
    for key, value in formats:
        if not isinstance(value, dict) or value.get("type") != "json_schema" or not isinstance(value.get("schema"), dict):
            raise InvalidRequest(f"'{key}' must be {{\"type\": \"json_schema\", \"schema\": {{...}}}}")
        out["response_format"] = {"type": "json_schema", "json_schema": {"name": "output", "schema": value["schema"]}}
    effort = config.get("effort")
    if effort is not None:
        if not isinstance(effort, str):
            raise InvalidRequest("'output_config.effort' must be a string")
        out["reasoning_effort"] = effort


def to_chat(body: Any) -> dict[str, Any]:
    """An Anthropic Messages request as the OpenAI chat request it asks for (raises
    ``InvalidRequest`` for a body that is wrong or asks for what is not served)."""
    if not isinstance(body, dict):
        raise InvalidRequest("the request body must be a JSON object")
    for key, why in REFUSED.items():
        if body.get(key) not in (None, [], {}):
            raise InvalidRequest(f"'{key}' is not supported: {why}")
    messages: list[dict[str, Any]] = []
    if body.get("system") is not None:
        messages.append({"role": "system", "content": _system(body["system"])})
    if "messages" not in body:
        raise InvalidRequest("'messages' is required")
    turns = body["messages"]
    if not isinstance(turns, list) or not turns:
        raise InvalidRequest("'messages' must be a non-empty list of objects")
    called: frozenset[str] = frozenset()
    for i, turn in enumerate(turns):
        converted, called = _turn(turn, i, called)
        messages += converted
    out: dict[str, Any] = {key: value for key, value in body.items()
                           if key in LLAMA_FIELDS or key.startswith(LLAMA_PREFIXES)}
    out["messages"] = messages
    if body.get("tools") is not None:
        out["tools"] = _tools(body["tools"])
    if body.get("tool_choice") is not None:
        out["tool_choice"] = _tool_choice(body["tool_choice"])
    if body.get("stop_sequences") is not None:
        if not isinstance(body["stop_sequences"], list):
            raise InvalidRequest("'stop_sequences' must be a list of strings")
        out["stop"] = body["stop_sequences"]
    out["max_tokens"] = body.get("max_tokens", DEFAULT_MAX_TOKENS)
    for key in PASSED:
        if key in body:
            out[key] = body[key]
    if out.get("stream") is True:
        out["timings_per_token"] = True  # the first partial's cached tokens, for message_start's usage
    if body.get("thinking") is not None:
        _thinking(body["thinking"], out)
    _output_config(body, out)
    return out


def count_tokens(rendered: str, images: Sequence[bytes], tok: Encoder, limits: Limits) -> int:
    """The rendered prompt's length in tokens, as the chat path would tokenize it (an
    image counts its positions); not held to the context size, unlike a request.
    Blocking (it may encode images): call on a worker thread."""
    if limits.media is not None and (images or limits.media.marker in rendered):
        return len(limits.media.tokenize(rendered, images, {}, cancel=limits.cancel))
    return len(encode_prompt(tok, rendered))


# -- answers -------------------------------------------------------------------------


def message_id() -> str:
    return "msg_" + uuid.uuid4().hex[:24]


def stop_reason(final: TaskFinal, tool_calls: bool) -> tuple[str, str | None]:
    """(``stop_reason``, ``stop_sequence``) of an answer."""
    if final.stop_type == "limit":
        return "max_tokens", None
    if tool_calls:
        return "tool_use", None
    if final.stop_type == "word" and final.stopping_word:
        return "stop_sequence", final.stopping_word
    return "end_turn", None


def usage(n_prompt: int, n_cached: int, n_output: int) -> dict[str, int]:
    """llama-server's usage: the prompt tokens read from the slot's cache apart."""
    return {"cache_read_input_tokens": n_cached, "input_tokens": n_prompt - n_cached, "output_tokens": n_output}


def tool_input(arguments: str) -> Any:
    """A call's arguments as the ``input`` object (an empty one where they are not JSON,
    as llama-server)."""
    try:
        value = json.loads(arguments)
    except json.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {}


def message(final: TaskFinal, answer: CO.ChatAnswer, *, id_: str, model: str) -> dict[str, Any]:
    """The non-streamed answer: a message whose blocks are the thinking, the text, then
    each tool call."""
    content: list[dict[str, Any]] = []
    if answer.reasoning:
        content.append({"type": "thinking", "thinking": answer.reasoning, "signature": ""})
    if answer.content:
        content.append({"type": "text", "text": answer.content})
    for call in answer.tool_calls:
        content.append({"type": "tool_use", "id": call.id, "name": call.name, "input": tool_input(call.arguments)})
    reason, sequence = stop_reason(final, bool(answer.tool_calls))
    return {
        "id": id_,
        "type": "message",
        "role": "assistant",
        "content": content,
        "model": model,
        "stop_reason": reason,
        "stop_sequence": sequence,
        "usage": usage(final.n_prompt, final.timings.cache_n, final.timings.predicted_n),
    }


Event = tuple[str, dict[str, Any]]


@attrs.define(eq=False)
class MessageStream:
    """The server-sent events of one streamed answer (one choice). ``on_partial`` and
    ``on_final`` are the chat stream's callbacks (``http._task_events``); ``events``
    wraps the stream, naming its error events. ``n_prompt``: the prompt's tokens, for
    the usage of ``message_start``; the cached ones come from the first partial's
    timings (the converted request asks for them: ``timings_per_token``)."""

    spec: CO.OutputSpec
    id_: str
    model: str
    n_prompt: int
    dumps: Callable[[Any], bytes]
    _reader: CO.StreamDeltas = attrs.field(init=False)
    _started: bool = False
    _blocks: dict[Any, tuple[int, str]] = attrs.field(factory=dict)  # key -> (index, block type), in order
    _calls: bool = False

    def __attrs_post_init__(self) -> None:
        self._reader = CO.StreamDeltas(self.spec)

    def on_partial(self, i: int, msg: TaskPartial) -> list[bytes]:
        if msg.progress is not None:
            return []
        events = self._start(msg.timings.cache_n if msg.timings is not None else 0)
        if msg.text:
            events += self._deltas(self._reader.feed(msg.text))
        return self._encode(events)

    def on_final(self, i: int, msg: TaskFinal) -> list[bytes]:
        events = self._start(msg.timings.cache_n)
        if msg.text_tail:
            events += self._deltas(self._reader.feed(msg.text_tail))
        events += self._deltas(self._reader.finish())
        for index, kind in self._blocks.values():  # opened in index order; closed at the end, as llama-server
            if kind == "thinking":
                events.append(self._delta(index, {"type": "signature_delta", "signature": ""}))
            events.append(("content_block_stop", {"type": "content_block_stop", "index": index}))
        reason, sequence = stop_reason(msg, self._calls)
        events.append(("message_delta", {"type": "message_delta",
                                         "delta": {"stop_reason": reason, "stop_sequence": sequence},
                                         "usage": {"output_tokens": msg.timings.predicted_n}}))
        events.append(("message_stop", {"type": "message_stop"}))
        return self._encode(events)

    async def events(self, source: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        """``source``'s events; its error events (``data: {"error": ...}``) named ``error``."""
        async for chunk in source:
            yield chunk if chunk.startswith(b"event: ") else b"event: error\n" + chunk

    def _start(self, n_cached: int) -> list[Event]:
        if self._started:
            return []
        self._started = True
        body: dict[str, Any] = {
            "id": self.id_, "type": "message", "role": "assistant", "content": [], "model": self.model,
            "stop_reason": None, "stop_sequence": None, "usage": usage(self.n_prompt, n_cached, 0),
        }
        return [("message_start", {"type": "message_start", "message": body})]

    def _open(self, key: Any, block: dict[str, Any]) -> tuple[int, list[Event]]:
        if key in self._blocks:
            return self._blocks[key][0], []
        index = len(self._blocks)
        self._blocks[key] = (index, block["type"])
        return index, [("content_block_start", {"type": "content_block_start", "index": index, "content_block": block})]

    @staticmethod
    def _delta(index: int, delta: dict[str, Any]) -> Event:
        return "content_block_delta", {"type": "content_block_delta", "index": index, "delta": delta}

    def _deltas(self, deltas: list[dict[str, Any]]) -> list[Event]:
        """OpenAI deltas (``StreamDeltas``) as Anthropic block events."""
        events: list[Event] = []
        for d in deltas:
            if d.get("reasoning_content"):
                index, opened = self._open("thinking", {"type": "thinking", "thinking": ""})
                events += [*opened, self._delta(index, {"type": "thinking_delta", "thinking": d["reasoning_content"]})]
            if d.get("content"):
                index, opened = self._open("text", {"type": "text", "text": ""})
                events += [*opened, self._delta(index, {"type": "text_delta", "text": d["content"]})]
            for call in d.get("tool_calls") or []:
                self._calls = True
                fn = call["function"]
                index, opened = self._open(("tool", call["index"]),
                                           {"type": "tool_use", "id": call["id"], "name": fn["name"], "input": {}})
                events += opened
                if fn["arguments"]:
                    events.append(self._delta(index, {"type": "input_json_delta", "partial_json": fn["arguments"]}))
        return events

    def _encode(self, events: list[Event]) -> list[bytes]:
        return [b"event: " + name.encode() + b"\ndata: " + self.dumps(data) + b"\n\n" for name, data in events]

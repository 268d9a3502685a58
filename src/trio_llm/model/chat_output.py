"""A chat answer's text → OpenAI's message: content, reasoning_content, tool_calls.

What a model writes for a tool call depends on its family, and its chat template says
which family it is (``detect_format``), as llama.cpp's ``common_chat_templates_init``
decides from the template's text:

- ``hermes``: Qwen3, Qwen2.5, Hermes: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``;
- ``qwen3_coder``: Qwen3-Coder and Qwen3.5: ``<tool_call><function=NAME><parameter=P>V</parameter>
  </function></tool_call>``;
- ``llama3_json``: Llama 3.x: the answer is one JSON object ``{"name": ..., "parameters": {...}}``
  (after an optional ``<|python_tag|>``);
- ``generic``: any other template: tools are described in a system message and the model
  is asked to answer ``{"tool_call": {"name", "arguments"}}`` or ``{"response": "..."}``
  (llama.cpp's generic format).

Thinking: with ``reasoning_format`` other than ``none``, the text up to ``</think>``
(after an optional ``<think>``, or from the start when the rendered prompt ended in an
open ``<think>``) becomes ``reasoning_content``; ``deepseek-legacy`` also leaves it in
``content``, tags included.

``parse`` is a pure function over text; ``StreamDeltas`` re-parses the growing text of a
streamed answer and yields only what is new, holding back a tail that may still become
a marker (``<tool_call>``, ``</think>``) so nothing sent as content is later taken back.
A tool call is streamed as one delta once it is complete.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import attrs

Format = Literal["hermes", "qwen3_coder", "llama3_json", "generic"]
REASONING_FORMATS = ("none", "auto", "deepseek", "deepseek-legacy")

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"


@attrs.frozen
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str = attrs.field(factory=lambda: "call_" + uuid.uuid4().hex[:24], eq=False)

    def to_json(self, index: int | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {"id": self.id, "type": "function",
                               "function": {"name": self.name, "arguments": self.arguments}}
        if index is not None:
            out = {"index": index, **out}
        return out


@attrs.frozen
class ChatAnswer:
    content: str
    reasoning: str | None = None
    tool_calls: tuple[ToolCall, ...] = ()

    def message(self) -> dict[str, Any]:
        """The OpenAI ``message`` of a non-streamed choice."""
        msg: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.reasoning is not None:
            msg["reasoning_content"] = self.reasoning
        if self.tool_calls:
            msg["content"] = self.content or None
            msg["tool_calls"] = [c.to_json() for c in self.tool_calls]
        return msg


@attrs.frozen
class OutputSpec:
    """How one request's answer is read."""

    fmt: Format | None = None  # None: no tools asked for, nothing parsed as a call
    reasoning_format: str = "auto"
    thinking_open: bool = False  # the rendered prompt ends in an open <think>
    tools: tuple[Mapping[str, Any], ...] = ()


def detect_format(source: str | None) -> Format:
    text = source or ""
    if "<tool_call>" in text and "<function=" in text:
        return "qwen3_coder"
    if "<tool_call>" in text:
        return "hermes"
    if "<|python_tag|>" in text or ("<|start_header_id|>" in text and "tools" in text):
        return "llama3_json"
    return "generic"


def template_handles_tools(source: str | None) -> bool:
    return bool(source) and "tools" in (source or "")


def generic_tool_prompt(tools: Sequence[Mapping[str, Any]]) -> str:
    """The system text llama.cpp's generic format adds when the template knows no tools."""
    return (
        "You can call these tools (JSON schema of each):\n"
        + json.dumps([t.get("function", t) for t in tools], ensure_ascii=False, indent=2)
        + "\n\nRespond in JSON format, either with `tool_call` (a request to call tools) or with "
        "`response` reply to the user's request: {\"tool_call\": {\"name\": ..., \"arguments\": {...}}} "
        "or {\"response\": \"...\"}"
    )


# ---------------------------------------------------------------------------
# reasoning


def split_reasoning(text: str, spec: OutputSpec, *, partial: bool) -> tuple[str | None, str, bool]:
    """(reasoning or None, the rest, still inside the thinking)."""
    if spec.reasoning_format == "none":
        return None, text, False
    body = text
    opened = spec.thinking_open
    stripped = body.lstrip()
    if stripped.startswith(THINK_OPEN):
        body, opened = stripped[len(THINK_OPEN):], True
    elif partial and THINK_OPEN.startswith(stripped) and stripped:
        return None, "", True  # "<thi": may still open a thought
    if not opened:
        return None, text, False
    end = body.find(THINK_CLOSE)
    if end < 0:
        if not partial:
            return body.strip(), "", True
        body = body.lstrip()
        return body[: len(body) - _partial_marker(body, THINK_CLOSE)].rstrip(), "", True
    reasoning = body[:end].strip()
    rest = body[end + len(THINK_CLOSE):].lstrip()
    if spec.reasoning_format == "deepseek-legacy":
        rest = f"{THINK_OPEN}{body[:end]}{THINK_CLOSE}{rest}"
    return reasoning, rest, False


# ---------------------------------------------------------------------------
# tool calls


def _arguments(value: Any) -> str:
    if isinstance(value, str):
        return value
    return json.dumps(value if value is not None else {}, ensure_ascii=False)


def _call_of(obj: Any) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    return ToolCall(obj["name"], _arguments(args))


def _json_prefix(text: str) -> tuple[Any, int] | None:
    try:
        return json.JSONDecoder().raw_decode(text)
    except json.JSONDecodeError:
        return None


def _param_types(tools: Sequence[Mapping[str, Any]], name: str) -> dict[str, Any]:
    for tool in tools:
        fn = tool.get("function", tool)
        if fn.get("name") == name:
            props = (fn.get("parameters") or {}).get("properties") or {}
            return {k: (v or {}).get("type") for k, v in props.items() if isinstance(v, dict)}
    return {}


_FUNCTION = re.compile(r"<function=([^>\s]+)>(.*?)(?:</function>|$)", re.DOTALL)
_PARAM = re.compile(r"<parameter=([^>\s]+)>\n?(.*?)\n?</parameter>", re.DOTALL)


def _coder_call(block: str, tools: Sequence[Mapping[str, Any]]) -> ToolCall | None:
    m = _FUNCTION.search(block)
    if m is None:
        return None
    name, body = m.group(1), m.group(2)
    types = _param_types(tools, name)
    args: dict[str, Any] = {}
    for p in _PARAM.finditer(body):
        key, raw = p.group(1), p.group(2)
        if types.get(key) == "string":
            args[key] = raw
            continue
        try:
            args[key] = json.loads(raw)
        except json.JSONDecodeError:
            args[key] = raw
    return ToolCall(name, json.dumps(args, ensure_ascii=False))


def _tagged_calls(text: str, spec: OutputSpec, *, partial: bool) -> tuple[str, list[ToolCall], str]:
    """Content, complete calls, and a held-back tail (an open or possible tag)."""
    content: list[str] = []
    calls: list[ToolCall] = []
    pos = 0
    while True:
        start = text.find(CALL_OPEN, pos)
        if start < 0:
            rest = text[pos:]
            hold = _partial_marker(rest, CALL_OPEN) if partial else 0
            content.append(rest[: len(rest) - hold])
            return "".join(content), calls, rest[len(rest) - hold:]
        content.append(text[pos:start])
        end = text.find(CALL_CLOSE, start)
        inner = text[start + len(CALL_OPEN): end if end >= 0 else len(text)]
        if end < 0 and partial:
            return "".join(content), calls, text[start:]
        call = _coder_call(inner, spec.tools) if spec.fmt == "qwen3_coder" else _hermes_call(inner)
        if call is not None:
            calls.append(call)
        else:
            content.append(text[start: end + len(CALL_CLOSE) if end >= 0 else len(text)])
        if end < 0:
            return "".join(content), calls, ""
        pos = end + len(CALL_CLOSE)


def _hermes_call(inner: str) -> ToolCall | None:
    got = _json_prefix(inner.strip())
    return _call_of(got[0]) if got else None


def _partial_marker(text: str, marker: str) -> int:
    """Length of the longest suffix of ``text`` that begins ``marker``."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def _json_calls(text: str, spec: OutputSpec, *, partial: bool) -> tuple[str, list[ToolCall], str]:
    body = text.strip()
    if body.startswith("<|python_tag|>"):
        body = body[len("<|python_tag|>"):].lstrip()
    if not body.startswith(("{", "[")):
        if partial and (body == "" or "<|python_tag|>".startswith(body)):
            return "", [], text
        return text, [], ""
    got = _json_prefix(body)
    if got is None:
        return ("", [], text) if partial else (text, [], "")
    obj = got[0]
    items = obj if isinstance(obj, list) else [obj]
    calls: list[ToolCall] = []
    response: str | None = None
    for item in items:
        if spec.fmt == "generic" and isinstance(item, dict):
            if isinstance(item.get("response"), str):
                response = item["response"]
                continue
            inner = item.get("tool_calls", item.get("tool_call"))
            for c in inner if isinstance(inner, list) else [inner]:
                if (call := _call_of(c)) is not None:
                    calls.append(call)
            continue
        if (call := _call_of(item)) is not None:
            calls.append(call)
    if not calls and response is None:
        return text, [], ""
    return (response or ""), calls, ""


def parse(text: str, spec: OutputSpec, *, partial: bool = False) -> tuple[ChatAnswer, str]:
    """The answer in ``text`` and (streaming) the tail held back from ``content``."""
    reasoning, rest, thinking = split_reasoning(text, spec, partial=partial)
    if thinking:
        return ChatAnswer("", reasoning), ""
    if spec.fmt is None:
        return ChatAnswer(rest, reasoning), ""
    if spec.fmt in ("hermes", "qwen3_coder"):
        content, calls, tail = _tagged_calls(rest, spec, partial=partial)
    else:
        content, calls, tail = _json_calls(rest, spec, partial=partial)
    if calls:
        content = content.strip()
    return ChatAnswer(content, reasoning, tuple(calls)), tail


class StreamDeltas:
    """The deltas of one streamed choice: feed the text so far, get what is new."""

    def __init__(self, spec: OutputSpec) -> None:
        self._spec = spec
        self._text = ""
        self._content = ""
        self._reasoning = ""
        self._calls = 0
        self.tool_calls: list[ToolCall] = []

    def feed(self, piece: str) -> list[dict[str, Any]]:
        self._text += piece
        answer, _ = parse(self._text, self._spec, partial=True)
        return self._deltas(answer, final=False)

    def finish(self) -> list[dict[str, Any]]:
        answer, _ = parse(self._text, self._spec, partial=False)
        return self._deltas(answer, final=True)

    def _deltas(self, answer: ChatAnswer, *, final: bool) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        reasoning = answer.reasoning or ""
        if reasoning.startswith(self._reasoning) and len(reasoning) > len(self._reasoning):
            out.append({"reasoning_content": reasoning[len(self._reasoning):]})
            self._reasoning = reasoning
        content = answer.content
        if not final and answer.tool_calls == () and self._spec.fmt is not None and content != content.rstrip():
            content = content.rstrip()  # trailing space may precede a call; sent once known
        if content.startswith(self._content) and len(content) > len(self._content):
            out.append({"content": content[len(self._content):]})
            self._content = content
        for i in range(self._calls, len(answer.tool_calls)):
            call = answer.tool_calls[i]
            self.tool_calls.append(call)
            out.append({"tool_calls": [call.to_json(index=i)]})
        self._calls = len(answer.tool_calls)
        return out

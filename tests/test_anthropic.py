"""Anthropic's Messages API (``/v1/messages``, ``/v1/messages/count_tokens``): the
conversion to a chat request and the stream's events on their own, then a real server
on loopback through the official ``anthropic`` client and raw HTTP, then llama-server
itself (xllamacpp) on the same file: the same greedy text, keys and usage."""

from __future__ import annotations

import base64
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import anthropic
import httpx
import pytest
import trio

from llamacpp_ref import Reference
from test_server_flags import Start, client, start  # noqa: F401  (the fixture)
from test_server_tools import qwen_like  # noqa: F401  (the fixture)
from trio_llm.errors import InvalidRequest
from trio_llm.model import chat_output as CO
from trio_llm.runtime import ServerHandle
from trio_llm.server import anthropic as AN
from trio_llm.server.tasks import TaskFinal, TaskPartial, Timings

WEATHER = {"name": "get_weather", "description": "the weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}},
                            "required": ["city"], "additionalProperties": False}}
ASKED = [{"role": "user", "content": "Weather in Paris?"}]
CALLED = [*ASKED, {"role": "assistant", "content": [
    {"type": "text", "text": "Let me look."},
    {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]}]
ANSWERED = [*CALLED, {"role": "user", "content": [
    {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "sunny, "},
                                                                   {"type": "text", "text": "21 C"}]},
    {"type": "text", "text": "And tomorrow?"}]}]
#: the same conversation as an OpenAI chat request, as llama-server's conversion writes it
ANSWERED_OAI = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": [{"type": "text", "text": "Let me look."}], "tool_calls": [
        {"id": "toolu_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "toolu_1", "content": "sunny, 21 C"},
    {"role": "user", "content": [{"type": "text", "text": "And tomorrow?"}]},
]
CLAUDE_CODE_HEADER = "x-anthropic-billing-header: cc_version=2.1.101.e51; cc_entrypoint=cli; cch=a5145;"


# -- the conversion, on its own ---------------------------------------------------------


def test_a_conversation_becomes_the_chat_request_it_asks_for() -> None:
    body = {"model": "claude-x", "max_tokens": 64, "system": "Be brief.", "messages": ANSWERED,
            "tools": [WEATHER], "tool_choice": {"type": "auto"}, "stop_sequences": ["\n\n"], "temperature": 0.5,
            "top_p": 0.9, "top_k": 7, "stream": False, "metadata": {"user_id": "u"}, "service_tier": "auto",
            "seed": 3, "dry_multiplier": 0.5, "n": 4, "logprobs": True}
    out = AN.to_chat(body)
    assert out["messages"] == [{"role": "system", "content": "Be brief."}, *ANSWERED_OAI]
    assert out["tools"] == [{"type": "function", "function": {"name": "get_weather", "description": "the weather in a city",
                                                              "parameters": WEATHER["input_schema"]}}]
    assert out["tool_choice"] == "auto" and out["stop"] == ["\n\n"] and out["max_tokens"] == 64
    assert (out["temperature"], out["top_p"], out["top_k"], out["stream"]) == (0.5, 0.9, 7, False)
    # llama.cpp's own sampling fields pass; OpenAI's n and logprobs (no Anthropic shape for them) do not
    assert out["seed"] == 3 and out["dry_multiplier"] == 0.5 and "n" not in out and "logprobs" not in out
    assert "metadata" not in out and "model" not in out and "timings_per_token" not in out


@pytest.mark.parametrize(("choice", "oai"), [({"type": "auto"}, "auto"), ({"type": "any"}, "required"),
                                             ({"type": "none"}, "none"),
                                             ({"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True},
                                              {"type": "function", "function": {"name": "get_weather"}})])
def test_tool_choice(choice: dict[str, Any], oai: Any) -> None:
    assert AN.to_chat({"messages": ASKED, "tools": [WEATHER], "tool_choice": choice})["tool_choice"] == oai


def test_system_blocks_thinking_images_and_defaults() -> None:
    system = [{"type": "text", "text": CLAUDE_CODE_HEADER}, {"type": "text", "text": "You are Claude Code.",
                                                              "cache_control": {"type": "ephemeral"}}]
    png = base64.b64encode(b"\x89PNG").decode()
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "look"},
                                     {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": png}},
                                     {"type": "image", "source": {"type": "url", "url": "https://example.org/a.jpg"}},
                                     {"type": "document", "source": {"type": "text", "media_type": "text/plain",
                                                                     "data": "notes"}},
                                     {"type": "document", "source": {"type": "content", "content": [
                                         {"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}}]},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "hmm", "signature": "s"},
                                          {"type": "redacted_thinking", "data": "xx"}, {"type": "text", "text": "ok"}]},
        {"role": "user", "content": []},  # nothing to say: left out, as llama-server does
        {"role": "user", "content": "go on"},
    ]
    out = AN.to_chat({"system": system, "messages": messages, "stream": True,
                      "thinking": {"type": "enabled", "budget_tokens": 256}})
    # the blocks glued, Claude Code's per-request stamp written as fffff (the prompt cache gets past it)
    assert out["messages"][0] == {"role": "system", "content": CLAUDE_CODE_HEADER.replace("a5145", "fffff")
                                  + "You are Claude Code."}
    assert out["messages"][1]["content"] == [
        {"type": "text", "text": "look"}, {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{png}"}},
        {"type": "image_url", "image_url": {"url": "https://example.org/a.jpg"}}, {"type": "text", "text": "notes"},
        {"type": "text", "text": "ab"}]
    assert out["messages"][2] == {"role": "assistant", "content": [{"type": "text", "text": "ok"}],
                                  "reasoning_content": "hmm"}
    assert out["messages"][3:] == [{"role": "user", "content": "go on"}]
    assert out["max_tokens"] == AN.DEFAULT_MAX_TOKENS and out["thinking_budget_tokens"] == 256
    assert out["timings_per_token"] is True  # a stream's message_start reads the cached tokens from it
    assert AN.to_chat({"messages": ASKED, "thinking": {"type": "enabled"}})["thinking_budget_tokens"] == 10000
    off = AN.to_chat({"messages": ASKED, "thinking": {"type": "disabled"}, "chat_template_kwargs": {"x": 1}})
    assert off["chat_template_kwargs"] == {"enable_thinking": False, "x": 1}
    assert "thinking_budget_tokens" not in AN.to_chat({"messages": ASKED, "thinking": {"type": "adaptive"}})
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    fmt = AN.to_chat({"messages": ASKED, "output_config": {"format": {"type": "json_schema", "schema": schema},
                                                           "effort": "low"}})
    assert fmt["response_format"]["json_schema"]["schema"] == schema and fmt["reasoning_effort"] == "low"


def test_billing_header() -> None:
    assert AN.normalize_billing_header(CLAUDE_CODE_HEADER + "x") == CLAUDE_CODE_HEADER.replace("a5145", "fffff") + "x"
    for text in ("You are helpful. cch=a5145;", "x-anthropic-billing-header: cch=12;", "x-anthropic-billing-header: a"):
        assert AN.normalize_billing_header(text) == text


BAD: list[tuple[Any, str]] = [
    ([1, 2], "JSON object"),
    ({"max_tokens": 8}, "'messages' is required"),
    ({"messages": "hi"}, "'messages' must be"),
    ({"messages": []}, "'messages' must be"),
    ({"messages": [3]}, "messages[0]: must be an object"),
    ({"messages": [{"role": "system", "content": "x"}]}, "'role'"),
    ({"messages": [{"role": ["user"], "content": "x"}]}, "'role'"),
    ({"messages": [{"role": "user"}]}, "'content' is required"),
    ({"messages": [{"role": "user", "content": 5}]}, "'content' must be"),
    ({"messages": [{"role": "user", "content": [{"type": "bogus"}]}]}, "'bogus' is not supported"),
    ({"messages": [{"role": "user", "content": [{"text": "x"}]}]}, "with a 'type'"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": 1}]}]}, "'text' must be a string"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "a", "name": "f", "input": {}}]}]},
     "belongs in a assistant turn"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_9"}]}]},
     "answers no tool_use"),
    ({"messages": [*CALLED, {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_2"}]}]},
     "answers no tool_use"),
    ({"messages": [{"role": "assistant", "content": [{"type": "tool_use", "id": "a", "name": "f", "input": [1]}]}]},
     "'input' must be an object"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "file", "file_id": "f"}}]}]},
     "image source type 'file'"),
    ({"messages": [{"role": "user", "content": [{"type": "document", "source": {"type": "base64", "data": "x"}}]}]},
     "only text documents"),
    ({"messages": [{"role": "user", "content": [{"type": "server_tool_use", "id": "s"}]}]}, "'server_tool_use'"),
    ({"messages": ASKED, "system": 3}, "'system'"),
    ({"messages": ASKED, "system": [{"type": "image"}]}, "only text blocks"),
    ({"messages": ASKED, "tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "web_search_20250305"),
    ({"messages": ASKED, "tools": [{"type": "bash_20250124", "name": "bash"}]}, "bash_20250124"),
    ({"messages": ASKED, "tools": {"name": "x"}}, "'tools' must be a list"),
    ({"messages": ASKED, "tools": [{"name": "f", "input_schema": 3}]}, "input_schema"),
    ({"messages": ASKED, "tool_choice": "auto"}, "'tool_choice'"),
    ({"messages": ASKED, "tool_choice": {"type": "tool"}}, "'name' must be a string"),
    ({"messages": ASKED, "stop_sequences": "x"}, "'stop_sequences'"),
    ({"messages": ASKED, "thinking": {"type": "on"}}, "'thinking'"),
    ({"messages": ASKED, "thinking": {"type": "enabled", "budget_tokens": "9"}}, "budget_tokens"),
    ({"messages": ASKED, "mcp_servers": [{"type": "url", "url": "https://x", "name": "x"}]}, "'mcp_servers'"),
    ({"messages": ASKED, "container": "c1"}, "'container'"),
    ({"messages": ASKED, "output_format": {"type": "text"}}, "'output_format'"),
]


@pytest.mark.parametrize(("body", "why"), BAD)
def test_bad_requests_are_refused_by_name(body: Any, why: str) -> None:
    with pytest.raises(InvalidRequest) as err:
        AN.to_chat(body)
    assert why in str(err.value)


# -- the stream's events, on their own ---------------------------------------------------


def _final(content: str, *, stop_type: str = "eos", word: str = "", tail: str = "", n: int = 5) -> TaskFinal:
    return TaskFinal(1, 0, content, tuple(range(n)), stop_type, word, 20, Timings(8, 1.0, 12, n, 1.0),  # type: ignore[arg-type]
                     (), tail, 25)


def _events(raw: list[bytes]) -> list[tuple[str, dict[str, Any]]]:
    out = []
    for chunk in raw:
        head, data = chunk.decode().split("\n", 1)
        assert head.startswith("event: ") and data.startswith("data: ") and data.endswith("\n\n")
        event = (head[len("event: "):], json.loads(data[len("data: "):]))
        assert event[1]["type"] == event[0]
        out.append(event)
    return out


def test_stream_of_thinking_text_and_a_tool_call() -> None:
    spec = CO.OutputSpec("hermes", "auto", True, ({"type": "function", "function": {"name": "f"}},))
    s = AN.MessageStream(spec, "msg_1", "m", 20, lambda o: json.dumps(o).encode())
    pieces = ["hm", "m</think>", "Hi", " there", '<tool_call>{"name": "f", ', '"arguments": {"a": 1}}</tool_call>']
    timings = Timings(8, 1.0, 12, 1, 1.0)
    raw = []
    for text in pieces:
        raw += s.on_partial(0, TaskPartial(1, 7, text, None, timings=timings))
    raw += s.on_final(0, _final("".join(pieces), n=len(pieces)))
    events = _events(raw)
    names = [name for name, _ in events]
    assert names[0] == "message_start" and names[-2:] == ["message_delta", "message_stop"]
    first = events[0][1]["message"]
    assert first["usage"] == {"cache_read_input_tokens": 12, "input_tokens": 8, "output_tokens": 0}
    assert first["content"] == [] and first["stop_reason"] is None and first["id"] == "msg_1"
    starts = [(d["index"], d["content_block"]) for n, d in events if n == "content_block_start"]
    assert starts == [(0, {"type": "thinking", "thinking": ""}), (1, {"type": "text", "text": ""}),
                      (2, {"type": "tool_use", "id": s._reader.tool_calls[0].id, "name": "f", "input": {}})]
    deltas = [(d["index"], d["delta"]) for n, d in events if n == "content_block_delta"]
    assert "".join(d["thinking"] for i, d in deltas if d["type"] == "thinking_delta") == "hmm"
    assert "".join(d["text"] for i, d in deltas if d["type"] == "text_delta") == "Hi there"
    assert [json.loads(d["partial_json"]) for i, d in deltas if d["type"] == "input_json_delta"] == [{"a": 1}]
    # every block closed at the end, in order, the thinking one after an empty signature
    stops = [d["index"] for n, d in events if n == "content_block_stop"]
    assert stops == [0, 1, 2]
    assert deltas[-1] == (0, {"type": "signature_delta", "signature": ""})
    assert events[-2][1] == {"type": "message_delta", "delta": {"stop_reason": "tool_use", "stop_sequence": None},
                             "usage": {"output_tokens": len(pieces)}}


def test_final_only_stream_and_stop_reasons() -> None:
    s = AN.MessageStream(CO.OutputSpec(), "msg_2", "m", 20, lambda o: json.dumps(o).encode())
    events = _events(s.on_final(0, _final("ab", stop_type="word", word="STOP", tail="ab")))
    assert [n for n, _ in events] == ["message_start", "content_block_start", "content_block_delta",
                                      "content_block_stop", "message_delta", "message_stop"]
    assert events[0][1]["message"]["usage"]["cache_read_input_tokens"] == 12
    assert events[-2][1]["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": "STOP"}
    answer = CO.ChatAnswer("ab")
    for final, reason in ((_final("ab", stop_type="limit"), "max_tokens"), (_final("ab"), "end_turn"),
                          (_final("ab", stop_type="word", word="x"), "stop_sequence")):
        msg = AN.message(final, answer, id_="msg_3", model="m")
        assert msg["stop_reason"] == reason and msg["content"] == [{"type": "text", "text": "ab"}]
        assert msg["usage"] == {"cache_read_input_tokens": 12, "input_tokens": 8, "output_tokens": 5}


async def test_an_error_mid_stream_is_an_error_event() -> None:
    s = AN.MessageStream(CO.OutputSpec(), "msg_4", "m", 20, lambda o: json.dumps(o).encode())

    async def source() -> AsyncIterator[bytes]:
        for chunk in s.on_partial(0, TaskPartial(1, 7, "a", None)):
            yield chunk
        yield b'data: {"error": {"code": 500, "message": "boom", "type": "server_error"}}\n\n'

    got = [chunk async for chunk in s.events(source())]
    assert got[-1] == b'event: error\ndata: {"error": {"code": 500, "message": "boom", "type": "server_error"}}\n\n'
    assert [n for n, _ in _events(got[:-1])] == ["message_start", "content_block_start", "content_block_delta"]


# -- a real server ----------------------------------------------------------------------


def _sse(text: str) -> list[tuple[str, dict[str, Any]]]:
    out = []
    for chunk in text.split("\n\n"):
        if chunk.strip():
            head, data = chunk.split("\n", 1)
            out.append((head.removeprefix("event: "), json.loads(data.removeprefix("data: "))))
    return out


def _streamed_text(events: list[tuple[str, dict[str, Any]]]) -> str:
    return "".join(d["delta"]["text"] for n, d in events if n == "content_block_delta" and d["delta"]["type"] == "text_delta")


async def qwen3(start: Start, path: Path, *argv: str) -> ServerHandle:  # noqa: F811
    return await start("-m", str(path), *argv)


async def test_text_streamed_and_not_through_the_anthropic_client(start: Start, tiny_qwen3_model: Path) -> None:  # noqa: F811
    h = await qwen3(start, tiny_qwen3_model)
    ac = anthropic.AsyncAnthropic(base_url=h.url, api_key="x")
    # this client has no temperature (nor top_p, top_k) of its own any more: llama-server reads them
    kw: dict[str, Any] = dict(model="m", max_tokens=12, extra_body={"temperature": 0}, system="Be brief.",
                              messages=[{"role": "user", "content": "Tell me a story"}])
    msg = await ac.messages.create(**kw)
    assert msg.type == "message" and msg.role == "assistant" and msg.id.startswith("msg_")
    assert msg.stop_reason == "max_tokens" and msg.usage.output_tokens == 12
    text = msg.content[0].text  # type: ignore[union-attr]
    async with ac.messages.stream(**kw) as stream:
        streamed = await stream.get_final_message()
    assert streamed.content[0].text == text and streamed.stop_reason == "max_tokens"  # type: ignore[union-attr]
    assert streamed.usage.output_tokens == 12
    # the system prompt as blocks renders as the string does
    blocks = kw | {"system": [{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}]}
    again = await ac.messages.create(**blocks)
    assert again.content == msg.content
    # the events themselves, in llama-server's order
    async with client(h) as c:
        r = await c.post("/v1/messages", json={k: v for k, v in kw.items() if k != "extra_body"}
                         | {"temperature": 0, "stream": True})
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = _sse(r.text)
    names = [n for n, _ in events]
    assert names == ["message_start", "content_block_start", *["content_block_delta"] * (len(names) - 5),
                     "content_block_stop", "message_delta", "message_stop"]
    assert _streamed_text(events) == text
    usage = events[0][1]["message"]["usage"]
    assert usage["cache_read_input_tokens"] > 0  # the same prompt again: read from the slot's cache
    assert usage["cache_read_input_tokens"] + usage["input_tokens"] == msg.usage.input_tokens
    await ac.close()


async def test_count_tokens_is_the_rendered_prompts_length(start: Start, tiny_qwen3_model: Path,  # noqa: F811
                                                            qwen_like: str) -> None:  # noqa: F811
    """count_tokens: the prompt /apply-template renders for the converted request, in
    tokens (here with a tool call answered: the result before the turn's own text)."""
    h = await qwen3(start, tiny_qwen3_model, "--chat-template-file", qwen_like)
    ac = anthropic.AsyncAnthropic(base_url=h.url, api_key="x")
    async with client(h) as c:
        for body in ({"system": "Be brief.", "messages": ASKED}, {"messages": ANSWERED, "tools": [WEATHER]}):
            prompt = (await c.post("/apply-template", json=AN.to_chat(body))).json()["prompt"]
            ids = (await c.post("/tokenize", json={"content": prompt, "add_special": True})).json()["tokens"]
            counted = await ac.messages.count_tokens(model="m", **body)  # type: ignore[arg-type]
            assert counted.input_tokens == len(ids) > 0
            r = await c.post("/v1/messages", json=body | {"max_tokens": 1, "cache_prompt": False})
            assert r.status_code == 200 and r.json()["usage"]["input_tokens"] == len(ids), r.text
    assert '"get_weather"' in prompt and "<tool_call>" in prompt and "sunny, 21 C" in prompt
    assert prompt.index("sunny, 21 C") < prompt.index("And tomorrow?")
    await ac.close()


@pytest.mark.parametrize("stream", [False, True])
async def test_a_forced_tool_call_is_a_tool_use_block(start: Start, tiny_qwen3_model: Path,  # noqa: F811
                                                      qwen_like: str, stream: bool) -> None:  # noqa: F811
    h = await qwen3(start, tiny_qwen3_model, "--chat-template-file", qwen_like)
    ac = anthropic.AsyncAnthropic(base_url=h.url, api_key="x")
    kw: dict[str, Any] = dict(model="m", max_tokens=128, extra_body={"temperature": 0}, messages=ASKED, tools=[WEATHER],
                              tool_choice={"type": "tool", "name": "get_weather"})
    if stream:
        async with ac.messages.stream(**kw) as s:
            msg = await s.get_final_message()
    else:
        msg = await ac.messages.create(**kw)
    assert msg.stop_reason == "tool_use"
    uses = [b for b in msg.content if b.type == "tool_use"]
    assert len(uses) == 1 and uses[0].name == "get_weather" and uses[0].input["city"] in ("Paris", "Oslo")  # type: ignore[index]
    # the call answered: the next turn runs
    turn = [*ASKED, {"role": "assistant", "content": [u.model_dump(exclude_none=True) for u in uses]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0].id, "content": "sunny"}]}]
    after = await ac.messages.create(**(kw | {"messages": turn, "tool_choice": {"type": "none"}, "max_tokens": 4}))
    assert after.stop_reason in ("max_tokens", "end_turn")
    with pytest.raises(anthropic.BadRequestError):  # a tool not in tools
        await ac.messages.create(**(kw | {"tool_choice": {"type": "tool", "name": "nope"}}))
    await ac.close()


#: a template whose prompt opens a thought (Qwen3-Thinking's way): the answer thinks first
THINKING = ("{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
            "{%- if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}")


async def test_thinking_blocks_and_the_thinking_budget(start: Start, tiny_qwen3_model: Path,  # noqa: F811
                                                       tmp_path: Path) -> None:
    """The thought is a thinking block (empty signature); ``thinking.budget_tokens``
    reaches the chat request as ``thinking_budget_tokens``: the thought is cut there and
    a text block follows."""
    (tmp_path / "think.jinja").write_text(THINKING)
    h = await qwen3(start, tiny_qwen3_model, "--chat-template-file", str(tmp_path / "think.jinja"))
    ac = anthropic.AsyncAnthropic(base_url=h.url, api_key="x")
    kw: dict[str, Any] = dict(model="m", max_tokens=12, extra_body={"temperature": 0},
                              messages=[{"role": "user", "content": "more"}])
    msg = await ac.messages.create(**kw)
    assert [b.type for b in msg.content] == ["thinking"] and msg.content[0].signature == ""  # type: ignore[union-attr]
    kw["thinking"] = {"type": "enabled", "budget_tokens": 3}
    budgeted = await ac.messages.create(**kw)
    assert [b.type for b in budgeted.content] == ["thinking", "text"]
    assert len(budgeted.content[0].thinking) < len(msg.content[0].thinking)  # type: ignore[union-attr]
    async with ac.messages.stream(**kw) as s:
        streamed = await s.get_final_message()
    assert [b.to_dict() for b in streamed.content] == [b.to_dict() for b in budgeted.content]
    # the thought goes back in the next turn (as the message's reasoning_content)
    turn = [*kw["messages"], {"role": "assistant", "content": [b.model_dump() for b in budgeted.content]},
            {"role": "user", "content": "and?"}]
    assert (await ac.messages.create(**(kw | {"messages": turn}))).stop_reason == "max_tokens"
    await ac.close()


async def test_structured_output_follows_its_schema(start: Start, tiny_qwen3_model: Path) -> None:  # noqa: F811
    h = await qwen3(start, tiny_qwen3_model)
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
              "additionalProperties": False}
    async with client(h) as c:
        for key, value in (("output_config", {"format": {"type": "json_schema", "schema": schema}}),
                           ("output_format", {"type": "json_schema", "schema": schema})):
            r = (await c.post("/v1/messages", json={"messages": ASKED, "max_tokens": 64, "temperature": 0,
                                                    key: value})).json()
            assert r["stop_reason"] == "end_turn", r
            assert isinstance(json.loads(r["content"][0]["text"])["a"], int)


async def test_stop_sequences_and_max_tokens(start: Start, tiny_qwen3_model: Path) -> None:  # noqa: F811
    h = await qwen3(start, tiny_qwen3_model)
    body = {"max_tokens": 24, "temperature": 0, "messages": [{"role": "user", "content": "x"}]}
    async with client(h) as c:
        whole = (await c.post("/v1/messages", json=body)).json()
        assert whole["stop_reason"] == "max_tokens" and whole["usage"]["output_tokens"] == 24
        text = whole["content"][0]["text"]
        word = text.strip()[2:4]
        assert len(word) == 2, text
        for stream in (False, True):
            r = await c.post("/v1/messages", json=body | {"stop_sequences": ["@@", word], "stream": stream})
            if stream:
                events = _sse(r.text)
                delta = events[-2][1]["delta"]
                assert _streamed_text(events) == text[: text.index(word)]
            else:
                got = r.json()
                delta = {k: got[k] for k in ("stop_reason", "stop_sequence")}
                assert got["content"] == [{"type": "text", "text": text[: text.index(word)]}]
            assert delta == {"stop_reason": "stop_sequence", "stop_sequence": word}


async def test_a_client_that_goes_away_frees_its_slot(start: Start) -> None:  # noqa: F811
    """Claude Code's Esc: the stream closed mid-answer cancels the task and frees the slot."""
    h = await start("-np", "1", "-c", "4096")
    body = {"messages": ASKED, "max_tokens": 3000, "ignore_eos": True, "stream": True}
    async with client(h) as c:
        async with c.stream("POST", "/v1/messages", json=body) as r:
            got = 0
            async for line in r.aiter_lines():
                got += line.startswith("event: content_block_delta")
                if got == 3:
                    break
            assert (await c.get("/slots")).json()[0]["is_processing"] is True
        with trio.fail_after(20):
            r2 = await c.post("/v1/messages", json={"messages": ASKED, "max_tokens": 2})
        assert r2.status_code == 200 and r2.json()["usage"]["output_tokens"] == 2
    engine = h.context.engine
    assert engine is not None and engine.slots.statistics().n_tasks_cancelled == 1


BAD_HTTP: list[tuple[Any, str]] = [
    (b"not json", "not valid JSON"),
    ([1], "JSON object"),
    ({"max_tokens": 8}, "'messages' is required"),
    ({"messages": 3, "max_tokens": 8}, "'messages' must be"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t"}]}]}, "answers no tool_use"),
    ({"messages": [{"role": "user", "content": [{"type": "video"}]}]}, "'video'"),
    ({"messages": ASKED, "tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "web_search"),
    ({"messages": ASKED, "max_tokens": "many"}, "max_tokens"),
    ({"messages": ASKED, "temperature": "hot"}, "temperature"),
    ({"messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}]}]}, "image input"),
]


@pytest.mark.parametrize(("body", "why"), BAD_HTTP)
async def test_bad_requests_are_400(start: Start, body: Any, why: str) -> None:  # noqa: F811
    h = await start()
    async with client(h) as c:
        for path in ("/v1/messages", "/v1/messages/count_tokens"):
            if path.endswith("count_tokens") and why in ("max_tokens", "temperature"):
                continue  # counting reads no sampling field
            content = body if isinstance(body, bytes) else json.dumps(body).encode()
            r = await c.post(path, content=content, headers={"Content-Type": "application/json"})
            assert r.status_code == 400, (path, r.text)
            err = r.json()["error"]
            assert err["type"] == "invalid_request_error" and why in err["message"], (path, err)
    ac = anthropic.AsyncAnthropic(base_url=h.url, api_key="x")
    with pytest.raises(anthropic.BadRequestError):
        await ac.messages.create(model="m", max_tokens=4, messages=[{"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "t", "content": "x"}]}])
    await ac.close()


async def test_an_embedding_server_does_not_generate(start: Start, tiny_qwen3_model: Path) -> None:  # noqa: F811
    h = await qwen3(start, tiny_qwen3_model, "--embeddings")
    async with client(h) as c:
        r = await c.post("/v1/messages", json={"messages": ASKED, "max_tokens": 4})
        assert r.status_code == 501, r.text
        assert (await c.post("/v1/messages/count_tokens", json={"messages": ASKED})).json()["input_tokens"] > 0


# -- an image ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def vision_files(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    from test_vision_server import MMPROJ
    from trio_llm.model.gguf import load_gguf
    from trio_llm.model.synth import make_model
    from trio_llm.vision.synth import write_mmproj

    d = tmp_path_factory.mktemp("vision")
    text = make_model("tiny-gemma3", "Q8_0", d / "tiny-gemma3.gguf", sharp=True)
    mmproj = d / "mmproj-tiny-f16.gguf"
    write_mmproj(mmproj, n_embd_text=load_gguf(text).config.n_embd, wtype="f16", seed=3, **MMPROJ)
    return text, mmproj


async def test_an_image_block_is_the_chat_requests_image(start: Start, vision_files: tuple[Path, Path]) -> None:  # noqa: F811
    """A base64 image block answers as the same image_url part does on /v1/chat/completions."""
    from test_vision_server import b64, png

    text, mmproj = vision_files
    h = await start("-m", str(text), "--mmproj", str(mmproj))
    data = b64(png(7))
    blocks = [{"type": "text", "text": "What is in"},
              {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": data}},
              {"type": "text", "text": "this picture?"}]
    parts = [blocks[0], {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{data}"}}, blocks[2]]
    async with httpx.AsyncClient(base_url=h.url, timeout=300) as c:
        ours = (await c.post("/v1/messages", json={"messages": [{"role": "user", "content": blocks}],
                                                   "max_tokens": 8, "temperature": 0})).json()
        chat = (await c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": parts}],
                                                           "max_tokens": 8, "temperature": 0})).json()
        counted = (await c.post("/v1/messages/count_tokens",
                                json={"messages": [{"role": "user", "content": blocks}]})).json()
    n_prompt = chat["usage"]["prompt_tokens"]
    assert counted["input_tokens"] == n_prompt == ours["usage"]["input_tokens"] + ours["usage"]["cache_read_input_tokens"]
    assert ours["content"][0]["text"] == chat["choices"][0]["message"]["content"]


# -- against llama-server itself --------------------------------------------------------


Fetch = Callable[..., Awaitable[httpx.Response]]


@pytest.fixture
async def llamacpp(tiny_qwen3_model: Path) -> AsyncIterator[Fetch]:
    ref = await trio.to_thread.run_sync(lambda: Reference(tiny_qwen3_model, n_ctx=512))

    async def post(path: str, body: Any) -> httpx.Response:
        return await trio.to_thread.run_sync(lambda: ref._client.post(path, json=body))

    yield post
    ref.close()


def _shape(obj: Any) -> Any:
    """The keys of a body, all the way down (values' types for leaves)."""
    if isinstance(obj, dict):
        return {k: _shape(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_shape(v) for v in obj]
    return type(obj).__name__


async def test_same_answers_as_llama_server(start: Start, tiny_qwen3_model: Path, llamacpp: Fetch) -> None:  # noqa: F811
    """A greedy request on the same file: llama-server's text, usage, keys and event order."""
    h = await qwen3(start, tiny_qwen3_model, "-c", "512")
    # llama-server renders this template with enable_thinking false; said here for both
    body = {"model": "m", "max_tokens": 16, "temperature": 0, "system": "Be brief.",
            "chat_template_kwargs": {"enable_thinking": False},
            "messages": [{"role": "user", "content": "Tell me"}, {"role": "assistant", "content": "Sure."},
                         {"role": "user", "content": [{"type": "text", "text": "more"}]}]}
    theirs = (await llamacpp("/v1/messages", body)).json()
    async with client(h) as c:
        ours = (await c.post("/v1/messages", json=body)).json()
        assert (await c.post("/v1/messages/count_tokens", json=body)).json() == \
            (await llamacpp("/v1/messages/count_tokens", body)).json()
        streamed = _sse((await c.post("/v1/messages", json=body | {"stream": True})).text)
    their_stream = _sse((await llamacpp("/v1/messages", body | {"stream": True})).text)
    assert ours["content"] == theirs["content"] and ours["usage"] == theirs["usage"]
    assert (ours["stop_reason"], ours["stop_sequence"]) == (theirs["stop_reason"], theirs["stop_sequence"])
    assert list(ours) == list(theirs) and _shape(ours) == _shape(theirs)
    assert [n for n, _ in streamed] == [n for n, _ in their_stream]
    assert [_shape(d) for _, d in streamed] == [_shape(d) for _, d in their_stream]
    for (_, a), (_, b) in zip(streamed, their_stream, strict=True):  # every event equal, ids apart
        if a["type"] == "message_start":
            a, b = ({**x["message"], "id": "", "model": ""} for x in (a, b))
        assert a == b
    # a tool call and its result render as llama-server renders them (this template has
    # no tools of its own; with tools given the two differ as their chat endpoints do)
    answered = {"messages": [*CALLED, {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "sunny"}]}]}],
        "chat_template_kwargs": {"enable_thinking": False}}
    async with client(h) as c:
        assert (await c.post("/v1/messages/count_tokens", json=answered)).json() == \
            (await llamacpp("/v1/messages/count_tokens", answered)).json()
    # a stop sequence: the same text and count; llama-server says end_turn, Anthropic's API stop_sequence
    word = theirs["content"][0]["text"].strip()[1:3]
    stop = body | {"stop_sequences": [word]}
    theirs = (await llamacpp("/v1/messages", stop)).json()
    async with client(h) as c:
        ours = (await c.post("/v1/messages", json=stop)).json()
    assert ours["content"] == theirs["content"] and ours["usage"]["output_tokens"] == theirs["usage"]["output_tokens"]
    assert ours["stop_sequence"] == theirs["stop_sequence"] == word
    assert (ours["stop_reason"], theirs["stop_reason"]) == ("stop_sequence", "end_turn")

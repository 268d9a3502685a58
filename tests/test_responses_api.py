"""OpenAI's Responses API (``/v1/responses``) and the input-token endpoints
(``/v1/responses/input_tokens``, ``/v1/chat/completions/input_tokens``): the conversion
to a chat request and the stream's events on their own, then a real server on loopback
through the official ``openai`` client and raw HTTP, then llama-server itself
(xllamacpp) on the same file: the same greedy text, keys, usage and events."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import trio

from llamacpp_ref import Reference
from test_anthropic import THINKING, _events, _final, _sse, qwen3  # the same helpers
from test_server_flags import Start, client, start  # noqa: F401  (the fixture)
from test_server_tools import qwen_like  # noqa: F401  (the fixture)
from trio_llm.errors import InvalidRequest
from trio_llm.model import chat_output as CO
from trio_llm.runtime import ServerHandle
from trio_llm.server import responses_api as RA
from trio_llm.server.tasks import PromptProgress, TaskPartial

WEATHER = {"type": "function", "name": "get_weather", "description": "the weather in a city", "strict": True,
           "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}},
                          "required": ["city"], "additionalProperties": False}}
WEATHER_OAI = {"type": "function", "function": {"name": "get_weather", "description": "the weather in a city",
                                                "parameters": WEATHER["parameters"]}}
ASKED = [{"role": "user", "content": "Weather in Paris?"}]
#: a turn as Codex sends it back: its reasoning, its text and its call, then the call's output
ANSWERED = [
    *ASKED,
    {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "hmm"}],
     "encrypted_content": ""},
    {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
     "content": [{"type": "output_text", "text": "Let me look.", "annotations": []}]},
    {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "get_weather",
     "arguments": '{"city": "Paris"}', "status": "completed"},
    {"type": "function_call_output", "call_id": "call_1", "output": "sunny, 21 C"},
    {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "And tomorrow?"}]},
]
#: the same conversation as an OpenAI chat request
ANSWERED_OAI = [
    {"role": "user", "content": [{"type": "text", "text": "Weather in Paris?"}]},
    {"role": "assistant", "content": [{"type": "text", "text": "Let me look."}], "reasoning_content": "hmm",
     "tool_calls": [{"id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
    {"role": "user", "content": [{"type": "text", "text": "And tomorrow?"}]},
]


# -- the conversion, on its own ---------------------------------------------------------


def test_a_conversation_becomes_the_chat_request_it_asks_for() -> None:
    body = {"model": "gpt-x", "instructions": "Be brief.", "input": ANSWERED, "tools": [WEATHER],
            "tool_choice": "auto", "max_output_tokens": 64, "temperature": 0.5, "top_p": 0.9, "stream": True,
            "reasoning": {"effort": "low", "summary": "auto"}, "store": False, "metadata": {"a": "b"},
            "include": ["reasoning.encrypted_content"], "truncation": "disabled", "user": "u", "seed": 3,
            "top_k": 7, "min_p": 0.1, "dry_multiplier": 0.5, "thinking_budget_tokens": 20, "n": 4}
    out = RA.to_chat(body)
    assert out["messages"] == [{"role": "system", "content": "Be brief."}, *ANSWERED_OAI]
    assert out["tools"] == [WEATHER_OAI] and out["tool_choice"] == "auto" and out["max_tokens"] == 64
    assert (out["temperature"], out["top_p"], out["stream"], out["reasoning_effort"]) == (0.5, 0.9, True, "low")
    # llama.cpp's own fields pass; OpenAI's chat-only n (one answer here) and the metadata do not
    assert (out["seed"], out["top_k"], out["min_p"], out["dry_multiplier"], out["thinking_budget_tokens"]) == \
        (3, 7, 0.1, 0.5, 20)
    for key in ("n", "model", "store", "metadata", "include", "truncation", "user", "input", "instructions",
                "reasoning", "max_output_tokens"):
        assert key not in out, key
    # a string input is one user message
    assert RA.to_chat({"input": "hi"})["messages"] == [{"role": "user", "content": "hi"}]


def test_items_parts_and_formats() -> None:
    items = [
        {"role": "developer", "content": "rules"},
        {"role": "user", "content": [{"type": "input_text", "text": "look"},
                                     {"type": "input_image", "image_url": "data:image/png;base64,AAAA", "detail": "auto"}]},
        {"role": "assistant", "content": "short form"},  # OpenAI's easy message: no "type"
        {"type": "message", "role": "assistant", "content": [{"type": "refusal", "refusal": "no"}]},
        {"type": "reasoning", "summary": [{"type": "summary_text", "text": "s"}], "encrypted_content": "xx"},
        {"type": "function_call", "call_id": "c2", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c2", "output": [
            {"type": "input_text", "text": "a"}, {"type": "input_image", "image_url": "https://example.org/a.png"}]},
    ]
    out = RA.to_chat({"input": items, "text": {"format": {"type": "json_schema", "name": "x", "strict": True,
                                                           "schema": {"type": "object"}}, "verbosity": "low"}})
    assert out["messages"] == [
        {"role": "developer", "content": [{"type": "text", "text": "rules"}]},
        {"role": "user", "content": [{"type": "text", "text": "look"},
                                     {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]},
        # one assistant turn: its messages joined, the refusal as text, the encrypted reasoning left out
        {"role": "assistant", "content": [{"type": "text", "text": "short form"}, {"type": "text", "text": "no"}],
         "tool_calls": [{"id": "c2", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c2", "content": [
            {"type": "text", "text": "a"}, {"type": "image_url", "image_url": {"url": "https://example.org/a.png"}}]},
    ]
    assert out["response_format"] == {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}
    assert RA.to_chat({"input": "x", "text": {"format": {"type": "json_object"}}})["response_format"] == \
        {"type": "json_object"}
    assert "response_format" not in RA.to_chat({"input": "x", "text": {"format": {"type": "text"}}})


@pytest.mark.parametrize(("choice", "oai", "names"), [
    ("required", "required", ["get_weather", "f"]),
    ({"type": "function", "name": "get_weather"}, {"type": "function", "function": {"name": "get_weather"}},
     ["get_weather", "f"]),
    ({"type": "allowed_tools", "mode": "required", "tools": [{"type": "function", "name": "f"}]}, "required", ["f"]),
])
def test_tool_choice(choice: Any, oai: Any, names: list[str]) -> None:
    out = RA.to_chat({"input": "x", "tools": [WEATHER, {"type": "function", "name": "f"}], "tool_choice": choice})
    assert out["tool_choice"] == oai and [t["function"]["name"] for t in out["tools"]] == names
    assert out["tools"][-1]["function"] == {"name": "f", "description": "", "parameters": {}}


BAD: list[tuple[Any, str]] = [
    ([1, 2], "JSON object"),
    ({"model": "m"}, "'input' is required"),
    ({"input": 3}, "'input' must be a string or a list"),
    ({"input": {"role": "user"}}, "'input' must be a string or a list"),
    ({"input": []}, "holds no message"),
    ({"input": [3]}, "input[0]: an input item must be an object"),
    ({"input": [{"content": "x"}]}, "needs a 'type'"),
    ({"input": [{"type": "bogus"}]}, "item type 'bogus' is not supported"),
    ({"input": [{"type": "web_search_call", "id": "w"}]}, "'web_search_call'"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "'item_reference'"),
    ({"input": [{"role": "tool", "content": "x"}]}, "'role'"),
    ({"input": [{"role": "user"}]}, "'content' is required"),
    ({"input": [{"role": "user", "content": 5}]}, "input[0].content: must be a string"),
    ({"input": [{"type": "message", "content": "x"}]}, "'role' must be"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "c", "output": 3}]}, "input[1].output: must be"),
    ({"input": "x", "max_output_tokens": "8"}, "'max_output_tokens' must be an integer"),
    ({"input": [{"role": "user", "content": [{"type": "video"}]}]}, "part type 'video'"),
    ({"input": [{"role": "user", "content": [{"text": "x"}]}]}, "with a 'type'"),
    ({"input": [{"role": "user", "content": [{"type": "input_text", "text": 1}]}]}, "'text' must be a string"),
    ({"input": [{"role": "user", "content": [{"type": "output_text", "text": "x"}]}]}, "belongs in an assistant"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]}, "'input_file'"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "file_id": "f"}]}]}, "'file_id'"),
    ({"input": [{"role": "assistant", "content": [{"type": "input_image", "image_url": "x"}]}]}, "output_text"),
    ({"input": [{"type": "function_call_output", "call_id": "c9", "output": "x"}]}, "answers no function_call"),
    ({"input": [{"type": "function_call", "call_id": "c1", "name": "f"}]}, "'arguments' must be a string"),
    ({"input": [{"type": "reasoning", "content": "x"}]}, "reasoning item"),
    ({"input": "x", "instructions": ["a"]}, "'instructions'"),
    ({"input": "x", "previous_response_id": "resp_1"}, "'previous_response_id' is not supported"),
    ({"input": "x", "conversation": "conv_1"}, "'conversation'"),
    ({"input": "x", "background": True}, "'background'"),
    ({"input": "x", "prompt": {"id": "pmpt_1"}}, "'prompt'"),
    ({"input": "x", "max_tool_calls": 3}, "'max_tool_calls'"),
    ({"input": "x", "truncation": "auto"}, "'truncation'"),
    ({"input": "x", "top_logprobs": 2}, "'top_logprobs'"),
    ({"input": "x", "include": ["message.output_text.logprobs"]}, "logprobs"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tool type 'web_search'"),
    ({"input": "x", "tools": [{"type": "file_search", "vector_store_ids": ["v"]}]}, "'file_search'"),
    ({"input": "x", "tools": [{"type": "code_interpreter", "container": {"type": "auto"}}]}, "'code_interpreter'"),
    ({"input": "x", "tools": [{"type": "custom", "name": "apply_patch"}]}, "tool type 'custom'"),
    ({"input": "x", "tools": {"name": "f"}}, "'tools' must be a list"),
    ({"input": "x", "tools": [{"type": "function", "name": "f", "parameters": 3}]}, "'parameters'"),
    ({"input": "x", "tool_choice": {"type": "web_search_preview"}}, "'web_search_preview'"),
    ({"input": "x", "tool_choice": 3}, "'tool_choice' must be"),
    ({"input": "x", "text": {"format": {"type": "json_schema"}}}, "'text.format'"),
    ({"input": "x", "reasoning": "high"}, "'reasoning'"),
]


@pytest.mark.parametrize(("body", "why"), BAD)
def test_bad_requests_are_refused_by_name(body: Any, why: str) -> None:
    with pytest.raises(InvalidRequest) as err:
        RA.to_chat(body)
    assert why in str(err.value)


# -- the stream's events, on their own ---------------------------------------------------


def test_stream_of_reasoning_text_and_a_call() -> None:
    spec = CO.OutputSpec("hermes", "auto", True, ({"type": "function", "function": {"name": "f"}},))
    s = RA.ResponseStream(spec, "resp_1", "m", lambda o: json.dumps(o).encode())
    pieces = ["hm", "m</think>", "Hi", " there", '<tool_call>{"name": "f", ', '"arguments": {"a": 1}}</tool_call>']
    raw = s.on_partial(0, TaskPartial(1, -1, "", None, progress=PromptProgress(20, 12, 8, 3)))
    for text in pieces:
        raw += s.on_partial(0, TaskPartial(1, 7, text, None))
    raw += s.on_final(0, _final("".join(pieces), n=len(pieces)))
    events = _events(raw)
    names = [n for n, _ in events]
    rs, msg = s._reasoning_id, s._message_id
    call = s._reader.tool_calls[0]
    fc = "fc_" + call.id.removeprefix("call_")
    assert names == ["response.created", "response.in_progress",
                     "response.output_item.added", "response.reasoning_text.delta", "response.reasoning_text.delta",
                     "response.output_item.added", "response.content_part.added", "response.output_text.delta",
                     "response.output_text.delta", "response.output_item.added",
                     "response.function_call_arguments.delta",
                     "response.output_item.done", "response.output_text.done", "response.content_part.done",
                     "response.output_item.done", "response.output_item.done", "response.completed"]
    # the progress report rides on the first in_progress, as llama-server's
    assert events[1][1]["prompt_progress"] == {"total": 20, "cache": 12, "processed": 8, "time_ms": 3}
    assert events[0][1]["response"] == {"id": "resp_1", "object": "response", "status": "in_progress"}
    assert "".join(d["delta"] for n, d in events if n == "response.reasoning_text.delta") == "hmm"
    assert "".join(d["delta"] for n, d in events if n == "response.output_text.delta") == "Hi there"
    added = [d["item"] for n, d in events if n == "response.output_item.added"]
    assert added == [
        {"id": rs, "summary": [], "type": "reasoning", "content": [], "encrypted_content": "", "status": "in_progress"},
        {"content": [], "id": msg, "role": "assistant", "status": "in_progress", "type": "message"},
        {"id": fc, "arguments": "", "call_id": call.id, "name": "f", "type": "function_call", "status": "in_progress"}]
    assert events[10][1] == {"type": "response.function_call_arguments.delta", "delta": '{"a": 1}', "item_id": fc,
                             "output_index": 2, "sequence_number": 10}
    # OpenAI's indices (llama-server sends none): every event numbered, each item's place
    assert [d["sequence_number"] for _, d in events] == list(range(len(events)))
    assert [d.get("output_index") for _, d in events[2:-1]] == [0, 0, 0, 1, 1, 1, 1, 2, 2, 0, 1, 1, 1, 2]
    done = events[-1][1]
    assert list(done) == ["type", "response", "timings", "sequence_number"]
    assert list(done["response"]) == ["id", "object", "created_at", "status", "model", "output", "usage"]
    assert done["response"]["usage"] == {"input_tokens": 20, "output_tokens": len(pieces),
                                         "total_tokens": 20 + len(pieces), "input_tokens_details": {"cached_tokens": 12}}
    assert [o["type"] for o in done["response"]["output"]] == ["reasoning", "message", "function_call"]
    assert done["response"]["output"][1]["content"] == [RA.output_text("Hi there")]
    assert done["response"]["output"][2] == {"id": fc, "type": "function_call", "status": "completed",
                                             "arguments": '{"a": 1}', "call_id": call.id, "name": "f"}


def test_final_only_stream_and_an_incomplete_answer() -> None:
    s = RA.ResponseStream(CO.OutputSpec(), "resp_2", "m", lambda o: json.dumps(o).encode())
    events = _events(s.on_final(0, _final("ab", stop_type="limit", tail="ab")))
    assert [n for n, _ in events] == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.done", "response.content_part.done",
        "response.output_item.done", "response.incomplete"]
    body = events[-1][1]["response"]
    assert body["status"] == "incomplete" and body["incomplete_details"] == {"reason": "max_output_tokens"}
    for stop_type, status in (("limit", "incomplete"), ("eos", "completed"), ("word", "completed")):
        out = RA.response(_final("ab", stop_type=stop_type), CO.ChatAnswer("ab"), id_="resp_3", model="m")
        assert out["status"] == status and ("incomplete_details" in out) == (status == "incomplete")
        assert out["output"][0]["content"] == [RA.output_text("ab")]


# -- a real server ----------------------------------------------------------------------


def _streamed_text(events: list[tuple[str, dict[str, Any]]]) -> str:
    return "".join(d["delta"] for n, d in events if n == "response.output_text.delta")


def _oai(h: ServerHandle) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=h.url + "/v1", api_key="x")


async def test_text_streamed_and_not_through_the_openai_client(start: Start, tiny_qwen3_model: Path) -> None:  # noqa: F811
    h = await qwen3(start, tiny_qwen3_model)
    oc = _oai(h)
    kw: dict[str, Any] = dict(model="m", max_output_tokens=12, temperature=0, instructions="Be brief.",
                              input="Tell me a story")
    r = await oc.responses.create(**kw)
    assert r.object == "response" and r.id.startswith("resp_") and r.status == "incomplete"
    assert r.incomplete_details is not None and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage is not None and r.usage.output_tokens == 12 and r.usage.input_tokens > 0
    assert [o.type for o in r.output] == ["message"] and r.output_text
    # the same conversation as items: the same prompt, the same greedy text
    items = await oc.responses.create(**(kw | {"input": [
        {"role": "user", "content": [{"type": "input_text", "text": "Tell me a story"}]}]}))
    assert items.output_text == r.output_text
    # streamed: the deltas make the same text, the last event carries the whole answer
    events = [e async for e in await oc.responses.create(**kw, stream=True)]
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == r.output_text
    last = events[-1]
    assert last.type == "response.incomplete" and last.response.output_text == r.output_text
    assert last.response.usage is not None and last.response.usage.input_tokens == r.usage.input_tokens
    # the events themselves, in llama-server's order, and the route without /v1
    async with client(h) as c:
        raw = await c.post("/responses", json={"input": "Tell me a story", "instructions": "Be brief.",
                                               "max_output_tokens": 12, "temperature": 0, "stream": True})
        assert raw.status_code == 200 and raw.headers["content-type"].startswith("text/event-stream")
        assert "[DONE]" not in raw.text
        got = _sse(raw.text)
    names = [n for n, _ in got]
    n_deltas = len(names) - 8
    assert names == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added", *["response.output_text.delta"] * n_deltas,
                     "response.output_text.done", "response.content_part.done", "response.output_item.done",
                     "response.incomplete"]
    assert _streamed_text(got) == r.output_text and "timings" in got[-1][1]
    assert [d["sequence_number"] for _, d in got] == list(range(len(got)))
    assert all(d["output_index"] == 0 for _, d in got[2:-1])  # the one message item
    # the OpenAI SDK's stream helper (it reads those indices)
    async with oc.responses.stream(**kw) as stream:
        assert "".join([e.delta async for e in stream if e.type == "response.output_text.delta"]) == r.output_text
    usage = got[-1][1]["response"]["usage"]
    assert usage["input_tokens_details"]["cached_tokens"] > 0  # the same prompt again: read from the slot's cache
    await oc.close()


async def test_input_tokens_is_the_rendered_prompts_length(start: Start, tiny_qwen3_model: Path,  # noqa: F811
                                                           qwen_like: str) -> None:  # noqa: F811
    """Both input_tokens endpoints: the prompt /apply-template renders for the chat
    request, in tokens (here with a call answered); a response's usage says as much."""
    h = await qwen3(start, tiny_qwen3_model, "--chat-template-file", qwen_like)
    oc = _oai(h)
    async with client(h) as c:
        for body in ({"instructions": "Be brief.", "input": "Weather in Paris?"},
                     {"input": ANSWERED, "tools": [WEATHER]}):
            chat = RA.to_chat(body)
            prompt = (await c.post("/apply-template", json=chat)).json()["prompt"]
            ids = (await c.post("/tokenize", json={"content": prompt, "add_special": True})).json()["tokens"]
            counted = await oc.responses.input_tokens.count(**body)  # type: ignore[arg-type]
            assert counted.object == "response.input_tokens" and counted.input_tokens == len(ids) > 0
            for path in ("/responses/input_tokens", "/v1/responses/input_tokens"):
                assert (await c.post(path, json=body)).json() == {"input_tokens": len(ids),
                                                                  "object": "response.input_tokens"}
            for path in ("/chat/completions/input_tokens", "/v1/chat/completions/input_tokens"):
                assert (await c.post(path, json=chat)).json() == {"input_tokens": len(ids),
                                                                  "object": "response.input_tokens"}
            r = await c.post("/v1/responses", json=body | {"max_output_tokens": 1, "cache_prompt": False})
            assert r.status_code == 200 and r.json()["usage"]["input_tokens"] == len(ids), r.text
    assert '"get_weather"' in prompt and "<tool_call>" in prompt and "sunny, 21 C" in prompt
    assert prompt.index("Let me look.") < prompt.index("<tool_call>") < prompt.index("sunny, 21 C")
    await oc.close()


@pytest.mark.parametrize("stream", [False, True])
async def test_a_forced_function_call_and_its_output(start: Start, tiny_qwen3_model: Path,  # noqa: F811
                                                     qwen_like: str, stream: bool) -> None:  # noqa: F811
    h = await qwen3(start, tiny_qwen3_model, "--chat-template-file", qwen_like)
    oc = _oai(h)
    kw: dict[str, Any] = dict(model="m", max_output_tokens=128, temperature=0, input=ASKED, tools=[WEATHER],
                              tool_choice={"type": "function", "name": "get_weather"})
    if stream:
        events = [e async for e in await oc.responses.create(**kw, stream=True)]
        names = [e.type for e in events]
        assert names[-3:] == ["response.function_call_arguments.delta", "response.output_item.done",
                              "response.completed"]
        r = events[-1].response  # type: ignore[union-attr]
        args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    else:
        r = await oc.responses.create(**kw)
        args = None
    assert r.status == "completed"
    calls = [o for o in r.output if o.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather" and calls[0].status == "completed"
    assert json.loads(calls[0].arguments)["city"] in ("Paris", "Oslo")
    assert calls[0].id == "fc_" + calls[0].call_id.removeprefix("call_")
    assert args is None or args == calls[0].arguments
    # the call answered: the next turn runs, the call and its output in the prompt
    turn = [*ASKED, calls[0].model_dump(exclude_none=True),
            {"type": "function_call_output", "call_id": calls[0].call_id, "output": "sunny"}]
    after = await oc.responses.create(**(kw | {"input": turn, "tool_choice": "none", "max_output_tokens": 4}))
    assert after.status == "incomplete" and after.output_text
    with pytest.raises(openai.BadRequestError):  # a function not in tools
        await oc.responses.create(**(kw | {"tool_choice": {"type": "function", "name": "nope"}}))
    await oc.close()


async def test_reasoning_items(start: Start, tiny_qwen3_model: Path, tmp_path: Path) -> None:  # noqa: F811
    """A thinking template: the thought is a reasoning item (streamed as reasoning_text
    deltas); the thinking budget passes through and cuts it; it goes back as an item."""
    (tmp_path / "think.jinja").write_text(THINKING)
    h = await qwen3(start, tiny_qwen3_model, "--chat-template-file", str(tmp_path / "think.jinja"))
    oc = _oai(h)
    kw: dict[str, Any] = dict(model="m", max_output_tokens=12, temperature=0, input="more")
    r = await oc.responses.create(**kw)
    assert [o.type for o in r.output] == ["reasoning"]
    budget = await oc.responses.create(**kw, extra_body={"thinking_budget_tokens": 3})
    assert [o.type for o in budget.output] == ["reasoning", "message"]
    thought = budget.output[0]
    assert thought.type == "reasoning" and thought.content and thought.content[0].type == "reasoning_text"
    assert len(thought.content[0].text) < len(r.output[0].content[0].text)  # type: ignore[union-attr]
    events = [e async for e in await oc.responses.create(**kw, stream=True, extra_body={"thinking_budget_tokens": 3})]
    streamed = events[-1].response  # type: ignore[union-attr]
    # the same items (llama-server's streamed reasoning item has no status)
    assert [o.model_dump(exclude={"id", "status"}) for o in streamed.output] == \
        [o.model_dump(exclude={"id", "status"}) for o in budget.output]
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == \
        thought.content[0].text
    turn = [{"role": "user", "content": "more"}, *[o.model_dump(exclude_none=True) for o in budget.output],
            {"role": "user", "content": "and?"}]
    assert (await oc.responses.create(**(kw | {"input": turn}))).status == "incomplete"
    await oc.close()


async def test_text_format_follows_its_schema(start: Start, tiny_qwen3_model: Path) -> None:  # noqa: F811
    h = await qwen3(start, tiny_qwen3_model)
    oc = _oai(h)
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
              "additionalProperties": False}
    r = await oc.responses.create(model="m", input="x", max_output_tokens=64, temperature=0,
                                  text={"format": {"type": "json_schema", "name": "out", "schema": schema,
                                                   "strict": True}})
    assert r.status == "completed", r
    assert isinstance(json.loads(r.output_text)["a"], int)
    await oc.close()


BAD_HTTP: list[tuple[Any, str]] = [
    (b"not json", "not valid JSON"),
    ([1], "JSON object"),
    ({"model": "m"}, "'input' is required"),
    ({"input": 3}, "'input' must be"),
    ({"input": [{"type": "bogus"}]}, "'bogus'"),
    ({"input": [{"role": "user", "content": [{"type": "input_audio"}]}]}, "'input_audio'"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": "x"}]}, "answers no function_call"),
    ({"input": "x", "previous_response_id": "resp_1"}, "previous_response_id"),
    ({"input": "x", "background": True}, "background"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "web_search"),
    ({"input": "x", "max_output_tokens": "many"}, "max_output_tokens"),
    ({"input": "x", "max_output_tokens": -5}, "max_tokens"),
    ({"input": "x", "temperature": "hot"}, "temperature"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "data:image/png;base64,AAAA"}]}]},
     "image input"),
]


@pytest.mark.parametrize(("body", "why"), BAD_HTTP)
async def test_bad_requests_are_400(start: Start, body: Any, why: str) -> None:  # noqa: F811
    h = await start()
    async with client(h) as c:
        for path in ("/v1/responses", "/v1/responses/input_tokens"):
            if path.endswith("input_tokens") and why in ("max_tokens", "temperature"):
                continue  # counting reads no sampling field
            content = body if isinstance(body, bytes) else json.dumps(body).encode()
            r = await c.post(path, content=content, headers={"Content-Type": "application/json"})
            assert r.status_code == 400, (path, r.text)
            err = r.json()["error"]
            assert err["type"] == "invalid_request_error" and why in err["message"], (path, err)
        r = await c.post("/v1/chat/completions/input_tokens", json={"input": "x"})
        assert r.status_code == 400 and "'messages' is required" in r.json()["error"]["message"]
    oc = _oai(h)
    with pytest.raises(openai.BadRequestError):
        await oc.responses.create(model="m", input="x", previous_response_id="resp_1")
    await oc.close()


async def test_an_embedding_server_does_not_generate(start: Start, tiny_qwen3_model: Path) -> None:  # noqa: F811
    h = await qwen3(start, tiny_qwen3_model, "--embeddings")
    async with client(h) as c:
        for path in ("/v1/responses", "/responses"):
            assert (await c.post(path, json={"input": "x"})).status_code == 501
        assert (await c.post("/v1/responses/input_tokens", json={"input": "x"})).json()["input_tokens"] > 0


# -- against llama-server itself --------------------------------------------------------


Fetch = Callable[..., Awaitable[httpx.Response]]


@pytest.fixture
async def llamacpp(tiny_qwen3_model: Path) -> AsyncIterator[Fetch]:
    ref = await trio.to_thread.run_sync(lambda: Reference(tiny_qwen3_model, n_ctx=512))

    async def post(path: str, body: Any) -> httpx.Response:
        # a fresh connection each time: llama-server closes one after a stream
        return await trio.to_thread.run_sync(lambda: httpx.post(ref._server.listening_address + path, json=body,
                                                                timeout=60))

    yield post
    ref.close()


def _shape(obj: Any) -> Any:
    """The keys of a body, all the way down (values' types for leaves)."""
    if isinstance(obj, dict):
        return {k: _shape(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_shape(v) for v in obj]
    return type(obj).__name__


def _blank(obj: Any) -> Any:
    """A body with what differs by design blanked: ids, times, the model's name, timings,
    and the status of an answer cut at max_output_tokens (here "incomplete", as OpenAI's
    API says; llama-server says "completed")."""
    if isinstance(obj, dict):
        # and OpenAI's stream indices, which llama-server does not send
        out = {k: _blank(v) for k, v in obj.items()
               if k not in ("timings", "incomplete_details", "sequence_number", "output_index", "content_index")}
        for key in ("id", "item_id", "created_at", "completed_at", "model"):
            if key in out:
                out[key] = ""
        if out.get("status") == "incomplete":
            out["status"] = "completed"
        if out.get("type") == "response.incomplete":
            out["type"] = "response.completed"
        return out
    if isinstance(obj, list):
        return [_blank(v) for v in obj]
    return obj


async def test_same_answers_as_llama_server(start: Start, tiny_qwen3_model: Path, llamacpp: Fetch) -> None:  # noqa: F811
    """A greedy request on the same file: llama-server's text, usage, keys, events and counts."""
    h = await qwen3(start, tiny_qwen3_model, "-c", "512")
    # llama-server renders this template with enable_thinking false; said here for both
    body = {"model": "m", "max_output_tokens": 16, "temperature": 0, "instructions": "Be brief.",
            "chat_template_kwargs": {"enable_thinking": False},
            "input": [{"role": "user", "content": "Tell me"},
                      {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Sure."}]},
                      {"role": "user", "content": [{"type": "input_text", "text": "more"}]}]}
    theirs = (await llamacpp("/v1/responses", body)).json()
    async with client(h) as c:
        ours = (await c.post("/v1/responses", json=body)).json()
        for path in ("/v1/responses/input_tokens", "/responses/input_tokens"):
            assert (await c.post(path, json=body)).json() == (await llamacpp(path, body)).json()
        chat = RA.to_chat(body)
        for path in ("/v1/chat/completions/input_tokens", "/chat/completions/input_tokens"):
            assert (await c.post(path, json=chat)).json() == (await llamacpp(path, chat)).json()
        streamed = _sse((await c.post("/v1/responses", json=body | {"stream": True})).text)
    their_stream = _sse((await llamacpp("/v1/responses", body | {"stream": True})).text)
    assert ours["output"][0]["content"] == theirs["output"][0]["content"] and ours["usage"] == theirs["usage"]
    assert (ours["status"], theirs["status"]) == ("incomplete", "completed")  # cut at max_output_tokens
    assert ours["incomplete_details"] == {"reason": "max_output_tokens"} and ours["completed_at"] is None
    ours.pop("incomplete_details")
    ours["completed_at"] = theirs["completed_at"]
    assert list(ours) == list(theirs) and _shape(ours) == _shape(theirs)
    assert _blank(ours) == _blank(theirs)
    assert [n for n, _ in streamed][:-1] == [n for n, _ in their_stream][:-1]
    assert (streamed[-1][0], their_stream[-1][0]) == ("response.incomplete", "response.completed")
    assert [_shape(_blank(d)) for _, d in streamed] == [_shape(_blank(d)) for _, d in their_stream]
    for (_, a), (_, b) in zip(streamed, their_stream, strict=True):  # every event equal, ids and times apart
        assert _blank(a) == _blank(b)
    # refused alike: previous_response_id, a missing or wrong input
    for bad in ({"input": "x", "previous_response_id": "resp_1"}, {"model": "m"}, {"input": 3}):
        async with client(h) as c:
            r = await c.post("/v1/responses", json=bad)
        assert r.status_code == (await llamacpp("/v1/responses", bad)).status_code == 400

"""Tools and reasoning through a real server: what reaches the template, and answers
read into the openai client's types."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import openai
import pytest

from test_server_flags import Start, client, start  # noqa: F401  (the fixture)

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "the weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]

QWEN_LIKE = (
    "{%- if tools %}<|im_start|>system\n<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools>"
    "[choice={{ tool_choice }}]<|im_end|>\n{%- endif %}"
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{%- for tc in m.tool_calls or [] %}<tool_call>{{ tc.function | tojson }}</tool_call>{%- endfor %}<|im_end|>\n"
    "{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}"
)

ASKED = [{"role": "user", "content": "Weather in Paris?"}]
HISTORY = [
    *ASKED,
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
]


@pytest.fixture
def qwen_like(tmp_path: Path) -> str:
    path = tmp_path / "qwen-like.jinja"
    path.write_text(QWEN_LIKE)
    return str(path)


async def test_tools_reach_a_template_that_knows_them(start: Start, qwen_like: str) -> None:  # noqa: F811
    h = await start("--chat-template-file", qwen_like)
    async with client(h) as c:
        prompt = (await c.post("/apply-template", json={"messages": HISTORY, "tools": TOOLS})).json()["prompt"]
        assert '"name": "get_weather"' in prompt.split("</tools>")[0] and "[choice=auto]" in prompt
        # the client's JSON-text arguments reach the template as an object
        assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>' in prompt
        none = (await c.post("/apply-template", json={"messages": ASKED, "tools": TOOLS,
                                                      "tool_choice": "none"})).json()["prompt"]
        assert "<tools>" not in none
        for bad in ({"tools": {"x": 1}}, {"tools": [{"type": "function"}]},
                    {"tools": [{"type": "function", "function": {"name": ""}}]}, {"tools": TOOLS, "tool_choice": 3},
                    {"reasoning_format": "fancy"}):
            r = await c.post("/v1/chat/completions", json={"messages": ASKED, **bad})
            assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", bad


async def test_tools_for_a_template_without_them_go_to_a_system_message(start: Start) -> None:  # noqa: F811
    h = await start()  # the tiny model's llama3 template never mentions tools
    async with client(h) as c:
        prompt = (await c.post("/apply-template", json={"messages": ASKED, "tools": TOOLS})).json()["prompt"]
        system = prompt.split("<|eot_id|>")[0]
        assert "<|start_header_id|>system" in system and '"get_weather"' in system and "`tool_call`" in system


async def test_chat_with_tools_and_reasoning_through_the_openai_client(start: Start, qwen_like: str) -> None:  # noqa: F811
    """The tiny model's words are random, so what it answers is content; the answer
    must still arrive in the client's types, streamed and not."""
    h = await start("--chat-template-file", qwen_like, "--reasoning-format", "deepseek")
    oai = openai.AsyncOpenAI(base_url=h.url + "/v1", api_key="x")
    r = await oai.chat.completions.create(model="m", messages=HISTORY, tools=TOOLS, max_tokens=8)  # type: ignore[arg-type]
    choice = r.choices[0]
    assert choice.finish_reason in ("stop", "length", "tool_calls")
    assert choice.message.content is not None or choice.message.tool_calls
    stream = await oai.chat.completions.create(model="m", messages=ASKED, tools=TOOLS, max_tokens=8,  # type: ignore[arg-type]
                                               stream=True)
    text, finish = "", None
    async for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
    assert finish in ("stop", "length", "tool_calls")
    await oai.close()


async def test_thinking_switch_and_reasoning_content(start: Start, tiny_qwen3_model: Path) -> None:  # noqa: F811
    """tiny-qwen3's ChatML template writes an empty <think></think> when thinking is
    off; the answer's text after it is content, none of it reasoning."""
    h = await start("-m", str(tiny_qwen3_model), "--chat-template-kwargs", '{"enable_thinking": false}')
    async with client(h) as c:
        off = (await c.post("/apply-template", json={"messages": ASKED})).json()["prompt"]
        on = (await c.post("/apply-template", json={"messages": ASKED,
                                                    "chat_template_kwargs": {"enable_thinking": True}})).json()["prompt"]
        assert off != on and "<think>" in off
        r = (await c.post("/v1/chat/completions", json={"messages": ASKED, "max_tokens": 6, "temperature": 0})).json()
        msg = r["choices"][0]["message"]
        assert msg["role"] == "assistant" and isinstance(msg["content"], str)
        assert json.dumps(msg)  # plain JSON all the way


# -- constrained decoding (llguidance) -------------------------------------------------------

ANSWER_SCHEMA = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]},
                                                  "n": {"type": "integer", "minimum": 0, "maximum": 9}},
                 "required": ["answer", "n"], "additionalProperties": False}
CITY_TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}}, "required": ["city"],
    "additionalProperties": False}}}, {"type": "function", "function": {"name": "noop", "parameters": {
        "type": "object", "properties": {}, "additionalProperties": False}}}]


async def test_gbnf_grammar_and_json_schema_on_completion(start: Start) -> None:  # noqa: F811
    import re

    h = await start("-np", "2")
    async with client(h) as c:
        for seed in range(3):
            r = (await c.post("/completion", json={"prompt": "Say", "grammar": 'root ::= ("yes" | "no") "!"',
                                                   "n_predict": 16, "seed": seed, "temperature": 1.0})).json()
            assert re.fullmatch(r"(yes|no)!", r["content"]), r["content"]
            assert r["stop_type"] == "eos"  # the grammar ended the answer
        r = (await c.post("/completion", json={"prompt": "JSON:", "json_schema": ANSWER_SCHEMA, "n_predict": 64,
                                               "temperature": 0})).json()
        import jsonschema

        jsonschema.validate(json.loads(r["content"]), ANSWER_SCHEMA)
        for bad in ({"grammar": "root ::= foo"}, {"grammar": 3}, {"json_schema": {"type": "nonsense"}},
                    {"grammar": 'root ::= "a"', "json_schema": {}}):
            r = await c.post("/completion", json={"prompt": "x", **bad})
            assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", bad


async def test_constrained_and_free_slots_decode_together(start: Start) -> None:  # noqa: F811
    import trio

    h = await start("-np", "2")
    results: dict[str, Any] = {}
    async with client(h) as c:
        async def ask(name: str, extra: dict) -> None:
            body = {"prompt": "Go", "n_predict": 24 if name == "free" else 96, "temperature": 0,
                    "ignore_eos": name == "free", **extra}
            results[name] = (await c.post("/completion", json=body)).json()

        async with trio.open_nursery() as n:
            n.start_soon(ask, "free", {})
            n.start_soon(ask, "schema", {"json_schema": ANSWER_SCHEMA})
    assert results["free"]["tokens_predicted"] == 24
    assert results["schema"]["stop_type"] == "eos"  # the grammar ended it, not the limit
    assert set(json.loads(results["schema"]["content"])) == {"answer", "n"}


async def test_response_format_through_the_openai_client(start: Start) -> None:  # noqa: F811
    import jsonschema

    h = await start()
    oai = openai.AsyncOpenAI(base_url=h.url + "/v1", api_key="x")
    r = await oai.chat.completions.create(
        model="m", messages=ASKED, max_tokens=64, temperature=0,  # type: ignore[arg-type]
        response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": ANSWER_SCHEMA}})
    jsonschema.validate(json.loads(r.choices[0].message.content or ""), ANSWER_SCHEMA)
    r = await oai.chat.completions.create(model="m", messages=ASKED, max_tokens=48, temperature=0,  # type: ignore[arg-type]
                                          response_format={"type": "json_object"})
    assert r.choices[0].finish_reason == "length" or isinstance(json.loads(r.choices[0].message.content or ""), dict)
    with pytest.raises(openai.BadRequestError):
        await oai.chat.completions.create(model="m", messages=ASKED,  # type: ignore[arg-type]
                                          response_format={"type": "xml"})  # type: ignore[typeddict-item]
    await oai.close()


@pytest.mark.parametrize("stream", [False, True])
async def test_a_forced_tool_call_round_trips_through_the_openai_client(
        start: Start, qwen_like: str, stream: bool) -> None:  # noqa: F811
    """tool_choice naming a function constrains decoding to one call in the template's
    format (here Hermes); the answer comes back as tool_calls of the client's types."""
    h = await start("--chat-template-file", qwen_like)
    oai = openai.AsyncOpenAI(base_url=h.url + "/v1", api_key="x")
    choice = {"type": "function", "function": {"name": "get_weather"}}
    kw: dict[str, Any] = dict(model="m", messages=ASKED, tools=CITY_TOOLS, tool_choice=choice, max_tokens=256,
                              temperature=0)
    if not stream:
        r = await oai.chat.completions.create(**kw)
        msg = r.choices[0].message
        assert r.choices[0].finish_reason == "tool_calls" and msg.content is None
        calls = [(c.function.name, json.loads(c.function.arguments)) for c in msg.tool_calls or []]
    else:
        calls_by_index: dict[int, Any] = {}
        finish = None
        async for chunk in await oai.chat.completions.create(**kw, stream=True):
            if not chunk.choices:
                continue
            for tc in chunk.choices[0].delta.tool_calls or []:
                calls_by_index[tc.index] = tc
            finish = chunk.choices[0].finish_reason or finish
        assert finish == "tool_calls"
        calls = [(tc.function.name, json.loads(tc.function.arguments)) for tc in calls_by_index.values()]
    assert len(calls) == 1 and calls[0][0] == "get_weather" and calls[0][1]["city"] in ("Paris", "Oslo")
    r = await oai.chat.completions.create(**(kw | {"tool_choice": "required"}))
    assert r.choices[0].message.tool_calls and r.choices[0].message.tool_calls[0].function.name in ("get_weather", "noop")
    with pytest.raises(openai.BadRequestError):
        await oai.chat.completions.create(**(kw | {"tool_choice": {"type": "function", "function": {"name": "nope"}}}))
    await oai.close()


async def test_server_wide_grammar_flag(start: Start) -> None:  # noqa: F811
    h = await start("--grammar", 'root ::= "ok"')
    async with client(h) as c:
        r = (await c.post("/completion", json={"prompt": "x", "n_predict": 8})).json()
        assert r["content"] == "ok" and r["stop_type"] == "eos"
        own = (await c.post("/completion", json={"prompt": "x", "n_predict": 8, "grammar": 'root ::= "no"'})).json()
        assert own["content"] == "no"


async def test_grammar_on_a_sentencepiece_vocabulary(start: Start, tiny_spm_model: Path) -> None:  # noqa: F811
    """SentencePiece writes a dummy-prefix space before a text's first word; the
    grammar must still get exactly its text (llama.cpp's test_completion_with_grammar)."""
    h = await start("-m", str(tiny_spm_model))
    async with client(h) as c:
        for path, extra in (("/completion", {"prompt": "x", "n_predict": 6}),
                            ("/chat/completions", {"messages": ASKED, "max_tokens": 6})):
            r = (await c.post(path, json={"grammar": 'root ::= "a"{5,5}', **extra})).json()
            text = r["content"] if "content" in r else r["choices"][0]["message"]["content"]
            assert text == "aaaaa"
            r = (await c.post(path, json={"json_schema": {"const": "42"}, **extra})).json()
            text = r["content"] if "content" in r else r["choices"][0]["message"]["content"]
            assert text == '"42"'


def test_templates_as_llama_cpp_renders_them(tiny_model: Path) -> None:
    from trio_llm.model.chat import ChatTemplate
    from trio_llm.model.gguf import load_gguf
    from trio_llm.model.tokenizer import Tokenizer

    tok = Tokenizer.from_metadata(load_gguf(tiny_model).metadata)
    source = ("{{ 'functions: ' + functions + '|' }}{% generation %}{{ messages[0].content }}{% endgeneration %}"
              "|{{ date_string }}")
    text = ChatTemplate.from_source(source, tok).render([{"role": "user", "content": "hi"}])
    import datetime

    assert text == f"functions: |hi|{datetime.date.today().strftime('%d %b %Y')}"

"""Reading a chat answer: reasoning_content and tool_calls per model family, streamed and not."""

from __future__ import annotations

import json

import pytest

from trio_llm.model.chat_output import OutputSpec, StreamDeltas, detect_format, parse

TOOLS = ({"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}},)


def stream(text: str, spec: OutputSpec, step: int = 1) -> list[dict]:
    reader = StreamDeltas(spec)
    out = []
    for i in range(0, len(text), step):
        out += reader.feed(text[i:i + step])
    return out + reader.finish()


def joined(deltas: list[dict], key: str) -> str:
    return "".join(d.get(key, "") for d in deltas)


HERMES = ('<think>\nthe user wants weather\n</think>\n\nLet me check.\n<tool_call>\n'
          '{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>')


@pytest.mark.parametrize("step", [1, 3, 1000])
def test_hermes_call_with_thinking_streamed_and_not(step: int) -> None:
    spec = OutputSpec("hermes", "auto", False, TOOLS)
    answer, _ = parse(HERMES, spec)
    assert (answer.content, answer.reasoning) == ("Let me check.", "the user wants weather")
    assert [(c.name, json.loads(c.arguments)) for c in answer.tool_calls] == [("get_weather", {"city": "Paris", "days": 2})]
    deltas = stream(HERMES, spec, step)
    assert joined(deltas, "reasoning_content") == "the user wants weather"
    assert joined(deltas, "content") == "Let me check."  # nothing of the call leaked as content
    calls = [d["tool_calls"][0] for d in deltas if "tool_calls" in d]
    assert len(calls) == 1 and calls[0]["index"] == 0 and calls[0]["function"]["name"] == "get_weather"
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris", "days": 2}


def test_qwen3_coder_xml_calls_follow_the_schema_types() -> None:
    spec = OutputSpec("qwen3_coder", "auto", True, TOOLS)  # the prompt opened <think>
    text = ("plan\n</think>\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\n123\n</parameter>\n"
            "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>")
    answer, _ = parse(text, spec)
    assert answer.reasoning == "plan" and answer.content == ""
    assert json.loads(answer.tool_calls[0].arguments) == {"city": "123", "days": 3}


def test_llama3_json_and_generic_calls() -> None:
    llama = OutputSpec("llama3_json", "auto", False, TOOLS)
    answer, _ = parse('<|python_tag|>{"name": "get_weather", "parameters": {"city": "X"}}', llama)
    assert answer.tool_calls[0].name == "get_weather" and json.loads(answer.tool_calls[0].arguments) == {"city": "X"}
    assert parse("Just text.", llama)[0].content == "Just text."
    assert joined(stream("Just text.", llama), "content") == "Just text."
    generic = OutputSpec("generic", "auto", False, TOOLS)
    assert parse('{"response": "hello"}', generic)[0].content == "hello"
    answer, _ = parse('{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Y"}}]}', generic)
    assert json.loads(answer.tool_calls[0].arguments) == {"city": "Y"}
    assert parse("{not json", generic)[0].content == "{not json"


def test_reasoning_formats() -> None:
    text = "<think>abc</think>Hello"
    assert parse(text, OutputSpec(None, "auto"))[0].reasoning == "abc"
    assert parse(text, OutputSpec(None, "deepseek"))[0].content == "Hello"
    legacy = parse(text, OutputSpec(None, "deepseek-legacy"))[0]
    assert (legacy.reasoning, legacy.content) == ("abc", text)
    none = parse(text, OutputSpec(None, "none"))[0]
    assert (none.reasoning, none.content) == (None, text)
    unfinished = parse("still thinking", OutputSpec(None, "auto", thinking_open=True))[0]
    assert (unfinished.reasoning, unfinished.content) == ("still thinking", "")
    deltas = stream("<think>a b</think> c", OutputSpec(None, "auto"))
    assert (joined(deltas, "reasoning_content"), joined(deltas, "content")) == ("a b", "c")


def test_format_follows_the_template() -> None:
    assert detect_format("{{ '<tool_call>' }}{{ tools }}") == "hermes"
    assert detect_format("<tool_call><function=x>") == "qwen3_coder"
    assert detect_format("<|start_header_id|>{% if tools %}") == "llama3_json"
    assert detect_format(None) == "generic"

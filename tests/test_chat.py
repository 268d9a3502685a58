"""Chat templates from GGUF metadata: the three families, the fallback, the Jinja contract."""

from __future__ import annotations

import datetime
from pathlib import Path
from typing import Any

import pytest

from trio_llm.errors import InvalidRequest, TemplateError
from trio_llm.model.chat import ChatTemplate, normalize_messages
from trio_llm.model.tokenizer import Tokenizer
from trio_llm.model.vocab import build_vocab
from vocab_files import read_metadata, write_vocab_gguf

FAMILIES = {"llama3": ("gpt2", "llama"), "chatml": ("gpt2", "qwen2"), "llama2": ("llama", "llama")}

CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Hi!"},
    {"role": "assistant", "content": "Hello."},
    {"role": "user", "content": "More?"},
]


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A vocabulary-only GGUF per family, written and read back like a real model."""
    root = tmp_path_factory.mktemp("chat")
    out = {}
    for family, (style, arch) in FAMILIES.items():
        (root / family).mkdir()
        spec = build_vocab(style, 1024, family)  # type: ignore[arg-type]
        out[family] = write_vocab_gguf(root / family / "vocab.gguf", spec, arch)
    return out


@pytest.fixture(scope="module")
def metadata(files: dict[str, Path]) -> dict[str, dict[str, Any]]:
    return {family: read_metadata(path) for family, path in files.items()}


def _template(md: dict[str, Any], **kwargs: Any) -> tuple[ChatTemplate, Tokenizer]:
    tok = Tokenizer.from_metadata(md)
    return ChatTemplate.from_metadata(md, tok, **kwargs), tok


def test_llama3(metadata: dict[str, dict[str, Any]]) -> None:
    tmpl, tok = _template(metadata["llama3"])
    assert tmpl.source is not None and "<|start_header_id|>" in tmpl.source
    text = tmpl.render(CONVERSATION[:2])
    # the template writes <|begin_of_text|>; the tokenizer adds BOS itself, so it is dropped
    assert text == (
        "<|start_header_id|>system<|end_header_id|>\n\nYou are terse.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nHi!<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    ids = tok.encode(text)
    assert ids.count(tok.bos_id) == 1 and ids[0] == tok.bos_id  # type: ignore[arg-type]
    assert ids.count(tok.eot_id) == 2  # type: ignore[arg-type]
    assert not tmpl.render(CONVERSATION[:2], add_generation_prompt=False).endswith("\n\n")


def test_chatml(metadata: dict[str, dict[str, Any]]) -> None:
    tmpl, tok = _template(metadata["chatml"])
    text = tmpl.render(CONVERSATION[:2])
    assert text == (
        "<|im_start|>system\nYou are terse.<|im_end|>\n"
        "<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n"
    )
    no_think = tmpl.render(CONVERSATION[:2], enable_thinking=False)
    assert no_think == text + "<think>\n\n</think>\n\n"
    assert tok.encode(text).count(tok.eos_id) == 2  # <|im_end|> is one token, twice


def test_llama2(metadata: dict[str, dict[str, Any]]) -> None:
    tmpl, tok = _template(metadata["llama2"])
    text = tmpl.render(CONVERSATION)
    assert text == (
        "[INST] <<SYS>>\nYou are terse.\n<</SYS>>\n\nHi! [/INST] Hello. </s><s>[INST] More? [/INST]"
    )
    ids = tok.encode(text)
    assert ids[0] == 1 and ids.count(1) == 2 and ids.count(2) == 1


def test_llama2_roles_must_alternate(metadata: dict[str, dict[str, Any]]) -> None:
    tmpl, _ = _template(metadata["llama2"])
    with pytest.raises(TemplateError, match="roles must alternate"):
        tmpl.render([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])


def test_trailing_eos_dropped_when_the_tokenizer_appends_it(
    metadata: dict[str, dict[str, Any]],
) -> None:
    md = dict(metadata["llama2"], **{"tokenizer.ggml.add_eos_token": True})
    tmpl, tok = _template(md)
    text = tmpl.render(CONVERSATION[1:3], add_generation_prompt=False)
    assert text == "[INST] Hi! [/INST] Hello. "  # the template writes " " + eos_token
    assert tok.encode(text)[-1] == tok.eos_id


def test_fallback_without_a_template(metadata: dict[str, dict[str, Any]]) -> None:
    md = {k: v for k, v in metadata["llama3"].items() if k != "tokenizer.chat_template"}
    tmpl, _ = _template(md)
    assert tmpl.source is None
    assert tmpl.render([{"role": "user", "content": "Hi"}]) == (
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )


@pytest.mark.reference
@pytest.mark.parametrize("family", FAMILIES)
def test_same_text_as_transformers(
    files: dict[str, Path], metadata: dict[str, dict[str, Any]], family: str
) -> None:
    """transformers renders the template from the same file; only our BOS strip differs."""
    from transformers import AutoTokenizer

    path = files[family]
    reference = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    tmpl, _ = _template(metadata[family])
    messages = CONVERSATION if family == "llama2" else CONVERSATION[:2]
    expected = reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    stripped = tmpl.bos_token if family != "chatml" else ""
    assert expected == stripped + tmpl.render(messages)


# --- the Jinja contract ----------------------------------------------------------------


def _custom(metadata: dict[str, dict[str, Any]], source: str, **kwargs: Any) -> ChatTemplate:
    tok = Tokenizer.from_metadata(metadata["chatml"])
    return ChatTemplate.from_source(source, tok, **kwargs)


def test_trim_and_lstrip_blocks(metadata: dict[str, dict[str, Any]]) -> None:
    source = "{% for m in messages %}\n    {% if true %}\n{{ m['role'] }}\n    {% endif %}\n{% endfor %}\n"
    tmpl = _custom(metadata, source)
    assert tmpl.render([{"role": "user", "content": ""}, {"role": "tool", "content": ""}]) == (
        "user\ntool\n"
    )


def test_strftime_now_and_tojson(metadata: dict[str, dict[str, Any]]) -> None:
    source = "{{ strftime_now('%d %b %Y') }} {{ tools | tojson }} {{ tools | tojson(indent=1) }}"
    pinned = datetime.datetime(2024, 7, 26, 12, 0)
    tmpl = _custom(metadata, source, now=lambda: pinned)
    tools = [{"name": "a<b>&c", "text": "é"}]
    assert tmpl.render([], tools=tools) == (
        '26 Jul 2024 [{"name": "a<b>&c", "text": "é"}] [\n {\n  "name": "a<b>&c",\n  "text": "é"\n }\n]'
    )


def test_bos_eos_and_extra_variables(metadata: dict[str, dict[str, Any]]) -> None:
    tmpl = _custom(
        metadata, "{{ bos_token }}|{{ eos_token }}|{{ custom }}|{{ add_generation_prompt }}"
    )
    assert tmpl.render([], custom="x", add_generation_prompt=False) == (
        "<|endoftext|>|<|im_end|>|x|False"
    )


@pytest.mark.parametrize(
    ("source", "message"),
    [
        ("{% for m in messages %}", "line 1"),  # syntax: unclosed block
        ("{{ messages[0]['content'] + 1 }}", "TypeError"),
        ("{{ undefined_function() }}", "undefined"),
        ("{% set _ = messages.append(1) %}", "unsafe|not safely callable"),
        ("{{ raise_exception('no tools here') }}", "^no tools here$"),
    ],
)
def test_template_errors(metadata: dict[str, dict[str, Any]], source: str, message: str) -> None:
    with pytest.raises(TemplateError, match=message):
        _custom(metadata, source).render([{"role": "user", "content": "x"}])


def test_non_string_template_in_metadata(metadata: dict[str, dict[str, Any]]) -> None:
    md = dict(metadata["chatml"], **{"tokenizer.chat_template": 42})
    with pytest.raises(TemplateError, match="must be a string"):
        _template(md)


# --- messages --------------------------------------------------------------------------


def test_text_parts_are_joined_and_other_keys_kept() -> None:
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "1"}]},
        {"role": "tool", "content": "42", "tool_call_id": "1"},
    ]
    assert normalize_messages(messages) == [
        {"role": "user", "content": "a\nb"},
        {"role": "assistant", "content": "", "tool_calls": [{"id": "1"}]},
        {"role": "tool", "content": "42", "tool_call_id": "1"},
    ]
    assert messages[0]["content"][0] == {"type": "text", "text": "a"}  # not modified in place


@pytest.mark.parametrize(
    ("messages", "message"),
    [
        ({"role": "user"}, "must be an array"),
        (["hi"], r"messages\[0\] must be an object"),
        ([{"content": "hi"}], r"messages\[0\]\.role"),
        ([{"role": "user"}], "content is missing"),
        ([{"role": "user", "content": 3}], "string or an array of text parts"),
        (
            [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
            "only text parts are supported, not 'image_url'",
        ),
        (
            [{"role": "user", "content": [{"type": "text", "text": None}]}],
            r"\.text must be a string",
        ),
    ],
)
def test_invalid_messages(metadata: dict[str, dict[str, Any]], messages: Any, message: str) -> None:
    tmpl, _ = _template(metadata["chatml"])
    with pytest.raises(InvalidRequest, match=message):
        tmpl.render(messages)

"""``--chat-template NAME``: every built-in name renders as llama.cpp renders it.

The reference is llama.cpp itself: an xllamacpp ``Server`` (llama-server in-process,
listening on loopback) started with that name and ``use_jinja`` off, which is how
llama-server reaches its legacy formatter ``llm_chat_apply_template`` (with Jinja on,
its default, a name other than chatml is rendered as template text: the prompt would
be the name itself). Its ``/apply-template`` gives the prompt for each conversation;
``prefill_assistant`` is off there so that ``add_generation_prompt`` is taken as sent
even after an assistant message, which isolates the template from the server's
continuation rule (tested on our server at the end).

The model is ``tiny-spm``: its BOS text is ``<s>`` and its tokenizer adds BOS, so a
format that writes ``<s>`` itself (gigachat, monarch, llama2-sys-bos) shows whether
the text is kept as llama.cpp keeps it.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
import xllamacpp

from conftest import ServeFactory
from trio_llm.model.builtin_templates import BUILTIN_TEMPLATES
from trio_llm.model.chat import ChatTemplate
from trio_llm.model.gguf import load_gguf
from trio_llm.model.tokenizer import Tokenizer
from trio_llm.runtime import ServerHandle

#: the names llama.cpp's ``--chat-template`` accepts (the table in src/llama-chat.cpp,
#: October 2026); the test below also asks xllamacpp for its list
LLAMA_CPP_NAMES = (
    "chatml llama2 llama2-sys llama2-sys-bos llama2-sys-strip mistral-v1 mistral-v3 mistral-v3-tekken "
    "mistral-v7 mistral-v7-tekken phi3 phi4 falcon3 zephyr monarch gemma orion openchat vicuna vicuna-orca "
    "deepseek deepseek2 deepseek3 deepseek-ocr command-r llama3 chatglm3 chatglm4 glmedge minicpm exaone3 "
    "exaone4 exaone-moe rwkv-world granite granite-4.0 granite-4.1 gigachat megrez yandex bailing "
    "bailing-think bailing2 llama4 smolvlm hunyuan-moe gpt-oss hunyuan-dense hunyuan-vl kimi-k2 seed_oss "
    "grok-2 pangu-embedded solar-open"
).split()


def _m(role: str, content: str) -> dict[str, str]:
    return {"role": role, "content": content}


#: conversations that reach every branch of the formats: system or not, several
#: turns, text to trim (C whitespace, and Unicode spaces a C trim keeps), two system
#: messages, a system message before an assistant one, roles beyond the usual three
CONVERSATIONS: dict[str, list[dict[str, str]]] = {
    "system_user": [_m("system", "You are a test."), _m("user", "Hi there")],
    "multi_turn": [
        _m("system", " Be brief. "), _m("user", "Hello"), _m("assistant", " Hi, how can I help? "),
        _m("user", "Tell me a joke.\n"),
    ],
    "no_system": [_m("user", "What is 2+2?")],
    "no_system_multi": [_m("user", "a"), _m("assistant", "b"), _m("user", "c")],
    "two_systems": [_m("system", "First."), _m("system", " Second. "), _m("user", "Go")],
    "system_then_assistant": [_m("system", "S"), _m("assistant", "A"), _m("user", "U")],
    "ends_with_assistant": [_m("user", "Q"), _m("assistant", "A ")],
    "other_roles": [
        _m("system", "sys"), _m("user", "call it"), _m("assistant_tool_call", '{"name": "f"}'), _m("tool", "42"),
        _m("function", "fn"), _m("ßeta", "odd role"), _m("assistant", "done"), _m("user", "thanks"),
    ],
    "whitespace": [_m("user", "\u00a0 padded \u2003"), _m("assistant", "\t\x0bx\x0c\r\n"), _m("user", " \n")],
    "system_only": [_m("system", "Only a system prompt.")],
}


class _LlamaServer:
    """llama-server in-process (xllamacpp) with one ``--chat-template``, and a client
    (one connection: a new one per request costs more than the rendering)."""

    def __init__(self, model: Path, name: str, *, jinja: bool = False, prefill: bool = False) -> None:
        params = xllamacpp.CommonParams()
        params.model.path = str(model)
        params.n_ctx = 256
        params.n_parallel = 1
        params.cpuparams.n_threads = 1
        params.cpuparams_batch.n_threads = 1
        params.warmup = False
        params.verbosity = -1
        params.chat_template = name
        params.use_jinja = jinja
        params.prefill_assistant = prefill
        self._server = xllamacpp.Server(params)
        self._client = httpx.Client(base_url=self._server.listening_address, timeout=30)

    def close(self) -> None:
        self._client.close()
        del self._server

    def prompt(self, messages: list[dict[str, str]], add_generation_prompt: bool | None) -> str:
        """llama-server's ``/apply-template`` for `messages` (None: the flag not sent)."""
        body: dict[str, Any] = {"messages": messages}
        if add_generation_prompt is not None:
            body["add_generation_prompt"] = add_generation_prompt
        r = self._client.post("/apply-template", json=body)
        assert r.status_code == 200, r.text
        prompt = r.json()["prompt"]
        assert isinstance(prompt, str)
        return prompt


@pytest.fixture(scope="module")
def spm_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from trio_llm.model.synth import make_model

    return make_model("tiny-spm", "Q8_0", tmp_path_factory.mktemp("spm") / "tiny-spm.gguf", seed=0)


@pytest.fixture(scope="module")
def spm_tokenizer(spm_model: Path) -> Tokenizer:
    tok = Tokenizer.from_metadata(load_gguf(spm_model).metadata)
    assert tok.add_bos and tok.bos_id is not None and tok.token_text(tok.bos_id) == "<s>"
    return tok


def test_the_names_are_llama_cpps() -> None:
    """Every name llama-server accepts is built in, and no other (the list llama.cpp
    prints under ``--chat-template``'s help is its ``llama_chat_builtin_templates``)."""
    assert sorted(BUILTIN_TEMPLATES) == sorted(LLAMA_CPP_NAMES)


@pytest.mark.parametrize("name", LLAMA_CPP_NAMES)
def test_builtin_template_matches_llama_cpp(name: str, spm_model: Path, spm_tokenizer: Tokenizer) -> None:
    ours = ChatTemplate.from_source(BUILTIN_TEMPLATES[name], spm_tokenizer)
    server = _LlamaServer(spm_model, name)
    try:
        for label, messages in CONVERSATIONS.items():
            for add_gen in (True, False):
                want = server.prompt(messages, add_gen)
                got = ours.render(messages, add_generation_prompt=add_gen)
                assert got == want, (name, label, add_gen)
    finally:
        server.close()


def test_a_name_with_jinja_is_the_name(spm_model: Path) -> None:
    """Why the names are checked with Jinja off: llama-server with ``--jinja`` (its
    default) takes ``command-r`` as template text, whose output is the text itself."""
    server = _LlamaServer(spm_model, "command-r", jinja=True)
    try:
        assert server.prompt(CONVERSATIONS["system_user"], True) == "command-r"
    finally:
        server.close()


# -- our server: /apply-template with --chat-template NAME ---------------------------------

Start = Callable[..., Awaitable[ServerHandle]]


@pytest.fixture
def start(serve_argv: ServeFactory, spm_model: Path) -> Start:
    """Factory: our server from a command line (tiny-spm, numpy, port 0), once loaded."""
    return lambda *argv: serve_argv("-m", spm_model, "--backend", "numpy", "-c", "512", *argv)


@pytest.fixture
def reference_server(spm_model: Path) -> Iterator[Callable[..., _LlamaServer]]:
    servers: list[_LlamaServer] = []

    def make(name: str, **kw: Any) -> _LlamaServer:
        servers.append(_LlamaServer(spm_model, name, **kw))
        return servers[-1]

    yield make
    for server in servers:
        server.close()


async def test_llama_cpp_suite_command_r(start: Start) -> None:
    """llama.cpp's test_chat_completion.py::test_apply_chat_template, as it asks."""
    h = await start("--chat-template", "command-r")
    async with httpx.AsyncClient(base_url=h.url, timeout=30) as c:
        r = await c.post("/apply-template", json={"messages": CONVERSATIONS["system_user"]})
    assert r.status_code == 200
    assert r.json()["prompt"] == (
        "<|START_OF_TURN_TOKEN|><|SYSTEM_TOKEN|>You are a test.<|END_OF_TURN_TOKEN|><|START_OF_TURN_TOKEN|>"
        "<|USER_TOKEN|>Hi there<|END_OF_TURN_TOKEN|><|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>"
    )


@pytest.mark.parametrize(("name", "jinja"), [("gigachat", False), ("vicuna", False), ("chatml", True)])
async def test_server_prompt_matches_llama_server(
    name: str, jinja: bool, start: Start, reference_server: Callable[..., _LlamaServer]
) -> None:
    """Our /apply-template against llama-server's, both with their defaults otherwise
    (``--prefill-assistant`` on): a legacy name renders a last assistant message whole,
    end-of-turn included, where chatml (Jinja in llama-server) continues it; a BOS the
    format writes (gigachat's ``<s>``) stays."""
    ref = reference_server(name, jinja=jinja, prefill=True)
    h = await start("--chat-template", name)
    async with httpx.AsyncClient(base_url=h.url, timeout=30) as c:
        for label in ("system_user", "multi_turn", "ends_with_assistant", "no_system_multi"):
            messages = CONVERSATIONS[label]
            for add_gen in (None, False):
                body: dict[str, Any] = {"messages": messages}
                if add_gen is not None:
                    body["add_generation_prompt"] = add_gen
                want = await trio.to_thread.run_sync(ref.prompt, messages, add_gen)
                r = await c.post("/apply-template", json=body)
                assert r.status_code == 200, r.text
                assert r.json()["prompt"] == want, (name, label, add_gen)

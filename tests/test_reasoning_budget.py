"""The thinking budget (llama-server's ``--reasoning-budget`` and the
``reasoning_budget_*`` / ``thinking_budget_tokens`` fields): the state machine on its
own, then through the server, where a greedy answer with a budget must be llama.cpp's
token for token (xllamacpp, the same request on the same file)."""

from __future__ import annotations

from pathlib import Path

import httpx

from conftest import ServeFactory
from llamacpp_ref import Reference, partial_utf8_tokens, plain_prompt
from trio_llm.engine.reasoning_budget import (
    COUNTING,
    DONE,
    FORCING,
    IDLE,
    WAITING,
    BudgetSpec,
    ReasoningBudget,
    utf8_complete,
)
from trio_llm.model.gguf import load_gguf
from trio_llm.model.tokenizer import Tokenizer

START, END, MSG = (7,), ((8, 9),), (5,)


def _walk(b: ReasoningBudget, tokens: list[int]) -> list[tuple[str, int | None]]:
    out = []
    for t in tokens:
        b.accept(t)
        out.append((b.state, b.forced()))
    return out


def test_the_state_machine_is_llamacpps() -> None:
    spec = BudgetSpec(2, (START,), END, MSG + END[0])
    b = ReasoningBudget(spec, lambda t: t != 66)
    assert (b.state, b.forced()) == (IDLE, None)
    # the start tag opens the count; two tokens spend it; the message and the end are forced
    assert _walk(b, [1, 7, 2, 3]) == [(IDLE, None), (COUNTING, None), (COUNTING, None), (FORCING, 5)]
    assert _walk(b, [5, 8, 9]) == [(FORCING, 8), (FORCING, 9), (DONE, None)]
    # done: passthrough, until a new start tag with a fresh budget
    assert _walk(b, [1, 2, 7, 8, 9]) == [(DONE, None)] * 2 + [(COUNTING, None), (COUNTING, None), (DONE, None)]
    # a token that leaves a character unfinished postpones the forcing
    b = ReasoningBudget(spec, lambda t: t != 66)
    assert _walk(b, [7, 1, 66, 66, 4]) == [(COUNTING, None), (COUNTING, None), (WAITING, None), (WAITING, None),
                                            (FORCING, 5)]
    # budget 0, and a prompt that opened the thought: forced at once
    b = ReasoningBudget(BudgetSpec(0, (START,), END, END[0], prefill=(3, 7)), lambda t: True)
    assert (b.state, b.forced()) == (FORCING, 8)
    # a natural end inside the budget
    b = ReasoningBudget(BudgetSpec(5, (START,), END, END[0], prefill=START), lambda t: True)
    assert _walk(b, [1, 8, 9, 2]) == [(COUNTING, None)] * 2 + [(DONE, None)] * 2


def test_utf8_completeness_is_llamacpps() -> None:
    assert utf8_complete(b"") and utf8_complete(b"abc") and utf8_complete("é".encode())
    assert not utf8_complete("é".encode()[:1]) and not utf8_complete("€".encode()[:2])
    assert utf8_complete("a€".encode()) and not utf8_complete(b"\x80\x80\x80\x80") and not utf8_complete(b"\x80")


async def test_a_budget_of_completion_is_llamacpps_token_for_token(
    numpy_server: ServeFactory, sharp_qwen3_model: Path,
) -> None:
    """/completion names its tags: the start tag is a token the free answer writes, so
    the count starts there; three tokens later the message and the end tag are forced
    and the answer goes on, exactly as llama-server's."""
    tok = Tokenizer.from_metadata(load_gguf(sharp_qwen3_model).metadata)
    prompt = plain_prompt(tok, 16, seed=2)
    body = {"prompt": prompt, "n_predict": 16, "temperature": 0, "cache_prompt": False, "return_tokens": True}
    h = await numpy_server(sharp_qwen3_model)
    async with httpx.AsyncClient(base_url=h.url, timeout=60) as c:
        free = (await c.post("/completion", json=body)).json()["tokens"]
        # a start tag: the first generated token whose text tokenizes back to it alone
        at = next(i for i, t in enumerate(free[:6]) if tok.encode(tok.decode([t]), add_special=False) == [t])
        budget = {"reasoning_budget_tokens": 3, "reasoning_budget_start_tag": tok.decode([free[at]]),
                  "reasoning_budget_end_tags": [" zebra"], "reasoning_budget_message": " stop"}
        ours = (await c.post("/completion", json={**body, **budget})).json()
    forced = tok.encode(" stop", add_special=False) + tok.encode(" zebra", add_special=False)
    assert ours["tokens"][: at + 4] == free[: at + 4]
    assert ours["tokens"][at + 4: at + 4 + len(forced)] == forced
    ref = Reference(sharp_qwen3_model, n_ctx=256)
    try:
        theirs = ref._client.post("/completion", json={**body, **budget}).json()
    finally:
        ref.close()
    assert ours["tokens"] == theirs["tokens"], (ours["tokens"], theirs["tokens"])
    assert ours["generation_settings"]["reasoning_budget_tokens"] == 3


THINKING = ("{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{%- endfor %}"
            "<|im_start|>assistant\n<think>\n")


async def test_a_chat_budget_closes_the_thought(
    numpy_server: ServeFactory, sharp_qwen3_model: Path, tmp_path: Path,
) -> None:
    """A template whose prompt opens a thought: the budget counts from the first token;
    --reasoning-budget is the default, a request's thinking_budget_tokens over it; the
    forced ``</think>`` ends the reasoning_content and the answer goes on as content."""
    template = tmp_path / "t.jinja"
    template.write_text(THINKING)
    tok = Tokenizer.from_metadata(load_gguf(sharp_qwen3_model).metadata)
    h = await numpy_server(sharp_qwen3_model, "--chat-template-file", str(template), "--reasoning-budget", "4",
                           "--reasoning-budget-message", " (enough)")
    # a random model writes pieces of characters: banned here, else the budget waits
    # for a character to finish (as llama.cpp's does) and the thought never closes
    broken = [[i, False] for i in partial_utf8_tokens(tok)]
    body = {"messages": [{"role": "user", "content": "hello there"}], "max_tokens": 20, "temperature": 0,
            "ignore_eos": True, "logit_bias": broken}
    async with httpx.AsyncClient(base_url=h.url, timeout=60) as c:
        r4 = (await c.post("/v1/chat/completions", json=body)).json()
        r2 = (await c.post("/v1/chat/completions", json={**body, "thinking_budget_tokens": 2})).json()
        # -1 is "not set": the server's budget, as llama-server
        unset = (await c.post("/v1/chat/completions", json={**body, "reasoning_budget_tokens": -1})).json()
        raw = (await c.post("/completion", json={"prompt": "x", "n_predict": 1})).json()
    assert raw["generation_settings"]["reasoning_budget_tokens"] == -1  # /completion: no tags, no budget
    for r, n in ((r4, 4), (r2, 2)):
        msg = r["choices"][0]["message"]
        thought = msg["reasoning_content"]
        assert thought.endswith("(enough)"), msg
        n_thought = len(tok.encode(thought.removesuffix(" (enough)"), add_special=False))
        assert abs(n_thought - n) <= 1, (thought, n)  # retokenizing a decoded text may merge a pair
        assert msg["content"] is not None
    assert unset["choices"][0]["message"] == r4["choices"][0]["message"]


async def test_reasoning_control_ends_a_thought_at_runtime(
    numpy_server: ServeFactory, sharp_qwen3_model: Path, tmp_path: Path,
) -> None:
    """llama-server's reasoning_control and POST /v1/chat/completions/control: a live,
    streamed completion that asked for it has its thought ended when asked (``</think>``
    forced), and its answer goes on as content; the endpoint's refusals are
    llama-server's."""
    import json

    template = tmp_path / "t.jinja"
    template.write_text(THINKING)
    tok = Tokenizer.from_metadata(load_gguf(sharp_qwen3_model).metadata)
    broken = [[i, False] for i in partial_utf8_tokens(tok)]
    h = await numpy_server(sharp_qwen3_model, "--chat-template-file", str(template))
    body = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 60, "temperature": 0,
            "ignore_eos": True, "logit_bias": broken, "stream": True, "reasoning_control": True}
    reasoning, content, cmpl_id = "", "", ""
    async with httpx.AsyncClient(base_url=h.url, timeout=60) as c:
        async with c.stream("POST", "/v1/chat/completions", json=body) as r:
            asked = False
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                cmpl_id = chunk["id"]
                delta = chunk["choices"][0]["delta"] if chunk.get("choices") else {}
                reasoning += delta.get("reasoning_content") or ""
                content += delta.get("content") or ""
                if reasoning and not asked:
                    asked = True
                    ok = (await c.post("/v1/chat/completions/control",
                                       json={"id": cmpl_id, "action": "reasoning_end"})).json()
                    assert ok == {"success": True}
        gone = (await c.post("/v1/chat/completions/control", json={"id": cmpl_id, "action": "reasoning_end"})).json()
        plain = await c.post("/v1/chat/completions", json={**body, "reasoning_control": False, "stream": False,
                                                           "max_tokens": 4})
        bad = [await c.post("/v1/chat/completions/control", json=b)
               for b in ({"action": "reasoning_end"}, {"id": cmpl_id, "action": "pause"}, [1])]
    assert reasoning and content  # the thought ended early, the answer went on
    assert len(tok.encode(reasoning, add_special=False)) < 40
    assert gone == {"success": False, "message": "no active completion for this id"}
    assert plain.status_code == 200
    assert [b.status_code for b in bad] == [400, 400, 400]
    assert "missing completion id" in bad[0].json()["error"]["message"]
    assert "unknown control action" in bad[1].json()["error"]["message"]


async def test_reasoning_control_needs_a_chat_request(
    numpy_server: ServeFactory, sharp_qwen3_model: Path,
) -> None:
    h = await numpy_server(sharp_qwen3_model)
    async with httpx.AsyncClient(base_url=h.url, timeout=60) as c:
        r = await c.post("/completion", json={"prompt": "hi", "n_predict": 1, "reasoning_control": True})
    assert r.status_code == 400 and "'reasoning_control' needs a chat request" in r.json()["error"]["message"]

"""The server end to end, in-process: real hypercorn on a loopback port, real HTTP
(httpx and the official openai client), the tiny model on the numpy backend."""

from __future__ import annotations

import json
import time
from collections.abc import Awaitable, Callable
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest
import trio

from conftest import ServeFactory
from trio_llm.config import ServerConfig
from trio_llm.engine.generate import generate_tokens
from trio_llm.engine.reference import NumpyBackend
from trio_llm.engine.sampling import SamplingParams
from trio_llm.model.gguf import load_gguf
from trio_llm.model.tokenizer import Tokenizer
from trio_llm.runtime import ServerHandle, _serve_http
from trio_llm.server.context import ServerContext
from trio_llm.server.http import create_app

Start = Callable[..., Awaitable[ServerHandle]]

PROMPT = "The quick brown fox jumps over the lazy dog"


@pytest.fixture
def start(serve_config: ServeFactory, tiny_model: Path) -> Start:
    """Factory: start a server (tiny model, numpy, port 0) and wait until it is loaded;
    a graceful shutdown at the end ends serve() by itself, well within its grace period."""

    def go(**overrides: Any) -> Awaitable[ServerHandle]:
        kw: dict[str, Any] = {
            "model": tiny_model, "port": 0, "backend": "numpy", "ctx_size": 1024,
            "parallel": 2, "shutdown_timeout": 2.0, "temp": 0.0,
        } | overrides
        return serve_config(ServerConfig(**kw))

    return go


def client(handle: ServerHandle, **kw: Any) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=handle.url, timeout=60, **kw)


def sse_events(text: str) -> list[Any]:
    out = []
    for line in text.splitlines():
        if line.startswith("data: "):
            payload = line[6:]
            out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out


@pytest.fixture(scope="module")
def reference(tiny_model: Path) -> tuple[NumpyBackend, Tokenizer]:
    model = load_gguf(tiny_model)
    return NumpyBackend(model, n_ctx=512, n_seq=1), Tokenizer.from_metadata(model.metadata)


# -- state endpoints ------------------------------------------------------------------------


async def test_state_endpoints(start: Start) -> None:
    h = await start(metrics=True, alias="tiny-test")
    async with client(h) as c:
        r = await c.get("/health")
        assert r.status_code == 200 and r.json() == {"status": "ok"}
        models = (await c.get("/v1/models")).json()
        assert models["data"][0]["id"] == "tiny-test"
        assert models["data"][0]["meta"]["n_vocab"] == 1024
        assert (await c.get("/models")).json() == models
        props = (await c.get("/props")).json()
        assert props["total_slots"] == 2
        assert props["default_generation_settings"]["n_ctx"] == 512
        assert props["model_path"].endswith(".gguf")
        assert props["is_sleeping"] is False
        assert props["residency"]["state"] == "resident"
        assert "<|start_header_id|>" in props["chat_template"]
        assert isinstance(props["device"], dict)
        slots = (await c.get("/slots")).json()
        assert [s["id"] for s in slots] == [0, 1] and not any(s["is_processing"] for s in slots)
        await c.post("/completion", json={"prompt": PROMPT, "n_predict": 4})
        r = await c.get("/metrics")
        assert r.status_code == 200
        text = r.text
        for name in ("llamacpp:prompt_tokens_total", "llamacpp:tokens_predicted_total",
                     "llamacpp:requests_processing", "llamacpp:requests_deferred"):
            assert name in text
        assert "llamacpp:tokens_predicted_total 4.0" in text
        assert "llamacpp:prompt_tokens_cached_total 0.0" in text
        assert 0 < int(r.headers["Process-Start-Time-Unix"]) <= time.time()
        # the same prompt again: all but its last token come from the slot's cache,
        # counted apart from the evaluated ones, as llama-server
        again = (await c.post("/completion", json={"prompt": PROMPT, "n_predict": 4})).json()["timings"]
        assert again["cache_n"] > 0
        text = (await c.get("/metrics")).text
        assert f"llamacpp:prompt_tokens_cached_total {float(again['cache_n'])}" in text
        assert "llamacpp:spec_decode_num_drafts_total 0.0" in text
        r = await c.get("/nope")
        assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"


async def test_health_is_503_while_loading() -> None:
    config = ServerConfig(port=0)
    stop, done = trio.Event(), trio.Event()
    async with trio.open_nursery() as n:
        binds = await n.start(_serve_http, create_app(ServerContext(config)), config, stop, done)
        async with httpx.AsyncClient(base_url=binds[0]) as c:
            r = await c.get("/health")
            assert r.status_code == 503
            assert r.json()["error"]["message"] == "Loading model"
            assert (await c.post("/completion", json={"prompt": "x"})).status_code == 503
        stop.set()


async def test_metrics_are_off_without_the_flag(start: Start) -> None:
    h = await start()
    async with client(h) as c:
        r = await c.get("/metrics")
        assert r.status_code == 501 and r.json()["error"]["type"] == "not_supported_error"


# -- generation -------------------------------------------------------------------------------


async def test_greedy_completion_equals_the_engine(start: Start, reference: tuple[NumpyBackend, Tokenizer]) -> None:
    backend, tok = reference
    prompt = tok.encode(PROMPT)
    expected = generate_tokens(backend, tok, prompt, 12, SamplingParams(temperature=0.0), np.random.default_rng(0))
    h = await start()
    async with client(h) as c:
        r = await c.post("/completion", json={"prompt": PROMPT, "n_predict": 12, "temperature": 0,
                                               "return_tokens": True})
        body = r.json()
    assert r.status_code == 200
    assert body["tokens"] == expected
    assert body["content"] == tok.decode(body["tokens"])
    assert body["stop"] is True and body["stop_type"] in ("limit", "eos")
    t = body["timings"]
    assert t["prompt_n"] == len(prompt) and t["cache_n"] == 0
    assert t["predicted_n"] == len(body["tokens"])

    async with client(h) as c:
        r = await c.post("/completion", json={"prompt": PROMPT, "n_predict": 12, "temperature": 0, "n_probs": 3})
    probs = r.json()["completion_probabilities"]
    assert [p["id"] for p in probs] == expected
    for p in probs:  # greedy: the chosen token is the most likely one
        assert len(p["top_logprobs"]) == 3 and p["top_logprobs"][0]["id"] == p["id"]
        assert p["logprob"] == p["top_logprobs"][0]["logprob"] <= 0
        assert bytes(p["bytes"]) == tok.token_to_piece(p["id"])


async def test_streaming_matches_the_whole_answer_and_token_lists_work(start: Start) -> None:
    h = await start()
    async with client(h) as c:
        whole = (await c.post("/completion", json={"prompt": PROMPT, "n_predict": 10, "return_tokens": True})).json()
        r = await c.post("/completion", json={"prompt": PROMPT, "n_predict": 10, "stream": True, "cache_prompt": False})
        assert r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r.text)
        ids = (await c.post("/tokenize", json={"content": PROMPT, "add_special": True})).json()["tokens"]
        by_ids = (await c.post("/completion", json={"prompt": ids, "n_predict": 10, "return_tokens": True})).json()
    assert events[-1]["stop"] is True and all(e["stop"] is False for e in events[:-1])
    assert "".join(e["content"] for e in events) == whole["content"]
    assert [e["tokens"][0] for e in events[:-1]] == whole["tokens"]
    assert by_ids["tokens"] == whole["tokens"]


async def test_prompt_cache_reuses_the_common_prefix(start: Start) -> None:
    h = await start(parallel=1)
    async with client(h) as c:
        first = (await c.post("/completion", json={"prompt": PROMPT, "n_predict": 4})).json()
        longer = PROMPT + " and runs away"
        second = (await c.post("/completion", json={"prompt": longer, "n_predict": 4, "return_tokens": True})).json()
        fresh = (await c.post("/completion", json={"prompt": longer, "n_predict": 4, "cache_prompt": False,
                                                    "return_tokens": True})).json()
        again = (await c.post("/completion", json={"prompt": longer, "n_predict": 4})).json()
    n_first = first["tokens_evaluated"]
    assert first["timings"]["cache_n"] == 0
    assert second["timings"]["cache_n"] == n_first  # the whole first prompt was reused
    assert second["timings"]["prompt_n"] == second["tokens_evaluated"] - n_first
    assert fresh["timings"]["cache_n"] == 0
    assert second["tokens"] == fresh["tokens"]  # reuse does not change the answer
    # everything cached: only the last prompt token is evaluated again
    assert again["timings"]["cache_n"] == again["tokens_evaluated"] - 1
    assert again["timings"]["prompt_n"] == 1


async def test_requests_go_to_the_slot_with_the_best_prefix(start: Start) -> None:
    h = await start(parallel=2)
    async with client(h) as c:
        a = (await c.post("/completion", json={"prompt": "alpha beta gamma delta", "n_predict": 2})).json()
        b = (await c.post("/completion", json={"prompt": "zeta eta theta iota", "n_predict": 2})).json()
        assert a["id_slot"] != b["id_slot"]  # the least recently used slot takes a new prompt
        a2 = (await c.post("/completion", json={"prompt": "alpha beta gamma delta epsilon", "n_predict": 2})).json()
        b2 = (await c.post("/completion", json={"prompt": "zeta eta theta iota kappa", "n_predict": 2})).json()
    assert (a2["id_slot"], b2["id_slot"]) == (a["id_slot"], b["id_slot"])
    assert a2["timings"]["cache_n"] > 0 and b2["timings"]["cache_n"] > 0


async def test_stop_words_cut_the_content(start: Start) -> None:
    h = await start()
    async with client(h) as c:
        free = (await c.post("/completion", json={"prompt": PROMPT, "n_predict": 16})).json()
        text = free["content"]
        word = text[len(text) // 2 : len(text) // 2 + 2]
        assert word.strip()
        cut = (await c.post("/completion", json={"prompt": PROMPT, "n_predict": 16, "stop": [word]})).json()
        r = await c.post("/completion", json={"prompt": PROMPT, "n_predict": 16, "stop": [word], "stream": True})
    assert cut["stop_type"] == "word" and cut["stopping_word"] == word
    assert cut["content"] == text[: text.index(word)]
    streamed = "".join(e["content"] for e in sse_events(r.text))
    assert streamed == cut["content"]


async def test_more_requests_than_slots_are_queued_not_dropped(start: Start) -> None:
    h = await start(parallel=2, metrics=True)
    prompts = [f"{PROMPT} number {i}" for i in range(6)]
    results: dict[int, Any] = {}
    async with client(h) as c:
        alone = [(await c.post("/completion", json={"prompt": p, "n_predict": 6, "cache_prompt": False,
                                                     "return_tokens": True})).json()
                 for p in prompts[:2]]

        async def one(i: int) -> None:
            r = await c.post("/completion", json={"prompt": prompts[i], "n_predict": 6, "stream": i % 2 == 1,
                                                   "return_tokens": True})
            assert r.status_code == 200
            results[i] = r

        async with trio.open_nursery() as n:
            for i in range(6):
                n.start_soon(one, i)
        metrics = (await c.get("/metrics")).text
    assert len(results) == 6
    assert results[0].json()["tokens"] == alone[0]["tokens"]  # batching does not change answers
    assert "".join(e["content"] for e in sse_events(results[1].text)) == alone[1]["content"]
    stats = h.context.engine.slots.statistics() if h.context.engine else None
    assert stats is not None and stats.n_tasks_done == 8
    assert stats.n_busy_slots_total > stats.n_decode  # some passes carried two slots
    assert "llamacpp:requests_deferred 0.0" in metrics


async def test_a_client_that_disconnects_frees_its_slot(start: Start) -> None:
    h = await start(parallel=1, ctx_size=4096)
    body = {"prompt": PROMPT, "n_predict": 3000, "ignore_eos": True, "stream": True}
    async with client(h) as c:
        async with c.stream("POST", "/completion", json=body) as r:
            lines = r.aiter_lines()
            got = 0
            async for line in lines:
                got += line.startswith("data: ")
                if got == 3:
                    break
            slots = (await c.get("/slots")).json()
            assert slots[0]["is_processing"] is True
        # the stream is closed; the one slot must be free long before 3000 tokens
        with trio.fail_after(20):
            r2 = await c.post("/completion", json={"prompt": "hello", "n_predict": 2})
        assert r2.status_code == 200
        slots = (await c.get("/slots")).json()
    assert slots[0]["is_processing"] is False
    engine = h.context.engine
    assert engine is not None and engine.slots.statistics().n_tasks_cancelled == 1


async def test_a_client_that_disconnects_frees_every_choice_slot(start: Start) -> None:
    """A streamed request of two prompts x n=2 takes four slots; closing the stream
    cancels all four tasks and frees every slot."""
    h = await start(parallel=4, ctx_size=4096)
    body = {"prompt": [PROMPT, "another prompt"], "max_tokens": 3000, "n": 2, "stream": True,
            "ignore_eos": True}
    async with client(h) as c:
        async with c.stream("POST", "/v1/completions", json=body) as r:
            got = 0
            async for line in r.aiter_lines():
                got += line.startswith("data: ")
                if got == 8:
                    break
            slots = (await c.get("/slots")).json()
            assert [s["is_processing"] for s in slots] == [True] * 4
        engine = h.context.engine
        assert engine is not None
        await wait_for(lambda: engine.slots.statistics().n_tasks_cancelled == 4)
        slots = (await c.get("/slots")).json()
    assert [s["is_processing"] for s in slots] == [False] * 4


async def wait_for(predicate: Callable[[], bool]) -> None:
    """Wait for server state that a real socket event will bring about."""
    with trio.fail_after(20):
        while not predicate():
            await trio.sleep(0.01)


async def test_a_client_that_leaves_while_queued_is_dropped_from_the_queue(start: Start) -> None:
    h = await start(parallel=1, ctx_size=4096)
    assert h.context.engine is not None
    queue, slots = h.context.engine.queue, h.context.engine.slots
    busy = {"prompt": PROMPT, "n_predict": 3000, "ignore_eos": True, "stream": True}
    async with client(h) as c:
        async with c.stream("POST", "/completion", json=busy) as r:
            lines = r.aiter_lines()  # kept: dropping the iterator would close the stream
            await lines.__anext__()  # the one slot is generating
            async with trio.open_nursery() as n:
                n.start_soon(partial(c.post, "/completion", json={"prompt": "queued", "n_predict": 2}))
                await wait_for(lambda: queue.statistics().n_deferred == 1)
                n.cancel_scope.cancel()  # the queued client gives up and disconnects
            await wait_for(lambda: queue.statistics().n_deferred == 0)
            assert queue.statistics().cancelled == 1
            assert (await c.get("/slots")).json()[0]["is_processing"] is True  # untouched
        # and now the stream's task, by whichever path sees the client gone first
        await wait_for(lambda: slots.statistics().n_tasks_cancelled == 1)
    assert queue.statistics().n_active == 0 and slots.statistics().n_processing == 0


# -- OpenAI API -----------------------------------------------------------------------------


async def test_openai_client_chat_completions_and_models(start: Start) -> None:
    h = await start(alias="tiny")
    oai = openai.AsyncOpenAI(base_url=h.url + "/v1", api_key="none", max_retries=0)
    models = await oai.models.list()
    assert [m.id for m in models.data] == ["tiny"]
    messages: Any = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]
    chat = await oai.chat.completions.create(model="whatever", messages=messages, max_tokens=8, temperature=0,
                                             logprobs=True, top_logprobs=3)
    choice = chat.choices[0]
    assert choice.finish_reason in ("stop", "length")
    assert chat.usage is not None and chat.usage.completion_tokens <= 8
    assert choice.logprobs is not None and choice.logprobs.content is not None
    assert all(len(lp.top_logprobs) == 3 for lp in choice.logprobs.content)
    assert all(lp.logprob <= 0 for lp in choice.logprobs.content)

    stream = await oai.chat.completions.create(model="x", messages=messages, max_tokens=8, temperature=0,
                                               stream=True, stream_options={"include_usage": True})
    parts, finish, usage = [], None, None
    async for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for ch in chunk.choices:
            parts.append(ch.delta.content or "")
            finish = ch.finish_reason or finish
    assert "".join(parts) == choice.message.content
    assert finish == choice.finish_reason
    assert usage is not None and usage.prompt_tokens == chat.usage.prompt_tokens

    comp = await oai.completions.create(model="x", prompt=PROMPT, max_tokens=6, temperature=0, logprobs=2)
    assert comp.choices[0].logprobs is not None and len(comp.choices[0].logprobs.tokens or []) == comp.usage.completion_tokens  # type: ignore[union-attr]
    text = ""
    async for chunk in await oai.completions.create(model="x", prompt=PROMPT, max_tokens=6, temperature=0, stream=True):
        text += chunk.choices[0].text if chunk.choices else ""
    assert text == comp.choices[0].text
    await oai.close()


async def test_chat_stream_ends_with_done(start: Start) -> None:
    h = await start()
    async with client(h) as c:
        r = await c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                       "max_tokens": 3, "stream": True})
        rendered = (await c.post("/apply-template", json={"messages": [{"role": "user", "content": "hi"}]})).json()
    events = sse_events(r.text)
    assert events[-1] == "[DONE]"
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"
    assert events[-2]["choices"][0]["finish_reason"] in ("stop", "length")
    assert rendered["prompt"].endswith("<|start_header_id|>assistant<|end_header_id|>\n\n")


async def test_return_progress_and_timings_per_token(start: Start) -> None:
    """llama-server's stream extras: with ``return_progress`` a ``prompt_progress``
    report before the prompt's first pass (processed == cache) and after each pass (the
    last one complete), on /completion and chat; with ``timings_per_token`` every event
    carries ``timings``, which never go backwards."""
    h = await start(parallel=1, batch_size=8)
    prompt = PROMPT + " again and again"
    async with client(h) as c:
        n = len((await c.post("/tokenize", json={"content": prompt, "add_special": True})).json()["tokens"])
        r = await c.post("/completion", json={"prompt": prompt, "n_predict": 3, "stream": True,
                                              "return_progress": True, "timings_per_token": True})
        events = sse_events(r.text)
        # the same prompt again: all but the last token cached, one pass
        again = sse_events((await c.post("/completion", json={"prompt": prompt, "n_predict": 3, "stream": True,
                                                                "return_progress": True})).text)
        chat = sse_events((await c.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": prompt}], "max_tokens": 3, "stream": True,
            "return_progress": True, "timings_per_token": True, "stream_options": {"include_usage": True}})).text)
        plain = sse_events((await c.post("/completion", json={"prompt": prompt, "n_predict": 3,
                                                                "stream": True})).text)
    progress = [e["prompt_progress"] for e in events if "prompt_progress" in e]
    assert progress[0] == {"total": n, "cache": 0, "processed": 0, "time_ms": progress[0]["time_ms"]}
    assert [p["processed"] for p in progress] == [*range(0, n, 8), n]  # one report per pass of -b 8
    assert all(p["total"] == n and p["cache"] == 0 for p in progress)
    assert all(e["tokens"] == [] and e["content"] == "" for e in events if "prompt_progress" in e)
    assert all("timings" in e for e in events)
    first = events[0]["timings"]
    assert (first["prompt_n"], first["prompt_ms"], first["predicted_n"], first["predicted_ms"]) == (0, 0.0, 0, 0.0)
    ms = [e["timings"]["prompt_ms"] for e in events]
    assert ms == sorted(ms) and ms[-1] > 0
    assert [e["timings"]["prompt_n"] for e in events if "prompt_progress" in e] == [p["processed"] for p in progress]
    tokens = [e for e in events if "prompt_progress" not in e and not e["stop"]]
    assert [e["timings"]["predicted_n"] for e in tokens] == list(range(1, len(tokens) + 1))
    assert [e["prompt_progress"] for e in again if "prompt_progress" in e] == [
        {"total": n, "cache": n - 1, "processed": n - 1, "time_ms": again[0]["prompt_progress"]["time_ms"]},
        {"total": n, "cache": n - 1, "processed": n, "time_ms": again[1]["prompt_progress"]["time_ms"]}]
    assert all("timings" not in e for e in again[:-1]) and "timings" in again[-1]
    # chat: a report is a role delta; the first event is the first report; timings on
    # every event (the final ones: on the usage chunk, the last before [DONE])
    assert chat[-1] == "[DONE]"
    reports = [e for e in chat[:-1] if "prompt_progress" in e]
    assert chat[0] is reports[0] and reports[-1]["prompt_progress"]["processed"] == reports[-1]["prompt_progress"]["total"]
    assert all(e["choices"][0]["delta"] == {"role": "assistant", "content": None} for e in reports)
    assert all("timings" in e for e in chat[:-1] if e["choices"] and e["choices"][0]["delta"])
    assert chat[-2]["choices"] == [] and chat[-2]["timings"]["predicted_n"] <= 3
    assert "timings" not in chat[-3]  # the finish chunk: the timings went to the usage chunk
    assert not any("prompt_progress" in e or "timings" in e for e in plain[:-1])


async def test_continue_final_message_and_verbose(start: Start) -> None:
    """vLLM's ``continue_final_message`` continues the last assistant message (the
    prompt ends with its text), and with ``add_generation_prompt`` left true it is a
    400, as llama-server; ``verbose`` (default on with -v) adds llama-server's
    ``__verbose``: the native answer with the prompt as text; /completion's answer
    always holds the prompt."""
    h = await start()
    msgs = [{"role": "user", "content": "What is the best book"}, {"role": "assistant", "content": "Whill"}]
    async with client(h) as c:
        r = await c.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 3, "add_generation_prompt": False,
                                                       "continue_final_message": True, "verbose": True})
        assert r.status_code == 200, r.text
        verbose = r.json()["__verbose"]
        assert verbose["prompt"].endswith("What is the best book<|eot_id|><|start_header_id|>assistant"
                                          "<|end_header_id|>\n\nWhill")
        assert verbose["tokens_predicted"] == r.json()["usage"]["completion_tokens"]
        # the prefill heuristic (no switch), the last message as text parts: joined, then continued
        parts = [msgs[0], {"role": "assistant", "content": [{"type": "text", "text": "Wh"}, {"type": "text", "text": "ill"}]}]
        r = await c.post("/v1/chat/completions", json={"messages": parts, "max_tokens": 2, "verbose": True})
        assert r.json()["__verbose"]["prompt"].endswith("<|end_header_id|>\n\nWh\nill")
        r = await c.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 3,
                                                       "continue_final_message": True})
        assert r.status_code == 400 and "add_generation_prompt" in r.json()["error"]["message"]
        plain = await c.post("/v1/chat/completions", json={"messages": msgs[:1], "max_tokens": 2})
        assert plain.status_code == 200 and "__verbose" not in plain.json()
        bad = await c.post("/v1/chat/completions", json={"messages": msgs[:1], "max_tokens": 2, "verbose": "yes"})
        assert bad.status_code == 400 and "'verbose'" in bad.json()["error"]["message"]
        native = (await c.post("/completion", json={"prompt": PROMPT, "n_predict": 2})).json()
        assert native["prompt"].endswith(PROMPT)
    h2 = await start(verbose=True)
    async with client(h2) as c:
        r = await c.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2})
        assert r.json()["__verbose"]["prompt"].endswith(PROMPT)


# -- tokens ----------------------------------------------------------------------------------------


async def test_tokenize_and_detokenize(start: Start, reference: tuple[NumpyBackend, Tokenizer]) -> None:
    _, tok = reference
    h = await start()
    async with client(h) as c:
        ids = (await c.post("/tokenize", json={"content": "héllo world"})).json()["tokens"]
        assert ids == tok.encode("héllo world", add_special=False)
        pieces = (await c.post("/tokenize", json={"content": "hi", "with_pieces": True})).json()["tokens"]
        assert [p["id"] for p in pieces] == tok.encode("hi", add_special=False)
        back = (await c.post("/detokenize", json={"tokens": ids})).json()
        assert back["content"] == "héllo world"
        r = await c.post("/detokenize", json={"tokens": [99999]})
        assert r.status_code == 400 and "outside the vocabulary" in r.json()["error"]["message"]


# -- bad input and auth ------------------------------------------------------------------------------


async def test_bad_input_is_a_400_and_does_not_disturb_other_requests(start: Start) -> None:
    h = await start(parallel=1, ctx_size=256)
    async with client(h) as c:
        good: dict[str, Any] = {}

        async def long_request() -> None:
            good["r"] = await c.post("/completion", json={"prompt": PROMPT, "n_predict": 40, "ignore_eos": True,
                                                           "return_tokens": True})

        async with trio.open_nursery() as n:
            n.start_soon(long_request)
            cases: list[tuple[str, Any, int, str]] = [
                ("/completion", b"{not json", 400, "not valid JSON"),
                ("/completion", b"", 400, "empty"),
                ("/completion", {"prompt": "x", "n_predict": "many"}, 400, "'n_predict'"),
                ("/completion", {"prompt": "x", "temperature": -2}, 400, "'temperature'"),
                ("/completion", {"prompt": "x", "top_k": 1.5}, 400, "'top_k'"),
                ("/completion", {"prompt": list(range(300))}, 400, "256"),
                ("/completion", {"prompt": "word " * 400}, 400, "context"),
                ("/v1/chat/completions", {"messages": "hi"}, 400, "'messages'"),
                ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "n": 3}, 400, "'n'"),
                ("/v1/completions", {"prompt": "x", "max_tokens": -7}, 400, "'max_tokens'"),
                ("/tokenize", {"content": 5}, 400, "'content'"),
            ]
            for path, payload, status, needle in cases:
                if isinstance(payload, bytes):
                    r = await c.post(path, content=payload, headers={"content-type": "application/json"})
                else:
                    r = await c.post(path, json=payload)
                assert r.status_code == status, (path, payload, r.text)
                err = r.json()["error"]
                assert needle in err["message"] and err["code"] == status and err["type"]
            r = await c.get("/completion")
            assert r.status_code == 405 and "error" in r.json()
        overflow = (await c.post("/completion", json={"prompt": "word " * 400})).json()["error"]
    assert overflow["type"] == "exceed_context_size_error" and overflow["n_ctx"] == 256
    assert good["r"].status_code == 200 and len(good["r"].json()["tokens"]) == 40


async def test_api_key_protects_everything_but_health(start: Start) -> None:
    h = await start(api_key="sekrit", metrics=True)
    async with client(h) as c:
        assert (await c.get("/health")).status_code == 200
        for path in ("/props", "/v1/models", "/metrics", "/slots"):
            r = await c.get(path)
            assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        r = await c.post("/completion", json={"prompt": "x", "n_predict": 1}, headers={"Authorization": "Bearer nope"})
        assert r.status_code == 401
        r = await c.post("/completion", json={"prompt": "x", "n_predict": 1}, headers={"Authorization": "Bearer sekrit"})
        assert r.status_code == 200
    oai = openai.AsyncOpenAI(base_url=h.url + "/v1", api_key="sekrit", max_retries=0)
    assert (await oai.models.list()).data
    await oai.close()


async def test_n_choices_through_the_openai_client(start: Start) -> None:
    """OpenAI's ``n``: with a fixed seed and sampling, each choice draws its own stream
    (seed + i), and each one equals the single-choice answer for its seed; greedy
    choices are identical; streamed, the chunks of the choices interleave by index,
    each ends with its finish_reason, and usage counts the prompt once and every
    choice's tokens. More choices than slots is a 400."""
    h = await start(parallel=3, temp=1.0)
    oai = openai.AsyncOpenAI(base_url=h.url + "/v1", api_key="none", max_retries=0)
    msgs = [{"role": "user", "content": "tell me"}]
    try:
        many = await oai.chat.completions.create(model="m", messages=msgs, max_tokens=12, n=3, seed=40)
        assert [c.index for c in many.choices] == [0, 1, 2]
        texts = [c.message.content for c in many.choices]
        n_tokens = 0
        for i, text in enumerate(texts):  # choice i is what seed 40 + i gives alone
            one = await oai.chat.completions.create(model="m", messages=msgs, max_tokens=12, seed=40 + i)
            assert one.choices[0].message.content == text
            n_tokens += one.usage.completion_tokens
            assert one.usage.prompt_tokens == many.usage.prompt_tokens  # the prompt counted once
        assert len(set(texts)) > 1, texts  # random weights, temperature 1: distinct draws
        assert many.usage.completion_tokens == n_tokens
        greedy = await oai.completions.create(model="m", prompt="once upon", max_tokens=8, n=2, temperature=0)
        assert greedy.choices[0].text == greedy.choices[1].text
        stream = await oai.chat.completions.create(model="m", messages=msgs, max_tokens=12, n=3, seed=40, stream=True,
                                                   stream_options={"include_usage": True})
        parts: dict[int, str] = {0: "", 1: "", 2: ""}
        finished: dict[int, str] = {}
        usage = None
        async for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
            for c in chunk.choices:
                assert c.index not in finished, "a chunk after its choice's finish"
                parts[c.index] += c.delta.content or ""
                if c.finish_reason is not None:
                    finished[c.index] = c.finish_reason
        assert [parts[i] for i in range(3)] == texts
        assert sorted(finished) == [0, 1, 2]
        assert usage is not None and usage.completion_tokens == many.usage.completion_tokens
        with pytest.raises(openai.BadRequestError):
            await oai.chat.completions.create(model="m", messages=msgs, max_tokens=2, n=4)
        # every choice pinned to one slot: they run there in turn, twice over (the
        # second request reuses the cache), and equal the unpinned choices
        for _ in range(2):
            pinned = await oai.chat.completions.create(model="m", messages=msgs, max_tokens=12, n=3, seed=40,
                                                       extra_body={"id_slot": 0})
            assert [c.message.content for c in pinned.choices] == texts
    finally:
        await oai.close()


async def test_several_prompts_in_one_openai_completion(start: Start) -> None:
    """/v1/completions with a list of prompts (text and token ids): the choices come n
    per prompt in order, each equal to that prompt's own answer, usage counts each
    prompt once; streamed the same; more tasks than slots is a 400."""
    h = await start(parallel=4)
    oai = openai.AsyncOpenAI(base_url=h.url + "/v1", api_key="none", max_retries=0)
    try:
        prompts: list[Any] = ["once upon a time", [5, 6, 7, 8, 9]]
        alone = [await oai.completions.create(model="m", prompt=p, max_tokens=6) for p in prompts]
        both = await oai.completions.create(model="m", prompt=prompts, max_tokens=6, n=2)
        assert [c.index for c in both.choices] == [0, 1, 2, 3]
        assert [c.text for c in both.choices] == [a.choices[0].text for a in alone for _ in range(2)]
        assert both.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)
        assert both.usage.completion_tokens == 2 * sum(a.usage.completion_tokens for a in alone)
        stream = await oai.completions.create(model="m", prompt=prompts, max_tokens=6, stream=True,
                                              stream_options={"include_usage": True})
        texts = ["", ""]
        usage = None
        async for chunk in stream:
            usage = chunk.usage or usage
            for c in chunk.choices:
                texts[c.index] += c.text
        assert texts == [a.choices[0].text for a in alone]
        assert usage is not None and usage.prompt_tokens == both.usage.prompt_tokens
        with pytest.raises(openai.BadRequestError, match="slots"):
            await oai.completions.create(model="m", prompt=prompts, max_tokens=2, n=3)
    finally:
        await oai.close()


async def test_several_prompts_on_the_native_endpoint(start: Start) -> None:
    """/completion with a list of prompts answers with a list, as llama-server does,
    each entry (with its index) equal to that prompt's own answer; streamed, every
    event carries its prompt's index."""
    h = await start(parallel=2)
    prompts: list[Any] = ["once upon a time", [5, 6, 7, 8, 9]]
    async with client(h) as c:
        alone = [(await c.post("/completion", json={"prompt": p, "n_predict": 6, "return_tokens": True})).json()
                 for p in prompts]
        r = await c.post("/completion", json={"prompt": prompts, "n_predict": 6, "return_tokens": True})
        assert r.status_code == 200
        both = r.json()
        assert [a["index"] for a in both] == [0, 1]
        assert [a["content"] for a in both] == [a["content"] for a in alone]
        assert [a["tokens"] for a in both] == [a["tokens"] for a in alone]
        r = await c.post("/completion", json={"prompt": prompts, "n_predict": 6, "stream": True})
        texts = ["", ""]
        for event in sse_events(r.text):
            texts[event["index"]] += event["content"]
        assert texts == [a["content"] for a in alone]
        r = await c.post("/completion", json={"prompt": ["a", "b", "c"], "n_predict": 2})
        assert r.status_code == 400 and "slots" in r.json()["error"]["message"]


async def test_slot_save_erase_restore(start: Start, tmp_path: Path) -> None:
    """llama-server's slot actions: a slot's cache saved to a file, erased, restored
    into the same slot and into another one; each restored slot then reuses the whole
    prompt (cache_n) and answers exactly as before. Bad names, missing or corrupt
    files, unknown actions and slots are 400s; save without --slot-save-path is 501."""
    h = await start(parallel=2, slot_save_path=tmp_path)
    body = {"prompt": PROMPT, "n_predict": 8, "id_slot": 0, "return_tokens": True}
    async with client(h) as c:
        first = (await c.post("/completion", json=body)).json()
        r = await c.post("/slots/0?action=save", json={"filename": "s0.bin"})
        assert r.status_code == 200, r.text
        saved = r.json()
        assert saved["id_slot"] == 0 and saved["filename"] == "s0.bin"
        assert saved["n_saved"] == first["tokens_cached"] > 0 and saved["n_written"] == (tmp_path / "s0.bin").stat().st_size
        erased = (await c.post("/slots/0?action=erase")).json()
        assert erased == {"id_slot": 0, "n_erased": saved["n_saved"]}
        assert (await c.get("/slots")).json()[0]["n_cached"] == 0
        for slot in (0, 1):
            r = await c.post(f"/slots/{slot}?action=restore", json={"filename": "s0.bin"})
            assert r.status_code == 200 and r.json()["n_restored"] == saved["n_saved"], r.text
            again = (await c.post("/completion", json=body | {"id_slot": slot})).json()
            assert again["content"] == first["content"] and again["tokens"] == first["tokens"]
            assert again["timings"]["cache_n"] == first["tokens_evaluated"] - 1  # only the last prompt token ran
        (tmp_path / "junk.bin").write_bytes(b"not a slot file")
        for path, payload, needle in [
            ("/slots/0?action=save", {"filename": "../escape.bin"}, "filename"),
            ("/slots/0?action=save", {"filename": ".hidden"}, "filename"),
            ("/slots/0?action=save", {"name": "x"}, "filename"),
            ("/slots/0?action=restore", {"filename": "missing.bin"}, "missing.bin"),
            ("/slots/0?action=restore", {"filename": "junk.bin"}, "not a slot file"),
            ("/slots/0?action=dance", {"filename": "x"}, "action"),
            ("/slots/7?action=erase", {}, "no slot 7"),
        ]:
            r = await c.post(path, json=payload)
            assert r.status_code == 400 and needle in r.json()["error"]["message"], (path, r.text)
        assert not (tmp_path.parent / "escape.bin").exists()
    h2 = await start(parallel=1)
    async with client(h2) as c:
        r = await c.post("/slots/0?action=save", json={"filename": "x.bin"})
        assert r.status_code == 501 and "--slot-save-path" in r.json()["error"]["message"]
        assert (await c.post("/slots/0?action=erase")).status_code == 200


async def test_cors_preflight_and_origin_headers(start: Start) -> None:
    """A browser front end on another origin: the preflight is answered without the
    key (browsers send none), every answer (a refusal, a stream) echoes the origin,
    and a request without Origin gets no CORS headers."""
    h = await start(api_key="sekrit")
    origin = "http://localhost:5173"
    async with client(h) as c:
        r = await c.options("/v1/chat/completions", headers={
            "Origin": origin, "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, content-type"})
        assert r.status_code == 200  # llama-server's answer to a preflight, and its headers
        assert r.headers["access-control-allow-origin"] == origin
        assert r.headers["access-control-allow-methods"] == "GET, POST, DELETE, OPTIONS"
        assert r.headers["access-control-allow-headers"] == "*"
        r = await c.get("/props", headers={"Origin": origin})
        assert r.status_code == 401 and r.headers["access-control-allow-origin"] == origin
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": True}
        r = await c.post("/v1/chat/completions", json=body,
                         headers={"Origin": origin, "Authorization": "Bearer sekrit"})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == origin
        assert r.headers["access-control-allow-credentials"] == "true"
        assert sse_events(r.text)[-1] == "[DONE]"
        r = await c.get("/health")
        assert r.status_code == 200 and "access-control-allow-origin" not in r.headers


async def test_sleep_endpoints_without_any_sleep_flag(start: Start) -> None:
    """No --sleep-idle-seconds, no arena: POST /sleep and /wake_up still work (vLLM's
    names), a bad level is refused, and a request after a sleep wakes the model."""
    h = await start()
    async with client(h) as c:
        r = await c.post("/sleep?level=deep")
        assert r.status_code == 400
        r = await c.post("/sleep?level=all")
        assert r.status_code == 200
        props = (await c.get("/props")).json()
        assert props["is_sleeping"] is True and props["residency"]["state"] == "cold"
        r = await c.post("/wake_up")
        assert r.status_code == 200 and r.json()["is_sleeping"] is False
        await c.post("/sleep")
        assert (await c.get("/props")).json()["is_sleeping"] is True
        r = await c.post("/completion", json={"prompt": "x", "n_predict": 2, "temperature": 0})
        assert r.status_code == 200 and r.json()["tokens_predicted"] == 2
        assert (await c.get("/props")).json()["residency"]["state"] == "resident"


async def test_prompt_cache_across_sleep_levels(start: Start) -> None:
    """A release that keeps the KV cache keeps the prompt cache; an unload destroys
    it, and the slots loop notices (the gate's kv_epoch) instead of reusing garbage."""
    h = await start(parallel=1, sleep_idle_seconds=3600)
    body = {"prompt": PROMPT, "n_predict": 6, "return_tokens": True}
    async with client(h) as c:
        first = (await c.post("/completion", json=body)).json()
        for level, cached in (("weights", True), ("all", True), ("unload", False)):
            r = await c.post(f"/sleep?level={level}")
            assert r.status_code == 200 and r.json()["is_sleeping"] is True
            assert (await c.get("/props")).json()["is_sleeping"] is True
            again = (await c.post("/completion", json=body)).json()
            assert again["tokens"] == first["tokens"], level
            assert (again["timings"]["cache_n"] > 0) is cached, level


async def test_read_only_endpoints_answer_while_asleep_and_do_not_wake(start: Start) -> None:
    """/health, /props, /v1/models, /models, /metrics and /slots answer a sleeping
    server (at every level) and leave it asleep; the next completion wakes it."""
    h = await start(parallel=1, metrics=True)
    read_only = ["/health", "/props", "/v1/models", "/models", "/metrics", "/slots"]
    async with client(h) as c:
        for level in ("weights", "all", "unload"):
            assert (await c.post(f"/sleep?level={level}")).status_code == 200
            before = (await c.get("/props")).json()["residency"]
            assert before["state"] in ("cold", "unloaded"), before
            for _ in range(3):
                for path in read_only:
                    r = await c.get(path)
                    assert r.status_code == 200, (path, r.text)
            after = (await c.get("/props")).json()
            assert after["is_sleeping"] is True
            assert after["residency"]["state"] == before["state"]
            assert after["residency"]["cycles"] == before["cycles"], level  # no restore ran
            r = await c.post("/completion", json={"prompt": PROMPT, "n_predict": 2})
            assert r.status_code == 200
            woke = (await c.get("/props")).json()["residency"]
            assert woke["state"] == "resident"
            assert woke["cycles"]["restores"] == before["cycles"]["restores"] + 1

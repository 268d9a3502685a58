"""llama-server's request fields beyond sampling: ``n_cmpl`` (alias ``n``) on
/completion, ``response_fields``, the code-completion limits ``n_indent`` and
``t_max_predict_ms``, and the refusals of what is not built (``lora``,
``grammar_lazy``) instead of a 200 that ignored them."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from trio_llm.runtime import ServerHandle, parse_config, serve
from trio_llm.server.slots import Slot, SlotsEngine
from trio_llm.server.stop import StopScanner
from trio_llm.server.tasks import ServerTask, TaskParams

Start = Callable[..., Awaitable[ServerHandle]]


@pytest.fixture
async def start(tiny_model: Path, nursery: trio.Nursery) -> AsyncIterator[Start]:
    handles: list[tuple[ServerHandle, trio.Event]] = []

    async def run(argv: list[str], done: trio.Event, *, task_status: Any) -> None:
        try:
            await serve(parse_config(argv, {}), task_status=task_status)
        finally:
            done.set()

    async def go(*argv: str) -> ServerHandle:
        done = trio.Event()
        h: ServerHandle = await nursery.start(run, ["-m", str(tiny_model), "--port", "0", "--backend", "numpy",
                                                    "--no-warmup", "-c", "512", *argv], done)
        with trio.fail_after(60):
            await h.context.loaded.wait()
        handles.append((h, done))
        return h

    yield go
    for h, done in handles:
        h.shutdown()
        with trio.fail_after(10):
            await done.wait()


async def test_n_cmpl_and_response_fields(start: Start) -> None:
    h = await start("-np", "2")
    body = {"prompt": "Once upon", "n_predict": 6, "seed": 5, "temperature": 1.0}
    async with httpx.AsyncClient(base_url=h.url, timeout=60) as c:
        two = (await c.post("/completion", json={**body, "n_cmpl": 2})).json()
        alias = (await c.post("/completion", json={**body, "n": 2})).json()
        one = [(await c.post("/completion", json={**body, "seed": s})).json() for s in (5, 6)]
        too_many = await c.post("/completion", json={**body, "n_cmpl": 3})
        picked = (await c.post("/completion", json={**body, "response_fields": [
            "content", "generation_settings/n_predict", "timings/predicted_n", "no/such"]})).json()
    assert isinstance(two, list) and [a["index"] for a in two] == [0, 1]
    # choice i samples with seed + i: each is the single answer of that seed
    assert [a["content"] for a in two] == [a["content"] for a in alias] == [a["content"] for a in one]
    assert too_many.status_code == 400 and "n_cmpl" in too_many.json()["error"]["message"]
    assert set(picked) == {"content", "generation_settings/n_predict", "timings/predicted_n"}
    assert picked["generation_settings/n_predict"] == 6 and picked["content"] == one[0]["content"]


@pytest.mark.parametrize(("field", "value", "needle"), [
    ("lora", [{"id": 0, "scale": 1.0}], "'lora'"), ("grammar_lazy", True, "'grammar_lazy'"),
    ("n_indent", -1, "'n_indent'"), ("response_fields", "content", "'response_fields'")])
async def test_what_is_not_built_is_400(start: Start, field: str, value: Any, needle: str) -> None:
    h = await start()
    async with httpx.AsyncClient(base_url=h.url, timeout=60) as c:
        r = await c.post("/completion", json={"prompt": "hi", "n_predict": 1, field: value})
        ok = await c.post("/completion", json={"prompt": "hi", "n_predict": 1, "lora": []})
    assert r.status_code == 400 and needle in r.json()["error"]["message"], r.text
    assert ok.status_code == 200


async def test_n_indent_cuts_the_line_that_is_not_indented(start: Start) -> None:
    """A grammar writes the lines; the third begins with less than 2 spaces: the answer
    ends before its text, as llama-server's (stop type limit)."""
    h = await start()
    grammar = 'root ::= "def f():\\n" "  return 1\\n" "x = 2\\n" [a-z]*'
    async with httpx.AsyncClient(base_url=h.url, timeout=60) as c:
        r = (await c.post("/completion", json={"prompt": "code", "n_predict": 40, "temperature": 0,
                                               "grammar": grammar, "n_indent": 2})).json()
        free = (await c.post("/completion", json={"prompt": "code", "n_predict": 40, "temperature": 0,
                                                  "grammar": grammar})).json()
    assert free["content"].startswith("def f():\n  return 1\nx = 2\n")
    assert (r["content"], r["stop_type"]) == ("def f():\n  return 1\n", "limit")


def _slot(params: TaskParams) -> Slot:
    slot = Slot(0, 64)
    slot.task = ServerTask(1, (1, 2), params, results=None)  # type: ignore[arg-type]
    slot.scanner = StopScanner(())
    return slot


def test_t_max_predict_ms_ends_at_a_newline_past_the_time() -> None:
    """The time limit counts from the first token, and acts only on a token with a
    newline, as llama-server's (times given, no clock read)."""
    slot = _slot(TaskParams(t_max_predict_ms=100))
    slot.t_prompt_done = 10.0
    limits = SlotsEngine._fim_limits

    def feed(piece: str, now: float) -> bool:
        slot.scanner.feed(piece)
        return limits(None, slot, piece, now)  # type: ignore[arg-type]

    assert not feed("a\n", 10.05)  # a newline, 50 ms in
    assert not feed("bbb", 10.2)  # 200 ms, no newline
    assert feed("c\nd", 10.2)  # a newline past 100 ms
    never = _slot(TaskParams())
    never.t_prompt_done = 0.0
    assert not limits(None, never, "\n", 1e6)  # type: ignore[arg-type]

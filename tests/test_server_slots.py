"""The queue and slots loop as actors, without HTTP: the real numpy backend behind
the real backend actor, the always-awake gate, tasks posted directly."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import pytest
import trio
import trio.testing

from trio_llm.engine.actor import BackendActor, BackendClient
from trio_llm.engine.backend import Level, SeqBatch
from trio_llm.engine.reference import NumpyBackend
from trio_llm.engine.sampling import SamplingParams
from trio_llm.model.gguf import load_gguf
from trio_llm.model.tokenizer import Tokenizer
from trio_llm.server.gate import AlwaysAwake
from trio_llm.server.queue import SlotsMessage, TaskQueue, outbox_size
from trio_llm.server.slots import SlotsEngine
from trio_llm.server.tasks import (
    ServerTask,
    TaskError,
    TaskFinal,
    TaskParams,
    TaskPartial,
    TaskResult,
)


@attrs.define
class Rig:
    client: BackendClient
    backend: NumpyBackend
    queue: TaskQueue
    slots: SlotsEngine
    tok: Tokenizer
    nursery: trio.Nursery

    def task(
        self, prompt: list[int], *, ban_eog: bool = False, **params: object
    ) -> tuple[ServerTask, trio.MemoryReceiveChannel[TaskResult]]:
        send, recv = trio.open_memory_channel[TaskResult](128)
        bias = tuple((e, -np.inf) for e in sorted(self.tok.eog_ids)) if ban_eog else ()
        sampling = SamplingParams(temperature=0.0, logit_bias=bias)
        p = TaskParams(sampling=sampling, **params)  # type: ignore[arg-type]
        return ServerTask(self.queue.new_id_task(), tuple(prompt), p, send), recv


async def make_rig(path: Path, nursery: trio.Nursery, *, n_seq: int, n_ctx: int, start_slots: bool = True,
                   **slots_kw: Any) -> Rig:
    model = load_gguf(path)
    backend = NumpyBackend(model, n_ctx=n_ctx, n_seq=n_seq)
    actor = BackendActor(backend)
    await nursery.start(actor.run)
    client = actor.client()
    send, recv = trio.open_memory_channel[SlotsMessage](outbox_size(n_seq))
    gate = AlwaysAwake()  # one gate for both, as runtime wires them: the queue reports busy
    queue = TaskQueue.create(n_seq, send, gate)
    tok = Tokenizer.from_metadata(model.metadata)
    slots = SlotsEngine(client, gate, tok, queue.inbox(), recv, n_ctx=n_ctx, n_batch=512, **slots_kw)
    await nursery.start(queue.start_loop)
    if start_slots:
        await nursery.start(slots.start_loop)
    return Rig(client, backend, queue, slots, tok, nursery)


@pytest.fixture
async def rig2(tiny_model: Path, nursery: trio.Nursery) -> AsyncIterator[Rig]:
    yield await make_rig(tiny_model, nursery, n_seq=2, n_ctx=64, start_slots=False)


async def collect(recv: trio.MemoryReceiveChannel[TaskResult]) -> list[TaskResult]:
    return [msg async for msg in recv]


async def answer(r: Rig, prompt: list[int], n_predict: int = 4) -> TaskFinal:
    """One greedy task of ``prompt`` (end-of-generation banned) through the rig, its final."""
    t, recv = r.task(prompt, n_predict=n_predict, ban_eog=True)
    await r.queue.post(t)
    (final,) = await collect(recv)
    assert isinstance(final, TaskFinal)
    return final


async def test_two_slots_share_every_forward_pass(rig2: Rig, tiny_model: Path) -> None:
    r = rig2
    prompts = [r.tok.encode("one two three"), r.tok.encode("four five six seven")]
    tasks = [r.task(p, n_predict=8, stream=True, id_slot=i, ban_eog=True) for i, p in enumerate(prompts)]
    for t, _ in tasks:
        await r.queue.post(t)
    await trio.testing.wait_all_tasks_blocked()  # both assignments wait in the slots inbox
    r.nursery.start_soon(r.slots.start_loop)
    results = [await collect(recv) for _, recv in tasks]

    # the same tokens as each prompt alone, greedily, on a fresh backend
    model = load_gguf(tiny_model)
    alone = NumpyBackend(model, n_ctx=64, n_seq=1)
    eog = sorted(r.tok.eog_ids)
    for prompt, res in zip(prompts, results, strict=True):
        final = res[-1]
        assert isinstance(final, TaskFinal) and final.stop_type == "limit"
        toks: list[int] = []
        logits = alone.forward([SeqBatch(0, np.asarray(prompt, np.int32), 0)])
        for _ in range(8):
            logits[0, eog] = -np.inf
            toks.append(int(np.argmax(logits[0])))
            logits = alone.forward([SeqBatch(0, np.array([toks[-1]], np.int32), len(prompt) + len(toks) - 1)])
        assert list(final.tokens) == toks
        assert [m.token for m in res if isinstance(m, TaskPartial)] == toks
    stats = r.slots.statistics()
    # one pass for both prompts, then seven passes each decoding both slots
    assert stats.n_decode == 8 and stats.n_busy_slots_total == 16
    assert stats.n_tasks_done == 2 and stats.n_processing == 0
    assert r.queue.statistics().n_idle_slots == 2


async def test_cancel_frees_the_slot_and_closes_the_channel(rig2: Rig) -> None:
    r = rig2
    r.nursery.start_soon(r.slots.start_loop)
    long_task, recv = r.task(r.tok.encode("hello"), n_predict=-1, stream=True, ban_eog=True)
    await r.queue.post(long_task)
    first = await recv.receive()
    assert isinstance(first, TaskPartial)
    await r.queue.cancel(long_task.id_task)
    rest = await collect(recv)  # ends: the channel was closed, no final message
    assert not any(isinstance(m, TaskFinal) for m in rest)
    await trio.testing.wait_all_tasks_blocked()
    assert r.slots.statistics().n_tasks_cancelled == 1
    assert r.queue.statistics().n_idle_slots == 2 and r.queue.statistics().cancelled == 0


async def test_a_client_that_stops_listening_frees_the_slot(rig2: Rig) -> None:
    r = rig2
    r.nursery.start_soon(r.slots.start_loop)
    t, recv = r.task(r.tok.encode("hello"), n_predict=-1, stream=True, ban_eog=True)
    await r.queue.post(t)
    assert isinstance(await recv.receive(), TaskPartial)
    await recv.aclose()  # no cancel message: the next send finds nobody
    with trio.fail_after(30):
        while r.slots.statistics().n_processing:
            await trio.testing.wait_all_tasks_blocked()
            await trio.sleep(0)
    assert r.slots.statistics().n_tasks_cancelled == 1


async def test_a_full_context_stops_with_limit(tiny_model: Path, nursery: trio.Nursery) -> None:
    r = await make_rig(tiny_model, nursery, n_seq=1, n_ctx=16)
    prompt = r.tok.encode("a b c d e")
    t, recv = r.task(prompt, n_predict=-1, ban_eog=True)
    await r.queue.post(t)
    (final,) = await collect(recv)
    assert isinstance(final, TaskFinal) and final.stop_type == "limit"
    assert len(final.tokens) == 16 - len(prompt) + 1  # the last one is never fed back
    assert final.n_cached_end == 16


async def test_a_backend_failure_answers_the_task_and_the_loop_goes_on(rig2: Rig) -> None:
    r = rig2
    r.nursery.start_soon(r.slots.start_loop)
    await r.client.release(Level.WEIGHTS)  # forward now refuses: "restore first"
    t, recv = r.task(r.tok.encode("hello"), n_predict=3)
    await r.queue.post(t)
    (err,) = await collect(recv)
    assert isinstance(err, TaskError) and "restore first" in err.message and err.code == 500
    await r.client.restore()
    t, recv = r.task(r.tok.encode("hello"), n_predict=3)
    await r.queue.post(t)
    (final,) = await collect(recv)
    assert isinstance(final, TaskFinal) and len(final.tokens) <= 3
    assert final.timings.cache_n == 0  # the failure dropped the caches: state unknown


async def test_the_gate_sees_busy_while_work_is_in_flight(rig2: Rig) -> None:
    r = rig2
    gate = r.slots._gate
    assert isinstance(gate, AlwaysAwake)
    r.nursery.start_soon(r.slots.start_loop)
    await trio.testing.wait_all_tasks_blocked()
    assert gate._busy is False
    t, recv = r.task(r.tok.encode("hello"), n_predict=-1, stream=True, ban_eog=True)
    await r.queue.post(t)
    assert isinstance(await recv.receive(), TaskPartial)
    assert gate._busy is True
    await r.queue.cancel(t.id_task)
    await collect(recv)
    await trio.testing.wait_all_tasks_blocked()
    assert gate._busy is False

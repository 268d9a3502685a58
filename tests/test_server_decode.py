"""The slots loop's device-sampled decode (server/decode.py) against the host chain.

Real backends (numpy and Vulkan on lavapipe) behind the real actor; each run's tokens
are compared with a reference computed by hand from ``forward`` and the host sampler
with the same seed, and with the loop forced onto the host path (``decode_steps=0``).
Several steps per submit must neither lose nor repeat a token when a slot stops in the
middle of a submit (its limit, a stop string), nor when another slot of the same pass
stops earlier.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import trio
import trio.testing

from trio_llm.engine.actor import BackendActor
from trio_llm.engine.backend import SeqBatch
from trio_llm.engine.loader import open_backend
from trio_llm.engine.sampling import SamplingParams, make_rng, sample
from trio_llm.model.gguf import load_gguf
from trio_llm.model.tokenizer import Tokenizer
from trio_llm.server.decode import DecodeWant, device_plan
from trio_llm.server.gate import AlwaysAwake
from trio_llm.server.queue import SlotsMessage, TaskQueue, outbox_size
from trio_llm.server.slots import SlotsEngine
from trio_llm.server.tasks import ServerTask, TaskFinal, TaskParams, TaskPartial, TaskResult

N_CTX = 96
AHEAD = [0, 0]  # the last Vulkan run's (resumed, dropped) look-ahead submits
GREEDY = SamplingParams(temperature=0.0)
SEEDED = SamplingParams(seed=1234)  # llama-server's default chain
HOT = SamplingParams(temperature=1.5, top_k=100, top_p=0.9, min_p=0.0, seed=99)


def reference(path: Path, kind: str, prompt: list[int], params: SamplingParams, n: int) -> list[int]:
    """What the host chain generates: forward, sample, feed back; stops at end of
    generation as the slots loop does."""
    model = load_gguf(path)
    tok = Tokenizer.from_metadata(model.metadata)
    be = open_backend(kind, model, n_ctx=N_CTX, n_seq=1)
    try:
        rng = make_rng(params.seed)
        logits = be.forward([SeqBatch(0, np.asarray(prompt, np.int32), 0)])
        out: list[int] = []
        while len(out) < n:
            t = sample(logits[0], params, rng, prompt + out)
            if tok.is_eog(t):
                break
            out.append(t)
            logits = be.forward([SeqBatch(0, np.array([t], np.int32), len(prompt) + len(out) - 1)])
        return out
    finally:
        be.close()


async def run_engine(path: Path, kind: str, jobs: list[tuple[list[int], SamplingParams, int, tuple[str, ...]]],
                     decode_steps: int, look_ahead: bool = True) -> tuple[list[list[TaskResult]], SlotsEngine, int]:
    """The jobs (prompt, params, n_predict, stop) at once on ``len(jobs)`` slots;
    every job's messages, streamed, the loop, and how many calls reached the backend."""
    model = load_gguf(path)
    backend = open_backend(kind, model, n_ctx=N_CTX, n_seq=len(jobs))
    try:
        async with trio.open_nursery() as nursery:
            actor = BackendActor(backend)
            await nursery.start(actor.run)
            send, recv = trio.open_memory_channel[SlotsMessage](outbox_size(len(jobs)))
            gate = AlwaysAwake()
            queue = TaskQueue.create(len(jobs), send, gate)
            tok = Tokenizer.from_metadata(model.metadata)
            slots = SlotsEngine(actor.client(), gate, tok, queue.inbox(), recv, n_ctx=N_CTX, n_batch=512,
                                decode_steps=decode_steps, look_ahead=look_ahead)
            await nursery.start(queue.start_loop)
            chans = []
            for i, (prompt, params, n, stop) in enumerate(jobs):
                s, r = trio.open_memory_channel[TaskResult](N_CTX + 4)
                await queue.post(ServerTask(queue.new_id_task(), tuple(prompt),
                                            TaskParams(sampling=params, n_predict=n, stream=True, stop=stop,
                                                       id_slot=i), s))
                chans.append(r)
            await trio.testing.wait_all_tasks_blocked()
            nursery.start_soon(slots.start_loop)
            results = [[m async for m in r] for r in chans]
            calls = actor.statistics().calls
            sampler = getattr(backend, "_sampler", None)
            if sampler is not None:  # Vulkan: how the submits queued ahead were used
                AHEAD[:] = [sampler.resumed, sampler.dropped]
            nursery.cancel_scope.cancel()
    finally:
        backend.close()
    return results, slots, calls


def tokens_of(msgs: list[TaskResult]) -> list[int]:
    final = msgs[-1]
    assert isinstance(final, TaskFinal)
    streamed = [m.token for m in msgs if isinstance(m, TaskPartial)]
    # no token lost or repeated on the way (the token that completes a stop string is
    # streamed only with text before the stop)
    assert streamed == list(final.tokens) or (final.stop_type == "word" and streamed == list(final.tokens[:-1]))
    return list(final.tokens)


def prompt_of(path: Path, text: str) -> list[int]:
    return Tokenizer.from_metadata(load_gguf(path).metadata).encode(text)


@pytest.mark.parametrize("kind", ["numpy", pytest.param("vulkan", marks=pytest.mark.vulkan)])
@pytest.mark.parametrize("params", [GREEDY, SEEDED, HOT], ids=["greedy", "default-chain", "hot"])
async def test_device_decode_equals_the_host_chain(tiny_model: Path, kind: str, params: SamplingParams) -> None:
    prompt = prompt_of(tiny_model, "one two three four")
    want = reference(tiny_model, kind, prompt, params, 13)
    for steps in (0, 1, 4):
        (msgs,), slots, _ = await run_engine(tiny_model, kind, [(prompt, params, 13, ())], steps)
        assert tokens_of(msgs) == want, steps
        phases = dict(slots.statistics().t_phases)
        assert (phases["device"] > 0) == (steps > 0)  # the path taken is the one asked for


@pytest.mark.parametrize("kind", ["numpy", pytest.param("vulkan", marks=pytest.mark.vulkan)])
async def test_ignore_eos_and_logit_bias_sample_on_the_device(tiny_model: Path, kind: str) -> None:
    """``ignore_eos`` (a -inf bias per end-of-generation token) and a request's own
    biases are applied on the device: the pass takes the device path and its tokens
    are the host chain's."""
    tok = Tokenizer.from_metadata(load_gguf(tiny_model).metadata)
    prompt = prompt_of(tiny_model, "one two three four")
    bans = tuple((t, -np.inf) for t in sorted(tok.eog_ids))
    for params in (SamplingParams(temperature=0.0, logit_bias=bans),
                   SamplingParams(seed=11, logit_bias=bans + ((prompt[1], 3.0), (prompt[2], -2.0)))):
        want = reference(tiny_model, kind, prompt, params, 24)
        assert len(want) == 24  # no end of generation
        (msgs,), slots, _ = await run_engine(tiny_model, kind, [(prompt, params, 24, ())], 4)
        assert tokens_of(msgs) == want
        phases = dict(slots.statistics().t_phases)
        assert phases["device"] > 0 and phases["decode"] == 0


@pytest.mark.parametrize("kind", ["numpy", pytest.param("vulkan", marks=pytest.mark.vulkan)])
async def test_slots_stopping_inside_a_submit_keep_exactly_their_tokens(tiny_model: Path, kind: str) -> None:
    """Three slots in one pass, four steps per submit: one stops at its limit after 3
    tokens, one at a stop string, one runs on; each equals its own run alone on the
    host path, and the slot that runs on is not disturbed by the others' stops."""
    p0, p1, p2 = (prompt_of(tiny_model, t) for t in ("alpha beta", "gamma delta epsilon", "zeta"))
    (alone,), _, _ = await run_engine(tiny_model, kind, [(p1, GREEDY, 20, ())], 0)
    text = "".join(m.text for m in alone if isinstance(m, TaskPartial))
    stop = text[len(text) // 2 : len(text) // 2 + 2]  # a stop string that ends it mid-way
    assert stop.strip()
    jobs = [(p0, SEEDED, 3, ()), (p1, GREEDY, 20, (stop,)), (p2, HOT, 17, ())]
    host, _, host_calls = await run_engine(tiny_model, kind, jobs, 0)
    dev, _, dev_calls = await run_engine(tiny_model, kind, jobs, 4)
    for h, d in zip(host, dev, strict=True):
        assert tokens_of(d) == tokens_of(h)
        fh, fd = h[-1], d[-1]
        assert isinstance(fh, TaskFinal) and isinstance(fd, TaskFinal)
        assert (fd.content, fd.stop_type, fd.n_cached_end) == (fh.content, fh.stop_type, fh.n_cached_end)
    assert dev[1][-1].stop_type == "word"  # type: ignore[union-attr]
    assert len(tokens_of(dev[0])) == 3
    # several decode steps ran per call into the backend
    assert dev_calls < host_calls


@pytest.mark.vulkan
async def test_look_ahead_submits_are_used_and_change_nothing(tiny_model: Path) -> None:
    """With look-ahead the next decode submit is queued while the host accepts the last
    one's ids: a long run resumes from them, and every run (one slot, three slots that
    stop at different points) gives exactly the tokens of the run without it."""
    p0, p1, p2 = (prompt_of(tiny_model, t) for t in ("alpha beta", "gamma delta epsilon", "zeta"))
    jobs = [(p0, SEEDED, 9, ()), (p1, GREEDY, 30, ()), (p2, HOT, 21, ())]
    for js in (jobs[1:2], jobs):
        plain, _, _ = await run_engine(tiny_model, "vulkan", js, 4, look_ahead=False)
        ahead, _, _ = await run_engine(tiny_model, "vulkan", js, 4, look_ahead=True)
        for a, b in zip(plain, ahead, strict=True):
            assert tokens_of(a) == tokens_of(b)
        assert AHEAD[0] >= 3


def test_device_plan_choices() -> None:
    w = DecodeWant(GREEDY, False, 10, -1)
    assert device_plan([w], n_vocab=1000, n_ctx=100, steps=4, steps_max=16, rows_max=8) is not None
    assert device_plan([w], n_vocab=1000, n_ctx=100, steps=4, steps_max=16, rows_max=8)[1] == 4  # type: ignore[index]
    # a slot's remaining tokens, the context, the backend's limit bound the steps (a power of two)
    assert device_plan([w, DecodeWant(GREEDY, False, 5, 3)], n_vocab=1000, n_ctx=100, steps=4, steps_max=16,
                       rows_max=8)[1] == 2  # type: ignore[index]
    assert device_plan([DecodeWant(GREEDY, False, 98, -1)], n_vocab=1000, n_ctx=100, steps=8, steps_max=16,
                       rows_max=8)[1] == 2  # type: ignore[index]
    assert device_plan([w], n_vocab=1000, n_ctx=100, steps=8, steps_max=1, rows_max=8)[1] == 1  # type: ignore[index]
    # anything the device cannot sample sends the whole pass to the host
    assert device_plan([w, DecodeWant(GREEDY, True, 10, -1)], n_vocab=1000, n_ctx=100, steps=4, steps_max=16,
                       rows_max=8) is None
    assert device_plan([w, DecodeWant(SamplingParams(repeat_penalty=1.2), False, 10, -1)], n_vocab=1000,
                       n_ctx=100, steps=4, steps_max=16, rows_max=8) is None
    assert device_plan([w] * 9, n_vocab=1000, n_ctx=100, steps=4, steps_max=16, rows_max=8) is None


@pytest.mark.vulkan
def test_a_release_or_another_call_waits_for_the_submit_queued_ahead(tiny_model: Path) -> None:
    """A submit queued ahead is in flight when the call returns: a release, a forward,
    or a decode that is not its continuation first waits for it and drops it, and the
    tokens stay those of plain greedy decoding."""
    from trio_llm.engine.backend import Level
    from trio_llm.engine.devsample import DeviceChain
    from trio_llm.vulkan.backend import VulkanBackend

    be = VulkanBackend(load_gguf(tiny_model), n_ctx=64, n_seq=1)
    try:
        prompt = np.asarray(prompt_of(tiny_model, "one two three"), np.int32)
        n0 = len(prompt)
        logits = be.forward([SeqBatch(0, prompt, 0)])
        want = [int(np.argmax(logits[0]))]
        for i in range(12):
            logits = be.forward([SeqBatch(0, np.array([want[-1]], np.int32), n0 + i)])
            want.append(int(np.argmax(logits[0])))
        g, z = [DeviceChain.greedy()], np.zeros((4, 1), np.float32)

        def step(tok: int, pos: int, ahead: bool) -> list[int]:
            return be.decode([SeqBatch(0, np.array([tok], np.int32), pos)], g, z, z if ahead else None)[:, 0].tolist()

        got = want[:1] + step(want[0], n0, True)  # queues the continuation
        be.release(Level.ALL)  # waits for it, drops it
        be.restore()
        got += step(got[-1], n0 + 4, True)  # afresh after the release; queues the next
        logits = be.forward([SeqBatch(0, np.array([got[-1]], np.int32), n0 + 8)])  # not the continuation
        got.append(int(np.argmax(logits[0])))
        got += step(got[-1], n0 + 9, False)[:3]
        assert got == want
        assert be._sampler.dropped == 2 and be._sampler.resumed == 0
    finally:
        be.close()

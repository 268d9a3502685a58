"""The sleep controller on MockClock, with the real numpy backend (tiny model) and a
real arbiter on a tmp arena. "Another process" is a second ``Arbiter`` on the same
arena: its own open file descriptions, so flock conflicts exactly as across
processes.

A note on exact times: MockClock's autojump also fires while a backend call runs on
a worker thread (that task counts as blocked), jumping to the next pending deadline.
So exact virtual times are asserted at decision points (state RELEASING observed,
probe counts), never across a backend call racing another pending deadline; every
file is opened before the controller starts; and no test keeps a fail_after
deadline pending across a backend call."""

from __future__ import annotations

import math
import os
import shutil
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import attrs
import numpy as np
import pytest
import trio
import trio.testing

from trio_llm.engine.actor import BackendActor, BackendClient
from trio_llm.engine.backend import Level, SeqBatch
from trio_llm.engine.reference import NumpyBackend
from trio_llm.errors import ArenaUnavailable, InvalidRequest, ModelLoadError
from trio_llm.model.gguf import load_gguf
from trio_llm.residency.arbiter import Arbiter, open_arbiter
from trio_llm.residency.residency import Residency, State
from trio_llm.residency.sleep import Act, Live, SleepConfig, SleepController, decide

EPS = 1e-9


@attrs.define
class Stack:
    ctl: SleepController
    residency: Residency
    arbiter: Arbiter
    client: BackendClient
    backend: NumpyBackend
    nursery: trio.Nursery
    other: Arbiter  # "another process": its own open file descriptions of the arena


@asynccontextmanager
async def stack(
    model: Path, arena: Path | None, cfg: SleepConfig, n_seq: int = 1
) -> AsyncIterator[Stack]:
    # every thread call (opening files here) happens before the controller starts:
    # autojump would otherwise move the clock past its deadlines meanwhile
    other = await open_arbiter(arena)
    arbiter = await open_arbiter(arena)
    await arbiter.take()  # coordinated load: the token before the weights
    gg = load_gguf(model)
    backend = NumpyBackend(gg, n_ctx=64, n_seq=n_seq)
    gg.close()
    actor = BackendActor(backend)
    client = actor.client()
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(actor.run)
            residency = Residency(client)
            await nursery.start(residency.run)
            ctl = SleepController(cfg, residency, arbiter)
            await nursery.start(ctl.run)
            yield Stack(ctl, residency, arbiter, client, backend, nursery, other)
            nursery.cancel_scope.cancel()
    finally:
        backend.close()
        arbiter.close()
        other.close()


async def released_at(res: Residency) -> float:
    """The virtual time the model starts releasing (a decision point)."""
    await res.wait_for(lambda s: s is State.RELEASING)
    return trio.current_time()


async def settled(res: Residency, state: State) -> None:
    """Wait for ``state``, then for the controller to finish the transition (give the
    token back, count it): it runs right after the residency reports the new state."""
    await res.wait_for(lambda s: s is state)
    await trio.testing.wait_all_tasks_blocked()


# ---- the pure decision ------------------------------------------------------------


def live(**kw: object) -> Live:
    base: dict[str, object] = dict(
        now=10.0, state=State.RESIDENT, busy=False, demand=0, sleep_request=None,
        idle_since=0.0, woke_at=0.0, last_probe=-math.inf, arbiter_active=False,
    )
    base.update(kw)
    return Live(**base)  # type: ignore[arg-type]


def test_decide_is_a_function_of_live_state() -> None:
    idle5 = SleepConfig(Level.WEIGHTS, idle_seconds=5)
    off = SleepConfig(Level.WEIGHTS)
    assert decide(idle5, live(state=State.COLD)).act is Act.WAIT
    assert decide(off, live(state=State.UNLOADED, demand=1)).act is Act.WAKE
    assert decide(idle5, live(busy=True)).act is Act.WAIT
    assert decide(idle5, live(now=50.0, passes=1)).act is Act.WAIT  # a forward pass in flight
    assert decide(off, live(sleep_request=Level.ALL, passes=1)).act is Act.WAIT
    assert decide(idle5, live(demand=2)).act is Act.WAIT
    assert decide(idle5, live(state=State.RESTORING)).act is Act.WAIT
    d = decide(idle5, live(now=4.0))
    assert (d.act, d.deadline) == (Act.WAIT, 5.0)
    d = decide(idle5, live(now=5.0))
    assert (d.act, d.level, d.reason) == (Act.SLEEP, Level.WEIGHTS, "idle")
    d = decide(off, live(sleep_request=Level.ALL))
    assert (d.act, d.level) == (Act.SLEEP, Level.ALL)
    assert decide(off, live(sleep_request=Level.ALL, busy=True)).act is Act.WAIT
    assert decide(off, live()).deadline == math.inf
    # the probe: never within the grace after a wake, then every 10 ms
    d = decide(off, live(arbiter_active=True, woke_at=9.95))
    assert (d.act, d.deadline) == (Act.WAIT, pytest.approx(10.05))
    assert decide(off, live(arbiter_active=True, woke_at=9.9)).act is Act.PROBE
    d = decide(off, live(arbiter_active=True, last_probe=9.995))
    assert d.deadline == pytest.approx(10.005)
    d = decide(idle5, live(now=4.0, arbiter_active=True, woke_at=3.95))
    assert d.deadline == pytest.approx(4.05)


# ---- idle sleep -------------------------------------------------------------------


async def test_idle_sleep_counts_only_idle_time(tiny_model: Path, autojump_clock: object) -> None:
    cfg = SleepConfig(Level.WEIGHTS, idle_seconds=5)
    async with stack(tiny_model, None, cfg) as s:
        t0 = trio.current_time()
        await trio.sleep(3)  # idle 3 s
        s.ctl.set_busy(True)
        await trio.sleep(60)  # busy: never counted, never sleeps
        assert s.residency.state is State.RESIDENT
        s.ctl.set_busy(False)
        assert await released_at(s.residency) == pytest.approx(t0 + 3 + 60 + 5, abs=EPS)
        await settled(s.residency, State.COLD)
        stats = s.ctl.statistics()
        assert (stats.idle_sleeps, stats.yields, stats.token_held) == (1, 0, False)
        assert s.ctl.is_sleeping()
        props = s.ctl.props()
        assert props["state"] == "cold" and props["level"] == "weights"
        assert props["device_bytes"]["weights"] == 0
        assert props["device_bytes"]["kv_cache"] > 0  # level weights keeps the KV cache
        # a request wakes it; the wake re-arms the idle deadline
        await s.ctl.wait_until_no_sleep()
        woke = trio.current_time()
        assert s.residency.state is State.RESIDENT and s.arbiter.holding
        assert s.ctl.props()["device_bytes"]["weights"] > 0
        assert await released_at(s.residency) == pytest.approx(woke + 5, abs=EPS)


async def test_idle_sleep_level_all_and_unload(tiny_model: Path, autojump_clock: object) -> None:
    for level in (Level.ALL, Level.UNLOAD):
        async with stack(tiny_model, None, SleepConfig(level, idle_seconds=1)) as s:
            cold = State.UNLOADED if level is Level.UNLOAD else State.COLD
            await settled(s.residency, cold)
            assert sum(s.ctl.props()["device_bytes"].values()) == 0
            await s.ctl.wait_until_no_sleep()
            assert s.ctl.props()["device_bytes"]["weights"] > 0
            assert s.residency.statistics().restores == 1


async def test_prompt_cache_survives_release_and_restore(
    tiny_model: Path, autojump_clock: object
) -> None:
    """A continuation after a release/restore cycle sees the same KV cache: the logits
    equal those of an uninterrupted run."""
    prompt = np.arange(1, 9, dtype=np.int32)
    more = np.array([42, 7], dtype=np.int32)
    for level in (Level.WEIGHTS, Level.ALL):
        async with stack(tiny_model, None, SleepConfig(level)) as s:
            await s.client.forward([SeqBatch(0, prompt, 0)])
            expected = await s.client.forward([SeqBatch(0, more, len(prompt))])
            await s.client.forward([SeqBatch(0, prompt, 0)])
            await s.ctl.request_sleep(None)
            assert s.ctl.is_sleeping()
            await s.ctl.wait_until_no_sleep()
            got = await s.client.forward([SeqBatch(0, more, len(prompt))])
            np.testing.assert_array_equal(got, expected)


# ---- the arbiter probe ------------------------------------------------------------


async def test_probe_cadence_and_yield_time(
    tiny_model: Path, tmp_path: Path, autojump_clock: object
) -> None:
    async with stack(tiny_model, tmp_path, SleepConfig(Level.WEIGHTS)) as s:
        t0 = s.ctl.statistics().woke_at
        other = s.other
        await trio.sleep_until(t0 + 0.2035)  # probes at +0.100, +0.110, ... +0.200
        async with trio.open_nursery() as nursery:
            nursery.start_soon(other.take)
            # the first probe after the registration (+0.210) sees it and yields
            assert await released_at(s.residency) == pytest.approx(t0 + 0.21, abs=EPS)
        assert other.holding and not s.arbiter.holding
        stats = s.arbiter.statistics()
        assert (stats.probes, stats.probes_positive) == (12, 1)
        assert s.ctl.statistics().yields == 1
        other.close()


async def test_no_yield_within_grace_of_a_wake(
    tiny_model: Path, tmp_path: Path, autojump_clock: object
) -> None:
    async with stack(tiny_model, tmp_path, SleepConfig(Level.WEIGHTS)) as s:
        t0 = s.ctl.statistics().woke_at
        other = s.other
        async with trio.open_nursery() as nursery:
            nursery.start_soon(other.take)  # registers at once, inside the start-up grace
            assert await released_at(s.residency) == pytest.approx(t0 + 0.1, abs=EPS)
        # the other side holds; a request for us waits for it, then wakes us
        async with trio.open_nursery() as nursery:
            nursery.start_soon(s.ctl.wait_until_no_sleep)
            await trio.sleep(1)
            assert s.residency.state is State.COLD and s.arbiter.statistics().waiting
            other.give_back()
        assert s.residency.state is State.RESIDENT and s.arbiter.holding
        woke = s.ctl.statistics().woke_at
        async with trio.open_nursery() as nursery:
            nursery.start_soon(other.take)
            assert await released_at(s.residency) == pytest.approx(woke + 0.1, abs=EPS)
        assert other.holding
        other.close()


async def test_holder_keeps_the_gpu_while_busy(
    tiny_model: Path, tmp_path: Path, autojump_clock: object
) -> None:
    async with stack(tiny_model, tmp_path, SleepConfig(Level.WEIGHTS)) as s:
        other = s.other
        s.ctl.set_busy(True)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(other.take)
            await trio.sleep(30)
            assert s.residency.state is State.RESIDENT  # never under an in-flight decode
            probes = s.arbiter.statistics().probes
            s.ctl.set_busy(False)
            t_idle = trio.current_time()
            assert await released_at(s.residency) == pytest.approx(t_idle, abs=EPS)
        assert s.arbiter.statistics().probes == probes + 1
        other.close()


async def test_a_waiter_that_left_is_not_latched(
    tiny_model: Path, tmp_path: Path, autojump_clock: object
) -> None:
    """A waiter that registers and leaves before the probe causes no release later."""
    async with stack(tiny_model, tmp_path, SleepConfig(Level.WEIGHTS)) as s:
        other = s.other
        with trio.move_on_after(0.05):
            await other.take()  # gives up inside the grace period
        await trio.sleep(5)
        assert s.residency.state is State.RESIDENT
        stats = s.arbiter.statistics()
        assert stats.probes > 400 and stats.probes_positive == 0
        # a POST /sleep whose caller went away does not fire on the next idle moment
        s.ctl.set_busy(True)
        with trio.move_on_after(1):
            await s.ctl.request_sleep("all")
        s.ctl.set_busy(False)
        await trio.sleep(5)
        assert s.residency.state is State.RESIDENT
        assert s.ctl.statistics().requested_sleeps == 0
        other.close()


async def test_waiter_registered_during_restore_is_seen(
    tiny_model: Path, tmp_path: Path, autojump_clock: object
) -> None:
    cfg = SleepConfig(Level.UNLOAD)  # restore reloads the file: a long RESTORING window
    async with stack(tiny_model, tmp_path, cfg) as s:
        await s.ctl.request_sleep(None)
        assert s.residency.state is State.UNLOADED and not s.arbiter.holding
        other = s.other
        async with trio.open_nursery() as nursery:
            nursery.start_soon(s.ctl.wait_until_no_sleep)
            await s.residency.wait_for(lambda st: st is State.RESTORING)
            nursery.start_soon(other.take)  # registers while we restore
            await s.residency.wait_for(lambda st: st is State.RESIDENT)
            t_release = await released_at(s.residency)
        # seen by the first probe after the grace: state, not an event we could miss
        assert t_release == pytest.approx(s.ctl.statistics().woke_at + 0.1, abs=EPS)
        assert other.holding and s.ctl.statistics().yields == 1
        other.close()


async def test_a_request_during_a_yield_lets_the_waiter_go_first(
    tiny_model: Path, tmp_path: Path, autojump_clock: object
) -> None:
    """A request that arrives while we release for a waiter must not snatch the token
    back before that waiter (polling every 5 ms) has had it."""
    async with stack(tiny_model, tmp_path, SleepConfig(Level.WEIGHTS)) as s:
        other = s.other
        async with trio.open_nursery() as nursery:
            nursery.start_soon(other.take)
            await s.residency.wait_for(lambda st: st is State.RELEASING)
            nursery.start_soon(s.ctl.wait_until_no_sleep)  # demand while releasing
            while not other.holding:
                await trio.sleep(0.001)
            # the waiter got the token, though our request came first
            assert s.residency.state is State.COLD and not s.arbiter.holding
            await trio.sleep(1)
            assert s.arbiter.statistics().waiting  # now we wait for them, registered
            assert other.probe() is True
            other.give_back()
        assert s.residency.state is State.RESIDENT and s.arbiter.holding
        other.close()


# ---- the wake path ----------------------------------------------------------------


async def test_every_waiter_returns_under_eager_sleep(
    tiny_model: Path, autojump_clock: object
) -> None:
    """idle_seconds=0: the model sleeps the instant nobody needs it. Waiters that saw
    it awake, waiters queued just after, and waiters arriving while it restores all
    return; none is stranded when the loop sleeps again before it runs."""
    async with stack(tiny_model, None, SleepConfig(Level.WEIGHTS, idle_seconds=0)) as s:
        await settled(s.residency, State.COLD)
        returned: list[int] = []

        async def request(i: int, delay: float) -> None:
            await trio.sleep(delay)
            await s.ctl.wait_until_no_sleep()
            assert s.residency.state is State.RESIDENT  # resident when it returns
            returned.append(i)

        # no fail_after here: autojump would jump to its deadline while a restore runs
        # on the backend's worker thread (pytest-timeout guards against a hang)
        async with trio.open_nursery() as nursery:
            for i in range(12):
                nursery.start_soon(request, i, 0.001 * (i % 4))
        assert sorted(returned) == list(range(12))
        await settled(s.residency, State.COLD)
        wakes = s.ctl.statistics().wakes
        # a request queued right after the others saw it awake wakes it by itself
        await s.ctl.wait_until_no_sleep()
        assert s.ctl.statistics().wakes == wakes + 1


async def test_cancelled_wait_withdraws_demand(
    tiny_model: Path, tmp_path: Path, autojump_clock: object
) -> None:
    async with stack(tiny_model, tmp_path, SleepConfig(Level.WEIGHTS)) as s:
        other = s.other
        await other.take()
        assert s.residency.state is State.COLD
        with trio.move_on_after(2):
            await s.ctl.wait_until_no_sleep()  # the other side keeps the token
        await trio.testing.wait_all_tasks_blocked()
        assert s.ctl.statistics().demand == 0
        assert not s.arbiter.statistics().waiting  # the take stopped with its demand
        assert other.probe() is False  # want.lock dropped
        other.give_back()
        await trio.sleep(1)
        assert not s.arbiter.holding  # nobody wanted the model: it stayed cold
        other.close()


async def test_failed_restore_reaches_the_waiter(
    tiny_model: Path, tmp_path: Path, autojump_clock: object
) -> None:
    copy = tmp_path / "model.gguf"
    shutil.copy(tiny_model, copy)
    async with stack(copy, tmp_path / "arena", SleepConfig(Level.UNLOAD)) as s:
        await s.ctl.request_sleep(None)
        copy.write_bytes(b"not a gguf any more")
        with pytest.raises(ModelLoadError):
            await s.ctl.wait_until_no_sleep()
        assert s.residency.state is State.UNLOADED and not s.arbiter.holding
        assert s.ctl.statistics().wake_failures == 1
        shutil.copy(tiny_model, copy)
        await s.ctl.wait_until_no_sleep()  # the next request tries again
        assert s.residency.state is State.RESIDENT


async def test_a_broken_arena_fails_the_wake_not_the_server(
    tiny_model: Path, tmp_path: Path, autojump_clock: object
) -> None:
    async with stack(tiny_model, tmp_path, SleepConfig(Level.WEIGHTS)) as s:
        await s.ctl.request_sleep(None)
        # fault injection: flock on it now fails (EBADF); a number never open, so that
        # no descriptor opened later (a queue ticket) can take its place
        os.close(s.arbiter._token_fd)
        s.arbiter._token_fd = 1 << 20
        with pytest.raises(ArenaUnavailable):
            await s.ctl.wait_until_no_sleep()
        assert s.ctl.statistics().wake_failures == 1
        assert s.ctl.props()["state"] == "cold"  # the controller is still there
        s.arbiter._token_fd = -1  # closed above: nothing left for close() to do


async def test_requests_sleep_and_wake(tiny_model: Path, autojump_clock: object) -> None:
    async with stack(tiny_model, None, SleepConfig(Level.WEIGHTS)) as s:
        with pytest.raises(InvalidRequest):
            await s.ctl.request_sleep("deep")
        s.ctl.set_busy(True)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(s.ctl.request_sleep, "all")
            await trio.sleep(2)
            assert s.residency.state is State.RESIDENT  # waits for idle
            s.ctl.set_busy(False)
        assert s.residency.state is State.COLD and s.residency.level is Level.ALL
        await s.ctl.request_sleep("weights")  # already released: no-op
        await s.ctl.request_wake()
        props = s.ctl.props()
        assert props["state"] == "resident" and props["token_held"]
        assert props["cycles"]["requested_sleeps"] == 1 and props["cycles"]["wakes"] == 1
        assert props["arbiter"]["active"] is False


# ---- shutdown ---------------------------------------------------------------------


@pytest.mark.parametrize("where", ["resident", "cold", "waiting", "unloaded"])
async def test_shutdown_in_every_state(
    tiny_model: Path, tmp_path: Path, autojump_clock: object, where: str
) -> None:
    level = Level.UNLOAD if where == "unloaded" else Level.ALL
    other = await open_arbiter(tmp_path)
    async with stack(tiny_model, tmp_path, SleepConfig(level)) as s:
        if where in ("cold", "unloaded", "waiting"):
            await s.ctl.request_sleep(None)
        if where == "waiting":
            await other.take()
            s.nursery.start_soon(s.ctl.wait_until_no_sleep)
            await trio.sleep(1)
            assert s.arbiter.statistics().waiting
    # the stack has shut down: nothing left registered or held
    assert other.probe() is False
    if other.holding:
        other.give_back()
    other.take_nowait()
    other.close()

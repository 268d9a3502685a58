"""The arena as a scheduler (issue 16): the quantum and the adaptive grace.

Pure decisions without trio; then the sleep controller on MockClock with the real
numpy backend and a real arbiter on a tmp arena ("another process" is a second
``Arbiter`` on the same arena, its own open file descriptions). The same MockClock
caveats as in ``test_sleep.py`` apply: exact times are asserted at decision points.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import trio
import trio.testing

from test_sleep import released_at, settled, stack
from trio_llm.engine.backend import Level, SeqBatch
from trio_llm.residency.residency import State
from trio_llm.residency.sleep import Act, Live, SleepConfig, decide, quantum_level

EPS = 1e-9


def live(**kw: object) -> Live:
    base: dict[str, object] = dict(
        now=10.0, state=State.RESIDENT, busy=True, demand=0, sleep_request=None,
        idle_since=0.0, woke_at=0.0, last_probe=-math.inf, arbiter_active=True,
    )
    base.update(kw)
    return Live(**base)  # type: ignore[arg-type]


# ---- pure decisions ------------------------------------------------------------------


def test_quantum_decision() -> None:
    q5 = SleepConfig(Level.WEIGHTS, quantum=5.0)
    off = SleepConfig(Level.WEIGHTS)
    # quantum 0: a busy holder never probes (today's rule)
    assert decide(off, live(now=1e6)) == decide(off, live(now=1e6, passes=1))
    assert decide(off, live(now=1e6)).act is Act.WAIT
    # busy before the quantum: wait until it is up, not a moment longer (and look at
    # the queue every probe interval meanwhile: a higher-priority waiter shortens it)
    d = decide(q5, live(now=4.995, woke_at=0.0))
    assert (d.act, d.deadline) == (Act.WAIT, 5.0)
    d = decide(q5, live(now=4.0, woke_at=0.0))
    assert (d.act, d.deadline) == (Act.WAIT, pytest.approx(4.01))
    # at the quantum: probe, even under a pass in flight (the yield waits for it)
    for kw in ({}, {"passes": 1}, {"demand": 2}, {"busy": False, "passes": 1}):
        d = decide(q5, live(now=5.0, **kw))
        assert (d.act, d.reason, d.level) == (Act.PROBE, "quantum", Level.WEIGHTS), kw
    # then every probe interval, not at every wake-up of the controller
    d = decide(q5, live(now=5.004, last_probe=5.0))
    assert (d.act, d.deadline) == (Act.WAIT, pytest.approx(5.01))
    # no arena, nothing to yield to
    assert decide(q5, live(now=50.0, arbiter_active=False)).act is Act.WAIT
    # not while releasing or restoring
    assert decide(q5, live(now=50.0, state=State.RESTORING)).act is Act.WAIT
    # a quantum yield never loses the KV cache the paused generations resume on
    assert quantum_level(Level.UNLOAD) is Level.ALL
    assert quantum_level(Level.WEIGHTS) is Level.WEIGHTS and quantum_level(Level.ALL) is Level.ALL
    d = decide(SleepConfig(Level.UNLOAD, quantum=1.0), live(now=2.0))
    assert (d.act, d.level) == (Act.PROBE, Level.ALL)
    # idle: the ordinary yield probe, at the configured level
    d = decide(SleepConfig(Level.UNLOAD, quantum=1.0), live(now=2.0, busy=False))
    assert (d.act, d.reason, d.level) == (Act.PROBE, "yield", Level.UNLOAD)


def test_adaptive_grace_decision() -> None:
    cfg = SleepConfig(Level.WEIGHTS)
    # a wake with nothing in hand keeps the 100 ms grace
    d = decide(cfg, live(busy=False, woke_at=9.95))
    assert (d.act, d.deadline) == (Act.WAIT, pytest.approx(10.05))
    # a wake for work in hand: idle again means probe now
    d = decide(cfg, live(busy=False, woke_at=9.99, woke_in_hand=True))
    assert (d.act, d.reason) == (Act.PROBE, "yield")
    # still never while busy (quantum off)
    assert decide(cfg, live(busy=True, woke_at=9.99, woke_in_hand=True)).act is Act.WAIT


# ---- the controller on MockClock ------------------------------------------------------


async def test_a_busy_holder_yields_at_its_quantum(
    tiny_model: Path, tmp_path: Path, autojump_clock: object
) -> None:
    cfg = SleepConfig(Level.WEIGHTS, quantum=2.0)
    async with stack(tiny_model, tmp_path, cfg) as s:
        t0 = s.ctl.statistics().woke_at
        s.ctl.set_busy(True)  # requests in flight all along
        async with trio.open_nursery() as nursery:
            await trio.sleep(0.5)
            nursery.start_soon(s.other.take)  # waits from +0.5
            assert await released_at(s.residency) == pytest.approx(t0 + 2.0, abs=EPS)
        assert s.other.holding and not s.arbiter.holding
        st = s.ctl.statistics()
        assert (st.yields, st.quantum_yields) == (1, 1)
        assert s.ctl.props()["cycles"]["quantum_yields"] == 1
        assert s.ctl.arena_statistics().yields == {"idle": 0, "quantum": 1, "budget": 0, "shutdown": 0}
        # the paused work wants the model back: it waits its turn, registered
        async with trio.open_nursery() as nursery:
            nursery.start_soon(s.ctl.wait_until_no_sleep)
            await trio.sleep(1)
            assert s.arbiter.statistics().waiting and s.other.probe() is True
            s.other.give_back()
        assert s.residency.state is State.RESIDENT and s.arbiter.holding


async def test_a_waiter_that_comes_late_is_served_at_the_next_probe(
    tiny_model: Path, tmp_path: Path, autojump_clock: object
) -> None:
    """Resident far longer than the quantum: a waiter makes a busy holder yield at
    the first probe after it registered (10 ms cadence), not a quantum later."""
    cfg = SleepConfig(Level.WEIGHTS, quantum=1.0)
    async with stack(tiny_model, tmp_path, cfg) as s:
        s.ctl.set_busy(True)
        await trio.sleep(30.0001)
        registered = trio.current_time()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(s.other.take)
            t = await released_at(s.residency)
        assert registered < t <= registered + cfg.probe_interval + EPS
        s.other.give_back()


async def test_the_quantum_yield_waits_for_the_pass_in_flight(
    tiny_model: Path, tmp_path: Path, autojump_clock: object
) -> None:
    """Decided under a forward pass: no new pass starts, and the release begins the
    instant the pass in flight has returned, never underneath it."""
    cfg = SleepConfig(Level.WEIGHTS, quantum=1.0)
    async with stack(tiny_model, tmp_path, cfg) as s:
        t0 = s.ctl.statistics().woke_at
        s.ctl.set_busy(True)
        pass_done = trio.Event()
        log: list[tuple[str, float]] = []

        async def long_pass() -> None:
            async with s.ctl.resident():
                await trio.sleep_until(t0 + 3.0)  # a pass that spans the quantum
                log.append(("pass ended", trio.current_time()))
            pass_done.set()

        async def next_pass() -> None:
            await trio.sleep_until(t0 + 1.5)  # after the yield was decided
            async with s.ctl.resident():
                log.append(("next pass", trio.current_time()))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(long_pass)
            nursery.start_soon(s.other.take)
            nursery.start_soon(next_pass)
            t_release = await released_at(s.residency)
            log.append(("release", t_release))
            await settled(s.residency, State.COLD)
            while not s.other.holding:  # its next poll (5 ms)
                await trio.sleep(0.001)
            await trio.sleep(1)
            s.other.give_back()
        assert [what for what, _ in log] == ["pass ended", "release", "next pass"]
        assert t_release == pytest.approx(t0 + 3.0, abs=EPS)
        assert s.ctl.statistics().quantum_yields == 1


async def test_a_quantum_yield_is_withdrawn_if_the_waiter_left(
    tiny_model: Path, tmp_path: Path, autojump_clock: object
) -> None:
    cfg = SleepConfig(Level.WEIGHTS, quantum=1.0)
    async with stack(tiny_model, tmp_path, cfg) as s:
        t0 = s.ctl.statistics().woke_at
        s.ctl.set_busy(True)
        async with trio.open_nursery() as nursery:

            async def a_pass() -> None:
                async with s.ctl.resident():
                    await trio.sleep_until(t0 + 2.0)

            nursery.start_soon(a_pass)
            with trio.move_on_at(t0 + 1.5):
                await s.other.take()  # seen at +1.0, gone at +1.5, before the pass ends
        await trio.sleep(0.1)
        assert s.residency.state is State.RESIDENT and s.arbiter.holding
        st = s.ctl.statistics()
        assert (st.yields, st.quantum_withdrawn) == (0, 1)
        async with s.ctl.resident():  # passes go on
            pass


@pytest.mark.parametrize("level", [Level.WEIGHTS, Level.ALL, Level.UNLOAD])
async def test_a_paused_generation_resumes_unchanged(
    tiny_model: Path, tmp_path: Path, autojump_clock: object, level: Level
) -> None:
    """Greedy decode of 12 tokens with a quantum yield in the middle (another process
    holds the GPU meanwhile) gives the logits of an uninterrupted run, bit for bit:
    the KV cache stayed (weights) or went through the host and back (all, and unload,
    whose quantum yields are made at all)."""
    prompt = np.arange(1, 9, dtype=np.int32)

    async def decode(s: object, pause_at: int | None) -> list[np.ndarray]:
        rows = []
        pos = 0
        tokens = prompt
        for step in range(12):
            async with s.ctl.resident():  # type: ignore[attr-defined]
                logits = await s.client.forward([SeqBatch(0, tokens, pos)])  # type: ignore[attr-defined]
            rows.append(logits[-1])
            pos += len(tokens)
            tokens = np.array([int(np.argmax(logits[-1]))], dtype=np.int32)
            if step == pause_at:
                s.nursery.start_soon(s.other.take)  # type: ignore[attr-defined]
                await s.residency.wait_for(lambda st: st is State.COLD)  # type: ignore[attr-defined]
                while not s.other.holding:  # type: ignore[attr-defined]
                    await trio.sleep(0.001)  # its next poll
                s.nursery.start_soon(_give_back_later, s.other)  # type: ignore[attr-defined]
        return rows

    async def _give_back_later(other: object) -> None:
        await trio.sleep(0.5)
        other.give_back()  # type: ignore[attr-defined]

    async with stack(tiny_model, tmp_path, SleepConfig(level)) as s:
        expected = await decode(s, None)
    cfg = SleepConfig(level, quantum=0.01)
    async with stack(tiny_model, tmp_path, cfg) as s:
        s.ctl.set_busy(True)
        got = await decode(s, 5)
        st = s.ctl.statistics()
        assert st.quantum_yields == 1 and st.wakes == 1
        assert s.residency.statistics().unloads == 0  # never lost the cache
    for a, b in zip(expected, got, strict=True):
        np.testing.assert_array_equal(a, b)


async def test_adaptive_grace_a_wake_for_work_in_hand_yields_when_done(
    tiny_model: Path, tmp_path: Path, autojump_clock: object
) -> None:
    async with stack(tiny_model, tmp_path, SleepConfig(Level.WEIGHTS)) as s:
        await s.ctl.request_sleep(None)
        # a request in hand (the queue reports busy) wakes the model, with a waiter
        s.ctl.set_busy(True)
        await s.ctl.wait_until_no_sleep()
        woke = s.ctl.statistics().woke_at
        assert s.ctl.statistics().woke_in_hand
        async with trio.open_nursery() as nursery:
            nursery.start_soon(s.other.take)
            await trio.sleep(0.02)
            assert s.residency.state is State.RESIDENT  # busy: never while the work runs
            s.ctl.set_busy(False)  # the work is done, 20 ms after the wake
            done = trio.current_time()
            t = await released_at(s.residency)
        assert t == pytest.approx(done, abs=EPS) and t < woke + 0.1 - EPS
        s.other.give_back()
        # a wake with nothing in hand (POST /wake_up) keeps the 100 ms grace
        await s.ctl.request_wake()
        woke = s.ctl.statistics().woke_at
        assert not s.ctl.statistics().woke_in_hand
        async with trio.open_nursery() as nursery:
            nursery.start_soon(s.other.take)
            assert await released_at(s.residency) == pytest.approx(woke + 0.1, abs=EPS)
        s.other.give_back()


async def test_arena_statistics(tiny_model: Path, tmp_path: Path, autojump_clock: object) -> None:
    async with stack(tiny_model, tmp_path, SleepConfig(Level.WEIGHTS, quantum=5)) as s:
        t0 = trio.current_time()
        await trio.sleep(2)
        a = s.ctl.arena_statistics()
        assert a.active and a.resident and a.quantum == 5 and a.acquisitions == 1
        assert a.held_seconds >= 2 - EPS
        async with trio.open_nursery() as nursery:
            nursery.start_soon(s.other.take)
            await settled(s.residency, State.COLD)
        await trio.sleep(1)
        a = s.ctl.arena_statistics()
        assert not a.resident and a.yields["idle"] == 1
        held = a.held_seconds
        await trio.sleep(1)
        assert s.ctl.arena_statistics().held_seconds == held  # not holding: no time counts
        async with trio.open_nursery() as nursery:
            nursery.start_soon(s.ctl.wait_until_no_sleep)
            await trio.sleep(0.3)
            s.other.give_back()
        a = s.ctl.arena_statistics()
        assert a.acquisitions == 2 and a.restored_bytes > 0
        # two takes (the load, the wake); the wake waited ~0.3 s: bucket 0.5 and above
        bounds = list(a.wait_bounds)
        assert a.wait_buckets[-1] == 2
        assert a.wait_buckets[bounds.index(0.25)] == 1 and a.wait_buckets[bounds.index(0.5)] == 2
        assert 0.3 - 0.01 <= a.wait_seconds <= 0.3 + 0.01
        assert t0 < trio.current_time()


def test_metrics_render_the_arena(tiny_model: Path) -> None:
    """The prometheus-client text of ``trio_llm_arena_*`` from a statistics record."""
    from prometheus_client import CollectorRegistry, generate_latest

    from trio_llm.residency.sleep import ArenaStatistics
    from trio_llm.server.metrics import _arena_metrics

    a = ArenaStatistics(
        active=True, resident=True, quantum=5.0, acquisitions=3,
        yields={"idle": 1, "quantum": 2, "budget": 0, "shutdown": 0},
        wait_bounds=(0.01, 0.1), wait_buckets=(1, 2, 3), wait_seconds=1.25,
        held_seconds=7.5, restored_bytes=4096,
    )

    class One:
        def collect(self) -> object:
            return _arena_metrics(a)

    reg = CollectorRegistry(auto_describe=False)
    reg.register(One())  # type: ignore[arg-type]
    text = generate_latest(reg).decode()
    for line in (
        "trio_llm_arena_resident 1.0",
        "trio_llm_arena_acquisitions_total 3.0",
        'trio_llm_arena_yields_total{reason="quantum"} 2.0',
        'trio_llm_arena_yields_total{reason="idle"} 1.0',
        'trio_llm_arena_wait_seconds_bucket{le="0.01"} 1.0',
        'trio_llm_arena_wait_seconds_bucket{le="0.1"} 2.0',
        'trio_llm_arena_wait_seconds_bucket{le="+Inf"} 3.0',
        "trio_llm_arena_wait_seconds_count 3.0",
        "trio_llm_arena_wait_seconds_sum 1.25",
        "trio_llm_arena_held_seconds_total 7.5",
        "trio_llm_arena_restored_bytes_total 4096.0",
    ):
        assert line in text.splitlines(), (line, text)


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--arena-quantum", "-1"], "--arena-quantum"),
        (["--arena-quantum", "nan"], "--arena-quantum"),
        (["--arena-quantum", "soon"], "--arena-quantum"),
        (["--arena-budget", "1024"], "--arena-budget: needs --vram-arena"),
        (["--vram-arena", "/nonexistent/arena", "--arena-budget", "0"], "--arena-budget: invalid value '0'"),
        (["--vram-arena", "/nonexistent/arena", "--arena-budget", "lots"], "a number of MiB > 0, or auto"),
        (["--vram-arena", "/nonexistent/arena", "--arena-budget", "inf"], "--arena-budget"),
        (["--arena-pin"], "--arena-pin: needs --arena-budget"),
        (["--vram-arena", "/nonexistent/arena", "--arena-pin"], "--arena-pin: needs --arena-budget"),
        (["--arena-priority", "1000"], "--arena-priority"),
        (["--arena-priority", "high"], "--arena-priority"),
    ],
)
def test_bad_arena_flags_are_one_line(args: list[str], needle: str, capsys: pytest.CaptureFixture[str]) -> None:
    from test_flags import one_line_exit

    assert needle in one_line_exit(args, capsys)


def test_arena_quantum_reaches_the_config() -> None:
    from trio_llm.runtime import parse_config

    assert parse_config(["--arena-quantum", "0.25"], {}).arena_quantum == 0.25
    assert parse_config([], {}).arena_quantum == 5.0


def test_a_higher_priority_waiter_shortens_the_quantum() -> None:
    from trio_llm.residency.sleep import effective_quantum

    cfg = SleepConfig(Level.WEIGHTS, quantum=4.0, priority=1)
    assert effective_quantum(cfg, None) == 4.0  # nobody queued (or a fork waiter)
    assert effective_quantum(cfg, 0) == 4.0 and effective_quantum(cfg, 1) == 4.0
    assert effective_quantum(cfg, 2) == 2.0 and effective_quantum(cfg, 4) == 0.5
    d = decide(cfg, live(now=0.495, waiter_priority=4))
    assert (d.act, d.deadline) == (Act.WAIT, 0.5)
    d = decide(cfg, live(now=0.6, waiter_priority=4))
    assert (d.act, d.reason) == (Act.PROBE, "quantum")
    d = decide(cfg, live(now=3.995, waiter_priority=1))
    assert (d.act, d.deadline) == (Act.WAIT, 4.0)


async def test_a_high_priority_waiter_gets_a_busy_holder_sooner(
    tiny_model: Path, tmp_path: Path, autojump_clock: object
) -> None:
    """Quantum 4 s; a waiter two steps above us makes it 1 s (``effective_quantum``),
    read from the arena's queue; an equal one waits the whole 4 s."""
    from trio_llm.residency.arbiter import open_arbiter

    for prio, expected in ((2, 1.0), (0, 4.0)):
        waiter = await open_arbiter(tmp_path / str(prio), priority=prio)
        async with stack(tiny_model, tmp_path / str(prio), SleepConfig(Level.WEIGHTS, quantum=4.0)) as s:
            t0 = s.ctl.statistics().woke_at
            s.ctl.set_busy(True)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(waiter.take)
                t = await released_at(s.residency)
            assert t == pytest.approx(t0 + expected, abs=0.011), prio
            waiter.give_back()
        waiter.close()

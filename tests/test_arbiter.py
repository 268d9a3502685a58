"""The VRAM arbiter on real flock: in one process (two open file descriptions conflict
exactly like two processes do), across real processes (the stand-in), and under
cancellation at every await point of ``take()``."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import trio
import trio.testing

from trio_llm.errors import ArenaUnavailable
from trio_llm.residency.arbiter import ARENA_ENV, Arbiter, arena_from, open_arbiter

POLL = 0.005


async def _pair(arena: Path) -> tuple[Arbiter, Arbiter]:
    return await open_arbiter(arena), await open_arbiter(arena)


async def test_take_give_back_and_statistics(tmp_path: Path) -> None:
    arb = await open_arbiter(tmp_path / "arena")
    assert arb.active
    assert (tmp_path / "arena" / "token.lock").exists()
    assert (tmp_path / "arena" / "want.lock").exists()
    arb.take_nowait()
    assert arb.holding
    assert arb.probe() is False
    with pytest.raises(RuntimeError):
        arb.take_nowait()
    arb.give_back()
    await arb.take()
    arb.give_back()
    stats = arb.statistics()
    assert (stats.takes, stats.gives, stats.contended_takes) == (2, 2, 0)
    assert (stats.probes, stats.probes_positive, stats.holding, stats.waiting) == (1, 0, False, False)
    arb.close()
    arb.close()
    with pytest.raises(trio.ClosedResourceError):
        arb.take_nowait()


async def test_take_nowait_would_block_leaves_no_trace(tmp_path: Path) -> None:
    a, b = await _pair(tmp_path)
    a.take_nowait()
    with pytest.raises(trio.WouldBlock):
        b.take_nowait()
    assert a.probe() is False  # a failed take_nowait never registers as a waiter
    assert not b.holding
    a.close()
    b.take_nowait()
    assert b.holding
    b.close()


async def test_waiter_is_seen_and_gets_the_token(tmp_path: Path, autojump_clock: object) -> None:
    a, b = await _pair(tmp_path)
    a.take_nowait()
    got_at: list[float] = []

    async def waiter() -> None:
        await b.take()
        got_at.append(trio.current_time())

    async with trio.open_nursery() as nursery:
        nursery.start_soon(waiter)
        await trio.testing.wait_all_tasks_blocked()
        assert b.statistics().waiting
        assert a.probe() is True
        await trio.sleep(1.0)
        assert a.probe() is True  # still waiting: state, not an event
        released_at = trio.current_time()
        a.give_back()
    assert b.holding
    # the waiter polls every 5 ms, so it wins within one interval of the release
    assert released_at <= got_at[0] <= released_at + POLL
    assert a.probe() is False  # want.lock dropped once the token is ours
    with pytest.raises(trio.WouldBlock):
        a.take_nowait()
    stats = b.statistics()
    assert (stats.contended_takes, stats.waiting) == (1, False)
    assert stats.wait_seconds == pytest.approx(got_at[0])
    a.close()
    b.close()


@pytest.mark.parametrize("steps", range(-1, 5))
@pytest.mark.parametrize("free_token_at_cancel", [False, True])
async def test_cancelled_take_leaves_nothing_behind(
    tmp_path: Path, mock_clock: trio.testing.MockClock, steps: int, free_token_at_cancel: bool
) -> None:
    """Cancel ``take()`` before its first checkpoint (steps=-1) and after each poll."""
    a, b = await _pair(tmp_path)
    a.take_nowait()
    done = trio.Event()

    async def waiter(scope: trio.CancelScope) -> None:
        with scope:
            await b.take()
        done.set()

    scope = trio.CancelScope()
    if steps == -1:
        scope.cancel()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(waiter, scope)
        for _ in range(max(steps, 0)):
            await trio.testing.wait_all_tasks_blocked()
            assert a.probe() is True
            mock_clock.jump(POLL)
        await trio.testing.wait_all_tasks_blocked()
        if free_token_at_cancel:
            a.give_back()  # the token is free when the cancellation lands
        scope.cancel()
        await done.wait()
    assert scope.cancelled_caught
    stats = b.statistics()
    assert not stats.holding and not stats.waiting and stats.takes == 0
    assert a.probe() is False  # want.lock was dropped on the way out
    if a.holding:
        a.give_back()
    # the kernel agrees: nobody waits, and the token is not held by b
    probe = await open_arbiter(tmp_path)
    probe.take_nowait()
    assert probe.probe() is False
    probe.close()
    for arb in (a, b):
        arb.close()


async def test_disabled_and_unusable_arena(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    off = await open_arbiter(None)
    assert not off.active
    await off.take()
    assert off.holding and off.probe() is False
    off.give_back()
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    with caplog.at_level(logging.WARNING, logger="trio_llm.residency.arbiter"):
        arb = await open_arbiter(blocker / "arena")
    assert "without cross-process coordination" in caplog.text
    assert not arb.active and arb.statistics().arena == str(blocker / "arena")
    arb.take_nowait()
    assert arb.probe() is False
    arb.close()


async def test_read_only_arena_is_uncoordinated(tmp_path: Path) -> None:
    arena = tmp_path / "ro"
    arena.mkdir()
    (arena / "token.lock").touch(mode=0o444)
    (arena / "want.lock").touch(mode=0o444)
    arena.chmod(0o555)
    try:
        arb = await open_arbiter(arena)
        if os.geteuid() == 0:
            assert arb.active  # root writes anyway; coordination still works
        else:
            assert not arb.active
        await arb.take()
        assert arb.holding
        arb.close()
    finally:
        arena.chmod(0o755)


async def test_a_failing_flock_is_a_typed_error(tmp_path: Path) -> None:
    """A flock that fails for another reason than contention (here: a descriptor
    closed behind the arbiter's back, as a broken mount would) is ArenaUnavailable."""
    arb = await open_arbiter(tmp_path)
    os.close(arb._probe_fd)  # fault injection on the real descriptor
    with pytest.raises(ArenaUnavailable):
        arb.probe()
    arb._probe_fd = -1  # already closed above
    arb.close()


def test_arena_from_flag_and_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv(ARENA_ENV, raising=False)
    assert arena_from(None) is None
    monkeypatch.setenv(ARENA_ENV, str(tmp_path / "env"))
    assert arena_from(None) == tmp_path / "env"
    assert arena_from(str(tmp_path / "flag")) == tmp_path / "flag"


# ---- real processes -------------------------------------------------------------


class StandIn:
    """A ``python -m trio_llm.residency.standin`` process and its event lines."""

    def __init__(self, arena: Path, *args: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(Path(__file__).with_name("standin.py")), "--arena", str(arena), *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )

    async def expect(self, word: str) -> None:
        assert self.proc.stdout is not None
        line = await trio.to_thread.run_sync(self.proc.stdout.readline)
        assert line.strip() == word

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    async def finish(self) -> int:
        return await trio.to_thread.run_sync(self.proc.wait)


async def test_standin_waits_while_we_hold(tmp_path: Path) -> None:
    arb = await open_arbiter(tmp_path)
    arb.take_nowait()
    other = StandIn(tmp_path, "--hold", "0")
    with trio.fail_after(20):
        await other.expect("waiting")
        while not arb.probe():  # registration and our probe race by a few µs
            await trio.sleep(0.001)
        assert other.proc.poll() is None  # still waiting: we hold the token
        arb.give_back()
        await other.expect("token")
        await other.expect("released")
        assert await other.finish() == 0
    assert arb.probe() is False
    arb.close()


async def test_standin_holder_yields_to_our_take(tmp_path: Path) -> None:
    other = StandIn(tmp_path, "--yield-when-wanted", "--hold", "60")
    arb = await open_arbiter(tmp_path)
    with trio.fail_after(20):
        await other.expect("waiting")
        await other.expect("token")
        await arb.take()  # the stand-in probes want.lock, sees us and yields
        await other.expect("released")
        assert await other.finish() == 0
    assert arb.holding
    arb.close()


async def test_sigkill_of_a_holder_hands_the_token_to_the_waiter(tmp_path: Path) -> None:
    other = StandIn(tmp_path, "--hold", "60")
    arb = await open_arbiter(tmp_path)
    with trio.fail_after(20):
        await other.expect("waiting")
        await other.expect("token")
        async with trio.open_nursery() as nursery:
            nursery.start_soon(arb.take)
            await trio.sleep(0.05)
            assert not arb.holding
            other.kill()
    assert arb.holding
    arb.close()


async def test_sigkill_of_a_waiter_clears_the_probe(tmp_path: Path) -> None:
    arb = await open_arbiter(tmp_path)
    arb.take_nowait()
    other = StandIn(tmp_path, "--hold", "0")
    with trio.fail_after(20):
        await other.expect("waiting")
        while not arb.probe():
            await trio.sleep(0.001)
        other.kill()
    assert arb.probe() is False  # the kernel dropped the dead waiter's want.lock
    assert other.proc.returncode == -signal.SIGKILL
    arb.close()

"""First-come and priority among waiters (issue 16): the ticket queue in
``ARENA/queue/``. The order is pure and tested as such; the rest runs real flock,
in one process ("another process" is another ``Arbiter`` on the same arena: its
own open file descriptions conflict exactly as across processes) and across real
processes (a waiter SIGKILLed in the queue)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import trio
import trio.testing

from trio_llm.residency.arbiter import SKIP_AFTER, Arbiter, open_arbiter
from trio_llm.residency.queue import QUEUE_DIR, Queue, is_head, parse_ticket, rank, ticket_name

STANDIN = [sys.executable, str(Path(__file__).with_name("standin.py"))]


def test_order_is_priority_then_arrival() -> None:
    assert parse_ticket(ticket_name(-3, 42, 77)) == (-3, 42, 77)
    assert parse_ticket("seq") is None and parse_ticket(".77-42.tmp") is None
    assert rank(1, 99) < rank(0, 1) < rank(0, 2) < rank(-1, 0)
    assert is_head(rank(0, 5), [rank(0, 6), rank(-1, 1)])
    assert not is_head(rank(0, 5), [rank(0, 4)])
    assert not is_head(rank(0, 5), [rank(1, 9)])
    assert is_head(rank(0, 5), [])


async def _takes_in_order(arena: Path, waiters: list[Arbiter], holder: Arbiter) -> list[int]:
    """Start each waiter's take in list order (each registered before the next),
    then free the token; the order in which they get it, each giving back at once."""
    got: list[int] = []

    async def wait(i: int, arb: Arbiter) -> None:
        await arb.take()
        got.append(i)
        await trio.sleep(0.05)  # hold a moment, then let the next one in
        arb.give_back()

    async with trio.open_nursery() as nursery:
        for i, arb in enumerate(waiters):
            nursery.start_soon(wait, i, arb)
            await trio.sleep(0.0013)  # registered (and ticketed) in this order
        await trio.sleep(0.1)
        holder.give_back()
    return got


async def test_first_come_first_served(tmp_path: Path, autojump_clock: object) -> None:
    """Four waiters, in several arrival orders: always served in arrival order, not in
    the kernel's (any poller that tries first would win without the queue)."""
    arbs = [await open_arbiter(tmp_path) for _ in range(5)]
    holder, waiters = arbs[0], arbs[1:]
    try:
        for order in ([0, 1, 2, 3], [3, 2, 1, 0], [2, 0, 3, 1]):
            holder.take_nowait()
            got = await _takes_in_order(tmp_path, [waiters[k] for k in order], holder)
            assert got == [0, 1, 2, 3], order
        assert all(a.statistics().takes == 3 for a in waiters)
        assert sum(a._overtakes for a in arbs) == 0
        assert os.listdir(tmp_path / QUEUE_DIR) == ["seq"]  # no ticket left behind
    finally:
        for a in arbs:
            a.close()


async def test_higher_priority_goes_first(tmp_path: Path, autojump_clock: object) -> None:
    holder = await open_arbiter(tmp_path)
    low = await open_arbiter(tmp_path, priority=0)
    mid = await open_arbiter(tmp_path, priority=1)
    high = await open_arbiter(tmp_path, priority=5)
    try:
        holder.take_nowait()
        # arrival: low, mid, high; served: high, mid, low
        got = await _takes_in_order(tmp_path, [low, mid, high], holder)
        assert got == [2, 1, 0]
        holder.take_nowait()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(low.take)
            nursery.start_soon(high.take)
            await trio.sleep(0.05)
            assert holder.waiting_priority() == 5  # what a holder's quantum reads
            holder.give_back()
            while not high.holding:
                await trio.sleep(0.001)
            high.give_back()
        assert low.holding
        low.give_back()
        assert holder.waiting_priority() is None
    finally:
        for a in (holder, low, mid, high):
            a.close()


async def test_a_frozen_head_is_overtaken_after_the_skip(tmp_path: Path, autojump_clock: object) -> None:
    """A live ticket whose owner never takes the free token (SIGSTOPped, or dead
    slow) holds the next waiter up for ``SKIP_AFTER`` only."""
    frozen = Queue.open(tmp_path, 0o600)
    arb = await open_arbiter(tmp_path)
    try:
        ticket = frozen.enqueue(priority=0)
        assert ticket is not None
        t0 = trio.current_time()
        await arb.take()
        waited = trio.current_time() - t0
        assert SKIP_AFTER <= waited <= SKIP_AFTER + 0.011
        assert arb._overtakes == 1
        frozen.leave(ticket)
    finally:
        frozen.close()
        arb.close()


async def test_cancelled_take_leaves_no_ticket(tmp_path: Path, autojump_clock: object) -> None:
    holder = await open_arbiter(tmp_path)
    arb = await open_arbiter(tmp_path)
    try:
        holder.take_nowait()
        with trio.move_on_after(0.5):
            await arb.take()
        assert [n for n in os.listdir(tmp_path / QUEUE_DIR) if n != "seq"] == []
        assert holder.probe() is False and not arb.holding
    finally:
        holder.close()
        arb.close()


WAITER = """
import sys, trio
from trio_llm.residency.arbiter import open_arbiter
async def main():
    arb = await open_arbiter(sys.argv[1])
    async with trio.open_nursery() as n:
        n.start_soon(arb.take)
        await trio.sleep(0.05)
        print("queued", flush=True)
        await trio.sleep_forever()
trio.run(main)
"""


async def test_sigkill_of_a_queued_waiter_repairs_the_queue(tmp_path: Path) -> None:
    """Real processes: a waiter ahead of us in the queue is SIGKILLed. Its ticket's
    lock died with it, so the ticket is recognised as dead and removed, and we get
    the token at once when it comes free (no skip delay); the stand-in (a fork-like
    waiter, no ticket) still sees and is seen exactly as before."""
    holder = await open_arbiter(tmp_path)
    holder.take_nowait()
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1] / "src")}
    child = await trio.lowlevel.open_process(
        [sys.executable, "-c", WAITER, str(tmp_path)], stdout=subprocess.PIPE, env=env
    )
    arb = await open_arbiter(tmp_path)
    try:
        assert child.stdout is not None
        with trio.fail_after(30):
            assert b"queued" in await child.stdout.receive_some()
        tickets = [n for n in os.listdir(tmp_path / QUEUE_DIR) if n.endswith(".ticket")]
        assert len(tickets) == 1 and holder.waiting_priority() == 0
        async with trio.open_nursery() as nursery:
            nursery.start_soon(arb.take)
            await trio.sleep(0.1)
            assert len(os.listdir(tmp_path / QUEUE_DIR)) == 3  # seq + two tickets
            child.send_signal(signal.SIGKILL)
            await child.wait()
            await trio.sleep(0.05)
            holder.give_back()
            t0 = trio.current_time()
            with trio.fail_after(10):
                while not arb.holding:
                    await trio.sleep(0.001)
            assert trio.current_time() - t0 < SKIP_AFTER  # the dead head did not hold us up
        assert arb._overtakes == 0
        assert os.listdir(tmp_path / QUEUE_DIR) == ["seq"]  # the dead ticket was removed
        # a fork-like waiter: no ticket, the same two files as ever
        standin = await trio.lowlevel.open_process(
            [*STANDIN, "--arena", str(tmp_path), "--hold", "0"], stdout=subprocess.PIPE
        )
        with trio.fail_after(10):
            while not arb.probe():
                await trio.sleep(0.01)
        assert arb.waiting_priority() is None  # waiters, but none queued: a fork
        arb.give_back()
        with trio.fail_after(10):
            assert await standin.wait() == 0
    finally:
        if child.returncode is None:
            child.kill()
        holder.close()
        arb.close()


async def test_a_file_in_the_way_of_the_queue_is_one_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    (tmp_path / QUEUE_DIR).write_text("a file in the way")
    arb = await open_arbiter(tmp_path)
    try:
        assert arb.active and arb._queue is None
        await arb.take()  # the arena works, in no particular order
        assert arb.holding
        lines = [r.getMessage() for r in caplog.records if "waiting queue" in r.getMessage()]
        assert len(lines) == 1 and "no particular order" in lines[0]
    finally:
        arb.close()


async def test_the_queue_follows_the_arena_permission_policy(tmp_path: Path) -> None:
    """Private arena: queue/ 0700 and tickets 0600; a shared (group-writable, setgid)
    arena: queue/ 2770 and 0660, whatever the umask (mkdir alone would apply it)."""
    private, shared = tmp_path / "private", tmp_path / "shared"
    private.mkdir(mode=0o700)
    shared.mkdir()
    shared.chmod(0o2770)
    old = os.umask(0o022)
    try:
        for arena, dir_mode, file_mode in ((private, 0o700, 0o600), (shared, 0o2770, 0o660)):
            holder = await open_arbiter(arena)
            arb = await open_arbiter(arena)
            holder.take_nowait()
            async with trio.open_nursery() as nursery:
                nursery.start_soon(arb.take)
                await trio.sleep(0.05)
                q = arena / QUEUE_DIR
                assert oct(q.stat().st_mode & 0o7777) == oct(dir_mode)
                for f in q.iterdir():
                    assert oct(f.stat().st_mode & 0o777) == oct(file_mode), f
                holder.give_back()
            holder.close()
            arb.close()
    finally:
        os.umask(old)

"""Co-residency under a memory budget and pin (issue 16; ``docs/arbiter.md``).

The decisions (who fits, who yields) are pure and tested without trio or files. The
rest runs real flock: in one process, where "another server" is another ``Arbiter`` on
the same arena with its own open file descriptions and its own name in the ledger
(they conflict exactly as across processes), and across real processes for every
SIGKILL (a co-resident, a queued waiter, a pinned holder) and for the reference
fork's stand-in.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from test_sleep import released_at
from trio_llm.errors import ArenaRefused
from trio_llm.residency.arbiter import Arbiter, Share, open_arbiter
from trio_llm.residency.ledger import (
    LEDGER_DIR,
    Member,
    decode,
    effective_budget,
    encode,
    fits,
    victims,
)

MiB = 1 << 20
STANDIN = [sys.executable, str(Path(__file__).with_name("standin.py"))]
SRC = str(Path(__file__).resolve().parents[1] / "src")
_idents = iter(range(1_000_000, 2_000_000))


def m(pid: int, mib: int, stamp: int, *, budget: int = 1000, pinned: bool = False) -> Member:
    return Member(pid, mib * MiB, budget * MiB, pinned, stamp)


# ---- the pure decisions ---------------------------------------------------------------


def test_fits_under_the_smallest_budget() -> None:
    two = [m(1, 40, 1), m(2, 30, 2)]
    assert fits(two, 30 * MiB, 100 * MiB)
    assert not fits(two, 31 * MiB, 100 * MiB)
    # a member that believes the device is smaller wins: safe, not fast
    assert effective_budget([m(1, 40, 1, budget=80)], 100 * MiB) == 80 * MiB
    assert not fits([m(1, 40, 1, budget=80)], 41 * MiB, 100 * MiB)
    assert fits([], 100 * MiB, 100 * MiB) and not fits([], 101 * MiB, 100 * MiB)


def test_victims_are_the_fewest_least_recently_used_first() -> None:
    members = [m(1, 30, stamp=5), m(2, 30, stamp=1), m(3, 60, stamp=9)]  # 120 of 100 would be over
    assert victims(members, 10 * MiB, 200 * MiB) == ()  # fits already: nobody yields
    # 40 MiB to free: one 30 is not enough, the 60 alone is (fewest beats oldest)
    assert victims(members, 20 * MiB, 100 * MiB) == (3,)
    # 20 MiB to free: any one does; the least recently used (stamp 1) goes
    assert victims(members, 20 * MiB, 120 * MiB) == (2,)
    # 70 MiB to free: two are needed; the pair with the least recently used first
    assert victims(members, 50 * MiB, 100 * MiB) == (2, 3)
    # more than all of them hold: nobody yields for a hopeless waiter
    assert victims(members, 200 * MiB, 100 * MiB) is None


def test_pinned_members_never_yield_and_shrink_the_budget_for_the_rest() -> None:
    pin = m(1, 50, stamp=0, pinned=True)  # the oldest, and still never chosen
    members = [pin, m(2, 30, stamp=3), m(3, 20, stamp=4)]
    assert victims(members, 30 * MiB, 100 * MiB) == (2,)
    assert victims(members, 50 * MiB, 100 * MiB) == (2, 3)
    assert victims(members, 51 * MiB, 100 * MiB) is None  # 51 + 50 pinned > 100
    many = [m(i, 1, stamp=100 - i) for i in range(2, 30)]  # beyond the exhaustive search: greedy, LRU first
    assert victims([pin, *many], 25 * MiB, 100 * MiB) == (29, 28, 27)


def test_records_round_trip() -> None:
    data = encode(123, 456, True, 7)
    assert decode(42, data) == Member(42, 123, 456, True, 7)
    assert len(encode(1, 2, False, 3)) == len(data)  # fixed width: a stamp update is one pwrite
    assert decode(42, b"") is None and decode(42, b"junk") is None


# ---- real flock, one process ----------------------------------------------------------


async def member(arena: Path, mib: float, budget: float = 100, *, pinned: bool = False,
                 priority: int = 0) -> Arbiter:
    return await open_arbiter(arena, share=Share(int(mib * MiB), int(budget * MiB), pinned),
                              ident=next(_idents), priority=priority)


def ledger_names(arena: Path) -> list[str]:
    return sorted(n for n in os.listdir(arena / LEDGER_DIR) if n.endswith(".member"))


async def until(pred: object, timeout: float = 10.0) -> None:
    with trio.fail_after(timeout):
        while not pred():  # type: ignore[operator]
            await trio.sleep(0.001)


async def test_two_that_fit_are_resident_together_and_nobody_yields(
    tmp_path: Path, autojump_clock: object
) -> None:
    a, b = await member(tmp_path, 40), await member(tmp_path, 50)
    try:
        await a.take()
        t0 = trio.current_time()
        await b.take()  # joins at once: a never saw a waiter
        assert trio.current_time() - t0 < 0.001
        assert a.holding and b.holding
        assert not a.probe() and not b.probe()
        assert len(ledger_names(tmp_path)) == 2
        assert a.statistics().coresident and b.statistics().members == 2
        b.give_back()
        assert len(ledger_names(tmp_path)) == 1
    finally:
        a.close()
        b.close()
    assert ledger_names(tmp_path) == []


async def test_coresidents_never_take_each_others_probe_for_a_waiter(tmp_path: Path) -> None:
    """A probe holds want.lock exclusively for an instant: two co-residents probing at
    once would each see the other as a waiter and yield for nobody (seen as a flaky
    idle yield of the real servers). The probe mutex serialises them: a probe that
    meets another in flight answers no, and the next one, 10 ms later, decides."""
    import fcntl

    a, b = await member(tmp_path, 10), await member(tmp_path, 10)
    try:
        await a.take()
        await b.take()
        assert a._ledger is not None
        with a._ledger.probing():  # a's probe, in flight
            fcntl.flock(a._probe_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            assert not b.probe()
            fcntl.flock(a._probe_fd, fcntl.LOCK_UN)
        assert not a.probe() and not b.probe()
        assert a.statistics().probes_positive == b.statistics().probes_positive == 0
    finally:
        a.close()
        b.close()


async def test_a_waiter_that_does_not_fit_makes_the_least_recently_used_yield(
    tmp_path: Path, autojump_clock: object
) -> None:
    a, b, c = await member(tmp_path, 40), await member(tmp_path, 40), await member(tmp_path, 50)
    try:
        await a.take()
        await b.take()
        a.touch()  # a used after b: b is the least recently used
        async with trio.open_nursery() as nursery:
            nursery.start_soon(c.take)
            await trio.sleep(0.05)
            assert not c.holding
            assert not a.probe()  # only one needs to go, and it is b
            assert b.probe() and b.probe_reason == "budget"
            b.give_back()  # (the controller releases device memory first)
            await until(lambda: c.holding)
        assert a.holding and c.holding and not b.holding
        assert b.statistics().budget_probes == 1
    finally:
        for x in (a, b, c):
            x.close()


async def test_an_exclusive_waiter_drains_the_coresidents_and_no_one_joins_meanwhile(
    tmp_path: Path, autojump_clock: object
) -> None:
    """A server without a budget (what a fork is to us): registered on want.lock, so
    every co-resident sees it; a co-resident that fits cannot join while it waits
    (flock alone would grant the shared lock and starve it); once it holds, a
    co-resident waiter registers on want.lock so that it yields as the protocol says."""
    a, b, late = await member(tmp_path, 10), await member(tmp_path, 10), await member(tmp_path, 10)
    excl = await open_arbiter(tmp_path)
    try:
        await a.take()
        await b.take()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(excl.take)
            await trio.sleep(0.05)
            assert a.probe() and a.probe_reason == "waiter" and b.probe()
            with pytest.raises(trio.WouldBlock):
                late.take_nowait()  # it would fit, but an exclusive waiter goes first
            a.give_back()
            b.give_back()
            await until(lambda: excl.holding)
        assert not excl.probe()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(late.take)
            await until(lambda: excl.probe())  # the co-resident waiter is on want.lock now
            excl.give_back()
            await until(lambda: late.holding)
        assert not late.statistics().waiting
        assert not late.probe()  # and it dropped want.lock on the way in
    finally:
        for x in (a, b, late, excl):
            x.close()


async def test_a_cancelled_coresident_take_leaves_nothing_behind(tmp_path: Path, autojump_clock: object) -> None:
    """Cancelled while registered on want.lock (an exclusive holder in the way) and
    while queued for room (co-residents in the way): no registration, no ticket, no
    member file, no token: the arbiter is as before the take."""
    excl = await open_arbiter(tmp_path)
    big = await member(tmp_path, 80)
    c = await member(tmp_path, 50)
    try:
        await excl.take()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(c.take)
            await trio.sleep(0.3)
            assert excl.probe()  # registered: the exclusive holder sees it
            nursery.cancel_scope.cancel()
        assert not c.holding and not c.statistics().waiting
        assert not excl.probe()  # the registration went with the cancel
        excl.give_back()
        await big.take()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(c.take)  # does not fit beside big: queued
            await trio.sleep(0.3)
            assert big.probe() and big.probe_reason == "budget"
            nursery.cancel_scope.cancel()
        assert not c.holding and not big.probe()  # its ticket is gone: nobody to make room for
        assert [n for n in os.listdir(tmp_path / "queue") if n.endswith(".ticket")] == []
        assert len(ledger_names(tmp_path)) == 1  # big's only
    finally:
        for x in (excl, big, c):
            x.close()


async def test_pinned_never_yields_and_pins_that_do_not_fit_are_refused(
    tmp_path: Path, autojump_clock: object, caplog: pytest.LogCaptureFixture
) -> None:
    pin = await member(tmp_path, 60, pinned=True)
    other = await member(tmp_path, 30)
    big = await member(tmp_path, 40)
    second_pin = await member(tmp_path, 50, pinned=True)
    excl = await open_arbiter(tmp_path)
    try:
        await pin.take()
        await other.take()
        with pytest.raises(ArenaRefused, match=r"--arena-pin: 50.0 MiB pinned here and 60.0 MiB pinned by pid"):
            second_pin.take_nowait()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(big.take)  # 60 pinned + 40 fits only without `other`
            await trio.sleep(0.05)
            assert not pin.probe()
            assert other.probe() and other.probe_reason == "budget"
            other.give_back()
            await until(lambda: big.holding)
            big.give_back()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(excl.take)
            await trio.sleep(0.05)
            assert not pin.probe() and not pin.probe()  # an exclusive waiter: still no
            assert sum("pinned: an exclusive waiter" in r.getMessage() for r in caplog.records) == 1
            nursery.cancel_scope.cancel()
    finally:
        for x in (pin, other, big, second_pin, excl):
            x.close()


async def test_a_head_that_can_never_fit_beside_the_pins_holds_nobody_up(
    tmp_path: Path, autojump_clock: object, caplog: pytest.LogCaptureFixture
) -> None:
    """First come is the rule, but a head that cannot fit even if every non-pinned
    member left (50 MiB beside a 60 MiB pin in 100) makes nobody yield, so it would
    hold up everyone behind it for as long as the pin runs: the next one, which fits,
    goes ahead; the hopeless one logs why it waits, and gets in once the pin is gone."""
    pin = await member(tmp_path, 60, pinned=True)
    hopeless, small = await member(tmp_path, 50), await member(tmp_path, 30)
    try:
        await pin.take()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(hopeless.take)
            await trio.sleep(0.05)
            nursery.start_soon(small.take)  # queued behind it
            await until(lambda: small.holding)
            assert not hopeless.holding and small._overtakes == 1
            assert any("do not fit beside 60.0 MiB of pinned models" in r.getMessage() for r in caplog.records)
            small.give_back()
            pin.give_back()
            await until(lambda: hopeless.holding)
    finally:
        for x in (pin, hopeless, small):
            x.close()


async def test_an_unusable_arena_with_a_budget_runs_uncoordinated(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A file where the arena should be: one line, and the server runs uncoordinated
    (every take succeeds at once), budget or not, as without one."""
    arena = tmp_path / "arena"
    arena.write_text("not a directory")
    a = await member(arena, 10)
    try:
        assert not a.active and not a.coresident
        await a.take()
        assert a.holding and not a.probe()
        lines = [r.getMessage() for r in caplog.records if "cannot use arena" in r.getMessage()]
        assert len(lines) == 1 and lines[0].endswith("running without cross-process coordination")
    finally:
        a.close()


async def test_a_file_in_the_way_of_the_ledger_means_taking_turns(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    (tmp_path / LEDGER_DIR).write_text("in the way")
    a = await member(tmp_path, 10)
    try:
        assert a.active and not a.coresident
        await a.take()  # exclusive, as without --arena-budget
        assert a.holding and not a.statistics().coresident
        lines = [r.getMessage() for r in caplog.records if "co-residency is off" in r.getMessage()]
        assert len(lines) == 1 and "takes turns (exclusive)" in lines[0]
    finally:
        a.close()


async def test_the_ledger_follows_the_arena_permission_policy(tmp_path: Path) -> None:
    """Private arena: ledger/ 0700 and its files 0600; a shared (group-writable,
    setgid) arena: 2770 and 0660, whatever the umask; nothing open to other users."""
    private, shared = tmp_path / "private", tmp_path / "shared"
    private.mkdir(mode=0o700)
    shared.mkdir()
    shared.chmod(0o2770)
    old = os.umask(0o022)
    try:
        for arena, dir_mode, file_mode in ((private, 0o700, 0o600), (shared, 0o2770, 0o660)):
            a = await member(arena, 10)
            await a.take()
            d = arena / LEDGER_DIR
            assert oct(d.stat().st_mode & 0o7777) == oct(dir_mode)
            files = list(d.iterdir())
            assert {f.name for f in files} >= {"lock", "probe"} and len(ledger_names(arena)) == 1
            for f in files:
                assert oct(f.stat().st_mode & 0o777) == oct(file_mode), f
            a.close()
    finally:
        os.umask(old)


# ---- real processes -------------------------------------------------------------------

CHILD = """
import sys, trio
from trio_llm.residency.arbiter import Share, open_arbiter
MiB = 1 << 20
async def main():
    arena, mib, pinned = sys.argv[1], float(sys.argv[2]), sys.argv[3] == "pin"
    arb = await open_arbiter(arena, share=Share(int(mib * MiB), 100 * MiB, pinned))
    async with trio.open_nursery() as n:
        n.start_soon(arb.take)
        while not arb.holding and not arb.statistics().waiting:
            await trio.sleep(0.005)
        await trio.sleep(0.05)
        print("holding" if arb.holding else "queued", flush=True)
        await trio.sleep_forever()
trio.run(main)
"""


async def child(arena: Path, mib: float, pin: bool = False) -> tuple[trio.Process, str]:
    proc = await trio.lowlevel.open_process(
        [sys.executable, "-c", CHILD, str(arena), str(mib), "pin" if pin else "-"],
        stdout=subprocess.PIPE, env={**os.environ, "PYTHONPATH": SRC},
    )
    return proc, await Lines(proc).next()


class Lines:
    """Whole lines from a child's stdout (a pipe delivers them in any chunks)."""

    def __init__(self, proc: trio.Process) -> None:
        assert proc.stdout is not None
        self._stream, self._buf = proc.stdout, b""

    async def next(self) -> str:
        with trio.fail_after(30):
            while b"\n" not in self._buf:
                chunk = await self._stream.receive_some()
                if not chunk:
                    return ""
                self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return line.decode()


async def kill(proc: trio.Process) -> None:
    proc.send_signal(signal.SIGKILL)
    await proc.wait()


@pytest.mark.parametrize("pin", [False, True], ids=["co-resident", "pinned"])
async def test_sigkill_of_a_coresident_repairs_the_ledger(tmp_path: Path, pin: bool) -> None:
    """A co-resident (or a pinned holder) is SIGKILLed: its shared hold and its member
    file's lock die with it; the waiter that did not fit beside it finds the member
    dead, removes it, and joins: nothing stranded, the budget right again."""
    proc, line = await child(tmp_path, 60, pin)
    a = await member(tmp_path, 30)
    waiter = await member(tmp_path, 50)
    try:
        assert line == "holding"
        await a.take()  # 60 + 30 fit
        assert len(ledger_names(tmp_path)) == 2
        async with trio.open_nursery() as nursery:
            nursery.start_soon(waiter.take)  # 50 fits only once the 60 is gone
            await trio.sleep(0.1)
            assert not waiter.holding
            # unpinned, the 60 is the one to go (it never does: a test child); pinned,
            # nobody can make room (30 < 40 needed): a stays either way
            assert not a.probe()
            await kill(proc)
            with trio.fail_after(10):
                while not waiter.holding:
                    await trio.sleep(0.005)
        assert a.holding and waiter.holding
        assert len(ledger_names(tmp_path)) == 2  # a and the waiter; the dead one removed
        assert not any(n.startswith(f"{proc.pid}-") for n in ledger_names(tmp_path))
    finally:
        if proc.returncode is None:
            await kill(proc)
        a.close()
        waiter.close()


async def test_sigkill_of_a_queued_coresident_waiter(tmp_path: Path) -> None:
    """A waiter that does not fit makes the least recently used yield; SIGKILLed while
    queued, its ticket is dead, and nobody yields for it any more."""
    a, b = await member(tmp_path, 40), await member(tmp_path, 40)
    try:
        await a.take()
        await b.take()
        proc, line = await child(tmp_path, 50)
        assert line == "queued"
        assert a.probe() and a.probe_reason == "budget"  # a joined first: least recently used
        await kill(proc)
        assert not a.probe() and not b.probe()
        assert [n for n in os.listdir(tmp_path / "queue") if n.endswith(".ticket")] == []
    finally:
        a.close()
        b.close()


async def test_the_standin_joins_a_coresident_arena(tmp_path: Path) -> None:
    """The reference fork's stand-in beside two co-residents: it registers on want.lock
    and blocks in LOCK_EX; both co-residents see it; it gets the token once they are
    gone (not before: their shared holds exclude it); while it holds, a co-resident
    waiter is on want.lock, so the stand-in yields to it like to any waiter."""
    a, b = await member(tmp_path, 40), await member(tmp_path, 40)
    standin = await trio.lowlevel.open_process(
        [*STANDIN, "--arena", str(tmp_path), "--hold", "60", "--yield-when-wanted"], stdout=subprocess.PIPE
    )
    out = Lines(standin)
    try:
        await a.take()
        await b.take()
        assert await out.next() == "waiting"
        with trio.fail_after(10):
            while not (a.probe() and b.probe()):
                await trio.sleep(0.01)
        assert a.probe_reason == "waiter"
        a.give_back()
        await trio.sleep(0.1)  # one shared hold is enough to keep it out
        assert b.probe()
        b.give_back()
        assert await out.next() == "token"
        with trio.fail_after(10):
            await a.take()  # registers while the stand-in holds exclusively: it yields
        assert a.holding
        assert await out.next() == "released"
        with trio.fail_after(10):
            assert await standin.wait() == 0
    finally:
        if standin.returncode is None:
            standin.kill()
        a.close()
        b.close()


# ---- the flags at start-up ------------------------------------------------------------


def test_start_up_figures_and_refusals(tiny_model: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """What ``--arena-budget`` and ``--arena-pin`` bring, read before the token is taken:
    the footprint is ``--fit``'s projection; bad input is one line."""
    from trio_llm.runtime import arena_share, parse_config

    base = ["-m", str(tiny_model), "--vram-arena", str(tmp_path), "-c", "512"]
    share = arena_share(parse_config([*base, "--backend", "numpy", "--arena-budget", "64", "--arena-pin"], {}))
    assert share is not None and share.pinned and share.budget == 64 * MiB
    bigger = arena_share(parse_config([*base, "-c", "4096", "--backend", "numpy", "--arena-budget", "64"], {}))
    assert bigger is not None and bigger.footprint - share.footprint == 3584 * 1024  # the KV of 3584 positions
    assert arena_share(parse_config([*base, "--backend", "numpy"], {})) is None  # no budget: take turns
    # auto on numpy: one line, and this server takes turns
    assert arena_share(parse_config([*base, "--backend", "numpy", "--arena-budget", "auto"], {})) is None
    assert any("numpy backend has no device budget" in r.getMessage() and "takes turns" in r.getMessage()
               for r in caplog.records)
    with pytest.raises(ArenaRefused, match=r"^--arena-budget: the model needs 8\.\d MiB on the device, more than "
                                           r"the 1\.0 MiB budget$"):
        arena_share(parse_config([*base, "--backend", "numpy", "--arena-budget", "1"], {}))


def test_a_budget_beyond_the_device_is_refused(tiny_model: Path, tmp_path: Path) -> None:
    from trio_llm.engine import fit
    from trio_llm.errors import ConfigError
    from trio_llm.runtime import arena_share, parse_config

    device = fit.device_memory()
    if device is None:
        pytest.skip("no Vulkan device here (lavapipe is missing)")
    base = ["-m", str(tiny_model), "--vram-arena", str(tmp_path), "-c", "512", "--backend", "vulkan"]
    too_much = device.heap_bytes // MiB + 1
    with pytest.raises(ConfigError, match=rf"^--arena-budget {too_much} MiB is more than the device's "):
        arena_share(parse_config([*base, "--arena-budget", str(too_much)], {}))
    auto = arena_share(parse_config([*base, "--arena-budget", "auto", "--fit-target", "256"], {}))
    assert auto is not None and auto.budget == device.budget_bytes - 256 * MiB


async def test_serve_refuses_a_pin_that_does_not_fit_beside_the_pins(tiny_model: Path, tmp_path: Path) -> None:
    """End to end: a pinned member holds 60 of the 64 MiB; ``trio-llm serve --arena-pin``
    with an 8 MiB model exits 1 with one line naming both, before loading anything."""
    pin = await member(tmp_path, 60, budget=64, pinned=True)
    try:
        await pin.take()
        proc = await trio.run_process(
            [sys.executable, "-m", "trio_llm", "serve", "-m", str(tiny_model), "-c", "512", "--backend", "numpy",
             "--port", "0", "--vram-arena", str(tmp_path), "--arena-budget", "64", "--arena-pin", "--log-disable"],
            capture_stdout=True, capture_stderr=True, check=False, env={**os.environ, "PYTHONPATH": SRC},
        )
        err = proc.stderr.decode().strip().splitlines()
        assert proc.returncode == 1, err
        assert len(err) == 1 and err[0].startswith("trio-llm serve: error: --arena-pin: 8.2 MiB pinned here and "
                                                   "60.0 MiB pinned by pid"), err
        assert len(ledger_names(tmp_path)) == 1  # nothing left behind by the refused server
    finally:
        pin.close()


# ---- real servers ---------------------------------------------------------------------


@pytest.mark.slow
async def test_three_servers_of_which_two_fit(tiny_model: Path, tmp_path: Path) -> None:
    """Real ``trio-llm serve`` processes, budget 18 MiB: a and b (8.2 MiB each at -c 512)
    fit together and never swap; c (15.7 MiB at -c 8192) fits beside neither, so its
    load makes both yield (reason budget), and a request to a then makes c yield while
    b joins a without anybody yielding."""
    from test_arbiter_servers import start

    arena = ("--arena-budget", "18", "--metrics", "--sleep-mode", "weights")
    a = await start(tiny_model, tmp_path, "-c", "512", *arena)
    b = await start(tiny_model, tmp_path, "-c", "512", *arena)
    servers = [a, b]
    try:
        for s in (a, b):
            res = await s.residency()
            assert res["state"] == "resident" and res["token_held"] and res["arbiter"]["coresident"]
        for i in range(6):  # alternating: no hand-off, nobody yields
            await (a if i % 2 else b).complete(f"question {i}")
        for s in (a, b):
            res = await s.residency()
            assert res["state"] == "resident" and res["cycles"]["yields"] == 0, res
        c = await start(tiny_model, tmp_path, "-c", "8192", *arena)
        servers.append(c)
        for s in (a, b):
            res = await s.until(lambda r: r["state"] == "cold", "yields to c")
            assert res["cycles"]["budget_yields"] == 1
        assert (await c.residency())["state"] == "resident"
        await a.complete("back to a")  # c must go; a alone
        res_c = await c.until(lambda r: r["state"] == "cold", "c yields to a")
        assert res_c["cycles"]["budget_yields"] == 1
        await b.complete("and b")  # joins a: nobody yields
        assert (await a.residency())["state"] == "resident"
        assert (await a.residency())["cycles"]["budget_yields"] == 1
        metrics = (await a.http.get("/metrics")).text
        assert 'trio_llm_arena_yields_total{reason="budget"} 1.0' in metrics
        assert "trio_llm_arena_coresident 1.0" in metrics
        assert "trio_llm_arena_budget_bytes 1.8874368e+07" in metrics
    finally:
        for s in servers:
            code, err = await s.stop()
            assert code == 0, err[-2000:]
    assert ledger_names(tmp_path) == []


# ---- the controller on MockClock ------------------------------------------------------


@contextlib.asynccontextmanager
async def controller(model: Path, arena: Path, cfg: object,
                     share: Share) -> AsyncIterator[tuple[Any, Arbiter, Any]]:
    """The sleep controller of a co-resident server (numpy backend, real arbiter),
    resident after its coordinated load; every thread call happens before it starts."""
    from trio_llm.engine.actor import BackendActor
    from trio_llm.engine.reference import NumpyBackend
    from trio_llm.model.gguf import load_gguf
    from trio_llm.residency.residency import Residency
    from trio_llm.residency.sleep import SleepController

    arbiter = await open_arbiter(arena, share=share, ident=next(_idents))
    await arbiter.take()
    gg = load_gguf(model)
    backend = NumpyBackend(gg, n_ctx=64, n_seq=1)
    gg.close()
    actor = BackendActor(backend)
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(actor.run)
            residency = Residency(actor.client())
            await nursery.start(residency.run)
            ctl = SleepController(cfg, residency, arbiter)  # type: ignore[arg-type]
            await nursery.start(ctl.run)
            yield ctl, arbiter, residency
            nursery.cancel_scope.cancel()
    finally:
        backend.close()
        arbiter.close()


async def test_a_busy_coresident_makes_room_at_its_quantum(
    tiny_model: Path, tmp_path: Path, autojump_clock: object
) -> None:
    """Chosen to make room (the least recently used) while busy: the yield comes at
    the quantum, at a step boundary, and is counted as a budget yield."""
    from trio_llm.engine.backend import Level
    from trio_llm.residency.residency import State
    from trio_llm.residency.sleep import SleepConfig

    cfg = SleepConfig(Level.WEIGHTS, quantum=2.0)
    other = await member(tmp_path, 40)
    waiter = await member(tmp_path, 50)
    try:
        async with controller(tiny_model, tmp_path, cfg, Share(40 * MiB, 100 * MiB)) as (ctl, arb, res):
            t0 = ctl.statistics().woke_at
            await other.take()  # fits beside us
            ctl.set_busy(True)  # requests in flight all along
            other.touch()  # used after us: we are the least recently used
            async with trio.open_nursery() as nursery:
                nursery.start_soon(waiter.take)
                await trio.sleep(1.0)
                assert arb.holding and not waiter.holding  # not before the quantum
                # the release begins at the quantum's probe (the release itself runs on a
                # worker thread, where autojump moves the clock on)
                assert await released_at(res) == pytest.approx(t0 + 2.0, abs=1e-9)
                with trio.fail_after(5):
                    while not waiter.holding:
                        await trio.sleep(0.001)
            assert ctl.statistics().state is State.COLD and not arb.holding
            assert ctl.arena_statistics().yields == {"idle": 0, "quantum": 0, "budget": 1, "shutdown": 0}
            assert other.holding  # the fewest: only we made room
            stats = ctl.arena_statistics()
            assert stats.coresident and stats.footprint_bytes == 40 * MiB and stats.budget_bytes == 100 * MiB
    finally:
        other.close()
        waiter.close()


async def test_a_pinned_server_never_yields_under_the_controller(
    tiny_model: Path, tmp_path: Path, autojump_clock: object
) -> None:
    from trio_llm.engine.backend import Level
    from trio_llm.residency.residency import State
    from trio_llm.residency.sleep import SleepConfig

    cfg = SleepConfig(Level.WEIGHTS, quantum=0.5)
    excl = await open_arbiter(tmp_path)
    big = await member(tmp_path, 60)
    try:
        async with controller(tiny_model, tmp_path, cfg, Share(50 * MiB, 100 * MiB, pinned=True)) as (ctl, arb, _):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(big.take)  # does not fit beside the pin: nobody can make room
                nursery.start_soon(excl.take)  # an exclusive waiter: a pin does not yield to it either
                ctl.set_busy(True)
                await trio.sleep(3.0)
                ctl.set_busy(False)
                await trio.sleep(3.0)
                assert ctl.statistics().state is State.RESIDENT and arb.holding
                assert ctl.statistics().yields == 0 and arb.statistics().probes > 100
                nursery.cancel_scope.cancel()
    finally:
        excl.close()
        big.close()


async def start_listening(model: Path, arena: Path, *extra: str) -> Any:
    """A server whose load may wait for the token: returned once its port is bound."""
    import re

    from test_arbiter_servers import SERVE, Server

    proc = await trio.lowlevel.open_process(
        [*SERVE, "-m", str(model), "--vram-arena", str(arena), *extra], stderr=subprocess.PIPE
    )
    assert proc.stderr is not None
    buf = b""
    with trio.fail_after(60):
        while not (m := re.search(rb"listening on (http://\S+)", buf)):
            chunk = await proc.stderr.receive_some()
            assert chunk, buf.decode()
            buf += chunk
    return Server(proc, m.group(1).decode(), [])


@pytest.mark.slow
async def test_sigkill_of_a_pinned_server_lets_the_big_one_load(tiny_model: Path, tmp_path: Path) -> None:
    """p (8.2 MiB, pinned) and x (15.7 MiB) do not fit 18 MiB together, and a pin never
    yields: x's coordinated load waits (its /health says loading). SIGKILL p: its shared
    hold and its member file's lock die with it, x finds it dead, loads and answers."""
    from test_arbiter_servers import start

    p = await start(tiny_model, tmp_path, "-c", "512", "--arena-budget", "18", "--arena-pin")
    x = await start_listening(tiny_model, tmp_path, "-c", "8192", "--arena-budget", "18")
    try:
        await trio.sleep(1.0)
        assert (await x.http.get("/health")).status_code == 503  # still waiting for room
        assert len(ledger_names(tmp_path)) == 1
        p.proc.send_signal(signal.SIGKILL)
        await p.proc.wait()
        with trio.fail_after(60):
            while (await x.http.get("/health")).status_code != 200:
                await trio.sleep(0.05)
        assert (await x.complete("after the pin"))["content"] is not None
        names = ledger_names(tmp_path)
        assert len(names) == 1 and names[0].startswith(f"{x.proc.pid}-")  # p's entry removed
    finally:
        await p.http.aclose()
        if p.proc.returncode is None:  # the test failed before the kill
            p.proc.kill()
            await p.proc.wait()
        code, err = await x.stop()
        assert code == 0, err[-2000:]


@pytest.mark.slow
async def test_sigkill_of_a_busy_coresident_lets_the_waiter_in(tiny_model: Path, tmp_path: Path) -> None:
    """Budget 24 MiB: a (15.7 MiB at -c 8192) streams and b (8.2) idles beside it; c
    (15.7) asks. The fewest that make room is a alone (b alone is too small), and b
    stays resident beside c afterwards; but a is busy, and its quantum (600 s) is far
    off, so c waits. SIGKILL a: its member is found dead, c joins beside b and answers.
    Nobody yielded for nothing, nothing is stranded, the ledger is b and c."""
    from test_arbiter_servers import start

    # a's quantum counts from its load: 30 s ran out before c asked inside a loaded full suite
    budget = ("--arena-budget", "24", "--arena-quantum", "600")
    c = await start(tiny_model, tmp_path, "-c", "8192", *budget)
    a = await start(tiny_model, tmp_path, "-c", "8192", *budget)  # c makes room (15.7 + 15.7 > 24)
    b = await start(tiny_model, tmp_path, "-c", "512", *budget)  # joins a (23.9 <= 24)
    try:
        await c.until(lambda r: r["state"] == "cold", "c made room for a")
        # far longer than the test needs it, even at a few thousand tokens a second
        body = {"prompt": "A long story:", "n_predict": 8000, "ignore_eos": True, "stream": True}
        async with trio.open_nursery() as nursery:

            async def stream() -> None:
                with pytest.raises(httpx.HTTPError):  # the process dies under it
                    async with a.http.stream("POST", "/completion", json=body) as r:
                        async for _ in r.aiter_lines():
                            pass

            nursery.start_soon(stream)
            await a.until(lambda r: r["state"] == "resident", "a streams")
            await trio.sleep(0.3)

            async def ask_c() -> None:
                answer = await c.complete("while a streams")
                assert answer["content"] is not None

            nursery.start_soon(ask_c)
            await trio.sleep(0.8)
            assert (await c.residency())["state"] == "cold"  # a, busy, still in the way
            assert (await b.residency())["state"] == "resident"  # b is not chosen: too small alone
            a.proc.send_signal(signal.SIGKILL)
            await a.proc.wait()
        assert (await c.residency())["state"] == "resident"
        res_b = await b.residency()
        assert res_b["state"] == "resident" and res_b["cycles"]["yields"] == 0
        names = ledger_names(tmp_path)
        assert sorted(n.split("-")[0] for n in names) == sorted(str(s.proc.pid) for s in (b, c)), names
        await b.complete("b again")  # beside c: nobody yields
        assert (await c.residency())["cycles"]["budget_yields"] == 1  # only the one for a's load
    finally:
        await a.http.aclose()
        if a.proc.returncode is None:  # the test failed before the kill: no server left behind
            a.proc.kill()
            await a.proc.wait()
        for s in (b, c):
            code, err = await s.stop()
            assert code == 0, err[-2000:]

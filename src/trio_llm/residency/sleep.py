"""The sleep controller: *when* the model leaves the device and comes back.

Implements ``trio_llm.server.gate.ResidencyGate`` over a ``Residency`` (what is
where) and an ``Arbiter`` (who may be resident). See ``docs/residency.md``.

Inbox: ``set_busy`` from the task queue (a task queued, assigned or in a slot);
``resident()`` around every forward pass of the slots loop; ``wait_until_no_sleep``/
``request_wake`` (callers that need the model resident) and ``request_sleep``
(``POST /sleep``), each of which registers live *demand* for as long as its caller
waits.
Outbox: residency commands (release/restore) and arbiter calls, all from the one
``run`` task; a change broadcast the waiters re-check on.

Invariants:
- One task (``run``) decides and runs every transition; every decision is a pure
  function (``decide``) of live state read at that moment: busy, demand, the
  residency state, the clock, and the kernel's want.lock (the probe). No flag is
  latched to fire later, so a wake can never trigger a stale release.
- Resident iff the token is held, at every point where no transition is running
  (asserted under ``__debug__``): a wake takes the token before restoring, a sleep
  releases before giving the token back.
- Never sleeps under a forward pass. Sleeps only when idle (no task in the server,
  nobody waiting for the model), with one exception, the *quantum* (issue 16): a
  holder resident for ``quantum`` seconds with a waiter on want.lock yields at the
  next step boundary with requests in flight; the release begins only after the
  pass in flight has returned, and is withdrawn if a re-probe finds nobody waiting.
  A quantum yield keeps the KV cache (at ``unload`` it releases at ``all``).
- Never yields within ``grace`` (100 ms) of a wake that had no work in hand (the
  request that woke us is not queued yet); a wake for work in hand (busy when it
  became resident) has no grace: it may yield the moment that work is done.
- A forward pass and a release exclude each other. ``resident()`` registers the pass
  in the same step (no checkpoint) that finds the model resident and no release
  decided; ``run`` marks a release as decided in the same step that decides it, before
  the first checkpoint on the way to the residency actor. So a pass either started
  first (and the release is not decided until it ends) or waits for the wake.
- Idle time is measured from the last moment the engine went idle (or woke): time
  spent busy never counts, and the idle timer is a deadline re-armed on every
  change, not a poll. The one poll is the 10 ms probe of want.lock while idle and
  resident with an arena, because the state it reads is a kernel lock.
"""

from __future__ import annotations

import itertools
import logging
import math
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from enum import StrEnum
from typing import Any

import attrs
import trio

from trio_llm.engine.backend import Level
from trio_llm.errors import (
    ArenaRefused,
    ArenaUnavailable,
    BackendError,
    InvalidRequest,
    TrioLLMError,
)
from trio_llm.residency.arbiter import WAIT_BUCKETS, Arbiter
from trio_llm.residency.residency import DEPTH, Residency, State

log = logging.getLogger(__name__)

PROBE_INTERVAL = 0.010
GRACE = 0.100


@attrs.frozen
class SleepConfig:
    level: Level  # --sleep-mode (see residency.resolve_level)
    idle_seconds: float | None = None  # --sleep-idle-seconds; None (or < 0 on the CLI): off
    probe_interval: float = PROBE_INTERVAL
    grace: float = GRACE
    cleanup_timeout: float = 10.0  # bound on the shielded cleanup at shutdown
    #: after a yield, how long a wake lets the processes we yielded to take the token
    #: first (see ``SleepController._let_waiters_go_first``)
    handoff_window: float = 0.5
    #: --arena-quantum: after this long resident, a waiter makes us yield even while
    #: busy, at the next step boundary; 0: yield only when idle (the protocol's rule)
    quantum: float = 0.0
    #: --arena-priority: a queued waiter of higher priority than ours shortens our
    #: quantum, halving it for each step of difference (``effective_quantum``)
    priority: int = 0


def effective_quantum(cfg: SleepConfig, waiter_priority: int | None) -> float:
    """The quantum against the highest-priority queued waiter: ``quantum`` against an
    equal or lower one (or a reference-fork waiter, which has no priority), halved
    for every step it ranks above us."""
    if waiter_priority is None or waiter_priority <= cfg.priority:
        return cfg.quantum
    return cfg.quantum / 2 ** min(waiter_priority - cfg.priority, 30)


def quantum_level(level: Level) -> Level:
    """The level of a quantum yield: the configured one, but never one that loses the
    KV cache, since the paused generations resume on it (``unload`` → ``all``)."""
    return Level.ALL if level is Level.UNLOAD else level


# ---- the decision: a pure function of live state --------------------------------------


class Act(StrEnum):
    WAKE = "wake"  # take the token, restore
    SLEEP = "sleep"  # release, give the token back
    PROBE = "probe"  # ask the arbiter whether anybody waits (then yield or keep)
    WAIT = "wait"  # nothing to do until a change or ``deadline``


@attrs.frozen
class Live:
    now: float
    state: State
    busy: bool  # a task queued, assigned or in a slot (the task queue's report)
    demand: int  # tasks waiting for the model to be resident
    sleep_request: Level | None  # deepest level asked for by pending POST /sleep callers
    idle_since: float  # when the engine last went idle (or the model last woke)
    woke_at: float  # when the model last became resident
    last_probe: float
    arbiter_active: bool
    passes: int = 0  # forward passes in flight (inside ``resident()``)
    #: the last wake had work in hand (busy when it became resident): no grace
    woke_in_hand: bool = False
    #: the highest priority among queued trio-llm waiters (None: none queued)
    waiter_priority: int | None = None


@attrs.frozen
class Decision:
    act: Act
    level: Level | None = None
    reason: str = ""
    deadline: float = math.inf  # for WAIT: re-decide no later than this


def decide(cfg: SleepConfig, live: Live) -> Decision:
    """What the controller does next. Reasons of a PROBE: ``yield`` (idle, the
    protocol's yield) and ``quantum`` (busy, resident for the quantum); of a SLEEP:
    ``requested`` and ``idle``."""
    if live.state in (State.COLD, State.UNLOADED):
        return Decision(Act.WAKE, reason="demand") if live.demand else Decision(Act.WAIT)
    if live.state is not State.RESIDENT:
        return Decision(Act.WAIT)
    if live.busy or live.passes or live.demand:
        # invariant 3: a busy holder yields only for the quantum, and the caller
        # releases only at a step boundary (``SleepController._quantum_yield``)
        if not (live.arbiter_active and cfg.quantum > 0):
            return Decision(Act.WAIT)
        quantum = effective_quantum(cfg, live.waiter_priority)
        probe_at = max(live.woke_at + quantum, live.last_probe + cfg.probe_interval)
        if live.now >= probe_at:
            return Decision(Act.PROBE, quantum_level(cfg.level), "quantum")
        # re-decide every probe interval: a higher-priority waiter queueing meanwhile
        # shortens the quantum, and no other event would tell us
        return Decision(Act.WAIT, deadline=min(probe_at, live.now + cfg.probe_interval))
    if live.sleep_request is not None:
        return Decision(Act.SLEEP, live.sleep_request, "requested")
    deadline = math.inf
    if cfg.idle_seconds is not None:
        idle_deadline = live.idle_since + cfg.idle_seconds
        if live.now >= idle_deadline:
            return Decision(Act.SLEEP, cfg.level, "idle")
        deadline = idle_deadline
    if live.arbiter_active:
        grace = 0.0 if live.woke_in_hand else cfg.grace
        probe_at = max(live.woke_at + grace, live.last_probe + cfg.probe_interval)
        if live.now >= probe_at:
            return Decision(Act.PROBE, cfg.level, "yield")
        deadline = min(deadline, probe_at)
    return Decision(Act.WAIT, deadline=deadline)


# ---- the controller ----------------------------------------------------------------


@attrs.frozen
class SleepStatistics:
    state: State
    busy: bool
    passes: int  # forward passes in flight
    demand: int
    token_held: bool
    wakes: int
    idle_sleeps: int
    yields: int  # yields to a waiter, idle or quantum
    quantum_yields: int  # of those, at a step boundary with work in flight (for a waiter on want.lock)
    quantum_withdrawn: int  # quantum yields decided, then the waiter had gone
    requested_sleeps: int
    wake_failures: int
    last_wake_seconds: float  # demand seen → resident (token wait + restore)
    woke_at: float  # trio time the model last became resident (start-up counts)
    last_sleep_seconds: float  # decision → released and token given back
    woke_in_hand: bool  # the last wake had work in hand (no grace after it)
    quantum: float  # --arena-quantum (0: off)
    budget_yields: int = 0  # yields to make room for a co-resident waiter that did not fit


@attrs.frozen
class ArenaStatistics:
    """What ``/metrics`` shows of the arena (``trio_llm_arena_*``; docs/arbiter.md)."""

    active: bool  # coordinating through an arena
    resident: bool
    quantum: float
    acquisitions: int  # tokens taken (the coordinated load counts)
    yields: dict[str, int]  # by reason: idle, quantum, budget, shutdown
    wait_bounds: tuple[float, ...]  # the histogram's upper bounds (then +Inf)
    wait_buckets: tuple[int, ...]  # take() calls, cumulative per bound, the last: all
    wait_seconds: float
    held_seconds: float
    restored_bytes: int
    coresident: bool = False  # co-residency on (--arena-budget)
    pinned: bool = False  # --arena-pin
    footprint_bytes: int = 0
    budget_bytes: int = 0
    members: int = 0  # co-residents in the ledger at the last read


@attrs.define(eq=False)
class SleepController:
    """The ``ResidencyGate`` of a server with idle sleep and/or an arena.

    Start-up order (coordinated load): ``await arbiter.take()`` before the backend
    uploads its weights, then start ``Residency.run`` and this ``run``; the model
    starts resident and holding the token. Shutdown: cancelling ``run`` drops any
    pending want.lock registration and, when cold, the token; a resident model's
    token is given back by ``Arbiter.close()`` after the backend has freed its
    device memory (invariant 1 holds through shutdown too).
    """

    _cfg: SleepConfig
    _residency: Residency
    _arbiter: Arbiter
    _busy: bool = False
    _passes: int = 0  # forward passes in flight (``resident()``)
    _leaving: bool = False  # a release is decided and not over: no pass may start
    _demand_by_gen: dict[int, int] = attrs.field(factory=dict)  # failure_gen → waiters
    _sleep_requests: dict[int, Level] = attrs.field(factory=dict)
    _request_ids: itertools.count[int] = attrs.field(factory=itertools.count)
    _sleep_gen: int = 0  # sleeps done; POST /sleep callers wait for it to move
    _failure: BaseException | None = None
    _failure_gen: int = 0
    _idle_since: float = 0.0
    _woke_at: float = -math.inf
    _last_probe: float = -math.inf
    _yielded_at: float = -math.inf
    _changed: trio.Event = attrs.field(factory=trio.Event)
    _wakes: int = 0
    _idle_sleeps: int = 0
    _yields: int = 0
    _quantum_yields: int = 0
    _quantum_withdrawn: int = 0
    _budget_yields: int = 0
    _woke_in_hand: bool = False
    _shutdown_gives: int = 0
    _waiter_priority: int | None = None  # cached ``Arbiter.waiting_priority()``
    _waiter_priority_at: float = -math.inf
    _requested_sleeps: int = 0
    _wake_failures: int = 0
    _last_wake: float = 0.0
    _last_sleep: float = 0.0

    # -- the gate (called by the slots loop and the HTTP edge) --

    async def wait_until_no_sleep(self) -> None:
        """Return once the model is resident and no release is decided, waking it if
        needed. Cancellable: a cancelled caller withdraws its demand (the wake stops if
        nobody else wants it). Raises the backend's error if the wake it waited for
        failed. Returns in the step that saw the model usable (no checkpoint after the
        check), which ``resident()`` relies on."""
        await trio.lowlevel.checkpoint()
        if self._usable():
            return
        gen = self._failure_gen
        self._demand_by_gen[gen] = self._demand_by_gen.get(gen, 0) + 1
        self._notify()
        try:
            # re-ask on every wake-up: the loop may have slept again since the last
            # change, and only the live state says whether we can go
            while not self._usable():
                if self._failure_gen != gen and self._failure is not None:
                    raise self._failure
                await self._changed.wait()
        finally:
            self._demand_by_gen[gen] -= 1
            if not self._demand_by_gen[gen]:
                del self._demand_by_gen[gen]
            self._notify()

    @asynccontextmanager
    async def resident(self) -> AsyncIterator[None]:
        """Hold the model resident for one forward pass: wait (waking it) like
        ``wait_until_no_sleep``, then no release can begin until the block exits."""
        await self.wait_until_no_sleep()
        # the same step as the check that found the model usable: a release decided
        # from now on sees this pass; one decided before it made the check fail
        self._passes += 1
        try:
            yield
        finally:
            self._passes -= 1
            if not self._passes:
                self._notify()  # the controller may be waiting for the pass to end

    def _usable(self) -> bool:
        return self._residency.state is State.RESIDENT and not self._leaving

    @property
    def _demand(self) -> int:
        """Waiters that still expect a wake: those that registered before the last
        failed wake have their answer (the error) and no longer count, so a failing
        restore is not retried on their behalf."""
        return self._demand_by_gen.get(self._failure_gen, 0)

    def set_busy(self, busy: bool) -> None:
        if busy == self._busy:
            return
        self._busy = busy
        if not busy:
            self._idle_since = trio.current_time()
        elif self._arbiter.holding:
            self._arbiter.touch()  # a co-resident's last use (least recently used yields first)
        self._notify()

    def is_sleeping(self) -> bool:
        return not self._usable()

    async def request_sleep(self, level: str | None) -> None:
        """``POST /sleep``: release now, or as soon as the engine is idle. Returns once a
        sleep has happened (or at once if the model is already released)."""
        try:
            lvl = Level(level) if level else self._cfg.level
        except ValueError:
            choices = ", ".join(x.value for x in Level)
            raise InvalidRequest(f"unknown sleep level {level!r} (one of: {choices})") from None
        await trio.lowlevel.checkpoint()
        if self._residency.state is not State.RESIDENT:
            return
        key = next(self._request_ids)
        gen = self._sleep_gen
        self._sleep_requests[key] = lvl
        self._notify()
        try:
            while self._sleep_gen == gen and self._residency.state is State.RESIDENT:
                await self._changed.wait()
        finally:
            # withdrawn with its caller: a request nobody waits for must not fire later
            self._sleep_requests.pop(key, None)
            self._notify()

    def kv_epoch(self) -> int:
        """Releases that lost the KV cache (level unload); the slots loop drops its
        prompt caches when this moves (see ``server/gate.py``)."""
        return self._residency.statistics().unloads

    async def request_wake(self) -> None:
        """``POST /wake_up``: the same as a request that needs the model."""
        await self.wait_until_no_sleep()

    # -- readers --

    def statistics(self) -> SleepStatistics:
        return SleepStatistics(
            state=self._residency.state,
            busy=self._busy,
            passes=self._passes,
            demand=self._demand,
            token_held=self._arbiter.holding,
            wakes=self._wakes,
            idle_sleeps=self._idle_sleeps,
            yields=self._yields,
            quantum_yields=self._quantum_yields,
            quantum_withdrawn=self._quantum_withdrawn,
            requested_sleeps=self._requested_sleeps,
            wake_failures=self._wake_failures,
            last_wake_seconds=self._last_wake,
            woke_at=self._woke_at,
            last_sleep_seconds=self._last_sleep,
            woke_in_hand=self._woke_in_hand,
            quantum=self._cfg.quantum,
            budget_yields=self._budget_yields,
        )

    def arena_statistics(self) -> ArenaStatistics:
        res = self._residency.statistics()
        arb = self._arbiter.statistics()
        return ArenaStatistics(
            active=arb.active,
            resident=res.state is State.RESIDENT,
            quantum=self._cfg.quantum,
            acquisitions=arb.takes,
            yields={
                "idle": self._yields - self._quantum_yields - self._budget_yields,
                "quantum": self._quantum_yields,
                "budget": self._budget_yields,
                "shutdown": self._shutdown_gives,
            },
            wait_bounds=WAIT_BUCKETS,
            wait_buckets=arb.wait_buckets,
            wait_seconds=arb.wait_seconds,
            held_seconds=arb.held_seconds,
            restored_bytes=res.restored_bytes,
            coresident=arb.coresident,
            pinned=arb.pinned,
            footprint_bytes=arb.footprint_bytes,
            budget_bytes=arb.budget_bytes,
            members=arb.members,
        )

    def props(self) -> dict[str, Any]:
        res = self._residency.statistics()
        arb = self._arbiter.statistics()
        return {
            "state": res.state.value,
            "level": res.level.value if res.level is not None else None,
            "sleep_mode": self._cfg.level.value,
            "sleep_enabled": True,
            "sleep_idle_seconds": self._cfg.idle_seconds,
            "device_bytes": res.device_bytes,
            "device_bytes_total": sum(res.device_bytes.values()),
            "token_held": arb.holding,
            "arbiter": {
                "active": arb.active,
                "arena": arb.arena,
                "waiting": arb.waiting,
                "probes": arb.probes,
                "contended_takes": arb.contended_takes,
                "quantum": self._cfg.quantum,
                "priority": self._cfg.priority,
                "acquisitions": arb.takes,
                "held_seconds": arb.held_seconds,
                "wait_seconds": arb.wait_seconds,
                "grace_waived": self._woke_in_hand,
                "coresident": arb.coresident,
                "pinned": arb.pinned,
                "footprint_bytes": arb.footprint_bytes,
                "budget_bytes": arb.budget_bytes,
                "members": arb.members,
            },
            "cycles": {
                "releases": res.releases,
                "restores": res.restores,
                "wakes": self._wakes,
                "idle_sleeps": self._idle_sleeps,
                "yields": self._yields,
                "quantum_yields": self._quantum_yields,
                "quantum_withdrawn": self._quantum_withdrawn,
                "budget_yields": self._budget_yields,
                "requested_sleeps": self._requested_sleeps,
                "failures": res.failures,
            },
            "restored_bytes": res.restored_bytes,
            "last_release_seconds": res.last_release_seconds,
            "last_restore_seconds": res.last_restore_seconds,
            "last_wake_seconds": self._last_wake,
        }

    # -- the task --

    def _notify(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    def _live(self) -> Live:
        request = max(self._sleep_requests.values(), key=DEPTH.__getitem__, default=None)
        return Live(
            now=trio.current_time(),
            state=self._residency.state,
            busy=self._busy,
            demand=self._demand,
            sleep_request=request,
            idle_since=self._idle_since,
            woke_at=self._woke_at,
            last_probe=self._last_probe,
            arbiter_active=self._arbiter.active,
            passes=self._passes,
            woke_in_hand=self._woke_in_hand,
            waiter_priority=self._queued_priority(),
        )

    def _queued_priority(self) -> int | None:
        """The top priority in the arena's queue, re-read at most once per probe
        interval, and only where it can matter: busy and resident, with a quantum."""
        cfg = self._cfg
        if not (cfg.quantum > 0 and self._arbiter.active and self._residency.state is State.RESIDENT
                and (self._busy or self._passes)):
            return None
        now = trio.current_time()
        if now - self._waiter_priority_at >= cfg.probe_interval:
            self._waiter_priority_at = now
            self._waiter_priority = self._arbiter.waiting_priority()
        return self._waiter_priority

    def _check_invariant(self) -> None:
        if __debug__:
            resident = self._residency.state is State.RESIDENT
            assert resident == self._arbiter.holding, (
                f"resident iff token held: state {self._residency.state.value}, "
                f"holding {self._arbiter.holding}"
            )

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Decide and act until cancelled. Expects the coordinated load to be done:
        the model resident and the token held."""
        now = trio.current_time()
        self._idle_since = self._woke_at = now
        self._check_invariant()
        task_status.started()
        try:
            while True:
                changed = self._changed
                decision = decide(self._cfg, self._live())
                if decision.act is Act.WAKE:
                    await self._wake()
                elif decision.act is Act.SLEEP:
                    assert decision.level is not None
                    await self._sleep(decision.level, decision.reason)
                elif decision.act is Act.PROBE:
                    self._last_probe = trio.current_time()
                    if self._probe():
                        assert decision.level is not None
                        if decision.reason == "quantum":
                            await self._quantum_yield(decision.level)
                        else:
                            await self._sleep(decision.level, self._yield_reason(decision.reason))
                else:
                    self._check_invariant()
                    with trio.move_on_at(decision.deadline):
                        await changed.wait()
        finally:
            with trio.CancelScope(shield=True), trio.move_on_after(self._cfg.cleanup_timeout):
                await self._shutdown()

    def _yield_reason(self, reason: str) -> str:
        """A yield made for a co-resident waiter that did not fit is a ``budget`` yield."""
        return "budget" if self._arbiter.probe_reason == "budget" else reason

    def _probe(self) -> bool:
        try:
            return self._arbiter.probe()
        except ArenaUnavailable as exc:
            # keep the GPU rather than crash: waiters still get it on our idle sleep
            log.warning("VRAM arbiter: probe failed (%s); not yielding", exc)
            return False

    def _wake_failed(self, exc: Exception) -> None:
        """Hand the error to the requests waiting for this wake; they stop counting as
        demand, so a failing wake is not retried in a loop on their behalf. The error
        they get is always a ``TrioLLMError`` (an unexpected ``OSError`` or ``ValueError``
        of a reload is wrapped), which is what the slots loop answers requests with;
        anything else would escape it and end the server."""
        self._wake_failures += 1
        if not isinstance(exc, TrioLLMError):
            exc = BackendError(f"{type(exc).__name__}: {exc}")
        self._failure = exc
        self._failure_gen += 1
        self._notify()

    async def _wake(self) -> None:
        t0 = trio.current_time()
        try:
            if not self._arbiter.holding and not await self._take_while_demanded():
                return  # everyone who wanted the model went away while we waited
        except (ArenaUnavailable, ArenaRefused) as exc:
            log.error("VRAM arbiter: cannot take the token: %s", exc)
            self._wake_failed(exc)
            return
        try:
            await self._residency.restore()
        except Exception as exc:
            # leave as we came: released (the residency state was repaired), token back
            log.error("residency: restore failed: %s", exc)
            self._arbiter.give_back()
            self._wake_failed(exc)
            return
        now = trio.current_time()
        self._woke_at = self._idle_since = now
        # the work that asked for this wake is in hand (queued, assigned or in a
        # slot): no grace after it (``decide``); a POST /wake_up keeps the grace
        self._woke_in_hand = self._busy
        self._last_wake = now - t0
        self._wakes += 1
        self._check_invariant()
        self._notify()

    async def _take_while_demanded(self) -> bool:
        """Wait for the token while somebody still needs the model; give up when the
        demand goes away (clients gone), so we never take the GPU for nobody."""
        error: ArenaUnavailable | ArenaRefused | None = None
        async with trio.open_nursery() as nursery:

            async def cancel_when_undemanded() -> None:
                while self._demand:
                    await self._changed.wait()
                nursery.cancel_scope.cancel()

            nursery.start_soon(cancel_when_undemanded)
            try:
                await self._let_waiters_go_first()
                await self._arbiter.take()
            except (ArenaUnavailable, ArenaRefused) as exc:
                error = exc  # raised bare below, not wrapped in the nursery's group
            nursery.cancel_scope.cancel()
        if error is not None:
            raise error
        if self._arbiter.holding and not self._demand:
            self._arbiter.give_back()  # won it just as the last waiter left
        return self._arbiter.holding

    async def _let_waiters_go_first(self) -> None:
        """Right after a yield, a request for us must not snatch the token back before
        the waiter we yielded to has had it: our take tries at once, theirs may be a
        5 ms poll away, and a busy server would starve it. So while somebody still
        waits (live want.lock state; we are not registered yet), give them the lead,
        for at most ``handoff_window`` after the yield (a frozen waiter cannot hold us
        up for longer)."""
        cfg = self._cfg
        deadline = self._yielded_at + cfg.handoff_window
        if trio.current_time() >= deadline:
            return
        with trio.move_on_at(deadline):
            while self._probe():
                await trio.sleep(cfg.probe_interval / 2)

    async def _quantum_yield(self, level: Level) -> None:
        """Yield with work in flight, at the next step boundary. Called in the step
        that probed positive (no checkpoint in between): ``_leaving`` holds off every
        pass from now on, the pass in flight (if any) runs to its end, and then the
        live state decides again: still a waiter → release; gone → withdraw (nothing
        latched). The paused requests stay in their slots and want the model back as
        any wake does."""
        self._leaving = True
        try:
            while self._passes:
                await self._changed.wait()
            if self._residency.state is not State.RESIDENT:
                return
            self._last_probe = trio.current_time()
            if not self._probe():
                self._quantum_withdrawn += 1
                return
            await self._release(level, self._yield_reason("quantum"))
        finally:
            self._leaving = False
            self._notify()

    async def _sleep(self, level: Level, reason: str) -> None:
        """Release, then give the token back. Called in the step that decided it (no
        checkpoint in between), so ``_leaving`` is set before any pass could start."""
        assert not self._passes, "a release decided under a forward pass"
        self._leaving = True
        try:
            await self._release(level, reason)
        finally:
            self._leaving = False
            self._notify()  # waiters re-check: cold now, or resident again after a failure

    async def _release(self, level: Level, reason: str) -> None:
        t0 = trio.current_time()
        try:
            await self._residency.release(level)
        except Exception as exc:
            # the state was repaired to resident: keep the token, try again later
            log.error("residency: release (%s, %s) failed: %s", level.value, reason, exc)
            self._idle_since = trio.current_time()
            return
        if self._arbiter.holding and self._residency.state is not State.RESIDENT:
            self._arbiter.give_back()
        self._last_sleep = trio.current_time() - t0
        if reason == "idle":
            self._idle_sleeps += 1
        elif reason in ("yield", "quantum", "budget"):
            self._yields += 1
            self._quantum_yields += reason == "quantum"
            self._budget_yields += reason == "budget"
            self._yielded_at = trio.current_time()
        else:
            self._requested_sleeps += 1
        self._sleep_gen += 1
        log.info("residency: sleeping (%s, %s)", level.value, reason)
        self._check_invariant()
        self._notify()

    async def _shutdown(self) -> None:
        """Shielded and bounded by the caller. A transition in flight finishes in the
        residency actor; once it has, a cold model's token goes back at once."""
        await self._residency.wait_for(lambda s: s not in (State.RELEASING, State.RESTORING))
        if self._arbiter.holding and self._residency.state in (State.COLD, State.UNLOADED):
            self._arbiter.give_back()
            self._shutdown_gives += 1

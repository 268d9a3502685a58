"""The VRAM arbiter: who may be resident on the shared GPU (``docs/arbiter.md``).

Implements ``ARBITER-PROTOCOL.md`` over two flock'd files in an *arena* directory:
``token.lock`` (LOCK_EX: held by the one resident process) and ``want.lock``
(LOCK_SH: held by every process waiting for the token). The holder asks "does
anybody wait?" with LOCK_EX|LOCK_NB on a second, separate open file description of
``want.lock``, because flock treats each ``open()`` independently: probing on the
waiting fd would convert our own lock instead of conflicting with the others'.

Inbox: calls from the sleep controller's task (``take``/``take_nowait``/``probe``/
``give_back``); outbox: none, every answer is the live kernel lock state.
Invariants: ``want.lock`` is held exactly while a ``take()`` is in progress, and
dropped on every way out of it (token won, error, cancellation); a cancelled
``take()`` leaves the arbiter unchanged (no token, no registration).

Why a polling wait rather than a blocking ``flock`` on a worker thread: a thread
blocked in ``flock(LOCK_EX)`` cannot be interrupted, so without
``abandon_on_cancel`` a cancelled ``take()`` would hang until the other holder
lets go, and with it an abandoned thread could win the token behind our back. A
non-blocking attempt every ``poll_interval`` (5 ms) has no thread to clean up, is
cancellable at every sleep, runs exactly on ``MockClock``, and costs a hand-off at
most one interval, well under the holder's own 10 ms probe cadence.

Permissions (``docs/arbiter.md``, "Who can disturb whom"): anyone who can open an
arena file can flock it, and a read-only descriptor is enough, so the files are
never created readable by all: mode 0660 when the arena directory is group-writable
(a shared arena: a group-owned setgid directory), else 0600; opened with
``O_NOFOLLOW`` (a planted symlink is refused) and only as regular files. A waiter
that has waited longer than ``report_after`` logs the pid holding the token (from
``/proc/locks``), so an operator can see who wedges it. None of this changes the
protocol: the names, lock kinds and lock order are the reference fork's.

If the arena's files are removed or replaced under a running server (``rm -rf`` of
the directory), its locks are on files nobody else can see any more: the next probe
reports "somebody waits", so a resident holder yields, and the arena is re-opened
(re-created) when the token goes back or before the next take.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import stat
from pathlib import Path

import attrs
import trio

from trio_llm.errors import ArenaRefused, ArenaUnavailable
from trio_llm.residency.ledger import (
    Busy,
    Ledger,
    Member,
    decode,
    effective_budget,
    encode,
    fits,
    pinned_bytes,
    victims,
)
from trio_llm.residency.queue import Queue, Ticket
from trio_llm.residency.queue import unlock as _unlock

log = logging.getLogger(__name__)

#: the environment variable the reference fork reads for the arena directory
ARENA_ENV = "LLAMA_VRAM_ARENA"
TOKEN_FILE = "token.lock"
WANT_FILE = "want.lock"
#: a take that has waited this long logs who holds the token
REPORT_AFTER = 10.0
#: polls of a take between two checks that the arena files are still ours
_STALE_CHECK_POLLS = 20
#: a waiter that is not at the head of the queue takes the token anyway once it has
#: seen it free this long (a frozen or dead-slow head must not hold everybody up)
SKIP_AFTER = 0.25
#: upper bounds (seconds) of the buckets of ``ArbiterStatistics.wait_buckets``, the
#: ``trio_llm_arena_wait_seconds`` histogram: from one poll to a long generation
WAIT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


@attrs.frozen
class Share:
    """What a co-resident-capable server (``--arena-budget``) brings to the ledger."""

    footprint: int  # device bytes when resident (the --fit projection)
    budget: int  # --arena-budget, bytes
    pinned: bool = False  # --arena-pin: never yields


def arena_from(flag: str | os.PathLike[str] | None) -> Path | None:
    """The arena directory: ``--vram-arena`` wins over ``LLAMA_VRAM_ARENA``; None if neither."""
    if flag:
        return Path(flag)
    env = os.environ.get(ARENA_ENV)
    return Path(env) if env else None


def _try_flock(fd: int, operation: int) -> bool:
    """One non-blocking flock: True if granted, False if somebody else holds a conflicting
    lock. EINTR is retried here (Python retries it too, PEP 475, but a signal handler
    that raises must not be mistaken for contention); any other failure (a file
    system without flock, a closed fd) is ``ArenaUnavailable``."""
    while True:
        try:
            fcntl.flock(fd, operation | fcntl.LOCK_NB)
            return True
        except InterruptedError:
            continue
        except BlockingIOError:
            return False
        except OSError as exc:
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                return False
            raise ArenaUnavailable(f"flock failed: {exc.strerror or exc}") from exc


def _now() -> float:
    """trio's clock when there is a run (always, in the server); statistics read
    outside one (a test's teardown) see the hold up to the last known instant."""
    try:
        return trio.current_time()
    except RuntimeError:
        return 0.0


@attrs.frozen
class ArbiterStatistics:
    active: bool  # coordinating through an arena (False: uncoordinated, always "granted")
    arena: str | None
    holding: bool  # this process holds token.lock
    waiting: bool  # a take() is in progress (want.lock held shared)
    takes: int  # tokens acquired
    gives: int  # tokens given back
    contended_takes: int  # takes that had to wait for another holder
    probes: int
    probes_positive: int  # probes that found a waiter
    wait_seconds: float  # total time spent inside take()
    held_seconds: float = 0.0  # total time holding the token (the current hold included)
    #: take() calls by wait, cumulative per ``WAIT_BUCKETS`` bound (the last: all)
    wait_buckets: tuple[int, ...] = ()
    coresident: bool = False  # co-residency on (--arena-budget, the ledger usable)
    pinned: bool = False
    footprint_bytes: int = 0
    budget_bytes: int = 0
    members: int = 0  # co-residents in the ledger at the last read (us included)
    budget_probes: int = 0  # probes that found us chosen to make room for the head waiter


@attrs.define(eq=False)
class Arbiter:
    """One process's end of the arena. Build with ``open_arbiter`` or ``Arbiter.disabled``.

    ``take_nowait()``/``take()`` acquire the token, ``give_back()`` returns it,
    ``probe()`` asks whether another process waits, ``close()`` drops everything.
    Only one task should drive it (the sleep controller): the token is per process.
    """

    _arena: Path | None
    _token_fd: int = -1
    _want_fd: int = -1
    _probe_fd: int = -1
    _poll_interval: float = 0.005
    _report_after: float = REPORT_AFTER
    _holding: bool = False
    _waiting: bool = False
    _closed: bool = False
    _takes: int = 0
    _gives: int = 0
    _contended: int = 0
    _probes: int = 0
    _probes_positive: int = 0
    _wait_seconds: float = 0.0
    _held_seconds: float = 0.0
    _held_since: float | None = None  # trio time of the take, while holding
    _wait_counts: list[int] = attrs.field(factory=lambda: [0] * (len(WAIT_BUCKETS) + 1))
    _stale: bool = False  # our files are no longer the arena's (removed or replaced)
    _priority: int = 0  # --arena-priority: our rank among trio-llm waiters
    _queue: Queue | None = None  # ARENA/queue/ (None: no queue, today's free-for-all)
    _skip_after: float = SKIP_AFTER
    _overtakes: int = 0  # takes that went ahead of a live head ticket (it did not take)
    _reopens: int = 0
    _share: Share | None = None  # --arena-budget: co-resident-capable (None: exclusive)
    _ledger: Ledger | None = None  # ARENA/ledger/ (None: co-residency off)
    _probe_reason: str = ""  # why the last positive probe was positive: waiter | budget
    _members_seen: int = 0
    _budget_probes: int = 0
    _pin_warned: bool = False
    _nofit_logged: bool = False
    #: our name in tickets and the ledger: the pid (tests give in-process arbiters their own)
    _ident: int = attrs.field(factory=os.getpid)

    @classmethod
    def disabled(cls) -> Arbiter:
        """An arbiter without an arena: every take succeeds at once, nobody ever waits."""
        return cls(None)

    @property
    def active(self) -> bool:
        return self._token_fd >= 0

    @property
    def holding(self) -> bool:
        return self._holding

    def _took(self) -> None:
        """Record a won token (no checkpoint: called in the step that won it)."""
        self._holding = True
        self._takes += 1
        self._held_since = _now()

    def _observe_wait(self, seconds: float) -> None:
        i = next((k for k, bound in enumerate(WAIT_BUCKETS) if seconds <= bound), len(WAIT_BUCKETS))
        self._wait_counts[i] += 1

    def statistics(self) -> ArbiterStatistics:
        held = self._held_seconds
        if self._held_since is not None:
            held += max(0.0, _now() - self._held_since)
        cumulative, total = [], 0
        for n in self._wait_counts:
            total += n
            cumulative.append(total)
        return ArbiterStatistics(
            active=self.active,
            arena=str(self._arena) if self._arena is not None else None,
            holding=self._holding,
            waiting=self._waiting,
            takes=self._takes,
            gives=self._gives,
            contended_takes=self._contended,
            probes=self._probes,
            probes_positive=self._probes_positive,
            wait_seconds=self._wait_seconds,
            held_seconds=held,
            wait_buckets=tuple(cumulative),
            coresident=self._ledger is not None,
            pinned=self._share is not None and self._share.pinned,
            footprint_bytes=self._share.footprint if self._share is not None else 0,
            budget_bytes=self._share.budget if self._share is not None else 0,
            members=self._members_seen,
            budget_probes=self._budget_probes,
        )

    @property
    def coresident(self) -> bool:
        """Co-residency is on: our token hold is shared, beside the ledger's members."""
        return self._ledger is not None

    @property
    def probe_reason(self) -> str:
        """Why the last positive ``probe()`` was positive: ``waiter`` (somebody on
        want.lock) or ``budget`` (the head waiter does not fit and we are chosen to
        make room)."""
        return self._probe_reason

    def _check_open(self) -> None:
        if self._closed:
            raise trio.ClosedResourceError("the arbiter is closed")

    def take_nowait(self) -> None:
        """Take the token if nobody holds it, else raise ``trio.WouldBlock``.

        Does not register on want.lock: a failed attempt leaves no trace.
        """
        self._check_open()
        if self._holding:
            raise RuntimeError("this process already holds the VRAM token")
        if self._ledger is not None:
            if not self._join():
                raise trio.WouldBlock
        elif self.active and not _try_flock(self._token_fd, fcntl.LOCK_EX):
            raise trio.WouldBlock
        self._took()

    async def take(self) -> None:
        """Wait for the token, registered on want.lock so the holder sees us and yields.

        No timeout (the holder may be mid-generation). Cancellable at every wait; a
        cancelled ``take()`` leaves the arbiter unchanged: want.lock dropped, no token.
        """
        await trio.lowlevel.checkpoint_if_cancelled()
        self._check_open()
        if self._holding:
            raise RuntimeError("this process already holds the VRAM token")
        if not self.active:
            self._took()
            await trio.lowlevel.cancel_shielded_checkpoint()
            return
        if self._check_stale():
            self._reopen()
            if not self.active:
                self._took()
                await trio.lowlevel.cancel_shielded_checkpoint()
                return
        t0 = trio.current_time()
        self._waiting = True
        try:
            if self._ledger is not None:
                await self._take_shared()
                if self._holding:
                    return
                # co-residency was dropped meanwhile (the ledger failed): wait as
                # an exclusive holder, as without --arena-budget
            await self._take_exclusive(t0)
        finally:
            self._waiting = False
            waited = trio.current_time() - t0
            self._wait_seconds += waited
            self._observe_wait(waited)

    async def _take_exclusive(self, t0: float) -> None:
        """The protocol's take: registered on want.lock throughout, LOCK_EX on the token."""
        registered = False
        logged = False
        reported = False
        polls = 0
        ticket: Ticket | None = None
        free_since: float | None = None  # not our turn, but the token free since then
        try:
            while True:
                polls += 1
                if polls % _STALE_CHECK_POLLS == 0 and self._check_stale():
                    # the arena was replaced while we waited: wait on the new files
                    if registered:
                        _unlock(self._want_fd)
                        registered = False
                    self._leave_queue(ticket)
                    ticket = None
                    self._reopen()
                    if not self.active:
                        self._took()
                        break
                # register first, then try, so a holder that probes between our
                # attempts always sees us; want.lock can be briefly unavailable while a
                # holder's probe owns it exclusively, so registration is retried too
                if not registered and self._want_fd >= 0:
                    registered = _try_flock(self._want_fd, fcntl.LOCK_SH)
                if ticket is None:
                    ticket = self._enqueue()
                head = self._my_turn(ticket)
                turn = head
                if head:
                    free_since = None
                else:
                    # not our turn; but is the token free (the head not taking it)?
                    if _try_flock(self._token_fd, fcntl.LOCK_SH):
                        _unlock(self._token_fd)
                        now = trio.current_time()
                        free_since = now if free_since is None else free_since
                        if now - free_since >= self._skip_after:
                            turn = True
                    else:
                        free_since = None
                if turn and _try_flock(self._token_fd, fcntl.LOCK_EX):
                    # no await between winning the lock and recording it: a
                    # cancellation cannot land in between
                    if not head:
                        self._overtakes += 1
                    self._took()
                    break
                if not logged:
                    log.info("VRAM arbiter: waiting for the GPU token")
                    self._contended += 1
                    logged = True
                waited = trio.current_time() - t0
                if not reported and waited >= self._report_after:
                    reported = True
                    log.warning("VRAM arbiter: waited %.0f s for the GPU token; %s",
                                waited, describe_holders(self._token_fd))
                await trio.sleep(self._poll_interval)
        finally:
            self._leave_queue(ticket)
            if registered:
                _unlock(self._want_fd)

    async def _take_shared(self) -> None:
        """The co-resident's take (``docs/arbiter.md``, "Co-residency"): queued with a
        ticket that carries our footprint; registered on want.lock only while the token
        is held exclusively (so an exclusive holder, a fork among them, sees us and
        yields, while co-residents do not yield to a waiter that may fit); the head
        joins with a shared hold when it fits (``_join``). Returns without the token
        only if co-residency was dropped meanwhile (the caller then waits exclusively).
        """
        assert self._share is not None
        share = self._share
        note = encode(share.footprint, share.budget, share.pinned, 0)
        t0 = trio.current_time()
        registered = False
        logged = reported = False
        polls = 0
        ticket: Ticket | None = None
        free_since: float | None = None
        try:
            while self._ledger is not None:
                polls += 1
                if polls % _STALE_CHECK_POLLS == 0 and self._check_stale():
                    if registered:
                        _unlock(self._want_fd)
                        registered = False
                    self._leave_queue(ticket)
                    ticket = None
                    self._reopen()
                    if not self.active:
                        self._took()
                        return
                    continue
                if ticket is None:
                    ticket = self._enqueue(note)
                exclusive = not self._token_shareable()
                if exclusive and not registered and self._want_fd >= 0:
                    registered = _try_flock(self._want_fd, fcntl.LOCK_SH)
                    if registered and self._token_shareable():
                        # the exclusive holder left between the test and the
                        # registration: a co-resident that joined meanwhile must not
                        # see a stale waiter
                        _unlock(self._want_fd)
                        registered = exclusive = False
                elif not exclusive and registered:
                    _unlock(self._want_fd)
                    registered = False
                head = self._my_turn(ticket)
                turn = head
                if head:
                    free_since = None
                elif _try_flock(self._token_fd, fcntl.LOCK_EX):
                    # wholly free (no holder of either kind), and the head not taking it
                    _unlock(self._token_fd)
                    now = trio.current_time()
                    free_since = now if free_since is None else free_since
                    turn = now - free_since >= self._skip_after
                else:
                    free_since = None
                    # a head that cannot fit even with every non-pinned member gone
                    # (beside the pins) makes nobody yield and would hold up the queue
                    # for as long as the pins run: those behind it may go ahead
                    turn = not exclusive and self._head_hopeless()
                if turn and not exclusive and not registered and self._join():
                    if not head:
                        self._overtakes += 1
                    self._took()
                    return
                if not logged:
                    log.info("VRAM arbiter: waiting for the GPU token (co-resident, %.1f MiB)",
                             share.footprint / (1 << 20))
                    self._contended += 1
                    logged = True
                waited = trio.current_time() - t0
                if not reported and waited >= self._report_after:
                    reported = True
                    log.warning("VRAM arbiter: waited %.0f s for the GPU token; %s",
                                waited, describe_holders(self._token_fd))
                await trio.sleep(self._poll_interval)
        finally:
            self._leave_queue(ticket)
            if registered:
                _unlock(self._want_fd)

    def _token_shareable(self) -> bool:
        """Is nobody holding the token exclusively? (A LOCK_SH|LOCK_NB, undone at once.)"""
        if _try_flock(self._token_fd, fcntl.LOCK_SH):
            _unlock(self._token_fd)
            return True
        return False

    def _join(self) -> bool:
        """Become a co-resident, in one step with no checkpoint: under the ledger's
        exclusive lock, with a shared hold on the token, and holding want.lock
        exclusively (so no exclusive waiter is registered, and none can register
        until we are in: flock alone would let joiners starve a waiting fork), if our
        footprint fits beside the live members. False: not now (try at the next poll).
        Raises ``ArenaRefused`` for a pin that does not fit beside the other pins. The
        probe's mutex is held throughout, so that no co-resident's probe takes our
        exclusive hold of want.lock for a waiter."""
        ledger, share = self._ledger, self._share
        assert ledger is not None and share is not None
        try:
            with ledger.locked(exclusive=True), ledger.probing():
                if not _try_flock(self._token_fd, fcntl.LOCK_SH):
                    return False  # held exclusively
                joined = False
                try:
                    if not _try_flock(self._probe_fd, fcntl.LOCK_EX):
                        return False  # an exclusive waiter is registered: it goes first
                    try:
                        members = ledger.members()
                        self._members_seen = len(members)
                        self._check_pins(members)
                        if not fits(members, share.footprint, share.budget):
                            self._log_no_fit(members)
                            return False
                        ledger.add(share.footprint, share.budget, share.pinned)
                        self._members_seen += 1
                        self._nofit_logged = False
                        joined = True
                        return True
                    finally:
                        _unlock(self._probe_fd)
                finally:
                    if not joined:
                        _unlock(self._token_fd)
        except Busy:
            return False
        except OSError as exc:
            self._drop_ledger(exc)
            return False

    def _check_pins(self, members: list[Member]) -> None:
        share = self._share
        assert share is not None
        if not share.pinned:
            return
        limit = effective_budget(members, share.budget)
        pinned = [m for m in members if m.pinned]
        if pinned_bytes(pinned) + share.footprint > limit:
            mib = 1 << 20
            pids = ", ".join(str(m.pid) for m in pinned)
            raise ArenaRefused(
                f"--arena-pin: {share.footprint / mib:.1f} MiB pinned here and "
                f"{pinned_bytes(pinned) / mib:.1f} MiB pinned by pid {pids} do not fit the "
                f"{limit / mib:.1f} MiB budget")

    def _log_no_fit(self, members: list[Member]) -> None:
        share = self._share
        assert share is not None
        if self._nofit_logged:
            return
        self._nofit_logged = True
        limit = effective_budget(members, share.budget)
        if share.footprint + pinned_bytes(members) > limit:
            log.warning("VRAM arbiter: %.1f MiB do not fit beside %.1f MiB of pinned models in the %.1f MiB "
                        "budget; waiting until a pinned server stops", share.footprint / (1 << 20),
                        pinned_bytes(members) / (1 << 20), limit / (1 << 20))
        else:
            log.info("VRAM arbiter: %.1f MiB do not fit beside %d co-resident(s) (%.1f of %.1f MiB); "
                     "waiting for the least recently used to make room", share.footprint / (1 << 20),
                     len(members), sum(m.footprint for m in members) / (1 << 20), limit / (1 << 20))

    def _drop_ledger(self, exc: OSError) -> None:
        log.warning("VRAM arbiter: the ledger in %s failed (%s); co-residency is off: this server "
                    "takes turns (exclusive)", self._arena, exc.strerror or exc)
        if self._ledger is not None:
            self._ledger.close()
        self._ledger = None

    def touch(self) -> None:
        """Record a use in the ledger (work starts): the least recently used member
        is the first to make room. A no-op when not a co-resident."""
        if self._ledger is not None and self._ledger.member:
            try:
                self._ledger.touch()
            except OSError as exc:
                self._drop_ledger(exc)

    def _head_hopeless(self) -> bool:
        """Is the head waiter co-resident-capable and unable to fit beside the pinned
        members, whoever else leaves (``victims`` is None)?"""
        ledger, queue = self._ledger, self._queue
        if ledger is None or queue is None:
            return False
        try:
            head = queue.head()
            need = decode(head[0], head[1]) if head is not None else None
            if need is None:
                return False
            with ledger.locked(exclusive=False):
                members = ledger.members()
        except Busy:
            return False
        except OSError:
            return False  # the join, or the next probe, reports a broken ledger
        return victims(members, need.footprint, need.budget) is None

    def _budget_victim(self) -> bool:
        """Is the head waiter a co-resident-capable one that does not fit, and are we
        among the members chosen to make room for it (``ledger.victims``)?"""
        ledger, share, queue = self._ledger, self._share, self._queue
        if ledger is None or share is None or queue is None or share.pinned or not ledger.member:
            return False
        try:
            head = queue.head()
            if head is None:
                return False
            need = decode(head[0], head[1])
            if need is None:
                return False  # an exclusive waiter: it is on want.lock, the probe sees it
            with ledger.locked(exclusive=False):
                members = [m for m in ledger.members() if m.pid != need.pid]
        except Busy:
            return False
        except OSError as exc:
            log.warning("VRAM arbiter: reading the queue or ledger failed (%s); not yielding",
                        exc.strerror or exc)
            return False
        self._members_seen = len(members)
        chosen = victims(members, need.footprint, need.budget)
        return chosen is not None and self._ident in chosen

    def _enqueue(self, note: bytes = b"") -> Ticket | None:
        """Our ticket, or None (no queue, or the counter busy this instant)."""
        if self._queue is None:
            return None
        try:
            return self._queue.enqueue(self._priority, note, self._ident)
        except OSError as exc:
            self._drop_queue(exc)
            return None

    def _my_turn(self, ticket: Ticket | None) -> bool:
        """May we try the token now? Without a ticket (no queue, or not yet), yes, as
        the protocol alone would; with one, when it is the head of the live tickets."""
        if ticket is None or self._queue is None:
            return True
        try:
            return self._queue.is_head(ticket)
        except OSError as exc:
            self._drop_queue(exc)
            return True

    def _leave_queue(self, ticket: Ticket | None) -> None:
        if ticket is not None and self._queue is not None:
            self._queue.leave(ticket)
        elif ticket is not None:
            with contextlib.suppress(OSError):
                os.close(ticket.fd)  # the queue was dropped: closing drops the lock

    def _drop_queue(self, exc: OSError) -> None:
        log.warning("VRAM arbiter: the waiting queue in %s failed (%s); waiters are served "
                    "in no particular order", self._arena, exc.strerror or exc)
        if self._queue is not None:
            with contextlib.suppress(OSError):
                self._queue.close()
        self._queue = None

    def waiting_priority(self) -> int | None:
        """The highest priority among trio-llm processes queued for the token; None
        if none is (nobody waits, or only reference-fork processes). Never blocks."""
        if self._queue is None:
            return None
        try:
            return self._queue.top_priority()
        except OSError as exc:
            self._drop_queue(exc)
            return None

    def probe(self) -> bool:
        """Does another process wait for the token? Never blocks; reads live lock state.

        A co-resident also answers yes when the head waiter does not fit and we are
        chosen to make room (``probe_reason`` says which). Its probe runs under the
        ledger's probe mutex: two co-residents probing want.lock exclusively at the same
        instant would each take the other for a waiter. When another co-resident
        probes or joins at this instant, the answer is no (the next probe is 10 ms
        away)."""
        self._check_open()
        if not self.active or self._probe_fd < 0:
            return False
        if self._ledger is not None:
            try:
                with self._ledger.probing():
                    return self._probe()
            except Busy:
                return False
            except OSError as exc:
                self._drop_ledger(exc)
        return self._probe()

    def _probe(self) -> bool:
        self._probes += 1
        if self._check_stale():
            # our token is on a file nobody else can see: yield, so that the token
            # goes back and the arena is re-opened (``give_back``)
            self._probes_positive += 1
            return True
        if _try_flock(self._probe_fd, fcntl.LOCK_EX):
            _unlock(self._probe_fd)
            if self._holding and self._budget_victim():
                self._probes_positive += 1
                self._budget_probes += 1
                self._probe_reason = "budget"
                return True
            return False
        if self._holding and self._share is not None and self._share.pinned and self._ledger is not None:
            if not self._pin_warned:
                self._pin_warned = True
                log.warning("VRAM arbiter: pinned: an exclusive waiter (a reference fork, or a server "
                            "without --arena-budget) waits for the GPU and will get it only when this "
                            "server stops")
            return False
        self._probes_positive += 1
        self._probe_reason = "waiter"
        return True

    def give_back(self) -> None:
        """Unlock the token. The caller has already released its device memory."""
        self._check_open()
        if not self._holding:
            raise RuntimeError("this process does not hold the VRAM token")
        if self._ledger is not None:
            self._ledger.leave()  # after the device memory, before the token
        if self.active:
            _unlock(self._token_fd)
        self._holding = False
        self._gives += 1
        if self._held_since is not None:
            self._held_seconds += max(0.0, _now() - self._held_since)
            self._held_since = None
        if self._stale:
            self._reopen()

    def _check_stale(self) -> bool:
        """Are our arena files still the ones the arena directory names? A cheap
        (two stats) check; once stale, stale until re-opened."""
        if self._stale or not self.active or self._arena is None:
            return self._stale
        try:
            ours = os.fstat(self._token_fd)
        except OSError:
            return False  # a broken descriptor, not a moved file: the flock reports it
        try:
            on_disk = os.stat(self._arena / TOKEN_FILE, follow_symlinks=False)
            same = (on_disk.st_dev, on_disk.st_ino) == (ours.st_dev, ours.st_ino)
        except OSError:
            same = False
        if not same:
            log.warning("VRAM arbiter: the arena files in %s were removed or replaced; "
                        "re-opening the arena", self._arena)
            self._stale = True
        return self._stale

    def _reopen(self) -> None:
        """Close our files and open the arena again (creating it if it is gone). On
        failure, uncoordinated, as at start-up. Never while holding the token. A few
        syscalls on a local directory, run in place like the non-blocking flocks:
        none of them waits."""
        assert not self._holding
        for name in ("_probe_fd", "_want_fd", "_token_fd"):
            fd = getattr(self, name)
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
                setattr(self, name, -1)
        self._stale = False
        self._reopens += 1
        if self._queue is not None:
            with contextlib.suppress(OSError):
                self._queue.close()
            self._queue = None
        share_on = self._ledger is not None
        if self._ledger is not None:
            self._ledger.close()
            self._ledger = None
        assert self._arena is not None
        try:
            self._token_fd, self._want_fd, self._probe_fd = _open_arena(self._arena)
            self._queue = _open_queue(self._arena)
            if share_on:
                self._ledger = _open_ledger(self._arena, self._queue, self._ident)
        except (OSError, ArenaUnavailable) as exc:
            reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
            log.warning("VRAM arbiter: cannot re-open arena %s (%s); running without "
                        "cross-process coordination", self._arena, reason)

    def close(self) -> None:
        """Give back the token (if held) and close the files. Idempotent."""
        if self._closed:
            return
        if self._holding:
            self.give_back()
        self._closed = True
        if self._ledger is not None:
            self._ledger.close()
            self._ledger = None
        if self._queue is not None:
            with contextlib.suppress(OSError):
                self._queue.close()
            self._queue = None
        for name in ("_probe_fd", "_want_fd", "_token_fd"):
            fd = getattr(self, name)
            if fd >= 0:
                os.close(fd)  # closing the last fd of a description drops its flock
                setattr(self, name, -1)


def arena_file_mode(dir_mode: int) -> int:
    """The mode of the files of an arena whose directory has ``dir_mode``: 0660 when
    the directory is group-writable (a shared arena), else 0600; never anything for
    others (a read-only descriptor is enough to flock and wedge the arena)."""
    return 0o660 if dir_mode & stat.S_IWGRP else 0o600


def _open_arena(arena: Path) -> tuple[int, int, int]:
    """Open token.lock, want.lock and a second description of want.lock (the probe).

    O_CLOEXEC keeps the lock descriptions out of exec'd children: a flock lives as
    long as any fd of its description, so an inherited fd would outlive our death.
    O_NOFOLLOW (relative to an fd of the directory) refuses a planted symlink, and a
    file that is not a regular one (a FIFO, a device) is refused too. A file we
    own gets the policy's mode (``arena_file_mode``), whatever the umask or whoever
    created it wider; one that another user owns and leaves open to all is used,
    with a warning.
    """
    if not arena.exists():
        arena.mkdir(parents=True, mode=0o700)
    dir_fd = os.open(arena, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        dir_st = os.fstat(dir_fd)
        mode = arena_file_mode(dir_st.st_mode)
        if dir_st.st_mode & stat.S_IWOTH and not dir_st.st_mode & stat.S_ISVTX:
            log.warning("VRAM arbiter: arena %s is writable by all: any local user can replace "
                        "its files (see docs/arbiter.md)", arena)
        flags = os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK
        fds: list[int] = []
        try:
            for name in (TOKEN_FILE, WANT_FILE, WANT_FILE):
                try:
                    fd = os.open(name, flags, mode, dir_fd=dir_fd)
                except OSError as exc:
                    if exc.errno == errno.ELOOP:
                        raise ArenaUnavailable(f"{arena / name} is a symbolic link") from None
                    raise
                fds.append(fd)
                _check_file(arena / name, fd, mode)
            # a file system without flock (some network mounts) fails here, at open,
            # rather than in the middle of a hand-off
            if _try_flock(fds[2], fcntl.LOCK_SH):
                _unlock(fds[2])
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise
    finally:
        os.close(dir_fd)
    return fds[0], fds[1], fds[2]


def _open_queue(arena: Path) -> Queue | None:
    """The waiting queue (``queue.py``); None, logged, if it cannot be used: the
    arena still works, only without an order among waiters."""
    try:
        return Queue.open(arena, arena_file_mode(os.stat(arena).st_mode))
    except OSError as exc:
        log.warning("VRAM arbiter: cannot use the waiting queue in %s (%s); waiters are served "
                    "in no particular order", arena, exc.strerror or exc)
        return None


def _open_ledger(arena: Path, queue: Queue | None, ident: int) -> Ledger | None:
    """The co-residency ledger (``ledger.py``); None, logged, if it (or the queue, which
    carries the waiters' footprints) cannot be used: the server then takes turns."""
    if queue is None:
        log.warning("VRAM arbiter: co-residency needs the waiting queue in %s; co-residency is off: "
                    "this server takes turns (exclusive)", arena)
        return None
    try:
        return Ledger.open(arena, arena_file_mode(os.stat(arena).st_mode), ident)
    except OSError as exc:
        log.warning("VRAM arbiter: cannot use the ledger in %s (%s); co-residency is off: this server "
                    "takes turns (exclusive)", arena, exc.strerror or exc)
        return None


def _check_file(path: Path, fd: int, mode: int) -> None:
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        raise ArenaUnavailable(f"{path} is not a regular file")
    have = stat.S_IMODE(st.st_mode)
    if st.st_uid == os.geteuid():
        if have != mode:
            os.fchmod(fd, mode)
    elif have & (stat.S_IROTH | stat.S_IWOTH):
        log.warning("VRAM arbiter: %s (owner uid %d) is open to all users (mode %04o): any local "
                    "user can hold its lock and keep the GPU from us (see docs/arbiter.md)",
                    path, st.st_uid, have)


def lock_holders(fd: int) -> list[tuple[int, str]]:
    """The (pid, kind) of every process holding a flock on ``fd``'s file, from
    ``/proc/locks`` (Linux; empty elsewhere). The pid is the process that took the
    lock; waiters blocked in flock (the "->" lines) are not holders."""
    try:
        st = os.fstat(fd)
        with open("/proc/locks") as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    want = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    out = []
    for line in lines:
        parts = line.split()
        if len(parts) < 6 or parts[1] == "->" or parts[1] != "FLOCK":
            continue
        if parts[5] == want:
            out.append((int(parts[4]), parts[3]))
    return out


def describe_holders(fd: int) -> str:
    """For the log: who holds the lock on ``fd`` (pid and command line)."""
    holders = [(pid, kind) for pid, kind in lock_holders(fd) if pid != os.getpid()]
    if not holders:
        return "its holder is not visible here (another pid namespace, or not Linux)"
    out = []
    for pid, _ in holders:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            cmd = ""
        out.append(f"pid {pid}" + (f" ({cmd[:200]})" if cmd else ""))
    return "held by " + ", ".join(out)


async def open_arbiter(
    arena: str | os.PathLike[str] | None, *, poll_interval: float = 0.005,
    report_after: float = REPORT_AFTER, priority: int = 0, share: Share | None = None,
    ident: int | None = None,
) -> Arbiter:
    """The arbiter for ``arena`` (``None``: disabled). An arena that cannot be opened or
    written is logged as a warning and gives an uncoordinated arbiter, never an error:
    a server must still serve when a shared directory is misconfigured. ``share``
    (``--arena-budget``): co-resident with the ledger's members while they fit; a
    ledger that cannot be used is one warning, and the server takes turns."""
    if arena is None:
        return Arbiter.disabled()
    path = Path(arena)
    me = os.getpid() if ident is None else ident
    try:
        token_fd, want_fd, probe_fd = await trio.to_thread.run_sync(_open_arena, path)
        queue = await trio.to_thread.run_sync(_open_queue, path)
        ledger = await trio.to_thread.run_sync(_open_ledger, path, queue, me) if share is not None else None
    except (OSError, ArenaUnavailable) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
        log.warning(
            "VRAM arbiter: cannot use arena %s (%s); running without cross-process coordination",
            path,
            reason,
        )
        return Arbiter(path, poll_interval=poll_interval, report_after=report_after, priority=priority,
                       share=share, ident=me)
    log.info("VRAM arbiter: sharing the GPU through %s", path)
    return Arbiter(
        path,
        token_fd=token_fd,
        want_fd=want_fd,
        probe_fd=probe_fd,
        poll_interval=poll_interval,
        report_after=report_after,
        priority=priority,
        queue=queue,
        share=share,
        ledger=ledger,
        ident=me,
    )

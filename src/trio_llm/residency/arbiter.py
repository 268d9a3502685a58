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
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
from pathlib import Path

import attrs
import trio

from trio_llm.errors import ArenaUnavailable

log = logging.getLogger(__name__)

#: the environment variable the reference fork reads for the arena directory
ARENA_ENV = "LLAMA_VRAM_ARENA"
TOKEN_FILE = "token.lock"
WANT_FILE = "want.lock"


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


def _unlock(fd: int) -> None:
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_UN)
            return
        except InterruptedError:
            continue


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
    _holding: bool = False
    _waiting: bool = False
    _closed: bool = False
    _takes: int = 0
    _gives: int = 0
    _contended: int = 0
    _probes: int = 0
    _probes_positive: int = 0
    _wait_seconds: float = 0.0

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

    def statistics(self) -> ArbiterStatistics:
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
        )

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
        if self.active and not _try_flock(self._token_fd, fcntl.LOCK_EX):
            raise trio.WouldBlock
        self._holding = True
        self._takes += 1

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
            self._holding = True
            self._takes += 1
            await trio.lowlevel.cancel_shielded_checkpoint()
            return
        t0 = trio.current_time()
        self._waiting = True
        registered = False
        logged = False
        try:
            while True:
                # register first, then try, so a holder that probes between our
                # attempts always sees us; want.lock can be briefly unavailable while a
                # holder's probe owns it exclusively, so registration is retried too
                if not registered and self._want_fd >= 0:
                    registered = _try_flock(self._want_fd, fcntl.LOCK_SH)
                if _try_flock(self._token_fd, fcntl.LOCK_EX):
                    # no await between winning the lock and recording it: a
                    # cancellation cannot land in between
                    self._holding = True
                    self._takes += 1
                    break
                if not logged:
                    log.info("VRAM arbiter: waiting for the GPU token")
                    self._contended += 1
                    logged = True
                await trio.sleep(self._poll_interval)
        finally:
            if registered:
                _unlock(self._want_fd)
            self._waiting = False
            self._wait_seconds += trio.current_time() - t0

    def probe(self) -> bool:
        """Does another process wait for the token? Never blocks; reads live lock state."""
        self._check_open()
        if not self.active or self._probe_fd < 0:
            return False
        self._probes += 1
        if _try_flock(self._probe_fd, fcntl.LOCK_EX):
            _unlock(self._probe_fd)
            return False
        self._probes_positive += 1
        return True

    def give_back(self) -> None:
        """Unlock the token. The caller has already released its device memory."""
        self._check_open()
        if not self._holding:
            raise RuntimeError("this process does not hold the VRAM token")
        if self.active:
            _unlock(self._token_fd)
        self._holding = False
        self._gives += 1

    def close(self) -> None:
        """Give back the token (if held) and close the files. Idempotent."""
        if self._closed:
            return
        if self._holding:
            self.give_back()
        self._closed = True
        for name in ("_probe_fd", "_want_fd", "_token_fd"):
            fd = getattr(self, name)
            if fd >= 0:
                os.close(fd)  # closing the last fd of a description drops its flock
                setattr(self, name, -1)


def _open_arena(arena: Path) -> tuple[int, int, int]:
    """Open token.lock, want.lock and a second description of want.lock (the probe).

    O_CLOEXEC keeps the lock descriptions out of exec'd children: a flock lives as
    long as any fd of its description, so an inherited fd would outlive our death.
    """
    arena.mkdir(parents=True, exist_ok=True)
    flags = os.O_RDWR | os.O_CREAT | os.O_CLOEXEC
    fds: list[int] = []
    try:
        for name in (TOKEN_FILE, WANT_FILE, WANT_FILE):
            fds.append(os.open(arena / name, flags, 0o666))
        # a file system without flock (some network mounts) fails here, at open,
        # rather than in the middle of a hand-off
        if _try_flock(fds[2], fcntl.LOCK_SH):
            _unlock(fds[2])
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    return fds[0], fds[1], fds[2]


async def open_arbiter(
    arena: str | os.PathLike[str] | None, *, poll_interval: float = 0.005
) -> Arbiter:
    """The arbiter for ``arena`` (``None``: disabled). An arena that cannot be opened or
    written is logged as a warning and gives an uncoordinated arbiter, never an error:
    a server must still serve when a shared directory is misconfigured."""
    if arena is None:
        return Arbiter.disabled()
    path = Path(arena)
    try:
        token_fd, want_fd, probe_fd = await trio.to_thread.run_sync(_open_arena, path)
    except (OSError, ArenaUnavailable) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
        log.warning(
            "VRAM arbiter: cannot use arena %s (%s); running without cross-process coordination",
            path,
            reason,
        )
        return Arbiter(path, poll_interval=poll_interval)
    log.info("VRAM arbiter: sharing the GPU through %s", path)
    return Arbiter(
        path,
        token_fd=token_fd,
        want_fd=want_fd,
        probe_fd=probe_fd,
        poll_interval=poll_interval,
    )

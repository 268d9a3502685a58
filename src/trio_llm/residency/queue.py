"""First-come and priority among trio-llm waiters: tickets in ``ARENA/queue/``.

flock grants in no order: when a holder unlocks ``token.lock``, whichever poller
tries first wins. So the order among waiters needs a queue of its own, outside the
kernel's lock order, that only trio-llm reads (``docs/arbiter.md``, "First-come and
priority"). A reference-fork process has no ticket and never reads the queue: it
waits through ``want.lock`` and ``token.lock`` exactly as before, and may overtake
the queue as it can overtake anybody today.

A *ticket* is a file ``p{priority}-s{seq}-{pid}.ticket``, flock'd ``LOCK_EX`` by its
waiter for exactly as long as it waits; ``seq`` comes from the counter file ``seq``,
read and bumped under its own flock. A ticket is created under a temporary name,
locked, then renamed into place, so it is never visible unlocked: a ticket whose lock
another process can take belongs to a dead waiter, and whoever sees it unlinks it
(the kernel drops a dead process's locks, so nothing goes stale). Among live tickets
the *head* (highest priority, then lowest sequence) is the one that tries the token.

The ordering is pure (``rank``, ``is_head``); ``Queue`` and ``Ticket`` are the few
syscalls on a local directory around it, run in place like the arbiter's
non-blocking flocks: none of them waits.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import re
import stat
from collections.abc import Iterable
from pathlib import Path

import attrs

QUEUE_DIR = "queue"
SEQ_FILE = "seq"
_TICKET = re.compile(r"p(-?\d+)-s(\d+)-(\d+)\.ticket")
_OPEN = os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK


# ---- the order: pure --------------------------------------------------------------


def ticket_name(priority: int, seq: int, pid: int) -> str:
    return f"p{priority}-s{seq:012d}-{pid}.ticket"


def parse_ticket(name: str) -> tuple[int, int, int] | None:
    """(priority, seq, pid) of a ticket file name; None for anything else."""
    m = _TICKET.fullmatch(name)
    return (int(m[1]), int(m[2]), int(m[3])) if m else None


def rank(priority: int, seq: int) -> tuple[int, int]:
    """Smaller goes first: the higher priority, then the earlier arrival."""
    return (-priority, seq)


def is_head(mine: tuple[int, int], live: Iterable[tuple[int, int]]) -> bool:
    """Is the ticket ranked ``mine`` ahead of every other live ticket?"""
    return all(mine < other for other in live)


# ---- the files ---------------------------------------------------------------------


# the arena files' flock helpers, shared with ledger.py and arbiter.py


def try_lock(fd: int, op: int) -> bool:
    """One non-blocking flock: True if granted, False if somebody holds a conflicting
    lock (EINTR retried)."""
    while True:
        try:
            fcntl.flock(fd, op | fcntl.LOCK_NB)
            return True
        except InterruptedError:
            continue
        except OSError as exc:
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                return False
            raise


def unlock(fd: int) -> None:
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_UN)
            return
        except InterruptedError:
            continue


def set_mode(fd: int, mode: int) -> None:
    """O_CREAT applies the umask: a file we own gets the policy's mode exactly."""
    st = os.fstat(fd)
    if st.st_uid == os.geteuid() and stat.S_IMODE(st.st_mode) != mode:
        os.fchmod(fd, mode)


@attrs.define(eq=False)
class Ticket:
    """Our place in the queue: the locked file, and its rank."""

    fd: int
    name: str
    rank: tuple[int, int]


@attrs.define(eq=False)
class Queue:
    """``ARENA/queue/``, opened by one process. Every method raises ``OSError`` on a
    failure other than a race it handles; the arbiter then runs without the queue."""

    dir_fd: int
    mode: int  # of the files we create (the arena's permission policy)

    @classmethod
    def open(cls, arena: Path, mode: int) -> Queue:
        """Open (creating) the queue directory. Its mode follows the files' policy
        (0700 private, 2770 group-shared: ``mode`` | execute bits)."""
        path = arena / QUEUE_DIR
        dir_mode = 0o770 if mode & stat.S_IWGRP else 0o700
        with contextlib.suppress(FileExistsError):
            os.mkdir(path, dir_mode)
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC | os.O_NOFOLLOW)
        try:
            st = os.fstat(fd)
            if not stat.S_ISDIR(st.st_mode):
                raise NotADirectoryError(errno.ENOTDIR, "not a directory", str(path))
            # mkdir applies the umask (022 would leave a shared arena's group unable to
            # queue): set the policy's mode, keeping a setgid bit inherited from the arena
            if st.st_uid == os.geteuid() and stat.S_IMODE(st.st_mode) & 0o777 != dir_mode:
                os.fchmod(fd, dir_mode | (st.st_mode & stat.S_ISGID))
        except BaseException:
            os.close(fd)
            raise
        return cls(fd, mode)

    def close(self) -> None:
        if self.dir_fd >= 0:
            os.close(self.dir_fd)
            self.dir_fd = -1

    def enqueue(self, priority: int, note: bytes = b"", pid: int | None = None) -> Ticket | None:
        """Take a ticket; None when the sequence counter is locked by another waiter
        at this instant (try again at the next poll). ``note`` is the ticket's content
        (a co-resident-capable waiter's footprint and budget: ``ledger.encode``),
        written before the ticket is visible."""
        fd = os.open(SEQ_FILE, os.O_RDWR | os.O_CREAT | _OPEN, self.mode, dir_fd=self.dir_fd)
        try:
            set_mode(fd, self.mode)
            if not try_lock(fd, fcntl.LOCK_EX):
                return None
            text = os.pread(fd, 32, 0).strip()
            seq = (int(text) if text.isdigit() else 0) + 1
            os.pwrite(fd, b"%020d\n" % seq, 0)  # fixed width: no truncation needed
        finally:
            os.close(fd)  # drops the counter's lock
        pid = os.getpid() if pid is None else pid
        tmp = f".{pid}-{seq}.tmp"
        tfd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | _OPEN, self.mode, dir_fd=self.dir_fd)
        if not try_lock(tfd, fcntl.LOCK_EX):
            # another waiter is looking at the temporary file at this instant (and
            # may remove it as dead): take another ticket next poll
            os.close(tfd)
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=self.dir_fd)
            return None
        try:
            set_mode(tfd, self.mode)
            if note:
                os.pwrite(tfd, note, 0)
            name = ticket_name(priority, seq, pid)
            # the lock is on the inode: the ticket is never visible unlocked
            os.rename(tmp, name, src_dir_fd=self.dir_fd, dst_dir_fd=self.dir_fd)
        except FileNotFoundError:
            # another waiter saw the temporary file unlocked (between our open and
            # flock) and removed it as dead: take another ticket next poll
            os.close(tfd)
            return None
        except BaseException:
            os.close(tfd)
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=self.dir_fd)
            raise
        return Ticket(tfd, name, rank(priority, seq))

    def leave(self, ticket: Ticket) -> None:
        """Give the ticket up (token won, cancelled, error). Never raises."""
        with contextlib.suppress(OSError):
            os.unlink(ticket.name, dir_fd=self.dir_fd)
        with contextlib.suppress(OSError):
            os.close(ticket.fd)

    def live(self, skip: str | None = None) -> list[tuple[tuple[int, int], int]]:
        """(rank, priority) of every live ticket but ``skip``; dead ones (and dead
        temporary files) are unlinked on the way."""
        out = []
        for name in os.listdir(self.dir_fd):
            if name == skip:
                continue
            parsed = parse_ticket(name)
            if parsed is None:
                if name.endswith(".tmp"):
                    self._alive(name)  # removes it if its creator is gone
                continue
            if self._alive(name):
                out.append((rank(parsed[0], parsed[1]), parsed[0]))
        return out

    def is_head(self, ticket: Ticket) -> bool:
        return is_head(ticket.rank, (r for r, _ in self.live(skip=ticket.name)))

    def head(self) -> tuple[int, bytes] | None:
        """The pid and content of the head live ticket (None: nobody queues). Its
        content is read while its owner's lock is seen held, so it is the live one."""
        best: tuple[tuple[int, int], str, int] | None = None
        for name in os.listdir(self.dir_fd):
            parsed = parse_ticket(name)
            if parsed is None:
                continue
            r = rank(parsed[0], parsed[1])
            if (best is None or r < best[0]) and self._alive(name):
                best = (r, name, parsed[2])
        if best is None:
            return None
        try:
            fd = os.open(best[1], os.O_RDONLY | _OPEN, dir_fd=self.dir_fd)
        except FileNotFoundError:
            return None  # it left meanwhile: the next probe reads the new head
        try:
            return best[2], os.pread(fd, 256, 0)
        finally:
            os.close(fd)

    def top_priority(self) -> int | None:
        """The highest priority among live tickets; None when nobody queues (the
        waiters, if any, are reference-fork processes)."""
        return max((p for _, p in self.live()), default=None)

    def _alive(self, name: str) -> bool:
        """Does a process hold ``name``'s lock? If not, unlink it (if it is still the
        same file: it may have been replaced meanwhile)."""
        try:
            fd = os.open(name, os.O_RDONLY | _OPEN, dir_fd=self.dir_fd)
        except FileNotFoundError:
            return False
        try:
            if not try_lock(fd, fcntl.LOCK_SH):
                return True
            ours = os.fstat(fd)
            with contextlib.suppress(OSError):
                now = os.stat(name, dir_fd=self.dir_fd, follow_symlinks=False)
                if (now.st_dev, now.st_ino) == (ours.st_dev, ours.st_ino):
                    os.unlink(name, dir_fd=self.dir_fd)
            return False
        finally:
            os.close(fd)

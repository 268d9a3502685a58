"""Co-residency under a memory budget: the ledger in ``ARENA/ledger/`` (issue 16).

Servers started with ``--arena-budget`` hold ``token.lock`` *shared* and are resident
together while their footprints fit the budget (``docs/arbiter.md``, "Co-residency
under a budget, and pin"). The ledger says who is resident with how much:

- ``ledger/lock``: the ledger's mutex (``LOCK_EX`` to change it, ``LOCK_SH`` to read
  it); its content is the use counter that orders members by last use.
- ``ledger/probe``: the probe's mutex. A probe is ``LOCK_EX|LOCK_NB`` on ``want.lock``,
  so two co-residents probing at the same instant would each see the other's probe as
  a waiter (and a joiner's exclusive hold of ``want.lock`` looks like one too): every
  co-resident-capable process takes this mutex around its probe and its join, and
  skips a probe when the mutex is busy (the next one is 10 ms later).
- ``ledger/PID-TAG.member``: one co-resident (TAG: random, so that servers in
  different pid namespaces sharing a directory never collide), flock'd ``LOCK_EX`` by its owner for as
  long as it is a member. Created under a temporary name, locked, then renamed into
  place, so it is never visible unlocked: a member file whose lock another process
  can take belongs to a dead process and is unlinked by whoever reads it next (the
  kernel drops a SIGKILLed process's locks, so the budget repairs itself).

The decisions are pure (``effective_budget``, ``fits``, ``victims``) and tested without
trio or files; ``Ledger`` is the few syscalls on a local directory around them, run in
place like the arbiter's non-blocking flocks: none of them waits (a lock that is busy
this instant is "try again at the next poll").

A reference-fork process never reads the ledger: it sees only ``token.lock`` (which its
``LOCK_EX`` cannot take while any member holds ``LOCK_SH``) and ``want.lock``.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import itertools
import os
import re
import secrets
import stat
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

import attrs

from trio_llm.residency.queue import set_mode, try_lock, unlock

LEDGER_DIR = "ledger"
LOCK_FILE = "lock"
PROBE_FILE = "probe"
MiB = 1 << 20
_MEMBER = re.compile(r"(\d+)-[0-9a-f]+\.member")
_OPEN = os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK
#: beyond this many candidates ``victims`` is greedy (LRU first) instead of exhaustive
_EXHAUSTIVE = 12


# ---- the decisions: pure -------------------------------------------------------------


@attrs.frozen
class Member:
    """One co-resident as its member file (or a waiter as its ticket) records it."""

    pid: int
    footprint: int  # device bytes it uses when resident
    budget: int  # its --arena-budget, bytes
    pinned: bool = False
    stamp: int = 0  # last use: smaller = used longer ago (the ledger's counter)


def effective_budget(members: Iterable[Member], budget: int) -> int:
    """The budget every decision uses: the smallest figure among the members and the
    one asking (servers that disagree about the device are safe, not fast)."""
    return min([budget, *(m.budget for m in members)])


def fits(members: Sequence[Member], footprint: int, budget: int) -> bool:
    """Does a newcomer of ``footprint`` fit beside ``members``?"""
    return sum(m.footprint for m in members) + footprint <= effective_budget(members, budget)


def pinned_bytes(members: Iterable[Member]) -> int:
    return sum(m.footprint for m in members if m.pinned)


def victims(members: Sequence[Member], footprint: int, budget: int) -> tuple[int, ...] | None:
    """The pids that must yield so that a waiter of ``footprint`` fits: the fewest
    non-pinned members whose footprints make room, least recently used first (among
    sets of the same size, the one whose members were used longest ago, in order).
    ``()``: it fits already; ``None``: it cannot fit even with every non-pinned member
    gone (nobody yields for it). Every member computes this from the same ledger and
    the same head ticket, so they agree on who goes."""
    limit = effective_budget(members, budget)
    need = sum(m.footprint for m in members) + footprint - limit
    if need <= 0:
        return ()
    movable = sorted((m for m in members if not m.pinned), key=lambda m: (m.stamp, m.pid))
    if sum(m.footprint for m in movable) < need:
        return None
    if len(movable) > _EXHAUSTIVE:
        out, freed = [], 0
        for m in movable:
            out.append(m.pid)
            freed += m.footprint
            if freed >= need:
                return tuple(out)
        return None  # pragma: no cover - excluded by the sum above
    for k in range(1, len(movable) + 1):
        # combinations come in lexicographic order of the LRU-sorted list: the first
        # that frees enough prefers the least recently used members
        for combo in itertools.combinations(movable, k):
            if sum(m.footprint for m in combo) >= need:
                return tuple(m.pid for m in combo)
    return None  # pragma: no cover - the full set frees enough


# ---- the record format ---------------------------------------------------------------


def encode(footprint: int, budget: int, pinned: bool, stamp: int) -> bytes:
    """A member file's (or a ticket's) content: fixed width, so a stamp update is one
    ``pwrite`` of the same length."""
    return b"footprint=%020d budget=%020d pinned=%d stamp=%020d\n" % (footprint, budget, int(pinned), stamp)


_RECORD = re.compile(rb"footprint=(\d+) budget=(\d+) pinned=([01]) stamp=(\d+)\n?")


def decode(pid: int, data: bytes) -> Member | None:
    m = _RECORD.fullmatch(data)
    if m is None:
        return None
    return Member(pid, int(m[1]), int(m[2]), m[3] == b"1", int(m[4]))


def member_name(pid: int, tag: str) -> str:
    return f"{pid}-{tag}.member"


# ---- the files -----------------------------------------------------------------------


class Busy(Exception):
    """``ledger/lock`` is held by another process at this instant: try at the next poll."""


@attrs.define(eq=False)
class Ledger:
    """``ARENA/ledger/``, opened by one process. Methods raise ``OSError`` on a failure
    other than the races they handle, and ``Busy`` when the mutex is taken; the arbiter
    turns co-residency off on an ``OSError`` (the server then takes turns)."""

    dir_fd: int
    lock_fd: int
    mode: int  # of the files we create (the arena's permission policy)
    probe_fd: int = -1
    #: our name in the ledger: the pid (tests give two arbiters of one process their own)
    ident: int = attrs.field(factory=os.getpid)
    #: our file's tag: the pid alone can repeat across pid namespaces
    tag: str = attrs.field(factory=lambda: secrets.token_hex(4))
    _entry_fd: int = -1  # our member file, while we are a member
    _record: Member | None = None

    @classmethod
    def open(cls, arena: Path, mode: int, ident: int | None = None) -> Ledger:
        """Open (creating) the ledger directory and its lock file; modes follow the
        arena's policy (0700/0600 private, 2770/0660 group-shared)."""
        path = arena / LEDGER_DIR
        dir_mode = 0o770 if mode & stat.S_IWGRP else 0o700
        with contextlib.suppress(FileExistsError):
            os.mkdir(path, dir_mode)
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC | os.O_NOFOLLOW)
        try:
            st = os.fstat(fd)
            if st.st_uid == os.geteuid() and stat.S_IMODE(st.st_mode) & 0o777 != dir_mode:
                os.fchmod(fd, dir_mode | (st.st_mode & stat.S_ISGID))
            fds: list[int] = []
            try:
                for name in (LOCK_FILE, PROBE_FILE):
                    fds.append(os.open(name, os.O_RDWR | os.O_CREAT | _OPEN, mode, dir_fd=fd))
                    if not stat.S_ISREG(os.fstat(fds[-1]).st_mode):
                        raise OSError(errno.EINVAL, "not a regular file", str(path / name))
                    set_mode(fds[-1], mode)
            except BaseException:
                for f in fds:
                    os.close(f)
                raise
        except BaseException:
            os.close(fd)
            raise
        return cls(fd, fds[0], mode, fds[1], os.getpid() if ident is None else ident)

    @property
    def _name(self) -> str:
        return member_name(self.ident, self.tag)

    @property
    def member(self) -> bool:
        return self._entry_fd >= 0

    @contextlib.contextmanager
    def locked(self, exclusive: bool) -> Iterator[None]:
        """The ledger's mutex, non-blocking: ``Busy`` if another process has it."""
        if not try_lock(self.lock_fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH):
            raise Busy
        try:
            yield
        finally:
            unlock(self.lock_fd)

    @contextlib.contextmanager
    def probing(self) -> Iterator[None]:
        """The probe's mutex, non-blocking: ``Busy`` if another co-resident probes or
        joins at this instant."""
        if not try_lock(self.probe_fd, fcntl.LOCK_EX):
            raise Busy
        try:
            yield
        finally:
            unlock(self.probe_fd)

    def _next_stamp(self) -> int:
        """Bump the use counter (under the exclusive lock)."""
        text = os.pread(self.lock_fd, 32, 0).strip()
        stamp = (int(text) if text.isdigit() else 0) + 1
        os.pwrite(self.lock_fd, b"%020d\n" % stamp, 0)
        return stamp

    def members(self) -> list[Member]:
        """Every live member, ours included (under the lock, either kind); dead
        members' files are unlinked on the way."""
        out = []
        for name in os.listdir(self.dir_fd):
            m = _MEMBER.fullmatch(name)
            if m is None:
                if name.endswith(".tmp"):
                    self._read_live(name, 0)  # removes it if its creator is gone
                continue
            pid = int(m[1])
            if self._entry_fd >= 0 and name == self._name and self._record is not None:
                out.append(self._record)
                continue
            rec = self._read_live(name, pid)
            if rec is not None:
                out.append(rec)
        return out

    def _read_live(self, name: str, pid: int) -> Member | None:
        """The record of a live member file; a dead one (its lock free) is unlinked if
        it is still the same file."""
        try:
            fd = os.open(name, os.O_RDONLY | _OPEN, dir_fd=self.dir_fd)
        except FileNotFoundError:
            return None
        try:
            if not try_lock(fd, fcntl.LOCK_SH):
                return decode(pid, os.pread(fd, 256, 0)) if pid else None
            ours = os.fstat(fd)
            with contextlib.suppress(OSError):
                now = os.stat(name, dir_fd=self.dir_fd, follow_symlinks=False)
                if (now.st_dev, now.st_ino) == (ours.st_dev, ours.st_ino):
                    os.unlink(name, dir_fd=self.dir_fd)
            return None
        finally:
            os.close(fd)

    def add(self, footprint: int, budget: int, pinned: bool) -> Member:
        """Become a member (under the exclusive lock): our file, locked before it is
        visible, with a fresh use stamp."""
        assert self._entry_fd < 0, "already a member"
        pid = self.ident
        rec = Member(pid, footprint, budget, pinned, self._next_stamp())
        tmp = f".{pid}-{self.tag}.member.tmp"
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | _OPEN, self.mode, dir_fd=self.dir_fd)
        try:
            if not try_lock(fd, fcntl.LOCK_EX):
                raise Busy  # a reader is looking at it this instant
            set_mode(fd, self.mode)
            os.pwrite(fd, encode(rec.footprint, rec.budget, rec.pinned, rec.stamp), 0)
            os.rename(tmp, self._name, src_dir_fd=self.dir_fd, dst_dir_fd=self.dir_fd)
        except BaseException:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=self.dir_fd)
            raise
        self._entry_fd, self._record = fd, rec
        return rec

    def touch(self) -> bool:
        """Record a use (we started work): a fresh stamp. False if the mutex was busy
        (the stamp is a hint for the choice of victims; the next use records it)."""
        if self._entry_fd < 0 or self._record is None:
            return False
        try:
            with self.locked(exclusive=True):
                rec = attrs.evolve(self._record, stamp=self._next_stamp())
                os.pwrite(self._entry_fd, encode(rec.footprint, rec.budget, rec.pinned, rec.stamp), 0)
                self._record = rec
        except Busy:
            return False
        return True

    def leave(self) -> None:
        """Stop being a member: unlink our file, then close it (its lock goes with it).
        Needs no mutex (an unlink is atomic); never raises."""
        if self._entry_fd < 0:
            return
        with contextlib.suppress(OSError):
            st = os.fstat(self._entry_fd)
            now = os.stat(self._name, dir_fd=self.dir_fd, follow_symlinks=False)
            if (now.st_dev, now.st_ino) == (st.st_dev, st.st_ino):
                os.unlink(self._name, dir_fd=self.dir_fd)
        with contextlib.suppress(OSError):
            os.close(self._entry_fd)
        self._entry_fd, self._record = -1, None

    def close(self) -> None:
        self.leave()
        for name in ("probe_fd", "lock_fd", "dir_fd"):
            fd = getattr(self, name)
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
                setattr(self, name, -1)

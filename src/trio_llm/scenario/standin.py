"""A stand-in for the reference fork's side of the arena, for interoperability tests.

Written only from ``ARBITER-PROTOCOL.md`` and deliberately *not* on trio or on
``arbiter.py``: it takes the token the way the C++ fork does (blocking LOCK_SH on
want.lock, then blocking LOCK_EX on token.lock, want.lock dropped once the token is
ours), holds it, and optionally yields like a resident holder when its probe sees a
waiter. A trio-llm server must yield to it, and it must wait while trio-llm holds.

It is a separate process with no trio loop, so its waits are plain ``select``
timeouts and its clock ``time.monotonic`` (the ban on both in src/ exists for
MockClock tests, which never run this module in-process; ``pyproject.toml`` lifts it
for this file only). It lives in ``scenario/`` because the scenario runner's ``fork``
step runs it (``python -m trio_llm.scenario.standin``); ``tests/standin.py`` runs the
same code for the interoperability tests.

Events go to stdout, one line each, flushed: ``waiting``, ``token``,
``released``. With ``--until-stdin`` a line on stdin (or EOF) ends the hold,
so tests control it without real-time sleeps.

    python -m trio_llm.scenario.standin --arena DIR --hold 5
    python tests/standin.py --arena DIR --yield-when-wanted --hold 60
"""

from __future__ import annotations

import argparse
import errno
import fcntl
import os
import select
import sys
import time

GRACE = 0.1
PROBE_INTERVAL = 0.01


def _say(word: str) -> None:
    print(word, flush=True)


def _flock(fd: int, op: int) -> bool:
    """flock retrying EINTR; with LOCK_NB returns False on contention."""
    while True:
        try:
            fcntl.flock(fd, op)
            return True
        except InterruptedError:
            continue
        except OSError as exc:
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN) and op & fcntl.LOCK_NB:
                return False
            raise


def _wait(timeout: float, stdin_open: bool) -> bool:
    """Sleep up to ``timeout``; True if stdin delivered a line or EOF meanwhile."""
    if not stdin_open:
        select.select([], [], [], max(timeout, 0.0))
        return False
    ready, _, _ = select.select([sys.stdin], [], [], max(timeout, 0.0))
    if ready:
        sys.stdin.readline()
        return True
    return False


def run(args: argparse.Namespace) -> int:
    os.makedirs(args.arena, exist_ok=True)
    token = os.open(os.path.join(args.arena, "token.lock"), os.O_RDWR | os.O_CREAT, 0o666)
    want = os.open(os.path.join(args.arena, "want.lock"), os.O_RDWR | os.O_CREAT, 0o666)
    probe = os.open(os.path.join(args.arena, "want.lock"), os.O_RDWR | os.O_CREAT, 0o666)
    for _ in range(args.cycles):
        _flock(want, fcntl.LOCK_SH)  # register as a waiter
        _say("waiting")
        while not _flock(token, fcntl.LOCK_EX | fcntl.LOCK_NB):
            _flock(token, fcntl.LOCK_EX)  # blocks until the holder unlocks
        _flock(want, fcntl.LOCK_UN)
        _say("token")
        start = time.monotonic()
        while True:
            elapsed = time.monotonic() - start
            left = args.hold - elapsed
            if left <= 0:
                break
            step = min(left, PROBE_INTERVAL) if args.yield_when_wanted else left
            if _wait(step, args.until_stdin):
                break
            if args.yield_when_wanted and elapsed >= GRACE:
                if not _flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB):
                    break  # somebody waits: yield
                _flock(probe, fcntl.LOCK_UN)
        _flock(token, fcntl.LOCK_UN)
        _say("released")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trio_llm.scenario.standin")
    parser.add_argument("--arena", required=True, help="the arena directory")
    parser.add_argument("--hold", type=float, default=1.0, help="seconds to hold the token")
    parser.add_argument(
        "--until-stdin", action="store_true", help="also stop holding on a stdin line or EOF"
    )
    parser.add_argument(
        "--yield-when-wanted",
        action="store_true",
        help="probe want.lock every 10 ms (after 100 ms) and yield when somebody waits",
    )
    parser.add_argument("--cycles", type=int, default=1, help="take/hold/release this many times")
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())

"""Cancelling image work that waits on other threads.

A request's images are encoded on its parse thread (``server.media``), which sometimes
has to wait: for the encoder's turn (one encode at a time, ``siglip``), or for another
request that is encoding the same image. When the request is cancelled, its cancel
event is set from trio (``server.media.run_sync_cancellable``); a thread blocked on a
``threading.Lock`` would not see it until the lock came free, which can be the whole
of another image's encode. Here the waiting is on a ``threading.Condition`` instead,
and the cancel event (``CancelEvent``) notifies the conditions its thread waits on as
it is set, so the waiter wakes, sees the event and leaves with ``EncodeCancelled`` at
once. Nothing polls and no wait has a timeout.

A plain ``threading.Event`` still works as a cancel event everywhere; it is only seen
when the wait ends for another reason (the turn comes), as before.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import attrs

from trio_llm.errors import EncodeCancelled


def check(cancel: threading.Event | None) -> None:
    """Raise ``EncodeCancelled`` if ``cancel`` is set."""
    if cancel is not None and cancel.is_set():
        raise EncodeCancelled("the image encode was cancelled")


class CancelEvent(threading.Event):
    """A request's cancel event that, once set, also wakes the threads waiting with it
    (``woken_by``): a cancelled parse leaves its wait at once instead of when the wait
    would have ended."""

    def __init__(self) -> None:
        super().__init__()
        self._guard = threading.Lock()  # guards _conds (set() runs on trio's thread)
        self._conds: list[threading.Condition] = []

    def set(self) -> None:
        super().set()
        with self._guard:
            conds = list(self._conds)
        for cond in conds:  # never holding _guard and a condition together: no lock order to keep
            with cond:
                cond.notify_all()

    def _add(self, cond: threading.Condition) -> None:
        with self._guard:
            self._conds.append(cond)

    def _remove(self, cond: threading.Condition) -> None:
        with self._guard:
            self._conds.remove(cond)


@contextlib.contextmanager
def woken_by(cancel: threading.Event | None, cond: threading.Condition) -> Iterator[None]:
    """Within the block, setting ``cancel`` (a ``CancelEvent``) notifies ``cond``'s
    waiters. Enter it holding ``cond`` and before checking ``cancel``: an event set
    after the check then finds the waiter inside ``cond.wait()`` (it cannot take
    ``cond`` earlier), so the wake-up is never lost."""
    if not isinstance(cancel, CancelEvent):
        yield
        return
    cancel._add(cond)
    try:
        yield
    finally:
        cancel._remove(cond)


@attrs.define(eq=False)
class TurnLock:
    """One holder at a time, like a ``threading.Lock``, for work that takes every core
    (an image encode): ``hold(cancel)`` waits for the turn, and a waiter whose
    ``CancelEvent`` is set leaves the wait at once with ``EncodeCancelled``, having
    taken nothing. Each release wakes every waiter (those cancelled leave, one of the
    others takes the turn), so a cancelled waiter never swallows the wake-up another
    one needed."""

    _cond: threading.Condition = attrs.field(factory=threading.Condition, alias="cond")
    _held: bool = attrs.field(default=False, init=False)
    _n_waiting: int = attrs.field(default=0, init=False)

    def locked(self) -> bool:
        with self._cond:
            return self._held

    @property
    def n_waiting(self) -> int:
        """Threads waiting for the turn now."""
        with self._cond:
            return self._n_waiting

    @contextlib.contextmanager
    def hold(self, cancel: threading.Event | None = None) -> Iterator[None]:
        """The turn, for the block; ``EncodeCancelled`` if ``cancel`` is (or gets) set
        before the turn comes: a request given up while another encoded starts
        nothing."""
        with self._cond, woken_by(cancel, self._cond):
            while self._held:
                check(cancel)
                self._n_waiting += 1
                try:
                    self._cond.wait()
                finally:
                    self._n_waiting -= 1
            check(cancel)
            self._held = True
        try:
            yield
        finally:
            with self._cond:
                self._held = False
                self._cond.notify_all()

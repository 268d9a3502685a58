"""The residency gate: how the slots loop and the HTTP edge talk to sleep/residency.

The slots/engine loop never touches residency directly. It runs every forward pass
inside ``async with gate.resident():``, which returns at once while the model is
resident and otherwise wakes it (takes the arbiter token, restores the device
memory) first, and which keeps any release from beginning until the pass is over:
the check that the model is resident and the registration of the pass happen in one
step, so a release decided a moment earlier makes the pass wait for the wake instead
of running on a model being released (arbiter protocol, invariant 1).

The task queue reports work with ``set_busy(True/False)``: True from the moment a task
is posted (before the queue loop or the slots loop has seen it) until no task is
queued, assigned or in a slot. The sleep controller counts idle time only while not
busy, and decides to sleep (idle timer or an arbiter waiter) only then, from live
state (invariant 3: the holder yields only when idle). The queue owns that state, not
the slots loop: between two tasks the slots loop has nothing in its slots for a moment
while the next task is already on its way, and a release decided there cut answers in
two. ``AlwaysAwake`` is the gate of a server without sleep or arbiter;
``trio_llm.residency.sleep.SleepController`` implements the same protocol for real.

Optional: a gate whose releases can lose the KV cache (level "unload") exposes
``kv_epoch() -> int``, a counter of such releases. The slots loop reads it after every
``wait_until_no_sleep()`` and, when it moved, forgets its prompt caches (the KV
contents are gone, so a cached prefix would be garbage). A gate without it is assumed
never to lose the KV cache.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any, Protocol

import attrs
import trio


class ResidencyGate(Protocol):
    def resident(self) -> AbstractAsyncContextManager[None]:
        """Around one forward pass: wait until resident (waking it if needed;
        cancellable), then hold off any release until the block exits."""
        ...

    async def wait_until_no_sleep(self) -> None:
        """Return when the model is resident; wake it if needed. Cancellable."""
        ...

    def set_busy(self, busy: bool) -> None:
        """A task is queued, assigned or in a slot (True), or none is (False)."""
        ...

    def is_sleeping(self) -> bool: ...

    def props(self) -> dict[str, Any]:
        """The ``residency`` object of ``/props`` (state, level, device bytes...)."""
        ...

    async def request_sleep(self, level: str | None) -> None:
        """``POST /sleep``: release now (once idle), at ``level`` or the configured one."""
        ...

    async def request_wake(self) -> None:
        """``POST /wake_up``: become resident now."""
        ...


@attrs.define(eq=False)
class AlwaysAwake:
    """The gate of a server with neither idle sleep nor an arena: always resident."""

    _busy: bool = False

    @asynccontextmanager
    async def resident(self) -> AsyncIterator[None]:
        await trio.lowlevel.checkpoint()
        yield

    async def wait_until_no_sleep(self) -> None:
        return None

    def set_busy(self, busy: bool) -> None:
        self._busy = busy

    def is_sleeping(self) -> bool:
        return False

    def props(self) -> dict[str, Any]:
        return {"state": "resident", "level": None, "sleep_enabled": False}

    async def request_sleep(self, level: str | None) -> None:
        from trio_llm.errors import InvalidRequest

        raise InvalidRequest("sleep is not enabled on this server (see --sleep-mode)")

    async def request_wake(self) -> None:
        return None

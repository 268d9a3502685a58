"""The residency gate: how the slots loop and the HTTP edge talk to sleep/residency.

The slots/engine loop never touches residency directly. Before every forward pass
it awaits ``wait_until_no_sleep()``, which returns at once while the model is
resident and otherwise wakes it (takes the arbiter token, restores the device
memory) first. It reports activity with ``set_busy(True/False)``: the sleep
controller counts idle time only while not busy, and decides to sleep (idle timer or
an arbiter waiter) only then, from live state. ``AlwaysAwake`` is the gate of a
server without sleep or arbiter; ``trio_llm.residency.sleep.SleepController``
implements the same protocol for real.

Optional: a gate whose releases can lose the KV cache (level "unload") exposes
``kv_epoch() -> int``, a counter of such releases. The slots loop reads it after every
``wait_until_no_sleep()`` and, when it moved, forgets its prompt caches (the KV
contents are gone, so a cached prefix would be garbage). A gate without it is assumed
never to lose the KV cache.
"""

from __future__ import annotations

from typing import Any, Protocol

import attrs


class ResidencyGate(Protocol):
    async def wait_until_no_sleep(self) -> None:
        """Return when the model is resident; wake it if needed. Cancellable."""
        ...

    def set_busy(self, busy: bool) -> None:
        """The engine has work in flight (True) or has gone idle (False)."""
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

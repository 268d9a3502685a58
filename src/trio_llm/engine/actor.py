"""The backend actor: the one task that calls a Backend.

Inbox: ``BackendRequest`` messages (a function of the backend and a reply channel),
sent by ``BackendClient`` methods. Outbox: one reply per request.
Invariants: exactly one call into the backend runs at a time, always on a worker
thread (so fence waits and numpy work never block the trio loop); a caller that is
cancelled while its call runs does not abandon the thread (a call with side effects
on the device must finish), it only stops waiting for the answer, and the actor
discards the reply.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import attrs
import numpy as np
import trio

from trio_llm.engine.backend import Backend, Level, SeqBatch
from trio_llm.engine.devsample import DeviceChain
from trio_llm.engine.kvshift import Move

T = TypeVar("T")


@attrs.frozen
class BackendRequest:
    fn: Callable[[Backend], Any]
    reply: trio.MemorySendChannel[tuple[bool, Any]]
    what: str


@attrs.frozen
class BackendActorStatistics:
    calls: int
    busy: bool
    queued: int
    busy_seconds: float


@attrs.define(eq=False)
class BackendActor:
    """Owns a Backend; run ``run()`` in a nursery, talk through ``client()``."""

    backend: Backend
    _send: trio.MemorySendChannel[BackendRequest] = attrs.field(init=False)
    _recv: trio.MemoryReceiveChannel[BackendRequest] = attrs.field(init=False)
    _calls: int = 0
    _busy: bool = False
    _busy_seconds: float = 0.0

    def __attrs_post_init__(self) -> None:
        self._send, self._recv = trio.open_memory_channel(16)

    def client(self) -> BackendClient:
        return BackendClient(self._send.clone(), self.backend)

    def statistics(self) -> BackendActorStatistics:
        return BackendActorStatistics(
            calls=self._calls,
            busy=self._busy,
            queued=self._recv.statistics().current_buffer_used,
            busy_seconds=self._busy_seconds,
        )

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        async with self._recv:
            async for req in self._recv:
                self._busy = True
                t0 = trio.current_time()
                try:
                    value = await trio.to_thread.run_sync(req.fn, self.backend)
                    result: tuple[bool, Any] = (True, value)
                except Exception as exc:  # delivered to the caller, who re-raises
                    result = (False, exc)
                finally:
                    self._busy = False
                    self._calls += 1
                    self._busy_seconds += trio.current_time() - t0
                try:
                    req.reply.send_nowait(result)
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    pass  # the caller was cancelled and went away


@attrs.define(eq=False)
class BackendClient:
    """The async face of a backend. Each method waits for the actor's answer."""

    _send: trio.MemorySendChannel[BackendRequest]
    backend: Backend  # for read-only attributes (config, n_ctx, n_seq) only

    async def call(self, fn: Callable[[Backend], T], what: str = "call") -> T:
        reply_send, reply_recv = trio.open_memory_channel[tuple[bool, Any]](1)
        async with reply_recv:
            await self._send.send(BackendRequest(fn, reply_send, what))
            ok, value = await reply_recv.receive()
        if not ok:
            raise value
        return value  # type: ignore[no-any-return]

    async def forward(self, batch: Sequence[SeqBatch]) -> np.ndarray:
        return await self.call(lambda b: b.forward(batch), "forward")

    async def decode(self, batch: Sequence[SeqBatch], chains: Sequence[DeviceChain], us: np.ndarray,
                     ahead: np.ndarray | None = None) -> np.ndarray:
        """Decode steps sampled by the backend (``engine/devsample.py``): ids [n_steps, B];
        ``ahead``: the numbers of the call expected next (it may be queued meanwhile)."""
        return await self.call(lambda b: b.decode(batch, chains, us, ahead), "decode")  # type: ignore[attr-defined]

    async def memory(self) -> dict[str, int]:
        return await self.call(lambda b: b.memory(), "memory")

    async def release(self, level: Level) -> None:
        await self.call(lambda b: b.release(level), "release")

    async def restore(self) -> None:
        await self.call(lambda b: b.restore(), "restore")

    async def read_kv(self, seq_id: int, n: int) -> np.ndarray:
        return await self.call(lambda b: b.read_kv(seq_id, n), "read_kv")

    async def write_kv(self, seq_id: int, kv: np.ndarray) -> None:
        await self.call(lambda b: b.write_kv(seq_id, kv), "write_kv")

    async def shift_kv(self, seq_id: int, moves: Sequence[Move]) -> None:
        """Only for a backend whose ``can_shift`` is true (``engine/kvshift.py``)."""
        await self.call(lambda b: b.shift_kv(seq_id, moves), "shift_kv")  # type: ignore[attr-defined]

    async def read_state(self, seq_id: int, raw: bool = False) -> np.ndarray:
        return await self.call(lambda b: b.read_state(seq_id, raw), "read_state")

    async def write_state(self, seq_id: int, state: np.ndarray, n_pos: int, raw: bool = False) -> None:
        await self.call(lambda b: b.write_state(seq_id, state, n_pos, raw), "write_state")

    async def close(self) -> None:
        with trio.CancelScope(shield=True), trio.move_on_after(30):
            await self.call(lambda b: b.close(), "close")

    async def aclose(self) -> None:
        await self._send.aclose()



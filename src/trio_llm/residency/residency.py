"""Residency: what of the model is on the device now (``docs/residency.md``).

The state machine is plain data and pure transition functions (httpcore style:
decide on data, do the I/O outside, repair the state if the I/O fails); the
``Residency`` actor is the thin async shell that runs them around
``BackendClient.release``/``restore``.

Inbox: ``release(level)`` and ``restore()`` commands, each with a reply channel.
Outbox: the replies; a state-change broadcast that any task can wait on
(``wait_for``). Invariants: one task (``run``) applies every transition, one at a
time; a transition that has started runs to the end even if the caller who asked
for it is cancelled (the backend call cannot be abandoned either), and only the
actor's own cancellation (shutdown) cuts it short, which counts as "maybe
resident" so the token is never given away too early; the device byte
counts are re-read after every transition and cached, so readers (``/props``) never
need the backend.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable
from enum import StrEnum

import attrs
import trio

from trio_llm.engine.actor import BackendClient
from trio_llm.engine.backend import MEMORY_CATEGORIES, Level

log = logging.getLogger(__name__)


class State(StrEnum):
    RESIDENT = "resident"  # everything on the device; forward passes may run
    RELEASING = "releasing"  # a release is copying out / freeing
    COLD = "cold"  # released with a host shadow (level weights or all)
    RESTORING = "restoring"  # a restore is uploading / reloading
    UNLOADED = "unloaded"  # released without a shadow (level unload); restore reloads


#: depth of each level: a deeper release after a shallower one escalates
DEPTH = {Level.WEIGHTS: 1, Level.ALL: 2, Level.UNLOAD: 3}


class InvalidTransition(RuntimeError):
    """A transition asked for in a state that does not allow it (a programming error)."""


@attrs.frozen
class ResidencyState:
    state: State = State.RESIDENT
    level: Level | None = None  # the release in effect (or in progress); None while resident


# ---- pure transitions -------------------------------------------------------------


def begin_release(s: ResidencyState, level: Level) -> ResidencyState:
    if s.state is State.RESIDENT:
        return ResidencyState(State.RELEASING, level)
    if s.state in (State.COLD, State.UNLOADED) and s.level is not None:
        if DEPTH[level] > DEPTH[s.level]:
            return ResidencyState(State.RELEASING, level)  # escalate, e.g. weights -> all
    raise InvalidTransition(f"cannot release ({level.value}) while {s.state.value}")


def end_release(s: ResidencyState) -> ResidencyState:
    if s.state is not State.RELEASING or s.level is None:
        raise InvalidTransition(f"no release in progress ({s.state.value})")
    return ResidencyState(State.UNLOADED if s.level is Level.UNLOAD else State.COLD, s.level)


def release_failed(before: ResidencyState) -> ResidencyState:
    """The state after a release raised. We cannot know how much was freed, so we keep
    the state we came from: never claim "cold" (and let the token go) while device
    memory may still be held."""
    return before


def begin_restore(s: ResidencyState) -> ResidencyState:
    if s.state in (State.COLD, State.UNLOADED):
        return ResidencyState(State.RESTORING, s.level)
    raise InvalidTransition(f"cannot restore while {s.state.value}")


def end_restore(s: ResidencyState) -> ResidencyState:
    if s.state is not State.RESTORING:
        raise InvalidTransition(f"no restore in progress ({s.state.value})")
    return ResidencyState(State.RESIDENT, None)


def restore_failed(s: ResidencyState) -> ResidencyState:
    """A failed restore leaves the model where it was: still released at its level."""
    assert s.level is not None
    return ResidencyState(State.UNLOADED if s.level is Level.UNLOAD else State.COLD, s.level)


def interrupted(s: ResidencyState) -> ResidencyState:
    """A transition cut short by cancellation (shutdown): the backend may finish the
    call or not, so the device may hold anything from nothing to everything. Count it
    as resident, so the token is kept until the backend has been closed."""
    return ResidencyState(State.RESIDENT, None)


def needs_release(s: ResidencyState, level: Level) -> bool:
    """Would ``release(level)`` change anything? (Releasing again at the same or a
    shallower level is a no-op.)"""
    if s.state is State.RESIDENT:
        return True
    return s.level is not None and s.state in (State.COLD, State.UNLOADED) and (
        DEPTH[level] > DEPTH[s.level]
    )


# ---- the level, from flags and the reference fork's environment ---------------------


def resolve_level(flag: str | None, *, env: dict[str, str] | None = None) -> Level:
    """``--sleep-mode`` wins; else the reference fork's variables
    (``LLAMA_SLEEP_VRAM_ONLY=1`` → weights, with ``LLAMA_SLEEP_EVICT_KV=1`` → all);
    else weights, the CLI's default: a fast swap that keeps the prompt cache."""
    if flag:
        return Level(flag)
    env = dict(os.environ) if env is None else env
    if env.get("LLAMA_SLEEP_VRAM_ONLY", "") not in ("", "0"):
        return Level.ALL if env.get("LLAMA_SLEEP_EVICT_KV", "") not in ("", "0") else Level.WEIGHTS
    return Level.WEIGHTS


# ---- the actor ----------------------------------------------------------------------


@attrs.frozen
class ResidencyStatistics:
    state: State
    level: Level | None
    releases: int
    restores: int
    unloads: int  # releases at level unload: each one lost the KV cache
    failures: int
    last_release_seconds: float
    last_restore_seconds: float
    last_bytes_moved: int  # device bytes freed by the last release / allocated by the last restore
    device_bytes: dict[str, int]  # cached after every transition
    restored_bytes: int = 0  # device bytes allocated by all restores (trio_llm_arena_restored_bytes_total)


@attrs.frozen
class _Command:
    op: str  # "release" | "restore"
    level: Level | None
    reply: trio.MemorySendChannel[BaseException | None]


def _total(mem: dict[str, int]) -> int:
    return sum(mem.values())


@attrs.define(eq=False)
class Residency:
    """Runs residency transitions for one backend; start ``run`` in a nursery."""

    _client: BackendClient
    _state: ResidencyState = ResidencyState()
    _memory: dict[str, int] = attrs.field(factory=lambda: dict.fromkeys(MEMORY_CATEGORIES, 0))
    _changed: trio.Event = attrs.field(factory=trio.Event)
    _send: trio.MemorySendChannel[_Command] = attrs.field(init=False)
    _recv: trio.MemoryReceiveChannel[_Command] = attrs.field(init=False)
    _releases: int = 0
    _restores: int = 0
    _unloads: int = 0
    _failures: int = 0
    _last_release: float = 0.0
    _last_restore: float = 0.0
    _last_moved: int = 0
    _restored_bytes: int = 0

    def __attrs_post_init__(self) -> None:
        self._send, self._recv = trio.open_memory_channel(1)

    # -- readers (any task) --

    @property
    def state(self) -> State:
        return self._state.state

    @property
    def level(self) -> Level | None:
        return self._state.level

    @property
    def memory(self) -> dict[str, int]:
        """Device bytes by category, as of the last transition."""
        return dict(self._memory)

    def statistics(self) -> ResidencyStatistics:
        return ResidencyStatistics(
            state=self._state.state,
            level=self._state.level,
            releases=self._releases,
            restores=self._restores,
            unloads=self._unloads,
            failures=self._failures,
            last_release_seconds=self._last_release,
            last_restore_seconds=self._last_restore,
            last_bytes_moved=self._last_moved,
            device_bytes=dict(self._memory),
            restored_bytes=self._restored_bytes,
        )

    async def wait_for(self, predicate: Callable[[State], bool], deadline: float = math.inf) -> bool:
        """Wait until ``predicate(state)`` holds (re-checked on every change) or the
        deadline passes; returns whether it holds."""
        with trio.move_on_at(deadline):
            while not predicate(self._state.state):
                await self._changed.wait()
        return predicate(self._state.state)

    # -- commands (sent to the actor) --

    async def release(self, level: Level) -> None:
        """Release device memory at ``level`` (no-op if already released that deeply).
        If the caller is cancelled, the release still completes in the actor."""
        await self._command("release", Level(level))

    async def restore(self) -> None:
        """Bring the model back to the device (no-op if resident)."""
        await self._command("restore", None)

    async def _command(self, op: str, level: Level | None) -> None:
        reply_send, reply_recv = trio.open_memory_channel[BaseException | None](1)
        async with reply_recv:
            await self._send.send(_Command(op, level, reply_send))
            error = await reply_recv.receive()
        if error is not None:
            raise error

    # -- the task --

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        self._memory = await self._client.memory()
        task_status.started()
        async with self._recv:
            async for cmd in self._recv:
                error: BaseException | None = None
                try:
                    # not shielded: at shutdown the backend actor may be gone and
                    # never answer; a cancelled transition repairs the state instead
                    if cmd.op == "release":
                        assert cmd.level is not None
                        await self._release(cmd.level)
                    else:
                        await self._restore()
                except Exception as exc:  # delivered to the caller, who re-raises
                    error = exc
                try:
                    cmd.reply.send_nowait(error)
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    pass  # the caller was cancelled and went away

    def _set(self, state: ResidencyState) -> None:
        self._state = state
        self._changed.set()
        self._changed = trio.Event()

    async def _release(self, level: Level) -> None:
        if not needs_release(self._state, level):
            return
        before = self._state
        self._set(begin_release(before, level))
        t0 = trio.current_time()
        held = _total(self._memory)
        try:
            await self._client.release(level)
        except Exception:
            self._failures += 1
            self._set(release_failed(before))
            raise
        except BaseException:
            self._set(interrupted(self._state))
            raise
        self._memory = await self._memory_after()
        self._last_release = trio.current_time() - t0
        self._last_moved = held - _total(self._memory)
        self._releases += 1
        if level is Level.UNLOAD:
            self._unloads += 1
        self._set(end_release(self._state))
        log.info(
            "residency: released (%s) %d bytes in %.3f s",
            level.value,
            self._last_moved,
            self._last_release,
        )

    async def _memory_after(self) -> dict[str, int]:
        """The byte counts after a transition that has completed. Cancellation here
        (shutdown) must not undo the transition: the counts are a report only."""
        try:
            return await self._client.memory()
        except trio.Cancelled:
            self._set(end_release(self._state) if self._state.state is State.RELEASING
                      else end_restore(self._state))
            raise

    async def _restore(self) -> None:
        if self._state.state is State.RESIDENT:
            return
        self._set(begin_restore(self._state))
        t0 = trio.current_time()
        held = _total(self._memory)
        try:
            await self._client.restore()
        except Exception:
            self._failures += 1
            self._set(restore_failed(self._state))
            raise
        except BaseException:
            self._set(interrupted(self._state))
            raise
        self._memory = await self._memory_after()
        self._last_restore = trio.current_time() - t0
        self._last_moved = _total(self._memory) - held
        self._restored_bytes += max(0, self._last_moved)
        self._restores += 1
        self._set(end_restore(self._state))
        log.info(
            "residency: restored %d bytes in %.3f s", self._last_moved, self._last_restore
        )

"""The task queue: which task runs in which slot, and who waits.

Inbox (``_inbox``, finite): ``Post`` from HTTP handlers, ``Cancel`` from handlers
whose client went away, ``SlotReleased`` from the slots loop when a slot goes idle.
Outbox (``assign``): ``Assign`` and ``CancelSlot`` messages to the slots loop;
``gate.set_busy`` whenever the answer to "is any task in the server?" may change.

Invariants: a slot runs at most one task; a task is in exactly one of pending,
deferred or active until it finishes or is cancelled; tasks start in arrival order
except that a task pinned to a busy slot (``id_slot``) lets later ones pass. The
outbox never fills: per slot at most one ``Assign`` and two ``CancelSlot`` can be in
flight (see ``outbox_size``), so this actor never blocks on the slots loop, and the
slots loop may block briefly on our inbox without a cycle. A task counts as work
(``has_work``) from the step its ``Post`` enters the inbox until the queue has handled
its slot's ``SlotReleased`` (or dropped it while waiting): the residency gate may
release the device only when nothing is queued, assigned or in a slot (arbiter
protocol, invariant 3), and this actor is the one that sees the whole path.

The decisions are the pure functions at the top (``select_slot``, ``dispatch``),
tested without trio; ``TaskQueue`` is the thin async shell around them. Names follow
llama.cpp's server (``post``, ``defer``, ``start_loop``, ``id_task``, ``id_slot``).
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Mapping, Sequence

import attrs
import trio

from trio_llm.server.gate import AlwaysAwake, ResidencyGate
from trio_llm.server.tasks import ServerTask

# ---------------------------------------------------------------------------
# messages


@attrs.frozen
class Post:
    task: ServerTask


@attrs.frozen
class Cancel:
    id_task: int


@attrs.frozen
class SlotReleased:
    """A slot went idle; ``cache`` is the token list its KV cache now holds."""

    id_slot: int
    id_task: int
    cache: tuple[int, ...]


@attrs.frozen
class Assign:
    task: ServerTask
    id_slot: int


@attrs.frozen
class CancelSlot:
    id_task: int
    id_slot: int


QueueMessage = Post | Cancel | SlotReleased
SlotsMessage = Assign | CancelSlot


def outbox_size(n_slots: int) -> int:
    """A buffer the outbox can never exceed: per slot one Assign, plus a CancelSlot
    for the task it finished on its own and one for the task it was just given."""
    return 3 * n_slots


# ---------------------------------------------------------------------------
# pure state transitions


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


@attrs.frozen
class IdleSlot:
    cache: tuple[int, ...]  # tokens in the slot's KV cache
    last_used: int  # a counter value; smaller = released longer ago


#: a cached prefix decides the slot only when it covers this share of the prompt;
#: below it (a shared BOS, a common first word) the least recently used slot is
#: overwritten instead, keeping more distinct prompts cached (llama-server's
#: ``--slot-prompt-similarity`` idea)
SLOT_PROMPT_SIMILARITY = 0.5


def select_slot(
    idle: Mapping[int, IdleSlot], prompt: Sequence[int], want: int = -1,
    similarity: float = SLOT_PROMPT_SIMILARITY,
) -> int | None:
    """The idle slot for ``prompt``: ``want`` if given (None while it is busy); else the
    one sharing the longest prefix with it if that covers ``similarity`` of the prompt;
    else the least recently used."""
    if want >= 0:
        return want if want in idle else None
    if not idle:
        return None
    best = max(idle, key=lambda i: (common_prefix(idle[i].cache, prompt), -idle[i].last_used))
    if prompt and common_prefix(idle[best].cache, prompt) >= similarity * len(prompt):
        return best
    return min(idle, key=lambda i: idle[i].last_used)


@attrs.define
class QueueState:
    """Everything the queue knows. Mutated only by the functions below."""

    idle: dict[int, IdleSlot]
    pending: deque[ServerTask] = attrs.field(factory=deque)  # posted, not yet looked at
    deferred: deque[ServerTask] = attrs.field(factory=deque)  # looked at, no slot free
    active: dict[int, int] = attrs.field(factory=dict)  # id_task -> id_slot
    #: cancelled while active: id_task -> id_slot until the slot says it let go
    cancelling: dict[int, int] = attrs.field(factory=dict)
    clock: int = 0  # counts releases, for least-recently-used order
    deferrals: int = 0  # tasks that found no free slot when first looked at

    @classmethod
    def initial(cls, n_slots: int) -> QueueState:
        return cls(idle={i: IdleSlot((), i - n_slots) for i in range(n_slots)})  # slot 0 first

    def has_tasks(self) -> bool:
        """A task waits, runs in a slot, or is being stopped there."""
        return bool(self.pending or self.deferred or self.active or self.cancelling)


def dispatch(state: QueueState) -> list[Assign]:
    """Start what can start: every waiting task, oldest first, gets its slot or is
    deferred. Returns the assignments to send; ``state`` is updated in place."""
    n_old = len(state.deferred)
    waiting = list(state.deferred) + list(state.pending)
    state.deferred.clear()
    state.pending.clear()
    out: list[Assign] = []
    done = 0
    try:
        for task in waiting:
            id_slot = select_slot(state.idle, task.prompt, task.params.id_slot)
            if id_slot is None:
                state.deferred.append(task)
                state.deferrals += done >= n_old  # counted once, when first deferred
            else:
                del state.idle[id_slot]
                state.active[task.id_task] = id_slot
                out.append(Assign(task, id_slot))
            done += 1
    except BaseException:
        # repair: whatever was not looked at yet is still waiting, in order
        state.deferred.extend(waiting[done:])
        raise
    return out


def release(state: QueueState, msg: SlotReleased) -> None:
    """A slot went idle: it is free again and remembers what its cache holds."""
    if state.active.get(msg.id_task) == msg.id_slot:
        del state.active[msg.id_task]
    if state.cancelling.get(msg.id_task) == msg.id_slot:
        del state.cancelling[msg.id_task]
    state.clock += 1
    state.idle[msg.id_slot] = IdleSlot(msg.cache, state.clock)


def cancel(state: QueueState, id_task: int) -> ServerTask | CancelSlot | None:
    """Forget a task: a waiting one is removed and returned (its channel must be
    closed); an active one yields the ``CancelSlot`` to send; a finished one, None."""
    for q in (state.pending, state.deferred):
        for task in q:
            if task.id_task == id_task:
                q.remove(task)
                return task
    id_slot = state.active.pop(id_task, None)
    if id_slot is None:
        return None
    state.cancelling[id_task] = id_slot  # still in its slot until SlotReleased
    return CancelSlot(id_task, id_slot)


# ---------------------------------------------------------------------------
# the actor


@attrs.frozen
class QueueStatistics:
    n_pending: int
    n_deferred: int  # llamacpp:requests_deferred
    n_active: int
    n_idle_slots: int
    posted: int
    cancelled: int  # cancelled while still waiting (the slots loop counts running ones)
    deferrals: int  # times a task was looked at and found no free slot


@attrs.define(eq=False)
class TaskQueue:
    """Run ``start_loop`` in a nursery; HTTP handlers ``post`` and ``cancel``."""

    _state: QueueState
    _assign: trio.MemorySendChannel[SlotsMessage]
    _gate: ResidencyGate = attrs.field(factory=AlwaysAwake)
    _send: trio.MemorySendChannel[QueueMessage] = attrs.field(init=False)
    _inbox: trio.MemoryReceiveChannel[QueueMessage] = attrs.field(init=False)
    _ids: itertools.count[int] = attrs.field(init=False, factory=lambda: itertools.count(1))
    _posted: int = 0
    _cancelled: int = 0

    @classmethod
    def create(
        cls, n_slots: int, assign: trio.MemorySendChannel[SlotsMessage], gate: ResidencyGate | None = None
    ) -> TaskQueue:
        return cls(QueueState.initial(n_slots), assign, AlwaysAwake() if gate is None else gate)

    def __attrs_post_init__(self) -> None:
        self._send, self._inbox = trio.open_memory_channel[QueueMessage](64)

    def new_id_task(self) -> int:
        return next(self._ids)

    def inbox(self) -> trio.MemorySendChannel[QueueMessage]:
        """A send side for another actor (the slots loop's releases)."""
        return self._send.clone()

    async def post(self, task: ServerTask) -> None:
        """Queue ``task``; its answers come on ``task.results``. Waits only while the
        inbox is full. If cancelled, the task was not posted."""
        await trio.lowlevel.checkpoint_if_cancelled()
        try:
            self._send.send_nowait(Post(task))
        except trio.WouldBlock:
            await self._send.send(Post(task))  # the inbox is full: busy already
            self._report()
            return
        # busy in the same step the task entered the inbox: a release decided after
        # this sees it, however long the queue loop takes to get to it
        self._report()
        await trio.lowlevel.cancel_shielded_checkpoint()

    async def cancel(self, id_task: int) -> None:
        """Stop ``id_task`` wherever it is; harmless if it already finished."""
        await self._send.send(Cancel(id_task))

    def has_work(self) -> bool:
        """Is any task in the server? Live state: queued here (or still in the inbox),
        assigned, in a slot, or being stopped there. Any message in the inbox counts
        too (conservatively: the loop reports again once it has handled it)."""
        inbox = self._send.statistics()
        return self._state.has_tasks() or bool(inbox.current_buffer_used or inbox.tasks_waiting_send)

    def _report(self) -> None:
        self._gate.set_busy(self.has_work())

    def statistics(self) -> QueueStatistics:
        s = self._state
        return QueueStatistics(
            n_pending=len(s.pending),
            n_deferred=len(s.deferred),
            n_active=len(s.active),
            n_idle_slots=len(s.idle),
            posted=self._posted,
            cancelled=self._cancelled,
            deferrals=s.deferrals,
        )

    async def start_loop(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        try:
            async with self._inbox:
                async for msg in self._inbox:
                    self._handle(msg)
                    for a in dispatch(self._state):
                        self._assign.send_nowait(a)
                    self._report()
        finally:
            # waiting handlers learn at once that their task will never run
            for task in (*self._state.pending, *self._state.deferred):
                task.results.close()

    #: the house name of an actor's main task; ``start_loop`` is llama.cpp's
    run = start_loop

    def _handle(self, msg: QueueMessage) -> None:
        if isinstance(msg, Post):
            self._posted += 1
            self._state.pending.append(msg.task)
        elif isinstance(msg, SlotReleased):
            release(self._state, msg)
        else:
            found = cancel(self._state, msg.id_task)
            if isinstance(found, CancelSlot):
                self._assign.send_nowait(found)  # the slots loop counts it when it lands
            elif found is not None:
                self._cancelled += 1
                found.results.close()

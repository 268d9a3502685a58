"""The slots loop: continuous batching of every active slot into one forward pass.

Inbox (``inbox``, finite): ``Assign`` and ``CancelSlot`` from the queue.
Outbox: ``SlotReleased`` to the queue's inbox when a slot goes idle; ``TaskPartial``
/ ``TaskFinal`` / ``TaskError`` on each task's own result channel (sized so a send
never waits: a slow client must not stall the other slots).

Invariants: each step runs exactly one ``BackendClient.forward`` holding, for every
active slot, either its next prompt chunk or its one token to decode (at most ``-b``
prompt tokens in all); every forward runs inside ``gate.resident()``, entered in the
step that plans it (so the KV epoch and the plan are read on a resident model that
no release can touch until the pass is over). Busy/idle is the task queue's report
to the gate, not ours: with our slots empty the next task may already be on its way
(in our inbox, or in the queue's), and only the queue sees all of it. A slot's KV cache
holds ``seq[:n_past]``, which is also what the slot reports as its prompt cache when
it goes idle, so the next request reuses the longest common prefix.

``plan_batch`` and the ``Slot`` methods are plain synchronous code over plain data;
``SlotsEngine.start_loop`` is the async shell that talks to the backend and channels.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from contextlib import AsyncExitStack
from enum import Enum
from functools import partial
from typing import Any, Protocol

import attrs
import numpy as np
import trio

from trio_llm.engine.actor import BackendClient
from trio_llm.engine.backend import SeqBatch
from trio_llm.engine.constraint import Constraint, Grammars, apply_masks
from trio_llm.engine.kvshift import Move, reuse_chunks
from trio_llm.engine.reasoning_budget import ReasoningBudget, utf8_complete
from trio_llm.engine.sampling import (
    DEFAULT_SEED,
    SamplerState,
    chain,
    draw_u,
    log_softmax,
    make_rng,
    make_state,
    pick,
    sample_u,
    top_logprobs,
)
from trio_llm.errors import ContextOverflow, InvalidRequest, TrioLLMError
from trio_llm.server.checkpoints import Checkpoints
from trio_llm.server.decode import DEFAULT_DECODE_STEPS, DecodeWant, device_plan
from trio_llm.server.gate import ResidencyGate
from trio_llm.server.media import cut_before_media
from trio_llm.server.queue import (
    Assign,
    CancelSlot,
    QueueMessage,
    SlotReleased,
    SlotsMessage,
    common_prefix,
)
from trio_llm.server.stop import StopScanner
from trio_llm.server.tasks import (
    PromptProgress,
    ServerTask,
    SlotAction,
    StopType,
    TaskActionDone,
    TaskError,
    TaskFinal,
    TaskPartial,
    TaskResult,
    Timings,
    TokenProb,
)

log = logging.getLogger(__name__)

#: above this vocabulary size a step's sampling (sorts over the vocabulary) runs on a
#: worker thread, so that a 128k-token top-p does not stall HTTP handling for ~10 ms
THREAD_SAMPLING_VOCAB = 32768


class TextStream(Protocol):
    def feed(self, token: int) -> str: ...

    def flush(self) -> str: ...


class Detokenizer(Protocol):
    """What the slots loop needs of a tokenizer (``trio_llm.model.tokenizer.Tokenizer``)."""

    def is_eog(self, token: int) -> bool: ...

    def stream_decoder(self, *, skip_special: bool = True) -> TextStream: ...


class SlotState(Enum):
    IDLE = "idle"
    PROCESSING_PROMPT = "processing_prompt"
    GENERATING = "generating"


@attrs.frozen
class Work:
    """One slot's share of the next forward pass."""

    id_slot: int
    tokens: tuple[int, ...]
    pos0: int
    decoding: bool  # one token of generation, not a prompt chunk
    #: an image's rows [n, n_embd] (``tokens`` then holds its media id n times): fed
    #: whole, as one non-causal entry (``server/media.py``)
    embd: np.ndarray | None = attrs.field(default=None, eq=False, repr=False)


def plan_batch(wants: Sequence[Work], n_batch: int) -> list[Work]:
    """Choose one forward pass: every decoding slot's token, then prompt chunks in the
    order given (oldest request first) until ``n_batch`` tokens are used. At least one
    prompt token always fits, so a prompt makes progress even when many slots decode."""
    out = [w for w in wants if w.decoding]
    budget = max(n_batch - len(out), 1)
    for w in wants:
        if w.decoding or budget <= 0:
            continue
        if w.embd is not None:
            # an image goes whole (the backend passes it alone if it must): past the
            # budget beside decoding tokens only, so that many decoding slots cannot
            # hold it back for ever; beside another prompt's chunk it waits for room
            if len(w.tokens) > budget and any(not o.decoding for o in out):
                continue
            out.append(w)
            budget -= len(w.tokens)
            continue
        take = min(len(w.tokens), budget)
        out.append(Work(w.id_slot, w.tokens[:take], w.pos0, False))
        budget -= take
    return out


@attrs.define(eq=False)
class Slot:
    """One sequence of the backend's KV cache and the task using it."""

    id: int
    n_ctx: int
    seq: list[int] = attrs.field(factory=list)  # tokens that belong in the KV cache
    n_past: int = 0  # how many of seq are in it
    task: ServerTask | None = None
    n_prompt: int = 0
    n_cached: int = 0  # prompt tokens reused from the previous request
    generated: list[int] = attrs.field(factory=list)
    probs: list[TokenProb] = attrs.field(factory=list)
    scanner: StopScanner = attrs.field(factory=lambda: StopScanner(()))
    text: TextStream | None = None  # whole UTF-8 characters only: tokens may split one
    rng: np.random.Generator | None = None
    #: what llama.cpp's other samplers keep between steps (Mirostat's mu, XTC's draws,
    #: DRY's breakers): made on the task's first sample when its params need it
    sampler: SamplerState | None = None
    budget: ReasoningBudget | None = None  # the task's thinking budget (engine/reasoning_budget.py)
    #: n_indent / t_max_predict_ms: a newline was generated, and where the current line starts
    has_new_line: bool = False
    last_nl_pos: int = 0
    #: the answer ended on an end-of-generation token: llama-server counts it as decoded
    n_eog: int = 0
    truncated: bool = False  # a context shift dropped tokens of this task's sequence
    t_start: float = 0.0
    t_prompt_done: float = 0.0
    started_order: int = 0
    #: (positions cached, common prefix, checkpoint positions) -> the prefix every layer's
    #: memory can continue from (a sliding-window ring or a recurrent state may not allow
    #: a shorter one, unless a checkpoint of the state is there)
    reusable: Callable[[int, int, Sequence[int]], int] = attrs.field(default=lambda n_cached, n_common, _: n_common)
    checkpoints: Checkpoints | None = None  # a hybrid model's context checkpoints
    restore_at: int | None = None  # the checkpoint to write back before the next pass
    constraint: Constraint | None = None  # the task's grammar matcher, made on its first sample
    can_shift: bool = False  # the backend can move cache rows (every layer a full KV cache)
    #: whether a token's bytes end on a whole UTF-8 character (the thinking budget's rule)
    utf8_complete: Callable[[int], bool] = lambda _token: True
    #: KV moves (--cache-reuse) owed before the next pass, and the prefix valid until then
    shifts: tuple[Move, ...] = ()
    n_prefix: int = 0

    @property
    def state(self) -> SlotState:
        if self.task is None:
            return SlotState.IDLE
        return SlotState.GENERATING if self.generated else SlotState.PROCESSING_PROMPT

    def cache(self) -> tuple[int, ...]:
        return tuple(self.seq[: self.n_past])

    def begin(self, task: ServerTask, text: TextStream, now: float, order: int) -> None:
        """Take ``task``: keep the common prefix of the cache, queue the rest of the prompt."""
        prompt = list(task.prompt)
        if len(prompt) >= self.n_ctx:
            raise ContextOverflow(len(prompt) + 1, self.n_ctx)
        cache = self.cache()
        keep = common_prefix(cache, prompt) if task.params.cache_prompt else 0
        shifts: list[Move] = []
        n_prefix = keep  # what the cache holds at its place until the moves are made
        if task.params.cache_prompt and task.params.n_cache_reuse > 0 and self.can_shift and not task.params.media:
            keep, shifts = reuse_chunks(cache, prompt, keep, task.params.n_cache_reuse)
        ck = self.checkpoints
        if ck is not None:
            ck.keep_upto(keep)  # copies past the common prefix hold another sequence
        # the last prompt token is always evaluated: its logits give the first sample
        keep = self.reusable(self.n_past, min(keep, len(prompt) - 1), ck.positions() if ck else ())
        cut = cut_before_media(prompt, keep)
        if cut != keep:  # never a part of an image's rows
            keep = self.reusable(self.n_past, cut, ck.positions() if ck else ())
            keep = keep if keep <= cut else 0
        if ck is None or keep == 0:
            self.restore_at = None  # position 0 starts afresh
        elif keep != self.n_past:
            self.restore_at = keep  # a checkpoint (reusable_prefix returned one)
        # else: continuing where the cache stands; a restore chosen for a task that went
        # away before its pass is still owed (the state is not at n_past yet)
        self.seq, self.n_past = prompt, keep
        self.shifts = tuple(shifts)
        self.n_prefix = min(n_prefix, keep)
        self.task, self.n_prompt, self.n_cached = task, len(prompt), keep
        self.generated, self.probs = [], []
        self.has_new_line, self.last_nl_pos, self.n_eog, self.truncated = False, 0, 0, False
        self.scanner = StopScanner(task.params.stop)
        self.text = text
        self.rng = make_rng(task.params.sampling.seed)
        self.budget = None if task.params.reasoning is None else ReasoningBudget(task.params.reasoning,
                                                                                   self.utf8_complete)
        self.t_start = self.t_prompt_done = now
        self.started_order = order

    def want(self) -> Work:
        rest = tuple(self.seq[self.n_past :])  # [n] tokens not yet in the KV cache
        stop = self.checkpoint_stop()
        if stop is not None:
            rest = rest[: stop - self.n_past]  # the prompt piece ends where a checkpoint is taken
        media = self.task.params.media if self.task is not None else None
        if media:  # (a text prompt is not scanned: a long one would cost a pass of Python per step)
            if rest and rest[0] < 0:  # an image's rows, whole
                rows = media[rest[0]]
                return Work(self.id, rest[: len(rows)], self.n_past, False, rows)
            first = next((i for i, t in enumerate(rest) if t < 0), None)
            if first is not None:
                rest = rest[:first]  # the text before an image
        # after a lost KV cache a generating slot re-evaluates its text as a prompt chunk
        return Work(self.id, rest, self.n_past, bool(self.generated) and len(rest) == 1)

    def checkpoint_stop(self) -> int | None:
        if self.checkpoints is None or self.generated or self.task is None:
            return None
        return self.checkpoints.next_stop(self.n_past, len(self.seq))

    def forget(self) -> None:
        """The KV cache no longer holds what the checkpoints were taken from."""
        if self.checkpoints is not None:
            self.checkpoints.clear()
        self.restore_at = None
        self.shifts = ()

    def timings(self, now: float) -> Timings:
        """The figures so far: while the prompt is processed, its passes until ``now``."""
        done = bool(self.generated) or self.n_past >= self.n_prompt
        return Timings(
            prompt_n=(self.n_prompt if done else self.n_past) - self.n_cached,
            prompt_ms=1e3 * ((self.t_prompt_done if done else now) - self.t_start),
            cache_n=self.n_cached,
            predicted_n=len(self.generated) + self.n_eog,
            predicted_ms=1e3 * (now - self.t_prompt_done) if self.generated or self.n_eog else 0.0,
        )

    def progress(self, now: float) -> TaskPartial:
        """llama-server's prompt progress report (``return_progress``), with its timings."""
        assert self.task is not None
        report = PromptProgress(self.n_prompt, self.n_cached, self.n_past, int(1e3 * (now - self.t_start)))
        timings = self.timings(now) if self.task.params.timings_per_token else None
        return TaskPartial(self.task.id_task, -1, "", None, progress=report, timings=timings, n_prompt=self.n_prompt)

    def finish(self, stop_type: StopType, now: float) -> TaskFinal:
        assert self.task is not None
        tail = self.scanner.flush() if stop_type != "word" else ""
        tail_utf8 = self.text.flush() if self.text is not None and stop_type != "word" else ""
        if tail_utf8:
            self.scanner.text += tail_utf8
            tail += tail_utf8
        final = TaskFinal(
            id_task=self.task.id_task,
            id_slot=self.id,
            content=self.scanner.text,
            tokens=tuple(self.generated),
            stop_type=stop_type,
            stopping_word=self.scanner.stopping_word,
            n_prompt=self.n_prompt,
            timings=self.timings(now),
            probs=tuple(self.probs),
            text_tail=tail,
            n_cached_end=self.n_past,
            truncated=self.truncated,
        )
        return final

    def reset(self) -> None:
        """Go idle; the KV cache (``seq[:n_past]``) stays for the next request (if its
        KV moves were never made, only the common prefix before them)."""
        if self.shifts:
            self.n_past, self.shifts = min(self.n_past, self.n_prefix), ()
        self.task = None
        self.seq = self.seq[: self.n_past]
        self.rng = None
        self.sampler = None
        self.budget = None
        self.constraint = None


@attrs.frozen
class SlotsStatistics:
    n_slots: int
    n_processing: int  # llamacpp:requests_processing
    n_prompt_tokens_processed: int  # llamacpp:prompt_tokens_total
    t_prompt_processing: float  # seconds
    n_tokens_predicted: int  # llamacpp:tokens_predicted_total
    t_tokens_generation: float  # seconds
    n_decode: int  # forward passes
    n_busy_slots_total: int  # sum over forward passes of the slots in each
    n_tasks_done: int
    n_tasks_cancelled: int
    kv_tokens: int  # positions in use over all slots
    kv_capacity: int
    n_prompt_tokens_cached: int = 0  # llamacpp:prompt_tokens_cached_total (reused, not evaluated)
    n_tokens_max: int = 0  # llamacpp:n_tokens_max: the longest prompt a slot has held
    #: seconds the loop spent per phase of its steps ("prompt" / "decode": the forward
    #: calls of passes with / without prompt tokens as the loop sees them, thread hop
    #: included; "device": the calls of device-sampled decode steps; "sample"; "emit":
    #: stop checks and sends to clients): where a decode step's time goes
    #: (bench/serverpath.py)
    t_phases: tuple[tuple[str, float], ...] = ()


@attrs.define(eq=False)
class SlotsEngine:
    """Run ``start_loop`` in a nursery; the queue feeds ``inbox``."""

    _client: BackendClient
    _gate: ResidencyGate
    _tokenizer: Detokenizer
    _to_queue: trio.MemorySendChannel[QueueMessage]
    _inbox: trio.MemoryReceiveChannel[SlotsMessage]
    n_ctx: int  # per slot
    n_batch: int
    grammars: Grammars | None = None  # constrained decoding (tasks with a grammar)
    ctx_checkpoints: int = 32  # --ctx-checkpoints (hybrid models; server/checkpoints.py)
    checkpoint_min_step: int = 8192  # --checkpoint-min-step
    #: decode steps per submit when the backend samples on the device (server/decode.py);
    #: 0: every step samples on the host
    decode_steps: int = DEFAULT_DECODE_STEPS
    #: hand the backend the numbers of the decode call expected next, so that it can
    #: queue that submit while the host accepts this one's tokens (server/decode.py)
    look_ahead: bool = True
    #: --special: control tokens' text is part of the answer (the end token's too)
    special: bool = False
    #: --context-shift (``_context_shift``), and whether prompts begin with a BOS it keeps
    ctx_shift: bool = False
    add_bos: bool = False
    _slots: list[Slot] = attrs.field(init=False)
    _released: list[SlotReleased] = attrs.field(init=False, factory=list)
    _order: int = 0
    _kv_epoch: int = 0
    # statistics
    _n_prompt: int = 0
    _n_prompt_cached: int = 0
    _n_tokens_max: int = 0
    _t_prompt: float = 0.0
    _n_predicted: int = 0
    _t_predicted: float = 0.0
    _n_decode: int = 0
    _n_busy_total: int = 0
    _n_done: int = 0
    _n_cancelled: int = 0
    _t_phases: dict[str, float] = attrs.field(factory=lambda: dict.fromkeys(("prompt", "decode", "device", "sample", "emit"), 0.0))
    #: id_task -> uniform numbers drawn ahead (for a look-ahead submit), consumed first
    _drawn: dict[int, list[float]] = attrs.field(factory=dict)
    #: ``_pieces`` bound once: the samplers' DRY cache keys on this object
    _piece_source: Callable[[], list[bytes]] | None = attrs.field(init=False, default=None)

    def _tokenize(self, text: str) -> list[int]:
        """A DRY breaker's text as tokens (no specials), as llama.cpp splits one."""
        encode = getattr(self._tokenizer, "encode", None)
        return [] if encode is None else list(encode(text, add_special=False, parse_special=False))

    def _pieces(self) -> list[bytes]:
        """Every token's bytes (DRY's sequence breakers are matched against them)."""
        piece = getattr(self._tokenizer, "token_to_piece", None)
        if piece is None:
            return []
        return [bytes(piece(i)) for i in range(self._client.backend.config.n_vocab)]

    def __attrs_post_init__(self) -> None:
        backend = self._client.backend
        self._piece_source = self._pieces
        reusable = getattr(backend, "reusable_prefix", None) or (lambda n_cached, n_common, _=(): n_common)
        shift = bool(getattr(backend, "can_shift", False))
        piece = getattr(self._tokenizer, "token_to_piece", None)
        complete = (lambda t: utf8_complete(bytes(piece(t)))) if piece is not None else (lambda _t: True)
        self._slots = [Slot(i, self.n_ctx, reusable=reusable, can_shift=shift, utf8_complete=complete)
                       for i in range(backend.n_seq)]
        if any(getattr(backend.config, "recurrent_layers", ())) and self.ctx_checkpoints > 0:
            for slot in self._slots:
                slot.checkpoints = Checkpoints(self.ctx_checkpoints, self.checkpoint_min_step)
        self._kv_epoch = self._gate_epoch()

    # -- read-only views, for /slots, /metrics and tests --------------------------

    def statistics(self) -> SlotsStatistics:
        return SlotsStatistics(
            n_slots=len(self._slots),
            n_processing=sum(s.task is not None for s in self._slots),
            n_prompt_tokens_processed=self._n_prompt,
            t_prompt_processing=self._t_prompt,
            n_tokens_predicted=self._n_predicted,
            t_tokens_generation=self._t_predicted,
            n_decode=self._n_decode,
            n_busy_slots_total=self._n_busy_total,
            n_tasks_done=self._n_done,
            n_tasks_cancelled=self._n_cancelled,
            kv_tokens=sum(s.n_past for s in self._slots),
            kv_capacity=self.n_ctx * len(self._slots),
            n_prompt_tokens_cached=self._n_prompt_cached,
            n_tokens_max=self._n_tokens_max,
            t_phases=tuple(self._t_phases.items()),
        )

    def slot_views(self) -> list[dict[str, Any]]:
        out = []
        for s in self._slots:
            task = s.task
            view: dict[str, Any] = {
                "id": s.id,
                "id_task": task.id_task if task else -1,
                "n_ctx": s.n_ctx,
                "speculative": False,
                "is_processing": task is not None,
                "state": s.state.value,
                "n_past": s.n_past,
                "n_cached": len(s.seq[: s.n_past]) if task is None else s.n_cached,
                "n_prompt": s.n_prompt if task else 0,
                "n_decoded": len(s.generated) if task else 0,
            }
            if task is not None:  # llama-server's fields of a slot with a task; none when idle
                view |= {
                    "n_prompt_tokens": s.n_prompt,
                    "n_prompt_tokens_processed": s.n_prompt - s.n_cached,
                    "n_prompt_tokens_cache": s.n_cached,
                    "params": task.params.to_json(),
                    "next_token": [{"has_next_token": True, "n_decoded": len(s.generated),
                                    "n_remain": (task.params.n_predict - len(s.generated)
                                                 if task.params.n_predict >= 0 else -1)}],
                }
            out.append(view)
        return out

    # -- the loop ----------------------------------------------------------------

    async def start_loop(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        try:
            while True:
                if not self._active():
                    self._handle(await self._inbox.receive())
                self._drain_inbox()
                await self._run_actions()
                await self._flush_releases()
                if not self._active():
                    continue
                await self._step()
                await self._flush_releases()
        finally:
            # handlers still waiting learn at once that no answer will come
            for s in self._slots:
                if s.task is not None:
                    s.task.results.close()

    #: the house name of an actor's main task; ``start_loop`` is llama.cpp's
    run = start_loop

    def _active(self) -> list[Slot]:
        """Slots with a generation to run (a slot action is run at once instead)."""
        return [s for s in self._slots if s.task is not None and s.task.action is None]

    def _gate_epoch(self) -> int:
        # A gate counts the releases that lost the KV cache (level "unload"); a gate
        # without the counter never loses it.
        epoch = getattr(self._gate, "kv_epoch", None)
        return int(epoch()) if callable(epoch) else 0

    def _drain_inbox(self) -> None:
        while True:
            try:
                msg = self._inbox.receive_nowait()
            except trio.WouldBlock:
                return
            self._handle(msg)

    def _handle(self, msg: SlotsMessage) -> None:
        now = trio.current_time()
        if isinstance(msg, Assign):
            slot = self._slots[msg.id_slot]
            assert slot.task is None, f"slot {slot.id} assigned while busy"
            if msg.task.action is not None:
                slot.task = msg.task  # run by _run_actions, before the next pass
                return
            self._order += 1
            try:
                slot.begin(msg.task, self._tokenizer.stream_decoder(skip_special=not self.special), now, self._order)
                self._n_prompt_cached += slot.n_cached
                self._n_tokens_max = max(self._n_tokens_max, slot.n_prompt)
                self._report_progress(slot, now)  # the first report: before any pass
            except TrioLLMError as exc:
                slot.task = msg.task
                error = TaskError(msg.task.id_task, str(exc), 400, "exceed_context_size_error")
                if self._send(slot, error):
                    self._release(slot, cancelled=False)
        elif isinstance(msg, CancelSlot):
            slot = self._slots[msg.id_slot]
            if slot.task is not None and slot.task.id_task == msg.id_task:
                self._release(slot, cancelled=True)

    def _release(self, slot: Slot, *, cancelled: bool) -> None:
        assert slot.task is not None
        id_task = slot.task.id_task
        self._drawn.pop(id_task, None)
        slot.task.results.close()
        slot.reset()
        if cancelled:
            self._n_cancelled += 1
        else:
            self._n_done += 1
        self._released.append(SlotReleased(slot.id, id_task, slot.cache()))

    async def _flush_releases(self) -> None:
        while self._released:
            await self._to_queue.send(self._released.pop(0))

    def _send(self, slot: Slot, msg: TaskResult) -> bool:
        """Deliver to the slot's client; False (and the slot freed) if it went away."""
        assert slot.task is not None
        try:
            slot.task.results.send_nowait(msg)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            self._release(slot, cancelled=True)
            return False
        return True

    async def _run_actions(self) -> None:
        for slot in self._slots:
            task = slot.task
            if task is None or task.action is None:
                continue
            try:
                # save and restore need the device: wait for it serving the inbox, as a
                # generation does, so that cancellations and new requests are handled
                # meanwhile, and the action itself is dropped if its client goes away
                if task.action.kind != "erase" and not await self._wait_serving_inbox(
                    partial(self._task_left, slot, task)
                ):
                    continue
                done = await self._slot_action(slot, task.action)
                result: TaskResult = (attrs.evolve(done, id_task=task.id_task) if isinstance(done, TaskActionDone)
                                      else TaskActionDone(task.id_task, done))
            except InvalidRequest as exc:
                result = TaskError(task.id_task, str(exc), 400, "invalid_request_error")
            except TrioLLMError as exc:
                result = TaskError(task.id_task, str(exc), 500, "server_error")
            if self._send(slot, result):
                self._release(slot, cancelled=False)

    @staticmethod
    def _task_left(slot: Slot, task: ServerTask) -> bool:
        return slot.task is not task

    async def _slot_action(self, slot: Slot, action: SlotAction) -> TaskActionDone | dict[str, Any]:
        """Save, restore or erase ``slot``'s KV cache; llama-server's answer for it.
        Only the device side runs here: the file was read (restore) or is written
        (save) by the HTTP handler (see ``SlotAction``)."""
        t0 = trio.current_time()
        if action.kind == "erase":
            n = slot.n_past
            slot.seq, slot.n_past = [], 0
            slot.forget()
            return {"id_slot": slot.id, "n_erased": n}
        if action.kind == "restore":
            kv = action.kv
            assert kv is not None
            async with self._gate.resident():
                self._check_epoch()
                slot.seq, slot.n_past = [], 0  # nothing of the old cache is valid meanwhile
                slot.forget()
                await self._client.write_kv(slot.id, kv)
                if action.state is not None and action.state.size:  # a recurrent state continues from here
                    await self._client.write_state(slot.id, action.state, len(action.tokens))
                slot.seq, slot.n_past = list(action.tokens), len(action.tokens)
            ms = 1e3 * (trio.current_time() - t0)
            return {"id_slot": slot.id, "filename": action.filename, "n_restored": len(action.tokens),
                    "n_read": kv.nbytes + (action.state.nbytes if action.state is not None else 0), "timings": {"restore_ms": ms}}
        async with self._gate.resident():
            self._check_epoch()
            tokens = tuple(slot.seq[: slot.n_past])
            kv = await self._client.read_kv(slot.id, len(tokens))
            if slot.restore_at is not None and slot.checkpoints is not None:  # the state is owed a restore: now
                await self._client.write_state(slot.id, slot.checkpoints.state_at(slot.restore_at), slot.restore_at,
                                               raw=True)
                slot.restore_at = None
            state = await self._client.read_state(slot.id)
        body = {"id_slot": slot.id, "filename": action.filename, "n_saved": len(tokens)}
        return TaskActionDone(-1, body, tokens, kv, state)

    async def _wait_resident(self) -> bool:
        """Wait for the model to be resident. While a wake takes time (a restore, another
        server holding the GPU), keep serving the inbox: a cancelled request must free
        its slot at once and a new one joins the pass that follows the wake. Returns
        False when nothing is left to run (every waiting request went away, or a slot
        action arrived, which runs first). Only a wait: the pass itself holds
        ``gate.resident()``."""
        return await self._wait_serving_inbox(lambda: not self._active() or self._pending_action())

    async def _wait_serving_inbox(self, give_up: Callable[[], bool]) -> bool:
        """Wait for the model to be resident (True), serving the inbox meanwhile, until
        ``give_up()`` holds after a message (False).

        The waker stays alive across inbox messages: cancelling it on every message
        would withdraw and re-register the demand each time, which under an arbiter
        means dropping and re-taking the want.lock registration (churn a holder sees
        as a waiter coming and going). A wake that fails raises its ``TrioLLMError``
        bare, not inside the nursery's ``ExceptionGroup``: the caller answers the
        waiting requests with it and the loop lives on."""
        if not self._gate.is_sleeping():
            return True
        woke = False
        failure: TrioLLMError | None = None
        async with trio.open_nursery() as nursery:

            async def wake() -> None:
                nonlocal woke, failure
                try:
                    await self._gate.wait_until_no_sleep()
                    woke = True
                except TrioLLMError as exc:
                    failure = exc
                nursery.cancel_scope.cancel()

            async def listen() -> None:
                while True:
                    self._handle(await self._inbox.receive())
                    if give_up():
                        nursery.cancel_scope.cancel()
                        return

            nursery.start_soon(wake)
            nursery.start_soon(listen)
        if failure is not None:
            raise failure
        return woke

    def _pending_action(self) -> bool:
        return any(s.task is not None and s.task.action is not None for s in self._slots)

    async def _step(self) -> None:
        async with AsyncExitStack() as stack:
            try:
                if not await self._wait_resident():
                    return
                # from here to the end of the forward: resident, and no release begins
                await stack.enter_async_context(self._gate.resident())
            except TrioLLMError as exc:
                self._fail_all(f"the model could not be made resident: {exc}")
                return
            plan = self._plan()
            if not plan:
                return
            batch = [self._entry(w) for w in plan]
            dev = self._device_plan(plan)
            t0 = trio.current_time()
            try:
                await self._shift_kv()
                await self._restore_checkpoints(plan)
                if dev is not None:
                    ids = await self._client.decode(batch, *dev)  # [n_steps, len(plan)]
                else:
                    logits = await self._client.forward(batch)  # [len(plan), n_vocab]
                    await self._take_checkpoints(plan)
            except TrioLLMError as exc:
                self._fail_all(f"the backend failed: {exc}")
                return
            t1 = trio.current_time()
        if dev is not None:
            self._after_decode(plan, ids, t0, t1)
        else:
            await self._after_forward(plan, logits, t0, t1)

    @staticmethod
    def _entry(w: Work) -> SeqBatch:
        if w.embd is not None:
            return SeqBatch(w.id_slot, np.zeros(len(w.tokens), np.int32), w.pos0, embd=w.embd, causal=False)
        return SeqBatch(w.id_slot, np.asarray(w.tokens, dtype=np.int32), w.pos0)

    def _device_plan(self, plan: list[Work]) -> tuple[list[Any], np.ndarray, np.ndarray | None] | None:
        """The chains, uniform numbers [n_steps, len(plan)] and look-ahead numbers of a
        device-sampled pass (``server/decode.py``), or None for the logits path."""
        backend = self._client.backend
        steps_max = getattr(backend, "decode_steps_max", 0)
        if not steps_max or self.decode_steps < 1 or not all(w.decoding for w in plan):
            return None
        wants = []
        for w in plan:
            task = self._slots[w.id_slot].task
            assert task is not None
            p = task.params
            left = p.n_predict - len(self._slots[w.id_slot].generated) if p.n_predict >= 0 else -1
            # a grammar or a thinking budget decides tokens on the host
            wants.append(DecodeWant(p.sampling, p.grammar is not None or p.reasoning is not None, w.pos0, left))
        chosen = device_plan(wants, n_vocab=backend.config.n_vocab, n_ctx=self.n_ctx, steps=self.decode_steps,
                             steps_max=steps_max, rows_max=8)
        if chosen is None:
            return None
        chains, n_steps = chosen
        us = np.empty((n_steps, len(plan)), np.float32)
        for r, w in enumerate(plan):
            slot = self._slots[w.id_slot]
            for j in range(n_steps):
                us[j, r] = self._next_u(slot)
        # the next call, if every slot goes on: its numbers drawn now (and consumed by
        # whatever pass comes next, so a seed gives the same tokens either way)
        ahead = None
        later = [attrs.evolve(x, pos0=x.pos0 + n_steps, remaining=x.remaining - n_steps if x.remaining >= 0 else -1)
                 for x in wants]
        if self.look_ahead and all(x.remaining != 0 and x.pos0 < self.n_ctx - 1 for x in later):
            nxt = device_plan(later, n_vocab=backend.config.n_vocab, n_ctx=self.n_ctx, steps=self.decode_steps,
                              steps_max=steps_max, rows_max=8)
            if nxt is not None:
                ahead = np.empty((nxt[1], len(plan)), np.float32)
                for r, w in enumerate(plan):
                    slot = self._slots[w.id_slot]
                    assert slot.task is not None and slot.rng is not None
                    for j in range(nxt[1]):
                        ahead[j, r] = draw_u(slot.task.params.sampling, slot.rng)
                    self._drawn.setdefault(slot.task.id_task, []).extend(ahead[:, r].tolist())
        return chains, us, ahead

    def _next_u(self, slot: Slot) -> float:
        """The slot's next uniform number: one drawn ahead, else a fresh draw."""
        assert slot.task is not None and slot.rng is not None
        drawn = self._drawn.get(slot.task.id_task)
        if drawn:
            return drawn.pop(0)
        return draw_u(slot.task.params.sampling, slot.rng)

    def _after_decode(self, plan: list[Work], ids: np.ndarray, t0: float, now: float) -> None:
        """Accept a device-sampled pass's ids step by step; a slot that stops drops the
        ids drawn past its stop (their KV positions lie past what it keeps)."""
        n_steps = ids.shape[0]
        self._n_decode += n_steps
        self._n_busy_total += n_steps * len(plan)
        self._t_predicted += now - t0
        self._t_phases["device"] += now - t0
        tasks = [self._slots[w.id_slot].task for w in plan]
        for j in range(n_steps):
            for r, w in enumerate(plan):
                slot = self._slots[w.id_slot]
                if slot.task is None or slot.task is not tasks[r]:
                    continue  # cancelled while the pass ran, or stopped at an earlier step
                slot.n_past += 1
                self._accept(slot, int(ids[j, r]), None, now)
        self._t_phases["emit"] += trio.current_time() - now

    async def _shift_kv(self) -> None:
        """Make the KV moves ``Slot.begin`` chose (``--cache-reuse``), before any pass
        reads or writes those positions."""
        for slot in self._slots:
            if slot.shifts and slot.task is not None:
                moves, slot.shifts = slot.shifts, ()
                await self._client.shift_kv(slot.id, moves)
                log.info("slot %d: moved %d cached tokens by KV shifting (%d chunks)", slot.id,
                         sum(m.n for m in moves), len(moves))

    async def _restore_checkpoints(self, plan: list[Work]) -> None:
        """Put back the checkpoint each slot continues from (``Slot.begin`` chose it)."""
        for w in plan:
            slot = self._slots[w.id_slot]
            if slot.restore_at is not None and slot.checkpoints is not None and w.pos0 == slot.restore_at:
                await self._client.write_state(slot.id, slot.checkpoints.state_at(slot.restore_at), slot.restore_at,
                                               raw=True)
                log.info("slot %d: restored the context checkpoint at %d", slot.id, slot.restore_at)
            slot.restore_at = None

    async def _take_checkpoints(self, plan: list[Work]) -> None:
        """Copy the state of each slot whose prompt piece ended at a checkpoint's place."""
        for w in plan:
            slot = self._slots[w.id_slot]
            ck = slot.checkpoints
            if ck is None or w.decoding or slot.generated or slot.task is None:
                continue
            pos = w.pos0 + len(w.tokens)
            if ck.wanted(pos, len(slot.seq), ck.next_stop(w.pos0, len(slot.seq))):
                ck.add(pos, await self._client.read_state(slot.id, raw=True))  # the backend's layout: one copy
                log.info("slot %d: context checkpoint at %d (%d held, %.1f MiB)", slot.id, pos, len(ck.positions()),
                         ck.n_bytes / 2**20)

    def _check_epoch(self) -> None:
        """On a resident model: if the KV cache was lost while the model slept, every
        slot starts over."""
        epoch = self._gate_epoch()
        if epoch != self._kv_epoch:
            self._kv_epoch = epoch
            for s in self._slots:
                s.n_past = 0
                s.forget()
                if s.task is not None:
                    s.n_cached = 0

    def _plan(self) -> list[Work]:
        """This step's forward pass, read on a resident model (inside ``resident()``)."""
        self._check_epoch()
        active = sorted(self._active(), key=lambda s: s.started_order)
        if not active:
            return []
        return plan_batch([s.want() for s in active], self.n_batch)

    async def _after_forward(self, plan: list[Work], logits: np.ndarray, t0: float, now: float) -> None:
        self._n_decode += 1
        self._n_busy_total += len(plan)
        n_prompt_tokens = sum(len(w.tokens) for w in plan if not w.decoding)
        self._n_prompt += n_prompt_tokens
        if n_prompt_tokens:
            self._t_prompt += now - t0
        else:
            self._t_predicted += now - t0
        self._t_phases["prompt" if n_prompt_tokens else "decode"] += now - t0

        ready: list[tuple[Slot, np.ndarray]] = []
        for w, row in zip(plan, logits, strict=True):
            slot = self._slots[w.id_slot]
            if slot.task is None:
                continue  # cancelled while the pass ran
            slot.n_past += len(w.tokens)
            if slot.n_past < len(slot.seq):
                self._report_progress(slot, now)
                continue  # more prompt to go
            if not slot.generated:
                slot.t_prompt_done = now
                if not self._report_progress(slot, now):
                    continue
                if slot.task.params.n_predict == 0:
                    self._finish(slot, "limit", now)
                    continue
            ready.append((slot, row))
        if ready:
            picks = await self._sample(ready)
            t_sampled = trio.current_time()
            self._t_phases["sample"] += t_sampled - now
            for (slot, _), (token, prob) in zip(ready, picks, strict=True):
                if slot.task is not None:
                    self._accept(slot, token, prob, t_sampled)
            self._t_phases["emit"] += trio.current_time() - t_sampled

    async def _sample(self, ready: list[tuple[Slot, np.ndarray]]) -> list[tuple[int, TokenProb | None]]:
        jobs = []
        seeds: dict[int, int] = {}  # slots whose sampler state is made in run()
        for k, (slot, row) in enumerate(ready):
            assert slot.task is not None and slot.rng is not None
            params = slot.task.params.sampling
            jobs.append((row, params, self._next_u(slot), slot.seq[: slot.n_past]))
            if params.host_only and slot.sampler is None:
                seeds[k] = params.seed if params.seed != DEFAULT_SEED else int(slot.rng.integers(0, 1 << 32))
        constrained = [(k, slot) for k, (slot, _) in enumerate(ready)
                       if slot.task is not None and slot.task.params.grammar is not None]

        def run() -> list[tuple[int, TokenProb | None]]:
            # constrained slots: their masks, all at once; the unmasked rows still give
            # the log-probabilities (of the raw distribution, as for every slot)
            masked: dict[int, np.ndarray] = {}
            if constrained:
                assert self.grammars is not None
                for _, slot in constrained:
                    if slot.constraint is None:
                        assert slot.task is not None and slot.task.params.grammar is not None
                        slot.constraint = self.grammars.constraint(slot.task.params.grammar)
                rows = apply_masks([s.constraint for _, s in constrained if s.constraint is not None],
                                   [jobs[k][0] for k, _ in constrained])
                masked = {k: r for (k, _), r in zip(constrained, rows, strict=True)}
            out: list[tuple[int, TokenProb | None]] = []
            for k, (row, params, u, recent) in enumerate(jobs):
                slot = ready[k][0]
                assert slot.task is not None
                if k in seeds:  # DRY's breakers may scan the vocabulary: here, off the loop
                    slot.sampler = make_state(params, seeds[k], self._piece_source, tokenize=self._tokenize)
                post = slot.task.params.post_sampling_probs and params.n_probs > 0
                forced = slot.budget.forced() if slot.budget is not None else None
                if forced is not None:  # the thinking budget is spent: its end is written
                    token = forced
                    ids, probs = np.array([forced]), np.array([1.0])
                elif params.host_only or post:
                    ids, probs = chain(masked.get(k, row), params, recent, slot.sampler)
                    token = pick(ids, probs, u, params, slot.sampler)
                else:
                    token = sample_u(masked.get(k, row), params, u, recent)
                if slot.constraint is not None:
                    slot.constraint.consume(token)
                prob = None
                if post:  # the chain's candidates, as llama-server's post_sampling_probs
                    top = tuple((int(i), float(q)) for i, q in zip(ids[: params.n_probs], probs[: params.n_probs],
                                                                     strict=True) if q > 0)
                    mine = float(probs[ids == token][0]) if bool((ids == token).any()) else 0.0
                    prob = TokenProb(token, mine, top, post=True)
                elif params.n_probs > 0:
                    lp = float(log_softmax(row)[token])
                    prob = TokenProb(token, lp, tuple(top_logprobs(row, params.n_probs)))
                out.append((token, prob))
            return out

        if constrained or seeds or self._client.backend.config.n_vocab >= THREAD_SAMPLING_VOCAB:
            return await trio.to_thread.run_sync(run)
        return run()

    def _accept(self, slot: Slot, token: int, prob: TokenProb | None, now: float) -> None:
        """A token was sampled for ``slot``: emit it and decide whether to go on."""
        assert slot.task is not None
        params = slot.task.params
        self._n_predicted += 1
        if self._tokenizer.is_eog(token):
            slot.n_eog = 1
            if self.special and slot.text is not None:
                # --special: the end token's text is the answer's last, as llama-server's
                text = slot.scanner.feed(slot.text.feed(token))
                partial = TaskPartial(slot.task.id_task, token, text, prob, n_decoded=len(slot.generated) + 1,
                                      n_prompt=slot.n_prompt)
                if text and params.stream and not self._send(slot, partial):
                    return
            self._finish(slot, "eos", now)
            return
        slot.generated.append(token)
        if slot.budget is not None:
            slot.budget.accept(token)
        if prob is not None:
            slot.probs.append(prob)
        assert slot.text is not None
        piece = slot.text.feed(token)
        text = slot.scanner.feed(piece)
        timings = slot.timings(now) if params.timings_per_token else None
        partial = TaskPartial(slot.task.id_task, token, text, prob, timings=timings,
                              n_decoded=len(slot.generated) + slot.n_eog, n_prompt=slot.n_prompt)
        if slot.scanner.stopping_word:
            if text and params.stream and not self._send(slot, partial):
                return
            self._finish(slot, "word", now)
            return
        if params.stream and not self._send(slot, partial):
            return
        if self._fim_limits(slot, piece, now):
            self._finish(slot, "limit", now)
        elif params.n_predict >= 0 and len(slot.generated) >= params.n_predict:
            self._finish(slot, "limit", now)
        elif len(slot.seq) + 1 >= slot.n_ctx and self._context_shift(slot):
            slot.seq.append(token)  # llama-server shifts when one position is left
        elif len(slot.seq) >= slot.n_ctx:
            self._finish(slot, "limit", now)  # no position left to feed the token back
        else:
            slot.seq.append(token)

    def end_reasoning(self, cmpl_id: str) -> tuple[bool, str]:
        """/v1/chat/completions/control's ``reasoning_end``: force the end of the thought
        of the live completion ``cmpl_id`` (llama-server's answers when it cannot)."""
        slot = next((s for s in self._slots if s.task is not None and s.task.params.cmpl_id == cmpl_id), None)
        if slot is None:
            return False, "no active completion for this id"
        if slot.budget is None or not slot.budget.spec.control:
            return False, "reasoning control not enabled for this completion"
        slot.budget.force()  # as llama-server: success even when no thought is being counted
        return True, ""

    def _context_shift(self, slot: Slot) -> bool:
        """--context-shift, as llama-server's: the sequence keeps its first ``n_keep``
        prompt tokens (and a BOS), drops ``n_discard`` after them (half of the rest when
        0), and the rest moves down (KV shifting, made before the next pass), so the
        answer goes on. False where it cannot: off, a cache that cannot shift, images."""
        assert slot.task is not None
        params = slot.task.params
        if not self.ctx_shift or not slot.can_shift or params.media:
            return False
        n_keep = len(slot.task.prompt) if params.n_keep < 0 else params.n_keep
        if self.add_bos:
            n_keep += 1
        n_keep = min(slot.n_ctx - 4, n_keep)
        n_left = slot.n_past - n_keep
        n_discard = params.n_discard or n_left // 2
        n_discard = max(0, min(n_discard, n_left - 1))
        if n_discard <= 0:
            return False
        log.warning("slot %d: context shift, n_keep = %d, n_left = %d, n_discard = %d", slot.id, n_keep, n_left,
                    n_discard)
        moved = slot.n_past - (n_keep + n_discard)
        slot.shifts = (*slot.shifts, Move(n_keep + n_discard, n_keep, moved))
        slot.n_prefix = n_keep  # what stays valid should the moves never be made
        slot.seq = slot.seq[:n_keep] + slot.seq[n_keep + n_discard:]
        slot.n_past -= n_discard
        slot.truncated = True
        return True

    def _fim_limits(self, slot: Slot, piece: str, now: float) -> bool:
        """llama-server's limits for code completion, after a token's text ``piece``:
        ``n_indent`` (a line begun with less indentation ends the answer, its text cut
        off) and ``t_max_predict_ms`` (past that much generation time, a newline ends
        it). True: the answer ends here (stop type "limit")."""
        assert slot.task is not None
        params = slot.task.params
        stop = False
        if slot.has_new_line and params.n_indent > 0:
            text = slot.scanner.text
            if slot.last_nl_pos > 0:
                pos = slot.last_nl_pos
                while pos < len(text) and text[pos] in " \t":
                    pos += 1
                if pos < len(text) and pos - slot.last_nl_pos < params.n_indent:
                    slot.scanner.text = text[:pos]
                    stop = True
            nl = slot.scanner.text.find("\n", slot.last_nl_pos)
            if nl >= 0:
                slot.last_nl_pos = nl + 1
        if "\n" in piece:
            slot.has_new_line = True
            if 0 < params.t_max_predict_ms < 1e3 * (now - slot.t_prompt_done):
                stop = True
        return stop

    def _report_progress(self, slot: Slot, now: float) -> bool:
        """Send a prompt progress report if the task asked for them (streaming with
        ``return_progress``); False if the client went away (the slot is freed)."""
        assert slot.task is not None
        if slot.generated or not (slot.task.params.stream and slot.task.params.return_progress):
            return True
        return self._send(slot, slot.progress(now))

    def _finish(self, slot: Slot, stop_type: StopType, now: float) -> None:
        final = slot.finish(stop_type, now)
        if self._send(slot, final):
            self._release(slot, cancelled=False)

    def _fail_all(self, message: str) -> None:
        for s in self._active():
            assert s.task is not None
            s.n_past = 0  # the cache's state is unknown after a failure
            s.forget()
            if self._send(s, TaskError(s.task.id_task, message)):
                self._release(s, cancelled=False)
        for s in self._slots:
            s.n_past = 0
            s.seq = []
            s.forget()

"""The messages between the HTTP edge, the queue and the slots loop.

A ``ServerTask`` is one completion request after parsing: token ids and validated
parameters, plus the send side of the channel its answers go back on. The HTTP
handler that posted it owns the receive side; closing it (the client went away) is
how the slots loop learns, on its next send, that nobody is listening any more. The
queue's ``cancel`` is the faster path and frees the slot even between sends.

Every message is frozen: once posted, nothing about a task changes except where it
is, and that belongs to the queue and the slots loop.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import attrs
import numpy as np
import trio

from trio_llm.engine.reasoning_budget import BudgetSpec
from trio_llm.engine.sampling import SamplingParams

StopType = Literal["none", "eos", "limit", "word"]


@attrs.frozen
class TaskParams:
    """What a request asks of generation, after validation at the HTTP edge."""

    n_predict: int = -1  # -1: until an end-of-generation token or the context is full
    sampling: SamplingParams = SamplingParams()
    stop: tuple[str, ...] = ()
    cache_prompt: bool = True  # reuse the slot's KV cache for the common prefix
    id_slot: int = -1  # -1: any slot (best prefix match); else wait for this one
    stream: bool = False  # send a TaskPartial per token, not only the final result
    grammar: str | None = None  # an llguidance grammar (compiled at the edge) the answer must match
    #: streaming: a ``prompt_progress`` event before the prompt's first pass and after
    #: each of its passes (llama-server's ``return_progress``)
    return_progress: bool = False
    timings_per_token: bool = False  # streaming: ``timings`` in every event, not only the last
    n_cache_reuse: int = 0  # --cache-reuse: least chunk moved by KV shifting (engine/kvshift.py); 0: off
    #: n_probs reports the candidates' probabilities after the sampler chain ("prob",
    #: "top_probs"), not the raw distribution's log-probabilities (llama-server's field)
    post_sampling_probs: bool = False
    #: a thinking budget (llama-server's reasoning_budget_*): ``engine/reasoning_budget.py``
    reasoning: BudgetSpec | None = None
    #: FIM clients' limits (llama-server's): a line indented less than this ends the
    #: answer, cut before its text; past this many ms of generation a newline ends it
    n_indent: int = 0
    t_max_predict_ms: int = -1
    #: /completion: only these fields of the final answer ("a/b": a nested one, keyed so)
    response_fields: tuple[str, ...] = ()
    #: /completion without streaming: the generated token ids in the answer's "tokens"
    #: (llama-server's ``return_tokens``; otherwise that list is empty). A streamed
    #: chunk always carries its token, whatever this says, as llama-server's does.
    return_tokens: bool = False
    #: --context-shift: the prompt tokens kept at the front (-1: all of them; a BOS is
    #: kept besides), and how many after them go (0: half of the rest)
    n_keep: int = 0
    n_discard: int = 0
    cmpl_id: str = ""  # the chat completion's id ("chatcmpl-..."), for /v1/chat/completions/control
    #: the prompt's images: media id (the negative number at each of an image's
    #: positions) -> its embedding rows [n, n_embd] (``server/media.py``)
    media: Mapping[int, np.ndarray] = attrs.field(factory=dict, eq=False, repr=False)

    def to_json(self) -> dict[str, object]:
        """llama-server's ``generation_settings`` / ``/slots`` ``params`` view."""
        s = self.sampling
        return {
            "n_predict": self.n_predict,
            "temperature": s.temperature,
            "top_k": s.top_k,
            "top_p": s.top_p,
            "min_p": s.min_p,
            "typical_p": s.typical_p,
            "repeat_penalty": s.repeat_penalty,
            "repeat_last_n": s.repeat_last_n,
            "presence_penalty": s.presence_penalty,
            "frequency_penalty": s.frequency_penalty,
            "seed": s.seed,
            "n_probs": s.n_probs,
            # llama-server's shape; -inf (a banned token, ignore_eos) is null in JSON
            "logit_bias": [{"bias": b if math.isfinite(b) else None, "token": t} for t, b in s.logit_bias],
            "stop": list(self.stop),
            "stream": self.stream,
            "cache_prompt": self.cache_prompt,
            "id_slot": self.id_slot,
            "timings_per_token": self.timings_per_token,
            "n_cache_reuse": self.n_cache_reuse,
            "post_sampling_probs": self.post_sampling_probs,
            "top_n_sigma": s.top_n_sigma,
            "xtc_probability": s.xtc_probability,
            "xtc_threshold": s.xtc_threshold,
            "dynatemp_range": s.dynatemp_range,
            "dynatemp_exponent": s.dynatemp_exponent,
            "dry_multiplier": s.dry_multiplier,
            "dry_base": s.dry_base,
            "dry_allowed_length": s.dry_allowed_length,
            "dry_penalty_last_n": s.dry_penalty_last_n,
            "dry_sequence_breakers": list(s.dry_sequence_breakers),
            "mirostat": s.mirostat,
            "mirostat_tau": s.mirostat_tau,
            "mirostat_eta": s.mirostat_eta,
            "min_keep": s.min_keep,
            "adaptive_target": s.adaptive_target,
            "adaptive_decay": s.adaptive_decay,
            "samplers": list(s.samplers),
            "reasoning_budget_tokens": self.reasoning.budget if self.reasoning is not None else -1,
            "n_indent": self.n_indent,
            "t_max_predict_ms": self.t_max_predict_ms,
        }


@attrs.frozen
class SlotAction:
    """llama-server's ``POST /slots/{id}?action=...``: save the slot's KV cache to
    ``path``, restore it from there, or erase it. Runs as a task pinned to the slot,
    so it waits for the slot like any request and never meets a generation in it.

    The file itself is read and written by the HTTP handler, on a worker thread, not
    by the slots loop: a slot file can be gigabytes, and a read or write there would
    stall every other slot's generation for as long (a planted FIFO: forever). So a
    restore arrives with the file's ``tokens`` and ``kv`` already read and checked,
    and a save's answer (``TaskActionDone``) carries them back to be written."""

    kind: Literal["save", "restore", "erase"]
    path: Path | None = None
    filename: str = ""
    tokens: tuple[int, ...] = ()  # restore: what the file holds
    kv: np.ndarray | None = attrs.field(default=None, eq=False, repr=False)  # restore: [n_layer, kv_parts, n, kv_dim]
    #: restore: the recurrent state after ``tokens`` (gated delta-net models; else empty)
    state: np.ndarray | None = attrs.field(default=None, eq=False, repr=False)


@attrs.frozen
class ServerTask:
    id_task: int
    prompt: tuple[int, ...]
    params: TaskParams
    results: trio.MemorySendChannel[TaskResult] = attrs.field(eq=False, repr=False)
    action: SlotAction | None = None  # a slot action instead of a generation


@attrs.frozen
class TokenProb:
    """One generated token's log-probability and the most likely alternatives."""

    id: int
    logprob: float  # with ``post``: the probability after the sampler chain
    top: tuple[tuple[int, float], ...]  # (token id, logprob or, with ``post``, probability), most likely first
    post: bool = False  # post_sampling_probs: probabilities of the chain's candidates


@attrs.frozen
class Timings:
    """llama-server's ``timings`` object: where the time of one request went."""

    prompt_n: int  # prompt tokens evaluated (not counting the cached prefix)
    prompt_ms: float
    cache_n: int  # prompt tokens reused from the slot's cache
    predicted_n: int
    predicted_ms: float

    def to_json(self) -> dict[str, float | int]:
        def per_second(n: int, ms: float) -> float:
            return 1e3 * n / ms if ms > 0 else 0.0

        # as llama-server (October 2026): the generation rate is over the decode steps,
        # n - 1, since the first token comes from the prompt pass's logits
        steps = max(self.predicted_n - 1, 0)
        return {
            "cache_n": self.cache_n,
            "prompt_n": self.prompt_n,
            "prompt_ms": self.prompt_ms,
            "prompt_per_token_ms": self.prompt_ms / self.prompt_n if self.prompt_n else 0.0,
            "prompt_per_second": per_second(self.prompt_n, self.prompt_ms),
            "predicted_n": self.predicted_n,
            "predicted_ms": self.predicted_ms,
            "predicted_per_token_ms": self.predicted_ms / steps if steps else 0.0,
            "predicted_per_second": per_second(steps, self.predicted_ms),
        }


@attrs.frozen
class PromptProgress:
    """llama-server's ``prompt_progress``: how far the prompt's evaluation has come.
    ``processed`` counts the positions in the KV cache, the reused ones included, so
    the first report (before any pass) has ``processed == cache``."""

    total: int  # prompt tokens
    cache: int  # reused from the slot's cache
    processed: int
    time_ms: int  # since the slot took the task

    def to_json(self) -> dict[str, int]:
        return {"total": self.total, "cache": self.cache, "processed": self.processed, "time_ms": self.time_ms}


@attrs.frozen
class TaskPartial:
    """One generated token while streaming; ``text`` may be empty while held back
    (a possible start of a stop string, or an incomplete UTF-8 character).

    A progress report (``return_progress``) is a partial without a token (``token``
    -1, ``text`` empty) carrying ``progress``. ``timings`` is set on every partial of
    a ``timings_per_token`` task: the figures so far."""

    id_task: int
    token: int
    text: str
    prob: TokenProb | None
    progress: PromptProgress | None = None
    timings: Timings | None = None
    #: the tokens generated so far (this one and an end-of-generation token counted)
    #: and the prompt's: llama-server's ``tokens_predicted`` / ``tokens_evaluated`` of
    #: a streamed /completion chunk
    n_decoded: int = 0
    n_prompt: int = 0


@attrs.frozen
class TaskFinal:
    id_task: int
    id_slot: int
    content: str  # the whole generated text, cut before a stop word
    tokens: tuple[int, ...]  # generated token ids (an end-of-generation token excluded)
    stop_type: StopType
    stopping_word: str
    n_prompt: int
    timings: Timings
    probs: tuple[TokenProb, ...]  # one per generated token when n_probs > 0
    text_tail: str  # text not yet sent as partials (for streaming clients)
    n_cached_end: int  # tokens the slot's cache holds afterwards (llama-server's tokens_cached)
    truncated: bool = False  # a context shift dropped part of the sequence (--context-shift)


@attrs.frozen
class TaskError:
    """The task failed in the engine (a backend error); the server goes on."""

    id_task: int
    message: str
    code: int = 500
    type: str = "server_error"


@attrs.frozen
class TaskActionDone:
    """A slot action finished; ``body`` is llama-server's answer for it (a save's is
    completed by the handler once it has written ``tokens`` and ``kv`` to the file)."""

    id_task: int
    body: dict[str, Any]
    tokens: tuple[int, ...] = ()  # save: the slot's cached tokens
    kv: np.ndarray | None = attrs.field(default=None, eq=False, repr=False)  # save: their KV cache
    state: np.ndarray | None = attrs.field(default=None, eq=False, repr=False)  # save: the recurrent state


TaskResult = TaskPartial | TaskFinal | TaskError | TaskActionDone

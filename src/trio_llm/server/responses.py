"""Response bodies: llama-server's native shape and OpenAI's, built from task results.

Pure functions of the results and a ``piece`` function (token id → bytes), so the
shapes can be checked without a server. Field names and meanings follow
llama-server's ``/completion`` and OpenAI's chat and legacy completion objects.
"""

from __future__ import annotations

import datetime
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from trio_llm.model.chat_output import ChatAnswer
from trio_llm.server.tasks import StopType, TaskFinal, TaskPartial, TokenProb

Piece = Callable[[int], bytes]

FINISH_REASON: dict[StopType, str | None] = {
    "eos": "stop",
    "word": "stop",
    "limit": "length",
    "none": None,
}


def unix_now() -> int:
    """OpenAI's ``created``: a calendar date in a response body, not a duration, so the
    wall clock is right here (durations all come from trio's clock)."""
    return int(datetime.datetime.now(datetime.UTC).timestamp())


def error_body(message: str, code: int, type_: str) -> dict[str, Any]:
    return {"error": {"code": code, "message": message, "type": type_}}


def _log(p: float) -> float | None:
    """A probability's log; None (JSON null) for 0, as -inf has no JSON form."""
    return math.log(p) if p > 0 else None


def _text(piece: Piece, token: int) -> str:
    return piece(token).decode("utf-8", errors="replace")


# -- llama-server native ---------------------------------------------------------


def native_probs(probs: Sequence[TokenProb], piece: Piece) -> list[dict[str, Any]]:
    """llama-server's ``completion_probabilities``: log-probabilities of the raw
    distribution, or with ``post_sampling_probs`` the chain's probabilities ("prob",
    "top_probs")."""

    def one(tok: int, v: float, post: bool) -> dict[str, Any]:
        return {"id": tok, "token": _text(piece, tok), "prob" if post else "logprob": v, "bytes": list(piece(tok))}

    return [one(p.id, p.logprob, p.post) | {"top_probs" if p.post else "top_logprobs": [one(t, v, p.post)
                                                                                         for t, v in p.top]}
            for p in probs]


def partial_extras(msg: TaskPartial) -> dict[str, Any]:
    """A streamed event's ``timings`` (``timings_per_token``) and ``prompt_progress``
    (``return_progress``), in any API's shape, as llama-server adds them."""
    out: dict[str, Any] = {}
    if msg.timings is not None:
        out["timings"] = msg.timings.to_json()
    if msg.progress is not None:
        out["prompt_progress"] = msg.progress.to_json()
    return out


def pick_fields(answer: Mapping[str, Any], paths: Sequence[str]) -> dict[str, Any]:
    """llama-server's ``response_fields``: only these fields of an answer, a path "a/b"
    naming a nested one (kept under the key "a/b"); a missing one is left out."""
    out: dict[str, Any] = {}
    for path in paths:
        cur: Any = answer
        for key in path.split("/"):
            if not isinstance(cur, Mapping) or key not in cur:
                break
            cur = cur[key]
        else:
            out[path] = cur
    return out


def native_partial(msg: TaskPartial, piece: Piece, *, n_probs: int, index: int = 0) -> dict[str, Any]:
    out: dict[str, Any] = {
        "index": index,
        "content": msg.text,
        "tokens": [msg.token] if msg.progress is None else [],  # a progress report has no token
        "stop": False,
        "id_slot": -1,
        "tokens_predicted": msg.n_decoded,
        "tokens_evaluated": msg.n_prompt,
    }
    if n_probs and msg.prob is not None:
        out["completion_probabilities"] = native_probs([msg.prob], piece)
    return out | partial_extras(msg)


def native_final(
    final: TaskFinal, piece: Piece, *, model: str, settings: dict[str, Any], stream: bool, n_probs: int,
    return_tokens: bool, index: int = 0,
) -> dict[str, Any]:
    """The final answer of /completion (and /infill) in llama-server's native shape.
    Its "tokens" are the generated ids only with ``return_tokens`` and no streaming:
    llama-server keeps them only when asked (``process_token``), and a stream's chunks
    carried them already; else the list is empty, the key still there."""
    out: dict[str, Any] = {
        "index": index,
        "content": final.text_tail if stream else final.content,
        "tokens": list(final.tokens) if return_tokens and not stream else [],
        "id_slot": final.id_slot,
        "stop": True,
        "model": model,
        "tokens_predicted": final.timings.predicted_n,  # an end-of-generation token counts, as llama-server's
        "tokens_evaluated": final.n_prompt,
        "generation_settings": settings,
        "has_new_line": "\n" in final.content,
        "truncated": final.truncated,
        "stop_type": final.stop_type,
        "stopping_word": final.stopping_word,
        "tokens_cached": final.n_cached_end,
        "timings": final.timings.to_json(),
    }
    if n_probs and not stream:
        out["completion_probabilities"] = native_probs(final.probs, piece)
    return out


# -- OpenAI -------------------------------------------------------------------------


def usage(finals: Sequence[TaskFinal], n: int = 1) -> dict[str, Any]:
    """OpenAI's usage of one request whose choices come ``n`` per prompt: each prompt
    once, every choice's tokens."""
    firsts = finals[::n]
    n_in = sum(f.n_prompt for f in firsts)
    n_out = sum(f.timings.predicted_n for f in finals)  # an end-of-generation token counts, as llama-server's
    return {
        "prompt_tokens": n_in,
        "completion_tokens": n_out,
        "total_tokens": n_in + n_out,
        "prompt_tokens_details": {"cached_tokens": sum(f.timings.cache_n for f in firsts)},
    }


def chat_logprobs(probs: Sequence[TokenProb], piece: Piece, top: int) -> dict[str, Any]:
    """OpenAI's ``logprobs.content``; with ``post_sampling_probs``, llama-server's
    "prob" / "top_probs" of the chain's candidates instead."""

    def one(tok: int, v: float, post: bool) -> dict[str, Any]:
        return {"token": _text(piece, tok), "prob" if post else "logprob": v, "bytes": list(piece(tok))}

    return {
        "content": [
            one(p.id, p.logprob, p.post) | {"top_probs" if p.post else "top_logprobs": [one(t, v, p.post)
                                                                                        for t, v in p.top[:top]]}
            for p in probs
        ]
    }


def completion_logprobs(probs: Sequence[TokenProb], piece: Piece, top: int, offset: int = 0) -> dict[str, Any]:
    tokens = [_text(piece, p.id) for p in probs]
    offsets = []
    for t in tokens:
        offsets.append(offset)
        offset += len(t)
    return {
        "tokens": tokens,
        # OpenAI's legacy shape has log-probabilities only: post_sampling_probs' are logged
        "token_logprobs": [_log(p.logprob) if p.post else p.logprob for p in probs],
        "top_logprobs": [{_text(piece, t): _log(v) if p.post else v for t, v in p.top[:top]} for p in probs],
        "text_offset": offsets,
    }


def chat_response(
    finals: Sequence[TaskFinal], piece: Piece, *, id_: str, model: str, logprobs: bool, top: int,
    answers: Sequence[ChatAnswer] | None = None,
) -> dict[str, Any]:
    """``answers``: each final's text read as content, reasoning and tool calls."""
    read = answers if answers is not None else [ChatAnswer(f.content) for f in finals]
    choices = [
        {
            "index": i,
            "message": read[i].message(),
            "finish_reason": "tool_calls" if read[i].tool_calls else FINISH_REASON[final.stop_type],
            "logprobs": chat_logprobs(final.probs, piece, top) if logprobs else None,
        }
        for i, final in enumerate(finals)
    ]
    return _final_body("chat.completion", finals, choices, id_=id_, model=model, n=len(finals))  # one prompt


def _final_body(
    object_: str, finals: Sequence[TaskFinal], choices: list[dict[str, Any]], *, id_: str, model: str,
    n: int = 1,
) -> dict[str, Any]:
    """The envelope both OpenAI endpoints put around their non-streamed choices (``n``
    per prompt); with several choices the timings are the first's, and the usage
    counts each prompt once."""
    return {
        "id": id_,
        "object": object_,
        "created": unix_now(),
        "model": model,
        "system_fingerprint": "trio-llm",
        "choices": choices,
        "usage": usage(finals, n),
        "timings": finals[0].timings.to_json(),
    }


def chat_chunk(
    *, id_: str, model: str, created: int, delta: dict[str, Any],
    finish_reason: str | None = None, logprobs: dict[str, Any] | None = None, index: int = 0,
) -> dict[str, Any]:
    choice: dict[str, Any] = {"index": index, "delta": delta, "finish_reason": finish_reason}
    if logprobs is not None:
        choice["logprobs"] = logprobs
    return {
        "id": id_,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "system_fingerprint": "trio-llm",
        "choices": [choice],
    }


def completion_response(
    finals: Sequence[TaskFinal], piece: Piece, *, id_: str, model: str, logprobs: bool, top: int, n: int = 1,
) -> dict[str, Any]:
    choices = [
        {
            "index": i,
            "text": final.content,
            "finish_reason": FINISH_REASON[final.stop_type],
            "logprobs": completion_logprobs(final.probs, piece, top) if logprobs else None,
        }
        for i, final in enumerate(finals)
    ]
    return _final_body("text_completion", finals, choices, id_=id_, model=model, n=n)


def completion_chunk(
    *, id_: str, model: str, created: int, text: str, finish_reason: str | None = None,
    logprobs: dict[str, Any] | None = None, index: int = 0,
) -> dict[str, Any]:
    return {
        "id": id_,
        "object": "text_completion",
        "created": created,
        "model": model,
        "system_fingerprint": "trio-llm",
        "choices": [{"index": index, "text": text, "finish_reason": finish_reason, "logprobs": logprobs}],
    }

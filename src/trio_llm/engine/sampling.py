"""Token sampling: small pure functions of (logits, parameters, an explicit RNG).

The chain follows llama.cpp's default sampler order (``common_sampler``): logit bias,
repetition penalties, top-k, typical-p, top-p, min-p, temperature, then a draw from
the softmax. Top-p and min-p therefore see the *untempered* distribution, exactly as in
llama-server, so the same settings keep the same candidates in both programs.

Every random draw comes from the ``np.random.Generator`` the caller passes in: a
slot seeded with ``seed`` replays the same tokens for the same logits, and tests can
pin the outcome without touching global state.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import attrs
import numpy as np

from trio_llm.errors import InvalidRequest

#: llama.cpp's LLAMA_DEFAULT_SEED: "pick a random seed", like -1
DEFAULT_SEED = 0xFFFFFFFF


def _finite(name: str) -> Any:
    def check(_inst: object, _attr: attrs.Attribute[Any], value: float) -> None:
        if not np.isfinite(value):
            raise InvalidRequest(f"{name} must be a finite number, got {value!r}")

    return check


def _in_range(name: str, lo: float, hi: float) -> Any:
    def check(_inst: object, _attr: attrs.Attribute[Any], value: float) -> None:
        if not (lo <= value <= hi):
            raise InvalidRequest(f"{name} must be between {lo} and {hi}, got {value!r}")

    return check


def _at_least(name: str, lo: int) -> Any:
    def check(_inst: object, _attr: attrs.Attribute[Any], value: int) -> None:
        if value < lo:
            raise InvalidRequest(f"{name} must be >= {lo}, got {value!r}")

    return check


@attrs.frozen
class SamplingParams:
    """One request's sampling settings; defaults are llama-server's.

    Construction validates (``InvalidRequest`` on a bad value), so a params object
    that exists is always usable by ``sample``.
    """

    temperature: float = attrs.field(default=0.8, validator=_finite("temperature"))
    top_k: int = 40  # <= 0: keep every token
    top_p: float = attrs.field(default=0.95, validator=_in_range("top_p", 0.0, 1.0))
    min_p: float = attrs.field(default=0.05, validator=_in_range("min_p", 0.0, 1.0))
    typical_p: float = attrs.field(default=1.0, validator=_in_range("typical_p", 0.0, 1.0))  # 1: off
    repeat_penalty: float = attrs.field(default=1.0, validator=_in_range("repeat_penalty", 0.0, 1e9))
    repeat_last_n: int = attrs.field(default=64, validator=_at_least("repeat_last_n", -1))
    presence_penalty: float = attrs.field(default=0.0, validator=_finite("presence_penalty"))
    frequency_penalty: float = attrs.field(default=0.0, validator=_finite("frequency_penalty"))
    seed: int = DEFAULT_SEED  # DEFAULT_SEED or negative: a fresh random seed
    n_probs: int = attrs.field(default=0, validator=_at_least("n_probs", 0))
    # (token id, bias) pairs added to the logits first; -inf bans a token
    logit_bias: tuple[tuple[int, float], ...] = ()

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


def make_rng(seed: int) -> np.random.Generator:
    """The generator for one request: deterministic for a fixed seed, fresh otherwise."""
    if seed < 0 or seed == DEFAULT_SEED:
        return np.random.default_rng()
    return np.random.default_rng(seed)


def apply_logit_bias(logits: np.ndarray, bias: Iterable[tuple[int, float]]) -> None:
    """Add each bias to its token's logit, in place; ids outside the vocab are refused."""
    n_vocab = logits.shape[0]
    for tok, b in bias:
        if not 0 <= tok < n_vocab:
            raise InvalidRequest(f"logit_bias names token {tok}, outside the vocabulary of {n_vocab}")
        logits[tok] += b


def apply_penalties(
    logits: np.ndarray,
    recent_tokens: Sequence[int] | np.ndarray,
    *,
    repeat_penalty: float,
    repeat_last_n: int,
    presence_penalty: float = 0.0,
    frequency_penalty: float = 0.0,
) -> None:
    """llama.cpp's penalties sampler, in place on ``logits`` [n_vocab].

    For each token seen in the last ``repeat_last_n`` tokens (-1: all of them): a
    positive logit is divided by ``repeat_penalty`` and a negative one multiplied (so
    the penalty always lowers the token), then ``count * frequency + presence`` is
    subtracted.
    """
    if repeat_last_n == 0 or (
        repeat_penalty == 1.0 and presence_penalty == 0.0 and frequency_penalty == 0.0
    ):
        return
    if repeat_last_n > 0:
        recent_tokens = recent_tokens[-repeat_last_n:]  # before converting a long history
    recent = np.asarray(recent_tokens, dtype=np.int64)  # [n_recent]
    recent = recent[(recent >= 0) & (recent < logits.shape[0])]
    if recent.size == 0:
        return
    ids, counts = np.unique(recent, return_counts=True)  # [n_distinct], [n_distinct]
    vals = logits[ids]  # [n_distinct]
    vals = np.where(vals <= 0, vals * repeat_penalty, vals / repeat_penalty)
    vals = vals - counts * frequency_penalty - presence_penalty
    logits[ids] = vals


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(np.asarray(x, dtype=np.float64) - np.max(x))  # [n]
    return e / e.sum()  # type: ignore[no-any-return]


def _sorted(ids: np.ndarray, vals: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Sort candidates by descending logit, ties by lower id."""
    order = np.lexsort((ids, -vals))  # [n]
    return ids[order], vals[order]


def _typical(ids: np.ndarray, vals: np.ndarray, p: float) -> tuple[np.ndarray, np.ndarray]:
    """llama.cpp's locally typical sampler: order the candidates by how far their
    surprise (-log prob) is from the distribution's entropy, keep the shortest such
    prefix whose probability exceeds ``p``."""
    v = vals.astype(np.float64)
    logp = v - (float(np.max(v)) + float(np.log(np.exp(v - np.max(v)).sum())))  # [k]
    probs = np.exp(logp)  # [k]
    entropy = float(-(probs * logp).sum())
    order = np.argsort(np.abs(-logp - entropy), kind="stable")  # [k]
    cum = np.cumsum(probs[order])  # [k]
    last = min(int(np.searchsorted(cum, p, side="right")) + 1, order.shape[0])  # first cum > p, kept
    keep = order[:last]
    return ids[keep], vals[keep]


#: top-p first looks for its cut among this many of the best candidates, widening
#: fourfold until their mass reaches p: a full sort of a 150k vocabulary costs ~50 ms
TOP_P_PROBE = 256


def candidates(logits: np.ndarray, params: SamplingParams,
               recent_tokens: Sequence[int] | np.ndarray = ()) -> tuple[np.ndarray, np.ndarray]:
    """The candidate set a draw is made from: ``(ids, probs)``, sorted by probability
    (ties by lower id).

    Runs the whole chain except the draw; ``sample`` draws from it. Greedy params give
    the single arg-max token with probability 1.

    Top-p and min-p each keep a prefix of the candidates sorted by logit, so their
    combination is the shorter prefix, whichever runs first; that lets min-p filter
    before anything is sorted, and top-p sort only as many candidates as its cut can
    reach. Top-p's probabilities are still normalised over every top-k candidate, as
    in llama.cpp.
    """
    x = np.array(logits, dtype=np.float32)  # [n_vocab], a private copy
    if params.logit_bias:
        apply_logit_bias(x, params.logit_bias)
    apply_penalties(
        x,
        recent_tokens,
        repeat_penalty=params.repeat_penalty,
        repeat_last_n=params.repeat_last_n,
        presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty,
    )
    top = float(np.max(x))
    if not top > -np.inf:
        raise InvalidRequest("every token is banned (logit_bias / penalties leave no candidate)")
    if params.greedy:
        return np.array([int(np.argmax(x))]), np.array([1.0])
    n = x.shape[0]
    k = params.top_k
    if 0 < k < n:
        ids = np.argpartition(x, n - k)[n - k :]  # [k] the k largest, unordered
    else:
        ids = np.arange(n)  # [n]
    vals = x[ids]  # [k]
    if params.typical_p < 1.0:
        ids, vals = _typical(ids, vals, params.typical_p)
        top = float(np.max(vals))  # the samplers after it see only its survivors
    # min-p: probability >= min_p x the top one's, i.e. logit >= top + log(min_p)
    if params.min_p > 0.0:
        keep = vals >= top + np.log(params.min_p)  # [k]
        cand_ids, cand_vals = ids[keep], vals[keep]
    else:
        cand_ids, cand_vals = ids, vals
    if params.top_p < 1.0:
        z = float(np.exp(vals.astype(np.float64) - top).sum())
        probe = TOP_P_PROBE
        while probe < cand_vals.shape[0]:
            threshold = np.partition(cand_vals, cand_vals.shape[0] - probe)[-probe]
            sel = cand_vals >= threshold  # ties with the threshold included
            mass = float(np.exp(cand_vals[sel].astype(np.float64) - top).sum()) / z
            if mass >= params.top_p:
                cand_ids, cand_vals = cand_ids[sel], cand_vals[sel]
                break
            probe *= 4
        cand_ids, cand_vals = _sorted(cand_ids, cand_vals)
        cum = np.cumsum(np.exp(cand_vals.astype(np.float64) - top)) / z  # [n_cand]
        cut = int(np.searchsorted(cum, params.top_p, side="left")) + 1
        cand_ids, cand_vals = cand_ids[:cut], cand_vals[:cut]
    else:
        cand_ids, cand_vals = _sorted(cand_ids, cand_vals)
    return cand_ids, _softmax(cand_vals.astype(np.float64) / params.temperature)


def sample(
    logits: np.ndarray,
    params: SamplingParams,
    rng: np.random.Generator,
    recent_tokens: Sequence[int] | np.ndarray = (),
) -> int:
    """One token id from ``logits`` [n_vocab].

    ``recent_tokens`` are the tokens already in the sequence (prompt and generated,
    oldest first) that the repetition penalties look at. Greedy (temperature <= 0)
    draws nothing from ``rng``; otherwise exactly one uniform number is drawn, even
    when one candidate is left: how many numbers a step takes then never depends on
    the logits, so the caller can draw them before the step runs (``draw_u``) and the
    device chain (``engine/devsample.py``) consumes the same numbers as this one.
    """
    return sample_u(logits, params, draw_u(params, rng), recent_tokens)


def draw_u(params: SamplingParams, rng: np.random.Generator) -> float:
    """The uniform number one step of ``params`` consumes (0.0 for greedy, no draw)."""
    return 0.0 if params.greedy else float(rng.random())


def sample_u(logits: np.ndarray, params: SamplingParams, u: float,
             recent_tokens: Sequence[int] | np.ndarray = ()) -> int:
    """``sample`` with its uniform number ``u`` in [0, 1) given."""
    ids, probs = candidates(logits, params, recent_tokens)
    if ids.shape[0] == 1:
        return int(ids[0])
    cum = np.cumsum(probs)  # [n_cand]
    idx = int(np.searchsorted(cum, u * cum[-1], side="right"))
    return int(ids[min(idx, ids.shape[0] - 1)])


def _logsumexp(x: np.ndarray) -> float:
    m = float(np.max(x))
    return m + float(np.log(np.exp(x - m).sum(dtype=np.float64)))


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """Log-probabilities of the raw distribution, float64 [n_vocab]."""
    x = np.asarray(logits)  # [n_vocab]
    return x.astype(np.float64) - _logsumexp(x)  # type: ignore[no-any-return]


def top_logprobs(logits: np.ndarray, n: int) -> list[tuple[int, float]]:
    """The ``n`` most likely tokens of the raw distribution with their log-probabilities,
    most likely first (ties by lower id): what ``n_probs`` / ``logprobs`` report."""
    if n <= 0:
        return []
    x = np.asarray(logits, dtype=np.float32)  # [n_vocab]
    n = min(n, x.shape[0])
    ids = np.argpartition(x, x.shape[0] - n)[x.shape[0] - n :]  # [n] unordered
    ids, vals = _sorted(ids, x[ids])
    lse = _logsumexp(x)
    return [(int(i), float(v) - lse) for i, v in zip(ids, vals, strict=True)]

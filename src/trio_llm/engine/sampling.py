"""Token sampling: small pure functions of (logits, parameters, an explicit RNG).

The chain is llama.cpp's (``common_sampler_init``): the logit bias first, then the
samplers of ``SamplingParams.samplers`` in their order (by default penalties, DRY,
top-n-sigma, top-k, typical-p, top-p, min-p, XTC, temperature with its dynamic range),
then the draw from the softmax, or from adaptive-p's reshaped distribution when
``adaptive_p`` is among them. Mirostat (1 or 2) replaces that list with temperature and
itself, as in llama.cpp. Top-p and min-p therefore see the *untempered* distribution, as
in llama-server, so the same settings keep the same candidates in both programs.

``chain`` gives the candidates the draw is made from (what llama-server reports as
``post_sampling_probs``) and ``pick`` draws one with the step's uniform number and
updates the request's ``SamplerState`` (Mirostat's ``mu``, adaptive-p's average).
Settings the device sampler also runs (``host_only`` false) take ``candidates``, the
fast path (an argpartition top-k, min-p before any sort, a probed top-p); anything else
takes ``_general``, a literal walk over llama.cpp's candidate array that keeps its
masked (-inf) entries, since dynamic temperature's entropy bound counts them.

Randomness: exactly one uniform number a step comes from the caller's generator
(``draw_u``), so a slot seeded with ``seed`` replays the same tokens for the same logits
and the device chain consumes the same numbers. XTC's coin comes from the state's own
generator, seeded apart from the caller's so that the two streams differ.

Where llama.cpp's result is an accident it is still followed: typical-p with a
candidate of probability 0 (a banned token, or one ~104 nats down in float32) has a NaN
entropy there, and keeps the order libstdc++'s sort leaves (``_typical_nan``); Mirostat
1's k goes through a float-to-int conversion that makes NaN or overflow 1, as on x86.
Not followed: a temperature <= 0 with no ``temperature`` in ``samplers`` draws nothing
(``draw_u``), so the chain's most likely candidate is taken where llama.cpp draws from
the untempered candidates; the ``infill`` sampler is refused (``sampler_names``).
"""

from __future__ import annotations

import functools
import math
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import attrs
import numpy as np

from trio_llm.errors import InvalidRequest

#: llama.cpp's LLAMA_DEFAULT_SEED: "pick a random seed", like -1
DEFAULT_SEED = 0xFFFFFFFF

#: llama.cpp's default sampler order (common_params_sampling::samplers), canonical names
DEFAULT_SAMPLERS = ("penalties", "dry", "top_n_sigma", "top_k", "typ_p", "top_p", "min_p", "xtc", "temperature")
#: common_sampler_type_to_chr: one character per sampler (--sampler-seq, a string ``samplers``)
SAMPLER_CHARS = {"e": "penalties", "d": "dry", "s": "top_n_sigma", "k": "top_k", "y": "typ_p", "p": "top_p",
                 "m": "min_p", "x": "xtc", "t": "temperature", "a": "adaptive_p"}


def _aliases() -> dict[str, str]:
    """common_sampler_types_from_names' table: each canonical name, its kebab-case and
    underscore-less spellings, nucleus / temp / typ, and the older llama.cpp names of
    typical-p (typical_p, typical-p, typical) that clients still send."""
    table = {name: name for name in SAMPLER_CHARS.values()}
    for name in SAMPLER_CHARS.values():
        if "_" in name:
            table[name.replace("_", "-")] = name
            table[name.replace("_", "")] = name
    table.update(nucleus="top_p", temp="temperature", typ="typ_p", typical_p="typ_p", typical="typ_p")
    table["typical-p"] = "typ_p"
    return table


_SAMPLER_ALIASES = _aliases()


def _no_infill(what: str) -> InvalidRequest:
    return InvalidRequest(f"{what}: llama.cpp's infill sampler is not supported (it needs the vocabulary's "
                          "end-of-generation tokens inside the chain)")


def sampler_names(value: str | Sequence[str]) -> tuple[str, ...]:
    """llama-server's ``samplers`` as canonical names: a list of names (any case, with
    llama.cpp's aliases: ``top-k``, ``nucleus``, ``temp``, ``typical``, ...) or a string of
    sampler characters (``"edskypmxt"``). An unknown name or character is refused with
    ``InvalidRequest`` (llama.cpp drops it with a warning)."""
    if isinstance(value, str):
        out = []
        for ch in value:
            if ch == "i":
                raise _no_infill("sampler character 'i'")
            if ch not in SAMPLER_CHARS:
                raise InvalidRequest(f"unknown sampler character {ch!r} (known: {''.join(SAMPLER_CHARS)})")
            out.append(SAMPLER_CHARS[ch])
        return tuple(out)
    names = []
    for name in value:
        if not isinstance(name, str):
            raise InvalidRequest(f"samplers must be names (strings), got {name!r}")
        if name.lower() == "infill":
            raise _no_infill("sampler 'infill'")
        canonical = _SAMPLER_ALIASES.get(name.lower())
        if canonical is None:
            raise InvalidRequest(f"unknown sampler {name!r} (known: {', '.join(SAMPLER_CHARS.values())})")
        names.append(canonical)
    return tuple(names)


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


def _one_of(name: str, values: tuple[int, ...]) -> Any:
    def check(_inst: object, _attr: attrs.Attribute[Any], value: int) -> None:
        if value not in values:
            raise InvalidRequest(f"{name} must be one of {', '.join(map(str, values))}, got {value!r}")

    return check


def _strings(value: Iterable[str]) -> tuple[str, ...]:
    if isinstance(value, str) or not all(isinstance(s, str) for s in value):
        raise InvalidRequest(f"dry_sequence_breakers must be a list of strings, got {value!r}")
    return tuple(value)


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
    # DRY: a token that would extend a repeat of more than dry_allowed_length tokens
    # loses dry_multiplier * dry_base ** (length - dry_allowed_length); 0: off
    dry_multiplier: float = attrs.field(default=0.0, validator=_finite("dry_multiplier"))
    dry_base: float = attrs.field(default=1.75, validator=_finite("dry_base"))  # below 1: off
    dry_allowed_length: int = attrs.field(default=2, validator=_at_least("dry_allowed_length", 0))
    dry_penalty_last_n: int = attrs.field(default=64, validator=_at_least("dry_penalty_last_n", -1))  # -1: all
    dry_sequence_breakers: tuple[str, ...] = attrs.field(default=("\n", ":", "\"", "*"), converter=_strings)
    # XTC: with this chance, drop every token at least xtc_threshold likely but the least of them
    xtc_probability: float = attrs.field(default=0.0, validator=_in_range("xtc_probability", 0.0, 1.0))
    xtc_threshold: float = attrs.field(default=0.1, validator=_in_range("xtc_threshold", 0.0, 1.0))  # > 0.5: off
    top_n_sigma: float = attrs.field(default=-1.0, validator=_finite("top_n_sigma"))  # <= 0: off
    dynatemp_range: float = attrs.field(default=0.0, validator=_finite("dynatemp_range"))  # <= 0: off
    dynatemp_exponent: float = attrs.field(default=1.0, validator=_finite("dynatemp_exponent"))
    mirostat: int = attrs.field(default=0, validator=_one_of("mirostat", (0, 1, 2)))  # Mirostat 1 or 2.0
    mirostat_tau: float = attrs.field(default=5.0, validator=_finite("mirostat_tau"))
    mirostat_eta: float = attrs.field(default=0.1, validator=_finite("mirostat_eta"))
    min_keep: int = attrs.field(default=0, validator=_at_least("min_keep", 0))
    adaptive_target: float = attrs.field(  # negative: off (adaptive-p draws as the plain draw)
        default=-1.0, validator=[_finite("adaptive_target"), _in_range("adaptive_target", -math.inf, 1.0)])
    adaptive_decay: float = attrs.field(default=0.9, validator=_in_range("adaptive_decay", 0.0, 0.99))
    samplers: tuple[str, ...] = attrs.field(default=DEFAULT_SAMPLERS, converter=sampler_names)

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

    @property
    def dry_active(self) -> bool:
        return self.dry_multiplier != 0.0 and self.dry_base >= 1.0 and self.dry_penalty_last_n != 0

    @property
    def adaptive_active(self) -> bool:
        return self.mirostat == 0 and self.adaptive_target >= 0.0 and "adaptive_p" in self.samplers

    @property
    def host_only(self) -> bool:
        """Whether anything beyond the device-capable chain (logit bias, penalties,
        top-k, typical-p, top-p, min-p, temperature, in the default order) is in play."""
        return (self.samplers != DEFAULT_SAMPLERS or self.mirostat != 0 or self.min_keep > 0
                or self.dry_active or (self.xtc_probability > 0.0 and self.xtc_threshold <= 0.5)
                or self.top_n_sigma > 0.0 or self.dynatemp_range > 0.0)


def make_rng(seed: int) -> np.random.Generator:
    """The generator for one request: deterministic for a fixed seed, fresh otherwise."""
    if seed < 0 or seed == DEFAULT_SEED:
        return np.random.default_rng()
    return np.random.default_rng(seed)


#: DRY's breaker table: head token -> the token sequences that must follow it (empty:
#: the token alone breaks a repeat)
Breakers = Mapping[int, tuple[tuple[int, ...], ...]]


@attrs.define(eq=False)
class SamplerState:
    """What one request's chain keeps between steps; ``make_state`` builds it.

    ``rng`` draws XTC's coin (never the draw itself: that is the caller's ``u``), ``mu``
    is Mirostat's surprise bound, ``weighted_sum`` / ``total_weight`` adaptive-p's
    decaying average of the chosen tokens' probabilities, ``breakers`` DRY's processed
    sequence breakers.
    """

    rng: np.random.Generator
    mu: float = 10.0
    weighted_sum: float = 0.0
    total_weight: float = 0.0
    breakers: Breakers = attrs.field(factory=dict)
    # adaptive-p: the candidates of the last chain and their probabilities before its
    # reshaping, for pick's update
    _pending: tuple[np.ndarray, np.ndarray] | None = None


#: llama_sampler_init_dry: a breaker is cut to 40 bytes, a breaker's tail to 20 tokens
DRY_MAX_BREAKER_BYTES = 40
DRY_MAX_TAIL_TOKENS = 20
_BREAKER_CACHE: OrderedDict[tuple[tuple[str, ...], int, int, bool], tuple[object, object, Breakers]] = OrderedDict()
_BREAKER_CACHE_SIZE = 8


def make_state(params: SamplingParams, seed: int, pieces: Callable[[], Sequence[bytes]] | None = None, *,
               tokenize: Callable[[str], Sequence[int]] | None = None) -> SamplerState:
    """A fresh state for one request of ``params`` with seed ``seed``.

    ``pieces()`` gives every token's bytes (``Tokenizer.token_to_piece`` of each id); it
    is called only when DRY is on, and the breaker table is cached per (breakers, source,
    whether ``tokenize`` is given): pass the same callable, or a bound method of the same
    object, for a model.
    ``tokenize`` (text -> ids, no specials) splits the rest of a breaker that a token
    only begins, as llama.cpp does; without it that rest is matched greedily against the
    pieces, which differs only for breakers longer than one character. Without
    ``pieces`` DRY runs with no breakers.
    """
    if seed < 0 or seed == DEFAULT_SEED:
        rng = np.random.default_rng()
    else:  # apart from make_rng(seed), the caller's generator of the draws
        rng = np.random.default_rng([seed, 0x58544331])
    decay = min(max(params.adaptive_decay, 0.0), 0.99)
    breakers: Breakers = {}
    if params.dry_active and pieces is not None:
        breakers = _cached_breakers(params.dry_sequence_breakers, pieces, tokenize)
    return SamplerState(rng, mu=2.0 * params.mirostat_tau, weighted_sum=params.adaptive_target / (1.0 - decay),
                        total_weight=1.0 / (1.0 - decay), breakers=breakers)


def _cached_breakers(breakers: tuple[str, ...], pieces: Callable[[], Sequence[bytes]],
                     tokenize: Callable[[str], Sequence[int]] | None) -> Breakers:
    owner, func = getattr(pieces, "__self__", pieces), getattr(pieces, "__func__", pieces)
    key = (breakers, id(owner), id(func), tokenize is None)
    hit = _BREAKER_CACHE.get(key)
    if hit is not None and hit[0] is owner and hit[1] is func:  # the entry holds both, so ids stay unique
        _BREAKER_CACHE.move_to_end(key)
        return hit[2]
    table = dry_breakers(breakers, pieces(), tokenize)
    _BREAKER_CACHE[key] = (owner, func, table)
    while len(_BREAKER_CACHE) > _BREAKER_CACHE_SIZE:
        _BREAKER_CACHE.popitem(last=False)
    return table


def dry_breakers(breakers: Iterable[str], pieces: Sequence[bytes],
                 tokenize: Callable[[str], Sequence[int]] | None = None) -> Breakers:
    """llama.cpp's processed DRY breakers (get_overlapping_token_sequences): a token whose
    text contains a breaker breaks alone; a token whose text *ends* with a breaker's
    beginning breaks when the tokens of the breaker's rest follow it."""
    table: dict[int, list[tuple[int, ...]]] = {}
    tails_of: dict[bytes, tuple[int, ...]] = {}  # a breaker's rest -> its tokens
    split = _splitter(pieces, tokenize)
    for text in breakers:
        brk = text.encode("utf-8")[:DRY_MAX_BREAKER_BYTES]
        if not brk:
            continue
        head = brk[:1]
        for tid, word in enumerate(pieces):
            if brk in word:
                tails = table.setdefault(tid, [])
                if () not in tails:
                    tails.append(())
                continue
            if len(brk) == 1:
                continue  # a one-byte breaker has no partial overlaps
            pos = word.find(head)
            while pos != -1:
                rest = word[pos:]
                if brk.startswith(rest):  # the word ends inside the breaker
                    more = brk[len(rest):]
                    if more not in tails_of:
                        tails_of[more] = tuple(split(more))[:DRY_MAX_TAIL_TOKENS]
                    tails = table.setdefault(tid, [])
                    if tails_of[more] not in tails:
                        tails.append(tails_of[more])
                pos = word.find(head, pos + 1)
    return {tid: tuple(tails) for tid, tails in table.items()}


def _splitter(pieces: Sequence[bytes], tokenize: Callable[[str], Sequence[int]] | None
              ) -> Callable[[bytes], list[int]]:
    """Bytes -> token ids: ``tokenize`` when given, else a greedy longest match over the
    pieces (lower id first among equal pieces)."""
    if tokenize is not None:
        return lambda text: [int(t) for t in tokenize(text.decode("utf-8", "replace"))]
    by_piece: dict[bytes, int] = {}

    def split(text: bytes) -> list[int]:
        if not by_piece:
            for tid, word in enumerate(pieces):
                if word:
                    by_piece.setdefault(word, tid)
        longest = max(map(len, by_piece), default=0)
        out, i = [], 0
        while i < len(text):
            size = next((n for n in range(min(longest, len(text) - i), 0, -1) if text[i : i + n] in by_piece), 0)
            if size == 0:
                break
            out.append(by_piece[text[i : i + size]])
            i += size
        return out

    return split


def apply_logit_bias(logits: np.ndarray, bias: Iterable[tuple[int, float]]) -> None:
    """Add each bias to its token's logit, in place; ids outside the vocab are refused."""
    n_vocab = logits.shape[0]
    for tok, b in bias:
        if not 0 <= tok < n_vocab:
            raise InvalidRequest(f"logit_bias names token {tok}, outside the vocabulary of {n_vocab}")
        logits[tok] += b


def _window(recent_tokens: Sequence[int] | np.ndarray, last_n: int, n_vocab: int) -> np.ndarray:
    """The last ``last_n`` tokens (-1: all), those inside the vocabulary, int64."""
    if last_n > 0:
        recent_tokens = recent_tokens[-last_n:]  # before converting a long history
    recent = np.asarray(recent_tokens, dtype=np.int64)  # [n_recent]
    return recent[(recent >= 0) & (recent < n_vocab)]  # type: ignore[no-any-return]


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
    recent = _window(recent_tokens, repeat_last_n, logits.shape[0])
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
    if _zero_prob32(v):
        ids, vals = _sorted(ids, vals)
        keep = _typical_nan(vals.astype(np.float64), p, 0)
        return ids[keep], vals[keep]
    logp = v - (float(np.max(v)) + float(np.log(np.exp(v - np.max(v)).sum())))  # [k]
    probs = np.exp(logp)  # [k]
    entropy = float(-(probs * logp).sum())
    order = np.argsort(np.abs(-logp - entropy), kind="stable")  # [k]
    cum = np.cumsum(probs[order])  # [k]
    last = min(int(np.searchsorted(cum, p, side="right")) + 1, order.shape[0])  # first cum > p, kept
    keep = order[:last]
    return ids[keep], vals[keep]


def _softmax32(x: np.ndarray) -> np.ndarray:
    """llama.cpp's softmax in float32: tiny probabilities underflow to 0 as they do there."""
    e = np.exp((x - x.max()).astype(np.float32))  # [n]
    return e / e.sum(dtype=np.float32)  # type: ignore[no-any-return]


def _zero_prob32(x: np.ndarray) -> bool:
    """Whether a candidate's float32 probability is 0 (a masked one, or > ~104 nats down)."""
    return bool(x.min() - x.max() < -87.0 and (_softmax32(x) == 0).any())


def _typical_nan(vals: np.ndarray, p: float, min_keep: int) -> np.ndarray:
    """Typical-p as llama.cpp runs it when a candidate has probability 0: ``0 * log 0``
    makes its entropy NaN, every distance NaN, and its std::sort of the (logit-sorted)
    candidates by distance compares nothing as smaller; the order that leaves is
    libstdc++'s, ``_equal_keys_order``. Positions into ``vals`` [n], sorted by logit."""
    order = _equal_keys_order(vals.shape[0])  # [n]
    cum = np.cumsum(_softmax32(vals)[order], dtype=np.float32)  # [n]
    ok = (cum > p) & (np.arange(cum.shape[0]) >= min_keep - 1)
    return order[: int(np.argmax(ok)) + 1 if ok.any() else cum.shape[0]]


@functools.lru_cache(maxsize=4)
def _equal_keys_order(n: int) -> np.ndarray:
    """The permutation libstdc++'s std::sort (introsort) leaves on ``n`` elements no one of
    which compares smaller than another: each partition moves the middle element first
    and reverses the rest (its unguarded partition swaps from both ends), splits at the
    meeting point and recurses; the final insertion sort moves nothing."""
    a = np.arange(n)

    def loop(first: int, last: int, depth: int) -> None:
        while last - first > 16 and depth > 0:  # depth never runs out: every split halves
            depth -= 1
            mid = first + (last - first) // 2
            a[first], a[mid] = a[mid], a[first]
            a[first + 1 : last] = a[first + 1 : last][::-1].copy()
            cut = first + 1 + (last - first - 1) // 2
            loop(cut, last, depth)
            last = cut

    if n > 1:
        loop(0, n, 2 * (n.bit_length() - 1))
    return a


#: top-p first looks for its cut among this many of the best candidates, widening
#: fourfold until their mass reaches p: a full sort of a 150k vocabulary costs ~50 ms
TOP_P_PROBE = 256


def candidates(logits: np.ndarray, params: SamplingParams,
               recent_tokens: Sequence[int] | np.ndarray = ()) -> tuple[np.ndarray, np.ndarray]:
    """The default chain's candidate set (``host_only`` false): ``(ids, probs)``, sorted
    by probability (ties by lower id); ``chain`` takes it for such settings.

    Greedy params give the single arg-max token with probability 1 (what llama.cpp's
    temperature sampler leaves at temperature <= 0: top-k, top-p and min-p all keep it;
    typical-p may not, so ``chain`` takes the general walk for greedy typical-p).

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
    if cand_vals[-1] == -np.inf:  # banned tokens that no cut removed: probability 0, left out
        n_live = int(np.searchsorted(-cand_vals, np.inf))
        cand_ids, cand_vals = cand_ids[:n_live], cand_vals[:n_live]
    return cand_ids, _softmax(cand_vals.astype(np.float64) / params.temperature)


def chain(logits: np.ndarray, params: SamplingParams, recent_tokens: Sequence[int] | np.ndarray = (),
          state: SamplerState | None = None) -> tuple[np.ndarray, np.ndarray]:
    """The candidates a draw is made from after the whole chain: ``(ids, probs)``, sorted
    by probability descending (ties by lower id); what llama-server reports as
    ``post_sampling_probs``. Tokens the chain masked (probability 0) are left out.

    ``recent_tokens`` are the tokens already in the sequence (prompt and generated,
    oldest first) that the penalties and DRY look at. ``state`` carries DRY's breakers,
    XTC's generator and Mirostat's ``mu``; without one, a fresh state is used (no DRY
    breakers, XTC's coin from ``params.seed``).
    """
    if not params.host_only and not (params.greedy and params.typical_p < 1.0):
        return candidates(logits, params, recent_tokens)
    return _general(logits, params, recent_tokens, state)


def pick(ids: np.ndarray, probs: np.ndarray, u: float, params: SamplingParams,
         state: SamplerState | None = None) -> int:
    """The draw from ``chain``'s candidates with the uniform number ``u`` in [0, 1): the
    first candidate whose cumulative probability exceeds ``u``. Updates ``state`` from
    the chosen token: Mirostat's ``mu`` by the token's surprise, adaptive-p's average by
    its probability before the reshaping (llama.cpp's accept)."""
    if ids.shape[0] == 1:
        idx = 0
    else:
        cum = np.cumsum(probs)  # [n_cand]
        idx = min(int(np.searchsorted(cum, u * cum[-1], side="right")), ids.shape[0] - 1)
    token = int(ids[idx])
    if state is not None:
        if params.mirostat != 0:
            surprise = -math.log2(float(probs[idx])) if probs[idx] > 0 else math.inf
            state.mu -= params.mirostat_eta * (surprise - params.mirostat_tau)
        elif params.adaptive_active and state._pending is not None:
            cand, orig = state._pending
            at = np.flatnonzero(cand == token)
            if at.size:
                state.weighted_sum = float(orig[at[0]]) + params.adaptive_decay * state.weighted_sum
                state.total_weight = 1.0 + params.adaptive_decay * state.total_weight
        state._pending = None
    return token


def sample(
    logits: np.ndarray,
    params: SamplingParams,
    rng: np.random.Generator,
    recent_tokens: Sequence[int] | np.ndarray = (),
    state: SamplerState | None = None,
) -> int:
    """One token id from ``logits`` [n_vocab].

    ``recent_tokens`` are the tokens already in the sequence (prompt and generated,
    oldest first) that the repetition penalties look at. Greedy (temperature <= 0)
    draws nothing from ``rng``; otherwise exactly one uniform number is drawn, even
    when one candidate is left: how many numbers a step takes then never depends on
    the logits, so the caller can draw them before the step runs (``draw_u``) and the
    device chain (``engine/devsample.py``) consumes the same numbers as this one.
    """
    return sample_u(logits, params, draw_u(params, rng), recent_tokens, state)


def draw_u(params: SamplingParams, rng: np.random.Generator) -> float:
    """The uniform number one step of ``params`` consumes (0.0 for greedy, no draw)."""
    return 0.0 if params.greedy else float(rng.random())


def sample_u(logits: np.ndarray, params: SamplingParams, u: float,
             recent_tokens: Sequence[int] | np.ndarray = (), state: SamplerState | None = None) -> int:
    """``sample`` with its uniform number ``u`` in [0, 1) given."""
    ids, probs = chain(logits, params, recent_tokens, state)
    return pick(ids, probs, u, params, state)


# --- the general chain: llama.cpp's candidate array, one sampler at a time -----------


@attrs.define(eq=False)
class _Cands:
    """llama_token_data_array: the surviving candidates in their current order;
    ``ordered``: sorted by logit, descending (ties: lower id). A masked candidate keeps
    its place with a -inf logit, as in llama.cpp."""

    ids: np.ndarray  # [n] int64
    logits: np.ndarray  # [n] float64
    ordered: bool = False

    def sort(self) -> None:
        if not self.ordered:
            order = np.lexsort((self.ids, -self.logits))  # [n]
            self.ids, self.logits, self.ordered = self.ids[order], self.logits[order], True

    def keep(self, sel: np.ndarray | slice) -> None:
        self.ids, self.logits = self.ids[sel], self.logits[sel]

    def probs(self) -> np.ndarray:
        return _softmax(self.logits)

    def positions(self, tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(indices into the candidates, indices into ``tokens``) of the tokens present."""
        order = np.argsort(self.ids, kind="stable")  # [n]
        at = np.searchsorted(self.ids[order], tokens)  # [n_tokens]
        at_c = np.minimum(at, self.ids.shape[0] - 1)
        found = self.ids[order][at_c] == tokens
        return order[at_c[found]], np.flatnonzero(found)


def _general(logits: np.ndarray, params: SamplingParams, recent_tokens: Sequence[int] | np.ndarray,
             state: SamplerState | None) -> tuple[np.ndarray, np.ndarray]:
    if state is None:
        state = make_state(params, params.seed)
    x = np.array(logits, dtype=np.float32)  # [n_vocab], a private copy
    if params.logit_bias:
        apply_logit_bias(x, params.logit_bias)
    if not float(np.max(x)) > -np.inf:
        raise InvalidRequest("every token is banned (logit_bias leaves no candidate)")
    n_vocab = x.shape[0]
    c = _Cands(np.arange(n_vocab), x.astype(np.float64))
    if params.mirostat != 0:
        _temp(c, params.temperature)
        if params.mirostat == 1:
            _mirostat(c, state.mu, n_vocab)
        else:
            _mirostat_v2(c, state.mu)
    else:
        for name in params.samplers:
            _SAMPLERS[name](c, params, recent_tokens, state)
        if params.adaptive_active:
            _adaptive(c, params, state)
    c.sort()
    finite = c.logits > -np.inf
    return c.ids[finite], _softmax(c.logits[finite])


def _penalties(c: _Cands, p: SamplingParams, recent: Sequence[int] | np.ndarray, _s: SamplerState) -> None:
    if p.repeat_last_n == 0 or (p.repeat_penalty == 1.0 and p.presence_penalty == 0.0
                                and p.frequency_penalty == 0.0):
        return
    window = _window(recent, p.repeat_last_n, np.iinfo(np.int64).max)
    if window.size == 0:
        return
    toks, counts = np.unique(window, return_counts=True)  # [n_distinct]
    at, which = c.positions(toks)
    v = c.logits[at]
    v = np.where(v <= 0, v * p.repeat_penalty, v / p.repeat_penalty)
    c.logits[at] = v - counts[which] * p.frequency_penalty - p.presence_penalty
    c.ordered = False


def _dry(c: _Cands, p: SamplingParams, recent: Sequence[int] | np.ndarray, s: SamplerState) -> None:
    """llama.cpp's DRY (from koboldcpp): for each token that would extend a sequence the
    recent window already repeats, a penalty growing with the repeat's length; the
    repeats looked at stop at the latest sequence breaker."""
    if not p.dry_active:
        return
    n_last = len(recent) if p.dry_penalty_last_n < 0 else min(len(recent), p.dry_penalty_last_n)
    if n_last <= p.dry_allowed_length:
        return
    rev = [int(t) for t in recent[len(recent) - n_last :]][::-1]  # [n_last], newest first
    # the longest repeat may not reach back past the newest breaker (head + its tail)
    rep_limit = n_last
    for i, tok in enumerate(rev):
        tails = s.breakers.get(tok)
        if tails is None:
            continue
        longest = -1
        for tail in tails:
            size = len(tail)
            if longest < size <= i and all(tail[o] == rev[i - o - 1] for o in range(size)):
                longest = size
        if longest >= 0:
            rep_limit = i - longest
            break
    if rep_limit < p.dry_allowed_length:
        return
    # z[j]: how many of the newest tokens repeat as the run ending j + 1 tokens back,
    # which rev[j] followed
    z = np.minimum(_z_function(rev)[1:], rep_limit)  # [n_last - 1]
    hit = np.flatnonzero(z >= p.dry_allowed_length)
    if hit.size == 0:
        return
    follow = np.array([rev[j] for j in hit], np.int64)  # [n_hit] the token after each repeat
    toks, inv = np.unique(follow, return_inverse=True)
    length = np.zeros(toks.shape[0], np.int64)
    np.maximum.at(length, inv, z[hit])
    alone = np.array([() in s.breakers.get(int(t), ()) for t in toks], bool)  # breaks alone: no penalty
    toks, length = toks[~alone], length[~alone]
    max_exp = int(np.float32(88.7228391) / np.float32(math.log(p.dry_base))) if p.dry_base > 1.000001 else 0
    exp = length - p.dry_allowed_length
    if max_exp > 0:
        exp = np.minimum(exp, max_exp)
    at, which = c.positions(toks)
    c.logits[at] -= p.dry_multiplier * np.power(float(p.dry_base), exp[which].astype(np.float64))
    c.ordered = False


def _z_function(s: list[int]) -> list[int]:
    """z[k]: the length of the longest common prefix of ``s`` and ``s[k:]`` (z[0] = 0)."""
    n = len(s)
    z = [0] * n
    lo = hi = 0  # the rightmost match seen: s[lo:hi] == s[:hi - lo]
    for k in range(1, n):
        m = min(hi - k, z[k - lo]) if k < hi else 0
        while k + m < n and s[m] == s[k + m]:
            m += 1
        z[k] = m
        if k + m > hi:
            lo, hi = k, k + m
    return z


def _top_n_sigma(c: _Cands, p: SamplingParams, _r: object, _s: SamplerState) -> None:
    if p.top_n_sigma <= 0.0 or c.ids.shape[0] <= 1:
        return
    vals = c.logits[c.logits > -np.inf]
    if vals.size == 0:
        return
    c.logits[c.logits < vals.max() - p.top_n_sigma * vals.std()] = -np.inf


def _top_k(c: _Cands, p: SamplingParams, _r: object, _s: SamplerState) -> None:
    _keep_top(c, p.top_k)


def _keep_top(c: _Cands, k: int) -> None:
    if k <= 0:
        return
    n = c.ids.shape[0]
    k = min(k, n)
    if not c.ordered and k < n:
        c.keep(c.logits >= np.partition(c.logits, n - k)[n - k])  # ties at the cut kept, for now
    c.sort()
    c.keep(slice(0, k))


def _typical_p(c: _Cands, p: SamplingParams, _r: object, _s: SamplerState) -> None:
    if p.typical_p >= 1.0:
        return
    c.sort()
    if _zero_prob32(c.logits):
        c.keep(_typical_nan(c.logits, p.typical_p, p.min_keep))
        c.ordered = False
        return
    probs = c.probs()
    logp = np.log(probs)  # [n]
    entropy = float(-(probs * logp).sum())
    order = np.argsort(np.abs(-logp - entropy), kind="stable")  # [n]
    cum = np.cumsum(probs[order])  # [n]
    ok = (cum > p.typical_p) & (np.arange(cum.shape[0]) >= p.min_keep - 1)
    c.keep(order[: int(np.argmax(ok)) + 1 if ok.any() else cum.shape[0]])
    c.ordered = False


def _top_p(c: _Cands, p: SamplingParams, _r: object, _s: SamplerState) -> None:
    if p.top_p >= 1.0:
        return
    z = c.logits.max()
    total = float(np.exp(c.logits - z).sum())
    n = c.ids.shape[0]
    probe = n if c.ordered else TOP_P_PROBE
    while True:  # sort the best `probe` only, while their mass reaches p
        m = min(probe, n)
        if m < n:
            sel = c.logits >= np.partition(c.logits, n - m)[n - m]
            head = _Cands(c.ids[sel], c.logits[sel])
        else:
            head = c
        head.sort()
        cum = np.cumsum(np.exp(head.logits - z)) / total  # [m]
        ok = (cum >= p.top_p) & (np.arange(1, cum.shape[0] + 1) >= p.min_keep)
        if ok.any() or m == n:
            last = int(np.argmax(ok)) + 1 if ok.any() else n
            c.ids, c.logits, c.ordered = head.ids[:last], head.logits[:last], True
            return
        probe *= 4


def _min_p(c: _Cands, p: SamplingParams, _r: object, _s: SamplerState) -> None:
    if p.min_p <= 0.0 or c.ids.shape[0] == 0:
        return
    if not c.ordered:
        sel = c.logits >= c.logits.max() + math.log(p.min_p)
        n_sel = int(sel.sum())
        if n_sel > 0 and n_sel >= p.min_keep:
            c.keep(sel)
            return
    c.sort()
    below = c.logits < c.logits[0] + math.log(p.min_p)
    below[: max(p.min_keep, 1)] = False
    c.keep(slice(0, int(np.argmax(below)) if below.any() else c.ids.shape[0]))


def _xtc(c: _Cands, p: SamplingParams, _r: object, s: SamplerState) -> None:
    """Exclude Top Choices: with chance ``xtc_probability``, every candidate at least
    ``xtc_threshold`` likely goes but the least likely of them."""
    if p.xtc_probability <= 0.0 or p.xtc_threshold > 0.5 or c.ids.shape[0] < 2:
        return
    if float(s.rng.random()) > p.xtc_probability:
        return
    c.sort()
    below = c.probs() < p.xtc_threshold
    last = (int(np.argmax(below)) if below.any() else c.ids.shape[0]) - 1  # the last of the leading run
    if last > 0 and c.ids.shape[0] - last >= p.min_keep:
        c.keep(slice(last, None))


def _temperature(c: _Cands, p: SamplingParams, _r: object, _s: SamplerState) -> None:
    """llama.cpp's temp-ext: with a dynamic range, the temperature moves within
    temperature +- range with the candidates' entropy relative to its maximum."""
    if p.dynatemp_range <= 0.0:
        _temp(c, p.temperature)
        return
    if c.ids.shape[0] <= 1:
        return
    c.sort()
    _temp(c, dynatemp(c.probs(), p.temperature, p.dynatemp_range, p.dynatemp_exponent))


def dynatemp(probs: np.ndarray, temperature: float, dyn_range: float, exponent: float) -> float:
    """The temperature dynamic temperature uses for candidates of probabilities ``probs``
    [n > 1]: masked ones (zeros) included, since they count in the entropy's maximum, log n."""
    lo, hi = max(0.0, temperature - dyn_range), temperature + dyn_range
    nz = probs[probs > 0]
    entropy = float(-(nz * np.log(nz)).sum())
    with np.errstate(divide="ignore", invalid="ignore"):
        scale = np.power(np.float64(entropy / math.log(probs.shape[0])), exponent)
    return float(lo + (hi - lo) * scale)


def _temp(c: _Cands, t: float) -> None:
    if c.ids.shape[0] == 0:
        return
    if t <= 0.0:  # only the (first) highest logit stays
        best = int(np.argmax(c.logits))
        top = c.logits[best]
        c.logits[:] = -np.inf
        c.logits[best] = top
        return
    c.logits = c.logits / t


def _mirostat(c: _Cands, mu: float, n_vocab: int, m: int = 100) -> None:
    """Mirostat 1: estimate the Zipf exponent from the best ``m`` candidates and keep the
    top k that makes the expected surprise ``mu``."""
    probs = _softmax32(c.logits)  # [n]
    n = c.ids.shape[0]
    head = np.arange(n) if n <= m else np.argpartition(-c.logits, m - 1)[:m]
    head = head[np.lexsort((c.ids[head], -c.logits[head]))]  # [min(n, m)] the best, in order
    p = probs[head].astype(np.float64)
    terms = min(m - 1, n - 1)
    i = np.arange(terms, dtype=np.float64)
    t = np.log((i + 2) / (i + 1))  # [terms]
    with np.errstate(all="ignore"):  # NaN and inf propagate as in llama.cpp's float math
        b = np.log(p[:terms] / p[1 : terms + 1])  # [terms]
        s_hat = np.float64((t * b).sum()) / np.float64((t * t).sum())
        eps = s_hat - 1.0
        k = float(np.power(eps * np.power(2.0, mu) / (1.0 - np.power(float(n_vocab), -eps)), 1.0 / s_hat))
    # float -> int as llama.cpp's on x86: NaN, inf and anything past INT_MAX become INT_MIN
    kk = int(k) if math.isfinite(k) and abs(k) < 2.0**31 else 1
    _keep_top(c, max(kk, 1))


def _mirostat_v2(c: _Cands, mu: float) -> None:
    """Mirostat 2: keep the candidates whose surprise (-log2 p) is at most ``mu`` (a prefix
    of the sorted candidates, as p falls along it), at least the best one."""
    with np.errstate(divide="ignore"):
        keep = -np.log2(_softmax32(c.logits)) <= mu  # [n]
    if keep.any():
        c.keep(keep)
    else:
        _keep_top(c, 1)


#: adaptive-p's reshaping: a peak at the adapted target, quadratic near it, linear beyond
_ADAPTIVE_WIDTH, _ADAPTIVE_PEAK, _ADAPTIVE_SHARPNESS = 0.3, 5.0, 10.0


def _adaptive(c: _Cands, p: SamplingParams, s: SamplerState) -> None:
    """Adaptive-p: favour the candidates whose probability is near a target that moves
    against the decaying average of the chosen tokens' probabilities."""
    probs = c.probs()
    s._pending = (c.ids.copy(), probs)
    target = min(max(p.adaptive_target, 0.0), 1.0)
    adapted = target if s.total_weight == 0.0 else 2.0 * target - s.weighted_sum / s.total_weight
    adapted = min(max(adapted, 0.0), 1.0)
    live = c.logits > -np.inf
    d = np.abs((probs[live] - adapted) / _ADAPTIVE_WIDTH)
    c.logits[live] = _ADAPTIVE_PEAK - _ADAPTIVE_SHARPNESS * d * d / (1.0 + d)
    c.ordered = False


_SAMPLERS: dict[str, Callable[[_Cands, SamplingParams, Sequence[int] | np.ndarray, SamplerState], None]] = {
    "penalties": _penalties, "dry": _dry, "top_n_sigma": _top_n_sigma, "top_k": _top_k,
    "typ_p": _typical_p, "top_p": _top_p, "min_p": _min_p, "xtc": _xtc, "temperature": _temperature,
    "adaptive_p": lambda c, p, r, s: None,  # runs last, in place of the draw (llama.cpp adds it at the end)
}


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

"""llama.cpp's full sampler chain (``engine/sampling.py``): each sampler on hand-made
logits with exact expectations, then against llama.cpp itself.

The reference is llama-server in-process (xllamacpp) on a sharp synthetic F32 file (F32
so that llama.cpp's CPU logits equal our numpy backend's to ~1e-4 nats: with 8-bit
activations they differ by ~1e-2, more than the gaps between this flat vocabulary's
candidates). A ``/completion`` of one token with ``post_sampling_probs`` and ``n_probs``
larger than the vocabulary reports llama.cpp's whole candidate set after its chain.
Each case is compared twice:

- *llama.cpp's logits*: its distribution with every sampler off, as logits (log p),
  through ``chain``: the same candidates and probabilities within 1e-4, so each
  sampler's rule (cuts, masks, min_keep, order, NaN cases) is llama.cpp's exactly;
- *our logits* (the numpy backend on the same prompt) through ``chain``: the same
  candidates and log-probabilities within ``OURS_TOL``.

Every request bans (logit bias) the control tokens and the tokens that are not whole
UTF-8 characters: llama-server reports no entry for a step whose token leaves the text
incomplete, and a masked token also exercises llama.cpp's handling of probability 0.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import attrs
import numpy as np
import pytest

from trio_llm.engine.sampling import (
    DEFAULT_SAMPLERS,
    SamplerState,
    SamplingParams,
    candidates,
    chain,
    draw_u,
    dry_breakers,
    dynatemp,
    make_rng,
    make_state,
    pick,
    sample,
    sample_u,
    sampler_names,
)
from trio_llm.errors import InvalidRequest

# every sampler off, temperature 1: single samplers can be switched on
FLAT = {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0}
PLAIN = SamplingParams(**FLAT)  # type: ignore[arg-type]


def softmax(x: np.ndarray | list[float]) -> np.ndarray:
    v = np.asarray(x, dtype=np.float64)
    e = np.exp(v - v.max())
    return e / e.sum()  # type: ignore[no-any-return]


def as_dict(ids: np.ndarray, probs: np.ndarray) -> dict[int, float]:
    return dict(zip(ids.tolist(), probs.tolist(), strict=True))


# --- names, parameters, the fast path ------------------------------------------------


def test_sampler_names_are_llamacpps() -> None:
    assert sampler_names("edskypmxt") == DEFAULT_SAMPLERS
    assert sampler_names(["Top-K", "nucleus", "temp", "typ", "typical", "typical_p", "min-p", "minp", "top-n-sigma",
                          "topnsigma", "adaptive-p", "penalties", "dry", "xtc"]) == (
        "top_k", "top_p", "temperature", "typ_p", "typ_p", "typ_p", "min_p", "min_p", "top_n_sigma",
        "top_n_sigma", "adaptive_p", "penalties", "dry", "xtc")
    assert sampler_names([]) == ()
    assert sampler_names("kkta") == ("top_k", "top_k", "temperature", "adaptive_p")
    for bad in (["top_q"], "kz", ["infill"], "ki", [3]):
        with pytest.raises(InvalidRequest):
            sampler_names(bad)  # type: ignore[arg-type]


def test_new_defaults_are_llamacpps_and_validated() -> None:
    p = SamplingParams()
    assert (p.dry_multiplier, p.dry_base, p.dry_allowed_length, p.dry_sequence_breakers) == (
        0.0, 1.75, 2, ("\n", ":", "\"", "*"))
    assert (p.xtc_probability, p.xtc_threshold, p.top_n_sigma, p.dynatemp_range, p.dynatemp_exponent) == (
        0.0, 0.1, -1.0, 0.0, 1.0)
    assert (p.mirostat, p.mirostat_tau, p.mirostat_eta, p.min_keep, p.adaptive_target, p.adaptive_decay) == (
        0, 5.0, 0.1, 0, -1.0, 0.9)
    assert p.samplers == DEFAULT_SAMPLERS and not p.host_only
    assert SamplingParams(samplers=["temp", "top-k"]).samplers == ("temperature", "top_k")  # type: ignore[arg-type]
    assert SamplingParams(samplers="kt").samplers == ("top_k", "temperature")  # type: ignore[arg-type]
    for bad in ({"mirostat": 3}, {"min_keep": -1}, {"xtc_probability": 1.5}, {"adaptive_decay": 0.995},
                {"adaptive_target": 1.5}, {"dry_allowed_length": -1}, {"dry_penalty_last_n": -2},
                {"samplers": ["nope"]}, {"dry_sequence_breakers": "\n"}, {"top_n_sigma": float("nan")}):
        with pytest.raises(InvalidRequest):
            SamplingParams(**bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("change", [
    {"dry_multiplier": 0.8}, {"xtc_probability": 0.5}, {"top_n_sigma": 1.0}, {"dynatemp_range": 0.5},
    {"mirostat": 2}, {"min_keep": 1}, {"samplers": ("top_k", "temperature")},
    {"samplers": DEFAULT_SAMPLERS + ("adaptive_p",), "adaptive_target": 0.5},
])
def test_host_only_for_anything_beyond_the_device_chain(change: dict[str, Any]) -> None:
    assert attrs.evolve(SamplingParams(), **change).host_only
    # and off when the setting is llama.cpp's "off"
    assert not SamplingParams(dry_multiplier=0.8, dry_base=0.5).host_only
    assert not SamplingParams(xtc_probability=0.5, xtc_threshold=0.6).host_only


def test_default_chain_is_todays_candidates_and_the_general_walk_agrees() -> None:
    rng = np.random.default_rng(5)
    for n_vocab in (60, 4000):
        for top_k, top_p, min_p, typical_p in [(40, 0.95, 0.05, 1.0), (0, 0.9, 0.0, 1.0), (0, 1.0, 0.02, 1.0),
                                              (30, 0.8, 0.1, 0.5), (0, 1.0, 0.0, 0.7), (5, 1.0, 0.0, 1.0)]:
            for scale in (0.5, 3.0, 8.0):
                x = (rng.normal(size=n_vocab) * scale).astype(np.float32)
                recent = rng.integers(0, n_vocab, 40)
                p = SamplingParams(temperature=0.7, top_k=top_k, top_p=top_p, min_p=min_p, typical_p=typical_p,
                                   repeat_penalty=1.2, presence_penalty=0.1)
                fast = candidates(x, p, recent)
                got = chain(x, p, recent)
                assert np.array_equal(got[0], fast[0]) and np.array_equal(got[1], fast[1])
                # min_keep 1 changes no cut but takes the general walk
                slow = chain(x, attrs.evolve(p, min_keep=1), recent)
                assert slow[0].tolist() == fast[0].tolist()
                np.testing.assert_allclose(slow[1], fast[1], rtol=1e-5)  # penalties: float32 there


def test_greedy_keeps_the_best_survivor_of_the_chain() -> None:
    x = np.log(np.array([0.5, 0.3, 0.15, 0.05]))
    assert chain(x, SamplingParams(temperature=0.0))[0].tolist() == [0]
    # llama.cpp's temperature sampler at <= 0 keeps the best of what the samplers
    # before it left: XTC has removed the top token, typical-p all but the most typical
    xtc = SamplingParams(temperature=0.0, top_k=0, top_p=1.0, min_p=0.0, xtc_probability=1.0, xtc_threshold=0.2)
    assert chain(x, xtc)[0].tolist() == [1]
    assert as_dict(*chain(x, SamplingParams(temperature=0.0, typical_p=0.01))) == {1: 1.0}
    rng = np.random.default_rng(0)
    state = rng.bit_generator.state
    assert sample(x, xtc, rng, (), make_state(xtc, 1)) == 1
    assert rng.bit_generator.state == state  # greedy still draws nothing from the caller's generator


# --- each sampler on hand-made logits -------------------------------------------------


def test_top_n_sigma_keeps_logits_within_n_deviations_of_the_top() -> None:
    x = np.array([5.0, 4.0, 3.5, 1.0, 0.0, 0.0, -1.0, -np.inf], np.float32)
    finite = x[np.isfinite(x)].astype(np.float64)
    for n in (0.5, 1.0, 2.0):
        ids, probs = chain(x, SamplingParams(**FLAT, top_n_sigma=n))  # type: ignore[arg-type]
        keep = np.flatnonzero(x >= finite.max() - n * finite.std())
        assert sorted(ids.tolist()) == keep.tolist()
        np.testing.assert_allclose(probs, softmax(x[ids]))
    assert len(chain(x, SamplingParams(**FLAT, top_n_sigma=0.0))[0]) == 7  # type: ignore[arg-type]


def test_xtc_removes_every_likely_token_but_the_least_of_them() -> None:
    probs = np.array([0.4, 0.3, 0.2, 0.1])
    x = np.log(probs)
    on = SamplingParams(**FLAT, xtc_probability=1.0, xtc_threshold=0.15)  # type: ignore[arg-type]
    ids, got = chain(x, on, (), make_state(on, 1))
    assert ids.tolist() == [2, 3]
    np.testing.assert_allclose(got, [2 / 3, 1 / 3])
    assert chain(x, attrs.evolve(on, xtc_threshold=0.5))[0].tolist() == [0, 1, 2, 3]  # one above: none removed
    assert chain(x, attrs.evolve(on, xtc_threshold=0.05))[0].tolist() == [3]
    assert chain(x, attrs.evolve(on, min_keep=3))[0].tolist() == [0, 1, 2, 3]  # would leave 2 < min_keep
    assert chain(x, attrs.evolve(on, xtc_threshold=0.6))[0].tolist() == [0, 1, 2, 3]  # > 0.5: off
    # the coin: xtc_probability of the steps, from the state's generator
    half = attrs.evolve(on, xtc_probability=0.5)
    state = make_state(half, 7)
    hits = sum(chain(x, half, (), state)[0].shape[0] == 2 for _ in range(2000))
    assert 900 < hits < 1100
    replay = make_state(half, 7)
    again = [chain(x, half, (), replay)[0].shape[0] for _ in range(50)]
    state2 = make_state(half, 7)
    assert again == [chain(x, half, (), state2)[0].shape[0] for _ in range(50)]  # a fixed seed replays


def test_dynatemp_moves_the_temperature_with_the_entropy() -> None:
    assert dynatemp(np.full(8, 1 / 8), 1.0, 0.5, 1.0) == pytest.approx(1.5)  # entropy at its maximum
    assert dynatemp(np.array([1.0, 0.0, 0.0]), 1.0, 0.5, 1.0) == pytest.approx(0.5)  # none
    assert dynatemp(np.array([1.0, 0.0]), 0.3, 0.5, 1.0) == pytest.approx(0.0)  # low end clamped at 0
    probs = np.array([0.6, 0.3, 0.1])
    h = -(probs * np.log(probs)).sum() / np.log(3)
    assert dynatemp(probs, 0.8, 0.4, 2.0) == pytest.approx(0.4 + 0.8 * h**2)
    x = np.log(probs)
    p = SamplingParams(**{**FLAT, "temperature": 0.8}, dynatemp_range=0.4, dynatemp_exponent=2.0)  # type: ignore[arg-type]
    np.testing.assert_allclose(chain(x, p)[1], softmax(x / (0.4 + 0.8 * h**2)))
    # masked candidates still count in the entropy's maximum, log n (top-n-sigma masks)
    y = np.array([3.0, 2.9, 0.0, 0.0, 0.0, 0.0], np.float32)
    q = attrs.evolve(p, top_n_sigma=1.0, dynatemp_exponent=1.0)
    two = softmax(y[:2])
    t = 0.4 + 0.8 * float(-(two * np.log(two)).sum() / np.log(6))
    np.testing.assert_allclose(chain(y, q)[1], softmax(y[:2] / t), rtol=1e-6)


def test_min_keep_holds_each_cut_open() -> None:
    x = np.log(np.array([0.5, 0.2, 0.15, 0.1, 0.05]))
    top_p = SamplingParams(**{**FLAT, "top_p": 0.1}, min_keep=3)  # type: ignore[arg-type]
    assert chain(x, top_p)[0].tolist() == [0, 1, 2]
    min_p = SamplingParams(**{**FLAT, "min_p": 0.9}, min_keep=4)  # type: ignore[arg-type]
    assert chain(x, min_p)[0].tolist() == [0, 1, 2, 3]
    typical = SamplingParams(**FLAT, typical_p=0.01, min_keep=2)  # type: ignore[arg-type]
    assert len(chain(x, typical)[0]) == 2
    # top-k and temperature take none
    assert chain(x, SamplingParams(**{**FLAT, "top_k": 2}, min_keep=4))[0].tolist() == [0, 1]  # type: ignore[arg-type]


def test_samplers_run_in_the_given_order() -> None:
    x = np.log(np.array([0.4, 0.3, 0.2, 0.1]))
    # top-p 0.6 before temperature 0.25 keeps [0, 1]; after it (sharper), only [0]
    before = SamplingParams(temperature=0.25, top_k=0, top_p=0.6, min_p=0.0, samplers=("top_p", "temperature"))
    after = attrs.evolve(before, samplers=("temperature", "top_p"))
    assert chain(x, before)[0].tolist() == [0, 1]
    assert chain(x, after)[0].tolist() == [0]
    np.testing.assert_allclose(chain(x, attrs.evolve(before, samplers=()))[1], [0.4, 0.3, 0.2, 0.1])  # no temperature
    twice = attrs.evolve(before, samplers=("temperature", "temperature"))
    np.testing.assert_allclose(chain(x, twice)[1], softmax(x * 16), rtol=1e-6)


def naive_dry(history: list[int], n_vocab: int, p: SamplingParams,
              breakers: dict[int, tuple[tuple[int, ...], ...]]) -> np.ndarray:
    """DRY's penalties by brute force: the repeat lengths by direct comparison."""
    w = history[-p.dry_penalty_last_n:] if p.dry_penalty_last_n > 0 else list(history)
    n = len(w)
    pen = np.zeros(n_vocab)
    if n <= p.dry_allowed_length:
        return pen
    limit = n
    for back in range(n):  # the newest breaker whose tail follows it
        tails = [t for t in breakers.get(w[n - 1 - back], ()) if len(t) <= back
                 and list(t) == w[n - back: n - back + len(t)]]
        if tails:
            limit = back - max(map(len, tails))
            break
    if limit < p.dry_allowed_length:
        return pen
    longest: dict[int, int] = {}
    for j in range(n - 1):
        size = 0
        while size < min(limit, j + 1) and w[j - size] == w[n - 1 - size]:
            size += 1
        if size >= p.dry_allowed_length:
            longest[w[j + 1]] = max(longest.get(w[j + 1], 0), size)
    for tok, size in longest.items():
        if () not in breakers.get(tok, ()):
            pen[tok] = p.dry_multiplier * p.dry_base ** (size - p.dry_allowed_length)
    return pen


def test_dry_penalties_on_a_constructed_history() -> None:
    pieces = [b"a", b"b", b"c", b"d", b"e", b"\n", b"x:", b"f"]
    p = SamplingParams(**FLAT, dry_multiplier=0.5, dry_base=2.0, dry_allowed_length=2)  # type: ignore[arg-type]
    state = make_state(p, 1, lambda: pieces)
    assert state.breakers == {5: ((),), 6: ((),)}
    x = np.zeros(8, np.float32)
    # "a b c d e a b c": d would make "a b c d" (3 repeated + 1): 0.5 * 2 ** (3 - 2)
    got = as_dict(*chain(x, p, [0, 1, 2, 3, 4, 0, 1, 2], state))
    want = softmax(-np.array([0, 0, 0, 1.0, 0, 0, 0, 0]))
    assert got == pytest.approx(dict(enumerate(want)))
    # a breaker inside the repeat: "a \n b c d e a \n b c" only "b c" counts (length 2 -> 0.5)
    got = as_dict(*chain(x, p, [0, 5, 1, 2, 3, 4, 0, 5, 1, 2], state))
    assert got == pytest.approx(dict(enumerate(softmax(-np.array([0, 0, 0, 0.5, 0, 0, 0, 0])))))
    # a breaker never takes the penalty itself; a window too short for a repeat: none
    got = as_dict(*chain(x, p, [0, 1, 5, 7, 0, 1], state))
    assert got == pytest.approx(dict(enumerate(softmax(np.zeros(8)))))
    short = attrs.evolve(p, dry_penalty_last_n=2)
    assert as_dict(*chain(x, short, [0, 1, 2, 0, 1, 2], state)) == pytest.approx(dict(enumerate(softmax(np.zeros(8)))))
    # the exponent grows with the repeat: "a b c d e f a b c d e" -> f: 0.5 * 2 ** 3
    got = chain(x, p, [0, 1, 2, 3, 4, 7, 0, 1, 2, 3, 4], state)
    assert as_dict(*got) == pytest.approx(dict(enumerate(softmax(-np.array([0, 0, 0, 0, 0, 0, 0, 4.0])))))


def test_dry_agrees_with_brute_force_on_random_histories() -> None:
    rng = np.random.default_rng(3)
    breakers = {3: ((),), 2: ((1,), (1, 0))}
    for trial in range(300):
        n_vocab = 5
        history = rng.integers(0, n_vocab, rng.integers(1, 60)).tolist()
        p = SamplingParams(**FLAT, dry_multiplier=0.7, dry_base=1.5,  # type: ignore[arg-type]
                           dry_allowed_length=int(rng.integers(0, 4)),
                           dry_penalty_last_n=int(rng.choice([-1, 10, 30])))
        state = SamplerState(make_rng(trial), breakers=breakers)
        x = np.zeros(n_vocab, np.float32)
        got = as_dict(*chain(x, p, history, state))
        want = softmax(-naive_dry(history, n_vocab, p, breakers))
        assert got == pytest.approx(dict(enumerate(want))), (history, p)


def test_dry_breakers_follow_llamacpps_overlaps() -> None:
    pieces = [b"a", b"b", b"ab", b"xa", b"ba", b"c", b"abc", b"\n"]

    def tokenize(text: str) -> list[int]:
        return {"b": [1], "bc": [1, 5], "c": [5]}[text]

    # "abc": contained in token 6; "ab", "xa", "ba", "a" end with its beginning "ab" / "a"
    table = dry_breakers(["abc", "\n", ""], pieces, tokenize)
    assert table == {6: ((),), 2: ((5,),), 0: ((1, 5),), 3: ((1, 5),), 4: ((1, 5),), 7: ((),)}
    # without a tokenizer the rest is matched greedily against the pieces
    assert dry_breakers(["abc"], pieces) == {6: ((),), 2: ((5,),), 0: ((1, 5),), 3: ((1, 5),), 4: ((1, 5),)}


def test_make_state_scans_the_vocabulary_once_and_only_for_dry() -> None:
    calls = []

    def pieces() -> list[bytes]:
        calls.append(1)
        return [b"a", b"\n"]

    off = SamplingParams()
    assert make_state(off, 1, pieces).breakers == {} and calls == []
    on = SamplingParams(dry_multiplier=0.8)
    assert make_state(on, 1, pieces).breakers == {1: ((),)}
    assert make_state(on, 2, pieces).breakers == {1: ((),)}
    assert len(calls) == 1
    assert make_state(attrs.evolve(on, dry_sequence_breakers=("a",)), 1, pieces).breakers == {0: ((),)}
    assert len(calls) == 2


def test_mirostat_truncates_and_pick_moves_mu() -> None:
    # Zipf probabilities p_i ~ i ** -1.2: mirostat 1 estimates s = 1.2 from the best 100
    n = 200
    x = -1.2 * np.log(np.arange(1, n + 1, dtype=np.float64))
    p1 = SamplingParams(temperature=1.0, mirostat=1, mirostat_tau=5.0, mirostat_eta=0.1)
    state = make_state(p1, 1)
    assert state.mu == 10.0
    ids, probs = chain(x, p1, (), state)
    zipf = softmax(x)
    t = np.log(np.arange(2, 101) / np.arange(1, 100))
    b = np.log(zipf[:99] / zipf[1:100])
    s_hat = (t * b).sum() / (t * t).sum()
    eps = s_hat - 1
    k = int((eps * 2**10 / (1 - n ** -eps)) ** (1 / s_hat))
    assert ids.tolist() == list(range(k))
    np.testing.assert_allclose(probs, softmax(x[:k]), rtol=1e-6)
    token = pick(ids, probs, 0.0, p1, state)
    assert token == 0 and state.mu == pytest.approx(10.0 - 0.1 * (-math.log2(probs[0]) - 5.0))
    # mirostat 2 keeps the tokens of surprise -log2 p <= mu
    p2 = attrs.evolve(p1, mirostat=2, mirostat_tau=2.0, mirostat_eta=0.5)
    state = make_state(p2, 1)
    ids, probs = chain(x, p2, (), state)
    assert ids.tolist() == np.flatnonzero(-np.log2(zipf) <= 4.0).tolist()
    last = int(ids[-1])
    assert pick(ids, probs, 0.999999, p2, state) == last
    state_mu = 4.0 - 0.5 * (-math.log2(probs[-1]) - 2.0)
    assert state.mu == pytest.approx(state_mu)
    assert chain(x, p2, (), state)[0].tolist() == np.flatnonzero(-np.log2(zipf) <= state_mu).tolist()
    # Mirostat replaces the list, penalties included (llama.cpp)
    pen = attrs.evolve(p2, repeat_penalty=100.0)
    assert chain(x, pen, [0], make_state(pen, 1))[0][0] == 0


def test_adaptive_p_reshapes_around_its_target_and_learns() -> None:
    probs = np.array([0.5, 0.25, 0.15, 0.1])
    x = np.log(probs)
    p = SamplingParams(**FLAT, samplers=("top_k", "adaptive_p"), adaptive_target=0.2,  # type: ignore[arg-type]
                       adaptive_decay=0.5)
    state = make_state(p, 1)
    assert (state.weighted_sum, state.total_weight) == (pytest.approx(0.4), pytest.approx(2.0))
    # the first step's target is 2 * 0.2 - 0.4 / 2 = 0.2
    d = np.abs(probs - 0.2) / 0.3
    ids, got = chain(x, p, (), state)
    want = softmax(5.0 - 10.0 * d * d / (1 + d))
    assert as_dict(ids, got) == pytest.approx(dict(enumerate(want)))
    assert pick(ids, got, 0.0, p, state) == int(ids[0])
    chosen = probs[int(ids[0])]
    assert state.weighted_sum == pytest.approx(chosen + 0.5 * 0.4)
    assert state.total_weight == pytest.approx(2.0)
    # a negative target: the plain draw
    off = attrs.evolve(p, adaptive_target=-1.0)
    np.testing.assert_allclose(chain(x, off, (), make_state(off, 1))[1], probs)


def test_typical_with_a_zero_probability_is_llamacpps_nan_order() -> None:
    """llama.cpp's entropy is NaN once a candidate has probability 0 (0 * log 0), so its
    std::sort by distance from it compares nothing as smaller and leaves libstdc++'s
    introsort order. On 41 candidates (sorted by logit): the middle one (20) goes first
    and the rest is reversed, split at 21; [21, 41) the same way (31 first, split at 31),
    then [0, 21) (10 first, split at 11): 31, 21..30, 20, 32..40, 10, 1..9, 0, 11..19. The
    mass passes 0.5 at 5; the banned 40 is kept but has probability 0."""
    x = np.concatenate([np.log(np.arange(40, 0, -1.0)), [-np.inf]]).astype(np.float32)  # [41]
    p = SamplingParams(**FLAT, typical_p=0.5)  # type: ignore[arg-type]
    want = [1, 2, 3, 4, 5, 10] + list(range(20, 40))
    assert sorted(chain(x, p)[0].tolist()) == want
    assert sorted(chain(x, attrs.evolve(p, min_keep=1))[0].tolist()) == want
    assert len(chain(x, attrs.evolve(p, min_keep=30))[0]) == 29  # 30 kept, the banned one among them


def test_sample_u_is_chain_then_pick_and_draws_one_number() -> None:
    x = np.random.default_rng(2).normal(size=300).astype(np.float32)
    p = SamplingParams(xtc_probability=0.5, xtc_threshold=0.02, top_n_sigma=2.0, dry_multiplier=0.5)
    recent = [1, 2, 3, 1, 2]
    for u in (0.0, 0.3, 0.999):
        s1, s2 = make_state(p, 9), make_state(p, 9)
        ids, probs = chain(x, p, recent, s1)
        assert sample_u(x, p, u, recent, s2) == pick(ids, probs, u, p, s1)
    rng, twin = make_rng(4), make_rng(4)
    sample(x, p, rng, recent, make_state(p, 4))
    draw_u(p, twin)
    assert rng.bit_generator.state == twin.bit_generator.state


# --- against llama.cpp ----------------------------------------------------------------

#: |log p| agreement of our logits' candidates with llama.cpp's (F32: ~1e-4 nats of
#: logit difference, times 1 / temperature)
OURS_TOL = 0.005
#: with llama.cpp's own logits only float32 rounding is left
THEIRS_RTOL = 1e-4

CASES: list[tuple[str, str, dict[str, Any]]] = [
    ("default", "plain", {}),
    ("top_n_sigma", "plain", {**FLAT, "top_n_sigma": 1.0}),
    ("top_n_sigma_wide", "plain", {**FLAT, "top_n_sigma": 2.0}),
    ("top_n_sigma_in_default_chain", "plain", {"top_n_sigma": 1.5}),
    ("xtc", "plain", {**FLAT, "temperature": 0.1, "samplers": ["temperature", "xtc"], "xtc_probability": 1.0,
                      "xtc_threshold": 0.05}),
    ("xtc_in_default_chain", "plain", {"xtc_probability": 1.0, "xtc_threshold": 0.03}),
    ("xtc_min_keep", "plain", {"xtc_probability": 1.0, "xtc_threshold": 0.001, "min_keep": 5}),
    ("dynatemp", "plain", {**FLAT, "dynatemp_range": 0.5}),
    ("dynatemp_top_k", "plain", {"temperature": 0.8, "top_k": 10, "dynatemp_range": 0.5, "dynatemp_exponent": 2.0}),
    ("dynatemp_masked", "plain", {**FLAT, "temperature": 0.8, "top_n_sigma": 1.0, "dynatemp_range": 0.7}),
    ("min_keep_top_p", "plain", {**FLAT, "top_p": 0.01, "min_keep": 5}),
    ("min_keep_min_p", "plain", {**FLAT, "min_p": 0.9, "min_keep": 7}),
    ("min_keep_typical_nan", "plain", {**FLAT, "typical_p": 0.01, "min_keep": 4}),
    ("typical_nan", "plain", {**FLAT, "typical_p": 0.3}),
    ("typical", "plain", {"top_k": 10, "top_p": 1.0, "min_p": 0.0, "typical_p": 0.5}),
    ("order", "plain", {"temperature": 0.3, "top_k": 20, "top_p": 0.5, "min_p": 0.05,
                        "samplers": ["temperature", "top_p", "top_k", "min_p"]}),
    ("order_aliases", "plain", {"temperature": 0.3, "top_k": 20, "top_p": 0.5, "min_p": 0.05,
                                "samplers": ["TEMP", "nucleus", "top-k", "minp"]}),
    ("order_chars", "plain", {"temperature": 0.3, "top_k": 50, "top_p": 0.5, "min_p": 0.05, "typical_p": 0.9,
                              "samplers": "tpkym"}),
    ("no_samplers", "plain", {"temperature": 0.3, "samplers": []}),
    ("mirostat", "plain", {"temperature": 1.0, "mirostat": 1}),
    ("mirostat_sharp", "plain", {"temperature": 0.5, "mirostat": 1, "mirostat_tau": 4.0}),
    ("mirostat_v2", "plain", {"temperature": 1.0, "mirostat": 2, "mirostat_tau": 4.9}),
    ("mirostat_v2_sharp", "plain", {"temperature": 0.5, "mirostat": 2, "mirostat_tau": 4.0}),
    ("adaptive", "plain", {"top_k": 10, "samplers": ["top_k", "adaptive_p"], "adaptive_target": 0.3}),
    ("adaptive_all", "plain", {**FLAT, "samplers": ["top_k", "adaptive_p"], "adaptive_target": 0.5}),
    ("greedy_typical", "plain", {"temperature": 0.0, "typical_p": 0.3}),
    ("greedy_xtc", "plain", {**FLAT, "temperature": 0.0, "xtc_probability": 1.0, "xtc_threshold": 0.001}),
    ("dry", "repeat", {**FLAT, "dry_multiplier": 0.8, "dry_penalty_last_n": 64}),
    ("dry_in_default_chain", "repeat", {"dry_multiplier": 0.8, "dry_penalty_last_n": 64}),
    ("dry_longer", "repeat_long", {**FLAT, "dry_multiplier": 0.8, "dry_base": 1.5, "dry_penalty_last_n": 64}),
    ("dry_window", "repeat_long", {**FLAT, "dry_multiplier": 0.8, "dry_base": 1.5, "dry_penalty_last_n": 14}),
    ("dry_allowed_0", "repeat", {**FLAT, "dry_multiplier": 0.8, "dry_penalty_last_n": 64, "dry_allowed_length": 0}),
    ("dry_newline_breaker", "repeat_breaker", {**FLAT, "dry_multiplier": 0.8, "dry_penalty_last_n": 64}),
    ("dry_token_breaker", "repeat", {**FLAT, "dry_multiplier": 0.8, "dry_penalty_last_n": 64, "breaker": 1}),
    ("dry_two_token_breaker", "repeat_long", {**FLAT, "dry_multiplier": 0.8, "dry_penalty_last_n": 64,
                                              "breaker": 2}),
]
#: cases checked on llama.cpp's logits only: typical-p's NaN order keeps a prefix of a
#: fixed permutation of the logit-sorted candidates, so two neighbours ~1e-4 apart
#: anywhere in the sort (not only at a cut) swap which of them is kept
ORDER_SENSITIVE = {"typical_nan", "min_keep_typical_nan"}


@attrs.frozen
class World:
    """The reference, our backend and the prompts, for one file."""

    ref: Any
    backend: Any
    tok: Any
    ban: tuple[int, ...]
    plain: tuple[int, ...]  # ordinary tokens, none holding a default DRY breaker
    newline: int

    def post(self, prompt: list[int], settings: dict[str, Any], n_predict: int = 1) -> dict[str, Any]:
        body = {"prompt": prompt, "n_predict": n_predict, "n_probs": 2 * self.tok.n_vocab,
                "post_sampling_probs": True, "cache_prompt": False, "return_tokens": True, "seed": 1,
                "logit_bias": [[t, False] for t in self.ban], **settings}
        r = self.ref._client.post("/completion", json=body)
        r.raise_for_status()
        out: dict[str, Any] = r.json()
        assert len(out["completion_probabilities"]) == n_predict, out
        return out

    def theirs(self, prompt: list[int], settings: dict[str, Any]) -> dict[int, float]:
        entry = self.post(prompt, settings)["completion_probabilities"][0]
        return {int(e["id"]): float(e["prob"]) for e in entry["top_probs"]}

    def their_logits(self, prompt: list[int]) -> np.ndarray:
        """llama.cpp's distribution with every sampler off, as logits (log p; -inf banned)."""
        probs = self.theirs(prompt, FLAT)
        assert len(probs) == self.tok.n_vocab - len(self.ban)
        with np.errstate(divide="ignore"):
            return np.log(np.array([probs.get(i, 0.0) for i in range(self.tok.n_vocab)]))

    def our_logits(self, prompt: list[int]) -> np.ndarray:
        from trio_llm.engine.backend import SeqBatch

        return self.backend.forward([SeqBatch(0, np.asarray(prompt, np.int32), 0)])[0]  # type: ignore[no-any-return]

    def params(self, settings: dict[str, Any]) -> SamplingParams:
        return SamplingParams(seed=1, logit_bias=tuple((t, float("-inf")) for t in self.ban), **settings)

    def state(self, params: SamplingParams) -> SamplerState:
        tok = self.tok
        return make_state(params, 1, lambda: [tok.token_to_piece(i) for i in range(tok.n_vocab)],
                          tokenize=lambda s: tok.encode(s, add_special=False, parse_special=False))

    def text(self, token: int) -> str:
        return str(self.tok.token_to_piece(token).decode("utf-8"))


@pytest.fixture(scope="module")
def world(model_path) -> Iterator[World]:  # type: ignore[no-untyped-def]
    from llamacpp_ref import Reference, partial_utf8_tokens
    from trio_llm.engine.reference import NumpyBackend
    from trio_llm.model.gguf import load_gguf
    from trio_llm.model.tokenizer import Tokenizer

    path = model_path("tiny", "F32", sharp=True)
    tok = Tokenizer.from_metadata(load_gguf(path).metadata)
    ban = partial_utf8_tokens(tok)
    ban += [i for i in range(tok.n_vocab) if tok.is_special(i) or tok.is_eog(i)]
    breakers = (b"\n", b":", b'"', b"*")
    plain = [i for i in range(tok.n_vocab) if i not in set(ban)
             and not any(b in tok.token_to_piece(i) for b in breakers)]
    newline = next(i for i in range(tok.n_vocab) if tok.token_to_piece(i) == b"\n")
    ref = Reference(path, n_ctx=256)
    try:
        yield World(ref, NumpyBackend(load_gguf(path), n_ctx=256, n_seq=1), tok, tuple(sorted(set(ban))),
                    tuple(plain), newline)
    finally:
        ref.close()


def prompt_of(world: World, kind: str, seed: int) -> tuple[list[int], int | None, list[int]]:
    """(prompt, the token DRY should penalise or None, the repeated run)."""
    rng = np.random.default_rng(seed)
    run = [int(t) for t in rng.choice(world.plain, 6, replace=False)]
    fill = [int(t) for t in rng.choice([t for t in world.plain if t not in run], 5, replace=False)]
    if kind == "plain":
        return [int(t) for t in rng.choice(world.plain, 12)], None, run
    if kind == "repeat":  # run fill run[:4]: run[4] would extend a repeat of 4
        return run + fill + run[:4], run[4], run
    if kind == "repeat_long":  # run fill run fill[:3]: fill[3] extends a repeat of 9
        return run + fill + run + fill[:3], fill[3], run
    # a newline inside the run: only the 2 tokens after it count
    broken = run[:2] + [world.newline] + run[2:]
    return broken + fill + broken[:5], broken[5], run


def resolve(world: World, settings: dict[str, Any], run: list[int]) -> dict[str, Any]:
    """A case's settings with ``breaker`` (1: a run token's text, 2: two run tokens')
    turned into ``dry_sequence_breakers``."""
    out = dict(settings)
    n = out.pop("breaker", 0)
    if n:
        out["dry_sequence_breakers"] = ["".join(world.text(t) for t in run[1 : 1 + n])]
    return out


def assert_same(ours: dict[int, float], theirs: dict[int, float], *, rtol: float = 0.0, log_tol: float = 0.0) -> None:
    assert set(ours) == set(theirs), (sorted(set(ours) - set(theirs)), sorted(set(theirs) - set(ours)))
    for t, q in theirs.items():
        if rtol:
            assert ours[t] == pytest.approx(q, rel=rtol), t
        else:
            assert abs(math.log(ours[t]) - math.log(q)) <= log_tol, (t, ours[t], q)


@pytest.mark.parametrize("seed", [1, 2])
@pytest.mark.parametrize(("name", "kind", "settings"), CASES, ids=[c[0] for c in CASES])
def test_chain_agrees_with_llamacpp(world: World, name: str, kind: str, settings: dict[str, Any], seed: int) -> None:
    prompt, target, run = prompt_of(world, kind, seed)
    settings = resolve(world, settings, run)
    theirs = world.theirs(prompt, settings)
    if target is not None and "breaker" not in name:  # DRY bites: the repeat's next token is penalised
        assert theirs.get(target, 0.0) < 0.7 * world.theirs(prompt, FLAT)[target]
    params = world.params(settings)
    # llama.cpp's own logits: its rules exactly
    mine = as_dict(*chain(world.their_logits(prompt), params, prompt, world.state(params)))
    assert_same(mine, theirs, rtol=THEIRS_RTOL)
    if name in ORDER_SENSITIVE:
        return
    # our logits: the whole path
    ours = as_dict(*chain(world.our_logits(prompt), params, prompt, world.state(params)))
    assert_same(ours, theirs, log_tol=OURS_TOL / min(1.0, params.temperature if params.temperature > 0 else 1.0))


@pytest.mark.parametrize(("name", "settings"), [
    ("mirostat", {"temperature": 1.0, "mirostat": 1, "mirostat_tau": 4.0, "mirostat_eta": 0.5}),
    ("mirostat_v2", {"temperature": 0.5, "mirostat": 2, "mirostat_tau": 3.0, "mirostat_eta": 0.5}),
    ("adaptive", {"temperature": 1.0, "top_k": 20, "samplers": ["top_k", "adaptive_p"], "adaptive_target": 0.3,
                  "adaptive_decay": 0.5}),
    ("adaptive_tempered", {"temperature": 0.2, "top_k": 20, "samplers": ["top_k", "temperature", "adaptive_p"],
                           "adaptive_target": 0.1, "adaptive_decay": 0.5}),
])
def test_state_carries_to_the_next_step_as_in_llamacpp(world: World, name: str, settings: dict[str, Any]) -> None:
    """Two steps of one request: pick, given a number that chooses llama.cpp's first
    token, moves the state (mu, the average) as llama.cpp's sampler did, so the second
    step's candidates agree too."""
    prompt, _, _ = prompt_of(world, "plain", 1)
    steps = world.post(prompt, settings, n_predict=2)["completion_probabilities"]
    params = world.params(settings)
    state = world.state(params)
    before = (state.mu, state.weighted_sum)
    for i, step in enumerate(steps):
        ids, probs = chain(world.their_logits(prompt + [int(s["id"]) for s in steps[:i]]), params, prompt, state)
        assert_same(as_dict(ids, probs), {int(e["id"]): float(e["prob"]) for e in step["top_probs"]},
                    rtol=THEIRS_RTOL)
        at = int(np.flatnonzero(ids == int(step["id"]))[0])
        cum = np.cumsum(probs)
        u = float((cum[at] - probs[at] / 2) / cum[-1])
        assert pick(ids, probs, u, params, state) == int(step["id"])
    assert (state.mu, state.weighted_sum) != before

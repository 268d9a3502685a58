"""Sampling: each stage of the chain with exact expectations, and draws by counting."""

from __future__ import annotations

import numpy as np
import pytest

from trio_llm.engine.sampling import (
    DEFAULT_SEED,
    SamplingParams,
    apply_penalties,
    candidates,
    log_softmax,
    make_rng,
    sample,
    top_logprobs,
)
from trio_llm.errors import InvalidRequest

# a neutral chain: every stage off, temperature 1, so single stages can be switched on
PLAIN = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0)


def probs_of(logits: list[float]) -> np.ndarray:
    e = np.exp(np.array(logits) - max(logits))
    return e / e.sum()


def test_defaults_are_llama_servers() -> None:
    p = SamplingParams()
    assert (p.temperature, p.top_k, p.top_p, p.min_p) == (0.8, 40, 0.95, 0.05)
    assert (p.repeat_penalty, p.repeat_last_n, p.seed, p.n_probs) == (1.0, 64, DEFAULT_SEED, 0)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"top_p": 1.5},
        {"min_p": -0.1},
        {"temperature": float("nan")},
        {"repeat_last_n": -2},
        {"n_probs": -1},
    ],
)
def test_bad_params_raise_invalid_request(kwargs: dict[str, float]) -> None:
    with pytest.raises(InvalidRequest):
        SamplingParams(**kwargs)  # type: ignore[arg-type]


def test_greedy_is_argmax_and_draws_nothing() -> None:
    logits = np.array([0.1, 3.0, 2.9, -1.0], dtype=np.float32)
    rng = np.random.default_rng(1)
    state = rng.bit_generator.state
    assert sample(logits, SamplingParams(temperature=0.0), rng) == 1
    assert sample(logits, SamplingParams(temperature=-1.0), rng) == 1
    assert rng.bit_generator.state == state


def test_repeat_penalty_divides_positive_and_multiplies_negative() -> None:
    x = np.array([2.0, -2.0, 1.0, 4.0])
    apply_penalties(x, [0, 1, 1], repeat_penalty=2.0, repeat_last_n=64)
    np.testing.assert_allclose(x, [1.0, -4.0, 1.0, 4.0])


def test_repeat_last_n_window_and_frequency_presence() -> None:
    x = np.array([2.0, 2.0, 2.0])
    # window of 3 sees tokens [1, 1, 2]; token 0 is too old
    apply_penalties(
        x, [0, 1, 1, 2], repeat_penalty=1.0, repeat_last_n=3,
        presence_penalty=0.5, frequency_penalty=0.25,
    )
    np.testing.assert_allclose(x, [2.0, 2.0 - 0.5 - 0.5, 2.0 - 0.25 - 0.5])
    y = np.array([2.0, 2.0])
    apply_penalties(y, [0, 1], repeat_penalty=2.0, repeat_last_n=0)
    np.testing.assert_allclose(y, [2.0, 2.0])  # 0 disables the penalty


def test_penalty_changes_greedy_choice() -> None:
    logits = np.array([1.0, 1.5, 0.0])
    params = SamplingParams(temperature=0.0, repeat_penalty=2.0)
    assert sample(logits, params, make_rng(0), recent_tokens=[1]) == 0


def test_top_k_keeps_the_k_largest_ties_by_lower_id() -> None:
    logits = np.array([1.0, 5.0, 3.0, 5.0, 2.0])
    ids, probs = candidates(logits, SamplingParams(temperature=1.0, top_k=3, top_p=1.0, min_p=0.0))
    assert ids.tolist() == [1, 3, 2]
    np.testing.assert_allclose(probs, probs_of([5.0, 5.0, 3.0]))


def test_top_p_keeps_shortest_prefix_reaching_p() -> None:
    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05]))
    p = SamplingParams(temperature=1.0, top_k=0, top_p=0.79, min_p=0.0)
    assert candidates(logits, p)[0].tolist() == [0, 1]
    p = SamplingParams(temperature=1.0, top_k=0, top_p=0.81, min_p=0.0)
    assert candidates(logits, p)[0].tolist() == [0, 1, 2]
    p = SamplingParams(temperature=1.0, top_k=0, top_p=0.0, min_p=0.0)
    assert candidates(logits, p)[0].tolist() == [0]  # always at least one


def test_min_p_is_relative_to_the_top_token() -> None:
    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05]))
    p = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.29)  # threshold 0.145
    ids, probs = candidates(logits, p)
    assert ids.tolist() == [0, 1, 2]
    np.testing.assert_allclose(probs, np.array([0.5, 0.3, 0.15]) / 0.95, rtol=1e-6)
    p = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.31)  # threshold 0.155
    assert candidates(logits, p)[0].tolist() == [0, 1]


def test_top_p_sees_untempered_distribution() -> None:
    # llama.cpp order: top-p before temperature, so a high temperature does not widen it
    logits = np.log(np.array([0.6, 0.3, 0.1]))
    hot = SamplingParams(temperature=5.0, top_k=0, top_p=0.85, min_p=0.0)
    ids, probs = candidates(logits, hot)
    assert ids.tolist() == [0, 1]
    np.testing.assert_allclose(probs, probs_of([np.log(0.6) / 5, np.log(0.3) / 5]))


def test_logit_bias_bans_and_rejects_out_of_range() -> None:
    logits = np.array([3.0, 1.0, 0.0])
    params = SamplingParams(temperature=0.0, logit_bias=((0, float("-inf")),))
    assert sample(logits, params, make_rng(0)) == 1
    with pytest.raises(InvalidRequest):
        sample(logits, SamplingParams(logit_bias=((7, 1.0),)), make_rng(0))


def test_fixed_seed_replays() -> None:
    logits = np.random.default_rng(3).normal(size=64).astype(np.float32)
    a = [sample(logits, PLAIN, make_rng(42)) for _ in range(5)]
    rng1, rng2 = make_rng(42), make_rng(42)
    seq1 = [sample(logits, PLAIN, rng1) for _ in range(50)]
    seq2 = [sample(logits, PLAIN, rng2) for _ in range(50)]
    assert len(set(a)) == 1
    assert seq1 == seq2
    assert len(set(seq1)) > 5  # and it does sample, not argmax


def test_draws_follow_the_tempered_distribution() -> None:
    logits = np.array([2.0, 1.0, 0.0, -1.0])
    params = SamplingParams(temperature=0.5, top_k=0, top_p=1.0, min_p=0.0)
    rng = make_rng(123)
    n = 20000
    counts = np.bincount([sample(logits, params, rng) for _ in range(n)], minlength=4)
    expected = probs_of([4.0, 2.0, 0.0, -2.0])
    # 4 standard deviations of a binomial count
    tol = 4 * np.sqrt(n * expected * (1 - expected)) + 1
    assert np.all(np.abs(counts - n * expected) <= tol), (counts, n * expected)


def test_draws_never_leave_the_candidate_set() -> None:
    logits = np.array([1.0, 0.9, 0.8, 0.7, 0.6, 0.5])
    params = SamplingParams(temperature=1.0, top_k=2, top_p=1.0, min_p=0.0)
    rng = make_rng(9)
    seen = {sample(logits, params, rng) for _ in range(500)}
    assert seen == {0, 1}


def test_top_logprobs_exact() -> None:
    logits = np.array([0.0, 2.0, 1.0, 2.0], dtype=np.float32)
    got = top_logprobs(logits, 3)
    lp = log_softmax(logits)
    assert [i for i, _ in got] == [1, 3, 2]
    np.testing.assert_allclose([v for _, v in got], [lp[1], lp[3], lp[2]])
    np.testing.assert_allclose(np.exp(lp).sum(), 1.0)
    assert top_logprobs(logits, 0) == []
    assert len(top_logprobs(logits, 10)) == 4


def naive_candidates(logits: np.ndarray, p: SamplingParams) -> tuple[list[int], np.ndarray]:
    """llama.cpp's chain step by step over a full sort: the slow, obvious version."""
    x = logits.astype(np.float64)
    order = sorted(range(len(x)), key=lambda i: (-x[i], i))
    if p.top_k > 0:
        order = order[: p.top_k]
    vals = x[order]
    if p.typical_p < 1.0:  # llama_sampler_typical_apply, spelled out
        pr = probs_of(list(vals))
        entropy = -sum(q * np.log(q) for q in pr)
        by_typ = sorted(range(len(order)), key=lambda i: (abs(-np.log(pr[i]) - entropy), i))
        total, last = 0.0, len(by_typ)
        for i, j in enumerate(by_typ):
            total += pr[j]
            if total > p.typical_p:
                last = i + 1
                break
        kept = by_typ[:last]
        order, vals = [order[j] for j in kept], vals[kept]
        resort = sorted(range(len(order)), key=lambda i: (-vals[i], order[i]))
        order, vals = [order[i] for i in resort], vals[resort]
    if p.top_p < 1.0:
        cum = np.cumsum(probs_of(list(vals)))
        keep = next((i + 1 for i, c in enumerate(cum) if c >= p.top_p), len(order))
        order, vals = order[:keep], vals[:keep]
    if p.min_p > 0.0:
        pr = probs_of(list(vals))
        keep = max(1, int(np.sum(pr >= p.min_p * pr[0])))
        order, vals = order[:keep], vals[:keep]
    return order, probs_of(list(vals / p.temperature))


@pytest.mark.parametrize("n_vocab", [50, 5000])
@pytest.mark.parametrize(
    ("top_k", "top_p", "min_p", "typical_p"),
    [(40, 0.95, 0.05, 1.0), (0, 0.95, 0.0, 1.0), (0, 0.5, 0.0, 1.0), (0, 0.999, 0.01, 1.0), (7, 1.0, 0.2, 1.0),
     (0, 1.0, 0.0, 1.0), (40, 0.95, 0.05, 0.5), (0, 1.0, 0.0, 0.9), (0, 0.8, 0.1, 0.3), (10, 1.0, 0.0, 0.2)],
)
def test_fast_chain_equals_the_naive_chain(n_vocab: int, top_k: int, top_p: float, min_p: float,
                                           typical_p: float) -> None:
    rng = np.random.default_rng(n_vocab + top_k)
    for scale in (0.5, 3.0, 8.0):
        logits = (rng.normal(size=n_vocab) * scale).astype(np.float32)
        params = SamplingParams(temperature=0.7, top_k=top_k, top_p=top_p, min_p=min_p, typical_p=typical_p)
        ids, probs = candidates(logits, params)
        want_ids, want_probs = naive_candidates(logits, params)
        assert ids.tolist() == want_ids
        np.testing.assert_allclose(probs, want_probs, rtol=1e-6)


def test_banning_every_token_is_an_invalid_request() -> None:
    ban = tuple((i, float("-inf")) for i in range(3))
    with pytest.raises(InvalidRequest, match="banned"):
        sample(np.zeros(3, np.float32), SamplingParams(logit_bias=ban), make_rng(0))

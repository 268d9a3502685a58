"""llama.cpp's samplers through the server: a request's (and the command line's)
``top_n_sigma``, ``xtc_*``, ``dynatemp_*``, ``dry_*``, ``mirostat*``, ``min_keep``,
``samplers``, and ``post_sampling_probs``, which reports the chain's candidates. The
reference is llama-server itself (xllamacpp) on the same file: the first token's
post-sampling candidates and probabilities of the same request (the draws themselves
come from different generators, so only the distribution is compared)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest

from conftest import ServeFactory
from llamacpp_ref import Reference, plain_prompt
from trio_llm.model.gguf import load_gguf
from trio_llm.model.tokenizer import Tokenizer

TOL = 0.03  # probabilities: our logits differ from llama.cpp's CPU ones by ~1e-3 nats

def _prompt(path: Path, n: int = 24, repeat: bool = False) -> list[int]:
    tok = Tokenizer.from_metadata(load_gguf(path).metadata)
    ids = plain_prompt(tok, n, seed=7)
    return ids + ids[: n // 2] if repeat else ids  # a repeat that DRY penalises


def _candidates(entry: dict[str, Any]) -> dict[int, float]:
    return {int(p["id"]): float(p["prob"]) for p in entry["top_probs"]}


def _same(ours: dict[int, float], theirs: dict[int, float]) -> None:
    assert set(ours) == set(theirs), (ours, theirs)
    for t, p in theirs.items():
        assert abs(ours[t] - p) <= TOL, (t, ours[t], p)


REQUESTS: dict[str, dict[str, Any]] = {
    "plain": {},
    "top_k": {"top_k": 3},
    "top_n_sigma": {"top_n_sigma": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0},
    "xtc": {"xtc_probability": 1.0, "xtc_threshold": 0.02, "top_k": 0, "min_p": 0.0},
    "dynatemp": {"dynatemp_range": 0.6, "dynatemp_exponent": 1.5},
    "dry": {"dry_multiplier": 2.0, "dry_allowed_length": 1, "dry_base": 2.0},
    "min_keep": {"min_keep": 5, "top_k": 2},
    "order": {"samplers": ["temperature", "top_k", "min_p"], "temperature": 2.0, "min_p": 0.2},
    "order_chars": {"samplers": "kt", "top_k": 4, "temperature": 0.5},
    "mirostat2": {"mirostat": 2, "mirostat_tau": 3.0},
    "mirostat1": {"mirostat": 1, "mirostat_tau": 3.0},
}


@pytest.mark.parametrize("name", list(REQUESTS))
async def test_a_requests_samplers_give_llamacpps_candidates(
    numpy_server: ServeFactory, sharp_qwen3_model: Path, name: str,
) -> None:
    prompt = _prompt(sharp_qwen3_model, repeat=name == "dry")
    body = {"prompt": prompt, "n_predict": 1, "n_probs": 40, "post_sampling_probs": True, "temperature": 1.0,
            "cache_prompt": False, "seed": 3, **REQUESTS[name]}
    ref = Reference(sharp_qwen3_model, n_ctx=256)
    try:
        theirs = ref._client.post("/completion", json=body).json()["completion_probabilities"][0]
    finally:
        ref.close()
    h = await numpy_server(sharp_qwen3_model)
    async with httpx.AsyncClient(base_url=h.url, timeout=60) as c:
        r = await c.post("/completion", json=body)
    assert r.status_code == 200, r.text
    ours = r.json()["completion_probabilities"][0]
    assert "logprob" not in ours and "top_logprobs" not in ours
    _same(_candidates(ours), _candidates(theirs))
    if ours["id"] in _candidates(ours):  # the drawn token's own prob (it may be past the top 40)
        assert abs(ours["prob"] - _candidates(ours)[ours["id"]]) < 1e-9
    assert ours["prob"] > 0
    settings = r.json()["generation_settings"]
    for key, value in REQUESTS[name].items():
        if key != "samplers":
            assert settings[key] == value, key


async def test_the_command_line_sets_the_defaults(numpy_server: ServeFactory, sharp_qwen3_model: Path) -> None:
    """--dry-* / --samplers / --top-n-sigma... are a request's defaults, as llama-server's."""
    args = ["--dry-multiplier", "1.5", "--dry-allowed-length", "1", "--dry-sequence-breaker", "x",
            "--dry-sequence-breaker", "y", "--samplers", "penalties;dry;top_k;temperature", "--top-k", "6",
            "--top-n-sigma", "2.5", "--mirostat-ent", "4", "--xtc-threshold", "0.2"]
    h = await numpy_server(sharp_qwen3_model, *args)
    cfg = h.context.config
    assert cfg.dry_sequence_breakers == ("x", "y") and cfg.samplers == ("penalties", "dry", "top_k", "temperature")
    prompt = _prompt(sharp_qwen3_model, repeat=True)
    # a fixed seed, and no end token drawn: llama-server leaves out the probabilities of an
    # answer that ends at once (a random seed drew one now and then under load)
    tok = Tokenizer.from_metadata(load_gguf(sharp_qwen3_model).metadata)
    body = {"prompt": prompt, "n_predict": 1, "n_probs": 40, "post_sampling_probs": True, "temperature": 1.0,
            "cache_prompt": False, "seed": 3, "logit_bias": [[t, False] for t in sorted(tok.eog_ids)]}
    async with httpx.AsyncClient(base_url=h.url, timeout=60) as c:
        r = await c.post("/completion", json=body)
        props = (await c.get("/props")).json()["default_generation_settings"]["params"]
    assert props["dry_multiplier"] == 1.5 and props["top_n_sigma"] == 2.5 and props["mirostat_tau"] == 4.0
    ref = Reference(sharp_qwen3_model, n_ctx=256)
    try:
        theirs = ref._client.post("/completion", json={**body, "dry_multiplier": 1.5, "dry_allowed_length": 1,
                                                       "dry_sequence_breakers": ["x", "y"], "top_k": 6,
                                                       "top_n_sigma": 2.5, "xtc_threshold": 0.2,
                                                       "samplers": ["penalties", "dry", "top_k", "temperature"]})
    finally:
        ref.close()
    _same(_candidates(r.json()["completion_probabilities"][0]), _candidates(theirs.json()["completion_probabilities"][0]))


@pytest.mark.parametrize(("field", "value"), [("mirostat", 3), ("samplers", ["top_k", "bogus"]),
                                               ("samplers", 5), ("dry_sequence_breakers", []),
                                               ("xtc_probability", 1.5), ("min_keep", -1),
                                               ("dry_penalty_last_n", -2), ("adaptive_decay", 1.0)])
async def test_bad_sampler_fields_are_400(
    numpy_server: ServeFactory, tiny_model: Path, field: str, value: Any,
) -> None:
    h = await numpy_server(tiny_model)
    async with httpx.AsyncClient(base_url=h.url, timeout=60) as c:
        r = await c.post("/completion", json={"prompt": "hi", "n_predict": 1, field: value})
        ok = await c.post("/completion", json={"prompt": "hi", "n_predict": 1})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", r.text
    assert ok.status_code == 200

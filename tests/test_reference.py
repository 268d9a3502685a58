"""The numpy reference backend: self-consistency of the forward pass, its building
blocks against naive loops, and residency (release/restore) for real.

Agreement with an independent implementation (Hugging Face transformers) is in
``test_transformers_reference.py``.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from trio_llm.engine import reference
from trio_llm.engine.backend import Backend, Level, SeqBatch
from trio_llm.engine.reference import NumpyBackend, apply_rope, attend, rms_norm, rope_tables
from trio_llm.errors import BackendError, ContextOverflow, InvalidRequest, ModelLoadError
from trio_llm.model.gguf import load_gguf

PRESETS = ["tiny", "tiny-qwen3", "tiny-qwen2"]


def open_numpy(path: Path, n_ctx: int = 64, n_seq: int = 2, **kw: object) -> NumpyBackend:
    """A float32 cache unless asked: these tests compare passes that compute the same
    K and V with different matrix shapes, whose float32 noise an f16 cache would round
    a whole f16 step apart now and then."""
    kw = {"cache_type_k": "f32", "cache_type_v": "f32", **kw}
    return NumpyBackend(load_gguf(path), n_ctx=n_ctx, n_seq=n_seq, **kw)  # type: ignore[arg-type]


def prompt(n: int, seed: int = 0, n_vocab: int = 1024) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, n_vocab, n).astype(np.int32)


def close(a: np.ndarray, b: np.ndarray) -> None:
    np.testing.assert_allclose(a, b, rtol=0, atol=2e-5 * float(np.ptp(b)))


def test_satisfies_backend_protocol(model_path) -> None:
    be: Backend = open_numpy(model_path("tiny", "Q8_0"))
    assert be.name == "numpy"
    assert (be.n_ctx, be.n_seq, be.config.n_layer) == (64, 2, 2)
    assert be.device_info()["type"] == "cpu"


@pytest.mark.parametrize("preset", PRESETS)
def test_incremental_decode_equals_one_pass(model_path, preset: str) -> None:
    """KV cache correctness: prefill in chunks then one token at a time gives the
    logits that one pass over the whole sequence gives."""
    be = open_numpy(model_path(preset, "Q8_0"))
    toks = prompt(20)
    full = be.forward_all_logits(toks, seq_id=1)  # [20, n_vocab]
    assert full.shape == (20, be.config.n_vocab) and full.dtype == np.float32
    got = [be.forward([SeqBatch(0, toks[:7], 0)])[0], be.forward([SeqBatch(0, toks[7:12], 7)])[0]]
    for i in range(12, 20):
        got.append(be.forward([SeqBatch(0, toks[i : i + 1], i)])[0])
    close(np.stack(got), full[[6, 11, *range(12, 20)]])


def test_batch_entries_are_independent(model_path) -> None:
    """Continuous batching: a mixed batch (one prefill, one decode) returns what each
    entry returns alone, and sequences never see each other's cache."""
    be = open_numpy(model_path("tiny", "Q8_0"), n_seq=3)
    a, b = prompt(9, seed=1), prompt(5, seed=2)
    alone_a = be.forward_all_logits(a, seq_id=2)[-1]
    alone_b = be.forward_all_logits(b, seq_id=2)[-1]
    be.forward([SeqBatch(1, b[:4], 0)])
    out = be.forward([SeqBatch(0, a, 0), SeqBatch(1, b[4:], 4)])  # [2, n_vocab]
    close(out[0], alone_a)
    close(out[1], alone_b)


def test_truncating_a_sequence_needs_no_call(model_path) -> None:
    """Prompt-cache reuse: restarting at a shorter pos0 overwrites the old tail."""
    be = open_numpy(model_path("tiny-qwen3", "Q8_0"))
    common, old_tail, new_tail = prompt(6, 3), prompt(4, 4), prompt(3, 5)
    be.forward([SeqBatch(0, np.concatenate([common, old_tail]), 0)])
    got = be.forward([SeqBatch(0, new_tail, 6)])[0]
    want = be.forward_all_logits(np.concatenate([common, new_tail]), seq_id=1)[-1]
    close(got, want)


def test_attend_matches_a_naive_loop() -> None:
    rng = np.random.default_rng(0)
    n, pos0, n_head, n_kv, hd = 3, 4, 6, 2, 8
    q = rng.normal(size=(n, n_head, hd)).astype(np.float32)
    k = rng.normal(size=(pos0 + n, n_kv, hd)).astype(np.float32)
    v = rng.normal(size=(pos0 + n, n_kv, hd)).astype(np.float32)
    got = attend(q, k, v, pos0)
    want = np.zeros_like(got)
    for i in range(n):
        for h in range(n_head):
            kv = h // (n_head // n_kv)
            s = np.array([q[i, h] @ k[t, kv] for t in range(pos0 + i + 1)]) / np.sqrt(hd)
            p = np.exp(s - s.max())
            p /= p.sum()
            want[i, h] = sum(p[t] * v[t, kv] for t in range(pos0 + i + 1))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_long_prompts_attend_in_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Blocking the query rows (to bound score memory) changes nothing."""
    rng = np.random.default_rng(3)
    n, pos0, n_head, n_kv, hd = 37, 5, 4, 2, 8
    q = rng.normal(size=(n, n_head, hd)).astype(np.float32)
    k = rng.normal(size=(pos0 + n, n_kv, hd)).astype(np.float32)
    v = rng.normal(size=(pos0 + n, n_kv, hd)).astype(np.float32)
    whole = attend(q, k, v, pos0)
    monkeypatch.setattr(reference, "ATTN_BLOCK_SCORES", n_head * (pos0 + n) * 4)  # 4 rows
    np.testing.assert_allclose(attend(q, k, v, pos0), whole, rtol=1e-6, atol=1e-6)


def test_rope_modes_differ_only_by_the_llama_permutation(model_path) -> None:
    """Adjacent-pair RoPE on an interleaved head equals half-split RoPE on the plain
    head: the reason llama GGUFs store Q/K rows permuted."""
    cfg = load_gguf(model_path("tiny", "Q8_0")).config
    cos, sin = rope_tables(cfg, 16)
    rng = np.random.default_rng(1)
    x = rng.normal(size=(16, 3, cfg.head_dim)).astype(np.float32)  # [n, heads, hd]
    half = cfg.head_dim // 2
    inter = np.empty_like(x)
    inter[..., 0::2], inter[..., 1::2] = x[..., :half], x[..., half:]
    neox = apply_rope(x, cos, sin, "neox")
    normal = apply_rope(inter, cos, sin, "normal")
    np.testing.assert_array_equal(normal[..., 0::2], neox[..., :half])
    np.testing.assert_array_equal(normal[..., 1::2], neox[..., half:])
    np.testing.assert_allclose(apply_rope(x, cos, sin, "neox")[0], x[0])  # position 0
    np.testing.assert_allclose(np.linalg.norm(neox, axis=-1), np.linalg.norm(x, axis=-1), rtol=1e-5)


def test_rope_scores_depend_on_relative_position(model_path) -> None:
    cfg = load_gguf(model_path("tiny-qwen3", "Q8_0")).config
    cos, sin = rope_tables(cfg, 40)
    rng = np.random.default_rng(2)
    q = np.repeat(rng.normal(size=(1, 1, cfg.head_dim)), 40, axis=0).astype(np.float32)
    k = np.repeat(rng.normal(size=(1, 1, cfg.head_dim)), 40, axis=0).astype(np.float32)
    rq, rk = apply_rope(q, cos, sin, "neox"), apply_rope(k, cos, sin, "neox")
    assert float(rq[10, 0] @ rk[3, 0]) == pytest.approx(float(rq[37, 0] @ rk[30, 0]), rel=1e-4)


def test_rms_norm() -> None:
    x = np.array([[3.0, 4.0]], dtype=np.float32)
    np.testing.assert_allclose(rms_norm(x, np.array([1.0, 2.0]), 0.0), [[3 / 12.5**0.5, 8 / 12.5**0.5]])


def test_memory_and_progress(model_path) -> None:
    path = model_path("tiny", "Q8_0")
    model = load_gguf(path)
    seen: list[tuple[int, int]] = []
    be = NumpyBackend(model, n_ctx=32, n_seq=2, progress=lambda d, t: seen.append((d, t)))
    cfg = be.config
    assert seen[-1] == (model.weight_bytes(), model.weight_bytes())
    assert [d for d, _ in seen] == sorted(d for d, _ in seen)
    n_params = sum(t.n_elements for t in model.tensors.values())
    assert be.memory() == {
        "weights": 4 * n_params,
        "kv_cache": 2 * 2 * 2 * cfg.n_layer * 32 * cfg.kv_dim,  # K and V, f16 (the default), 2 slots
        "compute": 0,
        "scratch": 0,
    }


def test_release_weights_keeps_kv(model_path) -> None:
    be = open_numpy(model_path("tiny", "Q8_0"))
    toks = prompt(10)
    want = be.forward_all_logits(toks, seq_id=1)[-1]
    be.forward([SeqBatch(0, toks[:9], 0)])
    kv = be.memory()["kv_cache"]
    be.release(Level.WEIGHTS)
    be.release(Level.WEIGHTS)  # idempotent
    assert be.memory() == {"weights": 0, "kv_cache": kv, "compute": 0, "scratch": 0}
    assert be.host_memory()["weights"] > 0
    with pytest.raises(BackendError, match="restore first"):
        be.forward([SeqBatch(0, toks[9:], 9)])
    be.restore()
    be.restore()  # idempotent
    assert be.level is None and be.memory()["weights"] > 0
    close(be.forward([SeqBatch(0, toks[9:], 9)])[0], want)


def test_release_all_moves_kv_to_host_and_back(model_path) -> None:
    be = open_numpy(model_path("tiny-qwen2", "Q8_0"))
    toks = prompt(10)
    want = be.forward_all_logits(toks, seq_id=1)[-1]
    be.forward([SeqBatch(0, toks[:9], 0)])
    kv = be.memory()["kv_cache"]
    be.release(Level.WEIGHTS)
    be.release(Level.ALL)  # escalates
    assert be.memory() == {"weights": 0, "kv_cache": 0, "compute": 0, "scratch": 0}
    assert be.host_memory()["kv_cache"] == kv
    be.release(Level.WEIGHTS)  # shallower than what is released: nothing to do
    assert be.level is Level.ALL
    be.restore()
    assert be.host_memory() == {"weights": 0, "kv_cache": 0, "compute": 0, "scratch": 0}
    close(be.forward([SeqBatch(0, toks[9:], 9)])[0], want)  # the cache survived


def test_unload_reloads_from_the_file(model_path, tmp_path: Path) -> None:
    src = model_path("tiny-qwen3", "Q8_0")
    path = tmp_path / "m.gguf"
    path.write_bytes(src.read_bytes())
    be = open_numpy(path)
    toks = prompt(8)
    want = be.forward_all_logits(toks)
    be.release(Level.UNLOAD)
    assert be.memory() == {"weights": 0, "kv_cache": 0, "compute": 0, "scratch": 0}
    assert be.host_memory() == {"weights": 0, "kv_cache": 0, "compute": 0, "scratch": 0}
    be.restore()
    close(be.forward_all_logits(toks), want)
    # really from the file: once it is gone, a restore after an unload fails typed
    be.release(Level.UNLOAD)
    path.unlink()
    with pytest.raises(ModelLoadError, match="no such file"):
        be.restore()


def test_close_is_safe_everywhere(model_path) -> None:
    be = open_numpy(model_path("tiny", "Q8_0"))
    be.release(Level.ALL)
    be.close()
    be.close()
    assert be.memory() == {"weights": 0, "kv_cache": 0, "compute": 0, "scratch": 0}
    with pytest.raises(BackendError):
        be.forward([SeqBatch(0, prompt(2), 0)])


def test_bad_batches_raise_typed_errors(model_path) -> None:
    be = open_numpy(model_path("tiny", "Q8_0"), n_ctx=16)
    with pytest.raises(ContextOverflow):
        be.forward([SeqBatch(0, prompt(10), 8)])
    with pytest.raises(InvalidRequest, match="token id"):
        be.forward([SeqBatch(0, np.array([5, 1024], np.int32), 0)])
    with pytest.raises(InvalidRequest, match="twice"):
        be.forward([SeqBatch(0, prompt(2), 0), SeqBatch(0, prompt(2), 2)])
    with pytest.raises(InvalidRequest, match="seq_id"):
        be.forward([SeqBatch(2, prompt(2), 0)])
    with pytest.raises(InvalidRequest):
        be.forward([])
    with pytest.raises(InvalidRequest):
        be.forward([SeqBatch(0, np.zeros(0, np.int32), 0)])


def test_rope_freq_factors_divide_the_frequencies(model_path) -> None:
    """llama-3 style ``rope_freqs.weight``: each factor divides one frequency."""
    cfg = load_gguf(model_path("tiny", "Q8_0")).config
    factors = np.full(cfg.head_dim // 2, 2.0, np.float32)
    cos2, sin2 = rope_tables(cfg, 16, factors)
    cos1, sin1 = rope_tables(cfg, 8)
    np.testing.assert_allclose(cos2[0::2], cos1, atol=1e-6)
    np.testing.assert_allclose(sin2[0::2], sin1, atol=1e-6)

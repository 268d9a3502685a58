"""The mixture-of-experts kernels against the numpy reference's ops, on lavapipe:
routing (softmax, top-k, renormalised weights), expert matvecs that read their ids
from the routing buffer (every weight type), the prefill path's grouping of a chunk's
pairs by expert and its tiled expert products (every weight type), the weighted
combine, and the prefill lowering against the numpy backend."""

from __future__ import annotations

import attrs
import numpy as np
import pytest

from test_vulkan_ops import QTYPES, Env, make_weights, open_env
from trio_llm.engine.backend import SeqBatch
from trio_llm.engine.reference import NumpyBackend, _moe_op
from trio_llm.graph import Graph
from trio_llm.model.gguf import load_gguf
from trio_llm.vulkan.backend import VulkanBackend
from trio_llm.vulkan.graph import Barrier, Dispatch
from trio_llm.vulkan.ops import (
    MOE_BN,
    MOE_PERM_OFF,
    Ops,
    moe_map_words,
    moe_max_tiles,
    moe_tiles_off,
)

pytestmark = pytest.mark.vulkan


env = pytest.fixture(scope="module", name="env")(open_env)


def _topk_node(n_expert: int, k: int, norm: bool, scale: float):  # type: ignore[no-untyped-def]
    g = Graph(shapes={"r": (n_expert, 8)})
    x = g.get_rows(g.weight("r"), g.tokens())
    g.moe_topk(g.linear(x, g.weight("r"), "logits"), k, "topk", norm=norm, scale=scale)
    return g.nodes[-1]


@pytest.mark.parametrize(("n_expert", "k", "norm", "scale"), [(16, 4, True, 1.0), (130, 8, True, 2.5),
                                                              (40, 3, False, 1.0)])
def test_moe_topk_routes_like_numpy(env: Env, n_expert: int, k: int, norm: bool, scale: float) -> None:
    n_tok = 5
    logits = np.random.default_rng(n_expert).standard_normal((n_tok, n_expert)).astype(np.float32) * 3
    want = _moe_op(_topk_node(n_expert, k, norm, scale), [logits])  # [T, 2k]
    x, y, st = env.put(logits), env.zeros(n_tok * 2 * k), env.step([0] * n_tok)
    env.run([env.ops.moe_topk(x, y, st, n_expert=n_expert, k=k, x_stride=n_expert, y_stride=2 * k, cap=8,
                              norm=norm, scale=scale)])
    got = env.get(y).reshape(n_tok, 2 * k)
    np.testing.assert_array_equal(got[:, :k], want[:, :k])  # the same experts, best first
    np.testing.assert_allclose(got[:, k:], want[:, k:], rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("qtype", QTYPES)
def test_moe_matvec_reads_expert_ids_from_the_routing(env: Env, qtype: str) -> None:
    n_exp, rows, cols, n_tok, k = 5, 70, 512, 3, 2
    raw, ref = make_weights(qtype, n_exp * rows, cols, seed=7)  # [E * rows, ...] = the 3-D tensor
    ref = ref.reshape(n_exp, rows, cols)
    rng = np.random.default_rng(8)
    ids = np.array([[4, 0], [2, 2], [1, 3]])
    routes = np.concatenate([ids.astype(np.float32), rng.random((n_tok, k), np.float32)], axis=1)
    x1 = rng.standard_normal((n_tok, cols)).astype(np.float32)  # one input per token
    x2 = rng.standard_normal((n_tok, k, cols)).astype(np.float32)  # one per chosen expert
    w, r, st = env.put(raw), env.put(routes), env.step([0] * n_tok)
    y1, y2 = env.zeros(n_tok * k * rows), env.zeros(n_tok * k * rows)
    kw = dict(n_in=cols, n_rows=rows, y_stride=k * rows, k=k, cap=4)
    env.run([
        env.ops.moe_matvec(qtype, w, env.put(x1), y1, st, r, x_stride=cols, x_pair=0, **kw),  # type: ignore[arg-type]
        env.ops.moe_matvec(qtype, w, env.put(x2), y2, st, r, x_stride=k * cols, x_pair=cols, **kw),  # type: ignore[arg-type]
    ])
    want1 = np.einsum("tkoi,ti->tko", ref[ids], x1)
    want2 = np.einsum("tkoi,tki->tko", ref[ids], x2)
    for got, want in ((y1, want1), (y2, want2)):
        scale = np.abs(want).max()
        np.testing.assert_allclose(env.get(got).reshape(n_tok, k, rows), want, atol=2e-5 * scale, rtol=0)


def test_moe_combine_weights_the_experts(env: Env) -> None:
    n_tok, k, n = 3, 4, 300
    rng = np.random.default_rng(9)
    ys = rng.standard_normal((n_tok, k, n)).astype(np.float32)
    routes = np.concatenate([np.zeros((n_tok, k), np.float32), rng.random((n_tok, k), np.float32)], axis=1)
    out, st = env.zeros(n_tok * n), env.step([0] * n_tok)
    env.run([env.ops.moe_combine(env.put(ys), env.put(routes), out, st, n=n, k=k, y_stride=n, cap=4)])
    want = np.einsum("tkd,tk->td", ys, routes[:, k:])
    np.testing.assert_allclose(env.get(out).reshape(n_tok, n), want, rtol=1e-5, atol=1e-6)


def _routing(n_tok: int, n_exp: int, k: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(ids [T, k], routes [T, 2k]): expert 0 chosen by every token, the last by none,
    the others at random (k distinct per token, as top-k gives)."""
    rng = np.random.default_rng(seed)
    ids = np.stack([np.concatenate([[0], rng.choice(np.arange(1, n_exp - 1), k - 1, replace=False)])
                    for _ in range(n_tok)])
    routes = np.concatenate([ids.astype(np.float32), rng.random((n_tok, k), np.float32)], axis=1)
    return ids, routes


@pytest.mark.parametrize(("n_tok", "n_exp", "k"), [(45, 9, 4), (1, 5, 2), (100, 130, 8)])
def test_moe_group_permutes_the_pairs_by_expert_into_tiles(env: Env, n_tok: int, n_exp: int, k: int) -> None:
    cap = 128
    ids, routes = _routing(n_tok, n_exp, k, seed=n_tok)
    m, st = env.zeros(moe_map_words(n_exp, k, cap), np.uint32), env.step([0] * n_tok)
    env.run([env.ops.moe_group(env.put(routes), m, st, n_expert=n_exp, k=k, cap=cap)])
    words = env.get(m, np.uint32)
    perm = words[MOE_PERM_OFF : MOE_PERM_OFF + n_tok * k]
    assert sorted(perm.tolist()) == list(range(n_tok * k))
    flat = ids.reshape(-1)
    counts = np.bincount(flat, minlength=n_exp)
    want_tiles = [(e, s) for e in range(n_exp) for s in range(0, counts[e], MOE_BN)]
    n_tiles = int(words[0])
    assert n_tiles == len(want_tiles) <= moe_max_tiles(n_exp, k, cap)
    tiles = words[moe_tiles_off(k, cap) :][: 2 * n_tiles].reshape(-1, 2)
    starts = np.concatenate([[0], np.cumsum(counts)])
    for (start, en), (e, s) in zip(tiles, want_tiles, strict=True):
        n = min(MOE_BN, counts[e] - s)
        assert (int(en) >> 8, int(en) & 0xFF, int(start)) == (e, n, starts[e] + s)
        assert (flat[perm[start : start + n]] == e).all()


@pytest.mark.parametrize("qtype", QTYPES)
def test_moe_matmul_equals_the_per_token_products(env: Env, qtype: str) -> None:
    """Tokens grouped by expert (45 tokens: tiles not full, an expert in every token,
    one in none) give each (token, expert) pair's product, for one input per token
    (gate, up) and one per pair (down)."""
    n_exp, rows, cols, n_tok, k, cap = 9, 70, 512, 45, 4, 64
    raw, ref = make_weights(qtype, n_exp * rows, cols, seed=11)
    ref = ref.reshape(n_exp, rows, cols)
    ids, routes = _routing(n_tok, n_exp, k, seed=12)
    rng = np.random.default_rng(13)
    x1 = rng.standard_normal((n_tok, cols)).astype(np.float32)
    x2 = rng.standard_normal((n_tok, k, cols)).astype(np.float32)
    w, st = env.put(raw), env.step([0] * n_tok)
    m = env.zeros(moe_map_words(n_exp, k, cap), np.uint32)
    y1, y2 = env.zeros(n_tok * k * rows), env.zeros(n_tok * k * rows)
    kw = dict(n_in=cols, n_rows=rows, y_stride=k * rows, k=k, n_expert=n_exp, cap=cap)
    env.run([
        env.ops.moe_group(env.put(routes), m, st, n_expert=n_exp, k=k, cap=cap),
        Barrier(),
        env.ops.moe_matmul(qtype, w, env.put(x1), y1, st, m, x_stride=cols, x_pair=0, **kw),  # type: ignore[arg-type]
        env.ops.moe_matmul(qtype, w, env.put(x2), y2, st, m, x_stride=k * cols, x_pair=cols, **kw),  # type: ignore[arg-type]
    ])
    want1 = np.einsum("tkoi,ti->tko", ref[ids], x1)
    want2 = np.einsum("tkoi,tki->tko", ref[ids], x2)
    for got, want in ((y1, want1), (y2, want2)):
        scale = np.abs(want).max()
        np.testing.assert_allclose(env.get(got).reshape(n_tok, k, rows), want, atol=2e-5 * scale, rtol=0)


def _kernels(backend: VulkanBackend, bucket: int, ops: Ops | None = None) -> set[str]:
    return {op.kernel.name for op in backend.lowered(bucket, ops) if isinstance(op, Dispatch)}


@pytest.mark.parametrize(("preset", "quant"), [("tiny-qwen3moe", "Q4_K_M"), ("tiny-qwen35moe", "Q8_0")])
def test_prefill_groups_tokens_by_expert_and_equals_numpy(model_path, preset: str, quant: str) -> None:  # type: ignore[no-untyped-def]
    """A prefill chunk (45 tokens: not a multiple of the tiles) runs the grouped expert
    products, decode keeps moe_matvec, and both paths give numpy's logits (the grouped
    ones also the per-pair path's), for the first chunk and a continuing one; so does
    the cooperative-matrix form's lowering, emulated, within its f16 rounding."""
    model = load_gguf(model_path(preset, quant))
    tokens = np.random.default_rng(3).integers(1, model.config.n_vocab, 60).astype(np.int32)
    chunks = [SeqBatch(0, tokens[:45], 0), SeqBatch(0, tokens[45:], 45)]
    ref = NumpyBackend(model, n_ctx=64, n_seq=1)
    grouped, per_pair, cm = (VulkanBackend(model, n_ctx=64, n_seq=1) for _ in range(3))
    per_pair._ops.moe_grouped = False
    cm._ops.moe_cm_emulate = True  # moe_matmul_cm's f16 tiles, its products by plain lanes
    try:
        assert {"moe_group", "moe_matmul"} <= _kernels(grouped, 64) and "moe_matvec" not in _kernels(grouped, 64)
        assert "moe_matvec" in _kernels(grouped, 8) and "moe_matmul" not in _kernels(grouped, 8)
        assert "moe_matmul" not in _kernels(per_pair, 64)
        # from 8 pairs per expert on average (16 experts, k 4: bucket 32), unless told otherwise
        assert "moe_matmul" in _kernels(grouped, 32) and "moe_matmul" not in _kernels(grouped, 16)
        assert "moe_matmul" not in _kernels(grouped, 64, attrs.evolve(grouped._ops, moe_grouped_min=17))
        assert "moe_matmul_cm" in _kernels(cm, 64) and "moe_matmul" not in _kernels(cm, 64)
        for chunk in chunks:
            want = ref.forward([chunk])
            scale = float(np.abs(want).max())
            got = grouped.forward([chunk])
            assert float(np.abs(got - want).max()) <= 2e-3 * scale
            np.testing.assert_allclose(got, per_pair.forward([chunk]), rtol=0, atol=1e-4 * scale)
            assert float(np.abs(cm.forward([chunk]) - want).max()) <= 5e-3 * scale
    finally:
        cm.close()
        per_pair.close()
        grouped.close()
        ref.close()


def _f16(a: np.ndarray) -> np.ndarray:
    return a.astype(np.float16).astype(np.float32)


def _moe_cm_case(env: Env, qtype: str, ops: Ops, emulate: bool) -> None:
    """moe_matmul_cm against numpy over f16-rounded weights and inputs (its tiles)."""
    n_exp, rows, cols, n_tok, k, cap = 9, 70, 512, 45, 4, 64
    raw, ref = make_weights(qtype, n_exp * rows, cols, seed=21)
    ref = _f16(ref).reshape(n_exp, rows, cols)
    ids, routes = _routing(n_tok, n_exp, k, seed=22)
    rng = np.random.default_rng(23)
    x1 = rng.standard_normal((n_tok, cols)).astype(np.float32)
    x2 = rng.standard_normal((n_tok, k, cols)).astype(np.float32)
    w, st = env.put(raw), env.step([0] * n_tok)
    m = env.zeros(moe_map_words(n_exp, k, cap), np.uint32)
    y1, y2 = env.zeros(n_tok * k * rows), env.zeros(n_tok * k * rows)
    kw = dict(n_in=cols, n_rows=rows, y_stride=k * rows, k=k, n_expert=n_exp, cap=cap, emulate_cm=emulate)
    d1 = ops.moe_matmul(qtype, w, env.put(x1), y1, st, m, x_stride=cols, x_pair=0, **kw)  # type: ignore[arg-type]
    d2 = ops.moe_matmul(qtype, w, env.put(x2), y2, st, m, x_stride=k * cols, x_pair=cols, **kw)  # type: ignore[arg-type]
    assert d1.kernel.name == "moe_matmul_cm"
    env.run([ops.moe_group(env.put(routes), m, st, n_expert=n_exp, k=k, cap=cap), Barrier(), d1, d2])
    want1 = np.einsum("tkoi,ti->tko", ref[ids], _f16(x1))
    want2 = np.einsum("tkoi,tki->tko", ref[ids], _f16(x2))
    for got, want in ((y1, want1), (y2, want2)):
        scale = np.abs(want).max()
        np.testing.assert_allclose(env.get(got).reshape(n_tok, k, rows), want, atol=1e-4 * scale, rtol=0)


@pytest.mark.parametrize("qtype", ["F16", "Q8_0", "Q4_K", "Q6_K"])
def test_moe_matmul_cm_emulated_equals_numpy_over_f16_tiles(env: Env, qtype: str) -> None:
    """The cooperative-matrix kernel's gather, tiles and stores, its products done by
    plain lanes (lavapipe has no cooperative matrices)."""
    _moe_cm_case(env, qtype, env.ops, emulate=True)


@pytest.mark.parametrize("qtype", ["F16", "Q8_0", "Q4_K", "Q6_K", "Q5_K", "Q3_K", "IQ4_XS"])
def test_moe_matmul_cm_equals_numpy_over_f16_tiles(env: Env, qtype: str) -> None:
    """The cooperative-matrix kernel itself (off by default, TRIO_LLM_MOE_CM=1): runs
    only where the device has them (the H200: bash bench/h200.sh verify)."""
    if not (env.device.coopmat and env.ops.subgroup in (32, 64)):
        pytest.skip("the device has no 16x16x16 f16 cooperative matrices with subgroups of 32 or 64")
    _moe_cm_case(env, qtype, attrs.evolve(env.ops, coopmat=True, moe_cm=True), emulate=False)

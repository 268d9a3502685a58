"""The mixture-of-experts kernels against the numpy reference's ops, on lavapipe:
routing (softmax, top-k, renormalised weights), expert matvecs that read their ids
from the routing buffer (every weight type), and the weighted combine."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

from test_vulkan_ops import QTYPES, Env, make_weights
from trio_llm.engine.reference import _moe_op
from trio_llm.graph import Graph
from trio_llm.vulkan.device import shared_device
from trio_llm.vulkan.kernels import KernelCache
from trio_llm.vulkan.memory import Allocator
from trio_llm.vulkan.ops import Ops

pytestmark = pytest.mark.vulkan


@pytest.fixture(scope="module")
def env() -> Iterator[Env]:
    device = shared_device()
    alloc = Allocator(device)
    kernels = KernelCache(device)
    yield Env(device, alloc, Ops(kernels, subgroup=device.limits.subgroup_size))
    kernels.close()
    alloc.free_all()


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

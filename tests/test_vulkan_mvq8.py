"""Decode matvecs on int8 activations (TRIO_LLM_MATVEC_Q8=1): quantize_q8.comp against a
numpy q8_1 quantizer, matvec.comp's X_Q8 form against the product of the same int8
activations (tight) and of the f32 ones (loose), and greedy decode through the backend.

The numpy quantizer is llama.cpp's q8_1 (ggml-cuda/quantize.cu ``quantize_q8_1``: per
32 values ``d = amax / 127``, ``q = roundf(x / d)``; ggml-quants.c
``quantize_row_q8_1_ref`` stores the block sum as ``d * sum(q)``), with d and s kept
in f32 (quantize_q8.comp says why).
"""

from __future__ import annotations

import numpy as np
import pytest
from test_vulkan_ops import Env, make_weights, np_rope
from test_vulkan_ops import env as env  # noqa: F401  (the module's device fixture)

from trio_llm.vulkan.ops import ROPE_NORMAL, Ops
from trio_llm.vulkan.shaders import Q8_MATVEC

pytestmark = pytest.mark.vulkan


def np_q8_1(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """x [ncol, n] f32 -> (q int8 [ncol, n], d f32 [ncol, n/32], s f32 [ncol, n/32])."""
    b = x.astype(np.float32).reshape(x.shape[0], -1, 32)
    amax = np.abs(b).max(axis=-1)
    d = (amax / np.float32(127)).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        v = np.where(d[..., None] == 0, np.float32(0), b / d[..., None]).astype(np.float32)
    q = (np.sign(v) * np.floor(np.abs(v).astype(np.float64) + 0.5)).astype(np.int8)  # roundf: ties away
    s = (d * q.astype(np.float32).sum(axis=-1)).astype(np.float32)
    return q.reshape(x.shape), d, s


def q8_views(env: Env, ops: Ops, x: np.ndarray, cap: int, n_live: int) -> tuple[object, object, object]:
    """x [cap, n] uploaded, its quantize dispatch (``n_live`` columns live) and the views."""
    n = x.shape[1]
    xv = env.put(x)
    q = env.put(np.full(cap * n // 4, 0x5A5A5A5A, np.uint32))  # garbage past the live columns
    ds = env.put(np.full(cap * n // 32 * 2, 9.0, np.float32))
    st = env.step([0] * n_live)
    return ops.quantize_q8(xv, q, ds, st, n_in=n, x_stride=n, cap=cap), q, ds


def test_quantize_matches_numpy_bit_for_bit(env: Env) -> None:
    """Ties of x / d at .5 (values built to land on them), zero blocks, huge and tiny
    values, and columns past the live count left alone."""
    rng = np.random.default_rng(1)
    cap, n, live = 6, 1024, 5
    x = (rng.standard_normal((cap, n)) * rng.uniform(1e-3, 50, (cap, 1))).astype(np.float32)
    x[0, :32] = 0.0  # a zero block: d = 0, q = 0
    # d = 127/16 / 127 = 1/16 exactly, so x / d lands on the ties k + 0.5 (roundf: away from 0)
    x[1, 32:64] = np.concatenate([[127.0], np.arange(-15, 16) + 0.5]).astype(np.float32) / 16
    x[2, :32] = np.float32(1e36) * np.sign(rng.standard_normal(32)).astype(np.float32)
    x[2, 32:64] = np.float32(1e-38)
    d_op, q, ds = q8_views(env, env.ops, x, cap, live)
    env.run([d_op])
    wq, wd, ws = np_q8_1(x[:live])
    got_q = env.get(q, np.int8).reshape(cap, n)[:live]
    got = env.get(ds).reshape(cap, n // 32, 2)
    # d and s within an ulp: Vulkan lets a device's f32 division be 2.5 ulp off (lavapipe's
    # is 1 off at times); the int8 values are exact but where x / d is within a few ulp of
    # a tie at .5 (none is, on lavapipe)
    np.testing.assert_array_max_ulp(got[:live, :, 0], wd, maxulp=1)
    np.testing.assert_array_max_ulp(got[:live, :, 1], ws, maxulp=2)
    v = np.abs(x[:live].reshape(live, -1, 32).astype(np.float64) / np.where(wd == 0, 1, wd)[..., None])
    near = ((np.abs(v - np.floor(v) - 0.5) < 1e-6 * np.maximum(v, 1)) & (v != np.floor(v) + 0.5)).reshape(live, n)
    ties = np.arange(-15, 16) + 0.5
    np.testing.assert_array_equal(got_q[1, 33:64], np.sign(ties) * (np.abs(ties) + 0.5))
    off = got_q != wq
    assert not (off & ~near).any(), np.argwhere(off & ~near)[:5]
    assert (np.abs(got_q.astype(int) - wq) <= 1).all()
    assert off.sum() == 0 or env.device.name.find("llvmpipe") < 0
    assert (env.get(q, np.uint32).reshape(cap, -1)[live:] == 0x5A5A5A5A).all()
    assert (got[live:] == 9.0).all()


def np_product_q8(wq: np.ndarray, d: np.ndarray, ref: np.ndarray) -> np.ndarray:
    """W . x with x the dequantized int8 activations, in f64: [ncol, rows]."""
    x = wq.astype(np.float64).reshape(wq.shape[0], -1, 32) * d[..., None].astype(np.float64)
    return x.reshape(wq.shape) @ ref.T.astype(np.float64)


@pytest.mark.parametrize("int_dot", [True, False])
@pytest.mark.parametrize("qtype", Q8_MATVEC)
def test_matvec_q8_columns_and_residual(env: Env, qtype: str, int_dot: bool) -> None:
    """1..8 live columns of a graph for 8 (MAXC 8), plain and with the residual add,
    both ways of multiplying the int8 words (the device's integer dot products where it
    has them, and the plain int math)."""
    if int_dot and not env.device.int_dot:
        pytest.skip("the device reports no integer dot products")
    ops = Ops(env.ops.kernels, subgroup=env.ops.subgroup, int_dot=int_dot)
    rows, n, cap = 70, 512, 8
    raw, ref = make_weights(qtype, rows, n, seed=3)
    rng = np.random.default_rng(4)
    x = rng.standard_normal((cap, n)).astype(np.float32)
    resid = rng.standard_normal((cap, rows)).astype(np.float32)
    w = env.put(raw)
    wq, wd, _ = np_q8_1(x)
    exact = np_product_q8(wq, wd, ref)
    f32 = x.astype(np.float64) @ ref.T.astype(np.float64)
    scale = np.abs(exact).max()
    for live in (1, 3, 8):
        qd, q, ds = q8_views(env, ops, x, cap, live)
        st = env.step([0] * live)
        y = env.put(np.full(cap * rows, 7.0, np.float32))
        y2 = env.put(resid)
        kw = dict(n_in=n, n_rows=rows, x_stride=n, y_stride=rows, maxc=cap, xd=ds)
        assert ("INT_DOT" in ops._q8_in(ds, None)[0]) is int_dot
        env.run([qd, ops.matvec(qtype, w, q, y, st, **kw), ops.matvec(qtype, w, q, y2, st, add=True, **kw)])  # type: ignore[arg-type]
        got = env.get(y).reshape(cap, rows)
        # the int8 product to f32 rounding (lavapipe: 2e-7 of the largest), the f32 one to
        # the activations' rounding (3e-3 .. 7e-3)
        np.testing.assert_allclose(got[:live], exact[:live], atol=1e-6 * scale, rtol=0)
        np.testing.assert_allclose(got[:live], f32[:live], atol=2e-2 * scale, rtol=0)
        assert (got[live:] == 7.0).all()
        np.testing.assert_allclose(env.get(y2).reshape(cap, rows)[:live], exact[:live] + resid[:live],
                                   atol=1e-6 * scale, rtol=0)


@pytest.mark.parametrize("qtype", Q8_MATVEC)
def test_matvec_q8_gate_up_and_rope(env: Env, qtype: str) -> None:
    """GATE_UP (silu(G x) * (U x)) and ROPE_OUT (in place, into an f32 cache) on the
    int8 activations, against the same forms of the numpy product of those."""
    rng = np.random.default_rng(6)
    ncol, heads, hd, n, n_ctx = 3, 4, 16, 512, 40
    rows = heads * hd
    raw, ref = make_weights(qtype, 2 * rows, n, seed=7)
    x = rng.standard_normal((ncol, n)).astype(np.float32)
    pos, seq = np.array([0, 39, 7]), np.array([0, 1, 1])
    factors = np.linspace(1.0, 4.0, hd // 2).astype(np.float32)
    qd, q, ds = q8_views(env, env.ops, x, ncol, ncol)
    st = env.step([0] * ncol, pos, seq)
    w, fv = env.put(raw), env.put(factors)
    wrope = env.put(raw[:rows])
    g, yq, kc = env.zeros(ncol * rows), env.zeros(ncol * rows), env.zeros(2 * n_ctx * rows)
    kw = dict(n_in=n, n_rows=rows, x_stride=n, y_stride=rows, head_dim=hd, theta=10000.0, maxc=ncol, xd=ds)
    env.run([
        qd,
        env.ops.matvec_gate_up(qtype, w, q, g, st, n_in=n, n_rows=rows, row_a=0, row_b=rows, x_stride=n,
                               y_stride=rows, maxc=ncol, xd=ds),
        env.ops.matvec_rope(qtype, wrope, q, yq, st, fv, rope=True, **kw),  # type: ignore[arg-type]
        env.ops.matvec_rope(qtype, wrope, q, kc, st, fv, rope=True, to_cache=True, n_ctx=n_ctx, **kw),  # type: ignore[arg-type]
    ])
    wq, wd, _ = np_q8_1(x)
    prod = np_product_q8(wq, wd, ref)  # [ncol, 2 rows]
    a, b = prod[:, :rows], prod[:, rows:]
    glu = a / (1 + np.exp(-np.clip(a, -80, 80))) * b
    np.testing.assert_allclose(env.get(g).reshape(ncol, rows), glu, atol=3e-5 * np.abs(glu).max(), rtol=0)
    want = np_rope(a.reshape(ncol, heads, hd), pos, 10000.0, ROPE_NORMAL, factors).reshape(ncol, rows)
    tol = 3e-5 * np.abs(a).max()
    np.testing.assert_allclose(env.get(yq).reshape(ncol, rows), want, atol=tol, rtol=0)
    k = env.get(kc).reshape(2, n_ctx, rows)
    for t in range(ncol):
        np.testing.assert_allclose(k[seq[t], pos[t]], want[t], atol=tol, rtol=0)

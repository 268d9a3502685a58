"""Decode matvecs on int8 activations (TRIO_LLM_MATVEC_Q8=1): quantize_q8.comp against a
numpy q8_1 quantizer, matvec.comp's X_Q8 form against the product of the same int8
activations (tight) and of the f32 ones (loose), and greedy decode through the backend.

The numpy quantizer is llama.cpp's q8_1 (ggml-cuda/quantize.cu ``quantize_q8_1``: per
32 values ``d = amax / 127``, ``q = roundf(x / d)``; ggml-quants.c
``quantize_row_q8_1_ref`` stores the block sum as ``d * sum(q)``), with d and s kept
in f32 (quantize_q8.comp says why).
"""

from __future__ import annotations

import struct
from typing import Any

import numpy as np
import pytest

from test_vulkan_model import F32_KV, N_CTX, PROMPTS
from test_vulkan_ops import Env, make_weights, np_rope, open_env
from trio_llm.engine.backend import SeqBatch
from trio_llm.engine.reference import NumpyBackend
from trio_llm.errors import ConfigError
from trio_llm.model.gguf import load_gguf
from trio_llm.vulkan.backend import VulkanBackend
from trio_llm.vulkan.graph import Barrier, Dispatch
from trio_llm.vulkan.ops import ROPE_NORMAL, Ops, _unroll_env
from trio_llm.vulkan.shaders import (
    FULL_UNROLL,
    GATE_UP,
    NORM_IN,
    Q8_MATVEC,
    ROPE_OUT,
    kv_defines,
    matvec_defines,
    spirv,
)

pytestmark = pytest.mark.vulkan

env = pytest.fixture(scope="module", name="env")(open_env)


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
    # x[2, 32:64] is subnormal: a device that flushes f32 denormals (the H200's driver does;
    # Vulkan allows it without shaderDenormPreserveFloat32) sees a zero block there: d = s = 0
    # and q = 0, the zero block's result, where lavapipe keeps numpy's d = 1e-38 / 127
    if got[2, 1, 0] == 0.0:
        wd, ws, wq = wd.copy(), ws.copy(), wq.copy()
        wd[2, 1] = ws[2, 1] = 0.0
        wq[2, 32:64] = 0
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


def test_quantize_with_the_norm(env: Env) -> None:
    """NORM_IN: the q8_1 blocks of RMSNorm(x) * g (rms_norm.comp's x * (1 / sqrt(mean(x^2)
    + eps)) * g), a work group per column, for rows shorter and longer than 1024 (64 and
    256 lanes): the scales within the rounding of the norm, an int8 value off by one
    only where that rounding crosses a half."""
    rng = np.random.default_rng(5)
    for n, cap, live in ((512, 4, 3), (2048, 2, 2)):
        x = (rng.standard_normal((cap, n)) * 3).astype(np.float32)
        g = rng.uniform(0.5, 1.5, n).astype(np.float32)
        xv, gv = env.put(x), env.put(g)
        q = env.put(np.full(cap * n // 4, 0x5A5A5A5A, np.uint32))
        ds = env.put(np.full(cap * n // 32 * 2, 9.0, np.float32))
        st = env.step([0] * live)
        env.run([env.ops.quantize_q8(xv, q, ds, st, n_in=n, x_stride=n, cap=cap, norm=gv, eps=1e-5)])
        xd = x[:live].astype(np.float64)
        y = (xd / np.sqrt((xd * xd).mean(axis=1, keepdims=True) + 1e-5) * g).astype(np.float32)
        wq, wd, _ = np_q8_1(y)
        got_q = env.get(q, np.int8).reshape(cap, n)
        got = env.get(ds).reshape(cap, n // 32, 2)
        np.testing.assert_allclose(got[:live, :, 0], wd, rtol=2e-6, atol=0)
        off = got_q[:live].astype(int) - wq
        assert np.abs(off).max() <= 1 and (off != 0).mean() < 1e-2, (off != 0).mean()
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
        # a barrier after the quantize: a GPU runs dispatches of one command buffer
        # concurrently (lavapipe one after another, which hid its absence)
        env.run([qd, Barrier(), ops.matvec(qtype, w, q, y, st, **kw),
                 ops.matvec(qtype, w, q, y2, st, add=True, **kw)])  # type: ignore[arg-type]
        got = env.get(y).reshape(cap, rows)
        # the int8 product to f32 rounding (lavapipe: 2e-7 of the largest), the f32 one to
        # the activations' rounding (3e-3 .. 7e-3)
        np.testing.assert_allclose(got[:live], exact[:live], atol=1e-6 * scale, rtol=0)
        np.testing.assert_allclose(got[:live], f32[:live], atol=2e-2 * scale, rtol=0)
        assert (got[live:] == 7.0).all()
        np.testing.assert_allclose(env.get(y2).reshape(cap, rows)[:live], exact[:live] + resid[:live],
                                   atol=1e-6 * scale, rtol=0)


@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K"])
def test_matvec_one_row_per_subgroup_at_8_columns(env: Env, qtype: str) -> None:
    """TRIO_LLM_MATVEC_RS8=1 (``Ops.matvec_rs8``): the plain matvec of 8 columns takes one
    row per subgroup (half the accumulators a lane; the H200 put the 16 of RS 2 in local
    memory) and gives the same sums as RS 2, on int8 activations and on f32 (F32 weights
    too); 4-column graphs keep RS 2."""
    rows, n, cap = 70, 512, 8
    rng = np.random.default_rng(5)
    x = rng.standard_normal((cap, n)).astype(np.float32)
    st = env.step([0] * cap)
    outs = {}
    for rs8 in (0, 1):
        ops = Ops(env.ops.kernels, subgroup=env.ops.subgroup, matvec_rs8=rs8)
        for wt in (qtype, "F32"):
            raw, ref = make_weights(wt, rows, n, seed=6)
            w, xv = env.put(raw), env.put(x)
            y = env.zeros(cap * rows)
            d = ops.matvec(wt, w, xv, y, st, n_in=n, n_rows=rows, x_stride=n, y_stride=rows, maxc=cap)
            assert d.kernel.local_size == ops.matvec_rows * ops.subgroup
            assert d.groups[0] * d.groups[1] * d.groups[2] >= -(-rows // (ops.matvec_rows * (rs8 or 2)))
            env.run([d])
            outs[rs8, wt, "f32"] = env.get(y).reshape(cap, rows)
            np.testing.assert_allclose(outs[rs8, wt, "f32"], x @ ref.T,
                                       atol=2e-5 * float(np.abs(x @ ref.T).max()), rtol=0)
        raw, ref = make_weights(qtype, rows, n, seed=6)
        w = env.put(raw)
        qd, q, ds = q8_views(env, ops, x, cap, cap)
        y = env.zeros(cap * rows)
        env.run([qd, Barrier(), ops.matvec(qtype, w, q, y, st, n_in=n, n_rows=rows, x_stride=n, y_stride=rows,
                                           maxc=cap, xd=ds)])
        outs[rs8, qtype, "q8"] = env.get(y).reshape(cap, rows)
        four = ops.matvec(qtype, w, q, y, st, n_in=n, n_rows=rows, x_stride=n, y_stride=rows, maxc=4, xd=ds)
        assert four.groups[0] * four.groups[1] * four.groups[2] == -(-rows // (ops.matvec_rows * 2))
    for key in (qtype, "F32"):
        np.testing.assert_allclose(outs[1, key, "f32"], outs[0, key, "f32"], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(outs[1, qtype, "q8"], outs[0, qtype, "q8"], rtol=1e-6, atol=1e-6)


def _function_variables(spv: bytes) -> int:
    """How many OpVariable (opcode 59) of storage class Function (7) a module declares:
    the arrays (and the odd scalar spirv-opt left in memory) a driver may keep in a
    thread's local memory."""
    words = struct.unpack(f"<{len(spv) // 4}I", spv)
    i, n = 5, 0  # past the header
    while i < len(words):
        count, op = words[i] >> 16, words[i] & 0xFFFF
        n += op == 59 and words[i + 3] == 7
        i += count
    return n


@pytest.mark.parametrize("qtype", ["F32", *Q8_MATVEC])
def test_matvec_unrolled_variants_keep_no_arrays(qtype: str) -> None:
    """``Ops.matvec_unroll`` (FIXED_MAXC, FIXED_RS, FULL_UNROLL): every form of matvec at
    8 columns, f32 and int8 activations, RS 1 and 2, compiles to SPIR-V without a single
    Function-storage variable, where the specialization-constant form keeps the
    accumulators (and more) as arrays for the driver to unroll or not."""
    forms: list[tuple[dict[str, object], tuple[int, ...]]] = [
        ({}, (1, 2)), (dict(GATE_UP), (2,)), ({**ROPE_OUT, **kv_defines(KV_TYPE=1)}, (2,)), (dict(NORM_IN), (1, 2))]
    for form, rss in forms:
        for x8 in ({}, {"X_Q8": 1, "INT_DOT": 1}, {"X_Q8": 1}):
            if x8 and (qtype == "F32" or "NORM_IN" in form):
                continue
            base = {**matvec_defines(qtype), **form, **x8}
            assert _function_variables(spirv("matvec", base)) >= 1
            for rs in rss:
                fixed = {**base, "FIXED_MAXC": "8u", "FIXED_RS": f"{rs}u", FULL_UNROLL: 1}
                assert _function_variables(spirv("matvec", fixed)) == 0, (base, rs)


def test_matvec_unroll_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    """TRIO_LLM_MATVEC_UNROLL: a comma list of the column counts 1, 2, 4, 8, 0 for none,
    unset or empty the default (8: issue 12's local memory); anything else is refused in
    one line."""
    monkeypatch.setenv("TRIO_LLM_MATVEC_UNROLL", "8, 2")
    assert _unroll_env() == {2, 8}
    monkeypatch.setenv("TRIO_LLM_MATVEC_UNROLL", "")
    assert _unroll_env() == {8}
    monkeypatch.delenv("TRIO_LLM_MATVEC_UNROLL")
    assert _unroll_env() == {8}
    monkeypatch.setenv("TRIO_LLM_MATVEC_UNROLL", "0")
    assert _unroll_env() == frozenset()
    for bad in ("3", "8,x"):
        monkeypatch.setenv("TRIO_LLM_MATVEC_UNROLL", bad)
        with pytest.raises(ConfigError, match="TRIO_LLM_MATVEC_UNROLL"):
            _unroll_env()


@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K", "Q8_0"])
def test_matvec_unrolled_same_sums(env: Env, qtype: str) -> None:
    """The unrolled variants (``Ops.matvec_unroll`` at 4 and 8 columns, with RS8 0 and 1)
    give the specialization-constant form's sums: plain on f32 and int8 activations (F32
    weights too), GATE_UP and ROPE_OUT into an f16 cache on int8, with 5 columns live of
    8 (the columns past the live count left alone)."""
    rows, n, cap, live, n_ctx, hd = 64, 512, 8, 5, 16, 16
    rng = np.random.default_rng(9)
    x = rng.standard_normal((cap, n)).astype(np.float32)
    st = env.step([0] * live, np.arange(live), np.zeros(live, np.int64))
    factors = env.put(np.ones(hd // 2, np.float32))
    outs: dict[tuple[object, ...], np.ndarray] = {}
    for unroll, rs8 in ((frozenset(), 0), (frozenset({4, 8}), 0), (frozenset({8}), 1)):
        ops = Ops(env.ops.kernels, subgroup=env.ops.subgroup, matvec_rs8=rs8, matvec_unroll=unroll)
        for maxc in (4, 8):
            for wt in (qtype, "F32"):
                raw, _ = make_weights(wt, rows, n, seed=10)
                w, xv, y = env.put(raw), env.put(x), env.put(np.full(cap * rows, 7.0, np.float32))
                kw0 = dict(n_in=n, n_rows=rows, x_stride=n, y_stride=rows, maxc=maxc)
                d = ops.matvec(wt, w, xv, y, st, **kw0)  # type: ignore[arg-type]
                plain = Ops(env.ops.kernels, subgroup=env.ops.subgroup, matvec_rs8=rs8, matvec_unroll=frozenset())
                assert (d.kernel is plain.matvec(wt, w, xv, y, st, **kw0).kernel) == (maxc not in unroll)  # type: ignore[arg-type]
                env.run([d])
                outs[unroll, rs8, maxc, wt, "f32"] = env.get(y)
            raw, _ = make_weights(qtype, 2 * rows, n, seed=10)
            w, wr = env.put(raw), env.put(raw[:rows])
            qd, q, ds = q8_views(env, ops, x, cap, live)
            y, g, kc = (env.put(np.full(cap * rows, 7.0, np.float32)), env.put(np.full(cap * rows, 7.0, np.float32)),
                        env.zeros(n_ctx * rows))
            kw = dict(n_in=n, n_rows=rows, x_stride=n, y_stride=rows, maxc=maxc, xd=ds)
            env.run([qd, Barrier(), ops.matvec(qtype, w, q, y, st, **kw),  # type: ignore[arg-type]
                     ops.matvec_gate_up(qtype, w, q, g, st, row_a=0, row_b=rows, **kw),  # type: ignore[arg-type]
                     ops.matvec_rope(qtype, wr, q, kc, st, factors, head_dim=hd, rope=True, theta=10000.0,
                                     to_cache=True, n_ctx=n_ctx, kv_type="f16", **kw)])  # type: ignore[arg-type]
            for name, view in (("q8", y), ("gate_up", g), ("rope", kc)):
                outs[unroll, rs8, maxc, qtype, name] = env.get(view)
    for (unroll, rs8, *rest), got in outs.items():
        want = outs[(frozenset(), 0, *rest)]
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * float(np.abs(want).max()),
                                   err_msg=f"unroll {sorted(unroll)} rs8 {rs8} {rest}")
        if rest[-1] != "rope":
            assert (got.reshape(cap, rows)[live:] == 7.0).all()


@pytest.mark.parametrize("qtype", ["Q4_K", "Q8_0"])
def test_matvec_split8_same_results(env: Env, qtype: str) -> None:
    """TRIO_LLM_MATVEC_SPLIT8 (``Ops.col_split``): an 8-column bucket as two 4-column
    dispatches, the second at COL0 = 4 on views 4 columns on, gives the single
    dispatch's results with 6 of 8 columns live (the second dispatch's 2 and its 2 dead
    ones): plain on f32 (F32 weights too) and int8 activations, GATE_UP, ROPE_OUT in
    place and into f16 and q8_0 caches at the step's own positions and sequences (which
    the second dispatch reads from column 4 on)."""
    rows, n, cap, live, n_ctx, hd = 64, 512, 8, 6, 24, 32
    rng = np.random.default_rng(11)
    x = rng.standard_normal((cap, n)).astype(np.float32)
    pos, seq = np.array([0, 5, 9, 3, 17, 2]), np.array([0, 1, 1, 0, 1, 0])
    st = env.step([0] * live, pos, seq)
    factors = env.put(np.linspace(1.0, 2.0, hd // 2).astype(np.float32))
    outs: dict[tuple[object, ...], np.ndarray] = {}
    for split in (False, True):
        ops = Ops(env.ops.kernels, subgroup=env.ops.subgroup, matvec_split8=split, matvec_unroll=frozenset())
        parts = ops.col_split(cap, x_stride=n, y_stride=rows, x8=True)
        assert parts == (((0, 4), (4, 4)) if split else ((0, 8),))
        for wt in (qtype, "F32"):
            raw, _ = make_weights(wt, rows, n, seed=12)
            w, xv, y = env.put(raw), env.put(x), env.put(np.full(cap * rows, 7.0, np.float32))
            env.run([ops.matvec(wt, w, xv, y, st, n_in=n, n_rows=rows, x_stride=n, y_stride=rows, maxc=mc, col0=c0)
                     for c0, mc in parts])
            outs[split, wt, "f32"] = env.get(y)
        raw, _ = make_weights(qtype, 2 * rows, n, seed=12)
        w, wr = env.put(raw), env.put(raw[:rows])
        qd, q, ds = q8_views(env, ops, x, cap, live)
        y, g, yr = (env.put(np.full(cap * rows, 7.0, np.float32)) for _ in range(3))
        kc16, kc8 = env.zeros(2 * n_ctx * rows // 2, np.uint32), env.zeros(2 * n_ctx * rows // 32 * 9, np.uint32)
        kw = dict(n_in=n, n_rows=rows, x_stride=n, y_stride=rows, xd=ds)
        rk = dict(head_dim=hd, rope=True, theta=10000.0, **kw)
        run: list[Any] = [qd, Barrier()]
        for c0, mc in parts:
            run += [ops.matvec(qtype, w, q, y, st, maxc=mc, col0=c0, **kw),  # type: ignore[arg-type]
                    ops.matvec_gate_up(qtype, w, q, g, st, row_a=0, row_b=rows, maxc=mc, col0=c0, **kw),  # type: ignore[arg-type]
                    ops.matvec_rope(qtype, wr, q, yr, st, factors, maxc=mc, col0=c0, **rk),  # type: ignore[arg-type]
                    ops.matvec_rope(qtype, wr, q, kc16, st, factors, to_cache=True, n_ctx=n_ctx, kv_type="f16",
                                    maxc=mc, col0=c0, **rk),  # type: ignore[arg-type]
                    ops.matvec_rope(qtype, wr, q, kc8, st, factors, to_cache=True, n_ctx=n_ctx, kv_type="q8_0",
                                    maxc=mc, col0=c0, **rk)]  # type: ignore[arg-type]
        env.run(run)
        for name, view in (("q8", y), ("gate_up", g), ("rope", yr)):
            outs[split, qtype, name] = env.get(view)
        outs[split, qtype, "f16 cache"] = env.get(kc16, np.uint32)
        outs[split, qtype, "q8_0 cache"] = env.get(kc8, np.uint32)
    for (split, *rest), got in outs.items():
        if not split:
            continue
        want = outs[(False, *rest)]
        if rest[-1].endswith("cache"):
            np.testing.assert_array_equal(got, want, err_msg=str(rest))
            assert got.any()
        else:
            np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6 * float(np.abs(want).max()), err_msg=str(rest))
            assert (got.reshape(cap, rows)[live:] == 7.0).all()


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
        Barrier(),
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


def q8_counts(vk: VulkanBackend, bucket: int) -> tuple[int, int, int, int, int]:
    """(quantize dispatches, of them with the norm, matvecs on int8 activations, matvecs
    on f32, rms_norm dispatches) of a bucket."""
    ops = [op for op in vk.lowered(bucket) if isinstance(op, Dispatch)]
    q8d = vk._act.bufs.get("q8d")
    quant = [op for op in ops if op.kernel.name == "quantize_q8"]
    mv = [op for op in ops if op.kernel.name == "matvec"]
    on = sum(any(v.buffer is q8d for v in op.views) for op in mv)
    return (len(quant), sum(len(op.views) == 5 for op in quant), on, len(mv) - on,
            sum(op.kernel.name == "rms_norm" for op in ops))


def forced_greedy(vk: VulkanBackend, ref: NumpyBackend, prompts: list[np.ndarray], n: int) -> tuple[float, int]:
    """Both backends fed numpy's greedy tokens for ``n`` steps: the largest logit
    difference relative to the largest logit, and how many steps' argmax were checked.
    Vulkan's argmax must be numpy's wherever numpy's best two logits are further apart
    than ``MARGIN`` of the largest (random tiny models have closer calls, which the int8
    rounding of the activations may turn either way)."""
    batch = [SeqBatch(i, p, 0) for i, p in enumerate(prompts)]
    pos = [len(p) for p in prompts]
    worst, checked = 0.0, 0
    for _ in range(n + 1):
        want, got = ref.forward(batch), vk.forward(batch)
        scale = float(np.abs(want).max())
        worst = max(worst, float(np.abs(got - want).max()) / scale)
        top = np.sort(want, axis=1)
        toks = [int(np.argmax(row)) for row in want]
        for row, t, margin in zip(got, toks, (top[:, -1] - top[:, -2]) / scale, strict=True):
            if margin > MARGIN:
                assert int(np.argmax(row)) == t
                checked += 1
        batch = [SeqBatch(i, np.array([t], np.int32), pos[i]) for i, t in enumerate(toks)]
        pos = [p + 1 for p in pos]
    return worst, checked


#: the bound of the logit difference (relative to the largest logit) and the top-two
#: margin from which the argmax must agree: measured on lavapipe, the tiny llama's
#: logits move by 0.6 % (the prefill, where only the head reads int8) to 3 % (decode,
#: every product) of the largest; a product on the wrong buffer moves them by the whole
#: scale
BOUND = 6e-2
MARGIN = 0.08
#: a mixture of experts' bound: the int8 rounding upstream of the router may flip a
#: close top-k call of a random tiny model, and then a whole expert's output differs
#: (the H200 measured 0.091 on tiny-qwen3moe, where lavapipe's order of sums stayed
#: under ``BOUND``); a wrong buffer still moves the logits by their whole scale
MOE_BOUND = 0.2


@pytest.mark.parametrize("quant", ["Q8_0", "Q4_K_M"])
def test_greedy_decode_on_int8_activations_follows_numpy(model_path, monkeypatch: pytest.MonkeyPatch,
                                                         quant: str) -> None:  # type: ignore[no-untyped-def]
    """TRIO_LLM_MATVEC_Q8=1 through the backend: llama (q/k/v on ROPE_OUT, gate/up on
    GATE_UP, o and down adding into the residual, the head), 2 and 4 sequences per decode
    step on numpy's greedy tokens, the logits within the int8 rounding of the
    activations (``BOUND``); one-column steps (below TRIO_LLM_MATVEC_Q8_MIN=2) keep f32."""
    monkeypatch.setenv("TRIO_LLM_MATVEC_Q8", "1")
    model = load_gguf(model_path("tiny", quant, sharp=True))
    ref = NumpyBackend(model, n_ctx=N_CTX, n_seq=4, **F32_KV)
    vk = VulkanBackend(model, n_ctx=N_CTX, n_seq=4, **F32_KV)
    try:
        assert vk._ops.matvec_q8 and vk._ops.matvec_q8_min == 2
        n_layer = sum(n.op == "attention" for n in vk._ir.nodes)
        # per layer one quantize for q/k/v and one for gate/up, each doing the norm before
        # them, one each for o and down, and the head's (with the output norm); every
        # matvec on int8 (Q4_K_M mixes Q4_K and Q6_K), no rms_norm dispatch left
        quant_n, normed, on, off, norms = q8_counts(vk, 4)
        assert (quant_n, normed, off, norms) == (4 * n_layer + 1, 2 * n_layer + 1, 0, 0), (quant_n, normed, off, norms)
        assert on >= 6 * n_layer + 1, on
        assert q8_counts(vk, 1) == (0, 0, 0, q8_counts(vk, 1)[3], 2 * n_layer + 1)
        for prompts in (PROMPTS, [*PROMPTS, PROMPTS[0][:7], PROMPTS[1][:3]]):
            worst, checked = forced_greedy(vk, ref, prompts, 12)
            assert 1e-3 < worst <= BOUND, worst  # int8 moves them, within the bound
            assert checked >= 3 * len(prompts), checked  # of 13 per sequence
    finally:
        vk.close()
        ref.close()


@pytest.mark.parametrize("preset", ["tiny-qwen3", "tiny-qwen2", "tiny-gemma3", "tiny-qwen3moe", "tiny-qwen35"])
def test_other_architectures_on_int8_activations(model_path, monkeypatch: pytest.MonkeyPatch,
                                                 preset: str) -> None:  # type: ignore[no-untyped-def]
    """The lowering with TRIO_LLM_MATVEC_Q8=1 where the graph differs from llama's: QK-norm
    (qwen3: its per-head norms stay dispatches), q/k/v biases (qwen2), gemma3's extra
    norms read by residual adds and its windows, the MoE FFN (its experts keep f32), the
    gated delta-net layers (qwen35); numpy's logits within ``BOUND`` for a few steps of 2
    sequences, some products on int8 in each."""
    monkeypatch.setenv("TRIO_LLM_MATVEC_Q8", "1")
    model = load_gguf(model_path(preset, "Q4_K_M"))
    ref = NumpyBackend(model, n_ctx=N_CTX, n_seq=2, **F32_KV)
    vk = VulkanBackend(model, n_ctx=N_CTX, n_seq=2, **F32_KV)
    try:
        assert q8_counts(vk, 2)[2] > 0
        worst, _ = forced_greedy(vk, ref, PROMPTS, 4)
        assert 1e-3 < worst <= (MOE_BOUND if "moe" in preset else BOUND), worst
    finally:
        vk.close()
        ref.close()

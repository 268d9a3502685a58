"""The gated delta-net kernels (qwen35) against the numpy reference's ops, on lavapipe:
the short convolution and the delta rule with their per-sequence state (a step holding
a continued sequence, a fresh one, and one left alone), L2 norm, the strided split,
partial RoPE, the sigmoid gates."""

from __future__ import annotations

import types

import attrs
import numpy as np
import pytest

from test_vulkan_ops import Env, open_env
from trio_llm.engine.backend import SeqBatch
from trio_llm.engine.reference import NumpyBackend, Step, apply_rope, rope_angles, sigmoid
from trio_llm.graph import Graph

pytestmark = pytest.mark.vulkan


env = pytest.fixture(scope="module", name="env")(open_env)


#: a step of two runs: sequence 2 continues at position 5, sequence 0 starts afresh;
#: sequence 1's state must stay untouched
RUNS = [(2, 5, 4), (0, 0, 3)]  # (sequence, first position, tokens)
N_SEQ = 3


def _step() -> tuple[Step, list[int], list[int], list[int]]:
    entries = [SeqBatch(s, np.zeros(n, np.int32), p) for s, p, n in RUNS]
    seqs = [s for s, _, n in RUNS for _ in range(n)]
    pos = [p + i for _, p, n in RUNS for i in range(n)]
    step = Step(entries=entries, tokens=np.zeros(len(seqs), np.int64), pos=np.array(pos),
                bounds=np.cumsum([0] + [n for _, _, n in RUNS]), out_rows=np.zeros(0, np.int64))
    return step, seqs, pos, [0] * len(seqs)



def _entered(state: np.ndarray) -> np.ndarray:
    """The numpy backend's state as a step starts: a run at position 0 starts from zeros
    (``NumpyBackend._enter_state``); the kernels see that from the position alone."""
    out = state.copy()
    for s, p, _ in RUNS:
        if p == 0:
            out[s] = 0.0
    return out


def test_ssm_conv_continues_each_sequence_from_its_state(env: Env) -> None:
    c, k = 40, 4
    rng = np.random.default_rng(1)
    step, seqs, pos, toks = _step()
    n = len(seqs)
    x = rng.standard_normal((n, c)).astype(np.float32)
    w = rng.standard_normal((c, k)).astype(np.float32)
    state = rng.standard_normal((N_SEQ, k - 1, c)).astype(np.float32)
    g = Graph(shapes={"emb": (8, c), "conv": (c, k)})
    g.layer(0)
    out = g.ssm_conv(g.get_rows(g.weight("emb"), g.tokens()), g.weight("conv"), "conv_out")
    node = g.nodes[-1]
    ref_state = _entered(state)
    fake = types.SimpleNamespace(_rs={out.id: ref_state})
    want = NumpyBackend._ssm_conv(fake, node, x, w, step)  # type: ignore[arg-type]
    xv, wv, yv, sv = env.put(x), env.put(w), env.zeros(n * c), env.put(state)
    st = env.step(toks, pos, seqs)
    env.run([env.ops.ssm_conv(xv, wv, yv, sv, st, c=c, k=k, cap=8, phase=0)])
    env.run([env.ops.ssm_conv(xv, wv, yv, sv, st, c=c, k=k, cap=8, phase=1)])
    np.testing.assert_allclose(env.get(yv).reshape(n, c), want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(env.get(sv).reshape(state.shape), ref_state, rtol=0, atol=0)
    np.testing.assert_array_equal(ref_state[1], state[1])  # sequence 1 untouched


#: delta_net.comp's forms: delta_split (0: one lane per state column)
DELTA_FORMS = [pytest.param(0, id="loops"), *(pytest.param(dp, id=f"split{dp}") for dp in (2, 4, 8))]


@pytest.mark.parametrize("split", DELTA_FORMS)
@pytest.mark.parametrize(("n_k", "n_v", "d"), [(2, 4, 64), (1, 1, 128)])
def test_delta_net_runs_each_sequence_through_its_state(env: Env, n_k: int, n_v: int, d: int, split: int) -> None:
    """Both forms of delta_net.comp: the head dim a specialization constant, and the
    split-lane form with DP lanes per state column (DP, TRIO_LLM_DELTA_SPLIT=DP)."""
    rng = np.random.default_rng(d)
    step, seqs, pos, toks = _step()
    n = len(seqs)

    def unit(shape: tuple[int, ...]) -> np.ndarray:  # L2-normalised heads, as the model feeds them
        z = rng.standard_normal(shape).astype(np.float32)
        return (z / np.linalg.norm(z, axis=-1, keepdims=True)).reshape(shape[0], -1)

    q, k = unit((n, n_k, d)), unit((n, n_k, d))
    v = rng.standard_normal((n, n_v * d)).astype(np.float32)
    alpha = rng.standard_normal((n, n_v)).astype(np.float32)
    beta = rng.standard_normal((n, n_v)).astype(np.float32)
    dt = rng.standard_normal(n_v).astype(np.float32)
    a = -np.exp(rng.standard_normal(n_v)).astype(np.float32)
    state = (0.1 * rng.standard_normal((N_SEQ, n_v, d, d))).astype(np.float32)  # [seq, h, i, j]
    g = Graph(shapes={"eq": (8, n_k * d), "ev": (8, n_v * d), "eg": (8, n_v), "dt": (n_v,), "a": (n_v,)})
    g.layer(0)
    tq, tv, tg = (g.get_rows(g.weight(w), g.tokens(), name=w) for w in ("eq", "ev", "eg"))
    out = g.delta_net(tq, tq, tv, tg, tg, g.weight("dt"), g.weight("a"), "dn", n_k_heads=n_k, n_v_heads=n_v,
                      head_dim=d)
    ref_state = _entered(state)
    fake = types.SimpleNamespace(_rs={out.id: ref_state})
    want = NumpyBackend._delta_net(fake, g.nodes[-1], q, k, v, alpha, beta, dt, a, step=step)  # type: ignore[arg-type]
    dev_state = np.ascontiguousarray(state.transpose(0, 1, 3, 2))  # the kernel keeps column j contiguous
    views = [env.put(t) for t in (q, k, v, alpha, beta, dt, a)]
    o, sv, st = env.zeros(n * n_v * d), env.put(dev_state), env.step(toks, pos, seqs)
    ops = attrs.evolve(env.ops, delta_split=split, delta_split_auto=False)
    env.run([ops.delta_net(*views, o, sv, st, n_k=n_k, n_v=n_v, d=d, cap=8)])
    np.testing.assert_allclose(env.get(o).reshape(n, -1), want, rtol=1e-4, atol=1e-5)
    got_state = env.get(sv).reshape(N_SEQ, n_v, d, d).transpose(0, 1, 3, 2)
    np.testing.assert_allclose(got_state, ref_state, rtol=1e-4, atol=1e-5)
    np.testing.assert_array_equal(got_state[1], state[1])  # sequence 1 untouched


def test_l2_norm_take_rope_partial_and_the_gates(env: Env) -> None:
    rng = np.random.default_rng(3)
    n, heads, hd, n_rot = 5, 3, 32, 8
    x = rng.standard_normal((n, heads * hd)).astype(np.float32)
    st = env.step([0] * n, [0, 3, 17, 40, 2])
    # L2 norm per head (one head nearly zero: the eps floor)
    x[1, :hd] = 1e-9
    y = env.zeros(x.size)
    env.run([env.ops.l2_norm(env.put(x), y, st, n=hd, rows_per_tok=heads, eps=1e-6, cap=8)])
    xg = x.reshape(n, heads, hd)
    want = xg / np.maximum(np.linalg.norm(xg, axis=-1, keepdims=True), 1e-6)
    np.testing.assert_allclose(env.get(y).reshape(want.shape), want, rtol=1e-5, atol=1e-7)
    # take: each head's second half
    y2 = env.zeros(n * heads * hd // 2)
    env.run([env.ops.take(env.put(x), y2, st, group=hd, start=hd // 2, n=hd // 2, n_out=heads * hd // 2,
                          x_stride=heads * hd, y_stride=heads * hd // 2, cap=8)])
    np.testing.assert_array_equal(env.get(y2).reshape(n, heads, -1), xg[:, :, hd // 2 :])
    # partial RoPE in place: the first n_rot of each head rotate, the rest stay
    xv = env.put(x)
    env.run([env.ops.rope_partial(xv, st, n_heads=heads, head_dim=hd, n_rot=n_rot, x_stride=heads * hd,
                                  theta=1e7, cap=8)])
    cos, sin = rope_angles(n_rot, 1e7, 64)
    pos = np.array([0, 3, 17, 40, 2])
    want_r = xg.copy()
    want_r[..., :n_rot] = apply_rope(xg[..., :n_rot], cos[pos], sin[pos], "neox")
    np.testing.assert_allclose(env.get(xv).reshape(want_r.shape), want_r, rtol=1e-4, atol=1e-5)
    # sigmoid(gate) * x, and the shared expert's row gate
    gate = rng.standard_normal(x.shape).astype(np.float32)
    y3 = env.zeros(x.size)
    env.run([env.ops.glu(env.put(gate), env.put(x), y3, st, n=x.shape[1], stride=x.shape[1], cap=8, act="sigmoid")])
    np.testing.assert_allclose(env.get(y3).reshape(x.shape), sigmoid(gate) * x, rtol=1e-5, atol=1e-6)
    h = rng.standard_normal((n, 48)).astype(np.float32)
    w = rng.standard_normal(48).astype(np.float32)
    y4 = env.zeros(x.size)
    env.run([env.ops.gate_rows(env.put(x), env.put(h), env.put(w), y4, st, n=x.shape[1], n_in=48, cap=8)])
    np.testing.assert_allclose(env.get(y4).reshape(x.shape), x * sigmoid(h @ w)[:, None], rtol=1e-5, atol=1e-6)


#: a prefill step for the chunked form: sequence 2 continues at position 5 for 150
#: tokens (chunks 5-63, 64-127, 128-154: none a multiple of the chunk), sequence 0
#: starts afresh with 70, sequence 3 continues with one token; sequence 1 is left alone
LONG_RUNS = [(2, 5, 150), (0, 0, 70), (3, 40, 1)]


@pytest.mark.parametrize(("n_k", "n_v", "d"), [(2, 4, 64), (1, 1, 128), (1, 2, 24)])
def test_the_chunked_delta_rule_equals_numpy_across_chunks_and_runs(env: Env, n_k: int, n_v: int, d: int) -> None:
    """delta_prep + delta_chunk (the prefill form) against the numpy reference over runs
    whose lengths and starts are not multiples of the chunk, from a nonzero state; the
    state ends in the layout the decode kernel reads (checked by decoding on from it)."""
    rng = np.random.default_rng(d + n_v)
    n_seq = 4
    entries = [SeqBatch(s, np.zeros(n, np.int32), p) for s, p, n in LONG_RUNS]
    seqs = [s for s, _, n in LONG_RUNS for _ in range(n)]
    pos = [p + i for _, p, n in LONG_RUNS for i in range(n)]
    n = len(seqs)
    step = Step(entries=entries, tokens=np.zeros(n, np.int64), pos=np.array(pos),
                bounds=np.cumsum([0] + [m for _, _, m in LONG_RUNS]), out_rows=np.zeros(0, np.int64))

    def unit(shape: tuple[int, ...]) -> np.ndarray:
        z = rng.standard_normal(shape).astype(np.float32)
        return (z / np.linalg.norm(z, axis=-1, keepdims=True)).reshape(shape[0], -1)

    q, k = unit((n, n_k, d)), unit((n, n_k, d))
    v = rng.standard_normal((n, n_v * d)).astype(np.float32)
    alpha = rng.standard_normal((n, n_v)).astype(np.float32)
    beta = rng.standard_normal((n, n_v)).astype(np.float32)
    dt = rng.standard_normal(n_v).astype(np.float32)
    a = -np.exp(rng.standard_normal(n_v)).astype(np.float32)
    state = (0.1 * rng.standard_normal((n_seq, n_v, d, d))).astype(np.float32)  # [seq, h, i, j]
    g = Graph(shapes={"eq": (8, n_k * d), "ev": (8, n_v * d), "eg": (8, n_v), "dt": (n_v,), "a": (n_v,)})
    g.layer(0)
    tq, tv, tg = (g.get_rows(g.weight(w), g.tokens(), name=w) for w in ("eq", "ev", "eg"))
    out = g.delta_net(tq, tq, tv, tg, tg, g.weight("dt"), g.weight("a"), "dn", n_k_heads=n_k, n_v_heads=n_v,
                      head_dim=d)
    ref_state = state.copy()
    ref_state[0] = 0.0  # sequence 0 starts at position 0
    fake = types.SimpleNamespace(_rs={out.id: ref_state})
    want = NumpyBackend._delta_net(fake, g.nodes[-1], q, k, v, alpha, beta, dt, a, step=step)  # type: ignore[arg-type]
    views = [env.put(t) for t in (q, k, v, alpha, beta, dt, a)]
    vq, vk, vv, va, vb, vdt, vad = views
    tm, pm, gc = env.zeros(n * n_v * 64), env.zeros(n * n_v * 64), env.zeros(n * n_v)
    o, sv = env.zeros(n * n_v * d), env.put(np.ascontiguousarray(state.transpose(0, 1, 3, 2)))
    st = env.step([0] * n, pos, seqs)
    env.run([env.ops.delta_prep(vq, vk, va, vb, vdt, vad, tm, pm, gc, st, n_k=n_k, n_v=n_v, d=d, cap=256,
                                    runs=n_seq)])
    env.run([env.ops.delta_chunk(vq, vk, vv, vb, tm, pm, gc, o, sv, st, n_k=n_k, n_v=n_v, d=d, cap=256,
                                     runs=n_seq)])
    np.testing.assert_allclose(env.get(o).reshape(n, -1), want, rtol=1e-4, atol=2e-4)
    got_state = env.get(sv).reshape(n_seq, n_v, d, d).transpose(0, 1, 3, 2)
    np.testing.assert_allclose(got_state, ref_state, rtol=1e-4, atol=2e-4)
    np.testing.assert_array_equal(got_state[1], state[1])  # sequence 1 untouched
    # the decode kernel continues sequence 2 from the state the chunked form left
    one = [env.put(t[:1]) for t in (q, k, v, alpha, beta)]
    o1, st1 = env.zeros(n_v * d), env.step([0], [155], [2])
    env.run([env.ops.delta_net(*one, vdt, vad, o1, sv, st1, n_k=n_k, n_v=n_v, d=d, cap=1)])
    step1 = Step(entries=[SeqBatch(2, np.zeros(1, np.int32), 155)], tokens=np.zeros(1, np.int64),
                 pos=np.array([155]), bounds=np.array([0, 1]), out_rows=np.zeros(0, np.int64))
    want1 = NumpyBackend._delta_net(fake, g.nodes[-1], q[:1], k[:1], v[:1], alpha[:1], beta[:1], dt, a,  # type: ignore[arg-type]
                                    step=step1)
    np.testing.assert_allclose(env.get(o1).reshape(1, -1), want1, rtol=1e-4, atol=2e-4)

"""The hybrid and MoE fusions (``Ops.hybrid_fuse``, forward.py's ``fusion_groups``) on
lavapipe: each fused kernel against numpy (the conv with its split and L2 norms, the
delta rule making its own q, k, v and with the gated RMSNorm, the experts' down product
reading their SwiGLU and summing them, the combine with the gated shared expert and the
residual, QK-norm with RoPE and the KV cache write, the decode attention's output gate),
the barrier levels of one decode
step per layer of tiny-qwen35, tiny-qwen35moe and tiny-qwen3moe (exact, fused and not),
and whole forwards equal to the unfused lowering's."""

from __future__ import annotations

import types

import attrs
import numpy as np
import pytest

from test_vulkan_deltanet import DELTA_FORMS, N_SEQ, _entered, _step
from test_vulkan_kv import attention_inputs, np_attention
from test_vulkan_ops import Env, make_weights, np_rope, open_env
from trio_llm.engine.backend import SeqBatch
from trio_llm.engine.reference import NumpyBackend, apply_rope, rms_norm, rope_angles, sigmoid, silu
from trio_llm.errors import ConfigError
from trio_llm.graph import Graph
from trio_llm.model.gguf import load_gguf
from trio_llm.model.kvtypes import dequantize_rows, kv_type
from trio_llm.vulkan.backend import VulkanBackend
from trio_llm.vulkan.forward import fusion_groups, plan_buffers
from trio_llm.vulkan.graph import Barrier, Copy, Op
from trio_llm.vulkan.ops import (
    ROPE_NEOX,
    ROPE_NORMAL,
    Ops,
    attention_counters,
    attention_part_floats,
)

pytestmark = pytest.mark.vulkan


env = pytest.fixture(scope="module", name="env")(open_env)


@pytest.mark.parametrize("d", [64, 128, 32])
def test_ssm_conv_split_equals_the_conv_the_takes_and_the_l2_norms(env: Env, d: int) -> None:
    """q and k heads L2-normed, v as it is, each in its own buffer; a head of 128 takes
    two channels a lane; the state is left for phase 1, which the unfused path shares."""
    key, value, k = 2 * d, 3 * d, 4
    c = 2 * key + value
    rng = np.random.default_rng(d)
    step, seqs, pos, toks = _step()
    n = len(seqs)
    x = rng.standard_normal((n, c)).astype(np.float32)
    w = rng.standard_normal((c, k)).astype(np.float32)
    state = rng.standard_normal((N_SEQ, k - 1, c)).astype(np.float32)
    g = Graph(shapes={"emb": (8, c), "conv": (c, k)})
    g.layer(0)
    out = g.ssm_conv(g.get_rows(g.weight("emb"), g.tokens()), g.weight("conv"), "conv_out")
    fake = types.SimpleNamespace(_rs={out.id: _entered(state)})
    conv = NumpyBackend._ssm_conv(fake, g.nodes[-1], x, w, step)  # type: ignore[arg-type]

    def l2(t: np.ndarray) -> np.ndarray:
        h = t.reshape(n, -1, d)
        return (h / np.maximum(np.linalg.norm(h, axis=-1, keepdims=True), 1e-6)).reshape(n, -1)

    want = [l2(conv[:, :key]), l2(conv[:, key : 2 * key]), conv[:, 2 * key :]]
    xv, wv, sv, st = env.put(x), env.put(w), env.put(state), env.step(toks, pos, seqs)
    ys = [env.zeros(n * key), env.zeros(n * key), env.zeros(n * value)]
    env.run([env.ops.ssm_conv_split(xv, wv, *ys, sv, st, c=c, k=k, d=d, e1=key, e2=2 * key, norm=0b011,
                                    eps=1e-6, cap=8)])
    for y, wt in zip(ys, want, strict=True):
        np.testing.assert_allclose(env.get(y).reshape(n, -1), wt, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(env.get(sv).reshape(state.shape), state)  # phase 1 moves it on


@pytest.mark.parametrize(("n_k", "n_v", "d", "conv", "gate"),
                         [(2, 4, 64, False, True), (1, 2, 128, False, True), (2, 4, 64, True, True),
                          (1, 2, 128, True, True), (2, 2, 64, True, False)])
@pytest.mark.parametrize("split", DELTA_FORMS)
def test_delta_net_fused_with_its_conv_and_its_gated_norm(env: Env, n_k: int, n_v: int, d: int, conv: bool,
                                                         gate: bool, split: int) -> None:
    """The rule, fed (``conv``) by the conv of its qkv input with the conv state, split
    and L2-normed in the kernel, and (``gate``) RMS-normed per head and gated by
    silu(z) after it: numpy's conv, L2 norms, rule, norm and gate. The conv state is
    left for ssm_conv's phase 1."""
    rng = np.random.default_rng(d + 1)
    step, seqs, pos, toks = _step()
    n = len(seqs)
    key = n_k * d
    c = 2 * key + n_v * d
    x = rng.standard_normal((n, c)).astype(np.float32)
    cw = (0.5 * rng.standard_normal((c, 4))).astype(np.float32)
    cstate = rng.standard_normal((N_SEQ, 3, c)).astype(np.float32)
    g = Graph(shapes={"emb": (8, c), "conv": (c, 4)})
    g.layer(0)
    cout = g.ssm_conv(g.get_rows(g.weight("emb"), g.tokens()), g.weight("conv"), "conv_out")
    conv_node = g.nodes[-1]
    if conv:
        y = NumpyBackend._ssm_conv(types.SimpleNamespace(_rs={cout.id: _entered(cstate)}), conv_node, x, cw,
                                   step)  # type: ignore[arg-type]
        heads = [y[:, :key].reshape(n, n_k, d), y[:, key : 2 * key].reshape(n, n_k, d)]
        q, k = ((h / np.maximum(np.linalg.norm(h, axis=-1, keepdims=True), 1e-6)).reshape(n, -1) for h in heads)
        v = y[:, 2 * key :]
    else:
        q, k = (t / np.linalg.norm(t, axis=-1, keepdims=True) for t in
                (rng.standard_normal((n, n_k, d)).astype(np.float32) for _ in range(2)))
        q, k = q.reshape(n, -1), k.reshape(n, -1)
        v = rng.standard_normal((n, n_v * d)).astype(np.float32)
    alpha = rng.standard_normal((n, n_v)).astype(np.float32)
    beta = rng.standard_normal((n, n_v)).astype(np.float32)
    dt = rng.standard_normal(n_v).astype(np.float32)
    a = -np.exp(rng.standard_normal(n_v)).astype(np.float32)
    z = rng.standard_normal((n, n_v * d)).astype(np.float32)
    nw = rng.standard_normal(d).astype(np.float32)
    state = (0.1 * rng.standard_normal((N_SEQ, n_v, d, d))).astype(np.float32)
    graph = Graph(shapes={"eq": (8, key), "ev": (8, n_v * d), "eg": (8, n_v), "dt": (n_v,), "a": (n_v,)})
    graph.layer(0)
    tq, tv, tg2 = (graph.get_rows(graph.weight(w), graph.tokens(), name=w) for w in ("eq", "ev", "eg"))
    out = graph.delta_net(tq, tq, tv, tg2, tg2, graph.weight("dt"), graph.weight("a"), "dn", n_k_heads=n_k,
                          n_v_heads=n_v, head_dim=d)
    fake = types.SimpleNamespace(_rs={out.id: _entered(state)})
    o = NumpyBackend._delta_net(fake, graph.nodes[-1], q, k, v, alpha, beta, dt, a, step=step)  # type: ignore[arg-type]
    want = silu(z) * rms_norm(o.reshape(n, n_v, d), nw, 1e-6).reshape(n, -1) if gate else o
    cv = env.put(cstate)
    qkv = [env.put(x), env.put(cw), cv] if conv else [env.put(t) for t in (q, k, v)]
    ov, sv, st = env.zeros(n * n_v * d), env.put(np.ascontiguousarray(state.transpose(0, 1, 3, 2))), \
        env.step(toks, pos, seqs)
    env.run([attrs.evolve(env.ops, delta_split=split, delta_split_auto=False).delta_net(*qkv, *(env.put(t) for t in (alpha, beta, dt, a)), ov, sv, st, n_k=n_k, n_v=n_v,
                               d=d, cap=8, gate=(env.put(z), env.put(nw), 1e-6) if gate else None,
                               conv=(c, 4, 1e-6) if conv else None)])
    np.testing.assert_allclose(env.get(ov).reshape(n, -1), want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
    got_state = env.get(sv).reshape(N_SEQ, n_v, d, d).transpose(0, 1, 3, 2)
    np.testing.assert_allclose(got_state, fake._rs[out.id], rtol=1e-4, atol=1e-5)
    np.testing.assert_array_equal(env.get(cv).reshape(cstate.shape), cstate)


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_K", "F16"])
def test_moe_matvec_glu_in_multiplies_the_experts_swiglu(env: Env, qtype: str) -> None:
    n_exp, rows, cols, n_tok, k = 5, 70, 256, 3, 2
    raw, ref = make_weights(qtype, n_exp * rows, cols, seed=17)
    ref = ref.reshape(n_exp, rows, cols)
    rng = np.random.default_rng(18)
    ids = np.array([[4, 0], [2, 3], [1, 4]])
    routes = np.concatenate([ids.astype(np.float32), rng.random((n_tok, k), np.float32)], axis=1)
    gate = rng.standard_normal((n_tok, k, cols)).astype(np.float32)
    up = rng.standard_normal((n_tok, k, cols)).astype(np.float32)
    y, st = env.zeros(n_tok * k * rows), env.step([0] * n_tok)
    env.run([env.ops.moe_matvec(qtype, env.put(raw), env.put(gate), y, st, env.put(routes), n_in=cols,
                                n_rows=rows, x_stride=k * cols, x_pair=cols, y_stride=k * rows, k=k, cap=4,
                                up=env.put(up))])
    want = np.einsum("tkoi,tki->tko", ref[ids], silu(gate) * up)
    np.testing.assert_allclose(env.get(y).reshape(n_tok, k, rows), want, atol=2e-5 * np.abs(want).max(), rtol=0)


@pytest.mark.parametrize(("qtype", "glu", "shexp", "resid"),
                         [("Q8_0", True, True, True), ("Q4_K", True, False, True), ("Q6_K", False, True, False),
                          ("F16", False, False, False)])
def test_moe_matvec_combine_sums_the_experts_and_ends_the_ffn(env: Env, qtype: str, glu: bool, shexp: bool,
                                                              resid: bool) -> None:
    """COMBINE: a work group per token sums its experts' down rows with their routing
    weights (reading silu(gate) * up with GLU_IN), plus the gated shared expert and the
    residual: numpy's products, weighted sum, gate and add."""
    n_exp, rows, cols, n_tok, k, n_in = 5, 70, 256, 3, 3, 200
    raw, ref = make_weights(qtype, n_exp * rows, cols, seed=27)
    ref = ref.reshape(n_exp, rows, cols)
    rng = np.random.default_rng(28)
    ids = np.array([[4, 0, 2], [2, 3, 1], [1, 4, 0]])
    routes = np.concatenate([ids.astype(np.float32), rng.random((n_tok, k), np.float32)], axis=1)
    x = rng.standard_normal((n_tok, k, cols)).astype(np.float32)
    up = rng.standard_normal((n_tok, k, cols)).astype(np.float32)
    xs = rng.standard_normal((n_tok, rows)).astype(np.float32)
    h = rng.standard_normal((n_tok, n_in)).astype(np.float32)
    gw = (0.1 * rng.standard_normal(n_in)).astype(np.float32)
    res = rng.standard_normal((n_tok, rows)).astype(np.float32)
    per = np.einsum("tkoi,tki->tko", ref[ids], silu(x) * up if glu else x)
    want = np.einsum("tko,tk->to", per, routes[:, k:])
    if shexp:
        want = want + xs * sigmoid(h @ gw)[:, None]
    if resid:
        want = res + want
    rv = env.put(res)
    y = rv if resid else env.zeros(n_tok * rows)  # the residual add writes in place
    env.run([env.ops.moe_matvec(qtype, env.put(raw), env.put(x), y, env.step([0] * n_tok), env.put(routes),
                                n_in=cols, n_rows=rows, x_stride=k * cols, x_pair=cols, y_stride=rows, k=k, cap=4,
                                up=env.put(up) if glu else None,
                                combine=(rv if resid else None,
                                         (env.put(xs), env.put(h), env.put(gw), n_in) if shexp else None))])
    np.testing.assert_allclose(env.get(y).reshape(n_tok, rows), want, atol=3e-5 * np.abs(want).max(), rtol=0)


@pytest.mark.parametrize(("shexp", "resid"), [(True, True), (False, True), (True, False)])
def test_moe_combine_adds_the_gated_shared_expert_and_the_residual(env: Env, shexp: bool, resid: bool) -> None:
    n_tok, k, n, n_in = 3, 4, 300, 200
    rng = np.random.default_rng(19)
    ys = rng.standard_normal((n_tok, k, n)).astype(np.float32)
    routes = np.concatenate([np.zeros((n_tok, k), np.float32), rng.random((n_tok, k), np.float32)], axis=1)
    xs = rng.standard_normal((n_tok, n)).astype(np.float32)
    h = rng.standard_normal((n_tok, n_in)).astype(np.float32)
    gw = (0.1 * rng.standard_normal(n_in)).astype(np.float32)
    res = rng.standard_normal((n_tok, n)).astype(np.float32)
    want = np.einsum("tkd,tk->td", ys, routes[:, k:])
    if shexp:
        want = want + xs * sigmoid(h @ gw)[:, None]
    if resid:
        want = res + want
    rv = env.put(res)
    out = rv if resid else env.zeros(n_tok * n)  # the residual add writes in place
    env.run([env.ops.moe_combine(env.put(ys), env.put(routes), out, env.step([0] * n_tok), n=n, k=k, y_stride=n,
                                 cap=4, res=rv if resid else None,
                                 shexp=(env.put(xs), env.put(h), env.put(gw), n_in) if shexp else None)])
    np.testing.assert_allclose(env.get(out).reshape(n_tok, n), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("mode", "n_rot", "gated", "kv"),
                         [(ROPE_NEOX, 32, False, None), (ROPE_NEOX, 32, False, "f16"), (ROPE_NORMAL, 32, False, "q8_0"),
                          (ROPE_NEOX, 8, True, None), (ROPE_NEOX, 8, False, "f32"), (ROPE_NEOX, 8, False, "q8_0")])
def test_qk_norm_rope_equals_the_norm_then_the_rope(env: Env, mode: int, n_rot: int, gated: bool,
                                                     kv: str | None) -> None:
    """Per head: RMSNorm, RoPE (all of the head with frequency divisors, or qwen35's
    first n_rot values), as a value or into the cache (f16 and q8_0 after their own
    rounding); ``gated``: q read from its interleave with the gate (heads of 2 hd)."""
    ntok, heads, hd, n_ctx, n_seq, eps, theta = 4, 3, 32, 40, 2, 1e-6, 1e7
    rng = np.random.default_rng(n_rot + mode)
    x = (rng.standard_normal((ntok, heads, 2 if gated else 1, hd)) * 3).astype(np.float32)
    w = (1 + 0.3 * rng.standard_normal(hd)).astype(np.float32)
    factors = (np.ones(hd // 2) if n_rot < hd else 1 + rng.random(hd // 2)).astype(np.float32)
    pos, seq = np.array([0, 39, 7, 3]), np.array([0, 1, 1, 0])
    normed = rms_norm(x[:, :, 0].astype(np.float64), w, eps)  # [ntok, heads, hd]
    want = normed.copy()
    if n_rot < hd:
        cos, sin = rope_angles(n_rot, theta, n_ctx)
        want[..., :n_rot] = apply_rope(normed[..., :n_rot], cos[pos], sin[pos], "neox")
    else:
        want = np_rope(normed, pos, theta, mode, factors)
    kw = dict(n_heads=heads, head_dim=hd, x_stride=x[0].size, x_head=x[0, 0].size, x_off=0, mode=mode,
              n_rot=n_rot, theta=theta, eps=eps, cap=8)
    xv, fv, wv, st = env.put(x), env.put(factors), env.put(w), env.step([0] * ntok, pos, seq)
    if kv is None:
        y = env.zeros(ntok * heads * hd)
        env.run([env.ops.qk_norm_rope(xv, y, fv, st, wv, **kw)])  # type: ignore[arg-type]
        np.testing.assert_allclose(env.get(y).reshape(want.shape), want, rtol=0, atol=2e-5 * np.abs(want).max())
        return
    t = kv_type(kv)
    kc = env.put(np.zeros(n_seq * n_ctx * t.row_bytes(heads * hd), np.uint8))
    env.run([env.ops.qk_norm_rope(xv, kc, fv, st, wv, to_cache=True, n_ctx=n_ctx, kv_dim=heads * hd, kv_type=kv,
                                  **kw)])  # type: ignore[arg-type]
    cache = env.get(kc, np.uint8).reshape(n_seq, n_ctx, t.row_bytes(heads * hd))
    step = {"f32": 0.0, "f16": 1e-3, "q8_0": 1.0 / 127}[kv] * np.abs(want).max()
    for i in range(ntok):
        got = dequantize_rows(cache[seq[i], pos[i]][None], t, heads * hd)[0]
        np.testing.assert_allclose(got, want[i].reshape(-1), atol=2e-5 * np.abs(want).max() + step, rtol=0)


@pytest.mark.parametrize("new", [True, False])
def test_decode_attention_gates_its_output(env: Env, new: bool) -> None:
    """attention_decode's OUT_GATE (both kernels): each output divided by 1 + exp(-g),
    g read from its interleave with q (heads of 2 hd, the gate second), on outputs one
    work group writes (a short sequence) and outputs the last split combines."""
    hd, n_head, n_kv, n_ctx = 64, 4, 2, 320
    pos, seq = [0, 5, 290, 200], [0, 1, 0, 1]
    ntok = len(pos)
    q, kc, kh, vc, vh = attention_inputs(env, ntok=ntok, n_seq=2, n_ctx=n_ctx, n_head=n_head, n_kv=n_kv, hd=hd,
                                         k_type="f16", v_type="f16", seed=3)
    g = np.random.default_rng(4).standard_normal((ntok, n_head, hd)).astype(np.float32) * 2
    qg = np.stack([np.zeros_like(g), g], axis=2)  # [ntok, n_head, 2, hd]: q's place, then the gate
    ops = Ops(env.ops.kernels, subgroup=env.ops.subgroup, decode_attn2=new)
    cap, n_split = 8, 4
    part, counters = env.zeros(attention_part_floats(cap, n_head, hd, n_split)), \
        env.zeros(attention_counters(cap, n_head, n_kv), np.uint32)
    o = env.zeros(q.size)
    d = ops.attention_decode(env.put(q), kc, vc, o, part, counters, env.step([0] * ntok, pos, seq), n_head=n_head,
                             n_head_kv=n_kv, head_dim=hd, n_ctx=n_ctx, q_stride=n_head * hd, o_stride=n_head * hd,
                             cap=cap, k_type="f16", v_type="f16", n_split=n_split,
                             gate=(env.put(qg), n_head * 2 * hd, 2 * hd, hd))
    assert d.kernel.name == ("attn_decode2" if new else "attn_decode")
    env.run([d])
    want = np_attention(q, kh, vh, np.array(pos), np.array(seq), n_kv, 0).reshape(ntok, n_head, hd) * sigmoid(g)
    np.testing.assert_allclose(env.get(o).reshape(want.shape), want, atol=3e-5 * np.abs(vh).max(), rtol=0)
    assert not env.get(counters, np.uint32).any()


def _levels(ops: list[Op]) -> list[list[str]]:
    """The dispatches between barriers, each level's kernel names sorted (matvec by its
    form: "gate_up" computes gate, up and SwiGLU, "matvec_rope" writes the KV cache)."""
    forms = {9: "gate_up", 13: "matvec_rope"}
    out: list[list[str]] = [[]]
    for op in ops:
        if isinstance(op, Barrier):
            out.append([])
        elif isinstance(op, Copy):
            out[-1].append("copy")
        else:
            name = op.kernel.name
            out[-1].append(forms.get(op.kernel.n_push, name) if name == "matvec" else name)
    return [sorted(level) for level in out]


MV4 = ["matvec"] * 4
#: one decode step of each layer kind, by barrier level (each level after a barrier)
DELTA = [["rms_norm"], MV4, ["delta_net"], ["matvec", "ssm_conv"]]
DELTA_OLD = [["rms_norm"], MV4, ["ssm_conv"], ["ssm_conv", "take"], ["l2_norm"], ["take"], ["l2_norm", "take"],
             ["delta_net"], ["rms_norm"], ["swiglu"], ["matvec"]]
GATED_ATTN = [["rms_norm"], ["matvec", "matvec", "matvec_rope"], ["qk_norm_rope", "qk_norm_rope"], ["attn_decode2"],
              ["matvec"]]
GATED_ATTN_OLD = [["rms_norm"], ["matvec"], ["take", "take"], ["matvec", "rms_norm"], ["rms_norm", "rope_partial"],
                  ["rope_partial"], ["matvec_rope", "rope"], ["attn_decode2"], ["swiglu"], ["matvec"]]
FFN = [["rms_norm"], ["gate_up"], ["matvec"]]
MOE = [["rms_norm"], ["gate_up", "matvec"], ["matvec", "moe_topk"], ["moe_matvec", "moe_matvec"], ["moe_matvec"]]
MOE_OLD = [["rms_norm"], ["matvec"], ["moe_topk"], ["moe_matvec", "moe_matvec"], ["swiglu"], ["moe_matvec"],
           ["gate_up", "moe_combine"], ["matvec"], ["gate_rows"], ["add"], ["add"]]
QWEN3_ATTN = [["rms_norm"], ["matvec", "matvec", "matvec_rope"], ["qk_norm_rope", "qk_norm_rope"], ["attn_decode2"],
              ["matvec"]]
QWEN3_ATTN_OLD = [["rms_norm"], ["matvec", "matvec"], ["rms_norm", "rms_norm"], ["matvec_rope", "rope", "rope"],
                  ["attn_decode2"], ["matvec"]]
QWEN3MOE = [["rms_norm"], ["matvec"], ["moe_topk"], ["moe_matvec", "moe_matvec"], ["moe_matvec"]]
QWEN3MOE_OLD = [["rms_norm"], ["matvec"], ["moe_topk"], ["moe_matvec", "moe_matvec"], ["swiglu"], ["moe_matvec"],
                ["moe_combine"], ["add"]]
HEAD = [["get_rows"], ["rms_norm"], ["matvec"], ["copy"]]

#: preset -> (fused, unfused) levels of a decode step: the embedding, the layers, the head
DECODE_LEVELS = {
    "tiny-qwen35": ([["get_rows"], *(DELTA + FFN) * 3, *GATED_ATTN, *FFN, *HEAD],
                    [["get_rows"], *(DELTA_OLD + FFN) * 3, *GATED_ATTN_OLD, *FFN, *HEAD]),
    "tiny-qwen35moe": ([["get_rows"], *(DELTA + MOE) * 3, *GATED_ATTN, *MOE, *HEAD],
                       [["get_rows"], *(DELTA_OLD + MOE_OLD) * 3, *GATED_ATTN_OLD, *MOE_OLD, *HEAD]),
    "tiny-qwen3moe": ([["get_rows"], *(QWEN3_ATTN + QWEN3MOE) * 2, *HEAD],
                      [["get_rows"], *(QWEN3_ATTN_OLD + QWEN3MOE_OLD) * 2, *HEAD]),
}


@pytest.mark.parametrize("preset", list(DECODE_LEVELS))
def test_decode_barriers_per_layer(model_path, monkeypatch: pytest.MonkeyPatch, preset: str) -> None:  # type: ignore[no-untyped-def]
    """One decode step of one token, level by level (a barrier before each but the
    first): fused, a qwen35 delta-net layer has 7 barriers (14 unfused:
    TRIO_LLM_HYBRID_FUSE=0), its gated attention layer 8 (13), qwen35moe's 9 and 10
    (22 and 21), a qwen3moe layer 10 (14); the head 4. Wider buckets (int8 activations
    add their quantizes) and prefill buckets have fewer barriers fused too."""
    model = load_gguf(model_path(preset, "Q8_0"))
    barriers = {}
    for fuse, want in zip(("1", "0"), DECODE_LEVELS[preset], strict=True):
        monkeypatch.setenv("TRIO_LLM_HYBRID_FUSE", fuse)
        be = VulkanBackend(model, n_ctx=64, n_seq=2)
        try:
            assert _levels(be.lowered(1)) == want, fuse
            barriers[fuse] = [sum(isinstance(op, Barrier) for op in be.lowered(b)) for b in (2, 8, 64)]
        finally:
            be.close()
    assert all(f < u for f, u in zip(barriers["1"], barriers["0"], strict=True)), barriers
    counts = {"delta": len(DELTA + FFN), "delta_old": len(DELTA_OLD + FFN), "attn": len(GATED_ATTN + FFN),
              "attn_old": len(GATED_ATTN_OLD + FFN), "moe_delta": len(DELTA + MOE),
              "moe_delta_old": len(DELTA_OLD + MOE_OLD), "moe_attn": len(GATED_ATTN + MOE),
              "moe_attn_old": len(GATED_ATTN_OLD + MOE_OLD), "qwen3moe": len(QWEN3_ATTN + QWEN3MOE),
              "qwen3moe_old": len(QWEN3_ATTN_OLD + QWEN3MOE_OLD)}
    assert counts == {"delta": 7, "delta_old": 14, "attn": 8, "attn_old": 13, "moe_delta": 9,
                      "moe_delta_old": 22, "moe_attn": 10, "moe_attn_old": 21, "qwen3moe": 10,
                      "qwen3moe_old": 14}


#: the larger groups left off: their parts fuse instead (conv_split and delta_gate,
#: glu_in and moe_out), the attention's gate a swiglu again
SMALLER = "delta_conv,moe_down_out,attn_gate"


@pytest.mark.parametrize(("preset", "quant", "chunked", "off", "split"),
                         [("tiny-qwen35", "Q8_0", False, "", 0), ("tiny-qwen35moe", "Q4_K_M", False, "", 0),
                          ("tiny-qwen3moe", "Q8_0", False, "", 0), ("tiny-qwen35", "Q4_K_M", True, "", 0),
                          ("tiny-qwen35moe", "Q8_0", False, SMALLER, 0), ("tiny-qwen35", "Q8_0", False, "", 4),
                          ("tiny-qwen35", "Q8_0", False, SMALLER, 2)])
def test_fused_forwards_equal_the_unfused_lowering(model_path, monkeypatch: pytest.MonkeyPatch, preset: str,
                                                   quant: str, chunked: bool, off: str, split: int,
                                                   f32_activations: None) -> None:  # type: ignore[no-untyped-def]
    """Two sequences, a 43-token prefill (the prefill buckets' fusions, the experts
    grouped there, so the combine ends the FFN; ``chunked``: the delta rule's chunked
    form there, so the conv is ssm_conv_split; ``off``: TRIO_LLM_HYBRID_OFF) and 10 decode
    steps: the logits of TRIO_LLM_HYBRID_FUSE=1 and =0 (the default) agree to float
    rounding (on lavapipe they are the same bits: every fused kernel sums in the
    unfused kernels' order), and so do the greedy tokens. ``split``: both with
    TRIO_LLM_DELTA_SPLIT (the delta rule's split-lane form, its fused forms in decode:
    CONV with GATED_NORM, or with ``off`` GATED_NORM alone). On f32 decode activations
    (``f32_activations``): the two sequences' unfused decode matvecs would otherwise read
    int8 activations where the fused kernels read f32, which moved the H200's logits by
    0.5-0.8 % (2026-12-04)."""
    model = load_gguf(model_path(preset, quant))
    if chunked:
        monkeypatch.setenv("TRIO_LLM_DELTA_CHUNKED", "1")
    monkeypatch.setenv("TRIO_LLM_HYBRID_OFF", off)
    monkeypatch.setenv("TRIO_LLM_DELTA_SPLIT", str(split))
    logits = {}
    for fuse in ("1", "0"):
        monkeypatch.setenv("TRIO_LLM_HYBRID_FUSE", fuse)
        be = VulkanBackend(model, n_ctx=64, n_seq=2)
        try:
            assert be._ops.hybrid_fuse == (fuse == "1") and be._ops.delta_split == split
            if fuse == "1":
                names = {op.kernel.name for op in be.lowered(64) if not isinstance(op, (Barrier, Copy))}
                # prefill buckets never take delta_conv (the H200's pp512 was slower with
                # it): their conv is conv_split, fused or not chunked
                assert ("ssm_conv_split" in names) == ("qwen35" in preset)
                assert ("moe_combine" in names) == ("moe" in preset)
                decode = {op.kernel.name for op in be.lowered(1) if not isinstance(op, (Barrier, Copy))}
                assert ("ssm_conv_split" in decode) == bool(off) and ("swiglu" in decode) == bool(off)
            prompts = [np.arange(1, 41, dtype=np.int32) * 23 % 1000, np.array([2, 300, 11], np.int32)]
            out = be.forward([SeqBatch(i, p, 0) for i, p in enumerate(prompts)])
            pos = [len(p) for p in prompts]
            steps = [out.copy()]
            for _ in range(10):
                toks = [int(np.argmax(r)) for r in out]
                out = be.forward([SeqBatch(i, np.array([t], np.int32), pos[i]) for i, t in enumerate(toks)])
                pos = [p + 1 for p in pos]
                steps.append(out.copy())
            logits[fuse] = np.stack(steps)  # [steps, 2, n_vocab]
        finally:
            be.close()
    scale = float(np.abs(logits["0"]).max())
    assert float(np.abs(logits["1"] - logits["0"]).max()) <= 1e-5 * scale
    assert (logits["1"].argmax(-1) == logits["0"].argmax(-1)).all()


def test_an_unknown_fusion_kind_is_one_clear_error(model_path, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("TRIO_LLM_HYBRID_OFF", "moe_down_out,conv")
    with pytest.raises(ConfigError, match="TRIO_LLM_HYBRID_OFF=conv: expected kinds among conv_split, "):
        VulkanBackend(load_gguf(model_path("tiny-qwen35", "Q8_0")), n_ctx=64, n_seq=1)


def test_a_sampled_graph_has_no_barrier_twice_in_a_row(model_path, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    """The device-sampled decode graph drops the logits copy and the barrier before it:
    the barrier before each sample serves it (two in a row would drain the GPU twice);
    fused, as ``DECODE_LEVELS`` counts."""
    monkeypatch.setenv("TRIO_LLM_HYBRID_FUSE", "1")
    be = VulkanBackend(load_gguf(model_path("tiny-qwen35", "Q8_0")), n_ctx=64, n_seq=1)
    try:
        ops = be._sampler.build(1, 3)
        assert not any(isinstance(a, Barrier) and isinstance(b, Barrier) for a, b in zip(ops[:-1], ops[1:], strict=True))
        assert sum(op.kernel.name == "sample" for op in ops if not isinstance(op, (Barrier, Copy))) == 3
        levels = len(DECODE_LEVELS["tiny-qwen35"][0])  # the copy's the last
        assert sum(isinstance(op, Barrier) for op in ops) == 3 * levels + 1
    finally:
        be.close()


@pytest.mark.parametrize(("preset", "quant"), [("tiny-qwen35", "Q8_0"), ("tiny-qwen35moe", "Q4_K_M")])
def test_the_fused_plan_frees_what_its_groups_kept(model_path, preset: str, quant: str) -> None:  # type: ignore[no-untyped-def]
    """plan_buffers with the fusion groups: a value a group keeps alive past its last
    reader dies at the group's end, so the fused plan needs a few slots more than the
    unfused one, not more per layer (before the fix such values were never freed:
    qwen35-0.8b's fused plan had 198 slots against 18, 672 MiB of compute buffers
    against 75; here 37 against 13)."""
    be = VulkanBackend(load_gguf(model_path(preset, quant)), n_ctx=64, n_seq=1)
    try:
        plain = plan_buffers(be._ir)
        fused = plan_buffers(be._ir, fusion_groups(be._ir))
        assert fused.fusions and len(fused.slots) - len(plain.slots) <= 6, (len(fused.slots), len(plain.slots))
    finally:
        be.close()

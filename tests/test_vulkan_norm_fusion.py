"""RMSNorm folded into the matvecs that read it (matvec.comp's NORM_IN, forward.py's
``find_norm_fusions``): op by op against numpy's norm-then-product for every weight
type, the GATE_UP and ROPE_OUT forms and 1..8 columns; model by model, a decode with
the fusion equals numpy and the unfused lowering, with two barriers fewer per layer.
"""

from __future__ import annotations

import numpy as np
import pytest

from test_vulkan_ops import QTYPES, Env, make_weights, np_rms_norm, np_rope, open_env
from trio_llm.engine.backend import SeqBatch
from trio_llm.engine.reference import NumpyBackend
from trio_llm.model.gguf import load_gguf
from trio_llm.model.kvtypes import dequantize_rows, kv_type
from trio_llm.vulkan.backend import VulkanBackend
from trio_llm.vulkan.graph import Barrier, Dispatch
from trio_llm.vulkan.ops import ROPE_NORMAL, Ops

pytestmark = pytest.mark.vulkan


env = pytest.fixture(scope="module", name="env")(open_env)


def _inputs(ncol: int, n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """x [ncol, n] of varied magnitude per column (the scale must be per column) and a
    norm weight g [n] around 1, as real files have."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((ncol, n)).astype(np.float32) * rng.uniform(0.05, 20, (ncol, 1)).astype(np.float32)
    g = (1 + 0.5 * rng.standard_normal(n)).astype(np.float32)
    return x, g


@pytest.mark.parametrize(("qtype", "cols", "ncol", "eps"),
                         [(q, 512, 3, 1e-5) for q in QTYPES]
                         + [("Q8_0", 160, n, 1e-6) for n in (1, 2, 5, 8)]
                         + [("Q4_K", 256, 8, 1e-6), ("Q6_K", 768, 1, 1e-5), ("F16", 64, 7, 0.5)])
def test_matvec_normalizes_its_input(env: Env, qtype: str, cols: int, ncol: int, eps: float) -> None:
    """y = W . (rms_norm(x) * g) for every live column, also added into a residual;
    a large eps (0.5) checks where eps goes; columns past the live count untouched."""
    rows = 70
    raw, ref = make_weights(qtype, rows, cols, seed=21)
    x, g = _inputs(8, cols, seed=22)
    resid = np.random.default_rng(23).standard_normal((8, rows)).astype(np.float32)
    w, xv, gv, y, y2 = env.put(raw), env.put(x), env.put(g), env.zeros(8 * rows), env.put(resid)
    st = env.step([0] * ncol)
    kw = {"n_in": cols, "n_rows": rows, "x_stride": cols, "y_stride": rows, "norm": gv, "eps": eps}
    env.run([env.ops.matvec(qtype, w, xv, y, st, **kw), env.ops.matvec(qtype, w, xv, y2, st, add=True, **kw)])
    want = (np_rms_norm(x[:ncol], g, eps) @ ref.T).astype(np.float32)  # [ncol, rows]
    tol = 2e-5 * np.abs(want).max()
    got = env.get(y).reshape(8, rows)
    np.testing.assert_allclose(got[:ncol], want, atol=tol, rtol=0)
    assert not got[ncol:].any()
    np.testing.assert_allclose(env.get(y2).reshape(8, rows)[:ncol], want + resid[:ncol], atol=tol, rtol=0)


@pytest.mark.parametrize("qtype", ["F32", "F16", "Q8_0", "Q4_0", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS"])
def test_gate_up_normalizes_its_input(env: Env, qtype: str) -> None:
    """GATE_UP with NORM_IN: silu(G n) * (U n) for n = rms_norm(x) * g, 6 columns."""
    rows, cols, ncol, eps = 70, 512, 6, 1e-6
    graw, gref = make_weights(qtype, rows, cols, seed=24)
    uraw, uref = make_weights(qtype, rows, cols, seed=25)
    x, g = _inputs(ncol, cols, seed=26)
    w, xv, gv, y = env.put(np.concatenate([graw, uraw])), env.put(x), env.put(g), env.zeros(ncol * rows)
    st = env.step([0] * ncol)
    env.run([env.ops.matvec_gate_up(qtype, w, xv, y, st, n_in=cols, n_rows=rows, row_a=0, row_b=rows,
                                    x_stride=cols, y_stride=rows, norm=gv, eps=eps)])
    n = np_rms_norm(x, g, eps)
    a, b = n @ gref.T, n @ uref.T
    want = a / (1 + np.exp(-np.clip(a, -80, 80))) * b
    np.testing.assert_allclose(env.get(y).reshape(ncol, rows), want, atol=3e-5 * np.abs(want).max(), rtol=0)


@pytest.mark.parametrize(("qtype", "kv"), [("Q8_0", "f32"), ("Q4_K", "f32"), ("F16", "f32"), ("Q6_K", "f16"),
                                           ("Q8_0", "q8_0")])
def test_rope_out_normalizes_its_input(env: Env, qtype: str, kv: str) -> None:
    """ROPE_OUT with NORM_IN: the rotated projection of the normed input, in place and
    into the cache (f16 and q8_0 caches compared after their own rounding)."""
    ntok, heads, hd, cols, n_ctx, n_seq, eps = 4, 2, 32, 512, 40, 2, 1e-5
    rows = heads * hd
    raw, ref = make_weights(qtype, rows, cols, seed=28)
    x, g = _inputs(ntok, cols, seed=29)
    pos, seq = np.array([0, 39, 7, 3]), np.array([0, 1, 1, 0])
    factors = np.ones(hd // 2, np.float32)
    t = kv_type(kv)
    row_bytes = t.row_bytes(rows)
    w, xv, gv, fv = env.put(raw), env.put(x), env.put(g), env.put(factors)
    yq, kc = env.zeros(ntok * rows), env.put(np.zeros(n_seq * n_ctx * row_bytes, np.uint8))
    st = env.step([0] * ntok, pos, seq)
    kw = {"n_in": cols, "n_rows": rows, "x_stride": cols, "y_stride": rows, "head_dim": hd, "theta": 10000.0,
          "norm": gv, "eps": eps}
    env.run([
        env.ops.matvec_rope(qtype, w, xv, yq, st, fv, rope=True, **kw),
        env.ops.matvec_rope(qtype, w, xv, kc, st, fv, rope=True, to_cache=True, n_ctx=n_ctx, kv_type=kv, **kw),
    ])
    plain = np_rms_norm(x, g, eps) @ ref.T  # [ntok, rows]
    want = np_rope(plain.reshape(ntok, heads, hd), pos, 10000.0, ROPE_NORMAL, factors).reshape(ntok, rows)
    tol = 3e-5 * np.abs(plain).max()
    np.testing.assert_allclose(env.get(yq).reshape(ntok, rows), want, atol=tol, rtol=0)
    cache = env.get(kc, np.uint8).reshape(n_seq, n_ctx, row_bytes)
    step = {"f32": 0.0, "f16": 1e-3, "q8_0": 1.0 / 127}[kv] * np.abs(want).max()
    for i in range(ntok):
        got = dequantize_rows(cache[seq[i], pos[i]][None], t, rows)[0]
        np.testing.assert_allclose(got, want[i], atol=tol + step, rtol=0)


def _barriers(backend: VulkanBackend, bucket: int, ops: Ops | None = None) -> int:
    return sum(isinstance(op, Barrier) for op in backend.lowered(bucket, ops))


def _kernels(backend: VulkanBackend, bucket: int, ops: Ops | None = None) -> list[str]:
    return [op.kernel.name for op in backend.lowered(bucket, ops) if isinstance(op, Dispatch)]


@pytest.mark.usefixtures("f32_activations")
@pytest.mark.parametrize(("preset", "quant", "norms_left"),
                         [("tiny", "Q4_K_M", 0), ("tiny-qwen3", "Q8_0", 0), ("tiny-gemma3", "Q8_0", 2 * 6)])
def test_fused_decode_equals_numpy_and_the_unfused_graph(model_path, monkeypatch: pytest.MonkeyPatch,
                                                         preset: str, quant: str, norms_left: int) -> None:  # type: ignore[no-untyped-def]
    """Decode graphs lose the whole-row norms before q/k/v, the FFN and the head (two
    barriers per layer and one for the head), prefill graphs keep them, and greedy
    decode of two sequences equals numpy's and the unfused graph's. gemma3's
    post-attention and post-FFN norms feed residual adds and stay (``norms_left``);
    QK-norms are per head and stay out of NORM_IN (with the hybrid fusions on,
    TRIO_LLM_HYBRID_FUSE=1, each is in its head's qk_norm_rope instead)."""
    model = load_gguf(model_path(preset, quant))
    n_layer = model.config.n_layer
    kv = {"cache_type_k": "f32", "cache_type_v": "f32"}
    ref = NumpyBackend(model, n_ctx=64, n_seq=2, **kv)
    # the scalar f32 matmuls for the prompts: on a GPU the cooperative-matrix prefill
    # rounds to f16 (3.3e-4 of the logits' scale on the H200 in both graphs alike),
    # which would hide what this test compares
    monkeypatch.setenv("TRIO_LLM_COOPMAT", "0")
    monkeypatch.setenv("TRIO_LLM_FUSE_NORM", "1")
    fused = VulkanBackend(model, n_ctx=64, n_seq=2, **kv)
    monkeypatch.delenv("TRIO_LLM_FUSE_NORM")  # the default: off until the H200 A/B
    plain = VulkanBackend(model, n_ctx=64, n_seq=2, **kv)
    try:
        assert fused._ops.fuse_norm and not plain._ops.fuse_norm
        qk = 2 * n_layer if model.config.arch in ("qwen3", "gemma3") and not fused._ops.hybrid_fuse else 0
        for bucket in (1, 2, 8):
            norms = _kernels(fused, bucket).count("rms_norm")
            assert norms == qk + norms_left, (bucket, norms)
            assert _kernels(plain, bucket).count("rms_norm") == qk + norms_left + 2 * n_layer + 1
            assert _barriers(plain, bucket) - _barriers(fused, bucket) == 2 * n_layer + 1
        assert _kernels(fused, 64) == _kernels(plain, 64)  # prefill unchanged
        prompts = [np.array([1, 17, 250, 3, 999, 42, 7], np.int32), np.array([2, 300, 11], np.int32)]
        logits = {}
        for name, be in (("ref", ref), ("fused", fused), ("plain", plain)):
            out = be.forward([SeqBatch(i, p, 0) for i, p in enumerate(prompts)])
            pos = [len(p) for p in prompts]
            steps = []
            for _ in range(12):
                toks = [int(np.argmax(r)) for r in out]
                out = be.forward([SeqBatch(i, np.array([t], np.int32), pos[i]) for i, t in enumerate(toks)])
                pos = [p + 1 for p in pos]
                steps.append(out.copy())
            logits[name] = np.stack(steps)  # [steps, 2, n_vocab]
        scale = float(np.abs(logits["ref"]).max())
        assert float(np.abs(logits["fused"] - logits["ref"]).max()) <= 1e-4 * scale
        assert float(np.abs(logits["fused"] - logits["plain"]).max()) <= 1e-4 * scale
        assert (logits["fused"].argmax(-1) == logits["ref"].argmax(-1)).all()
    finally:
        plain.close()
        fused.close()
        ref.close()

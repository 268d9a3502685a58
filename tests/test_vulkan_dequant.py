"""TRIO_LLM_MATMUL_DEQUANT: prefill products that first decode a weight piece to f16 rows
(dequant_f16.comp) and then multiply those as F16.

The op against numpy's dequantization rounded to f16, for every weight type; the
lowering (which buckets and products take it, the scratch buffer's size) and whole
prefills against numpy's logits within the f16 rounding; the setting's parsing.
"""

from __future__ import annotations

import numpy as np
import pytest

from test_vulkan_model import F32_KV, PROMPTS, _prefill_within_f16
from test_vulkan_ops import Env, make_weights, open_env
from trio_llm.engine.backend import SeqBatch
from trio_llm.engine.reference import NumpyBackend
from trio_llm.errors import ConfigError
from trio_llm.graph import OUTPUTS
from trio_llm.model.gguf import load_gguf
from trio_llm.vulkan.backend import VulkanBackend
from trio_llm.vulkan.graph import Dispatch
from trio_llm.vulkan.ops import DEQUANT_DEFAULT_QTYPES, dequant_types_env, env_int
from trio_llm.vulkan.shaders import QTYPES

pytestmark = pytest.mark.vulkan

env = pytest.fixture(scope="module", name="env")(open_env)


@pytest.mark.parametrize("qtype", [q for q in QTYPES if q != "F16"])
def test_dequant_f16_equals_numpy_rounded(env: Env, qtype: str) -> None:
    """Every row of every type, and nothing past the matrix written (the scratch may be
    larger than the piece)."""
    rows, n = 37, 512
    raw, ref = make_weights(qtype, rows, n, seed=3)
    w = env.put(raw)
    y = env.put(np.full(rows * n // 2 + 64, 0x7E007E00, np.uint32))  # f16 NaN pairs past the end
    env.run([env.ops.dequant_f16(qtype, w, y, n_in=n, n_rows=rows)])
    got = env.get(y, np.uint32).view(np.float16)
    want = ref.astype(np.float16).reshape(-1)
    np.testing.assert_array_max_ulp(got[: rows * n], want, maxulp=1)
    assert (env.get(y, np.uint32)[rows * n // 2:] == 0x7E007E00).all()


def test_the_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    for value, want in (("", frozenset()), ("0", frozenset()), ("1", frozenset(DEQUANT_DEFAULT_QTYPES)),
                        ("Q4_K, Q8_0", frozenset({"Q4_K", "Q8_0"}))):
        monkeypatch.setenv("TRIO_LLM_MATMUL_DEQUANT", value)
        assert dequant_types_env() == want
    for bad in ("F16", "Q4_K,Q9_9", "yes"):
        monkeypatch.setenv("TRIO_LLM_MATMUL_DEQUANT", bad)
        with pytest.raises(ConfigError, match="TRIO_LLM_MATMUL_DEQUANT"):
            dequant_types_env()
    # the integer settings (env_int): unset or empty is the default, a non-integer one line
    monkeypatch.delenv("TRIO_LLM_MATMUL_DEQUANT_MIN", raising=False)
    assert env_int("TRIO_LLM_MATMUL_DEQUANT_MIN", 128) == 128
    monkeypatch.setenv("TRIO_LLM_MATMUL_DEQUANT_MIN", " 64 ")
    assert env_int("TRIO_LLM_MATMUL_DEQUANT_MIN", 128) == 64
    monkeypatch.setenv("TRIO_LLM_MATMUL_DEQUANT_MIN", "")
    assert env_int("TRIO_LLM_MATMUL_DEQUANT_MIN", 128) == 128
    monkeypatch.setenv("TRIO_LLM_MATMUL_DEQUANT_MIN", "abc")
    with pytest.raises(ConfigError, match="TRIO_LLM_MATMUL_DEQUANT_MIN='abc': not an integer"):
        env_int("TRIO_LLM_MATMUL_DEQUANT_MIN", 128)


def test_prefill_through_f16_rows(model_path, monkeypatch: pytest.MonkeyPatch,  # type: ignore[no-untyped-def]
                                  f32_activations: None) -> None:
    """A Q4_K_M file (Q4_K and Q6_K products) with the K-quants decoded first from 16
    tokens: the 32-token bucket decodes each token-row product's weights and multiplies
    them as F16, the decode buckets and the logits' product do not; the scratch holds
    the largest such matrix; numpy's logits within the f16 rounding, then the same
    decode steps as without it."""
    monkeypatch.setenv("TRIO_LLM_MATMUL_DEQUANT", "1")
    monkeypatch.setenv("TRIO_LLM_MATMUL_DEQUANT_MIN", "16")
    model = load_gguf(model_path("tiny-qwen3", "Q4_K_M"))
    ref = NumpyBackend(model, n_ctx=64, n_seq=2, **F32_KV)
    vk = VulkanBackend(model, n_ctx=64, n_seq=2, **F32_KV)
    try:
        lowered = [op for op in vk.lowered(32) if isinstance(op, Dispatch)]
        deq = [op for op in lowered if op.kernel.name == "dequant_f16"]
        linear = [n for n in vk._ir.nodes if n.op == "linear" and n.inputs[0].shape[0] != OUTPUTS]
        kq = [n for n in vk._ir.nodes if n.op == "linear"
              and vk._weights.slots[n.inputs[1].name].qtype in DEQUANT_DEFAULT_QTYPES]
        assert deq and len(deq) <= len(kq) and len(deq) <= len(linear)
        assert all(op.views[1].buffer is vk._act.bufs["wdq"] for op in deq)
        largest = max(2 * int(n.inputs[1].shape[0]) * int(n.inputs[1].shape[1]) for n in vk._ir.nodes
                      if n.op == "linear" and n in kq and n.inputs[0].shape[0] != OUTPUTS)
        assert vk._act.bufs["wdq"].size >= largest
        for bucket in (1, 2, 4, 8):
            assert not any(isinstance(op, Dispatch) and op.kernel.name == "dequant_f16" for op in vk.lowered(bucket))
        _prefill_within_f16(vk, ref, "dequant_f16", (), [])
        # sequence 0 holds 12 + 40 positions after those prefills, sequence 1 its prompt
        step = [SeqBatch(0, np.array([5], np.int32), 52), SeqBatch(1, np.array([9], np.int32), len(PROMPTS[1]))]
        want, got = ref.forward(step), vk.forward(step)
        assert float(np.abs(got - want).max()) <= 5e-3 * float(np.abs(want).max())
    finally:
        vk.close()
        ref.close()

"""Mixture of experts: the graph ops' shape checks, the qwen3moe files make-model
writes, and the numpy reference's lazy experts (agreement with llama.cpp is in
test_llamacpp_agreement.py)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

from trio_llm.engine.backend import SeqBatch
from trio_llm.engine.reference import NumpyBackend
from trio_llm.errors import GraphError
from trio_llm.graph import Graph
from trio_llm.model.gguf import load_gguf
from trio_llm.model.synth import CHUNK_VALUES, PRESETS, plan_tensors


def test_moe_ops_check_shapes_at_build_time() -> None:
    g = Graph(shapes={"r": (8, 64), "up": (8, 32, 64), "down": (8, 64, 32), "flat": (32, 64)})
    x = g.get_rows(g.weight("r"), g.tokens())  # [T, 64]
    logits = g.linear(x, g.weight("r"), "logits")  # [T, 8]
    routes = g.moe_topk(logits, 2, "topk")
    assert routes.shape == ("T", 4)
    up = g.moe_linear(x, g.weight("up"), routes, "up")
    assert up.shape == ("T", 2, 32)
    down = g.moe_linear(up, g.weight("down"), routes, "down")
    assert g.moe_combine(down, routes, "out").shape == ("T", 64)
    with pytest.raises(GraphError, match="top-9 of 8"):
        g.moe_topk(logits, 9, "bad")
    with pytest.raises(GraphError, match="3-D expert weights"):
        g.moe_linear(x, g.weight("flat"), routes, "bad")
    with pytest.raises(GraphError, match=r"input must be \[T, 32\]"):
        g.moe_linear(x, g.weight("down"), routes, "bad")
    with pytest.raises(GraphError, match="expert outputs"):
        g.moe_combine(x, routes, "bad")


def test_qwen3_30b_a3b_plan_has_real_shapes_and_bounded_chunks() -> None:
    plans = {t.name: t for t in plan_tensors(PRESETS["qwen3-30b-a3b"], "Q4_K_M")}
    assert plans["blk.0.ffn_gate_exps.weight"].shape == (128, 768, 2048)
    assert plans["blk.0.ffn_down_exps.weight"].shape == (128, 2048, 768)
    assert plans["blk.0.ffn_gate_inp.weight"].ggml_type == T.F32  # the router stays F32
    # llama-quantize's ffn_down rule reaches the experts' down (Q6_K in "more bits" layers)
    assert plans["blk.0.ffn_down_exps.weight"].ggml_type == T.Q6_K
    assert plans["blk.0.ffn_up_exps.weight"].ggml_type == T.Q4_K
    n_params = sum(math.prod(t.shape) for t in plans.values())
    assert 30.0e9 < n_params < 31.0e9, n_params
    for t in plans.values():  # a pool worker never holds a whole expert tensor
        for r0, r1 in t.chunks():
            assert (r1 - r0) * math.prod(t.shape[1:] or (1,)) <= max(CHUNK_VALUES, math.prod(t.shape[1:] or (1,)))


def test_numpy_dequantizes_experts_only_when_routed(model_path) -> None:  # type: ignore[no-untyped-def]
    model = load_gguf(model_path("tiny-qwen3moe", "Q4_K_M"))
    cfg = model.config
    assert (cfg.n_expert, cfg.n_expert_used, cfg.n_ff_exp) == (16, 4, 256)
    backend = NumpyBackend(model, n_ctx=32, n_seq=1)
    try:
        experts = backend._experts
        assert len(experts) == 3 * cfg.n_layer
        cache = next(iter(experts.values())).cache
        assert not cache  # nothing dequantized at load
        backend.forward([SeqBatch(0, np.array([5], np.int32), 0)])
        # one token: k experts of each of the three matrices of every layer
        assert len(cache) == 3 * cfg.n_layer * cfg.n_expert_used
        e = next(iter(cache))
        dense = model.tensor(e[0]).dequantize()[e[1]]
        np.testing.assert_array_equal(cache[e], dense)
    finally:
        backend.close()


@pytest.mark.usefixtures("f32_activations")
@pytest.mark.vulkan
def test_vulkan_batches_and_restores_moe_like_numpy(model_path) -> None:  # type: ignore[no-untyped-def]
    """Two sequences in one batch (prefill, then 2-column decode) route their tokens
    independently: Vulkan's greedy runs equal numpy's; and a release at every level
    (numpy reloads its lazily read experts, Vulkan its 3-D tensors) changes nothing."""
    from test_vulkan_model import PROMPTS, greedy_batched
    from trio_llm.engine.backend import Level
    from trio_llm.vulkan.backend import VulkanBackend

    model = load_gguf(model_path("tiny-qwen3moe", "Q4_K_M"))
    ref = NumpyBackend(model, n_ctx=48, n_seq=2)
    vk = VulkanBackend(model, n_ctx=48, n_seq=2)
    try:
        got_first, got = greedy_batched(vk, PROMPTS, 6)
        want_first, want = greedy_batched(ref, PROMPTS, 6)
        assert float(np.abs(got_first - want_first).max()) <= 2e-3 * float(np.abs(want_first).max())
        assert got == want
        for backend in (ref, vk):
            before = backend.forward([SeqBatch(0, PROMPTS[0], 0)])
            for level in (Level.WEIGHTS, Level.ALL, Level.UNLOAD):
                backend.release(level)
                backend.restore()
                np.testing.assert_allclose(backend.forward([SeqBatch(0, PROMPTS[0], 0)]), before, rtol=0, atol=1e-5)
    finally:
        vk.close()
        ref.close()


def test_vulkan_refuses_an_expert_width_its_kernels_cannot_tile(model_path) -> None:  # type: ignore[no-untyped-def]
    import attrs

    from trio_llm.errors import UnsupportedModelError
    from trio_llm.vulkan.backend import _check_shapes

    model = load_gguf(model_path("tiny-qwen3moe", "Q8_0"))
    _check_shapes(model, model.config)  # the preset itself is fine
    with pytest.raises(UnsupportedModelError, match="expert_feed_forward_length 40 is not a multiple of 32"):
        _check_shapes(model, attrs.evolve(model.config, n_ff_exp=40))

"""``--n-cpu-moe``: which expert tensors stay in host memory (whole layers, then the
boundary layer's gate and up), the one-line refusals, and on Vulkan the same logits
with those tensors read from host-visible memory, across release and restore."""

from __future__ import annotations

import numpy as np
import pytest

from trio_llm.engine.backend import Level, SeqBatch
from trio_llm.engine.placement import cpu_moe_tensors
from trio_llm.errors import InvalidRequest
from trio_llm.model.gguf import load_gguf
from trio_llm.model.synth import PRESETS
from trio_llm.models import tensor_shapes


def test_whole_layers_then_the_boundary_layers_gate_then_up() -> None:
    cfg = PRESETS["qwen3-30b-a3b"].config()
    assert cpu_moe_tensors(cfg, 0) == frozenset()
    two = cpu_moe_tensors(cfg, 2)
    assert two == {f"blk.{il}.ffn_{m}_exps.weight" for il in (0, 1) for m in ("gate", "up", "down")}
    assert cpu_moe_tensors(cfg, 2.5) == two | {"blk.2.ffn_gate_exps.weight"}
    assert cpu_moe_tensors(cfg, 2.75) == two | {"blk.2.ffn_gate_exps.weight", "blk.2.ffn_up_exps.weight"}
    assert len(cpu_moe_tensors(cfg, 48)) == 3 * 48


def test_bad_counts_and_dense_models_are_one_line() -> None:
    moe = PRESETS["tiny-qwen3moe"].config()
    with pytest.raises(InvalidRequest, match="exceeds the model's 2 layers"):
        cpu_moe_tensors(moe, 2.5)
    with pytest.raises(InvalidRequest, match="expected a layer count >= 0"):
        cpu_moe_tensors(moe, -1)
    with pytest.raises(InvalidRequest, match=r"has no expert weights"):
        cpu_moe_tensors(PRESETS["tiny"].config(), 1)


def test_deepseek2s_per_head_matrices_are_not_experts() -> None:
    """GLM-4.7-Flash's 3-D ``attn_k_b`` / ``attn_v_b`` (one matrix per head) and its
    shared expert stay on the device at any count: only llama.cpp's
    ``ffn_(up|down|gate)_exps`` move, and its leading dense layer has none."""
    cfg = PRESETS["glm-4.7-flash"].config()
    shapes = tensor_shapes(cfg)
    assert len(shapes["blk.1.attn_k_b.weight"]) == len(shapes["blk.1.attn_v_b.weight"]) == 3
    host = cpu_moe_tensors(cfg, cfg.n_layer) & set(shapes)
    assert host == {f"blk.{il}.ffn_{m}_exps.weight" for il in range(1, cfg.n_layer) for m in ("gate", "up", "down")}
    assert not cpu_moe_tensors(cfg, 1) & set(shapes)  # layer 0 is dense
    assert cpu_moe_tensors(cfg, 1.5) & set(shapes) == {"blk.1.ffn_gate_exps.weight"}


@pytest.mark.vulkan
def test_vulkan_deepseek2_with_host_experts_gives_the_same_logits(model_path) -> None:  # type: ignore[no-untyped-def]
    """tiny-deepseek2 (a dense layer 0, then experts) with ``--n-cpu-moe 2.5``: the
    experts of layer 1 and layer 2's gate in host memory, and exactly those bytes;
    logits as with everything on the device, across a release and restore."""
    from trio_llm.vulkan.backend import VulkanBackend

    model = load_gguf(model_path("tiny-deepseek2", "Q8_0"))
    prompt = np.array([5, 77, 301, 12, 9, 640, 33, 2, 18, 400, 71, 6], np.int32)
    base = VulkanBackend(model, n_ctx=32, n_seq=1)
    try:
        want = [base.forward([SeqBatch(0, prompt, 0)]), base.forward([SeqBatch(0, prompt[:1], 12)])]
    finally:
        base.close()
    vk = VulkanBackend(model, n_ctx=32, n_seq=1, n_cpu_moe=2.5)
    try:
        names = cpu_moe_tensors(model.config, 2.5) & set(model.tensors)
        assert names == {"blk.1.ffn_gate_exps.weight", "blk.1.ffn_up_exps.weight", "blk.1.ffn_down_exps.weight",
                         "blk.2.ffn_gate_exps.weight"}
        # the host segments hold those tensors (plus alignment), not a head matrix more
        pad = vk._weights.host_bytes() - sum(model.tensor(n).n_bytes for n in names)
        assert 0 <= pad < min(model.tensor(f"blk.{il}.attn_{m}_b.weight").n_bytes for il in (1, 2) for m in "kv")
        _same_across_releases(vk, prompt, want, (Level.ALL,))
    finally:
        vk.close()


@pytest.mark.vulkan
def test_vulkan_reads_host_experts_and_gives_the_same_logits(model_path) -> None:  # type: ignore[no-untyped-def]
    from trio_llm.vulkan.backend import VulkanBackend

    model = load_gguf(model_path("tiny-qwen3moe", "Q4_K_M"))
    prompt = np.array([5, 77, 301, 12, 9, 640, 33, 2, 18, 400, 71, 6], np.int32)
    base = VulkanBackend(model, n_ctx=32, n_seq=1)
    try:
        want = [base.forward([SeqBatch(0, prompt, 0)]), base.forward([SeqBatch(0, prompt[:1], 12)])]
        device_weights = base.memory()["weights"]
    finally:
        base.close()
    vk = VulkanBackend(model, n_ctx=32, n_seq=1, n_cpu_moe=1.5)
    try:
        host = vk._weights.host_bytes()
        assert host >= sum(model.tensor(n).n_bytes for n in cpu_moe_tensors(model.config, 1.5)) > 0
        assert vk.memory()["weights"] <= device_weights - host + (1 << 20)  # they left device memory
        _same_across_releases(vk, prompt, want, (Level.WEIGHTS, Level.ALL, Level.UNLOAD))
    finally:
        vk.close()


def _same_across_releases(vk, prompt: np.ndarray, want: list[np.ndarray], levels: tuple[Level, ...]) -> None:  # type: ignore[no-untyped-def]
    """The prompt's logits and one decode step's equal ``want`` exactly: as loaded, then
    after a release at each of ``levels`` and a restore."""
    for level in (None, *levels):
        if level is not None:
            vk.release(level)
            vk.restore()
        got = [vk.forward([SeqBatch(0, prompt, 0)]), vk.forward([SeqBatch(0, prompt[:1], 12)])]
        for g, w in zip(got, want, strict=True):
            np.testing.assert_array_equal(g, w)


def test_the_server_refuses_n_cpu_moe_on_a_dense_model_in_one_line(
    tiny_model, capsys: pytest.CaptureFixture[str]
) -> None:  # type: ignore[no-untyped-def]
    from trio_llm.runtime import main

    assert main(["-m", str(tiny_model), "--port", "0", "--backend", "numpy", "--n-cpu-moe", "1"]) == 1
    err = capsys.readouterr().err
    errors = [ln for ln in err.splitlines() if "error" in ln]
    assert len(errors) == 1 and "has no expert weights" in errors[0] and "Traceback" not in err
    assert main(["-m", str(tiny_model), "--port", "0", "--backend", "numpy", "--n-cpu-moe", "x"]) == 2


@pytest.mark.vulkan
def test_the_server_refuses_layers_on_the_cpu_in_one_line(tiny_model, capsys: pytest.CaptureFixture[str]) -> None:  # type: ignore[no-untyped-def]
    from trio_llm.runtime import main

    assert main(["-m", str(tiny_model), "--port", "0", "--backend", "vulkan", "-ngl", "1"]) == 1
    err = capsys.readouterr().err
    errors = [ln for ln in err.splitlines() if "error" in ln]
    assert len(errors) == 1 and "-ngl 1: keeping 1 of the model's 2 layers on the CPU" in errors[0]

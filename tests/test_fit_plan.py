"""``--fit`` and ``--arena-budget`` project a model's device memory with the Vulkan
backend's own plan (``VulkanBackend.plan``): its constructor's sizing on an allocator
that makes nothing. The plan must be what the backend then holds, byte for byte, for
every kind of memory a model has (full and sliding-window caches, a latent cache, the
delta-net state, expert maps, host experts, an embedding head, image rows)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from trio_llm.engine import fit
from trio_llm.model.gguf import load_gguf

pytestmark = pytest.mark.vulkan

MiB = 1 << 20

CASES = [
    ("tiny", dict(n_ctx=1024, n_seq=2, max_chunk=512)),
    ("tiny", dict(n_ctx=300, n_seq=3, max_chunk=64, cache_type_k="q8_0", cache_type_v="q4_0")),
    ("tiny-gemma3", dict(n_ctx=2048, n_seq=1, max_chunk=256)),  # sliding-window layers: window + a pass
    ("tiny-gemma3", dict(n_ctx=100, n_seq=2, max_chunk=8, cache_type_k="q8_0", cache_type_v="q8_0")),
    ("tiny-qwen35", dict(n_ctx=1024, n_seq=4, max_chunk=512, cache_type_k="q4_0", cache_type_v="q4_0")),
    ("tiny-qwen35moe", dict(n_ctx=512, n_seq=2, max_chunk=128)),
    ("tiny-qwen35moe", dict(n_ctx=512, n_seq=1, max_chunk=128, n_cpu_moe=2)),  # host experts: not device bytes
    ("tiny-deepseek2", dict(n_ctx=700, n_seq=2, max_chunk=512, cache_type_k="q8_0")),  # latent: K alone
    ("tiny-qwen3-embd", dict(n_ctx=256, n_seq=2, max_chunk=256, output="embd")),
]


@pytest.mark.parametrize(("preset", "kw"), CASES, ids=[f"{p}-{i}" for i, (p, _) in enumerate(CASES)])
def test_the_plan_is_what_the_backend_holds(model_path: Any, preset: str, kw: dict[str, Any]) -> None:
    from trio_llm.vulkan.backend import VulkanBackend

    model = load_gguf(model_path(preset, "Q8_0"))
    try:
        plan = VulkanBackend.plan(model, **kw)
        be = VulkanBackend(model, **kw)
        try:
            assert plan == be.memory()
            assert plan["weights"] > 0 and plan["kv_cache"] > 0 and plan["compute"] > 0
        finally:
            be.close()
    finally:
        model.close()


def test_the_plan_counts_what_the_formula_did_not(model_path: Any) -> None:
    """The formula counted K and V in every layer for every position. The plan counts a
    hybrid's attention layers only (with its fixed delta-net state) and stops a
    sliding-window layer's growth at its window: past the window, a position costs the
    global layers alone."""
    from trio_llm.engine.memory import plan_memory
    from trio_llm.models import build_graph
    from trio_llm.vulkan.backend import VulkanBackend

    hybrid = load_gguf(model_path("tiny-qwen35", "Q8_0"))
    gemma = load_gguf(model_path("tiny-gemma3", "Q8_0"))
    try:
        cfg = hybrid.config
        n_attn = sum(not r for r in cfg.recurrent_layers)
        assert 0 < n_attn < cfg.n_layer
        kv = [VulkanBackend.plan(hybrid, n_ctx=n, n_seq=1, max_chunk=64)["kv_cache"] for n in (1024, 2048)]
        assert kv[1] - kv[0] == 1024 * n_attn * cfg.kv_dim * 2 * 2  # f16 K and V of the attention layers
        assert kv[1] - kv[0] < 1024 * fit.kv_bytes_per_position(cfg, "f16", "f16")

        cfg = gemma.config
        layers = plan_memory(build_graph(cfg, {n: t.shape for n, t in gemma.tensors.items()}), n_ctx=8192, chunk=64)
        n_global = sum(m.kind == "kv" for m in layers)
        assert 0 < n_global < len(layers)
        kv = [VulkanBackend.plan(gemma, n_ctx=n, n_seq=1, max_chunk=64)["kv_cache"] for n in (4096, 8192)]
        assert kv[1] - kv[0] == 4096 * n_global * cfg.kv_dim * 2 * 2
    finally:
        hybrid.close()
        gemma.close()


def test_fit_chooses_the_largest_context_the_plan_fits(model_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """``fit_slot_ctx`` on the Vulkan backend with the free memory pinned (the device's
    figure moves with everything else on the machine): the chosen context's backend holds
    no more than the free memory less --fit-target, and one step more would not fit."""
    from trio_llm.runtime import device_need, fit_slot_ctx, parse_config
    from trio_llm.vulkan.backend import VulkanBackend

    path = model_path("tiny-qwen35", "Q8_0")
    args = ["-m", str(path), "--backend", "vulkan", "-np", "2", "-b", "64", "-ub", "64", "-ctk", "q8_0",
            "-ctv", "q8_0", "--fit-target", "1", "--fit-ctx", "512"]
    config = parse_config(args, {})
    model = load_gguf(path)
    try:
        need = device_need(config, model)
        free = need(2 * 1400) + MiB  # room for 1,400 positions a slot (of the 4096 trained) and a little
        monkeypatch.setattr(fit, "device_free_bytes", lambda selector=None: free)
        per_slot = fit_slot_ctx(config, model)
        assert per_slot == 1280  # the most 256-position steps of both slots under 1,400 a slot
        be = VulkanBackend(model, n_ctx=per_slot, n_seq=2, max_chunk=64, cache_type_k="q8_0", cache_type_v="q8_0")
        try:
            assert sum(be.memory().values()) == need(2 * per_slot) <= free - MiB
        finally:
            be.close()
        assert need(2 * (per_slot + 256)) > free - MiB
        # a context the user sets is kept, fitting or not
        assert fit_slot_ctx(parse_config([*args, "-c", "8192"], {}), model) == 4096
    finally:
        model.close()


def test_the_arena_footprint_is_the_plan(model_path: Any, tmp_path: Path) -> None:
    """``--arena-budget`` on the Vulkan backend counts the bytes the backend will hold at
    the context the load uses."""
    from trio_llm.runtime import arena_share, parse_config
    from trio_llm.vulkan.backend import VulkanBackend

    path = model_path("tiny-gemma3", "Q8_0")
    share = arena_share(parse_config(["-m", str(path), "--vram-arena", str(tmp_path), "-c", "4096", "-np", "2",
                                      "--backend", "vulkan", "--arena-budget", "512"], {}))
    model = load_gguf(path)
    try:
        be = VulkanBackend(model, n_ctx=2048, n_seq=2)
        try:
            held = sum(be.memory().values())
        finally:
            be.close()
    finally:
        model.close()
    assert share is not None and share.footprint == held

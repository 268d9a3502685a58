"""The Vulkan backend end to end against the numpy reference, on real synthetic GGUFs.

Both backends compute in float32 from the *same* dequantized weight values (the
shaders decode ggml blocks exactly as gguf's dequantizer does, see
test_vulkan_ops.py), so the weight type does not add error of its own: what differs
is only the order of float32 summation (subgroup trees and 64-wide tiles against
BLAS), which grows with the length of the dot products and the magnitude of the
activations, not with the quantization. Measured on lavapipe, the largest difference
of any logit, relative to the largest logit, is below 3e-6 for every type. The
tolerances below leave a margin of ~30x for other drivers' summation orders and fused
multiply-adds; they are per type only because the K-quant tensors of Q4_K_M mix two
block types, which we keep as a separate knob, not because any type needs more.
"""

from __future__ import annotations

import numpy as np
import pytest

from trio_llm.engine.backend import Level, SeqBatch
from trio_llm.engine.reference import NumpyBackend
from trio_llm.errors import BackendError, ContextOverflow, InvalidRequest
from trio_llm.model.gguf import load_gguf
from trio_llm.vulkan.backend import VulkanBackend

# the f32 path (tests/conftest.py f32_activations): these hold Vulkan to numpy at f32 tolerances
pytestmark = [pytest.mark.vulkan, pytest.mark.usefixtures("f32_activations")]

PRESETS = ["tiny", "tiny-qwen3", "tiny-qwen2", "tiny-spm"]
QUANTS = ["F32", "F16", "Q8_0", "Q4_0", "Q4_K", "Q6_K", "Q4_K_M", "Q3_K_M", "Q5_K_M"]

#: max |logit difference| / max |logit|, per weight type (see the module docstring)
REL_TOL = {"F32": 1e-4, "F16": 1e-4, "Q8_0": 1e-4, "Q4_0": 1e-4, "Q4_K": 1e-4, "Q6_K": 1e-4, "Q4_K_M": 1e-4,
           "Q3_K_M": 1e-4, "Q5_K_M": 1e-4}

#: the equivalence of the kernels is checked with a float32 cache: rounding K and V to
#: f16 (the default, as llama-server's) turns float32 summation-order noise into whole
#: f16 steps now and then, which flips near-ties of random weights; the cache types are
#: checked against llama.cpp itself (test_llamacpp_agreement.py) and op by op
#: (test_vulkan_kv.py)
F32_KV = {"cache_type_k": "f32", "cache_type_v": "f32"}

N_GREEDY = 64
N_CTX = 96
PROMPTS = [
    np.array([1, 17, 250, 3, 999, 42, 7, 7, 512, 100, 64, 9], np.int32),
    np.array([2, 300, 11, 800, 5], np.int32),
]


def greedy_batched(backend: VulkanBackend | NumpyBackend, prompts: list[np.ndarray], n: int) -> tuple[np.ndarray, list[list[int]]]:
    """Greedy runs of several sequences advanced together, one forward per step;
    each backend follows its own argmax, so a single flipped token fails the test."""
    vk = backend
    logits = vk.forward([SeqBatch(i, p, 0) for i, p in enumerate(prompts)])  # [B, n_vocab]
    first = logits
    outs: list[list[int]] = [[] for _ in prompts]
    pos = [len(p) for p in prompts]
    for _ in range(n):
        toks = [int(np.argmax(row)) for row in logits]
        for i, t in enumerate(toks):
            outs[i].append(t)
        logits = vk.forward([SeqBatch(i, np.array([t], np.int32), pos[i]) for i, t in enumerate(toks)])
        pos = [p + 1 for p in pos]
    return first, outs



def assert_follows_numpy(vk: VulkanBackend, ref: NumpyBackend, n: int = N_GREEDY, tol: float = 1e-4) -> None:
    """``greedy_batched`` on both backends: the first logits within ``tol`` of numpy's
    (relative to the largest) and the same greedy tokens."""
    got_first, got = greedy_batched(vk, PROMPTS, n)
    want_first, want = greedy_batched(ref, PROMPTS, n)
    assert float(np.abs(got_first - want_first).max()) <= tol * float(np.abs(want_first).max())
    assert got == want

@pytest.mark.parametrize("quant", QUANTS)
@pytest.mark.parametrize("preset", PRESETS)
def test_logits_and_greedy_match_reference(model_path, preset: str, quant: str) -> None:  # type: ignore[no-untyped-def]
    model = load_gguf(model_path(preset, quant))
    ref = NumpyBackend(model, n_ctx=N_CTX, n_seq=2, **F32_KV)
    vk = VulkanBackend(model, n_ctx=N_CTX, n_seq=2, **F32_KV)
    try:
        # two sequences in one batch (17 tokens: the tiled prefill kernels, then
        # 2-column decode); test_single_sequence_runs_equal_batched_runs covers the
        # equivalence of batched and lone sequences
        got_first, got = greedy_batched(vk, PROMPTS, N_GREEDY)
        want_first, want = greedy_batched(ref, PROMPTS, N_GREEDY)
        scale = float(np.abs(want_first).max())
        diff = float(np.abs(got_first - want_first).max())
        assert diff <= REL_TOL[quant] * scale, (preset, quant, diff, scale)
        assert got == want, (preset, quant)
    finally:
        vk.close()
        ref.close()


def test_single_sequence_runs_equal_batched_runs(model_path) -> None:  # type: ignore[no-untyped-def]
    """A sequence's logits do not depend on what else shares its batch."""
    model = load_gguf(model_path("tiny-qwen3", "Q8_0"))
    vk = VulkanBackend(model, n_ctx=32, n_seq=3, **F32_KV)
    try:
        batched = vk.forward([SeqBatch(0, PROMPTS[0], 0), SeqBatch(2, PROMPTS[1], 0)])
        step = vk.forward([SeqBatch(2, np.array([5], np.int32), 5), SeqBatch(0, np.array([6], np.int32), 12)])
        alone0 = vk.forward([SeqBatch(1, PROMPTS[0], 0)])
        alone2 = vk.forward([SeqBatch(1, PROMPTS[1], 0)])
        step2 = vk.forward([SeqBatch(1, np.array([5], np.int32), 5)])
        np.testing.assert_allclose(batched[0], alone0[0], atol=1e-5)
        np.testing.assert_allclose(batched[1], alone2[0], atol=1e-5)
        np.testing.assert_allclose(step[0], step2[0], atol=1e-5)
    finally:
        vk.close()


def test_chunked_prefill_equals_reference(model_path) -> None:  # type: ignore[no-untyped-def]
    """A batch larger than the biggest graph runs as chunks; entries may span chunks."""
    model = load_gguf(model_path("tiny", "Q4_K_M"))
    ref = NumpyBackend(model, n_ctx=64, n_seq=2, **F32_KV)
    vk = VulkanBackend(model, n_ctx=64, n_seq=2, max_chunk=16, **F32_KV)
    try:
        long = np.arange(3, 43, dtype=np.int32)  # 40 + 5 tokens: chunks of 16, 16, 13
        batch = [SeqBatch(0, long, 0), SeqBatch(1, PROMPTS[1], 0)]
        got = vk.forward(batch)
        want = np.stack([ref.forward([b])[0] for b in batch])
        np.testing.assert_allclose(got, want, atol=1e-4 * np.abs(want).max())
        assert vk.statistics().submits == 3
    finally:
        vk.close()
        ref.close()



def _prefill_within_f16(vk: VulkanBackend, ref: NumpyBackend, kernel: str, not_run: tuple[str, ...],
                        more: list[list[SeqBatch]]) -> None:
    """The 32-token bucket's graph runs ``kernel`` and none of ``not_run``; two
    sequences in one 17-token batch, a 40-token one after a cached prefix of 12, then
    ``more`` batches: numpy's logits within the f16 rounding (5e-3 of the largest)."""
    from trio_llm.vulkan.graph import Dispatch

    names = {op.kernel.name for op in vk.lowered(32) if isinstance(op, Dispatch)}
    assert kernel in names and not names & set(not_run), names
    for batch in ([SeqBatch(0, PROMPTS[0], 0), SeqBatch(1, PROMPTS[1], 0)],
                  [SeqBatch(0, np.arange(3, 43, dtype=np.int32), 12)], *more):
        want = ref.forward(batch)
        got = vk.forward(batch)
        assert float(np.abs(got - want).max()) <= 5e-3 * float(np.abs(want).max())

@pytest.mark.parametrize("sub", [32, 64])
def test_prefill_on_matmul_cm2_emulated(model_path, sub: int) -> None:  # type: ignore[no-untyped-def]
    """The prefill lowering with every dense product on matmul_cm2 (its products
    emulated, lavapipe has no cooperative matrices; TRIO_LLM_MATMUL_CM2=1 on a GPU):
    a mixed-type file (Q4_K_M: Q4_K and Q6_K), two sequences in one 17-token batch and a
    40-token one, numpy's logits within the f16 rounding of weights and activations."""

    model = load_gguf(model_path("tiny-qwen3", "Q4_K_M"))
    ref = NumpyBackend(model, n_ctx=64, n_seq=2, **F32_KV)
    vk = VulkanBackend(model, n_ctx=64, n_seq=2, **F32_KV)
    vk._ops.matmul_cm2_emulate = sub
    try:
        _prefill_within_f16(vk, ref, "matmul_cm2", ("matmul", "matmul_cm"), [])
    finally:
        vk.close()
        ref.close()


@pytest.mark.parametrize(("sub", "spec"), [(32, "v"), (64, "v+k64+b44+direct"), (32, "v+db+direct+w")])
def test_prefill_on_matmul_cm3_emulated(model_path, sub: int, spec: str) -> None:  # type: ignore[no-untyped-def]
    """The same prefills with every dense product on matmul_cm3 in a variant of the
    H200 sweep (TRIO_LLM_CM2_VARIANT; emulated, on the tile ``cm3_tile`` picks within
    lavapipe's shared memory), numpy's logits within the f16 rounding."""
    from trio_llm.vulkan.shaders import cm3_variant

    model = load_gguf(model_path("tiny-qwen3", "Q4_K_M"))
    ref = NumpyBackend(model, n_ctx=64, n_seq=2, **F32_KV)
    vk = VulkanBackend(model, n_ctx=64, n_seq=2, **F32_KV)
    vk._ops.matmul_cm2_emulate = sub
    vk._ops.matmul_cm2_variant = cm3_variant(spec)
    try:
        _prefill_within_f16(vk, ref, "matmul_cm3", ("matmul", "matmul_cm", "matmul_cm2"), [])
    finally:
        vk.close()
        ref.close()


@pytest.mark.parametrize(("sub", "rows"), [(32, 0), (64, 32)])
def test_prefill_on_attn_prefill_cm2_emulated(model_path, sub: int, rows: int) -> None:  # type: ignore[no-untyped-def]
    """The prefill lowering with its attention on attn_prefill_cm2 (each subgroup owning
    16 query rows; its products emulated, lavapipe has no cooperative matrices;
    TRIO_LLM_PREFILL_CM2=1 on a GPU), on 64-row tiles of 32 keys and 32-row tiles of 64
    keys: two sequences in one 17-token batch, a 40-token one after a cached prefix of 12
    (the tiles' key ranges start past 0) and the decode step after it, numpy's logits
    within the f16 rounding of q, K, V and the softmax weights."""

    model = load_gguf(model_path("tiny", "Q8_0"))
    ref = NumpyBackend(model, n_ctx=64, n_seq=2, **F32_KV)
    vk = VulkanBackend(model, n_ctx=64, n_seq=2, **F32_KV)
    vk._ops.prefill_cm2_emulate = sub
    vk._ops.prefill_rows_cm = rows
    try:
        _prefill_within_f16(vk, ref, "attn_prefill_cm2", ("attn_prefill", "attn_prefill_cm"),
                            [[SeqBatch(0, np.array([7], np.int32), 52)]])
    finally:
        vk.close()
        ref.close()


@pytest.mark.parametrize(("sub", "spec"), [(64, "v+rb2+pr+k16")])  # (each more: a minute of lavapipe's compiles)
def test_prefill_on_attn_prefill_cm3_emulated(model_path, sub: int, spec: str) -> None:  # type: ignore[no-untyped-def]
    """The same prefills with the attention on attn_prefill_cm3 in a variant of the H200
    sweep (TRIO_LLM_PREFILL_CM2_VARIANT; emulated, on the rows and keys its plan picks
    within lavapipe's shared memory; "+pr" only compiles its layout check here, the
    emulated products read P from shared memory), the decode step after them, numpy's
    logits within the f16 rounding."""
    from trio_llm.vulkan.shaders import attn_variant

    model = load_gguf(model_path("tiny", "Q8_0"))
    ref = NumpyBackend(model, n_ctx=64, n_seq=2, **F32_KV)
    vk = VulkanBackend(model, n_ctx=64, n_seq=2, **F32_KV)
    vk._ops.prefill_cm2_emulate = sub
    vk._ops.prefill_cm2_variant = attn_variant(spec)
    try:
        _prefill_within_f16(vk, ref, "attn_prefill_cm3", ("attn_prefill", "attn_prefill_cm", "attn_prefill_cm2"),
                            [[SeqBatch(0, np.array([7], np.int32), 52)]])
    finally:
        vk.close()
        ref.close()


@pytest.mark.parametrize("level", [Level.WEIGHTS, Level.ALL, Level.UNLOAD])
def test_release_restore_cycles_give_identical_output(model_path, level: Level) -> None:  # type: ignore[no-untyped-def]
    model = load_gguf(model_path("tiny-qwen2", "Q6_K"))
    vk = VulkanBackend(model, n_ctx=32, n_seq=1, **F32_KV)
    try:
        prompt = PROMPTS[0]
        first = vk.forward([SeqBatch(0, prompt, 0)])
        nxt = vk.forward([SeqBatch(0, np.array([9], np.int32), len(prompt))])
        resident = sum(vk.memory().values())
        for _ in range(2):
            vk.release(level)
            vk.release(level)  # idempotent
            cold = vk.memory()
            if level is Level.WEIGHTS:
                assert cold["weights"] == 0 and cold["kv_cache"] > 0
            else:
                assert sum(cold.values()) <= 0.05 * resident, cold
            if level is Level.ALL:  # the graphs stay, their commands given back
                assert vk._graphs and all(g.stale for g in vk._graphs.values())
            with pytest.raises(BackendError):
                vk.forward([SeqBatch(0, prompt, 0)])
            vk.restore()
            assert sum(vk.memory().values()) == resident
            if level is Level.UNLOAD:
                # the KV cache did not survive: recompute it from the prompt
                again = vk.forward([SeqBatch(0, prompt, 0)])
                np.testing.assert_array_equal(again, first)
            # the next token continues from the (restored or recomputed) cache
            np.testing.assert_array_equal(vk.forward([SeqBatch(0, np.array([9], np.int32), len(prompt))]), nxt)
        assert vk.statistics().restores == 2
    finally:
        vk.close()
        vk.close()  # safe twice


def test_escalating_release_then_close_in_every_state(model_path) -> None:  # type: ignore[no-untyped-def]
    model = load_gguf(model_path("tiny", "Q8_0"))
    vk = VulkanBackend(model, n_ctx=16, n_seq=1, **F32_KV)
    want = vk.forward([SeqBatch(0, PROMPTS[1], 0)])
    vk.forward([SeqBatch(0, np.array([4], np.int32), 5)])
    vk.release(Level.WEIGHTS)
    vk.release(Level.ALL)  # escalates: the KV cache now goes to the host too
    assert vk.host_memory()["kv_cache"] > 0
    assert sum(vk.memory().values()) == 0
    vk.restore()
    np.testing.assert_array_equal(vk.forward([SeqBatch(0, PROMPTS[1], 0)]), want)
    vk.release(Level.ALL)
    vk.close()  # closing while released frees the host copies too
    assert sum(vk.memory().values()) == 0
    with pytest.raises(BackendError):
        vk.restore()


def test_bad_batches_raise_typed_errors(model_path) -> None:  # type: ignore[no-untyped-def]
    model = load_gguf(model_path("tiny", "Q8_0"))
    vk = VulkanBackend(model, n_ctx=8, n_seq=2, **F32_KV)
    try:
        with pytest.raises(ContextOverflow):
            vk.forward([SeqBatch(0, np.arange(9, dtype=np.int32), 0)])
        with pytest.raises(InvalidRequest):
            vk.forward([SeqBatch(2, np.array([1], np.int32), 0)])
        with pytest.raises(InvalidRequest):
            vk.forward([SeqBatch(0, np.array([1], np.int32), 0), SeqBatch(0, np.array([1], np.int32), 1)])
        with pytest.raises(InvalidRequest):
            vk.forward([SeqBatch(0, np.array([5000], np.int32), 0)])
        with pytest.raises(InvalidRequest):
            vk.forward([])
        info = vk.device_info()
        assert info["backend"] == "vulkan" and info["name"]
    finally:
        vk.close()


@pytest.mark.parametrize(("preset", "quant"), [("tiny-qwen3", "Q8_0"), ("tiny", "Q4_K")])
def test_tensors_beyond_the_storage_range_are_bound_in_pieces(model_path, preset: str, quant: str) -> None:  # type: ignore[no-untyped-def]
    """With a binding limit of 128 KiB the 1024-row embedding and output head are
    split into row ranges (as llama-1b's 279 MB embedding is on lavapipe); the
    logits must not change."""
    import attrs

    from trio_llm.vulkan.device import shared_device

    model = load_gguf(model_path(preset, quant))
    whole = VulkanBackend(model, n_ctx=24, n_seq=2, **F32_KV)
    try:
        want = whole.forward([SeqBatch(0, PROMPTS[0], 0), SeqBatch(1, PROMPTS[1], 0)])
    finally:
        whole.close()
    device = shared_device()
    limits = device.limits
    device.limits = attrs.evolve(limits, max_storage_buffer_range=128 << 10)
    try:
        split = VulkanBackend(model, n_ctx=24, n_seq=2, **F32_KV)
        try:
            pieces = split._weights.pieces("token_embd.weight")
            assert len(pieces) > 1 and pieces[-1][2] == model.config.n_vocab
            got = split.forward([SeqBatch(0, PROMPTS[0], 0), SeqBatch(1, PROMPTS[1], 0)])
            step = split.forward([SeqBatch(1, np.array([7], np.int32), 5)])
        finally:
            split.close()
    finally:
        device.limits = limits
    np.testing.assert_array_equal(got, want)
    ref = NumpyBackend(model, n_ctx=24, n_seq=2, **F32_KV)
    ref.forward([SeqBatch(1, PROMPTS[1], 0)])
    want_step = ref.forward([SeqBatch(1, np.array([7], np.int32), 5)])
    np.testing.assert_allclose(step, want_step, atol=1e-4 * np.abs(want_step).max())


@pytest.mark.parametrize("host_import", ["1", "0"])
def test_weight_shadow_imported_or_copied(model_path, monkeypatch: pytest.MonkeyPatch, host_import: str) -> None:  # type: ignore[no-untyped-def]
    """Both shadows (the file's pages imported, or a one-time host copy, which is what
    GPUs use) restore the same weights; the copy is made once and kept across cycles."""
    monkeypatch.setenv("TRIO_LLM_VK_HOST_IMPORT", host_import)
    model = load_gguf(model_path("tiny-qwen3", "Q4_K_M"))
    vk = VulkanBackend(model, n_ctx=16, n_seq=1, **F32_KV)
    try:
        want = vk.forward([SeqBatch(0, PROMPTS[1], 0)])
        imported = vk.device_info()["weights_shadow"] == "imported"
        if host_import == "0":
            assert not imported
        if imported:
            assert vk.host_memory()["weights"] == 0
        else:
            assert vk.host_memory()["weights"] >= model.weight_bytes()
        shadows = [s.shadow for s in vk._weights.segments]
        for level in (Level.WEIGHTS, Level.ALL):
            vk.release(level)
            vk.restore()
            assert [s.shadow for s in vk._weights.segments] == shadows  # captured once
            np.testing.assert_array_equal(vk.forward([SeqBatch(0, PROMPTS[1], 0)]), want)
    finally:
        vk.close()


def test_twenty_release_restore_cycles_keep_greedy_output(model_path) -> None:  # type: ignore[no-untyped-def]
    """Twenty cycles, alternating the levels that keep the KV cache (weights, all):
    after each one the greedy continuation of a prompt evaluated *before* the release
    is the one computed with no release at all (weights and KV both came back)."""
    model = load_gguf(model_path("tiny", "Q4_K_M"))
    vk = VulkanBackend(model, n_ctx=64, n_seq=1, **F32_KV)

    def greedy_from(logits: np.ndarray, pos: int, n: int = 8) -> list[int]:
        out = []
        for _ in range(n):
            tok = int(np.argmax(logits[0]))
            out.append(tok)
            logits = vk.forward([SeqBatch(0, np.array([tok], np.int32), pos)])
            pos += 1
        return out

    try:
        prompt = PROMPTS[0]
        want = greedy_from(vk.forward([SeqBatch(0, prompt, 0)]), len(prompt))
        recorded = vk.statistics().graphs_recorded
        for cycle in range(20):
            first = vk.forward([SeqBatch(0, prompt, 0)])
            vk.release(Level.WEIGHTS if cycle % 2 == 0 else Level.ALL)
            vk.restore()
            assert greedy_from(first, len(prompt)) == want, f"cycle {cycle}"
        assert vk.statistics().restores == 20
        # the graphs survived every cycle (pointed at the new buffers, not recorded again)
        assert vk.statistics().graphs_recorded == recorded
    finally:
        vk.close()


@pytest.mark.parametrize("fail_at", [1, 2, 4])
def test_a_restore_that_runs_out_of_memory_midway_can_be_retried(model_path, monkeypatch: pytest.MonkeyPatch,
                                                                 fail_at: int) -> None:  # type: ignore[no-untyped-def]
    """The device refuses the ``fail_at``-th allocation of a restore at level all (some
    weights and KV buffers already made, copies in flight): restore raises the typed
    error, and the next restore brings everything back, the graphs pointing at the
    right buffers and the KV cache intact (the continuation of a prompt evaluated
    before the release is unchanged)."""
    from trio_llm.errors import DeviceOutOfMemory
    from trio_llm.vulkan.memory import Allocator

    model = load_gguf(model_path("tiny", "Q8_0"))
    vk = VulkanBackend(model, n_ctx=32, n_seq=1, **F32_KV)
    try:
        prompt = PROMPTS[0]
        vk.forward([SeqBatch(0, prompt, 0)])
        step = [SeqBatch(0, np.array([9], np.int32), len(prompt))]
        want = vk.forward(step)
        resident = vk.memory()
        vk.release(Level.ALL)
        real_create = Allocator.create
        calls = {"n": 0}

        def refusing(self, size: int, category: str, place: str = "device"):  # type: ignore[no-untyped-def]
            if place == "device" and category in ("weights", "kv_cache"):
                calls["n"] += 1
                if calls["n"] == fail_at:
                    raise DeviceOutOfMemory(f"refused allocation {fail_at} (test)")
            return real_create(self, size, category, place)

        monkeypatch.setattr(Allocator, "create", refusing)
        with pytest.raises(DeviceOutOfMemory):
            vk.restore()
        assert vk.level is Level.ALL  # still released
        with pytest.raises(BackendError):
            vk.forward(step)
        monkeypatch.setattr(Allocator, "create", real_create)
        vk.restore()
        assert vk.memory() == resident  # nothing leaked, nothing missing
        np.testing.assert_array_equal(vk.forward(step), want)
    finally:
        vk.close()


@pytest.mark.parametrize("kind", ["numpy", "vulkan"])
def test_kv_of_a_sequence_copied_to_another_continues_it(model_path, kind: str) -> None:  # type: ignore[no-untyped-def]
    """read_kv of sequence 0 written into sequence 1 (what a slot save and restore
    do): the next token of sequence 1 has the logits sequence 0 would give; the
    cache read back equals what was written, on both backends."""
    model = load_gguf(model_path("tiny", "Q8_0"))
    be = VulkanBackend(model, n_ctx=32, n_seq=2, **F32_KV) if kind == "vulkan" else NumpyBackend(model, n_ctx=32, n_seq=2, **F32_KV)
    try:
        prompt = PROMPTS[0]
        be.forward([SeqBatch(0, prompt, 0)])
        kv = be.read_kv(0, len(prompt))
        cfg = be.config
        assert kv.shape == (cfg.n_layer, 2, len(prompt), cfg.n_head_kv * cfg.head_dim) and np.abs(kv).max() > 0
        be.write_kv(1, kv)
        np.testing.assert_array_equal(be.read_kv(1, len(prompt)), kv)
        nxt = np.array([9], np.int32)
        want = be.forward([SeqBatch(0, nxt, len(prompt))])
        np.testing.assert_array_equal(be.forward([SeqBatch(1, nxt, len(prompt))]), want)
        assert be.read_kv(1, 0).shape[2] == 0
    finally:
        be.close()


@pytest.mark.parametrize("quant", ["Q8_0", "Q4_K_M"])
def test_gemma3_ring_caches_match_reference(model_path, quant: str) -> None:  # type: ignore[no-untyped-def]
    """tiny-gemma3 (window 16) with chunks of 8: its sliding-window layers keep rings of
    24 rows, which 76 positions wrap three times; the global layer keeps them all. The
    Vulkan backend follows numpy's greedy path and logits."""
    model = load_gguf(model_path("tiny-gemma3", quant))
    ref = NumpyBackend(model, n_ctx=N_CTX, n_seq=2, max_chunk=8, **F32_KV)
    vk = VulkanBackend(model, n_ctx=N_CTX, n_seq=2, max_chunk=8, **F32_KV)
    try:
        assert [m.rows for m in ref.layers] == [m.rows for m in vk._mem] == [24] * 5 + [N_CTX]
        assert_follows_numpy(vk, ref)
    finally:
        vk.close()
        ref.close()

"""The physical batch (-ub) above 512 tokens: one forward pass of up to 4096 prompt
tokens on the Vulkan backend (``max_chunk``), the step buffer's arrays as long as the
largest bucket (its header says how long: ``common.glsl``), and attention_prefill's
key splits by bucket (``Ops.prefill_splits``).

Against the numpy reference on the architectures whose prefill has state of its own
across a chunk: llama (plain attention), gemma-3 (sliding windows over a ring),
qwen3moe (the chunk's expert grouping) and qwen35 (the delta rule's recurrent state).
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from trio_llm.engine.backend import SeqBatch
from trio_llm.engine.reference import NumpyBackend
from trio_llm.errors import InvalidRequest
from trio_llm.model.gguf import load_gguf
from trio_llm.vulkan.ops import SPLIT_TOKENS, STEP_HEADER, Ops, fill_step, step_words
from trio_llm.vulkan.shaders import MAX_STEP_CAP, STEP_CAP

F32_KV = {"cache_type_k": "f32", "cache_type_v": "f32"}


def test_fill_step_lays_the_arrays_out_by_the_buffer_length() -> None:
    """The header's third word is the arrays' length, and each array starts that many
    words after the previous one: what STEP_POS / STEP_SEQ / STEP_OUT / STEP_VIS read."""
    for cap in (STEP_CAP, 2048):
        words = np.full(step_words(cap), 7, np.uint32)
        fill_step(words, np.array([11, 12, 13], np.uint32), np.array([100, 101, 102], np.uint32),
                  np.array([0, 0, 1], np.uint32), np.array([2], np.uint32))
        h = STEP_HEADER
        assert words[:3].tolist() == [3, 1, cap]
        assert words[h : h + 3].tolist() == [11, 12, 13]
        assert words[h + cap : h + cap + 3].tolist() == [100, 101, 102]
        assert words[h + 2 * cap : h + 2 * cap + 3].tolist() == [0, 0, 1]
        assert words[h + 3 * cap] == 2
        assert (words[h + 4 * cap : h + 5 * cap] == 7).all()  # STEP_VIS: left alone unless given
        fill_step(words, np.array([11, 12, 13], np.uint32), np.array([100, 101, 102], np.uint32),
                  np.array([0, 0, 1], np.uint32), np.array([2], np.uint32), np.array([101, 101, 102], np.uint32))
        assert words[h + 4 * cap : h + 4 * cap + 3].tolist() == [101, 101, 102]
        assert len(words) == h + 5 * cap
    with pytest.raises(AssertionError):
        fill_step(np.zeros(step_words(16), np.uint32), np.zeros(17, np.uint32), np.zeros(17, np.uint32),
                  np.zeros(17, np.uint32), np.zeros(1, np.uint32))


def test_prefill_splits_shrink_as_the_bucket_grows() -> None:
    """512-token chunks keep the split tuned on the H200 (one per 8k of context, up to
    4); a bucket of b tokens splits at most SPLIT_TOKENS / b ways, so 2048 and more
    never split, and the partials are sized for the largest bucket x its splits."""
    dev = SimpleNamespace(limits=SimpleNamespace(max_shared_memory=48 * 1024), name="stand-in")
    ops = Ops(SimpleNamespace(device=dev), subgroup=32)  # type: ignore[arg-type]
    assert SPLIT_TOKENS == 2048
    at32k = [ops.prefill_splits(32768, 32, 8, 64, bucket=b) for b in (16, 256, 512, 1024, 2048, 4096)]
    assert at32k == [4, 4, 4, 2, 1, 1]
    assert ops.prefill_splits(16384, 32, 8, 64, bucket=512) == 2
    assert ops.prefill_splits(4096, 32, 8, 64, bucket=16) == 1
    assert ops.prefill_splits(32768, 32, 8, 64, window=1024, bucket=512) == 1
    floats = ops.prefill_part_floats(32768, 32, 8, 64, cap=4096)
    assert floats == 512 * 32 * 4 * 66  # the 512 bucket's four splits; 1024 x 2 is as many
    assert ops.prefill_part_floats(4096, 32, 8, 64, cap=4096) == 0


@pytest.mark.vulkan
@pytest.mark.parametrize("preset", ["tiny", "tiny-gemma3", "tiny-qwen3moe", "tiny-qwen35"])
def test_one_pass_of_2048_tokens_equals_the_reference(model_path, monkeypatch, preset: str) -> None:  # type: ignore[no-untyped-def]
    """A 1,300-token prompt in one submit of the 2048 bucket, and in three of 512, then
    eight decode steps of numpy's greedy tokens: every step's logits within the
    tolerance of numpy's (relative to the largest), and on the scalar f32 products
    (lavapipe) the same greedy tokens. Where the device has cooperative matrices (the
    H200: ``bash bench/h200.sh ubatch`` runs this first) the prefill products and
    attention round to f16, so the tolerance is theirs (5e-3) and the tokens are not
    compared: random weights have near-ties that f16 may flip."""
    from trio_llm.vulkan.backend import VulkanBackend

    monkeypatch.setenv("TRIO_LLM_MATVEC_Q8", "0")  # decode steps on f32 activations, as numpy's
    model = load_gguf(model_path(preset, "Q8_0"))
    n_ctx = 1400
    prompt = np.random.default_rng(3).integers(0, model.config.n_vocab, 1300).astype(np.int32)
    ref = NumpyBackend(model, n_ctx=n_ctx, n_seq=1, **F32_KV)
    big = VulkanBackend(model, n_ctx=n_ctx, n_seq=1, max_chunk=2048, **F32_KV)
    small = VulkanBackend(model, n_ctx=n_ctx, n_seq=1, max_chunk=512, **F32_KV)
    try:
        f16 = big._ops.coopmat
        tol = 5e-3 if f16 else 1e-4
        want = [ref.forward([SeqBatch(0, prompt, 0)])]
        toks = []
        for i in range(8):
            toks.append(int(np.argmax(want[-1][0])))
            want.append(ref.forward([SeqBatch(0, np.array([toks[-1]], np.int32), len(prompt) + i)]))
        for be, passes in ((big, 1), (small, 3)):
            before = be.statistics().submits
            got = [be.forward([SeqBatch(0, prompt, 0)])]
            assert be.statistics().submits - before == passes
            for i, t in enumerate(toks):
                got.append(be.forward([SeqBatch(0, np.array([t], np.int32), len(prompt) + i)]))
            for step, (g, w) in enumerate(zip(got, want, strict=True)):
                err = float(np.abs(g - w).max()) / float(np.abs(w).max())
                assert err <= tol, f"{passes} pass(es), step {step}: {err:.2e} > {tol}"
                if not f16:
                    assert int(np.argmax(g[0])) == int(np.argmax(w[0]))
    finally:
        for be in (ref, big, small):
            be.close()


@pytest.mark.vulkan
def test_chunk_bounds(model_path) -> None:  # type: ignore[no-untyped-def]
    """max_chunk rounds up to a power of two and stops at MAX_STEP_CAP; 0 is refused."""
    from trio_llm.vulkan.backend import VulkanBackend

    model = load_gguf(model_path("tiny", "Q8_0"))
    with pytest.raises(InvalidRequest):
        VulkanBackend(model, n_ctx=64, n_seq=1, max_chunk=0)
    be = VulkanBackend(model, n_ctx=MAX_STEP_CAP * 2, n_seq=1, max_chunk=MAX_STEP_CAP * 4, **F32_KV)
    try:
        assert be._cap == MAX_STEP_CAP
        prompt = np.random.default_rng(5).integers(0, model.config.n_vocab, MAX_STEP_CAP + 100).astype(np.int32)
        be.forward([SeqBatch(0, prompt, 0)])
        assert be.statistics().submits == 2  # 4096 + 100
    finally:
        be.close()
    be = VulkanBackend(model, n_ctx=2048, n_seq=1, max_chunk=600, **F32_KV)
    try:
        assert be._cap == 1024
    finally:
        be.close()

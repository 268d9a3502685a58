"""KV shifting (``--cache-reuse``, engine/kvshift.py) on both backends (numpy and
Vulkan on lavapipe): llama-server's chunk choice, the moved K equal to numpy's RoPE of
the original at the new positions (through the quantized caches' Hadamard rotation),
V moved as is, and through the slots loop greedy answers equal to a fresh evaluation's
on a one-layer model (whose cache depends only on each token and its position)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import trio

from test_server_http import start  # noqa: F401  (the fixture: a real server on loopback)
from trio_llm.engine.actor import BackendActor
from trio_llm.engine.backend import Backend, SeqBatch
from trio_llm.engine.kvshift import Move, k_ropes, reuse_chunks, shift_k
from trio_llm.engine.loader import open_backend
from trio_llm.engine.reference import apply_rope, rope_angles
from trio_llm.engine.sampling import SamplingParams
from trio_llm.errors import BackendError
from trio_llm.graph import Node, Tensor
from trio_llm.model.gguf import load_gguf
from trio_llm.model.kvtypes import hadamard, rotation_blocks, roundtrip
from trio_llm.model.tokenizer import Tokenizer
from trio_llm.models import build_graph
from trio_llm.server.gate import AlwaysAwake
from trio_llm.server.queue import SlotsMessage, TaskQueue, outbox_size
from trio_llm.server.slots import SlotsEngine
from trio_llm.server.tasks import ServerTask, TaskFinal, TaskParams, TaskResult

BACKENDS = ["numpy", "vulkan"]


def test_reuse_chunks_is_llama_servers_loop() -> None:
    cache = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]
    # prefix 2; then 6 7 8 (3 >= 3) found at cache 5 -> prompt 2; then 11 12 too short (2 < 3)
    assert reuse_chunks(cache, [1, 2, 6, 7, 8, 11, 12], 2, 3) == (5, [Move(5, 2, 3)])
    assert reuse_chunks(cache, [1, 2, 6, 7, 8, 11, 12], 2, 2) == (7, [Move(5, 2, 3), Move(10, 5, 2)])
    # a prompt token that the cache never holds stops the scan at the cache's end
    assert reuse_chunks(cache, [1, 2, 99, 6, 7, 8], 2, 1) == (2, [])
    assert reuse_chunks(cache, [1, 2, 3], 3, 1) == (3, [])


def _open(path: Path, kind: str, n_seq: int, ctk: str = "f16", ctv: str = "f16") -> Backend:
    try:
        return open_backend(kind, load_gguf(path), n_ctx=128, n_seq=n_seq, cache_type_k=ctk, cache_type_v=ctv)
    except Exception as exc:  # no Vulkan device at all on this machine
        if kind == "vulkan" and type(exc).__name__ == "BackendUnavailable":
            pytest.skip(f"no Vulkan device: {exc}")
        raise


@pytest.mark.parametrize("kind", BACKENDS)
@pytest.mark.parametrize(("preset", "ctk", "ctv"), [("tiny", "f16", "f16"), ("tiny", "q8_0", "q4_0"),
                                                    ("tiny-qwen3", "q4_1", "f16")])
def test_the_moved_k_is_the_rope_of_the_original_at_its_new_positions(
    model_path, kind: str, preset: str, ctk: str, ctv: str
) -> None:  # type: ignore[no-untyped-def]
    path = model_path(preset, "Q8_0")
    be = _open(path, kind, 1, ctk, ctv)
    try:
        assert be.can_shift is True
        rng = np.random.default_rng(3)
        toks = rng.integers(10, 1000, 40).astype(np.int32)
        be.forward([SeqBatch(0, toks, 0)])
        before = be.read_kv(0, 40)  # [L, 2, 40, kv_dim]
        src, dst, n = 22, 7, 18
        be.shift_kv(0, [Move(src, dst, n)])  # type: ignore[attr-defined]
        after = be.read_kv(0, 40)
    finally:
        be.close()
    cfg = load_gguf(path).config
    graph_ropes = k_ropes(build_graph(cfg, {k: t.shape for k, t in load_gguf(path).tensors.items()}))
    hd = cfg.head_dim
    kb, _ = rotation_blocks(ctk, ctv, hd)
    for il, rope in graph_ropes.items():
        assert rope is not None
        cos, sin = rope_angles(hd, rope.attr("theta"), 128, None, rope.attr("freq_scale"))
        k = before[il, 0, src : src + n].reshape(n, -1, hd)  # [n, n_kv, hd] as stored
        k = hadamard(k, kb) if kb else k
        raw = apply_rope(k, cos[src : src + n], -sin[src : src + n], rope.attr("mode"))  # the unroped K
        want = apply_rope(raw, cos[dst : dst + n], sin[dst : dst + n], rope.attr("mode"))
        want = roundtrip((hadamard(want, kb) if kb else want).reshape(n, -1), ctk)
        got = after[il, 0, dst : dst + n]
        scale = float(np.abs(want).max())
        # a quantized K is encoded again: a value may land one step of its block away
        tol = {"f16": 2e-3, "q8_0": 2.0 / 127, "q4_1": 2.0 / 15}[ctk] * scale
        np.testing.assert_allclose(got, want, atol=tol)
        assert np.mean(np.abs(got - want)) < tol / 4
        np.testing.assert_array_equal(after[il, 1, dst : dst + n], before[il, 1, src : src + n])  # V as is
        np.testing.assert_array_equal(after[il, :, :dst], before[il, :, :dst])  # the prefix untouched


async def _answers(path: Path, kind: str, prompts: list[list[int]], reuse: int,
                   cache_prompt: bool = True) -> list[TaskFinal]:
    """Greedy answers (end of generation banned) of ``prompts`` in turn on one slot."""
    be = _open(path, kind, 1)
    try:
        model = load_gguf(path)
        tok = Tokenizer.from_metadata(model.metadata)
        out: list[TaskFinal] = []
        async with trio.open_nursery() as nursery:
            actor = BackendActor(be)
            await nursery.start(actor.run)
            send, recv = trio.open_memory_channel[SlotsMessage](outbox_size(1))
            gate = AlwaysAwake()
            queue = TaskQueue.create(1, send, gate)
            slots = SlotsEngine(actor.client(), gate, tok, queue.inbox(), recv, n_ctx=128, n_batch=512)
            await nursery.start(queue.start_loop)
            await nursery.start(slots.start_loop)
            bias = tuple((e, -np.inf) for e in sorted(tok.eog_ids))
            for prompt in prompts:
                s, r = trio.open_memory_channel[TaskResult](8)
                params = TaskParams(n_predict=6, sampling=SamplingParams(temperature=0.0, logit_bias=bias, n_probs=2),
                                    n_cache_reuse=reuse, cache_prompt=cache_prompt)
                await queue.post(ServerTask(queue.new_id_task(), tuple(prompt), params, s))
                (final,) = [m async for m in r]
                assert isinstance(final, TaskFinal)
                out.append(final)
            nursery.cancel_scope.cancel()
        return out
    finally:
        be.close()


@pytest.mark.parametrize("kind", BACKENDS)
async def test_cache_reuse_answers_equal_a_fresh_evaluation(model_path, kind: str) -> None:  # type: ignore[no-untyped-def]
    path = model_path("tiny-1layer", "Q8_0")
    rng = np.random.default_rng(12)
    head, dropped, chunk = ([int(t) for t in rng.integers(10, 1000, m)] for m in (5, 15, 30))
    first = [1, *head, *dropped, *chunk]
    second = [1, *head, *chunk, 77]  # the chunk now right after the head: 15 positions lower
    reused = await _answers(path, kind, [first, second], reuse=8)
    fresh = (await _answers(path, kind, [second], reuse=0, cache_prompt=False))[0]
    plain = await _answers(path, kind, [first, second], reuse=0)
    got = reused[1]
    assert got.timings.cache_n == 1 + 5 + 30 > plain[1].timings.cache_n == 6  # the chunk moved, not evaluated
    assert got.timings.prompt_n == 1  # only the new last token
    # the logits move by float rounding only (~1e-5 with an f16 cache): equal greedy
    # tokens are the claim where no step's top two are that close (this prompt's closest
    # are 0.05 apart in log-probability)
    assert min(p.top[0][1] - p.top[1][1] for p in fresh.probs) > 1e-3
    assert got.tokens == fresh.tokens == plain[1].tokens
    for a, b in zip(got.probs, fresh.probs, strict=True):
        assert abs(a.logprob - b.logprob) < 1e-3


@pytest.mark.parametrize("preset", ["tiny-gemma3", "tiny-qwen35"])
async def test_memory_that_cannot_shift_keeps_prefix_reuse(model_path, preset: str) -> None:  # type: ignore[no-untyped-def]
    """A sliding-window layer or a recurrent state cannot move (llama.cpp's
    ``llama_memory_can_shift`` is false for them): ``n_cache_reuse`` is ignored there
    and the common prefix is what is reused; the backend refuses a shift."""
    path = model_path(preset, "Q8_0")
    be = _open(path, "numpy", 1)
    try:
        assert be.can_shift is False
        with pytest.raises(BackendError, match="cannot shift"):
            be.shift_kv(0, [Move(10, 2, 4)])  # type: ignore[attr-defined]
    finally:
        be.close()
    rng = np.random.default_rng(12)
    head, dropped, chunk = ([int(t) for t in rng.integers(10, 1000, m)] for m in (5, 15, 30))
    prompts = [[1, *head, *dropped, *chunk], [1, *head, *chunk, 77]]
    got = (await _answers(path, "numpy", prompts, reuse=8))[1]
    plain = (await _answers(path, "numpy", prompts, reuse=0))[1]
    # gemma3: the 6-token prefix; qwen35: none (its state's checkpoints lie past it)
    assert got.timings.cache_n == plain.timings.cache_n == {"tiny-gemma3": 6, "tiny-qwen35": 0}[preset]
    assert got.tokens == plain.tokens


async def test_the_flag_reaches_requests_through_http(start, model_path) -> None:  # type: ignore[no-untyped-def]  # noqa: F811
    """``--cache-reuse 8`` is the default of the request field ``n_cache_reuse``, shown in
    ``generation_settings``; a request's own 0 turns it off."""
    h = await start(model=model_path("tiny-1layer", "Q8_0"), parallel=1, cache_reuse=8)
    rng = np.random.default_rng(12)
    head, dropped, chunk = ([int(t) for t in rng.integers(10, 1000, m)] for m in (5, 15, 30))
    first, second = [1, *head, *dropped, *chunk], [1, *head, *chunk, 77]
    async with httpx.AsyncClient(base_url=h.url, timeout=60) as c:
        async def ask(prompt: list[int], **kw: object) -> dict[str, Any]:
            r = await c.post("/completion", json={"prompt": prompt, "n_predict": 2} | kw)
            assert r.status_code == 200, r.text
            return r.json()  # type: ignore[no-any-return]

        await ask(first)
        moved = await ask(second)
        await ask(first)
        off = await ask(second, n_cache_reuse=0)
        bad = await c.post("/completion", json={"prompt": second, "n_cache_reuse": "x"})
    assert moved["generation_settings"]["n_cache_reuse"] == 8
    assert moved["timings"]["cache_n"] == 36 and off["timings"]["cache_n"] == 6
    assert bad.status_code == 400 and "n_cache_reuse" in bad.json()["error"]["message"]


@pytest.mark.parametrize(("mode", "n_rot", "factors", "freq_scale", "kb"), [
    ("normal", 0, False, 1.0, 0), ("neox", 0, True, 0.25, 64), ("neox", 16, False, 1.0, 0), ("normal", 32, True, 1.0, 64),
])
def test_shift_k_is_rope_at_the_sum_of_the_positions(mode: str, n_rot: int, factors: bool, freq_scale: float,
                                                     kb: int) -> None:
    """``shift_k(rope(x, p), d) == rope(x, p + d)`` through the forward's own rotation:
    both RoPE layouts, partial RoPE, frequency factors (llama 3), linear scaling and the
    quantized caches' Hadamard rotation (stored K rotated, the shift undoing it first)."""
    hd, n_kv, n = 64, 2, 12
    rng = np.random.default_rng(1)
    nr = n_rot or hd
    f = rng.uniform(1.0, 8.0, nr // 2).astype(np.float32) if factors else None
    attrs_ = {"n_heads": n_kv, "head_dim": hd, "mode": mode, "theta": 1e4, "freq_scale": freq_scale}
    if n_rot:
        attrs_["n_rot"] = n_rot
    x_t = Tensor(0, (1, n_kv * hd), "k", "value")
    node = Node("rope", Tensor(1, (1, n_kv * hd), "k_rope", "value"), (x_t,), attrs_, 0)
    cos, sin = rope_angles(nr, 1e4, 128, f, freq_scale)
    x = rng.standard_normal((n, n_kv, hd)).astype(np.float32)

    def rope_at(pos: np.ndarray) -> np.ndarray:
        y = x.copy()
        y[..., :nr] = apply_rope(y[..., :nr], cos[pos], sin[pos], mode)
        return hadamard(y, kb) if kb else y

    p = np.arange(40, 40 + n)
    got = shift_k(rope_at(p).reshape(n, -1), -33, node, f, kb)
    np.testing.assert_allclose(got, rope_at(p - 33).reshape(n, -1), atol=2e-5)

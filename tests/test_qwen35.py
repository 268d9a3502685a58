"""Gated delta-net hybrids (qwen35) on the numpy reference: the recurrent state a
sequence carries between forward passes, its memory kind (reusable only as the whole
cached sequence), release/restore, and prefix reuse through the slots loop. Agreement
with llama.cpp is in test_llamacpp_agreement.py."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import trio

from test_server_slots import answer, make_rig
from trio_llm.engine.backend import Level, SeqBatch
from trio_llm.engine.memory import LayerMemory, reusable_prefix
from trio_llm.engine.reference import NumpyBackend
from trio_llm.errors import BackendError, GraphError
from trio_llm.graph import Graph
from trio_llm.model.gguf import load_gguf

PROMPT = np.array([17, 230, 5, 891, 64, 300, 12, 77, 450, 9, 601, 33], np.int32)


@pytest.fixture(scope="module", params=["tiny-qwen35", "tiny-qwen35moe"])
def model(model_path, request):  # type: ignore[no-untyped-def]
    return load_gguf(model_path(request.param, "Q8_0"))


def test_the_hybrid_pattern_and_its_memory_plan(model) -> None:  # type: ignore[no-untyped-def]
    cfg = model.config
    assert cfg.recurrent_layers == (True, True, True, False) and cfg.n_rot == 16
    be = NumpyBackend(model, n_ctx=32, n_seq=2)
    try:
        assert [m.layer for m in be.layers] == [3]  # one layer with a KV cache
        assert [(m.layer, m.kind) for m in be.recurrent] == [(0, "recurrent"), (1, "recurrent"), (2, "recurrent")]
        # a recurrent state continues only from all of itself
        assert be.reusable_prefix(10, 10) == 10 and be.reusable_prefix(10, 12) == 10
        assert be.reusable_prefix(10, 9) == 0 and be.reusable_prefix(10, 3) == 0
    finally:
        be.close()
    kinds = [LayerMemory(0, "kv", 64, 0, 8), LayerMemory(1, "recurrent", 0, 0, 0)]
    assert reusable_prefix(kinds, 20, 20) == 20 and reusable_prefix(kinds, 20, 19) == 0


def test_the_state_carries_a_sequence_across_passes_and_sequences_apart(model) -> None:  # type: ignore[no-untyped-def]
    be = NumpyBackend(model, n_ctx=32, n_seq=2)
    try:
        whole = be.forward_all_logits(PROMPT, seq_id=0)  # [12, n_vocab] in one pass
        # the same sequence in three passes (prefill pieces, then decode), in slot 1,
        # while slot 0 runs something else in the same batches
        other = np.array([3, 4, 5, 6, 7], np.int32)
        be.forward([SeqBatch(1, PROMPT[:5], 0), SeqBatch(0, other, 0)])
        be.forward([SeqBatch(1, PROMPT[5:11], 5)])
        last = be.forward([SeqBatch(1, PROMPT[11:], 11), SeqBatch(0, PROMPT[:1], 5)])
        np.testing.assert_allclose(last[0], whole[-1], rtol=0, atol=1e-4)
        # a pass that does not start where the state stopped is refused, by name
        with pytest.raises(BackendError, match="recurrent state holds 12 positions; it cannot continue at 7"):
            be.forward([SeqBatch(1, PROMPT[:2], 7)])
        # position 0 starts the state afresh
        again = be.forward([SeqBatch(1, PROMPT, 0)])
        np.testing.assert_allclose(again[0], whole[-1], rtol=0, atol=1e-4)
    finally:
        be.close()


@pytest.mark.parametrize("level", [Level.WEIGHTS, Level.ALL, Level.UNLOAD])
def test_release_keeps_the_state_or_says_it_is_gone(model, level: Level) -> None:  # type: ignore[no-untyped-def]
    be = NumpyBackend(model, n_ctx=32, n_seq=1)
    try:
        be.forward([SeqBatch(0, PROMPT[:11], 0)])
        state_bytes = be.memory()["kv_cache"]
        be.release(level)
        if level is not Level.WEIGHTS:
            assert be.memory()["kv_cache"] == 0 and be.host_memory()["kv_cache"] == (
                state_bytes if level is Level.ALL else 0)
        be.restore()
        if level is Level.UNLOAD:  # nothing survived: the state starts again at position 0
            with pytest.raises(BackendError, match="holds 0 positions"):
                be.forward([SeqBatch(0, PROMPT[11:], 11)])
            be.forward([SeqBatch(0, PROMPT[:11], 0)])
        got = be.forward([SeqBatch(0, PROMPT[11:], 11)])
        want = be.forward_all_logits(PROMPT)[-1]
        np.testing.assert_allclose(got[0], want, rtol=0, atol=1e-4)
    finally:
        be.close()


def test_qwen35moe_adds_routed_and_gated_shared_experts(model_path) -> None:  # type: ignore[no-untyped-def]
    cfg = load_gguf(model_path("tiny-qwen35moe", "Q8_0")).config
    assert (cfg.n_expert, cfg.n_expert_used, cfg.n_ff_exp, cfg.n_ff_shexp) == (16, 4, 256, 256)
    from trio_llm.models import build_graph, tensor_shapes

    g = build_graph(cfg, tensor_shapes(cfg))
    ops = [n.op for n in g.nodes if n.layer == 0]
    assert ops.count("moe_linear") == 3 and ops.count("gate_rows") == 1 and "delta_net" in ops
    assert tensor_shapes(cfg)["blk.0.ffn_gate_inp_shexp.weight"] == (256,)


def test_delta_net_ops_check_shapes_at_build_time() -> None:
    g = Graph(shapes={"w": (64, 16), "conv": (64, 4), "dt": (4,), "a": (4,), "a3": (3,)})
    g.layer(0)
    x = g.get_rows(g.weight("w"), g.tokens())  # [T, 16]
    h = g.linear(x, g.weight("w"), "h")  # [T, 64]
    c = g.ssm_conv(h, g.weight("conv"), "conv")
    q = g.take(c, 64, 0, 16, "q")  # [T, 16]: 2 k heads of 8
    v = g.take(c, 64, 32, 32, "v")  # [T, 32]: 4 v heads of 8
    gate = g.take(c, 64, 60, 4, "gate")  # [T, 4]
    out = g.delta_net(q, q, v, gate, gate, g.weight("dt"), g.weight("a"), "dn", n_k_heads=2, n_v_heads=4, head_dim=8)
    assert out.shape == ("T", 32) and g.take(h, 16, 8, 8, "halves").shape == ("T", 32)
    with pytest.raises(GraphError, match="take"):
        g.take(h, 16, 10, 8, "bad")
    with pytest.raises(GraphError, match=r"dt and a must be \[4\]"):
        g.delta_net(q, q, v, gate, gate, g.weight("dt"), g.weight("a3"), "bad", n_k_heads=2, n_v_heads=4,
                    head_dim=8)
    with pytest.raises(GraphError, match="do not share"):
        g.delta_net(q, q, v, gate, gate, g.weight("dt"), g.weight("a"), "bad", n_k_heads=3, n_v_heads=4,
                    head_dim=8)


@pytest.mark.usefixtures("f32_activations")
@pytest.mark.vulkan
@pytest.mark.parametrize("split", ["0", "4"], ids=["column", "split4"])
def test_vulkan_carries_the_state_as_numpy_does_and_keeps_it_across_release(model, monkeypatch,  # type: ignore[no-untyped-def]
                                                                            split: str) -> None:
    """Two sequences in one batch (one continued in pieces, one fresh), then decode:
    Vulkan's logits equal numpy's; a release at every level (the state copied to the host
    and back at ``all``, dropped at ``unload``) continues the same. ``split``:
    TRIO_LLM_DELTA_SPLIT, the delta rule's split-lane form (4 lanes per state column)."""
    from trio_llm.vulkan.backend import VulkanBackend

    monkeypatch.setenv("TRIO_LLM_DELTA_SPLIT", split)
    ref = NumpyBackend(model, n_ctx=32, n_seq=2)
    vk = VulkanBackend(model, n_ctx=32, n_seq=2)
    try:
        assert vk._ops.delta_split == int(split)
        other = np.array([3, 4, 5, 6, 7], np.int32)
        for be in (ref, vk):
            be.forward([SeqBatch(1, PROMPT[:5], 0), SeqBatch(0, other, 0)])
            be.forward([SeqBatch(1, PROMPT[5:11], 5)])
        want = ref.forward([SeqBatch(1, PROMPT[11:], 11), SeqBatch(0, PROMPT[:1], 5)])
        got = vk.forward([SeqBatch(1, PROMPT[11:], 11), SeqBatch(0, PROMPT[:1], 5)])
        scale = float(np.abs(want).max())
        np.testing.assert_allclose(got, want, rtol=0, atol=2e-3 * scale)
        nxt = np.array([9], np.int32)
        # the reference for the releases: the prompt as one batch, as they replay it (on a
        # GPU a 12-token batch takes the chunked delta rule, the pieces above the
        # recurrence: equal to numpy within the tolerance above, not to the last bit)
        vk.forward([SeqBatch(1, PROMPT, 0)])
        before = vk.forward([SeqBatch(1, nxt, 12)])
        for level in (Level.WEIGHTS, Level.ALL, Level.UNLOAD):
            vk.forward([SeqBatch(1, PROMPT, 0)])
            vk.release(level)
            cold = vk.memory()
            if level is not Level.WEIGHTS:
                assert cold["kv_cache"] == 0
            vk.restore()
            if level is Level.UNLOAD:  # the state is gone: recomputed from position 0
                vk.forward([SeqBatch(1, PROMPT, 0)])
            np.testing.assert_allclose(vk.forward([SeqBatch(1, nxt, 12)]), before, rtol=0, atol=1e-5 * scale)
        # the same memory kinds as numpy: only the whole cached sequence continues
        assert vk.reusable_prefix(10, 10) == 10 and vk.reusable_prefix(10, 9) == 0
        with pytest.raises(BackendError, match="recurrent state holds 13 positions; it cannot continue at 7"):
            vk.forward([SeqBatch(1, PROMPT[:2], 7)])
    finally:
        vk.close()
        ref.close()


async def test_slots_reuse_a_whole_cached_sequence_and_recompute_a_cut_one(
    model_path, nursery: trio.Nursery
) -> None:  # type: ignore[no-untyped-def]
    path = model_path("tiny-qwen35", "Q8_0")
    r = await make_rig(path, nursery, n_seq=1, n_ctx=128)
    first = await answer(r, [int(t) for t in PROMPT])
    # the next turn extends everything the slot holds: its state continues
    turn = [int(t) for t in PROMPT] + list(first.tokens) + [40, 41, 42]
    got = await answer(r, turn)
    assert got.timings.cache_n > len(PROMPT)
    # a prompt that shares only a prefix cannot cut the state back: recomputed
    cut = [int(t) for t in PROMPT[:6]] + [50, 51]
    got_cut = await answer(r, cut)
    assert got_cut.timings.cache_n == 0
    fresh = await make_rig(path, nursery, n_seq=1, n_ctx=128)
    assert (await answer(fresh, turn)).tokens == got.tokens
    fresh2 = await make_rig(path, nursery, n_seq=1, n_ctx=128)
    assert (await answer(fresh2, cut)).tokens == got_cut.tokens


@pytest.mark.parametrize("backend", ["numpy", pytest.param("vulkan", marks=pytest.mark.vulkan)])
async def test_a_hybrid_server_sleeps_at_all_and_continues_its_cached_turn(
    model_path, nursery: trio.Nursery, backend: str, tmp_path
) -> None:  # type: ignore[no-untyped-def]
    """Through a real server: after ``POST /sleep?level=all`` the same request gives the
    same greedy answer and reuses its prompt (from the context checkpoint taken before
    its last token), and the next turn (everything the slot holds, and more) reuses
    the cache, recurrent state included; cold device memory at ``all`` is at most 5 %
    of resident."""
    import httpx

    from trio_llm.config import ServerConfig
    from trio_llm.runtime import serve

    done = trio.Event()

    async def run(config: ServerConfig, *, task_status: Any) -> None:
        try:
            await serve(config, task_status=task_status)
        finally:
            done.set()

    config = ServerConfig(model=model_path("tiny-qwen35", "Q8_0"), port=0, backend=backend, ctx_size=256,
                          parallel=1, shutdown_timeout=2.0, temp=0.0, sleep_idle_seconds=3600,
                          slot_save_path=tmp_path)
    h = await nursery.start(run, config)
    with trio.fail_after(60):
        await h.context.loaded.wait()
    prompt = [int(t) for t in PROMPT]
    try:
        async with httpx.AsyncClient(base_url=h.url, timeout=60) as c:
            first = (await c.post("/completion", json={"prompt": prompt, "n_predict": 6, "return_tokens": True})).json()
            resident = (await c.get("/props")).json()["residency"]["device_bytes_total"]
            assert (await c.post("/sleep?level=all")).json()["is_sleeping"] is True
            cold = (await c.get("/props")).json()["residency"]["device_bytes_total"]
            assert resident > 0 and cold <= 0.05 * resident
            again = (await c.post("/completion", json={"prompt": prompt, "n_predict": 6, "return_tokens": True})).json()
            assert again["tokens"] == first["tokens"]
            # the same prompt after the wake continues from the checkpoint before its last token
            assert again["timings"]["cache_n"] == len(prompt) - 1
            assert (await c.post("/sleep?level=all")).json()["is_sleeping"] is True
            turn = prompt + first["tokens"] + [40, 41, 42]
            nxt = (await c.post("/completion", json={"prompt": turn, "n_predict": 4, "return_tokens": True})).json()
            assert nxt["timings"]["cache_n"] >= len(prompt) + len(first["tokens"]) - 1
            # a slot file carries the recurrent state with the KV cache: after a restore
            # the slot continues exactly as it would have without the round trip
            saved = (await c.post("/slots/0?action=save", json={"filename": "turn.bin"})).json()
            assert saved["n_saved"] == len(turn) + len(nxt["tokens"]) - 1
            cont = turn + nxt["tokens"] + [43, 44]
            want = (await c.post("/completion", json={"prompt": cont, "n_predict": 4, "return_tokens": True})).json()
            assert want["timings"]["cache_n"] == saved["n_saved"]
            other = (await c.post("/completion", json={"prompt": [5, 6, 7], "n_predict": 2})).json()
            assert other["timings"]["cache_n"] == 0  # the slot now holds something else
            restored = (await c.post("/slots/0?action=restore", json={"filename": "turn.bin"})).json()
            assert restored["n_restored"] == saved["n_saved"]
            got = (await c.post("/completion", json={"prompt": cont, "n_predict": 4, "return_tokens": True})).json()
            assert got["tokens"] == want["tokens"] and got["timings"]["cache_n"] == saved["n_saved"]
            # a file of this model without the state is refused, by name
            from trio_llm.server import slot_file

            cfg = load_gguf(model_path("tiny-qwen35", "Q8_0")).config
            slot_file.save(tmp_path / "nostate.bin", cfg, [1, 2], np.zeros((cfg.n_layer, 2, 2, cfg.kv_dim), np.float32))
            bad = await c.post("/slots/0?action=restore", json={"filename": "nostate.bin"})
            assert bad.status_code == 400 and "no recurrent state" in bad.json()["error"]["message"]
    finally:
        h.shutdown()
        with trio.fail_after(10):
            await done.wait()
    # the same turn from nothing gives the same answer
    fresh = NumpyBackend(load_gguf(model_path("tiny-qwen35", "Q8_0")), n_ctx=256, n_seq=1)
    try:
        logits = fresh.forward([SeqBatch(0, np.array(turn, np.int32), 0)])
        assert int(np.argmax(logits[0])) == nxt["tokens"][0]
    finally:
        fresh.close()


def test_the_chunked_prefill_form_equals_the_recurrence() -> None:
    """The delta rule's prefill form (chunks of 64, llama.cpp's) against the token by
    token recurrence, over 150 tokens (three chunks, the last partial) from a nonzero
    state, with strong and weak decays."""
    from trio_llm.engine.reference import _delta_chunk

    rng = np.random.default_rng(4)
    n, nv, d = 150, 3, 16
    q = rng.standard_normal((n, nv, d)).astype(np.float32)
    k = rng.standard_normal((n, nv, d)).astype(np.float32)
    q /= np.linalg.norm(q, axis=-1, keepdims=True) * np.sqrt(d)
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    v = rng.standard_normal((n, nv, d)).astype(np.float32)
    g = (-np.abs(rng.standard_normal((n, nv))) * np.array([0.01, 1.0, 8.0])).astype(np.float32)
    beta = (1 / (1 + np.exp(-rng.standard_normal((n, nv))))).astype(np.float32)
    s0 = (0.1 * rng.standard_normal((nv, d, d))).astype(np.float32)
    s_ref, want = s0.copy(), np.empty_like(v)
    for t in range(n):
        s_ref *= np.exp(g[t])[:, None, None]
        delta = (v[t] - np.einsum("hij,hi->hj", s_ref, k[t])) * beta[t][:, None]
        s_ref += k[t][:, :, None] * delta[:, None, :]
        want[t] = np.einsum("hij,hi->hj", s_ref, q[t])
    s, got = s0.copy(), np.empty_like(v)
    for c0 in range(0, n, 64):
        got[c0 : c0 + 64] = _delta_chunk(s, q[c0 : c0 + 64], k[c0 : c0 + 64], v[c0 : c0 + 64], g[c0 : c0 + 64],
                                         beta[c0 : c0 + 64])
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-5)
    np.testing.assert_allclose(s, s_ref, rtol=0, atol=2e-5)


@pytest.mark.vulkan
def test_vulkan_prefills_in_chunks_and_continues_from_a_previous_prefill(model, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Prefill buckets run the chunked delta rule when asked (``recurrent.chunked_prefill``;
    decode buckets always the recurrence): a prompt of 130 tokens,
    then 71 more continuing its state (neither a multiple of the chunk, the second
    starting mid-chunk), then a decode step, equal numpy's logits. On the scalar f32
    products (TRIO_LLM_COOPMAT=0): numpy's tolerance here is f32's, and on a GPU the
    cooperative-matrix products' f16 tiles moved tiny-qwen35moe's logits by 2x that
    (the H200, 2026-12-04)."""
    from trio_llm.vulkan.backend import VulkanBackend

    monkeypatch.setenv("TRIO_LLM_DELTA_CHUNKED", "1")
    monkeypatch.setenv("TRIO_LLM_COOPMAT", "0")
    monkeypatch.setenv("TRIO_LLM_MATVEC_Q8", "0")

    rng = np.random.default_rng(7)
    toks = rng.integers(0, model.config.n_vocab, 202).astype(np.int32)
    ref = NumpyBackend(model, n_ctx=256, n_seq=1)
    vk = VulkanBackend(model, n_ctx=256, n_seq=1)
    try:
        kernels = {d.kernel.name for d in vk.lowered(256) if hasattr(d, "kernel")}
        assert {"delta_prep", "delta_chunk"} <= kernels and "delta_net" not in kernels
        assert "delta_net" in {d.kernel.name for d in vk.lowered(1) if hasattr(d, "kernel")}
        for piece in (SeqBatch(0, toks[:130], 0), SeqBatch(0, toks[130:201], 130), SeqBatch(0, toks[201:], 201)):
            want, got = ref.forward([piece]), vk.forward([piece])
            np.testing.assert_allclose(got, want, rtol=0, atol=2e-3 * float(np.abs(want).max()))
    finally:
        vk.close()
        ref.close()


@pytest.mark.parametrize("backend", ["numpy", pytest.param("vulkan", marks=pytest.mark.vulkan)])
def test_a_state_read_and_written_back_continues_exactly(model, backend: str) -> None:  # type: ignore[no-untyped-def]
    """``read_state`` after 11 tokens, the sequence overwritten by another prompt, then
    ``write_state`` + the KV rows back: the next token's logits are those of the
    uninterrupted run. The vector is the shared layout: numpy continues from Vulkan's."""
    from trio_llm.engine.memory import state_floats

    if backend == "vulkan":
        from trio_llm.vulkan.backend import VulkanBackend

        be: Any = VulkanBackend(model, n_ctx=32, n_seq=1)
    else:
        be = NumpyBackend(model, n_ctx=32, n_seq=1)
    ref = NumpyBackend(model, n_ctx=32, n_seq=1)
    try:
        be.forward([SeqBatch(0, PROMPT[:11], 0)])
        state, kv, raw_at_11 = be.read_state(0), be.read_kv(0, 11), be.read_state(0, raw=True)
        assert state.shape == (state_floats(be.graph if backend == "numpy" else be._ir),) and state.any()
        want = be.forward([SeqBatch(0, PROMPT[11:], 11)])
        be.forward([SeqBatch(0, PROMPT[::-1].copy(), 0)])  # something else in the sequence
        with pytest.raises(BackendError, match="holds 12 positions"):
            be.forward([SeqBatch(0, PROMPT[11:], 11)])
        be.write_kv(0, kv)
        be.write_state(0, state, 11)
        np.testing.assert_allclose(be.forward([SeqBatch(0, PROMPT[11:], 11)]), want, rtol=0, atol=1e-5)
        # the backend's own layout (the checkpoints' copies) goes back the same way
        be.forward([SeqBatch(0, PROMPT[::-1].copy(), 0)])
        be.write_kv(0, kv)
        be.write_state(0, raw_at_11, 11, raw=True)
        np.testing.assert_allclose(be.forward([SeqBatch(0, PROMPT[11:], 11)]), want, rtol=0, atol=1e-5)
        ref.write_kv(0, kv)
        ref.write_state(0, state, 11)
        np.testing.assert_allclose(ref.forward([SeqBatch(0, PROMPT[11:], 11)]), want, rtol=0,
                                   atol=2e-3 * float(np.abs(want).max()))
        with pytest.raises(BackendError, match="a recurrent state of 3 values"):
            be.write_state(0, state[:3], 11)
    finally:
        be.close()
        ref.close()

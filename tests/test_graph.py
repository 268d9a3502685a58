"""The model layer: graphs built from the architecture files, their shape checks, the
buffer plan and memory plan derived from them, and the Vulkan lowering's fusions."""

from __future__ import annotations

import attrs
import numpy as np
import pytest

from trio_llm.engine.memory import LayerMemory, plan_memory, reusable_prefix
from trio_llm.engine.reference import NumpyBackend
from trio_llm.errors import GraphError
from trio_llm.graph import TOKENS, Graph
from trio_llm.model.gguf import load_gguf
from trio_llm.model.synth import PRESETS
from trio_llm.models import build_graph, tensor_shapes
from trio_llm.vulkan.forward import plan_buffers

ARCH_PRESETS = ["tiny", "tiny-qwen2", "tiny-qwen3", "tiny-gemma3", "tiny-gemma-embd", "llama-8b", "gemma3-4b", "tiny-qwen3moe", "tiny-qwen35",
                "qwen3-30b-a3b", "qwen35-9b", "tiny-qwen35moe", "qwen35-35b-a3b"]


def _graph(preset: str) -> Graph:
    cfg = PRESETS[preset].config()
    return build_graph(cfg, tensor_shapes(cfg))


def test_a_shape_mismatch_is_an_error_at_build_time_naming_node_and_shapes() -> None:
    g = Graph(shapes={"w": (8, 16)})
    x = g.get_rows(g.weight("w"), g.tokens())  # [T, 16]
    g.layer(3)
    y = g.linear(x, g.weight("w"), "proj")  # [T, 8]
    with pytest.raises(GraphError, match=r"^blk\.3\.bad: linear of blk\.3\.proj\[T, 8\] by w\[8, 16\]: "
                                         r"input width 8 != 16$"):
        g.linear(y, g.weight("w"), "bad")
    with pytest.raises(GraphError, match=r"the model needs tensor 'nope', which the file lacks"):
        g.weight("nope")
    with pytest.raises(GraphError, match="rms_norm of .* needs a weight \\[4\\]"):
        g.rms_norm(y, g.weight("w"), 1e-5, "n", group=4)


def test_a_file_missing_a_tensor_fails_the_build_with_its_name() -> None:
    cfg = PRESETS["tiny"].config()
    shapes = tensor_shapes(cfg)
    del shapes["blk.1.ffn_up.weight"]
    with pytest.raises(GraphError, match="'blk.1.ffn_up.weight'"):
        build_graph(cfg, shapes)
    shapes = tensor_shapes(cfg)
    shapes["blk.0.attn_k.weight"] = (64, 256)  # half the KV width
    with pytest.raises(GraphError, match=r"blk\.0\.Kcur_rope: rope of 2 heads of 64 needs \[T, 128\], got blk\.0\.Kcur\[T, 64\]"):
        build_graph(cfg, shapes)


@pytest.mark.parametrize("preset", ARCH_PRESETS)
def test_every_layer_has_one_attention_and_the_head_gives_logits(preset: str) -> None:
    cfg = PRESETS[preset].config()
    g = _graph(preset)
    # every layer mixes tokens once: by attention, or (hybrids) by its recurrent state
    mixing = sorted([*g.attention_layers(), *g.recurrent_layers()])
    assert mixing == list(range(cfg.n_layer))
    # an encoder (gemma-embedding) has no logits: its graph ends at the embedding
    assert g.logits is not None and g.logits.shape == ("O", cfg.n_vocab if cfg.causal_attn else cfg.n_embd)
    # every weight the graph reads is one the architecture file lists (or an optional one)
    assert set(g.weights) <= set(tensor_shapes(cfg))


def test_gemma3_layers_alternate_five_windows_and_one_global_with_their_rope() -> None:
    cfg = PRESETS["gemma3-4b"].config()
    g = _graph("gemma3-4b")
    attn = g.attention_layers()
    windows = [attn[il].attr("window") for il in range(cfg.n_layer)]
    assert windows[:6] == [1024] * 5 + [0] and windows[6:12] == windows[:6]
    ropes = [n for n in g.nodes if n.op == "rope" and n.out.name.endswith("Qcur_rope")]
    assert [(r.attr("theta"), r.attr("freq_scale")) for r in ropes[4:6]] == [(1e4, 1.0), (1e6, 0.125)]
    assert all(n.attr("scale") == pytest.approx(1 / 16) for n in attn.values())  # 1/sqrt(256)
    scale = [n for n in g.nodes if n.op == "scale"]
    assert len(scale) == 1 and scale[0].attr("scale") == pytest.approx(2560 ** 0.5)
    assert sum(n.op == "glu" and n.attr("act") == "gelu" for n in g.nodes) == cfg.n_layer


@pytest.mark.parametrize("preset", ARCH_PRESETS)
def test_the_buffer_plan_never_gives_two_live_values_one_buffer(preset: str) -> None:
    g = _graph(preset)
    plan = plan_buffers(g)
    last: dict[int, int] = {}
    born: dict[int, int] = {}
    for i, node in enumerate(g.nodes):
        born[node.out.id] = i
        for t in node.inputs:
            last[t.id] = i
    assert g.logits is not None
    last[g.logits.id] = len(g.nodes)
    values = [n.out for n in g.nodes]
    for a in values:
        for b in values:
            if a.id < b.id and plan.slot_of[a.id] == plan.slot_of[b.id]:
                # b may take a's buffer only once a is dead, or as the in-place output of
                # the node that reads a last
                assert last.get(a.id, born[a.id]) <= born[b.id], (a, b)
    # same-width rows reuse buffers: far fewer buffers than values
    # an MoE layer adds the router's and the routing's widths, a delta-net layer its
    # projections', its gates' and its convolution's
    limit = 12 + (2 if PRESETS[preset].n_expert else 0) + (6 if PRESETS[preset].ssm[0] else 0)
    assert len(plan.slots) <= limit < len(values)


def test_sliding_window_layers_keep_a_ring_and_say_when_a_prefix_is_reusable() -> None:
    g = _graph("gemma3-4b")
    mem = plan_memory(g, n_ctx=131072, chunk=512)
    assert [m.kind for m in mem[:6]] == ["kv_swa"] * 5 + ["kv"]
    assert mem[0].rows == 1024 + 512 and mem[5].rows == 131072
    swa = mem[0]
    # a ring of 1536 rows holding positions [0, 5000): positions 3464.. are still there
    assert swa.reusable(5000, 5000) and swa.reusable(5000, 4487)
    assert not swa.reusable(5000, 4486) and not swa.reusable(5000, 100)
    assert swa.reusable(1000, 10)  # nothing overwritten yet
    assert reusable_prefix(mem, 5000, 4600) == 4600 and reusable_prefix(mem, 5000, 200) == 0
    full = LayerMemory(0, "kv", 8192, 0, 128)
    assert reusable_prefix([full], 5000, 17) == 17


def test_gemma3_ring_caches_compute_what_full_caches_do(model_path) -> None:  # type: ignore[no-untyped-def]
    """A window of 16 over 40 tokens: chunks of 4 (a ring of 20 rows, overwritten twice)
    give the logits of one pass with every position kept."""
    model = load_gguf(model_path("tiny-gemma3", "Q8_0"))
    toks = np.random.default_rng(3).integers(10, 1000, 40).astype(np.int32)
    # a float32 cache: f16 would round the two passes' float32 noise apart now and then
    f32 = {"cache_type_k": "f32", "cache_type_v": "f32"}
    ring = NumpyBackend(model, n_ctx=64, n_seq=1, max_chunk=4, **f32)
    full = NumpyBackend(model, n_ctx=64, n_seq=1, max_chunk=64, **f32)
    assert [m.rows for m in ring.layers[:2]] == [20, 20] and full.layers[0].kind == "kv"
    np.testing.assert_allclose(ring.forward_all_logits(toks), full.forward_all_logits(toks), atol=2e-5)
    # continuing a reusable prefix equals recomputing it; a prefix the ring lost is refused
    # the ring holds positions 20..39; continuing at 36 reads 21..35, at 35 it would need 20
    assert ring.reusable_prefix(40, 36) == 36 and ring.reusable_prefix(40, 34) == 0
    from trio_llm.engine.backend import SeqBatch

    want = full.forward([SeqBatch(0, toks[:39], 0)])
    got = ring.forward([SeqBatch(0, toks[36:39], 36)])
    np.testing.assert_allclose(got, want, atol=2e-5)


@pytest.mark.parametrize("preset", ["tiny", "tiny-qwen35"])
def test_a_chunk_without_output_rows(model_path, preset: str) -> None:  # type: ignore[no-untyped-def]
    """A forward longer than the chunk: the chunks before the last want no logits, so
    the output rows' nodes (the final norm, a gated norm's groups) run on zero rows.
    They once failed there ("cannot reshape array of size 0"), which a server with
    -ub above 512 on the numpy backend met on its first long prompt."""
    from trio_llm.engine.backend import SeqBatch

    model = load_gguf(model_path(preset, "Q8_0"))
    toks = np.random.default_rng(4).integers(10, 1000, 40).astype(np.int32)
    f32 = {"cache_type_k": "f32", "cache_type_v": "f32"}
    chunked = NumpyBackend(model, n_ctx=64, n_seq=1, max_chunk=16, **f32)
    whole = NumpyBackend(model, n_ctx=64, n_seq=1, max_chunk=64, **f32)
    np.testing.assert_allclose(chunked.forward([SeqBatch(0, toks, 0)]), whole.forward([SeqBatch(0, toks, 0)]),
                               atol=2e-5)


def test_an_unknown_op_is_refused_by_both_backends_by_name(model_path) -> None:  # type: ignore[no-untyped-def]
    be = NumpyBackend(load_gguf(model_path("tiny", "Q8_0")), n_ctx=16, n_seq=1)
    node = be.graph.nodes[0]
    be.graph.nodes[0] = attrs.evolve(node, op="warp")
    from trio_llm.engine.backend import SeqBatch

    with pytest.raises(GraphError, match="inp_embd: the numpy backend has no op 'warp'"):
        be.forward([SeqBatch(0, np.array([1, 2], np.int32), 0)])
    assert node.out.shape == (TOKENS, 256)


def _kinds(ops) -> list[str]:  # type: ignore[no-untyped-def]
    """Each dispatch as its kernel (matvec by variant), barriers as '|'."""
    from trio_llm.vulkan.graph import Barrier, Copy

    # one push word more: the NORM_IN form (the norm's epsilon)
    variants = {7: "matvec", 13: "matvec_rope", 9: "gate_up", 8: "matvec+norm", 14: "matvec_rope+norm",
                10: "gate_up+norm"}
    out = []
    for op in ops:
        if isinstance(op, Barrier):
            out.append("|")
        elif isinstance(op, Copy):
            out.append("copy")
        else:
            name = op.kernel.name
            out.append(variants[op.kernel.n_push] if name == "matvec" else name)
    return out


@pytest.mark.vulkan
def test_the_lowering_fuses_what_the_decode_kernels_do(model_path) -> None:  # type: ignore[no-untyped-def]
    """llama decode: q/k/v normalize their input, rotate and store the cache in their
    projections, gate+up+SwiGLU is one matvec that normalizes its input too, the output
    projections add into the residual, attention is the split (flash-decoding) kernel
    (attn_decode2, the default, where the device can run it);
    5 barriers a layer (7 with TRIO_LLM_FUSE_NORM=0: the two norms on their own).
    Prefill (a bucket past 8 tokens) runs each op on its own."""
    import attrs

    from trio_llm.vulkan.backend import VulkanBackend

    be = VulkanBackend(load_gguf(model_path("tiny", "Q8_0")), n_ctx=64, n_seq=1)
    try:
        cfg = be.config
        # attn_decode2 (the default) where the device can run it, attn_decode otherwise
        attn = ("attn_decode2" if be._ops.decode_attn2 and be._ops.decode2_ok(cfg.n_head, cfg.n_head_kv, cfg.head_dim)
                else "attn_decode")
        for fuse in (True, False):
            decode = _kinds(be.lowered(1, attrs.evolve(be._ops, fuse_norm=fuse)))
            if fuse:
                qkv, ffn, head = "matvec_rope+norm", ["gate_up+norm"], ["matvec+norm"]
            else:
                qkv, ffn, head = "matvec_rope", ["rms_norm", "|", "gate_up"], ["rms_norm", "|", "matvec"]
            layer = [*([] if fuse else ["rms_norm", "|"]), qkv, qkv, qkv, "|", attn, "|",
                     "matvec", "|", *ffn, "|", "matvec", "|"]
            assert decode[:2] == ["get_rows", "|"]
            body = decode[2 : 2 + 2 * len(layer)]
            assert [k for k in body if k != qkv] == [k for k in layer * 2 if k != qkv]
            assert body.count(qkv) == 6
            assert decode[2 + 2 * len(layer):] == ["get_rows", "|", *head, "|", "copy"]
        prefill = _kinds(be.lowered(64))
        # (the head runs on the one output row: a matvec)
        assert prefill.count("matmul") == 2 * 7 and "swiglu" in prefill and prefill.count("rope") == 2 * 3
    finally:
        be.close()
    be = VulkanBackend(load_gguf(model_path("tiny-qwen3", "Q8_0")), n_ctx=64, n_seq=1)
    try:
        decode = _kinds(be.lowered(1, attrs.evolve(be._ops, fuse_norm=True)))
        # neox RoPE after QK-norm stays a rope dispatch; v still goes straight to the cache
        assert decode.count("matvec_rope+norm") == 2 and decode.count("rope") == 2 * 2
        decode = _kinds(be.lowered(1))  # the default: the norms on their own
        assert decode.count("matvec_rope") == 2 and "matvec_rope+norm" not in decode
    finally:
        be.close()
    # with the hybrid fusions (TRIO_LLM_HYBRID_FUSE=1, chosen when the backend plans its
    # buffers) it is one dispatch with the norm (qk_norm_rope), k's writing the cache
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRIO_LLM_HYBRID_FUSE", "1")
        be = VulkanBackend(load_gguf(model_path("tiny-qwen3", "Q8_0")), n_ctx=64, n_seq=1)
    try:
        decode = _kinds(be.lowered(1, attrs.evolve(be._ops, fuse_norm=True)))
        assert decode.count("matvec_rope+norm") == 2 and decode.count("qk_norm_rope") == 2 * 2
        assert "rope" not in decode and "rms_norm" not in decode
    finally:
        be.close()

"""deepseek2 (GLM-4.7-Flash): what llama.cpp cannot say for us (its greedy agreement is
in test_llamacpp_agreement.py, ``tiny-deepseek2``): the new graph ops against plain
numpy, the latent cache (one cache, no KV shift), metadata validation, files without
q_lora and with an MTP block, and the GLM-4.7-Flash preset's shapes."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from trio_llm.engine import fit
from trio_llm.engine.backend import Level, SeqBatch
from trio_llm.engine.reference import NumpyBackend, _moe_op
from trio_llm.errors import InvalidRequest, ModelLoadError, UnsupportedModelError
from trio_llm.graph import Graph
from trio_llm.model.gguf import load_gguf
from trio_llm.model.synth import PRESETS, make_model, plan_tensors
from trio_llm.models import Meta, build_graph, deepseek2, tensor_shapes
from trio_llm.server import slot_file


def test_sigmoid_routing_selects_by_the_bias_and_weighs_without_it() -> None:
    """``moe_topk`` with sigmoid gating: the bias decides which experts, the weights are
    the unbiased sigmoids, renormalised and scaled (llama.cpp's build_moe_ffn)."""
    g = Graph(shapes={"b": (4,)})
    g.layer(0)
    logits = g._tensor(("T", 4), "logits", "value")
    node_t = g.moe_topk(logits, 2, "topk", gating="sigmoid", norm=True, scale=2.0, bias=g.weight("b"))
    node = g.nodes[-1]
    assert node.out is node_t and node.attr("gating") == "sigmoid"
    x = np.array([[2.0, 1.0, 0.0, -1.0]], np.float32)
    bias = np.array([0.0, 0.0, 5.0, 5.0], np.float32)  # pushes experts 2 and 3 to the top
    out = _moe_op(node, [x, bias])
    assert out[0, :2].tolist() == [2.0, 3.0]  # sigmoid(0) + 5 beats sigmoid(-1) + 5
    s = 1 / (1 + np.exp(-x[0]))
    want = np.array([s[int(out[0, 0])], s[int(out[0, 1])]]) / (s[2] + s[3]) * 2.0
    np.testing.assert_allclose(out[0, 2:], want, rtol=1e-6)
    no_bias = _moe_op(node, [x])  # without a bias the largest logits win
    assert sorted(no_bias[0, :2].tolist()) == [0.0, 1.0]


def test_head_linear_and_concat_are_per_head(model_path) -> None:  # type: ignore[no-untyped-def]
    """The absorbed attention's ops on the real file: each head's query through its own
    attn_k_b slice, and Q as [absorbed | roped] per head, checked against plain loops."""
    model = load_gguf(model_path("tiny-deepseek2", "F32"))
    cfg = model.config
    be = NumpyBackend(model, n_ctx=32, n_seq=1)
    try:
        g = be.graph
        hl = next(n for n in g.nodes if n.op == "head_linear" and n.out.name == "blk.0.q_nope_absorbed")
        cat = next(n for n in g.nodes if n.op == "concat" and n.out.name == "blk.0.Qcur")
        nope = cfg.head_dim_k_mla - cfg.n_rot
        rng = np.random.default_rng(0)
        x = rng.standard_normal((3, cfg.n_head * nope)).astype(np.float32)
        wk = model.tensor("blk.0.attn_k_b.weight").dequantize()  # [n_head, kv_lora, nope]
        y = be._op(hl, [x, be._experts["blk.0.attn_k_b.weight"]], None)  # type: ignore[arg-type]
        for h in range(cfg.n_head):
            np.testing.assert_allclose(y[:, h * cfg.n_lora_kv:(h + 1) * cfg.n_lora_kv],
                                       x[:, h * nope:(h + 1) * nope] @ wk[h].T, rtol=1e-5, atol=1e-6)
        pe = rng.standard_normal((3, cfg.n_head * cfg.n_rot)).astype(np.float32)
        q = be._op(cat, [y, pe], None)  # type: ignore[arg-type]
        row = cfg.n_lora_kv + cfg.n_rot
        assert q.shape == (3, cfg.n_head * row)
        for h in range(cfg.n_head):
            np.testing.assert_array_equal(q[:, h * row:h * row + cfg.n_lora_kv], y[:, h * cfg.n_lora_kv:(h + 1) * cfg.n_lora_kv])
            np.testing.assert_array_equal(q[:, h * row + cfg.n_lora_kv:(h + 1) * row], pe[:, h * cfg.n_rot:(h + 1) * cfg.n_rot])
    finally:
        be.close()


def test_the_latent_cache_is_one_cache_and_cannot_shift(model_path) -> None:  # type: ignore[no-untyped-def]
    """Every layer caches kv_lora_rank + n_rot values per token, once (V is K's latent
    part), in K's type: a q8_0 K with an f16 V costs exactly q8_0 rows; KV shifting is
    refused (the roped part is a slice of each row)."""
    model = load_gguf(model_path("tiny-deepseek2", "Q8_0"))
    cfg = model.config
    assert cfg.head_dim == cfg.n_lora_kv + cfg.n_rot and cfg.n_head_kv == 1
    be = NumpyBackend(model, n_ctx=32, n_seq=1, cache_type_k="q8_0", cache_type_v="f16")
    try:
        assert all(m.v_is_k and m.kv_dim == cfg.head_dim for m in be.layers)
        assert be.kv_bytes_per_token() == cfg.n_layer * cfg.head_dim // 32 * 34
        assert not be.can_shift
        be.forward([SeqBatch(0, np.arange(5, dtype=np.int32) + 7, 0)])
        kv = be.read_kv(0, 5)  # [L, 1, n, kv_dim]: K alone, no V rows
        assert kv.shape == (cfg.n_layer, 1, 5, cfg.kv_dim) and cfg.kv_parts == 1
        assert np.abs(kv).max() > 0
    finally:
        be.close()


def _meta(model, **changes):  # type: ignore[no-untyped-def]
    md = {**model.metadata}
    for k, v in changes.items():
        key = f"deepseek2.{k}"
        if v is None:
            md.pop(key, None)
        else:
            md[key] = v
    return Meta(model.path, md, "deepseek2")


@pytest.mark.parametrize(("changes", "error", "match"), [
    ({"attention.kv_lora_rank": None}, ModelLoadError, "missing metadata key 'deepseek2.attention.kv_lora_rank'"),
    ({"attention.kv_lora_rank": 0}, ModelLoadError, "kv_lora_rank' is 0"),
    ({"attention.key_length": 100}, ModelLoadError, "expected kv_lora_rank \\+ n_rot = 288"),
    ({"attention.head_count_kv": 2}, ModelLoadError, "head_count_kv' is 2, expected 1"),
    ({"rope.dimension_count": 33}, ModelLoadError, "MLA sizes do not fit"),
    ({"expert_shared_count": None}, ModelLoadError, "expert_shared_count"),
    ({"expert_used_count": 17}, ModelLoadError, "expert_used_count 17 of expert_count 16"),
    ({"attention.key_length_mla": None}, UnsupportedModelError, "without the MLA split"),
    ({"rope.scaling.type": "yarn"}, UnsupportedModelError, "RoPE scaling 'yarn'"),
    ({"expert_gating_func": 4}, UnsupportedModelError, "expert_gating_func 4"),
    ({"expert_group_count": 8}, UnsupportedModelError, "expert_group_count"),
    ({"attention.temperature_scale": 0.1}, UnsupportedModelError, "temperature scaling"),
])
def test_bad_metadata_is_one_line_naming_it(model_path, changes, error, match) -> None:  # type: ignore[no-untyped-def]
    model = load_gguf(model_path("tiny-deepseek2", "Q8_0"))
    with pytest.raises(error, match=match) as info:
        deepseek2.hparams(_meta(model, **changes), model.tensors)
    assert "\n" not in str(info.value)


def test_gating_defaults_as_llama_cpp_without_the_key(model_path) -> None:  # type: ignore[no-untyped-def]
    """No expert_gating_func: softmax, except for GLM-4.7-Flash's shape (47 or 48 blocks
    and a 154880 vocabulary), which llama.cpp routes by sigmoid."""
    model = load_gguf(model_path("tiny-deepseek2", "Q8_0"))
    assert deepseek2.hparams(_meta(model, expert_gating_func=None), model.tensors).expert_gating == "softmax"
    assert model.config.expert_gating == "sigmoid"
    glm = PRESETS["glm-4.7-flash"].config()
    assert (glm.n_layer, glm.n_vocab, glm.expert_gating) == (47, 154880, "sigmoid")


def test_a_file_without_q_lora_reads_attn_q(model_path) -> None:  # type: ignore[no-untyped-def]
    """DeepSeek-V2-Lite's layout: no attention.q_lora_rank, one attn_q per layer."""
    model = load_gguf(model_path("tiny-deepseek2", "Q8_0"))
    cfg = deepseek2.hparams(_meta(model, **{"attention.q_lora_rank": None}), model.tensors)
    assert cfg.n_lora_q == 0
    shapes = tensor_shapes(cfg)
    assert shapes["blk.0.attn_q.weight"] == (cfg.n_head * cfg.head_dim_k_mla, cfg.n_embd)
    assert not any("attn_q_a" in n or "attn_q_b" in n for n in shapes)
    g = build_graph(cfg, shapes)
    assert "blk.0.attn_q.weight" in g.weights and g.logits is not None


def test_an_mtp_block_is_left_out_of_the_forward_pass(model_path, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """GLM-4.7-Flash's converted files carry one nextn block after the trunk: the trunk
    is the same model, giving the same logits as the file without it."""
    plain = model_path("tiny-deepseek2", "Q8_0")
    with_mtp = load_gguf(make_model("tiny-deepseek2", "Q8_0", tmp_path / "mtp.gguf", mtp=1))
    assert with_mtp.metadata["deepseek2.block_count"] == 4 and "blk.3.nextn.eh_proj.weight" in with_mtp.tensors
    assert with_mtp.config == load_gguf(plain).config
    toks = np.array([5, 9, 11, 300], np.int32)
    outs = []
    for m in (load_gguf(plain), with_mtp):
        be = NumpyBackend(m, n_ctx=16, n_seq=1)
        try:
            outs.append(be.forward([SeqBatch(0, toks, 0)]))
        finally:
            be.close()
    np.testing.assert_array_equal(outs[0], outs[1])


def test_the_glm_preset_has_glm_4_7_flash_shapes() -> None:
    cfg = PRESETS["glm-4.7-flash"].config()
    shapes = tensor_shapes(cfg)
    assert shapes["blk.1.attn_k_b.weight"] == (20, 512, 192)
    assert shapes["blk.1.attn_v_b.weight"] == (20, 256, 512)
    assert shapes["blk.1.attn_q_b.weight"] == (20 * 256, 768)
    assert shapes["blk.1.attn_kv_a_mqa.weight"] == (576, 2048)
    assert shapes["blk.0.ffn_down.weight"] == (2048, 10240)
    assert shapes["blk.46.ffn_gate_exps.weight"] == (64, 1536, 2048)
    assert shapes["blk.46.ffn_down_shexp.weight"] == (2048, 1536)
    assert cfg.attn_scale == pytest.approx(1 / 16)
    plans = {t.name: t for t in plan_tensors(PRESETS["glm-4.7-flash"], "Q4_K_M")}
    assert "blk.1.exp_probs_b.bias" in plans and "blk.0.exp_probs_b.bias" not in plans
    # attn_k_b rows of 192 values cannot be Q4_K blocks of 256: llama-quantize's fallback
    assert plans["blk.1.attn_k_b.weight"].ggml_type.name == "Q5_0"
    total = sum(t.n_bytes for t in plans.values())
    assert 15e9 < total < 22e9, total  # ~30B parameters at ~4.9 bits



@pytest.mark.vulkan
def test_the_vulkan_backend_runs_the_latent_cache_as_numpy(model_path) -> None:  # type: ignore[no-untyped-def]
    """F32 weights and cache: a 12-token prefill and three decode steps give numpy's
    logits (the latent row of 288 takes attn_prefill.comp's LATENT form in the prefill,
    head_linear the expert matvec, concat and the sigmoid router their shaders); the
    cache reads back as numpy's, K alone."""
    from trio_llm.vulkan.backend import VulkanBackend

    model = load_gguf(model_path("tiny-deepseek2", "F32", sharp=True))
    assert model.config.head_dim > 256
    kw = dict(n_ctx=32, n_seq=1, cache_type_k="f32", cache_type_v="f32")
    vk, ref = VulkanBackend(model, **kw), NumpyBackend(model, **kw)  # type: ignore[arg-type]
    try:
        toks = np.arange(12, dtype=np.int32) * 37 % 1000 + 3
        steps = [SeqBatch(0, toks, 0)] + [SeqBatch(0, np.array([t], np.int32), 12 + i) for i, t in enumerate((5, 77, 901))]
        for b in steps:
            np.testing.assert_allclose(vk.forward([b]), ref.forward([b]), atol=2e-3, rtol=1e-3)
        kv = vk.read_kv(0, 15)
        assert kv.shape == (model.config.n_layer, 1, 15, model.config.kv_dim)
        np.testing.assert_allclose(kv, ref.read_kv(0, 15), atol=1e-4)
    finally:
        vk.close()
        ref.close()


def test_the_latent_cache_is_counted_as_llama_cpp_counts_it() -> None:
    """llama.cpp's MLA cache has no V: n_layer x n_ctx x (kv_lora_rank + n_rot) values
    of K's type. GLM-4.7-Flash at 131072 positions, f16: 47 x 576 x 2 bytes a position,
    6768 MiB (with a V as big as K it would be twice that); the V type changes nothing."""
    cfg = PRESETS["glm-4.7-flash"].config()
    assert (cfg.n_layer, cfg.n_lora_kv, cfg.n_rot, cfg.kv_parts) == (47, 512, 64, 1)
    per = fit.kv_bytes_per_position(cfg, "f16", "f16")
    assert per == 47 * (512 + 64) * 2 == fit.kv_bytes_per_position(cfg, "f16", "q4_0")
    assert per * 131072 == 6768 << 20
    assert fit.kv_bytes_per_position(cfg, "q8_0", "f16") == 47 * 576 // 32 * 34
    assert fit.footprint_bytes(cfg, weights=0, ctx_total=131072, type_k="f16", type_v="f16", n_batch=1) \
        == fit.compute_bytes(cfg, 1) + (6768 << 20)
    llama = PRESETS["tiny"].config()  # an ordinary cache still counts K and V
    assert llama.kv_parts == 2 and fit.kv_bytes_per_position(llama, "f16", "q8_0") == \
        llama.n_layer * llama.kv_dim * (2 + 34 / 32)
    assert slot_file.max_bytes(cfg, 100) == 47 * 1 * 100 * 576 * 4 + 400 + 4 * slot_file.OVERHEAD


@pytest.mark.vulkan
@pytest.mark.parametrize(("kt", "vt"), [("f16", "f16"), ("q8_0", "f16")])
def test_the_vulkan_latent_cache_is_k_alone_and_sleeps_with_it(model_path, kt, vt) -> None:  # type: ignore[no-untyped-def]
    """The device holds n_layer x positions x (kv_lora_rank + n_rot) values of K's type
    and nothing for V (what device_info, memory(), the fit projection and numpy report);
    a release at level all (``--sleep-mode all``) moves exactly those bytes to the host
    and frees them on the device, and after the restore the sequence continues with the
    logits of a run that never slept."""
    from trio_llm.vulkan.backend import VulkanBackend

    model = load_gguf(model_path("tiny-deepseek2", "Q8_0"))
    cfg = model.config
    n_ctx, n_seq = 64, 2
    want = int(cfg.n_layer * n_seq * n_ctx * (cfg.n_lora_kv + cfg.n_rot) * fit.CACHE_TYPE_BYTES[kt])
    assert fit.kv_bytes_per_position(cfg, kt, vt) * n_seq * n_ctx == want
    kw = dict(n_ctx=n_ctx, n_seq=n_seq, cache_type_k=kt, cache_type_v=vt)
    vk, ref = VulkanBackend(model, **kw), NumpyBackend(model, **kw)  # type: ignore[arg-type]
    try:
        assert vk.device_info()["kv_bytes"] == ref.kv_bytes() == want
        assert vk.device_info()["kv_bytes_per_token"] == ref.kv_bytes_per_token() == want // (n_seq * n_ctx)
        assert vk.memory()["kv_cache"] == ref.memory()["kv_cache"] == want
        prompt = np.arange(11, dtype=np.int32) * 53 % 1000 + 2
        more = np.array([42, 7, 300], np.int32)
        vk.forward([SeqBatch(1, prompt, 0)])
        expected = vk.forward([SeqBatch(1, more, len(prompt))])  # never slept
        vk.forward([SeqBatch(0, prompt, 0)])
        vk.release(Level.ALL)
        assert vk.memory()["kv_cache"] == 0 and vk.host_memory()["kv_cache"] == want
        vk.restore()
        assert vk.memory()["kv_cache"] == want
        np.testing.assert_array_equal(vk.forward([SeqBatch(0, more, len(prompt))]), expected)
    finally:
        vk.close()
        ref.close()


@pytest.mark.vulkan
def test_a_latent_slot_file_holds_k_alone_and_round_trips(model_path, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Slot save/restore of a latent cache: read_kv gives [n_layer, 1, n, kv_dim] (K of
    each layer), the file holds that and no V, and restoring it into another slot
    continues as the saved one does, on either backend; a file with a V part is refused."""
    from trio_llm.vulkan.backend import VulkanBackend

    model = load_gguf(model_path("tiny-deepseek2", "Q8_0"))
    cfg = model.config
    kw = dict(n_ctx=64, n_seq=2, cache_type_k="q8_0", cache_type_v="f16")
    prompt = np.arange(9, dtype=np.int32) * 71 % 1000 + 4
    more = np.array([17, 401], np.int32)
    for be in (VulkanBackend(model, **kw), NumpyBackend(model, **kw)):  # type: ignore[arg-type]
        try:
            be.forward([SeqBatch(0, prompt, 0)])
            kv = be.read_kv(0, len(prompt))
            assert kv.shape == (cfg.n_layer, 1, len(prompt), cfg.kv_dim) and np.abs(kv).max() > 0
            path = tmp_path / f"{be.name}.bin"
            size = slot_file.save(path, cfg, prompt.tolist(), kv)
            assert kv.nbytes < size < kv.nbytes + slot_file.OVERHEAD
            tokens, back, _ = slot_file.load(path, cfg, 64)
            assert tokens == prompt.tolist()
            np.testing.assert_array_equal(back, kv)
            be.write_kv(1, back)
            np.testing.assert_array_equal(be.read_kv(1, len(prompt)), kv)
            np.testing.assert_array_equal(be.forward([SeqBatch(1, more, len(prompt))]),
                                          be.forward([SeqBatch(0, more, len(prompt))]))
            slot_file.save(path, cfg, prompt.tolist(), np.concatenate([kv, kv], axis=1))
            with pytest.raises(InvalidRequest, match="wrong shape"):
                slot_file.load(path, cfg, 64)
        finally:
            be.close()


@pytest.mark.vulkan
def test_vulkan_decodes_a_latent_cache_at_depth_by_flash_decoding(model_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Decode steps at depths 300..302 (not multiples of the 128-key tile) of a 512-row
    cache take attention_decode's latent form (V the first kv_lora_rank values of each
    K row, split over decode_splits(512) work groups): numpy's logits with an f32 cache;
    with a q8_0 cache those of the plain attention.comp path (numpy's q8_0 run differs
    from the device's by ~1e-2 after the 300-token prefill, on either path, because numpy
    rounds q to q8_0 before its dot products as llama.cpp's CPU does: see the test below)."""
    model = load_gguf(model_path("tiny-deepseek2", "F32", sharp=True))
    toks = np.arange(300, dtype=np.int32) * 37 % 1000 + 3
    steps = [SeqBatch(0, np.array([t], np.int32), 300 + i) for i, t in enumerate((5, 77, 901))]

    def run(be) -> list[np.ndarray]:  # type: ignore[no-untyped-def]
        try:
            be.forward([SeqBatch(0, toks, 0)])
            return [be.forward([b]) for b in steps]
        finally:
            be.close()

    _latent_against_fallback(monkeypatch, model, "attention_decode", ("decode_latent_ok", lambda *a: False), run,
                             n_seq=1, tols={"f32": (1e-4, 1e-4), "q8_0": (1e-4, 1e-4)})


@pytest.mark.vulkan
def test_vulkan_prefills_a_latent_cache_by_tiled_attention(model_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A 300-token prompt in two chunks (170 tokens, then 130 after them beside a second
    sequence's first 45 in the same step) and a decode step: every prefill attention is
    attention_prefill's latent form (attn_prefill.comp LATENT, V the first kv_lora_rank
    values of each K row). numpy's logits with an f32 cache (within 1e-4; they agree to
    ~2e-6); with q8_0 those of the same backend with the latent prefill refused
    (attention.comp, the fallback) within 2e-3: the two kernels' f32 sums differ in
    order, which moves some of the next layers' K values across a q8_0 rounding edge
    (one quantization step each; ~2e-4 in the logits here, numpy's own q8_0 cache with
    an f32 q comes as close). numpy itself is no reference at q8_0: it rounds q to q8_0
    before its dot products, as llama.cpp's CPU flash attention does and no shader
    does (~1e-2 apart at this depth, as for tiny and tiny-qwen3)."""
    model = load_gguf(model_path("tiny-deepseek2", "F32", sharp=True))
    toks = np.arange(300, dtype=np.int32) * 37 % 1000 + 3
    other = np.arange(45, dtype=np.int32) * 11 % 1000 + 7
    steps = [[SeqBatch(0, toks[:170], 0)], [SeqBatch(0, toks[170:], 170), SeqBatch(1, other, 0)],
             [SeqBatch(0, np.array([5], np.int32), 300), SeqBatch(1, np.array([77], np.int32), 45)]]

    def run(be) -> list[np.ndarray]:  # type: ignore[no-untyped-def]
        try:
            return [be.forward(b) for b in steps]
        finally:
            be.close()

    _latent_against_fallback(monkeypatch, model, "attention_prefill", ("prefill_latent_tile", lambda *a: None), run,
                             n_seq=2, tols={"f32": (1e-4, 0.0), "q8_0": (2e-3, 0.0)})


def _latent_against_fallback(monkeypatch, model, spied: str, refuse: tuple[str, Any], run: Any, *,  # type: ignore[no-untyped-def]
                             n_seq: int, tols: dict[str, tuple[float, float]]) -> None:
    """Every call of ``Ops.<spied>`` is the latent form (``v_dim`` = kv_lora_rank), and
    ``run``'s logits match numpy's with an f32 cache, and with a q8_0 cache those of the
    Vulkan backend with the latent form refused (``refuse``: the method and its stand-in;
    attention.comp then serves the latent layers), within ``tols[type]`` (atol, rtol)."""
    from trio_llm.vulkan.backend import VulkanBackend
    from trio_llm.vulkan.ops import Ops

    calls: list[int] = []
    orig = getattr(Ops, spied)

    def spy(self, *a, **kw):  # type: ignore[no-untyped-def]
        calls.append(kw.get("v_dim", 0))
        return orig(self, *a, **kw)

    monkeypatch.setattr(Ops, spied, spy)
    for kt in ("f32", "q8_0"):
        kw = dict(n_ctx=512, n_seq=n_seq, cache_type_k=kt, cache_type_v=kt)
        if kt == "f32":
            want = run(NumpyBackend(model, **kw))
        else:
            with monkeypatch.context() as m:
                m.setattr(Ops, *refuse)
                calls.clear()
                want = run(VulkanBackend(model, **kw))
                assert not calls  # attention.comp served the latent layers
        calls.clear()
        got = run(VulkanBackend(model, **kw))
        assert calls and set(calls) == {model.config.n_lora_kv}  # every such attention was the latent one
        atol, rtol = tols[kt]
        for g, w in zip(got, want, strict=True):
            np.testing.assert_allclose(g, w, atol=atol, rtol=rtol)

"""qwen3next (Qwen3-Next, Qwen3-Coder-Next): what differs from qwen35moe, checked
where llama.cpp cannot say it (its agreement on both backends is in
test_llamacpp_agreement.py, ``tiny-qwen3next``): the fused gate projection's layout,
the grouped k heads, and the refusal of the older fused q/k/v/z conversions."""

from __future__ import annotations

import pytest

from trio_llm.errors import UnsupportedModelError
from trio_llm.model.gguf import load_gguf
from trio_llm.models import Meta, qwen3next


def test_the_graph_splits_ssm_ba_per_k_head_and_groups_the_k_heads(model_path) -> None:  # type: ignore[no-untyped-def]
    """tiny-qwen3next (2 k heads, 4 v heads): beta is values 0-1 of each group of 4 of
    ssm_ba's output, alpha values 2-3; every delta_net reads k head h // 2."""
    model = load_gguf(model_path("tiny-qwen3next", "Q8_0"))
    from trio_llm.models import build_graph

    g = build_graph(model.config, {n: t.shape for n, t in model.tensors.items()})
    takes = {n.out.name: (n.attr("group"), n.attr("start"), n.attr("n")) for n in g.nodes if n.op == "take"}
    assert takes["blk.0.b"] == (4, 0, 2) and takes["blk.0.a"] == (4, 2, 2)
    rules = [n for n in g.nodes if n.op == "delta_net"]
    assert len(rules) == 3 and all(n.attr("k_grouped") for n in rules)
    assert "blk.0.ssm_beta.weight" not in model.tensors and model.tensors["blk.0.ssm_ba.weight"].shape == (8, 256)


def test_older_fused_conversions_are_refused_by_name(model_path) -> None:  # type: ignore[no-untyped-def]
    """A file with ``ssm_in`` (q, k, v and z of each k head side by side: llama.cpp's
    converter before it wrote attn_qkv and attn_gate) is one UnsupportedModelError naming
    the tensor, through the loader and through ``trio-llm serve`` (one line, exit 1)."""
    model = load_gguf(model_path("tiny-qwen3next", "Q8_0"))
    tensors = {n: t for n, t in model.tensors.items()}
    tensors["blk.1.ssm_in.weight"] = tensors.pop("blk.1.attn_qkv.weight")
    with pytest.raises(UnsupportedModelError, match=r"blk\.1\.ssm_in\.weight: the fused q/k/v/z projection"):
        qwen3next.hparams(Meta(model.path, model.metadata, "qwen3next"), tensors)


def test_the_listed_recurrent_layers_win_over_the_interval(model_path) -> None:  # type: ignore[no-untyped-def]
    """``attention.recurrent_layers`` (the converter's list, which llama.cpp prefers)
    decides which layers are delta-net layers, for qwen35 and qwen3next alike; a list
    that is not booleans for every layer is one ModelLoadError naming the key."""
    from trio_llm.errors import ModelLoadError
    from trio_llm.models import qwen35

    for preset, mod in (("tiny-qwen35", qwen35), ("tiny-qwen3next", qwen3next)):
        model = load_gguf(model_path(preset, "Q8_0"))
        arch = model.config.arch
        key = f"{arch}.attention.recurrent_layers"
        assert model.metadata[key] == [True, True, True, False]  # what make-model writes
        md = {**model.metadata, key: [True, False, True, False, False]}
        cfg = mod.hparams(Meta(model.path, md, arch), model.tensors)
        assert cfg.recurrent_layers == (True, False, True, False)
        for bad in ([True, False], [1, 0, 1, 0], "yes"):
            with pytest.raises(ModelLoadError, match="recurrent_layers"):
                mod.hparams(Meta(model.path, {**model.metadata, key: bad}, arch), model.tensors)

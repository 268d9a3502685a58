"""qwen35moe: Qwen3.5's hybrid stack (``qwen35.py``) with a mixture-of-experts FFN in
every layer (llama.cpp's ``src/models/qwen35moe.cpp``): softmax routing over
``expert_count`` experts, the ``expert_used_count`` best renormalised, plus a shared
expert of width ``expert_shared_feed_forward_length`` that every token passes, scaled
by the sigmoid of its one-output gate ``ffn_gate_inp_shexp`` (a vector in the file).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from trio_llm.errors import ModelLoadError
from trio_llm.graph import Graph
from trio_llm.model.config import ModelConfig
from trio_llm.models import Meta
from trio_llm.models.blocks import Moe, head_tensors, moe_ffn, moe_tensors
from trio_llm.models.llama import common_hparams, no_rope_scaling
from trio_llm.models.qwen35 import build_layers, layer_tensors, ssm_hparams

ARCHS = ("qwen35moe",)
MIN_BLOCK_TENSORS = 11


def hparams(meta: Meta, tensors: Mapping[str, Any]) -> ModelConfig:
    shexp = meta.arch_get("expert_shared_feed_forward_length", int, 0)
    if f"{meta.arch}.feed_forward_length" not in meta.md and shexp > 0:
        # the dense width is unused here; files may leave it out
        meta = Meta(meta.path, {**meta.md, f"{meta.arch}.feed_forward_length": shexp}, meta.arch)
    hp = common_hparams(meta, tensors, rms_eps_default=1e-6)
    hp["qk_norm"] = True
    hp["n_rot"] = meta.positive("rope.dimension_count", hp["head_dim"])
    no_rope_scaling(meta, hp, "partial RoPE")
    n_expert = meta.positive("expert_count")
    n_used = meta.positive("expert_used_count")
    if n_used > n_expert:
        raise ModelLoadError(meta.path, f"expert_used_count {n_used} exceeds expert_count {n_expert}")
    n_ff_exp = meta.arch_get("expert_feed_forward_length", int, 0) or hp["n_ff"] // n_used
    return ModelConfig(**hp, **ssm_hparams(meta, hp["n_layer"]), n_expert=n_expert, n_expert_used=n_used,
                       n_ff_exp=n_ff_exp, n_ff_shexp=shexp or hp["n_ff"])


def tensors(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    shapes: dict[str, tuple[int, ...]] = {"token_embd.weight": (cfg.n_vocab, cfg.n_embd)}
    for il in range(cfg.n_layer):
        shapes.update(layer_tensors(cfg, il))
        shapes.update(moe_tensors(cfg, il, shared_gate=True))
    shapes.update(head_tensors(cfg))
    return shapes


def optional(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    return {}


def build(g: Graph, cfg: ModelConfig) -> None:
    moe = Moe(n_expert=cfg.n_expert, n_expert_used=cfg.n_expert_used, norm=True, shared=True)
    build_layers(g, cfg, lambda g, h, il: moe_ffn(g, h, il, moe, "silu"))

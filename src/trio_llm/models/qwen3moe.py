"""qwen3moe: qwen3's attention (QK-norm, half-split RoPE) with a mixture-of-experts FFN
in every layer (llama.cpp's ``src/models/qwen3moe.cpp``).

Per token the router (``ffn_gate_inp``) picks ``expert_used_count`` of the layer's
``expert_count`` experts by softmax probability, their weights renormalised to sum to
one (llama.cpp always renormalises for this architecture); each expert is a SwiGLU FFN
of width ``expert_feed_forward_length`` stored as one 3-D tensor per matrix
(``ffn_gate_exps`` / ``ffn_up_exps`` / ``ffn_down_exps``, numpy order
``[n_expert, n_out, n_in]``). No shared expert, no dense layers.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from trio_llm.errors import ModelLoadError
from trio_llm.graph import Graph
from trio_llm.model.config import ModelConfig
from trio_llm.models import Meta
from trio_llm.models.blocks import (
    Attn,
    Moe,
    Rope,
    attention,
    attention_tensors,
    head,
    head_tensors,
    moe_ffn,
    norm,
)
from trio_llm.models.llama import common_hparams, rope_scaling

ARCHS = ("qwen3moe",)
MIN_BLOCK_TENSORS = 11


def hparams(meta: Meta, tensors: Mapping[str, Any]) -> ModelConfig:
    hp = common_hparams(meta, tensors, rms_eps_default=1e-6)
    n_expert = meta.positive("expert_count")
    n_used = meta.positive("expert_used_count")
    if n_used > n_expert:
        raise ModelLoadError(meta.path, f"expert_used_count {n_used} exceeds expert_count {n_expert}")
    n_ff_exp = meta.arch_get("expert_feed_forward_length", int, 0) or hp["n_ff"] // n_used
    if n_ff_exp <= 0:
        raise ModelLoadError(meta.path, f"metadata key '{meta.arch}.expert_feed_forward_length' is {n_ff_exp}")
    if not hp["qk_norm"]:
        raise ModelLoadError(meta.path, "missing tensor 'blk.0.attn_q_norm.weight' (qwen3moe has QK-norm)")
    return ModelConfig(**{**hp, **rope_scaling(meta, hp)}, n_expert=n_expert, n_expert_used=n_used,
                       n_ff_exp=n_ff_exp)


def tensors(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    e = cfg.n_embd
    ne, ff = cfg.n_expert, cfg.n_ff_exp
    shapes: dict[str, tuple[int, ...]] = {"token_embd.weight": (cfg.n_vocab, e)}
    for i in range(cfg.n_layer):
        b = f"blk.{i}."
        shapes.update(attention_tensors(cfg, i, qk_norm=True))
        shapes.update({
            b + "ffn_norm.weight": (e,),
            b + "ffn_gate_inp.weight": (ne, e),
            b + "ffn_gate_exps.weight": (ne, ff, e),
            b + "ffn_up_exps.weight": (ne, ff, e),
            b + "ffn_down_exps.weight": (ne, e, ff),
        })
    shapes.update(head_tensors(cfg))
    return shapes


def optional(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    return {}


def build(g: Graph, cfg: ModelConfig) -> None:
    eps = cfg.rms_eps
    a = Attn(n_head=cfg.n_head, n_head_kv=cfg.n_head_kv, head_dim=cfg.head_dim, eps=eps,
             scale=cfg.kq_scale, qk_norm=True)
    rope = Rope(mode="neox", theta=cfg.rope_theta, freq_scale=cfg.rope_freq_scale, yarn=cfg.rope_yarn)
    moe = Moe(n_expert=cfg.n_expert, n_expert_used=cfg.n_expert_used, norm=True)
    x = g.get_rows(g.weight("token_embd.weight"), g.tokens())  # [T, n_embd]
    for il in range(cfg.n_layer):
        g.layer(il)
        h = norm(g, x, f"blk.{il}.attn_norm.weight", eps, "attn_norm")
        x = g.add(x, attention(g, h, il, a, rope), "ffn_inp")
        h = norm(g, x, f"blk.{il}.ffn_norm.weight", eps, "ffn_norm")
        x = g.cvec(g.add(x, moe_ffn(g, h, il, moe, "silu"), "l_out"))
    head(g, x, eps)

"""qwen3next: Qwen3-Next (and Qwen3-Coder-Next), the hybrid Qwen3.5 grew from
(llama.cpp's ``src/models/qwen3next.cpp``): ``qwen35moe``'s stack, with three
differences in its delta-net layers.

* One projection ``ssm_ba`` makes both gates of the delta rule, laid out per k head:
  that head's ``n_v / n_k`` beta values, then as many alpha values (llama.cpp's
  ``mixed_ba`` view); ``take`` splits them into v-head order.
* A k head's v heads sit side by side (v head h reads k head ``h // (n_v / n_k)``,
  llama.cpp's repeat-interleave), where Qwen3.5's files tile them (``h % n_k``):
  ``Graph.delta_net(k_grouped=True)``.
* Its RoPE is llama.cpp's NeoX RoPE on the first ``rope.dimension_count`` values of a
  head (Qwen3.5's multi-section RoPE is the same for text).

Files made by llama.cpp's converter before it split the fused ``ssm_in`` projection
(q, k, v and z of each k head side by side) are refused by name: their channels need a
reordering at load that is not built.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from trio_llm.errors import UnsupportedModelError
from trio_llm.graph import Graph, Tensor
from trio_llm.model.config import ModelConfig
from trio_llm.models import Meta, qwen35moe
from trio_llm.models.blocks import Moe, moe_ffn
from trio_llm.models.qwen35 import build_layers, linear_attention

ARCHS = ("qwen3next",)
MIN_BLOCK_TENSORS = qwen35moe.MIN_BLOCK_TENSORS


def hparams(meta: Meta, tensors: Mapping[str, Any]) -> ModelConfig:
    legacy = sorted(n for n in tensors if n.endswith(".ssm_in.weight"))
    if legacy:
        raise UnsupportedModelError(meta.path, f"{legacy[0]}: the fused q/k/v/z projection of older qwen3next "
                                               "conversions is not supported; convert the model again with "
                                               "llama.cpp's convert_hf_to_gguf.py (attn_qkv and attn_gate)")
    return qwen35moe.hparams(meta, tensors)


def tensors(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    shapes = qwen35moe.tensors(cfg)
    for il in range(cfg.n_layer):
        b = f"blk.{il}."
        if cfg.is_recurrent(il):
            del shapes[b + "ssm_beta.weight"], shapes[b + "ssm_alpha.weight"]
            shapes[b + "ssm_ba.weight"] = (2 * cfg.ssm_n_v_heads, cfg.n_embd)
    return shapes


def optional(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    return {}


def fused_gates(g: Graph, h: Tensor, il: int, cfg: ModelConfig) -> tuple[Tensor, Tensor]:
    """(beta, alpha) ``[T, n_v]`` from ``ssm_ba``: per k head, its v heads' betas then
    their alphas, so ``take`` over groups of ``2 n_v / n_k`` gives each in v-head order."""
    r = cfg.ssm_n_v_heads // cfg.ssm_n_k_heads
    ba = g.linear(h, g.weight(f"blk.{il}.ssm_ba.weight"), "linear_attn_mixed_ba")  # [T, 2 n_v]
    return g.take(ba, 2 * r, 0, r, "b"), g.take(ba, 2 * r, r, r, "a")


def qwen3next_linear(g: Graph, h: Tensor, il: int, cfg: ModelConfig) -> Tensor:
    return linear_attention(g, h, il, cfg, gates=fused_gates, k_grouped=True)


def build(g: Graph, cfg: ModelConfig) -> None:
    moe = Moe(n_expert=cfg.n_expert, n_expert_used=cfg.n_expert_used, norm=True, shared=True)
    build_layers(g, cfg, lambda g, h, il: moe_ffn(g, h, il, moe, "silu"), linear=qwen3next_linear)

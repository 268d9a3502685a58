"""gemma3: llama's skeleton with Gemma's differences.

- the embedding is scaled by sqrt(n_embd), embedding rows given as input
  (``SeqBatch.embd``: an image's, from the vision projector) are not;
- QK-norm, and a softmax scale of 1/sqrt(head_dim) (1/sqrt(n_embd / n_head) for the
  62-layer 27B, as llama.cpp and gemma_pytorch pick it);
- "sandwich" norms: the attention and FFN outputs are normed again
  (``post_attention_norm``, ``post_ffw_norm``) before their residual adds;
- GeGLU (gelu's tanh form) instead of SwiGLU;
- five sliding-window layers (``attention.sliding_window`` positions, RoPE base
  ``rope.freq_base_swa`` or 10000, no scaling) to every global one (the file's RoPE base
  and linear scaling), or the file's ``attention.sliding_window_pattern`` (as llama.cpp's
  ``load_swa_pattern``); the sliding-window layers' caches keep only the positions a
  window can reach.

The GGUF converter already adds Gemma's "+1" to the norm weights, so the norms are plain.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from trio_llm.errors import ModelLoadError, UnsupportedModelError
from trio_llm.graph import Graph, Tensor
from trio_llm.model.config import ModelConfig
from trio_llm.models import Meta
from trio_llm.models.blocks import (
    Attn,
    Rope,
    attention,
    attention_tensors,
    ffn,
    head,
    head_tensors,
    norm,
)
from trio_llm.models.llama import common_hparams, rope_base

ARCHS = ("gemma3",)
MIN_BLOCK_TENSORS = 13
#: one global layer after every five sliding-window ones
SWA_PATTERN = 6
ROPE_THETA_SWA = 10000.0


def hparams(meta: Meta, tensors: Mapping[str, Any]) -> ModelConfig:
    hp = common_hparams(meta, tensors, rms_eps_default=1e-6)
    hp["rope_theta"] = rope_base(meta, 1e6)
    n_layer = hp["n_layer"]
    n_swa = meta.arch_get("attention.sliding_window", int, 0)
    if n_swa < 0:
        raise UnsupportedModelError(meta.path, f"negative gemma3.attention.sliding_window {n_swa}")
    factor = linear_rope_factor(meta)
    if meta.arch_get("final_logit_softcapping", float, 0.0) > 0:
        raise UnsupportedModelError(meta.path, "gemma3 with final_logit_softcapping is not supported")
    extra = derived(n_layer, hp["n_embd"], hp["n_head"], hp["head_dim"], n_swa, factor)
    if n_swa > 0:  # llama.cpp reads these two only for a model with windows
        extra["swa_layers"] = swa_pattern(meta, n_layer)
        extra["rope_theta_swa"] = rope_theta_swa(meta)
    return ModelConfig(**hp, **extra)


def linear_rope_factor(meta: Meta) -> float:
    """The global layers' linear RoPE scaling factor (llama.cpp's freq_scale, with
    --rope-scale over it; 0: none), for gemma3 and its relatives; other kinds refused."""
    kind = meta.over.get("rope_scaling") or meta.arch_get("rope.scaling.type", str, "linear")
    if kind not in ("none", "linear") or any(k.startswith("yarn_") for k in meta.over):
        raise UnsupportedModelError(meta.path, f"RoPE scaling {kind!r} of {meta.arch} is not supported (none, linear)")
    factor = 0.0 if kind == "none" else meta.arch_get("rope.scaling.factor", float, 0.0)
    if meta.over.get("rope_freq_scale"):
        factor = 1.0 / meta.over["rope_freq_scale"]
    return float(factor)


def rope_theta_swa(meta: Meta) -> float:
    """The sliding-window layers' RoPE base: the file's ``rope.freq_base_swa``, else 10000."""
    theta = meta.arch_get("rope.freq_base_swa", float, ROPE_THETA_SWA)
    if theta <= 0:
        raise ModelLoadError(meta.path, f"RoPE base {theta} of the sliding-window layers is not positive")
    return float(theta)


def swa_pattern(meta: Meta, n_layer: int) -> tuple[bool, ...]:
    """llama.cpp's ``load_swa_pattern(ml, 6)``: the file's per-layer list, else its
    period (``il % n < n - 1``; 0: every layer), else one global layer in six."""
    value = meta.md.get(f"{meta.arch}.attention.sliding_window_pattern", SWA_PATTERN)
    if isinstance(value, list):
        if len(value) < n_layer or not all(isinstance(v, bool) for v in value):
            raise ModelLoadError(meta.path, f"metadata key '{meta.arch}.attention.sliding_window_pattern' "
                                            f"is not {n_layer} booleans")
        return tuple(value[:n_layer])
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ModelLoadError(meta.path, f"metadata key '{meta.arch}.attention.sliding_window_pattern' is {value!r}")
    return tuple(value == 0 or il % value < value - 1 for il in range(n_layer))


def derived(n_layer: int, n_embd: int, n_head: int, head_dim: int, n_swa: int, rope_factor: float) -> dict[str, Any]:
    """The config fields gemma3 adds to llama's (``make-model`` writes files from them)."""
    dim = n_embd // n_head if n_layer == 62 else head_dim
    return dict(
        n_swa=n_swa,
        swa_layers=tuple(n_swa > 0 and il % SWA_PATTERN < SWA_PATTERN - 1 for il in range(n_layer)),
        rope_theta_swa=ROPE_THETA_SWA,
        rope_freq_scale=1.0 / rope_factor if rope_factor > 0 else 1.0,
        attn_scale=1.0 / math.sqrt(dim),
    )


def tensors(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    e, ff = cfg.n_embd, cfg.n_ff
    shapes: dict[str, tuple[int, ...]] = {"token_embd.weight": (cfg.n_vocab, e)}
    for i in range(cfg.n_layer):
        b = f"blk.{i}."
        shapes.update(attention_tensors(cfg, i, qk_norm=True))
        shapes.update({
            b + "post_attention_norm.weight": (e,),
            b + "ffn_norm.weight": (e,),
            b + "ffn_gate.weight": (ff, e),
            b + "ffn_up.weight": (ff, e),
            b + "ffn_down.weight": (e, ff),
            b + "post_ffw_norm.weight": (e,),
        })
    shapes.update(head_tensors(cfg))
    return shapes


def optional(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    return {}


def build(g: Graph, cfg: ModelConfig) -> None:
    eps = cfg.rms_eps
    x = g.get_rows(g.weight("token_embd.weight"), g.tokens())  # [T, n_embd]
    x = g.scale(x, math.sqrt(cfg.n_embd), "inp_scaled")
    x = g.embd_rows(x)  # an image's rows, unscaled (llama.cpp scales only token input)
    for il in range(cfg.n_layer):
        swa = cfg.is_swa(il)
        a = Attn(n_head=cfg.n_head, n_head_kv=cfg.n_head_kv, head_dim=cfg.head_dim, eps=eps,
                 scale=cfg.kq_scale, qk_norm=True, window=cfg.n_swa if swa else 0)
        x = block(g, cfg, il, x, a)
    head(g, x, eps)


def block(g: Graph, cfg: ModelConfig, il: int, x: Tensor, a: Attn) -> Tensor:
    """Layer ``il`` over the residual stream ``x``, attending as ``a`` says: the
    sliding-window layers' RoPE or the global one's, the sandwich norms, GeGLU, the
    layer's control vector (gemma3 and gemma-embedding share it)."""
    g.layer(il)
    b, eps = f"blk.{il}.", cfg.rms_eps
    rope = (Rope("neox", cfg.rope_theta_swa) if cfg.is_swa(il)
            else Rope("neox", cfg.rope_theta, freq_scale=cfg.rope_freq_scale))
    h = norm(g, x, b + "attn_norm.weight", eps, "attn_norm")
    h = norm(g, attention(g, h, il, a, rope), b + "post_attention_norm.weight", eps, "attn_post_norm")
    x = g.add(x, h, "sa_out")
    h = norm(g, x, b + "ffn_norm.weight", eps, "ffn_norm")
    h = norm(g, ffn(g, h, il, "gelu"), b + "post_ffw_norm.weight", eps, "ffn_post_norm")
    return g.cvec(g.add(x, h, "l_out"))

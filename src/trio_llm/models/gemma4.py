"""gemma4: Gemma 4's text stack, as llama.cpp's ``src/models/gemma4.cpp`` runs it.

gemma3's skeleton (embedding scaled by sqrt(n_embd), sandwich norms, GeGLU, QK-norm,
sliding-window and full layers), with Gemma 4's differences:

- the layer pattern is the file's per-layer list ``attention.sliding_window_pattern``;
  the sliding-window layers have their own head size (``attention.key_length_swa``),
  RoPE base (``rope.freq_base_swa``, else 10000) and rotated part
  (``rope.dimension_count_swa``); the full layers rotate ``head_dim`` values with the
  divisors of ``rope_freqs.weight`` (1e30 on the pairs that should not turn: the
  converter's "proportional" RoPE);
- the softmax scale is 1 (the Q/K norms carry it) and V is RMS-normed without a
  weight; a layer without ``attn_v`` uses its K projection (before the K norm) as V;
- the last ``attention.shared_kv_layers`` layers have no K/V of their own: a full one
  attends over the cache of the last layer that owns one (``n_layer_kv - 1``), a
  sliding-window one over the layer before it (``n_layer_kv - 2``), as llama.cpp's
  ``layer_reuse_cb`` maps them;
- per-layer embeddings (``embedding_length_per_layer_input`` > 0): each token's row of
  ``per_layer_token_embd`` (scaled by sqrt(n_pl)) plus the normed projection of the
  embedding (``per_layer_model_proj``, 1/sqrt(n_embd), ``per_layer_proj_norm``), over
  sqrt(2), gives each layer n_pl values; after the FFN a layer adds
  ``post_norm(proj(gelu(inp_gate(x)) * its values)))``;
- each layer's output times ``layer_output_scale`` (when the file has it); per-layer
  KV heads and FFN widths (``use_double_wide_mlp``); final logit softcapping.

Refused at load by name: the mixture-of-experts variant (26B-A4B), a fused ``attn_qkv``.
Images (a gemma4 projector) are not served: the graph takes no embedding rows.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from trio_llm.errors import ModelLoadError, UnsupportedModelError
from trio_llm.graph import Graph, Tensor
from trio_llm.model.config import ARCH_ROPE, ModelConfig
from trio_llm.models import Meta
from trio_llm.models.blocks import ffn, head_tensors, norm
from trio_llm.models.gemma3 import linear_rope_factor, rope_theta_swa
from trio_llm.models.llama import n_vocab_of, rope_base

ARCHS = ("gemma4",)
MIN_BLOCK_TENSORS = 9
ROPE_THETA_SWA = 10000.0


def _per_layer(meta: Meta, key: str, n_layer: int, default: int | None = None) -> tuple[int, ...]:
    """A key that is one positive count or one per layer (llama.cpp's ``get_key_or_arr``)."""
    value = meta.md.get(f"{meta.arch}.{key}", default)
    if isinstance(value, list):
        if len(value) != n_layer or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in value):
            raise ModelLoadError(meta.path, f"metadata key '{meta.arch}.{key}' is not {n_layer} positive counts")
        return tuple(value)
    if value is None:
        raise ModelLoadError(meta.path, f"missing metadata key '{meta.arch}.{key}'")
    return (meta.positive(key, default),) * n_layer


def hparams(meta: Meta, tensors: Mapping[str, Any]) -> ModelConfig:
    path, md = meta.path, meta.md
    n_embd = meta.positive("embedding_length")
    n_head = meta.positive("attention.head_count")
    n_layer = meta.positive("block_count")
    if MIN_BLOCK_TENSORS * n_layer > len(tensors):
        raise ModelLoadError(path, f"block_count {n_layer} needs at least {MIN_BLOCK_TENSORS * n_layer} "
                                   f"tensors, the file has {len(tensors)}")
    if meta.arch_get("expert_count", int, 0) > 0 or any(n.endswith("ffn_gate_inp.weight") for n in tensors):
        raise UnsupportedModelError(path, "gemma4 with a mixture of experts (26B-A4B) is not supported")
    if any(n.endswith("attn_qkv.weight") for n in tensors):
        raise UnsupportedModelError(path, "gemma4 with a fused attn_qkv is not supported")
    kv_heads = _per_layer(meta, "attention.head_count_kv", n_layer, n_head)
    if any(n_head % h for h in kv_heads):
        raise ModelLoadError(path, f"head_count {n_head} is not a multiple of head_count_kv {kv_heads}")
    n_ff = _per_layer(meta, "feed_forward_length", n_layer)
    head_dim = meta.positive("attention.key_length")
    head_dim_swa = meta.positive("attention.key_length_swa")
    if (meta.positive("attention.value_length", head_dim) != head_dim
            or meta.positive("attention.value_length_swa", head_dim_swa) != head_dim_swa):
        raise ModelLoadError(path, "gemma4 requires key_length == value_length (and for the sliding-window layers)")
    swa = md.get(f"{meta.arch}.attention.sliding_window_pattern")
    if not isinstance(swa, list) or len(swa) < n_layer or not all(isinstance(v, bool) for v in swa):
        raise ModelLoadError(path, f"metadata key '{meta.arch}.attention.sliding_window_pattern' is not "
                                   f"{n_layer} booleans")
    swa_layers = tuple(swa[:n_layer])
    n_swa = meta.positive("attention.sliding_window")
    n_shared = meta.arch_get("attention.shared_kv_layers", int, 0)
    n_kv = n_layer - n_shared
    if n_shared and not (n_kv >= 2 and not swa_layers[n_kv - 1] and swa_layers[n_kv - 2]):
        raise ModelLoadError(path, f"gemma4's {n_shared} shared-KV layers need layer {n_kv - 1} full and "
                                   f"layer {n_kv - 2} sliding-window (llama.cpp's reuse)")
    if not 0 <= n_shared < n_layer:
        raise ModelLoadError(path, f"metadata key '{meta.arch}.attention.shared_kv_layers' is {n_shared}")
    n_rot = meta.positive("rope.dimension_count", head_dim)
    if n_rot != head_dim:
        raise UnsupportedModelError(path, f"gemma4 full layers rotating {n_rot} of {head_dim} values are not supported")
    n_rot_swa = meta.positive("rope.dimension_count_swa", n_rot)
    if n_rot_swa > head_dim_swa or n_rot_swa % 2:
        raise ModelLoadError(path, f"rope.dimension_count_swa {n_rot_swa} of a head of {head_dim_swa}")
    factor = linear_rope_factor(meta)
    theta_swa = rope_theta_swa(meta)
    softcap = meta.arch_get("final_logit_softcapping", float, 0.0)
    n_vocab = n_vocab_of(meta, tensors)
    return ModelConfig(
        arch=meta.arch,
        name=str(md.get("general.name", path.stem)),
        n_vocab=n_vocab,
        n_embd=n_embd,
        n_layer=n_layer,
        n_head=n_head,
        n_head_kv=kv_heads[0],
        head_dim=head_dim,
        n_ff=max(n_ff),
        n_ctx_train=meta.positive("context_length"),
        rope_theta=rope_base(meta, 10000.0),
        rms_eps=meta.arch_get("attention.layer_norm_rms_epsilon", float),
        rope_mode=ARCH_ROPE[meta.arch],
        qk_norm=True,
        attn_bias=False,
        tied_embeddings="output.weight" not in tensors,
        n_swa=n_swa,
        swa_layers=swa_layers,
        rope_theta_swa=float(theta_swa),
        rope_freq_scale=1.0 / factor if factor > 0 else 1.0,
        attn_scale=1.0,
        head_dim_swa=head_dim_swa,
        n_rot_swa=n_rot_swa,
        n_head_kv_layers=kv_heads if len(set(kv_heads)) > 1 else (),
        n_ff_layers=n_ff if len(set(n_ff)) > 1 else (),
        n_embd_per_layer=meta.arch_get("embedding_length_per_layer_input", int),
        n_layer_kv=n_kv if n_shared else 0,
        final_logit_softcap=softcap,
    )


def kv_source(cfg: ModelConfig, il: int) -> int:
    """The layer whose cache layer ``il`` attends over: itself, or for a shared-KV layer
    llama.cpp's ``n_layer_kv_from_start - (is_swa ? 2 : 1)``."""
    if cfg.has_kv(il):
        return il
    return cfg.n_layer_kv - (2 if cfg.is_swa(il) else 1)


def tensors(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    e, n_pl, nh = cfg.n_embd, cfg.n_embd_per_layer, cfg.n_head
    shapes: dict[str, tuple[int, ...]] = {"token_embd.weight": (cfg.n_vocab, e)}
    if n_pl:
        shapes.update({"per_layer_token_embd.weight": (cfg.n_vocab, n_pl * cfg.n_layer),
                       "per_layer_model_proj.weight": (n_pl * cfg.n_layer, e),
                       "per_layer_proj_norm.weight": (n_pl,)})
    if not all(cfg.swa_layers):
        shapes["rope_freqs.weight"] = (cfg.head_dim // 2,)
    for il in range(cfg.n_layer):
        b = f"blk.{il}."
        hd, ff = cfg.layer_head_dim(il), cfg.layer_n_ff(il)
        shapes.update({b + "attn_norm.weight": (e,), b + "attn_q.weight": (nh * hd, e),
                       b + "attn_q_norm.weight": (hd,)})
        if cfg.has_kv(il):
            shapes.update({b + "attn_k.weight": (cfg.layer_n_head_kv(il) * hd, e), b + "attn_k_norm.weight": (hd,)})
        shapes.update({
            b + "attn_output.weight": (e, nh * hd),
            b + "post_attention_norm.weight": (e,),
            b + "ffn_norm.weight": (e,),
            b + "ffn_gate.weight": (ff, e),
            b + "ffn_up.weight": (ff, e),
            b + "ffn_down.weight": (e, ff),
            b + "post_ffw_norm.weight": (e,),
        })
        if n_pl:
            shapes.update({b + "inp_gate.weight": (n_pl, e), b + "proj.weight": (e, n_pl),
                           b + "post_norm.weight": (e,)})
    shapes.update(head_tensors(cfg))
    return shapes


def optional(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """``attn_v`` (absent: K is V) and ``layer_output_scale`` of each layer."""
    shapes: dict[str, tuple[int, ...]] = {}
    for il in range(cfg.n_layer):
        b = f"blk.{il}."
        if cfg.has_kv(il):
            shapes[b + "attn_v.weight"] = (cfg.layer_n_head_kv(il) * cfg.layer_head_dim(il), cfg.n_embd)
        shapes[b + "layer_output_scale.weight"] = (1,)
    return shapes


def _per_layer_inputs(g: Graph, cfg: ModelConfig, x: Tensor) -> Tensor:
    """llama.cpp's ``build_inp_per_layer`` + ``project_per_layer_inputs``: every layer's
    n_pl values per token, side by side: ``[T, n_layer * n_pl]``."""
    n_pl = cfg.n_embd_per_layer
    pl = g.get_rows(g.weight("per_layer_token_embd.weight"), g.tokens(), "inp_per_layer_selected")
    pl = g.scale(pl, math.sqrt(n_pl), "inp_per_layer_scaled")  # [T, n_layer * n_pl]
    proj = g.linear(x, g.weight("per_layer_model_proj.weight"), "per_layer_proj")  # [T, n_layer * n_pl]
    proj = g.scale(proj, 1.0 / math.sqrt(cfg.n_embd), "per_layer_proj_scaled")
    proj = g.rms_norm(proj, g.weight("per_layer_proj_norm.weight"), cfg.rms_eps, "per_layer_proj_normed", group=n_pl)
    return g.scale(g.add(proj, pl, "inp_per_layer_sum"), 1.0 / math.sqrt(2.0), "inp_per_layer")


def _attention(g: Graph, cfg: ModelConfig, h: Tensor, il: int) -> Tensor:
    b = f"blk.{il}."
    swa, eps = cfg.is_swa(il), cfg.rms_eps
    hd, nh, nkv = cfg.layer_head_dim(il), cfg.n_head, cfg.layer_n_head_kv(il)
    rope: dict[str, Any] = dict(head_dim=hd, mode="neox")
    if swa:
        rope.update(theta=cfg.rope_theta_swa, n_rot=cfg.n_rot_swa if cfg.n_rot_swa != hd else 0)
    else:
        rope.update(theta=cfg.rope_theta, freq_scale=cfg.rope_freq_scale, factors=g.weight("rope_freqs.weight"))
    window = cfg.n_swa if swa else 0
    q = g.linear(h, g.weight(b + "attn_q.weight"), "Qcur")  # [T, n_head * hd]
    q = g.rms_norm(q, g.weight(b + "attn_q_norm.weight"), eps, "Qcur_normed", group=hd)
    q = g.rope(q, "Qcur_pos", n_heads=nh, **rope)
    src = kv_source(cfg, il)
    if src != il:  # a shared-KV layer: the earlier layer's cache, nothing stored
        att = g.attention(q, None, None, "kqv_out", n_head=nh, n_head_kv=cfg.layer_n_head_kv(src), head_dim=hd,
                          scale=cfg.kq_scale, window=window, kv_layer=src)
    else:
        k = g.linear(h, g.weight(b + "attn_k.weight"), "Kcur")  # [T, n_head_kv * hd]
        v = g.linear(h, g.weight(b + "attn_v.weight"), "Vcur") if g.has(b + "attn_v.weight") else k
        k = g.rms_norm(k, g.weight(b + "attn_k_norm.weight"), eps, "Kcur_normed", group=hd)
        v = g.rms_norm(v, None, eps, "Vcur_normed", group=hd)
        k = g.rope(k, "Kcur_pos", n_heads=nkv, **rope)
        att = g.attention(q, k, v, "kqv_out", n_head=nh, n_head_kv=nkv, head_dim=hd, scale=cfg.kq_scale,
                          window=window)  # [T, n_head * hd]
    return g.linear(att, g.weight(b + "attn_output.weight"), "attn_out")  # [T, n_embd]


def build(g: Graph, cfg: ModelConfig) -> None:
    eps, n_pl = cfg.rms_eps, cfg.n_embd_per_layer
    x = g.get_rows(g.weight("token_embd.weight"), g.tokens())  # [T, n_embd]
    x = g.scale(x, math.sqrt(cfg.n_embd), "inp_scaled")
    per_layer = _per_layer_inputs(g, cfg, x) if n_pl else None  # [T, n_layer * n_pl]
    for il in range(cfg.n_layer):
        g.layer(il)
        b = f"blk.{il}."
        h = norm(g, x, b + "attn_norm.weight", eps, "attn_norm")
        h = norm(g, _attention(g, cfg, h, il), b + "post_attention_norm.weight", eps, "attn_post_norm")
        x = g.add(x, h, "attn_out_res")
        h = norm(g, x, b + "ffn_norm.weight", eps, "ffn_norm")
        h = norm(g, ffn(g, h, il, "gelu"), b + "post_ffw_norm.weight", eps, "ffn_post_norm")
        x = g.add(x, h, "ffn_out_res")
        if per_layer is not None:
            gate = g.linear(x, g.weight(b + "inp_gate.weight"), "pe_gate")  # [T, n_pl]
            mine = g.take(per_layer, cfg.n_layer * n_pl, il * n_pl, n_pl, "inp_this_layer")  # [T, n_pl]
            pe = g.linear(g.glu(gate, mine, "gelu", "pe_act"), g.weight(b + "proj.weight"), "pe_proj")  # [T, n_embd]
            pe = norm(g, pe, b + "post_norm.weight", eps, "per_layer_embd_out")
            x = g.add(x, pe, "pe_out")
        if g.has(b + "layer_output_scale.weight"):
            x = g.mul(x, g.weight(b + "layer_output_scale.weight"), "out_scaled")
        x = g.cvec(x)
    g.layer(-1)
    x = g.outputs(x)  # [O, n_embd]
    x = norm(g, x, "output_norm.weight", eps, "result_norm")
    if g.output == "embd":
        g.set_logits(x)
        return
    w = g.weight("output.weight" if g.has("output.weight") else "token_embd.weight")
    logits = g.linear(x, w, "result_output")  # [O, n_vocab]
    if cfg.final_logit_softcap > 0:
        logits = g.softcap(logits, cfg.final_logit_softcap, "result_softcapped")
    g.set_logits(logits)

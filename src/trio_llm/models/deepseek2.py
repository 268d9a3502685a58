"""deepseek2: multi-head latent attention and a DeepSeek-style mixture of experts
(llama.cpp's ``src/models/deepseek2.cpp``); GLM-4.7-Flash's files use it.

Attention goes through low-rank bottlenecks. Each query comes from ``attn_q_b`` of the
RMS-normed ``attn_q_a`` projection (or, without ``attention.q_lora_rank``, straight
from ``attn_q``): per head a part without RoPE and ``rope.dimension_count`` values
with (adjacent-pair RoPE). Keys and values of a token share one latent vector, the
RMS-normed first ``kv_lora_rank`` values of ``attn_kv_a_mqa``; its last ``n_rot``
values are a RoPE key shared by every head. llama.cpp's absorbed form, which this
file follows: each head's no-RoPE query goes through that head's ``attn_k_b`` into
the latent space, so attention is multi-query with one KV head whose row is the
latent plus the RoPE key (``key_length``, e.g. 576) and whose value is the latent
itself (a view of the same cache: one cache, K's type); each head's output then
leaves the latent space through its ``attn_v_b`` before ``attn_output``.

The first ``leading_dense_block_count`` layers have a dense SwiGLU FFN; the others
route each token to ``expert_used_count`` experts (softmax or sigmoid probabilities,
chosen with the optional ``exp_probs_b`` selection bias, renormalised if
``expert_weights_norm``, times ``expert_weights_scale``) and add an ungated shared
expert of ``expert_shared_count`` experts' width. Multi-token-prediction blocks after
the trunk (``nextn_predict_layers``) are not read.

Refused: files from before the MLA split (``attn_kv_b`` and no ``key_length_mla``),
YaRN or other RoPE scaling, attention temperature scaling, grouped expert selection
(``expert_group_count`` > 1), and gating functions other than softmax and sigmoid.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from trio_llm.errors import ModelLoadError, UnsupportedModelError
from trio_llm.graph import Graph, Tensor
from trio_llm.model.config import ModelConfig
from trio_llm.models import Meta
from trio_llm.models.blocks import Moe, ffn, head, head_tensors, moe_ffn, moe_tensors, norm
from trio_llm.models.llama import common_hparams, no_rope_scaling

ARCHS = ("deepseek2",)
MIN_BLOCK_TENSORS = 11
#: llama.cpp's ``expert_gating_func`` values
GATING = {1: "softmax", 2: "sigmoid"}


def kq_scale(head_dim_k_mla: int) -> float:
    """The softmax scale: over a head's q.k size before absorption (no YaRN here)."""
    return 1.0 / math.sqrt(head_dim_k_mla)


def hparams(meta: Meta, tensors: Mapping[str, Any]) -> ModelConfig:
    path, a = meta.path, meta.arch
    hp = common_hparams(meta, tensors, rms_eps_default=1e-6)
    if meta.arch_get("attention.key_length_mla", int, 0) <= 0 or "blk.0.attn_kv_b.weight" in tensors:
        raise UnsupportedModelError(path, "deepseek2 file without the MLA split (attn_k_b / attn_v_b and "
                                          "attention.key_length_mla): reconvert it with a newer llama.cpp")
    n_rot = meta.positive("rope.dimension_count")
    n_lora_kv = meta.positive("attention.kv_lora_rank")
    k_mla = meta.positive("attention.key_length_mla")
    v_mla = meta.positive("attention.value_length_mla")
    n_lora_q = meta.arch_get("attention.q_lora_rank", int, 0)
    if n_lora_q < 0 or n_rot % 2 or not 0 < n_rot < k_mla:
        raise ModelLoadError(path, f"MLA sizes do not fit: q_lora_rank {n_lora_q}, rope.dimension_count {n_rot}, "
                                   f"key_length_mla {k_mla}")
    if hp["head_dim"] != n_lora_kv + n_rot or meta.arch_get("attention.value_length", int, n_lora_kv) != n_lora_kv:
        raise ModelLoadError(path, f"metadata key '{a}.attention.key_length' is {hp['head_dim']} and value_length "
                                   f"{meta.md.get(f'{a}.attention.value_length')}, expected kv_lora_rank + "
                                   f"n_rot = {n_lora_kv + n_rot} and {n_lora_kv}")
    if hp["n_head_kv"] != 1:
        raise ModelLoadError(path, f"metadata key '{a}.attention.head_count_kv' is {hp['n_head_kv']}, expected 1 (MLA)")
    scaling = meta.md.get(f"{a}.rope.scaling.type", "none")
    if scaling != "none" or meta.arch_get("rope.scaling.factor", float, 1.0) not in (0.0, 1.0):
        raise UnsupportedModelError(path, f"deepseek2 with RoPE scaling {scaling!r} (YaRN) is not supported")
    no_rope_scaling(meta, hp, "YaRN of MLA")  # the command line's --rope-* / --yarn-*
    if meta.arch_get("attention.temperature_scale", float, 0.0) != 0.0:
        raise UnsupportedModelError(path, "deepseek2 with attention temperature scaling is not supported")
    if meta.arch_get("expert_group_count", int, 0) > 1:
        raise UnsupportedModelError(path, "deepseek2 with grouped expert selection (expert_group_count > 1) "
                                          "is not supported")
    n_dense = meta.arch_get("leading_dense_block_count", int, 0)
    n_expert = meta.positive("expert_count") if n_dense < hp["n_layer"] else meta.arch_get("expert_count", int, 0)
    n_used = meta.positive("expert_used_count") if n_expert else 0
    if n_dense < 0 or n_used > n_expert:
        raise ModelLoadError(path, f"leading_dense_block_count {n_dense}, expert_used_count {n_used} of "
                                   f"expert_count {n_expert}")
    n_ff_exp = meta.positive("expert_feed_forward_length")
    n_shared = meta.positive("expert_shared_count") if n_expert else 0
    func = meta.arch_get("expert_gating_func", int, 0)
    if func == 0:  # llama.cpp's default for files without the key: sigmoid for GLM-4.7-Flash's shape
        func = 2 if hp["n_layer"] + meta.arch_get("nextn_predict_layers", int, 0) in (47, 48) \
            and hp["n_vocab"] == 154880 else 1
    if func not in GATING:
        raise UnsupportedModelError(path, f"deepseek2 with expert_gating_func {func} is not supported "
                                          f"(softmax and sigmoid are)")
    return ModelConfig(**{**hp, "n_rot": n_rot, "attn_scale": kq_scale(k_mla)},
                       n_lora_q=n_lora_q, n_lora_kv=n_lora_kv, head_dim_k_mla=k_mla, head_dim_v_mla=v_mla,
                       n_dense_lead=min(n_dense, hp["n_layer"]), n_expert=n_expert, n_expert_used=n_used,
                       n_ff_exp=n_ff_exp, n_ff_shexp=n_ff_exp * n_shared, expert_gating=GATING[func],
                       expert_weights_norm=meta.arch_get("expert_weights_norm", bool, False),
                       expert_weights_scale=meta.arch_get("expert_weights_scale", float, 0.0))


def tensors(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    e, nh, r = cfg.n_embd, cfg.n_head, cfg.n_rot
    kv, kq, vd = cfg.n_lora_kv, cfg.head_dim_k_mla, cfg.head_dim_v_mla
    shapes: dict[str, tuple[int, ...]] = {"token_embd.weight": (cfg.n_vocab, e)}
    for il in range(cfg.n_layer):
        b = f"blk.{il}."
        shapes[b + "attn_norm.weight"] = (e,)
        if cfg.n_lora_q:
            shapes.update({b + "attn_q_a_norm.weight": (cfg.n_lora_q,), b + "attn_q_a.weight": (cfg.n_lora_q, e),
                           b + "attn_q_b.weight": (nh * kq, cfg.n_lora_q)})
        else:
            shapes[b + "attn_q.weight"] = (nh * kq, e)
        shapes.update({
            b + "attn_kv_a_mqa.weight": (kv + r, e),
            b + "attn_kv_a_norm.weight": (kv,),
            b + "attn_k_b.weight": (nh, kv, kq - r),  # each head's no-RoPE query into the latent
            b + "attn_v_b.weight": (nh, vd, kv),  # each head's output out of it
            b + "attn_output.weight": (e, nh * vd),
            b + "ffn_norm.weight": (e,),
        })
        if il < cfg.n_dense_lead:
            shapes.update({b + "ffn_gate.weight": (cfg.n_ff, e), b + "ffn_up.weight": (cfg.n_ff, e),
                           b + "ffn_down.weight": (e, cfg.n_ff)})
        else:
            shapes.update(moe_tensors(cfg, il))
    shapes.update(head_tensors(cfg))
    return shapes


def optional(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The experts' selection bias (DeepSeek-V3's ``e_score_correction_bias``)."""
    return {f"blk.{il}.exp_probs_b.bias": (cfg.n_expert,) for il in range(cfg.n_dense_lead, cfg.n_layer)}


def mla_attention(g: Graph, h: Tensor, il: int, cfg: ModelConfig) -> Tensor:
    """Multi-head latent attention in the absorbed form: ``[T, n_embd]``."""
    b = f"blk.{il}."
    nh, r, kv, kq, eps = cfg.n_head, cfg.n_rot, cfg.n_lora_kv, cfg.head_dim_k_mla, cfg.rms_eps
    if cfg.n_lora_q:
        q = g.linear(h, g.weight(b + "attn_q_a.weight"), "q_a")  # [T, q_lora]
        q = g.rms_norm(q, g.weight(b + "attn_q_a_norm.weight"), eps, "q_a_norm")
        q = g.linear(q, g.weight(b + "attn_q_b.weight"), "q")  # [T, n_head * kq]
    else:
        q = g.linear(h, g.weight(b + "attn_q.weight"), "q")  # [T, n_head * kq]
    rope = dict(head_dim=r, mode="normal", theta=cfg.rope_theta)
    q_nope = g.take(q, kq, 0, kq - r, "q_nope")  # [T, n_head * (kq - r)]
    q_pe = g.rope(g.take(q, kq, kq - r, r, "q_pe"), "q_pe_rope", n_heads=nh, **rope)  # type: ignore[arg-type]
    q_abs = g.head_linear(q_nope, g.weight(b + "attn_k_b.weight"), "q_nope_absorbed")  # [T, n_head * kv]
    q = g.concat(q_abs, q_pe, nh, "Qcur")  # [T, n_head * (kv + r)]
    ckv = g.linear(h, g.weight(b + "attn_kv_a_mqa.weight"), "kv_cmpr_pe")  # [T, kv + r]
    k_pe = g.rope(g.take(ckv, kv + r, kv, r, "k_pe"), "k_pe_rope", n_heads=1, **rope)  # type: ignore[arg-type]
    latent = g.rms_norm(g.take(ckv, kv + r, 0, kv, "kv_cmpr"), g.weight(b + "attn_kv_a_norm.weight"), eps,
                        "kv_cmpr_norm")  # [T, kv]
    k = g.concat(latent, k_pe, 1, "Kcur")  # [T, kv + r]
    att = g.attention(q, k, k, "kqv_latent", n_head=nh, n_head_kv=1, head_dim=kv + r, scale=cfg.kq_scale,
                      v_is_k=True, v_dim=kv)  # [T, n_head * (kv + r)], each head's first kv values kept
    att = g.take(att, kv + r, 0, kv, "kqv")  # [T, n_head * kv]: the values are the latent part
    att = g.head_linear(att, g.weight(b + "attn_v_b.weight"), "kqv_mla")  # [T, n_head * v_mla]
    return g.linear(att, g.weight(b + "attn_output.weight"), "attn_out")  # [T, n_embd]


def build(g: Graph, cfg: ModelConfig) -> None:
    eps = cfg.rms_eps
    moe = Moe(n_expert=cfg.n_expert, n_expert_used=cfg.n_expert_used, norm=cfg.expert_weights_norm,
              scale=cfg.expert_weights_scale, shared=True, shared_gate=False,
              gating="sigmoid" if cfg.expert_gating == "sigmoid" else "softmax")
    x = g.get_rows(g.weight("token_embd.weight"), g.tokens())  # [T, n_embd]
    for il in range(cfg.n_layer):
        g.layer(il)
        b = f"blk.{il}."
        h = norm(g, x, b + "attn_norm.weight", eps, "attn_norm")
        x = g.add(x, mla_attention(g, h, il, cfg), "ffn_inp")
        h = norm(g, x, b + "ffn_norm.weight", eps, "ffn_norm")
        out = ffn(g, h, il, "silu") if il < cfg.n_dense_lead else moe_ffn(g, h, il, moe, "silu")
        x = g.cvec(g.add(x, out, "l_out"))
    head(g, x, eps)

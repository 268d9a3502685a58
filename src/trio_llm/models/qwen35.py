"""qwen35: Qwen3.5's hybrid of gated delta-net layers and gated full attention
(llama.cpp's ``src/models/qwen35.cpp`` and ``delta-net-base.cpp``).

Three of every ``full_attention_interval`` (4) layers are linear attention: one
projection ``attn_qkv`` feeds a short causal convolution (``ssm_conv1d``, width
``ssm.conv_kernel``, SiLU), whose output splits into q, k (L2-normalised per head) and
v for the gated delta rule over a per-sequence recurrent state (decay from
``ssm_alpha``, ``ssm_dt.bias`` and ``ssm_a``; update strength from ``ssm_beta``); its
output is RMS-normed per head (``ssm_norm``), gated by SiLU of ``attn_gate``, and
projected back (``ssm_out``). The fourth layer is attention whose q projection also
carries a per-head output gate (interleaved: each head's q then its gate), with
QK-norm, RoPE on the first ``rope.dimension_count`` values of each head only, and the
attention output multiplied by the gate's sigmoid. Every layer norms again before its
SwiGLU FFN (``post_attention_norm``). For text, llama.cpp's multi-section RoPE gives
every section the token's position, which is plain half-split RoPE.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from trio_llm.errors import ModelLoadError, UnsupportedModelError
from trio_llm.graph import Graph, Tensor
from trio_llm.model.config import ModelConfig
from trio_llm.models import Meta
from trio_llm.models.blocks import ffn, head, head_tensors, norm
from trio_llm.models.llama import common_hparams, no_rope_scaling

ARCHS = ("qwen35",)
MIN_BLOCK_TENSORS = 9
FULL_ATTENTION_INTERVAL = 4


def ssm_hparams(meta: Meta, n_layer: int) -> dict[str, Any]:
    """The delta-net hyper-parameters (shared with qwen35moe)."""
    d_conv = meta.positive("ssm.conv_kernel")
    d_inner = meta.positive("ssm.inner_size")
    d_state = meta.positive("ssm.state_size")
    n_v = meta.positive("ssm.time_step_rank")
    n_k = meta.positive("ssm.group_count")
    if d_inner % n_v or d_inner // n_v != d_state:
        raise UnsupportedModelError(meta.path, f"delta-net value heads of {d_inner} / {n_v} differ from the "
                                               f"key heads of {d_state} (llama.cpp requires them equal)")
    if n_v % n_k:
        raise ModelLoadError(meta.path, f"ssm.time_step_rank {n_v} is not a multiple of ssm.group_count {n_k}")
    interval = meta.arch_get("full_attention_interval", int, FULL_ATTENTION_INTERVAL)
    if interval <= 0:
        raise ModelLoadError(meta.path, f"metadata key '{meta.arch}.full_attention_interval' is {interval}")
    recurrent = tuple((il + 1) % interval != 0 for il in range(n_layer))
    # the converter's per-layer list (from the checkpoint's layer_types), which llama.cpp
    # prefers to the interval; it may go on over the multi-token-prediction blocks
    key = f"{meta.arch}.attention.recurrent_layers"
    listed = meta.md.get(key)
    if listed is not None:
        if not isinstance(listed, list) or len(listed) < n_layer or not all(isinstance(x, bool) for x in listed):
            raise ModelLoadError(meta.path, f"metadata key {key!r} is not a list of {n_layer} or more booleans")
        recurrent = tuple(listed[:n_layer])
    return dict(
        recurrent_layers=recurrent,
        ssm_d_conv=d_conv, ssm_n_k_heads=n_k, ssm_n_v_heads=n_v, ssm_head_dim=d_state,
    )


def hparams(meta: Meta, tensors: Mapping[str, Any]) -> ModelConfig:
    hp = common_hparams(meta, tensors, rms_eps_default=1e-6)
    hp["qk_norm"] = True
    hp["n_rot"] = meta.positive("rope.dimension_count", hp["head_dim"])
    if hp["n_rot"] > hp["head_dim"] or hp["n_rot"] % 2:
        raise ModelLoadError(meta.path, f"rope.dimension_count {hp['n_rot']} does not fit head_dim {hp['head_dim']}")
    no_rope_scaling(meta, hp, "partial RoPE")
    return ModelConfig(**hp, **ssm_hparams(meta, hp["n_layer"]))


def dims(cfg: ModelConfig) -> tuple[int, int, int]:
    """(key_dim, value_dim, conv_dim) of a delta-net layer."""
    key = cfg.ssm_n_k_heads * cfg.ssm_head_dim
    value = cfg.ssm_n_v_heads * cfg.ssm_head_dim
    return key, value, 2 * key + value


def layer_tensors(cfg: ModelConfig, il: int) -> dict[str, tuple[int, ...]]:
    """The attention-side tensors of layer ``il`` (either kind) and its norms."""
    e, q, kv, hd = cfg.n_embd, cfg.q_dim, cfg.kv_dim, cfg.head_dim
    b = f"blk.{il}."
    shapes: dict[str, tuple[int, ...]] = {b + "attn_norm.weight": (e,), b + "post_attention_norm.weight": (e,)}
    if cfg.is_recurrent(il):
        key, value, conv = dims(cfg)
        nv = cfg.ssm_n_v_heads
        shapes.update({
            b + "attn_qkv.weight": (conv, e),
            b + "attn_gate.weight": (value, e),
            b + "ssm_conv1d.weight": (conv, cfg.ssm_d_conv),
            b + "ssm_dt.bias": (nv,),
            b + "ssm_a": (nv,),
            b + "ssm_beta.weight": (nv, e),
            b + "ssm_alpha.weight": (nv, e),
            b + "ssm_norm.weight": (cfg.ssm_head_dim,),
            b + "ssm_out.weight": (e, value),
        })
    else:
        shapes.update({
            b + "attn_q.weight": (2 * q, e),  # each head's q, then its output gate
            b + "attn_k.weight": (kv, e),
            b + "attn_v.weight": (kv, e),
            b + "attn_q_norm.weight": (hd,),
            b + "attn_k_norm.weight": (hd,),
            b + "attn_output.weight": (e, q),
        })
    return shapes


def tensors(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    e, ff = cfg.n_embd, cfg.n_ff
    shapes: dict[str, tuple[int, ...]] = {"token_embd.weight": (cfg.n_vocab, e)}
    for il in range(cfg.n_layer):
        b = f"blk.{il}."
        shapes.update(layer_tensors(cfg, il))
        shapes.update({b + "ffn_gate.weight": (ff, e), b + "ffn_up.weight": (ff, e), b + "ffn_down.weight": (e, ff)})
    shapes.update(head_tensors(cfg))
    return shapes


def optional(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    return {}


def gated_attention(g: Graph, h: Tensor, il: int, cfg: ModelConfig) -> Tensor:
    """Full attention with a per-head output gate and partial RoPE: ``[T, n_embd]``."""
    b = f"blk.{il}."
    hd, eps = cfg.head_dim, cfg.rms_eps
    qg = g.linear(h, g.weight(b + "attn_q.weight"), "Qcur_full")  # [T, n_head * 2 hd]
    q = g.take(qg, 2 * hd, 0, hd, "Qcur")  # [T, n_head * hd]
    gate = g.take(qg, 2 * hd, hd, hd, "gate")  # [T, n_head * hd]
    q = g.rms_norm(q, g.weight(b + "attn_q_norm.weight"), eps, "Qcur_normed", group=hd)
    k = g.linear(h, g.weight(b + "attn_k.weight"), "Kcur")  # [T, n_head_kv * hd]
    k = g.rms_norm(k, g.weight(b + "attn_k_norm.weight"), eps, "Kcur_normed", group=hd)
    v = g.linear(h, g.weight(b + "attn_v.weight"), "Vcur")  # [T, n_head_kv * hd]
    kw = dict(head_dim=hd, mode="neox", theta=cfg.rope_theta, n_rot=cfg.n_rot)
    q = g.rope(q, "Qcur_rope", n_heads=cfg.n_head, **kw)  # type: ignore[arg-type]
    k = g.rope(k, "Kcur_rope", n_heads=cfg.n_head_kv, **kw)  # type: ignore[arg-type]
    att = g.attention(q, k, v, "attn_pregate", n_head=cfg.n_head, n_head_kv=cfg.n_head_kv, head_dim=hd,
                      scale=1.0 / math.sqrt(hd))  # [T, n_head * hd]
    att = g.glu(gate, att, "sigmoid", "attn_gated")  # sigmoid(gate) * att
    return g.linear(att, g.weight(b + "attn_output.weight"), "attn_output")  # [T, n_embd]


def beta_alpha(g: Graph, h: Tensor, il: int, cfg: ModelConfig) -> tuple[Tensor, Tensor]:
    """Qwen3.5's gates of the delta rule, one projection each: ``[T, n_v]`` twice."""
    b = f"blk.{il}."
    beta = g.linear(h, g.weight(b + "ssm_beta.weight"), "beta")  # [T, n_v]
    alpha = g.linear(h, g.weight(b + "ssm_alpha.weight"), "alpha")  # [T, n_v]
    return beta, alpha


def linear_attention(g: Graph, h: Tensor, il: int, cfg: ModelConfig, gates: Any = beta_alpha,
                     k_grouped: bool = False) -> Tensor:
    """The gated delta-net layer: ``[T, n_embd]``; ``gates(g, h, il, cfg)`` makes its
    (beta, alpha), ``k_grouped`` is ``Graph.delta_net``'s (qwen3next's layout)."""
    b = f"blk.{il}."
    key, value, conv = dims(cfg)
    d, eps = cfg.ssm_head_dim, cfg.rms_eps
    qkv = g.linear(h, g.weight(b + "attn_qkv.weight"), "linear_attn_qkv_mixed")  # [T, conv]
    z = g.linear(h, g.weight(b + "attn_gate.weight"), "z")  # [T, value]
    beta, alpha = gates(g, h, il, cfg)  # [T, n_v] each
    c = g.ssm_conv(qkv, g.weight(b + "ssm_conv1d.weight"), "conv_output_silu")  # [T, conv]
    q = g.l2_norm(g.take(c, conv, 0, key, "q_conv"), d, eps, "q_conv_normed")  # [T, key]
    k = g.l2_norm(g.take(c, conv, key, key, "k_conv"), d, eps, "k_conv_normed")  # [T, key]
    v = g.take(c, conv, 2 * key, value, "v_conv")  # [T, value]
    o = g.delta_net(q, k, v, alpha, beta, g.weight(b + "ssm_dt.bias"), g.weight(b + "ssm_a"), "attn_output",
                    n_k_heads=cfg.ssm_n_k_heads, n_v_heads=cfg.ssm_n_v_heads, head_dim=d,
                    k_grouped=k_grouped)  # [T, value]
    o = g.rms_norm(o, g.weight(b + "ssm_norm.weight"), eps, "attn_out_norm", group=d)
    o = g.glu(z, o, "silu", "final_output")  # silu(z) * normed
    return g.linear(o, g.weight(b + "ssm_out.weight"), "linear_attn_out")  # [T, n_embd]


def build_layers(g: Graph, cfg: ModelConfig, ffn_block: Any, linear: Any = linear_attention) -> None:
    """The hybrid stack; ``ffn_block(g, h, il)`` is the layer's feed-forward (qwen35moe's
    is a mixture of experts), ``linear(g, h, il, cfg)`` its delta-net layer (qwen3next's
    takes its gates from one projection)."""
    eps = cfg.rms_eps
    x = g.get_rows(g.weight("token_embd.weight"), g.tokens())  # [T, n_embd]
    for il in range(cfg.n_layer):
        g.layer(il)
        b = f"blk.{il}."
        h = norm(g, x, b + "attn_norm.weight", eps, "attn_norm")
        mix = linear if cfg.is_recurrent(il) else gated_attention
        x = g.add(x, mix(g, h, il, cfg), "attn_residual")
        h = norm(g, x, b + "post_attention_norm.weight", eps, "attn_post_norm")
        x = g.cvec(g.add(x, ffn_block(g, h, il), "post_ffn"))
    head(g, x, eps)


def build(g: Graph, cfg: ModelConfig) -> None:
    build_layers(g, cfg, lambda g, h, il: ffn(g, h, il, "silu"))

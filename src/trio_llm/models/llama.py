"""llama, qwen2 and qwen3: the plain pre-norm transformer with SwiGLU.

The three differ in three switches, all read from the file: q/k/v biases (qwen2),
RMSNorm of each q and k head before RoPE (qwen3), and the RoPE layout (llama GGUFs
store Q/K rows permuted for adjacent-pair RoPE; qwen uses the half split).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from trio_llm.errors import ModelLoadError, UnsupportedModelError
from trio_llm.graph import Graph, yarn_corr_dims
from trio_llm.model.config import ARCH_ROPE, ModelConfig
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

ARCHS = ("llama", "qwen2", "qwen3")
MIN_BLOCK_TENSORS = 9


def n_vocab_of(meta: Meta, tensors: Mapping[str, Any]) -> int:
    """The vocabulary size: the tokenizer's token count, else (no tokenizer section) the
    embedding's rows; the tokenizer raises its own error if anything needs one."""
    toks = meta.md.get("tokenizer.ggml.tokens")
    if isinstance(toks, list) and toks:
        return len(toks)
    if "token_embd.weight" in tensors:
        return int(tensors["token_embd.weight"].shape[0])
    raise ModelLoadError(meta.path, "missing tensor 'token_embd.weight'")


def common_hparams(meta: Meta, tensors: Mapping[str, Any], *, rms_eps_default: float = 1e-5) -> dict[str, Any]:
    """The hyper-parameters every llama-shaped architecture stores under its own name."""
    path, md = meta.path, meta.md
    n_embd = meta.positive("embedding_length")
    n_head = meta.positive("attention.head_count")
    n_head_kv = meta.positive("attention.head_count_kv", n_head)
    n_layer = meta.positive("block_count")
    # llama.cpp's converter appends multi-token-prediction blocks (Qwen3.5, Qwen3-Next:
    # `nextn_predict_layers` of them) after the trunk and counts them in block_count;
    # a forward pass is the trunk's, as llama.cpp's without an MTP context
    nextn = meta.arch_get("nextn_predict_layers", int, 0)
    if not 0 <= nextn < n_layer:
        raise ModelLoadError(path, f"metadata key '{meta.arch}.nextn_predict_layers' is {nextn}, "
                                   f"block_count {n_layer}")
    n_layer -= nextn
    # checked before anything loops over blocks, so a corrupt count cannot make
    # validation run for hours
    if MIN_BLOCK_TENSORS * n_layer > len(tensors):
        raise ModelLoadError(path, f"block_count {n_layer} needs at least {MIN_BLOCK_TENSORS * n_layer} "
                                   f"tensors, the file has {len(tensors)}")
    if n_head % n_head_kv:
        raise ModelLoadError(path, f"head_count {n_head} is not a multiple of head_count_kv {n_head_kv}")
    n_vocab = n_vocab_of(meta, tensors)
    return dict(
        arch=meta.arch,
        name=str(md.get("general.name", path.stem)),
        n_vocab=n_vocab,
        n_embd=n_embd,
        n_layer=n_layer,
        n_head=n_head,
        n_head_kv=n_head_kv,
        head_dim=meta.positive("attention.key_length", max(1, n_embd // n_head)),
        n_ff=meta.positive("feed_forward_length"),
        n_ctx_train=meta.positive("context_length"),
        rope_theta=rope_base(meta, 10000.0),
        rms_eps=meta.arch_get("attention.layer_norm_rms_epsilon", float, rms_eps_default),
        rope_mode=ARCH_ROPE[meta.arch],
        qk_norm="blk.0.attn_q_norm.weight" in tensors,
        attn_bias="blk.0.attn_q.bias" in tensors,
        tied_embeddings="output.weight" not in tensors,
        n_cls_out=tensors["cls.output.weight"].shape[0] if "cls.output.weight" in tensors else 0,
    )


def rope_base(meta: Meta, default: float) -> float:
    """The RoPE base: ``--rope-freq-base``, else the file's ``rope.freq_base``."""
    base = meta.over.get("rope_freq_base") or meta.arch_get("rope.freq_base", float, default)
    if base <= 0:
        raise ModelLoadError(meta.path, f"RoPE base {base} is not positive")
    return float(base)


#: llama.cpp's YaRN defaults for the architectures that do not set them
#: (``llama_hparams::yarn_beta_fast`` / ``yarn_beta_slow``)
YARN_BETA_FAST, YARN_BETA_SLOW = 32.0, 1.0


def rope_scaling(meta: Meta, hp: Mapping[str, Any]) -> dict[str, Any]:
    """RoPE scaling as llama.cpp derives it (``llama_model::load_hparams`` for the file,
    ``llama_context``'s cparams for the command line over it): the config fields
    ``rope_freq_scale`` and ``rope_yarn``, ``attn_scale`` when YaRN's magnitude factor
    (or ``rope.scaling.attn_factor``) is not 1, and ``n_ctx_train`` when the command
    line rescales a YaRN model.

    - ``rope.scaling.type``: ``none``, ``linear`` (the default when the key is missing)
      or ``yarn``; ``--rope-scaling`` over it. ``longrope`` and the rest are refused.
    - ``rope.scaling.factor`` (or the older ``rope.scale_linear``): the positions are
      divided by it (``freq_scale`` = 1 / factor); ``--rope-scale`` / ``--rope-freq-scale``
      over it; type ``none`` never scales.
    - YaRN (``ext_factor`` 1 unless ``--yarn-ext-factor``): each frequency's position is
      blended between scaled and unscaled by a ramp between the correction dimensions
      of ``rope.scaling.original_context_length`` (``--yarn-orig-ctx``; else the
      training context) and the betas (32 and 1, or ``--yarn-beta-fast/slow``); ggml's
      cos and sin carry ``1 + 0.1 ln(factor)`` times ``rope.scaling.attn_factor``. That
      factor multiplies q and k alike, so here it is the softmax scale's, squared: the
      same attention, and a rope op that stays a rotation."""
    over, path = meta.over, meta.path
    kind = over.get("rope_scaling") or meta.arch_get("rope.scaling.type", str, "linear")
    if kind not in ("none", "linear", "yarn"):
        raise UnsupportedModelError(path, f"RoPE scaling {kind!r} is not supported (none, linear, yarn)")
    factor = meta.arch_get("rope.scaling.factor", float, 0.0) or meta.arch_get("rope.scale_linear", float, 0.0)
    fs_file = 1.0 / factor if factor else 1.0
    fs = float(over.get("rope_freq_scale") or fs_file)
    if kind == "none":
        fs = 1.0
    if fs <= 0:
        raise ModelLoadError(path, f"RoPE frequency scale {fs} is not positive")
    ext = float(over.get("yarn_ext_factor", -1.0))
    if ext < 0:
        ext = 1.0 if kind == "yarn" else 0.0
    attn = float(over.get("yarn_attn_factor", -1.0))
    if attn < 0:
        attn = 1.0
    out: dict[str, Any] = {"rope_freq_scale": fs}
    n_ctx_orig = int(over.get("yarn_orig_ctx") or meta.arch_get("rope.scaling.original_context_length", int, 0)
                     or hp["n_ctx_train"])
    if ext != 0:
        f = 1.0 / fs
        attn = (1.0 + 0.1 * math.log(f) if f > 1.0 else 1.0) / (1.0 + 0.1 * math.log(f))
        n_rot = hp.get("n_rot") or hp["head_dim"]
        low, high = yarn_corr_dims(n_rot, n_ctx_orig, hp["rope_theta"], float(over.get("yarn_beta_fast", YARN_BETA_FAST)),
                                   float(over.get("yarn_beta_slow", YARN_BETA_SLOW)))
        out["rope_yarn"] = (ext, low, high)
        if kind == "yarn" and fs != fs_file:  # llama_context: the longer context YaRN now reaches
            out["n_ctx_train"] = int(n_ctx_orig / fs)
    attn *= meta.arch_get("rope.scaling.attn_factor", float, 1.0)
    # ggml's rope_yarn multiplies cos and sin by attn, and by 1 + 0.1 ln(1 / freq_scale) with YaRN on
    mscale = attn * (1.0 + 0.1 * math.log(1.0 / fs) if ext != 0 else 1.0)
    if mscale != 1.0:
        out["attn_scale"] = mscale * mscale / math.sqrt(hp["head_dim"])
    return out


def no_rope_scaling(meta: Meta, hp: Mapping[str, Any], why: str) -> None:
    """Refuse a file or command line whose RoPE scaling an architecture does not run."""
    scaling = rope_scaling(meta, hp)
    if scaling["rope_freq_scale"] != 1.0 or scaling.get("rope_yarn") or "attn_scale" in scaling:
        raise UnsupportedModelError(meta.path, f"RoPE scaling of {meta.arch} is not supported ({why})")


def hparams(meta: Meta, tensors: Mapping[str, Any]) -> ModelConfig:
    hp = common_hparams(meta, tensors)
    cfg = ModelConfig(**{**hp, **rope_scaling(meta, hp)})
    if cfg.arch == "qwen3" and not cfg.qk_norm:
        raise ModelLoadError(meta.path, "missing tensor 'blk.0.attn_q_norm.weight' (qwen3 has QK-norm)")
    if cfg.arch == "qwen2" and not cfg.attn_bias:
        raise ModelLoadError(meta.path, "missing tensor 'blk.0.attn_q.bias' (qwen2 has q/k/v biases)")
    return cfg


def tensors(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    e, ff = cfg.n_embd, cfg.n_ff
    shapes: dict[str, tuple[int, ...]] = {"token_embd.weight": (cfg.n_vocab, e)}
    for i in range(cfg.n_layer):
        b = f"blk.{i}."
        shapes.update(attention_tensors(cfg, i, qk_norm=cfg.qk_norm, bias=cfg.attn_bias))
        shapes[b + "ffn_norm.weight"] = (e,)
        shapes[b + "ffn_gate.weight"] = (ff, e)
        shapes[b + "ffn_up.weight"] = (ff, e)
        shapes[b + "ffn_down.weight"] = (e, ff)
    shapes.update(head_tensors(cfg))
    if cfg.n_cls_out:  # a reranker's classifier (llama.cpp loads it for qwen3)
        shapes["cls.output.weight"] = (cfg.n_cls_out, e)
    return shapes


def optional(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    return {"rope_freqs.weight": (cfg.head_dim // 2,)}


def build(g: Graph, cfg: ModelConfig) -> None:
    eps = cfg.rms_eps
    a = Attn(n_head=cfg.n_head, n_head_kv=cfg.n_head_kv, head_dim=cfg.head_dim, eps=eps,
             scale=cfg.kq_scale, bias=cfg.attn_bias, qk_norm=cfg.qk_norm)
    rope = Rope(mode=cfg.rope_mode, theta=cfg.rope_theta, freq_scale=cfg.rope_freq_scale, factors="rope_freqs.weight",
                yarn=cfg.rope_yarn)
    x = g.get_rows(g.weight("token_embd.weight"), g.tokens())  # [T, n_embd]
    for il in range(cfg.n_layer):
        g.layer(il)
        h = norm(g, x, f"blk.{il}.attn_norm.weight", eps, "attn_norm")
        x = g.add(x, attention(g, h, il, a, rope), "ffn_inp")
        h = norm(g, x, f"blk.{il}.ffn_norm.weight", eps, "ffn_norm")
        x = g.cvec(g.add(x, ffn(g, h, il, "silu"), "l_out"))
    head(g, x, eps)

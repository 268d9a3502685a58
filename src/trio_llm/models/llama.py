"""llama, qwen2 and qwen3: the plain pre-norm transformer with SwiGLU.

The three differ in three switches, all read from the file: q/k/v biases (qwen2),
RMSNorm of each q and k head before RoPE (qwen3), and the RoPE layout (llama GGUFs
store Q/K rows permuted for adjacent-pair RoPE; qwen uses the half split).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from trio_llm.errors import ModelLoadError
from trio_llm.graph import Graph
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
    toks = md.get("tokenizer.ggml.tokens")
    if isinstance(toks, list) and toks:
        n_vocab = len(toks)
    elif "token_embd.weight" in tensors:
        # no tokenizer section: the embedding still tells the vocabulary size, and the
        # tokenizer raises its own error if anything needs one
        n_vocab = tensors["token_embd.weight"].shape[0]
    else:
        raise ModelLoadError(path, "missing tensor 'token_embd.weight'")
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
        rope_theta=meta.arch_get("rope.freq_base", float, 10000.0),
        rms_eps=meta.arch_get("attention.layer_norm_rms_epsilon", float, rms_eps_default),
        rope_mode=ARCH_ROPE[meta.arch],
        qk_norm="blk.0.attn_q_norm.weight" in tensors,
        attn_bias="blk.0.attn_q.bias" in tensors,
        tied_embeddings="output.weight" not in tensors,
        n_cls_out=tensors["cls.output.weight"].shape[0] if "cls.output.weight" in tensors else 0,
    )


def hparams(meta: Meta, tensors: Mapping[str, Any]) -> ModelConfig:
    cfg = ModelConfig(**common_hparams(meta, tensors))
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
    rope = Rope(mode=cfg.rope_mode, theta=cfg.rope_theta, factors="rope_freqs.weight")
    x = g.get_rows(g.weight("token_embd.weight"), g.tokens())  # [T, n_embd]
    for il in range(cfg.n_layer):
        g.layer(il)
        h = norm(g, x, f"blk.{il}.attn_norm.weight", eps, "attn_norm")
        x = g.add(x, attention(g, h, il, a, rope), "ffn_inp")
        h = norm(g, x, f"blk.{il}.ffn_norm.weight", eps, "ffn_norm")
        x = g.add(x, ffn(g, h, il, "silu"), "l_out")
    head(g, x, eps)

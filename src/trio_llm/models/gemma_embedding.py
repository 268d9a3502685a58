"""gemma-embedding: EmbeddingGemma, gemma3's stack as a bidirectional encoder.

llama.cpp's ``src/models/gemma-embedding.cpp``: gemma3's layers (the embedding scaled by
sqrt(n_embd), QK-norm, sandwich norms, GeGLU, five sliding-window layers to one global
one, a softmax scale of 1/sqrt(head_dim)) with these differences:

- attention is not causal (``hparams.causal_attn = false``): every token of a prompt sees
  every other, so a prompt runs in one pass (llama.cpp gives the model no memory and
  needs the prompt in one ubatch); the server's embedding passes mark their entries
  non-causal (``SeqBatch.causal``), and the model does not generate;
- the sliding window is symmetric (``LLAMA_SWA_TYPE_SYMMETRIC``): a token at p sees the
  keys j with ``|p - j| <= n_swa / 2``, here ``window = n_swa // 2 + 1`` with
  ``symmetric``;
- the sliding-window layers' RoPE base is the file's ``rope.freq_base_swa`` (else
  10000, llama.cpp's default), the global layers' the file's base with linear scaling;
  the layer pattern the file's ``attention.sliding_window_pattern`` (else 6);
- the graph ends at the final norm (``t_embd``): there are no logits;
- a file converted with ``--sentence-transformers-dense-modules`` has ``dense_2``
  [feat, n_embd] and ``dense_3`` [n_embd, feat], which llama.cpp's ``build_dense_out``
  applies after pooling (``dense_3(dense_2(pooled))``, or to every token for pooling
  none). Here they close the embedding graph, on every row before the host pools: the
  same vectors for none, cls and last, and for mean too, up to rounding, since both
  are linear maps, which commute with the mean.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from trio_llm.errors import ModelLoadError, UnsupportedModelError
from trio_llm.graph import Graph
from trio_llm.model.config import ModelConfig
from trio_llm.models import Meta
from trio_llm.models.blocks import Attn, norm
from trio_llm.models.gemma3 import MIN_BLOCK_TENSORS as MIN_BLOCK_TENSORS
from trio_llm.models.gemma3 import block, linear_rope_factor, rope_theta_swa, swa_pattern
from trio_llm.models.gemma3 import tensors as gemma3_tensors
from trio_llm.models.llama import common_hparams, rope_base

ARCHS = ("gemma-embedding",)


def hparams(meta: Meta, tensors: Mapping[str, Any]) -> ModelConfig:
    hp = common_hparams(meta, tensors, rms_eps_default=1e-6)
    hp["rope_theta"] = rope_base(meta, 10000.0)
    n_layer, n_embd = hp["n_layer"], hp["n_embd"]
    n_swa = meta.arch_get("attention.sliding_window", int)  # required, as llama.cpp's get_key
    if n_swa < 0:
        raise UnsupportedModelError(meta.path, f"negative {meta.arch}.attention.sliding_window {n_swa}")
    factor = linear_rope_factor(meta)
    theta_swa = rope_theta_swa(meta)
    # sentence-transformers' dense projections: llama.cpp asserts dense_2 reads and
    # dense_3 writes n_embd values
    d2_in, d2_out = (meta.arch_get(f"dense_2_feat_{k}", int, 0) for k in ("in", "out"))
    d3_in, d3_out = (meta.arch_get(f"dense_3_feat_{k}", int, 0) for k in ("in", "out"))
    for key, value in (("dense_2_feat_in", d2_in), ("dense_3_feat_out", d3_out)):
        if value not in (0, n_embd):
            raise ModelLoadError(meta.path, f"metadata key '{meta.arch}.{key}' is {value}, expected {n_embd}")
    if "dense_2.weight" in tensors and "dense_3.weight" in tensors and d2_out != d3_in:
        raise ModelLoadError(meta.path, f"dense_2 gives {d2_out} values, dense_3 reads {d3_in}")
    return ModelConfig(
        **hp,
        n_swa=n_swa,
        swa_layers=swa_pattern(meta, n_layer),
        rope_theta_swa=float(theta_swa),
        rope_freq_scale=1.0 / factor if factor > 0 else 1.0,
        attn_scale=1.0 / math.sqrt(hp["head_dim"]),
        causal_attn=False,
        dense_feat=(d2_out, d3_in),
    )


def tensors(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    return gemma3_tensors(cfg)  # the same blocks; output.weight only when untied


def optional(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    d2_out, d3_in = cfg.dense_feat
    return {"dense_2.weight": (d2_out, cfg.n_embd), "dense_3.weight": (cfg.n_embd, d3_in)}


def build(g: Graph, cfg: ModelConfig) -> None:
    eps = cfg.rms_eps
    x = g.get_rows(g.weight("token_embd.weight"), g.tokens())  # [T, n_embd]
    x = g.scale(x, math.sqrt(cfg.n_embd), "inp_scaled")
    for il in range(cfg.n_layer):
        swa = cfg.is_swa(il)
        # a symmetric window: |p - j| <= n_swa / 2
        a = Attn(n_head=cfg.n_head, n_head_kv=cfg.n_head_kv, head_dim=cfg.head_dim, eps=eps,
                 scale=cfg.kq_scale, qk_norm=True, window=cfg.n_swa // 2 + 1 if swa else 0, symmetric=swa)
        x = block(g, cfg, il, x, a)
    g.layer(-1)
    x = g.outputs(x)  # [O, n_embd]
    x = norm(g, x, "output_norm.weight", eps, "result_norm")  # [O, n_embd]: t_embd
    # llama.cpp's build_dense_out (see the module docstring), then the embedding; a graph
    # built for logits or rank ends there too: this model has neither head
    if g.has("dense_2.weight"):
        x = g.linear(x, g.weight("dense_2.weight"), "dense_2_out")  # [O, dense_2_feat_out]
    if g.has("dense_3.weight"):
        x = g.linear(x, g.weight("dense_3.weight"), "result_embd_pooled")  # [O, n_embd]
    g.set_logits(x)

"""``trio-llm make-model``: deterministic synthetic GGUF models of real shapes.

Speed does not depend on weight values, so benchmarks and tests run on files made
here: random N(0, 0.02) matrices, norms near 1, a real tokenizer section from
``trio_llm.model.vocab``, and llama.cpp's standard metadata keys, so llama.cpp loads
the same files.

Every tensor is cut into fixed row chunks, and each chunk draws from its own RNG
seeded by (seed, tensor name, chunk index): the bytes are the same whether chunks
are made in this process or in a process pool, in any order. The file is written
streaming (tensor directory first, then one tensor's bytes at a time) to a temporary
name and renamed into place, so a reader never sees half a file and an 8B model
needs memory for one tensor, not for the model.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import hashlib
import multiprocessing
import os
import sys
import tempfile
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Literal

import attrs
import gguf
import numpy as np
from gguf import GGMLQuantizationType as T
from gguf import LlamaFileType

from trio_llm.errors import ModelLoadError, TrioLLMError
from trio_llm.model.config import ARCH_ROPE, ModelConfig
from trio_llm.model.gguf import expected_shapes
from trio_llm.model.quant import block_size, quantize, tensor_bytes

WEIGHT_STD = 0.02
#: values per generation chunk: big enough to amortise numpy's call overhead, small
#: enough that a chunk's float32 scratch (64 MiB) stays modest in every pool worker
CHUNK_VALUES = 1 << 24
#: models with more values than this are made in a process pool
POOL_THRESHOLD = 1 << 26

VocabStyle = Literal["gpt2", "llama"]
VocabFamily = Literal["llama3", "chatml", "llama2", "gemma"]


@attrs.frozen
class Preset:
    name: str
    arch: str
    n_embd: int
    n_layer: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_ff: int
    n_vocab: int
    tied: bool
    rope_theta: float
    n_ctx: int
    vocab_style: VocabStyle
    vocab_family: VocabFamily
    rms_eps: float
    model_name: str
    #: Llama 3.1+ long-context RoPE (factor, low_freq_factor, high_freq_factor,
    #: original context), stored as llama.cpp does: a ``rope_freqs.weight`` tensor
    rope_scaling: tuple[float, float, float, int] | None = None
    #: sliding window (gemma3) and linear RoPE scaling of the global layers
    n_swa: int = 0
    rope_linear: float = 0.0
    #: mixture of experts (qwen3moe): experts per layer, chosen per token, their width
    n_expert: int = 0
    n_expert_used: int = 0
    n_ff_exp: int = 0
    #: gated delta-net hybrids (qwen35): (conv width, k heads, v heads, head size) of
    #: the delta-net layers, and the rotated part of an attention head
    ssm: tuple[int, int, int, int] = (0, 0, 0, 0)
    n_rot: int = 0
    n_ff_shexp: int = 0  # a shared expert's width (qwen35moe)
    #: a reranker (Qwen3-Reranker's layout): the labels of its rank head
    #: ``cls.output.weight``, written with pooling type rank and a ``rerank`` template
    rank_labels: tuple[str, ...] = ()
    #: the file's ``<arch>.pooling_type`` (an embedding model's default pooling)
    pooling: gguf.PoolingType | None = None
    #: multi-token-prediction blocks after the trunk, as llama.cpp's converter appends
    #: them to Qwen3.5 and Qwen3-Next files (counted in block_count, named by
    #: ``nextn_predict_layers``); a forward pass never reads them
    mtp: int = 0
    #: multi-head latent attention (deepseek2): (q_lora_rank, kv_lora_rank, a head's
    #: q.k size without RoPE, a head's value size); q_lora_rank 0: one full attn_q
    mla: tuple[int, int, int, int] = (0, 0, 0, 0)
    #: deepseek2's router and layout: leading dense layers, shared experts (each of
    #: n_ff_exp), the gating function, renormalisation and scale of the chosen weights
    n_dense_lead: int = 0
    n_expert_shared: int = 0
    expert_gating: str = "softmax"
    expert_norm: bool = False
    expert_scale: float = 0.0
    #: sentence-transformers' dense projections (gemma-embedding's dense_2, dense_3):
    #: their inner width; 0: none
    dense: int = 0
    #: gemma4 (as its converter writes it): the sliding-window layers' head size, the
    #: per-layer embeddings' width, the shared-KV layers at the end, the layer pattern
    #: (True: sliding-window), the logit softcap, the KV heads of a full layer, the
    #: layers written without attn_v (K is V)
    head_dim_swa: int = 0
    n_embd_per_layer: int = 0
    n_kv_shared: int = 0
    swa_pattern: tuple[bool, ...] = ()
    softcap: float = 0.0
    n_head_kv_full: int = 0
    no_v_layers: tuple[int, ...] = ()

    def config(self) -> ModelConfig:
        extra: dict[str, object]
        if self.arch == "gemma3":
            from trio_llm.models import gemma3

            extra = gemma3.derived(self.n_layer, self.n_embd, self.n_head, self.head_dim, self.n_swa,
                                   self.rope_linear)
        elif self.arch == "gemma-embedding":
            from trio_llm.models import gemma3

            extra = dict(gemma3.derived(self.n_layer, self.n_embd, self.n_head, self.head_dim, self.n_swa,
                                        self.rope_linear), causal_attn=False, dense_feat=(self.dense, self.dense))
        elif self.arch == "gemma4":
            from trio_llm.models.gemma4 import ROPE_THETA_SWA

            n_kv = self.n_layer - self.n_kv_shared
            kv_heads = tuple(self.n_head_kv if w else self.n_head_kv_full or self.n_head_kv for w in self.swa_pattern)
            n_ff = tuple(self.n_ff if il < n_kv else 2 * self.n_ff for il in range(self.n_layer))  # double-wide
            extra = dict(n_swa=self.n_swa, swa_layers=self.swa_pattern, rope_theta_swa=ROPE_THETA_SWA, attn_scale=1.0,
                         head_dim_swa=self.head_dim_swa, n_rot_swa=self.head_dim_swa,
                         n_head_kv_layers=kv_heads if len(set(kv_heads)) > 1 else (),
                         n_ff_layers=n_ff if len(set(n_ff)) > 1 else (), n_embd_per_layer=self.n_embd_per_layer,
                         n_layer_kv=n_kv if self.n_kv_shared else 0, final_logit_softcap=self.softcap)
        elif self.arch in ("qwen35", "qwen35moe", "qwen3next"):
            from trio_llm.models.qwen35 import FULL_ATTENTION_INTERVAL

            d_conv, n_k, n_v, d = self.ssm
            extra = dict(recurrent_layers=tuple((il + 1) % FULL_ATTENTION_INTERVAL != 0 for il in range(self.n_layer)),
                         ssm_d_conv=d_conv, ssm_n_k_heads=n_k, ssm_n_v_heads=n_v, ssm_head_dim=d, n_rot=self.n_rot)
        elif self.arch == "deepseek2":
            from trio_llm.models.deepseek2 import kq_scale

            q_lora, kv_lora, nope, v_head = self.mla
            extra = dict(n_rot=self.n_rot, attn_scale=kq_scale(nope + self.n_rot), n_lora_q=q_lora,
                         n_lora_kv=kv_lora, head_dim_k_mla=nope + self.n_rot, head_dim_v_mla=v_head,
                         n_dense_lead=self.n_dense_lead, expert_gating=self.expert_gating,
                         expert_weights_norm=self.expert_norm, expert_weights_scale=self.expert_scale)
        else:
            extra = {}
        return ModelConfig(
            arch=self.arch,
            name=self.model_name,
            n_vocab=self.n_vocab,
            n_embd=self.n_embd,
            n_layer=self.n_layer,
            n_head=self.n_head,
            n_head_kv=self.n_head_kv,
            head_dim=self.head_dim,
            n_ff=self.n_ff * (2 if self.arch == "gemma4" and self.n_kv_shared else 1),
            n_ctx_train=self.n_ctx,
            rope_theta=self.rope_theta,
            rms_eps=self.rms_eps,
            rope_mode=ARCH_ROPE[self.arch],
            qk_norm=self.arch in ("qwen3", "gemma3", "gemma4", "gemma-embedding", "qwen3moe", "qwen35", "qwen35moe",
                                  "qwen3next"),
            attn_bias=self.arch == "qwen2",
            tied_embeddings=self.tied,
            n_expert=self.n_expert,
            n_expert_used=self.n_expert_used,
            n_ff_exp=self.n_ff_exp,
            n_ff_shexp=self.n_ff_shexp or self.n_ff_exp * self.n_expert_shared,
            n_cls_out=len(self.rank_labels),
            **extra,  # type: ignore[arg-type]
        )


def _preset(name: str, arch: str, dims: tuple[int, ...], tied: bool, theta: float, n_ctx: int,
            vocab: tuple[VocabStyle, VocabFamily], model_name: str,
            rope_scaling: tuple[float, float, float, int] | None = None, n_swa: int = 0,
            rope_linear: float = 0.0, moe: tuple[int, int, int] = (0, 0, 0),
            ssm: tuple[int, int, int, int] = (0, 0, 0, 0), n_rot: int = 0, n_ff_shexp: int = 0,
            rank_labels: tuple[str, ...] = (), pooling: gguf.PoolingType | None = None) -> Preset:
    n_embd, n_layer, n_head, n_head_kv, head_dim, n_ff, n_vocab = dims
    return Preset(
        name=name, arch=arch, n_embd=n_embd, n_layer=n_layer, n_head=n_head,
        n_head_kv=n_head_kv, head_dim=head_dim, n_ff=n_ff, n_vocab=n_vocab, tied=tied,
        rope_theta=theta, n_ctx=n_ctx, vocab_style=vocab[0], vocab_family=vocab[1],
        rms_eps=1e-5 if arch == "llama" else 1e-6, model_name=model_name,
        rope_scaling=rope_scaling, n_swa=n_swa, rope_linear=rope_linear,
        n_expert=moe[0], n_expert_used=moe[1], n_ff_exp=moe[2], ssm=ssm, n_rot=n_rot,
        n_ff_shexp=n_ff_shexp, rank_labels=rank_labels,
        pooling=gguf.PoolingType.RANK if rank_labels else pooling,
    )


def _deepseek2(name: str, dims: tuple[int, ...], theta: float, n_ctx: int, model_name: str, *,
               mla: tuple[int, int, int, int], n_rot: int, moe: tuple[int, int, int], scale: float) -> Preset:
    """A deepseek2 preset as GLM-4.7-Flash's converter writes one: one leading dense
    layer, one shared expert, sigmoid routing with a selection bias, renormalised."""
    return attrs.evolve(
        _preset(name, "deepseek2", dims, False, theta, n_ctx, ("gpt2", "chatml"), model_name, moe=moe,
                n_rot=n_rot),
        mla=mla, n_dense_lead=1, n_expert_shared=1, expert_gating="sigmoid", expert_norm=True,
        expert_scale=float(np.float32(scale)))  # as the file holds it


#: Qwen3-Reranker's ``rerank`` template as llama.cpp's converter writes it (abridged system text)
RERANK_TEMPLATE = (
    "<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and the Instruct "
    'provided. Note that the answer can only be "yes" or "no".<|im_end|>\n<|im_start|>user\n<Instruct>: Given a '
    "web search query, retrieve relevant passages that answer the query\n<Query>: {query}\n<Document>: "
    "{document}<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
)

PRESETS: dict[str, Preset] = {
    p.name: p
    for p in [
        _preset("tiny", "llama", (256, 2, 4, 2, 64, 512, 1024), False, 1e4, 4096,
                ("gpt2", "llama3"), "trio-llm tiny"),
        _preset("tiny-qwen3", "qwen3", (256, 2, 4, 2, 64, 512, 1024), True, 1e6, 4096,
                ("gpt2", "chatml"), "trio-llm tiny-qwen3"),
        # a Qwen3-Reranker-shaped qwen3: a yes/no rank head, pooling rank
        _preset("tiny-qwen3-rerank", "qwen3", (256, 2, 4, 2, 64, 512, 1024), True, 1e6, 4096,
                ("gpt2", "chatml"), "trio-llm tiny-qwen3-rerank", rank_labels=("yes", "no")),
        # a Qwen3-Embedding-shaped qwen3: pooling type last
        _preset("tiny-qwen3-embd", "qwen3", (256, 2, 4, 2, 64, 512, 1024), True, 1e6, 4096,
                ("gpt2", "chatml"), "trio-llm tiny-qwen3-embd", pooling=gguf.PoolingType.LAST),
        _preset("tiny-qwen2", "qwen2", (256, 2, 4, 2, 64, 512, 1024), False, 1e6, 4096,
                ("gpt2", "chatml"), "trio-llm tiny-qwen2"),
        # one layer: its K and V depend only on the token and its position, so a KV shift
        # (--cache-reuse) is exact and its answers can equal a fresh evaluation's
        _preset("tiny-1layer", "llama", (256, 1, 4, 2, 64, 512, 1024), False, 1e4, 4096,
                ("gpt2", "llama3"), "trio-llm tiny-1layer"),
        _preset("tiny-spm", "llama", (256, 2, 4, 2, 64, 512, 1024), False, 1e4, 4096,
                ("llama", "llama2"), "trio-llm tiny-spm"),
        _preset("demo", "llama", (512, 4, 8, 4, 64, 1024, 4096), False, 1e4, 4096,
                ("gpt2", "llama3"), "trio-llm demo"),
        _preset("llama-1b", "llama", (2048, 16, 32, 8, 64, 8192, 128256), True, 5e5, 131072,
                ("gpt2", "llama3"), "synthetic Llama-3.2-1B shape", (32.0, 1.0, 4.0, 8192)),
        _preset("llama-8b", "llama", (4096, 32, 32, 8, 128, 14336, 128256), False, 5e5, 131072,
                ("gpt2", "llama3"), "synthetic Llama-3.1-8B shape", (8.0, 1.0, 4.0, 8192)),
        _preset("qwen3-0.6b", "qwen3", (1024, 28, 16, 8, 128, 3072, 151936), True, 1e6, 40960,
                ("gpt2", "chatml"), "synthetic Qwen3-0.6B shape"),
        # six layers: five sliding-window ones (a window of 16, so short tests cross it)
        # and one global, with gemma-3-4b's RoPE layout
        _preset("tiny-gemma3", "gemma3", (256, 6, 4, 2, 64, 512, 1024), True, 1e6, 4096,
                ("llama", "gemma"), "trio-llm tiny-gemma3", n_swa=16, rope_linear=8.0),
        # EmbeddingGemma's layout (gemma-embedding): tiny-gemma3's stack, bidirectional, a
        # symmetric window of 16 (8 each side, so short prompts cross it), mean pooling and
        # sentence-transformers' dense projections (4 x n_embd inside, as the 300M's)
        attrs.evolve(_preset("tiny-gemma-embd", "gemma-embedding", (256, 6, 4, 2, 64, 512, 1024), True, 1e6,
                             2048, ("llama", "gemma"), "trio-llm tiny-gemma-embd", n_swa=16,
                             pooling=gguf.PoolingType.MEAN), dense=1024),
        # 16 experts of width 256, 4 chosen per token (moe: experts, used, width)
        _preset("tiny-qwen3moe", "qwen3moe", (256, 2, 4, 2, 64, 512, 1024), False, 1e6, 4096,
                ("gpt2", "chatml"), "trio-llm tiny-qwen3moe", moe=(16, 4, 256)),
        _preset("qwen3-30b-a3b", "qwen3moe", (2048, 48, 32, 4, 128, 6144, 151936), False, 1e6, 40960,
                ("gpt2", "chatml"), "synthetic Qwen3-30B-A3B shape", moe=(128, 8, 768)),
        # gated delta-net hybrids: three delta-net layers to one gated-attention layer;
        # ssm: (conv width, k heads, v heads, head size); a quarter of each attention
        # head rotates
        _preset("tiny-qwen35", "qwen35", (256, 4, 4, 2, 64, 512, 1024), False, 1e7, 4096,
                ("gpt2", "chatml"), "trio-llm tiny-qwen35", ssm=(4, 2, 4, 64), n_rot=16),
        _preset("qwen35-0.8b", "qwen35", (1024, 24, 8, 2, 256, 3584, 248320), True, 1e7, 262144,
                ("gpt2", "chatml"), "synthetic Qwen3.5-0.8B shape", ssm=(4, 16, 16, 128), n_rot=64),
        _preset("qwen35-9b", "qwen35", (4096, 32, 16, 4, 256, 12288, 248320), False, 1e7, 262144,
                ("gpt2", "chatml"), "synthetic Qwen3.5-9B shape", ssm=(4, 16, 32, 128), n_rot=64),
        # hybrids with a mixture of experts and a shared expert in every layer
        _preset("tiny-qwen35moe", "qwen35moe", (256, 4, 4, 2, 64, 256, 1024), False, 1e7, 4096,
                ("gpt2", "chatml"), "trio-llm tiny-qwen35moe", moe=(16, 4, 256), ssm=(4, 2, 4, 64), n_rot=16,
                n_ff_shexp=256),
        _preset("qwen35-35b-a3b", "qwen35moe", (2048, 40, 16, 2, 256, 512, 248320), False, 1e7, 262144,
                ("gpt2", "chatml"), "synthetic Qwen3.5-35B-A3B shape", moe=(256, 8, 512), ssm=(4, 16, 32, 128),
                n_rot=64, n_ff_shexp=512),
        # Qwen3-Next (Qwen3-Coder-Next): qwen35moe's stack, the delta rule's gates from one
        # projection (ssm_ba) and each k head's v heads side by side
        _preset("tiny-qwen3next", "qwen3next", (256, 4, 4, 2, 64, 256, 1024), False, 1e7, 4096,
                ("gpt2", "chatml"), "trio-llm tiny-qwen3next", moe=(16, 4, 256), ssm=(4, 2, 4, 64), n_rot=16,
                n_ff_shexp=256),
        _preset("qwen3-coder-next", "qwen3next", (2048, 48, 16, 2, 256, 512, 151936), False, 1e7, 262144,
                ("gpt2", "chatml"), "synthetic Qwen3-Coder-Next shape", moe=(512, 10, 512), ssm=(4, 16, 32, 128),
                n_rot=64, n_ff_shexp=512),
        # Gemma 4 E4B's layout, small: sliding-window layers (window 16, heads of 64, two
        # KV heads) and full ones (heads of 128, one KV head, proportional RoPE over a
        # quarter of each head), per-layer embeddings, the last two layers sharing the KV
        # of layers 4 (sliding) and 5 (full, written without attn_v: K is V), double-wide
        # FFNs there, a logit softcap of 30
        attrs.evolve(_preset("tiny-gemma4", "gemma4", (256, 8, 4, 2, 128, 256, 1024), True, 1e6, 4096,
                             ("llama", "gemma"), "trio-llm tiny-gemma4", n_swa=16),
                     head_dim_swa=64, n_embd_per_layer=32, n_kv_shared=2, softcap=30.0, n_head_kv_full=1,
                     swa_pattern=(True, True, False, True, True, False, True, False), no_v_layers=(5,)),
        # the same with released Gemma 4's head sizes: 512-wide heads in the full layers,
        # 256 in the sliding-window ones (the Vulkan attention's widest heads)
        attrs.evolve(_preset("tiny-gemma4-wide", "gemma4", (256, 8, 4, 2, 512, 256, 1024), True, 1e6, 4096,
                             ("llama", "gemma"), "trio-llm tiny-gemma4-wide", n_swa=16),
                     head_dim_swa=256, n_embd_per_layer=32, n_kv_shared=2, softcap=30.0, n_head_kv_full=1,
                     swa_pattern=(True, True, False, True, True, False, True, False), no_v_layers=(5,)),
        _preset("gemma3-4b", "gemma3", (2560, 34, 8, 4, 256, 10240, 262144), True, 1e6, 131072,
                ("llama", "gemma"), "synthetic gemma-3-4b shape", n_swa=1024, rope_linear=8.0),
        # multi-head latent attention (head_dim: the latent cache row, kv_lora_rank +
        # n_rot, one KV head), a leading dense layer, then 16 experts (4 chosen by
        # sigmoid with a selection bias) and a shared expert; mla: (q_lora_rank,
        # kv_lora_rank, no-RoPE q.k size, v size)
        # (a latent row of 288: above 256, so the Vulkan attention's wide-head path runs)
        _deepseek2("tiny-deepseek2", (256, 3, 4, 1, 256 + 32, 512, 1024), 1e4, 4096, "trio-llm tiny-deepseek2",
                   mla=(128, 256, 64, 64), n_rot=32, moe=(16, 4, 128), scale=2.5),
        # GLM-4.7-Flash (HF Glm4MoeLiteForCausalLM, 47 layers; its converted files add one
        # MTP block: make-model --mtp 1): hidden 2048, 20 heads, q_lora_rank 768,
        # kv_lora_rank 512, qk_nope/qk_rope/v head dims 192/64/256, dense FFN 10240 in
        # the first layer, 64 experts of 1536 (4 used) and one shared, routed_scaling
        # 1.8, vocabulary 154880, rope_theta 1e6, context 202752, rms_norm_eps 1e-5
        # (from the model's config.json as recalled, not re-checked: a chat/tokenizer
        # section of our own stands in for GLM's)
        attrs.evolve(_deepseek2("glm-4.7-flash", (2048, 47, 20, 1, 512 + 64, 10240, 154880), 1e6, 202752,
                                "synthetic GLM-4.7-Flash shape", mla=(768, 512, 192, 256), n_rot=64,
                                moe=(64, 4, 1536), scale=1.8), rms_eps=1e-5),
    ]
}

#: ``--quant`` names that are a ggml type and no llama-quantize mix: every matrix that
#: type (Q3_K / Q4_K / Q5_K are llama-quantize aliases of their _M mixes; here they stay
#: pure, the mixes have their own names). Pure K-quants are named by their closest mix.
PLAIN: dict[str, tuple[T, LlamaFileType]] = {
    "F32": (T.F32, LlamaFileType.ALL_F32), "F16": (T.F16, LlamaFileType.MOSTLY_F16),
    "BF16": (T.BF16, LlamaFileType.MOSTLY_BF16), "Q3_K": (T.Q3_K, LlamaFileType.MOSTLY_Q3_K_S),
    "Q4_K": (T.Q4_K, LlamaFileType.MOSTLY_Q4_K_S), "Q5_K": (T.Q5_K, LlamaFileType.MOSTLY_Q5_K_S),
}
#: llama-quantize's mixes (its ftype names): the base type and general.file_type.
#: ``mix_type`` types each tensor as llama-quantize does for the mix; ``Q4_K_XL`` is an
#: unsloth-like "dynamic" mix of Q4_K/Q5_K/Q6_K/Q8_0 (no llama-quantize ftype).
MIXES: dict[str, tuple[T, LlamaFileType]] = {
    "Q2_K": (T.Q2_K, LlamaFileType.MOSTLY_Q2_K),
    "Q3_K_S": (T.Q3_K, LlamaFileType.MOSTLY_Q3_K_S), "Q3_K_M": (T.Q3_K, LlamaFileType.MOSTLY_Q3_K_M),
    "Q3_K_L": (T.Q3_K, LlamaFileType.MOSTLY_Q3_K_L),
    "Q4_0": (T.Q4_0, LlamaFileType.MOSTLY_Q4_0), "Q4_1": (T.Q4_1, LlamaFileType.MOSTLY_Q4_1),
    "Q5_0": (T.Q5_0, LlamaFileType.MOSTLY_Q5_0), "Q5_1": (T.Q5_1, LlamaFileType.MOSTLY_Q5_1),
    "Q4_K_S": (T.Q4_K, LlamaFileType.MOSTLY_Q4_K_S), "Q4_K_M": (T.Q4_K, LlamaFileType.MOSTLY_Q4_K_M),
    "Q5_K_S": (T.Q5_K, LlamaFileType.MOSTLY_Q5_K_S), "Q5_K_M": (T.Q5_K, LlamaFileType.MOSTLY_Q5_K_M),
    "Q6_K": (T.Q6_K, LlamaFileType.MOSTLY_Q6_K), "Q8_0": (T.Q8_0, LlamaFileType.MOSTLY_Q8_0),
    "IQ4_NL": (T.IQ4_NL, LlamaFileType.MOSTLY_IQ4_NL), "IQ4_XS": (T.IQ4_XS, LlamaFileType.MOSTLY_IQ4_XS),
    "Q4_K_XL": (T.Q4_K, LlamaFileType.MOSTLY_Q4_K_M),
}
#: every ``--quant`` name
QUANTS: dict[str, tuple[T, LlamaFileType]] = {**PLAIN, **MIXES}

#: llama-quantize's fallback when a row length is no multiple of the type's block
_FALLBACK = {T.IQ4_XS: T.IQ4_NL, T.Q2_K: T.Q4_0, T.Q3_K: T.Q4_0, T.Q4_K: T.Q5_0, T.Q5_K: T.Q5_1, T.Q6_K: T.Q8_0}


class MakeModelError(TrioLLMError):
    """Bad make-model arguments (unknown preset or quant, negative seed)."""


@attrs.frozen
class TensorPlan:
    name: str
    shape: tuple[int, ...]  # numpy order
    ggml_type: T
    kind: Literal["matrix", "norm", "bias", "const"]
    values: tuple[float, ...] | None = None  # the contents of a "const" tensor
    scale: float = 1.0  # multiplies the drawn values (``sharp`` files)

    @property
    def n_bytes(self) -> int:
        return tensor_bytes(self.ggml_type, self.shape)

    def chunks(self) -> list[tuple[int, int]]:
        """Row ranges, fixed by the shape alone so the bytes never depend on the pool."""
        n_rows = self.shape[0] if len(self.shape) > 1 else 1
        step = max(1, CHUNK_VALUES // int(np.prod(self.shape[1:] or self.shape)))
        return [(r, min(r + step, n_rows)) for r in range(0, n_rows, step)]


def use_more_bits(i_layer: int, n_layer: int) -> bool:
    """llama.cpp's Q4_K_M rule for the layers that get Q6_K in attn_v and ffn_down:
    the first and last eighth, and every third layer in between."""
    return i_layer < n_layer // 8 or i_layer >= 7 * n_layer // 8 or (i_layer - n_layer // 8) % 3 == 2


def _role(name: str) -> str:
    """llama-quantize's tensor category: the name's matrix kind (attn_v, ffn_down, ...)."""
    if name in ("output.weight", "token_embd.weight"):
        return name.split(".")[0]
    # llama-quantize matches names by substring: an expert tensor is in its matrix's
    # category (ffn_down_exps is an ffn_down)
    return name.split(".")[2].removesuffix("_exps").removesuffix("_shexp") if name.startswith("blk.") else name


def mix_type(name: str, quant: str, cfg: ModelConfig, n_in: int) -> T:
    """The type llama-quantize gives matrix ``name`` (rows of ``n_in``) in mix ``quant``
    (its ``llama_tensor_get_type`` for the dense architectures we make: no experts, no
    Falcon, no 70B rule), then its fallback for rows the type's blocks do not fill."""
    base = MIXES[quant][0]
    role = _role(name)
    il = int(name.split(".")[1]) if name.startswith("blk.") else 0
    n = cfg.n_layer
    more = use_more_bits(il, n)
    gqa = cfg.n_head // cfg.n_head_kv
    new = base
    if role == "output" or (cfg.tied_embeddings and role == "token_embd"):
        # the head (or the tied embedding serving as it)
        new = T.Q8_0 if n_in % block_size(base) or base == T.Q8_0 else T.Q6_K
    elif quant == "Q4_K_XL":
        # unsloth-like: the sensitive matrices a step or two up, the first layer most
        new = {
            "attn_v": T.Q8_0 if il == 0 else T.Q6_K, "attn_output": T.Q5_K,
            "ffn_down": T.Q8_0 if il == 0 else T.Q6_K if more else T.Q5_K,
        }.get(role, T.Q4_K)
    elif role == "attn_v":
        new = {
            "Q2_K": T.Q4_K if gqa >= 4 else T.Q3_K,
            "Q3_K_M": T.Q5_K if il < 2 else T.Q4_K,
            "Q3_K_L": T.Q5_K,
            "IQ4_NL": T.Q5_K if gqa >= 4 else base, "IQ4_XS": T.Q5_K if gqa >= 4 else base,
            "Q4_K_M": T.Q6_K if more else base, "Q5_K_M": T.Q6_K if more else base,
            "Q4_K_S": T.Q5_K if il < 4 else base,
        }.get(quant, base)
    elif role == "ffn_down":
        new = {
            "Q2_K": T.Q3_K,
            "Q3_K_M": T.Q5_K if il < n // 16 else T.Q4_K,
            "Q3_K_L": T.Q5_K,
            "Q4_K_M": T.Q6_K if more else base,
            "IQ4_NL": T.Q5_K if il < n // 8 else base, "IQ4_XS": T.Q5_K if il < n // 8 else base,
            "Q5_K_M": T.Q6_K if more else base,
            "Q4_K_S": T.Q5_K if il < n // 8 else base,
        }.get(quant, base)
    elif role == "attn_output":
        new = {"Q2_K": T.Q3_K, "Q3_K_M": T.Q4_K, "Q3_K_L": T.Q5_K}.get(quant, base)
    if n_in % block_size(new):
        new = _FALLBACK.get(new, T.F16)
        if n_in % block_size(new):
            new = T.F16
    return new


def _matrix_type(name: str, quant: str, cfg: ModelConfig, n_in: int, pure: bool) -> T:
    if quant in PLAIN or pure:
        t = QUANTS[quant][0]
        # llama-quantize's fallback, for rows its blocks cannot fill (deepseek2's
        # per-head attn_k_b rows, 192 values in GLM-4.7-Flash, under a K-quant)
        if n_in % block_size(t):
            t = _FALLBACK.get(t, T.F16)
        return t if n_in % block_size(t) == 0 else T.F16
    return mix_type(name, quant, cfg, n_in)


#: ``sharp`` files: q/k projections 5x, so attention scores have a std of ~2.5 instead
#: of ~0.1 and which positions a query attends to matters (QK-norm architectures
#: renormalise q and k; their scores are peaked already). Measured on tiny F32 in
#: llama.cpp: zeroing every attn_k moves the top logprobs 0.04 nats in a plain file,
#: 0.35 in a sharp one. The logits are left as they are: scaling them 2x doubled
#: llama.cpp's 8-bit activation-rounding differences too (and an MoE router near-tie
#: then crossed the agreement tolerance). MoE routers 10x: with N(0, 0.02) routers
#: the expert probabilities are nearly uniform and llama.cpp's 8-bit activation rounding
#: flips near-tied top-k choices (measured on tiny-qwen35moe: 11 of 23 types parted by
#: 0.15-0.35 nats); real routers are decisive, and a sharp one makes the choice matter.
SHARP_SCALES = {"attn_q.weight": 5.0, "attn_k.weight": 5.0, "ffn_gate_inp.weight": 10.0,
                "attn_q_b.weight": 5.0, "attn_kv_a_mqa.weight": 5.0, "exp_probs_b.bias": 5.0}


#: gemma4's q and k norm weights (see plan_tensors)
GEMMA4_QK_NORM = 0.35


def plan_tensors(preset: Preset, quant: str, pure: bool = False, sharp: bool = False) -> list[TensorPlan]:
    """Every tensor of the file, in file order, with its type (``pure``: every matrix
    the mix's base type, as llama-quantize's ``--pure``).

    ``sharp`` scales the q/k projections up (``SHARP_SCALES``). N(0, 0.02) weights give
    near-uniform attention, so a file compared with llama.cpp could hide a wrong
    attention pattern (RoPE, positions, masking) inside the tolerance; a sharp file
    cannot."""
    if quant not in QUANTS:
        raise MakeModelError(f"unknown quant {quant!r} (choose from {', '.join(QUANTS)})")
    cfg = preset.config()
    plans = []
    if preset.rope_scaling is not None:
        factors = llama3_rope_factors(cfg.head_dim, cfg.rope_theta, *preset.rope_scaling)
        plans.append(TensorPlan("rope_freqs.weight", (len(factors),), T.F32, "const", factors))
    if cfg.arch == "gemma4" and not all(cfg.swa_layers):  # the converter's proportional RoPE: a quarter turns
        half = cfg.head_dim // 2
        factors = tuple([1.0] * (half // 4) + [1e30] * (half - half // 4))
        plans.append(TensorPlan("rope_freqs.weight", (half,), T.F32, "const", factors))
    shapes = expected_shapes(cfg)
    if cfg.arch == "gemma4":
        from trio_llm.models import optional_shapes

        shapes.pop("rope_freqs.weight", None)
        for name, shape in optional_shapes(cfg).items():
            il = int(name.split(".")[1])
            if name.endswith("layer_output_scale.weight"):
                plans.append(TensorPlan(name, shape, T.F32, "const", (0.5 + 0.1 * il,)))
            elif il not in preset.no_v_layers:
                shapes[name] = shape
    if cfg.arch == "deepseek2" or preset.dense:  # the experts' selection bias, the dense projections
        from trio_llm.models import optional_shapes

        shapes.update(optional_shapes(cfg))
    for name, shape in shapes.items():
        scale = SHARP_SCALES.get(name.split(".", 2)[-1] if name.startswith("blk.") else name, 1.0) if sharp else 1.0
        if cfg.arch == "gemma4" and name.endswith(("attn_q_norm.weight", "attn_k_norm.weight")):
            # gemma4's softmax scale is 1: unit-RMS heads would give scores of std
            # sqrt(head_dim), an attention so peaked that 8-bit rounding moves it; these
            # norms bring it to about 1 (0.5 still parted from llama.cpp on 7 of 23
            # weight types, by 0.11 to 0.20 nats)
            scale = GEMMA4_QK_NORM
        if name.endswith(("ffn_gate_inp.weight", "ssm_conv1d.weight", "ssm_alpha.weight", "ssm_beta.weight")):
            # the router and the delta-net's small matrices stay F32, as llama.cpp's
            # converter and llama-quantize keep them
            plans.append(TensorPlan(name, shape, T.F32, "matrix", scale=scale))
        elif name.endswith("ffn_gate_inp_shexp.weight"):
            # a shared expert's gate: a one-output linear layer stored as a vector
            plans.append(TensorPlan(name, shape, T.F32, "bias"))
        elif name.endswith(".ssm_a"):
            # the delta rule's decay rates, -exp(A_log): negative, so the state decays
            rates = -np.exp(np.linspace(-1.0, 1.0, shape[0]))
            plans.append(TensorPlan(name, shape, T.F32, "const", tuple(float(r) for r in rates)))
        elif len(shape) >= 2:
            ggml_type = _matrix_type(name, quant, cfg, shape[-1], pure)
            plans.append(TensorPlan(name, shape, ggml_type, "matrix", scale=scale))
        else:
            kind: Literal["norm", "bias"] = "bias" if name.endswith(".bias") else "norm"
            plans.append(TensorPlan(name, shape, T.F32, kind, scale=scale))
    return plans + _mtp_plans(preset, cfg, plans, quant, pure)


def _mtp_plans(preset: Preset, cfg: ModelConfig, plans: list[TensorPlan], quant: str,
               pure: bool) -> list[TensorPlan]:
    """The ``preset.mtp`` multi-token-prediction blocks llama.cpp's loader expects
    (``load_block_mtp`` of qwen35.cpp, qwen35moe.cpp, qwen3next.cpp; deepseek2.cpp's
    blocks past ``n_layer``): a full-attention
    block with the trunk's FFN (the tensors of the trunk's last attention layer, under
    the block's number), then ``nextn.eh_proj`` [n_embd, 2 n_embd] and its norms."""
    if not preset.mtp:
        return []
    if not cfg.recurrent_layers and cfg.arch != "deepseek2":
        raise MakeModelError(f"--mtp: {preset.arch} files have no multi-token-prediction blocks here")
    last = max(il for il in range(cfg.n_layer) if not cfg.is_recurrent(il))
    src = f"blk.{last}."
    out = []
    for i in range(preset.mtp):
        b = f"blk.{cfg.n_layer + i}."
        out += [attrs.evolve(t, name=b + t.name[len(src):]) for t in plans if t.name.startswith(src)]
        proj = (cfg.n_embd, 2 * cfg.n_embd)
        out.append(TensorPlan(b + "nextn.eh_proj.weight", proj, _matrix_type(b + "nextn.eh_proj.weight", quant, cfg,
                                                                            proj[-1], pure), "matrix"))
        out += [TensorPlan(b + f"nextn.{n}.weight", (cfg.n_embd,), T.F32, "norm")
                for n in ("enorm", "hnorm", "shared_head_norm")]
    return out


def llama3_rope_factors(
    head_dim: int, theta: float, factor: float, low_freq_factor: float, high_freq_factor: float,
    original_ctx: int,
) -> tuple[float, ...]:
    """Per-frequency divisors of Llama 3.1's RoPE: wavelengths shorter than
    ``original_ctx / high_freq_factor`` keep their frequency (1), longer than
    ``original_ctx / low_freq_factor`` are slowed by ``factor``, and the band in
    between is interpolated smoothly. llama.cpp reads them from ``rope_freqs.weight``
    and divides each rotation frequency by its factor."""
    freqs = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)  # [head_dim/2]
    wavelen = 2 * np.pi / freqs
    smooth = (original_ctx / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    mid = 1.0 / ((1.0 - smooth) / factor + smooth)
    out = np.where(wavelen < original_ctx / high_freq_factor, 1.0,
                   np.where(wavelen > original_ctx / low_freq_factor, factor, mid))
    return tuple(float(v) for v in out.astype(np.float32))


def _chunk_rng(seed: int, name: str, chunk: int) -> np.random.Generator:
    name_key = int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "little")
    return np.random.default_rng(np.random.SeedSequence([seed, name_key, chunk]))


def make_chunk(seed: int, plan: TensorPlan, chunk: int, rows: tuple[int, int]) -> np.ndarray:
    """The encoded bytes of rows ``rows`` of one tensor (a pool work unit)."""
    if plan.kind == "const":
        return quantize(np.asarray(plan.values, dtype=np.float32), plan.ggml_type)
    rng = _chunk_rng(seed, plan.name, chunk)
    shape = (rows[1] - rows[0], *plan.shape[1:]) if len(plan.shape) > 1 else plan.shape
    values = rng.standard_normal(shape, dtype=np.float32)  # [rows, n_in] or [n]
    values *= np.float32(WEIGHT_STD)
    if plan.kind == "norm":
        values += np.float32(1.0)
    if plan.scale != 1.0:
        values *= np.float32(plan.scale)
    return quantize(values, plan.ggml_type)


def _units(plans: list[TensorPlan]) -> Iterator[tuple[int, int, tuple[int, int]]]:
    for index, plan in enumerate(plans):
        for chunk, rows in enumerate(plan.chunks()):
            yield index, chunk, rows


def _encoded_tensors(
    plans: list[TensorPlan], seed: int, workers: int
) -> Iterator[tuple[int, np.ndarray]]:
    """Yield (index into plans, bytes) per tensor in file order, made in-process or
    in a pool.

    The pool keeps a bounded window of chunks in flight, so memory stays at a few
    chunks per worker however large the model.
    """
    units = _units(plans)
    current = 0
    parts: list[np.ndarray] = []
    if workers <= 1:
        for index, chunk, rows in units:
            if index != current:
                yield current, _join(parts)
                current, parts = index, []
            parts.append(make_chunk(seed, plans[index], chunk, rows))
    else:
        ctx = multiprocessing.get_context("spawn")
        with cf.ProcessPoolExecutor(max_workers=workers, mp_context=ctx) as pool:
            window: deque[tuple[int, cf.Future[np.ndarray]]] = deque()

            def submit_next() -> None:
                unit = next(units, None)
                if unit is not None:
                    index, chunk, rows = unit
                    window.append((index, pool.submit(make_chunk, seed, plans[index], chunk, rows)))

            for _ in range(2 * workers):
                submit_next()
            while window:
                index, future = window.popleft()
                if index != current:
                    yield current, _join(parts)
                    current, parts = index, []
                parts.append(future.result())
                submit_next()
    yield current, _join(parts)


def _join(parts: list[np.ndarray]) -> np.ndarray:
    data = parts[0] if len(parts) == 1 else np.concatenate(parts, axis=0)
    return data.reshape(-1)  # [n_bytes] uint8


def _write_metadata(writer: gguf.GGUFWriter, preset: Preset, quant: str) -> None:
    from trio_llm.model.vocab import build_vocab

    cfg = preset.config()
    writer.add_type("model")
    writer.add_name(cfg.name)
    writer.add_string("general.basename", preset.name)
    writer.add_string("general.quantized_by", "trio-llm make-model")
    writer.add_file_type(int(QUANTS[quant][1]))
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    writer.add_vocab_size(cfg.n_vocab)
    writer.add_context_length(cfg.n_ctx_train)
    writer.add_embedding_length(cfg.n_embd)
    writer.add_block_count(cfg.n_layer + preset.mtp)
    if preset.mtp:
        writer.add_uint32(f"{preset.arch}.nextn_predict_layers", preset.mtp)
    if cfg.arch == "gemma4":  # one per layer where they differ, as its converter writes them
        writer.add_feed_forward_length(list(cfg.n_ff_layers) or cfg.n_ff)
    else:
        writer.add_feed_forward_length(cfg.n_ff)
    writer.add_head_count(cfg.n_head)
    writer.add_head_count_kv(list(cfg.n_head_kv_layers) or cfg.n_head_kv)
    writer.add_key_length(cfg.head_dim)
    writer.add_value_length(cfg.n_lora_kv or cfg.head_dim)  # MLA: V is the latent part of K
    writer.add_rope_dimension_count(cfg.n_rot or cfg.head_dim)
    writer.add_rope_freq_base(cfg.rope_theta)
    writer.add_layer_norm_rms_eps(cfg.rms_eps)
    if preset.n_swa:
        writer.add_sliding_window(preset.n_swa)
    if cfg.arch == "gemma4":  # conversion/gemma.py's Gemma4Model
        writer.add_rope_freq_base_swa(cfg.rope_theta_swa)
        writer.add_shared_kv_layers(preset.n_kv_shared)
        writer.add_embedding_length_per_layer_input(cfg.n_embd_per_layer)
        writer.add_sliding_window_pattern(list(cfg.swa_layers))
        writer.add_key_length_swa(cfg.head_dim_swa)
        writer.add_value_length_swa(cfg.head_dim_swa)
        writer.add_rope_dimension_count_swa(cfg.n_rot_swa)
        writer.add_final_logit_softcapping(cfg.final_logit_softcap)
    if cfg.arch == "gemma-embedding":  # as the converter's EmbeddingGemma writes them
        writer.add_rope_freq_base_swa(cfg.rope_theta_swa)
        if preset.dense:
            writer.add_dense_features_dims("dense_2", cfg.n_embd, preset.dense)
            writer.add_dense_features_dims("dense_3", preset.dense, cfg.n_embd)
    if cfg.recurrent_layers:
        from trio_llm.models.qwen35 import FULL_ATTENTION_INTERVAL

        d_conv, n_k, n_v, d = preset.ssm
        writer.add_ssm_conv_kernel(d_conv)
        writer.add_ssm_inner_size(n_v * d)
        writer.add_ssm_state_size(d)
        writer.add_ssm_time_step_rank(n_v)
        writer.add_ssm_group_count(n_k)
        writer.add_full_attention_interval(FULL_ATTENTION_INTERVAL)
        # and the per-layer list the converter writes beside it (MTP blocks are attention)
        writer.add_array(f"{preset.arch}.attention.recurrent_layers",
                         [*cfg.recurrent_layers, *([False] * preset.mtp)])
        if cfg.arch != "qwen3next":  # its RoPE is NeoX's, without sections
            # llama.cpp's multi-section RoPE: Qwen3.5's 11/11/10 of 32 pairs, scaled to n_rot
            half = cfg.n_rot // 2
            a = round(half * 11 / 32)
            writer.add_rope_dimension_sections([a, a, half - 2 * a, 0])
    if preset.n_expert:
        writer.add_expert_count(preset.n_expert)
        writer.add_expert_used_count(preset.n_expert_used)
        writer.add_expert_feed_forward_length(preset.n_ff_exp)
    if preset.n_ff_shexp:
        writer.add_expert_shared_feed_forward_length(preset.n_ff_shexp)
    if cfg.arch == "deepseek2":
        writer.add_leading_dense_block_count(cfg.n_dense_lead)
        if cfg.n_lora_q:
            writer.add_q_lora_rank(cfg.n_lora_q)
        writer.add_kv_lora_rank(cfg.n_lora_kv)
        writer.add_key_length_mla(cfg.head_dim_k_mla)
        writer.add_value_length_mla(cfg.head_dim_v_mla)
        writer.add_expert_shared_count(preset.n_expert_shared)
        writer.add_expert_weights_scale(cfg.expert_weights_scale)
        writer.add_expert_weights_norm(cfg.expert_weights_norm)
        writer.add_expert_gating_func(
            gguf.ExpertGatingFuncType.SIGMOID if cfg.expert_gating == "sigmoid" else gguf.ExpertGatingFuncType.SOFTMAX)
    if preset.rope_linear:
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(preset.rope_linear)
    if preset.pooling is not None:
        writer.add_pooling_type(preset.pooling)
    if preset.rank_labels:
        writer.add_classifier_output_labels(list(preset.rank_labels))
    build_vocab(preset.vocab_style, cfg.n_vocab, preset.vocab_family).write(writer)
    if preset.rank_labels:
        writer.add_string("tokenizer.chat_template.rerank", RERANK_TEMPLATE)


def _group(name: str) -> str:
    return ".".join(name.split(".")[:2]) if name.startswith("blk.") else name.split(".")[0]


def _usable_cpus() -> int:
    """CPUs this process may run on (a container's affinity mask, not the host's count)."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return os.cpu_count() or 1


def _writer(preset: Preset, quant: str, plans: list[TensorPlan]) -> gguf.GGUFWriter:
    writer = gguf.GGUFWriter(path=None, arch=preset.arch)
    _write_metadata(writer, preset, quant)
    for t in plans:
        writer.add_tensor_info(t.name, t.shape, np.dtype(np.float32), t.n_bytes, raw_dtype=t.ggml_type)
    return writer


def planned_file_bytes(preset: str, quant: str, pure: bool = False, sharp: bool = False) -> int:
    """The exact size ``make_model`` will write, without generating any weights.

    Writes only the header (metadata and tensor directory) to a scratch file; the
    tensor data that follows is each tensor padded to the GGUF alignment.
    """
    if preset not in PRESETS:
        raise MakeModelError(f"unknown preset {preset!r} (choose from {', '.join(PRESETS)})")
    plans = plan_tensors(PRESETS[preset], quant, pure, sharp)
    writer = _writer(PRESETS[preset], quant, plans)
    align = writer.data_alignment
    with tempfile.TemporaryDirectory() as scratch:
        writer.write_header_to_file(Path(scratch) / "header.gguf")
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        assert writer.fout is not None
        header = writer.fout[0].tell()
        writer.close()
    return gguf.GGUFWriter.ggml_pad(header, align) + sum(
        gguf.GGUFWriter.ggml_pad(t.n_bytes, align) for t in plans
    )


def make_model(
    preset: str,
    quant: str,
    path: str | os.PathLike[str],
    seed: int = 0,
    progress: Callable[[str], None] | None = None,
    workers: int | None = None,
    pure: bool = False,
    sharp: bool = False,
    mtp: int = 0,
    metadata: Mapping[str, str | int | float] | None = None,
) -> Path:
    """Write the ``preset`` model as ``quant`` to ``path`` atomically; return the path.

    ``quant`` is a ``QUANTS`` name: a plain type, or a llama-quantize mix whose base
    type ``pure`` puts on every matrix instead (llama-quantize's ``--pure``). ``sharp``:
    see ``plan_tensors``. ``mtp``: that many multi-token-prediction blocks after the
    trunk (``Preset.mtp``; the hybrids and deepseek2 only). ``metadata``: keys set over
    the preset's (``{arch}.`` is written out; a str, an int as UINT32, a float as
    FLOAT32), e.g. a RoPE scaling the preset does not have.

    ``workers`` defaults to one process per CPU for models above ``POOL_THRESHOLD``
    values and to in-process generation below it; the bytes are the same either way.
    """
    if preset not in PRESETS:
        raise MakeModelError(f"unknown preset {preset!r} (choose from {', '.join(PRESETS)})")
    if seed < 0:
        raise MakeModelError(f"seed must be >= 0, got {seed}")
    if mtp < 0:
        raise MakeModelError(f"mtp must be >= 0, got {mtp}")
    p = attrs.evolve(PRESETS[preset], mtp=mtp)
    plans = plan_tensors(p, quant, pure, sharp)
    if workers is None:
        n_values = sum(int(np.prod(t.shape)) for t in plans)
        workers = _usable_cpus() if n_values > POOL_THRESHOLD else 1
    path = Path(path)
    writer = _writer(p, quant, plans)
    for key, value in (metadata or {}).items():
        kind = (gguf.GGUFValueType.STRING if isinstance(value, str) else gguf.GGUFValueType.FLOAT32
                if isinstance(value, float) else gguf.GGUFValueType.UINT32)
        writer.kv_data[0][key] = gguf.GGUFValue(value, kind)  # over the preset's own value, if any
    with atomic_gguf(writer, path) as tmp:
        writer.write_header_to_file(tmp)
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        total = sum(t.n_bytes for t in plans)
        written = 0
        for index, data in _encoded_tensors(plans, seed, workers):
            writer.write_tensor_data(data)
            written += plans[index].n_bytes
            group = _group(plans[index].name)
            last_of_group = index + 1 == len(plans) or _group(plans[index + 1].name) != group
            if progress is not None and last_of_group:
                progress(f"{group}: {written / 1e6:,.1f} of {total / 1e6:,.1f} MB written")
    return path


@contextmanager
def atomic_gguf(writer: gguf.GGUFWriter, path: Path) -> Iterator[Path]:
    """A temporary file beside ``path`` for ``writer`` to write: renamed onto ``path``
    (mode 0644) when the block ends, removed on any error, so a half-written file never
    stands at ``path``."""
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        yield tmp
        writer.close()
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        writer.close()
        tmp.unlink(missing_ok=True)
        raise


def generator_version() -> str:
    """A short hash of the code that decides a synthetic file's bytes.

    Part of the default model's file name, so changing the generator (presets, RNG
    layout, quantizers, vocabulary) makes a new file instead of reusing a stale one.
    """
    from trio_llm.model import gguf as gguf_mod
    from trio_llm.model import quant, vocab

    h = hashlib.sha256()
    for module in (sys.modules[__name__], quant, vocab, gguf_mod):
        if module.__file__ is not None:
            h.update(Path(module.__file__).read_bytes())
    h.update(gguf.__version__.encode() if hasattr(gguf, "__version__") else b"")
    return h.hexdigest()[:12]


DEFAULT_PRESET = "demo"
DEFAULT_QUANT = "Q8_0"


def default_model_path() -> Path:
    """The embedded default model (``demo`` in Q8_0), made on first use in the cache.

    Blocking (it may write a ~10 MB file): call it through ``trio.to_thread.run_sync``
    from async code. Safe when several processes race: each writes its own temporary
    file and renames it into place, and every rename installs a complete file.
    """
    import platformdirs

    directory = Path(platformdirs.user_cache_dir("trio-llm")) / "models"
    path = directory / f"{DEFAULT_PRESET}-{DEFAULT_QUANT}-{generator_version()}.gguf"
    if not path.exists():
        try:
            directory.mkdir(parents=True, exist_ok=True)
            make_model(DEFAULT_PRESET, DEFAULT_QUANT, path, seed=0)
        except OSError as exc:
            raise ModelLoadError(path, f"cannot write the default model: {exc.strerror or exc}") from None
    return path


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        raise MakeModelError(message)


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="trio-llm make-model",
        description="Write a deterministic synthetic GGUF model of a known shape.",
    )
    parser.add_argument("--preset", required=True, help=f"one of: {', '.join(PRESETS)}")
    parser.add_argument("--quant", default="Q8_0",
                        help=f"a type, every matrix in it: {', '.join(PLAIN)}; or a llama-quantize mix, "
                             f"each tensor typed as llama-quantize does: {', '.join(MIXES)}")
    parser.add_argument("--pure", action="store_true",
                        help="every matrix in the mix's base type (as llama-quantize --pure)")
    parser.add_argument("--sharp", action="store_true",
                        help="q/k projections 5x: peaked attention (for agreement tests)")
    parser.add_argument("-o", "--output", required=True, type=Path, help="GGUF file to write")
    parser.add_argument("--seed", type=int, default=0, help="RNG seed (>= 0)")
    parser.add_argument("--mtp", type=int, default=0,
                        help="multi-token-prediction blocks after the trunk, as llama.cpp's converter writes "
                             "Qwen3.5, Qwen3-Next and GLM-4.7-Flash files (the hybrid and deepseek2 presets only)")
    parser.add_argument("--workers", type=int, default=None, help="processes (default: per CPU)")
    parser.add_argument("-q", "--quiet", action="store_true", help="no progress lines")
    return parser


def main(argv: list[str]) -> int:
    try:
        args = _parser().parse_args(argv)
        if args.preset not in PRESETS:
            raise MakeModelError(f"unknown preset {args.preset!r} (choose from {', '.join(PRESETS)})")
        if args.quant not in QUANTS:
            raise MakeModelError(f"unknown quant {args.quant!r} (choose from {', '.join(QUANTS)})")
        if args.seed < 0:
            raise MakeModelError(f"--seed must be >= 0, got {args.seed}")
        if args.workers is not None and args.workers < 1:
            raise MakeModelError(f"--workers must be >= 1, got {args.workers}")
        if not args.output.parent.is_dir():
            raise MakeModelError(f"output directory {str(args.output.parent)!r} does not exist")
        if args.output.is_dir():
            raise MakeModelError(f"output {str(args.output)!r} is a directory")
    except MakeModelError as exc:
        print(f"trio-llm make-model: error: {exc}", file=sys.stderr)
        return 2

    def report(line: str) -> None:
        print(f"make-model {args.preset} {args.quant}: {line}", file=sys.stderr, flush=True)

    try:
        make_model(args.preset, args.quant, args.output, seed=args.seed,
                   progress=None if args.quiet else report, workers=args.workers, pure=args.pure,
                   sharp=args.sharp, mtp=args.mtp)
    except MakeModelError as exc:
        print(f"trio-llm make-model: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"trio-llm make-model: error: {args.output}: {exc.strerror or exc}", file=sys.stderr)
        return 1
    except (cf.process.BrokenProcessPool, MemoryError):
        print("trio-llm make-model: error: a worker process died (killed, or out of memory); "
              "try fewer --workers",
              file=sys.stderr)
        return 1
    if not args.quiet:
        report(f"wrote {args.output} ({args.output.stat().st_size:,} bytes)")
    return 0

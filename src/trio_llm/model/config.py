"""ModelConfig: the hyper-parameters a forward pass needs, read once from GGUF metadata.

Shapes follow llama.cpp's names. Weight matrices are stored the ggml way: a tensor
with ``ne = [n_in, n_out]`` is ``n_out`` rows of ``n_in`` values, each row quantized
in blocks along ``n_in``; in numpy that is an array of shape ``[n_out, n_in]``.
"""

from __future__ import annotations

from typing import Literal

import attrs

RopeMode = Literal["normal", "neox"]

#: architectures we run, and the RoPE layout each implies (each has its file in
#: ``trio_llm.models``, which builds its graph)
ARCH_ROPE: dict[str, RopeMode] = {"llama": "normal", "qwen2": "neox", "qwen3": "neox", "gemma3": "neox",
                                 "qwen3moe": "neox", "qwen35": "neox",
                                 "qwen35moe": "neox", "qwen3next": "neox", "deepseek2": "normal",
                                 "gemma-embedding": "neox", "gemma4": "neox"}


@attrs.frozen
class ModelConfig:
    arch: str  # "llama" (also Mistral-style llama), "qwen2", "qwen3"
    name: str
    n_vocab: int
    n_embd: int
    n_layer: int
    n_head: int
    n_head_kv: int
    head_dim: int  # per head; qwen3 has head_dim * n_head != n_embd
    n_ff: int
    n_ctx_train: int
    rope_theta: float
    rms_eps: float
    rope_mode: RopeMode  # "normal": adjacent pairs (llama GGUF, Q/K pre-permuted); "neox": half split
    qk_norm: bool  # qwen3: RMSNorm of each q and k head before RoPE
    attn_bias: bool  # qwen2: biases on q, k and v projections
    tied_embeddings: bool  # no output.weight: the head reuses token_embd.weight
    # sliding-window attention (gemma3): the window, and which layers use it
    n_swa: int = 0
    swa_layers: tuple[bool, ...] = ()
    rope_theta_swa: float = 0.0  # the RoPE base of the sliding-window layers
    rope_freq_scale: float = 1.0  # linear RoPE scaling of the other layers (1 / factor)
    #: YaRN (ext_factor, low, high): the ramp of ``trio_llm.graph.rope_divisors``; empty:
    #: none. Its magnitude factor is in ``attn_scale`` (squared: q and k both carry it)
    rope_yarn: tuple[float, ...] = ()
    attn_scale: float = 0.0  # softmax scale of q.k; 0: 1 / sqrt(head_dim)
    # mixture of experts (qwen3moe): experts per layer, chosen per token, their FFN width
    n_expert: int = 0
    n_expert_used: int = 0
    n_ff_exp: int = 0
    n_ff_shexp: int = 0  # the shared expert's width (qwen35moe); 0: none
    # gated delta-net hybrids (qwen35): the recurrent layers, the short convolution's
    # width, the k and v heads of the delta rule and their size, the rotated part of a
    # full-attention head (partial RoPE; 0: all of it)
    recurrent_layers: tuple[bool, ...] = ()
    ssm_d_conv: int = 0
    ssm_n_k_heads: int = 0
    ssm_n_v_heads: int = 0
    ssm_head_dim: int = 0
    n_rot: int = 0
    # multi-head latent attention (deepseek2): the q and kv low ranks (n_lora_q 0: one
    # full attn_q), the q.k size of a head (its no-RoPE part then its n_rot RoPE part)
    # and the size of a head's value after decompression; head_dim is then the latent
    # cache row (n_lora_kv + n_rot, one KV head)
    n_lora_q: int = 0
    n_lora_kv: int = 0
    head_dim_k_mla: int = 0
    head_dim_v_mla: int = 0
    n_dense_lead: int = 0  # leading layers with a dense FFN instead of experts
    # the router (deepseek2's keys; the other MoE architectures fix them in their file)
    expert_gating: str = "softmax"  # or "sigmoid"
    expert_weights_norm: bool = False
    expert_weights_scale: float = 0.0  # 0: none
    # a rank head (llama.cpp's cls_out, a causal reranker such as Qwen3-Reranker):
    # ``cls.output.weight`` [n_cls_out, n_embd]; 0: none
    n_cls_out: int = 0
    #: llama.cpp's ``hparams.causal_attn``: False for an encoder (gemma-embedding), whose
    #: every token sees its whole prompt; such a model has no memory in llama.cpp, so
    #: it runs a prompt in one pass and does not generate
    causal_attn: bool = True
    #: sentence-transformers' dense projections after pooling (gemma-embedding's
    #: ``dense_2`` [feat, n_embd] then ``dense_3`` [n_embd, feat]): (dense_2's outputs,
    #: dense_3's inputs); (0, 0): none
    dense_feat: tuple[int, int] = (0, 0)
    #: per-layer shapes (gemma4): the sliding-window layers' head size (0: head_dim) and
    #: rotated part (0: all of it), each layer's KV heads and FFN width (empty: n_head_kv,
    #: n_ff everywhere)
    head_dim_swa: int = 0
    n_rot_swa: int = 0
    n_head_kv_layers: tuple[int, ...] = ()
    n_ff_layers: tuple[int, ...] = ()
    #: gemma4's per-layer embeddings: values per layer (0: none)
    n_embd_per_layer: int = 0
    #: the layers from the start that own a KV cache (llama.cpp's
    #: ``n_layer_kv_from_start``); the later ones attend over an earlier layer's; 0: all
    n_layer_kv: int = 0
    #: ``cap * tanh(logits / cap)`` on the logits; 0: none
    final_logit_softcap: float = 0.0
    #: LoRA adapters' deltas (``model/lora.py``): (matrix, lora_a, lora_b, scale), each
    #: ``scale * B (A x)`` added to that matrix's product
    lora: tuple[tuple[str, str, str, float], ...] = ()

    def is_recurrent(self, il: int) -> bool:
        return bool(self.recurrent_layers) and self.recurrent_layers[il]

    def is_swa(self, il: int) -> bool:
        return bool(self.swa_layers) and self.swa_layers[il]

    def layer_head_dim(self, il: int) -> int:
        return self.head_dim_swa if self.head_dim_swa and self.is_swa(il) else self.head_dim

    def layer_n_head_kv(self, il: int) -> int:
        return self.n_head_kv_layers[il] if self.n_head_kv_layers else self.n_head_kv

    def layer_n_ff(self, il: int) -> int:
        return self.n_ff_layers[il] if self.n_ff_layers else self.n_ff

    def has_kv(self, il: int) -> bool:
        """Does layer ``il`` own a KV cache (llama.cpp's ``hparams.has_kv``)?"""
        return not self.n_layer_kv or il < self.n_layer_kv

    @property
    def kq_scale(self) -> float:
        return self.attn_scale if self.attn_scale > 0 else 1.0 / float(self.head_dim) ** 0.5

    @property
    def n_gqa(self) -> int:
        return self.n_head // self.n_head_kv

    @property
    def q_dim(self) -> int:
        return self.n_head * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_head_kv * self.head_dim

    @property
    def uniform_kv(self) -> bool:
        """Does every layer own a cache of ``kv_dim`` values per position (the one shape
        slot files and ``read_kv`` take)? Not gemma4's: per-layer heads, shared caches."""
        return not (self.n_layer_kv or self.n_head_kv_layers or self.head_dim_swa not in (0, self.head_dim))

    @property
    def kv_parts(self) -> int:
        """Caches per attention layer: K and V (2), or K alone (1) for multi-head latent
        attention, whose values are the first ``n_lora_kv`` values of each K row (as in
        llama.cpp, whose MLA cache has no V)."""
        return 1 if self.n_lora_kv else 2

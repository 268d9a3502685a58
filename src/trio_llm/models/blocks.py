"""Shared blocks of the architectures: norms, attention, feed-forward, the head.

Each block takes what varies as arguments (head counts, RoPE settings, which optional
tensors a layer has); none of them asks which architecture it is building, so an
architecture file reads as the list of its differences. Names of intermediate values
follow llama.cpp's ``cb(cur, "...", il)`` names.
"""

from __future__ import annotations

from typing import Any, Literal

import attrs

from trio_llm.graph import Activation, Graph, RopeMode, Tensor
from trio_llm.model.config import ModelConfig


@attrs.frozen
class Rope:
    mode: RopeMode
    theta: float
    freq_scale: float = 1.0
    factors: str | None = None  # a tensor of per-frequency divisors (llama 3 long context)
    yarn: tuple[float, ...] = ()  # ModelConfig.rope_yarn


@attrs.frozen
class Attn:
    n_head: int
    n_head_kv: int
    head_dim: int
    eps: float
    scale: float  # softmax scale of q.k
    bias: bool = False  # q/k/v biases (qwen2)
    qk_norm: bool = False  # RMSNorm of each q and k head before RoPE (qwen3, gemma3)
    window: int = 0  # sliding window; 0: full causal attention
    symmetric: bool = False  # the window also hides keys ``window`` or more after (non-causal rows)


def attention_tensors(cfg: ModelConfig, il: int, *, qk_norm: bool, bias: bool = False) -> dict[str, tuple[int, ...]]:
    """The tensors ``attention`` reads in layer ``il`` (with the norm before it), with
    their numpy-order shapes."""
    b = f"blk.{il}."
    e, q, kv, hd = cfg.n_embd, cfg.q_dim, cfg.kv_dim, cfg.head_dim
    shapes = {b + "attn_norm.weight": (e,), b + "attn_q.weight": (q, e), b + "attn_k.weight": (kv, e),
              b + "attn_v.weight": (kv, e)}
    if bias:
        shapes.update({b + "attn_q.bias": (q,), b + "attn_k.bias": (kv,), b + "attn_v.bias": (kv,)})
    if qk_norm:
        shapes.update({b + "attn_q_norm.weight": (hd,), b + "attn_k_norm.weight": (hd,)})
    shapes[b + "attn_output.weight"] = (e, q)
    return shapes


def head_tensors(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The final norm and the output projection (absent when tied to the embedding)."""
    shapes: dict[str, tuple[int, ...]] = {"output_norm.weight": (cfg.n_embd,)}
    if not cfg.tied_embeddings:
        shapes["output.weight"] = (cfg.n_vocab, cfg.n_embd)
    return shapes


def norm(g: Graph, x: Tensor, weight: str, eps: float, name: str) -> Tensor:
    return g.rms_norm(x, g.weight(weight), eps, name)


def attention(g: Graph, h: Tensor, il: int, a: Attn, rope: Rope) -> Tensor:
    """Self-attention of layer ``il`` on the normed input ``h`` ``[T, n_embd]``, through
    the output projection: ``[T, n_embd]``."""
    b = f"blk.{il}."
    q = g.linear(h, g.weight(b + "attn_q.weight"), "Qcur")  # [T, n_head * hd]
    k = g.linear(h, g.weight(b + "attn_k.weight"), "Kcur")  # [T, n_head_kv * hd]
    v = g.linear(h, g.weight(b + "attn_v.weight"), "Vcur")  # [T, n_head_kv * hd]
    if a.bias:
        q = g.add(q, g.weight(b + "attn_q.bias"), "Qcur_b")
        k = g.add(k, g.weight(b + "attn_k.bias"), "Kcur_b")
        v = g.add(v, g.weight(b + "attn_v.bias"), "Vcur_b")
    if a.qk_norm:
        q = g.rms_norm(q, g.weight(b + "attn_q_norm.weight"), a.eps, "Qcur_normed", group=a.head_dim)
        k = g.rms_norm(k, g.weight(b + "attn_k_norm.weight"), a.eps, "Kcur_normed", group=a.head_dim)
    factors = g.weight(rope.factors) if rope.factors is not None and g.has(rope.factors) else None
    kw: dict[str, Any] = dict(head_dim=a.head_dim, mode=rope.mode, theta=rope.theta, freq_scale=rope.freq_scale,
                              factors=factors)
    if rope.yarn:
        kw["yarn"] = rope.yarn
    q = g.rope(q, "Qcur_rope", n_heads=a.n_head, **kw)  # type: ignore[arg-type]
    k = g.rope(k, "Kcur_rope", n_heads=a.n_head_kv, **kw)  # type: ignore[arg-type]
    att = g.attention(q, k, v, "kqv_out", n_head=a.n_head, n_head_kv=a.n_head_kv, head_dim=a.head_dim,
                      scale=a.scale, window=a.window, symmetric=a.symmetric)  # [T, n_head * hd]
    return g.linear(att, g.weight(b + "attn_output.weight"), "attn_out")  # [T, n_embd]


def ffn(g: Graph, h: Tensor, il: int, act: Activation) -> Tensor:
    """The gated feed-forward block: ``down(act(gate(h)) * up(h))``."""
    b = f"blk.{il}."
    gate = g.linear(h, g.weight(b + "ffn_gate.weight"), "ffn_gate")  # [T, n_ff]
    up = g.linear(h, g.weight(b + "ffn_up.weight"), "ffn_up")  # [T, n_ff]
    par = g.glu(gate, up, act, "ffn_act")  # [T, n_ff]
    return g.linear(par, g.weight(b + "ffn_down.weight"), "ffn_out")  # [T, n_embd]


def head(g: Graph, x: Tensor, eps: float) -> Tensor:
    """The final norm and the output projection, only for the rows whose logits are
    wanted; a file without ``output.weight`` reuses the embedding (tied). An embedding
    graph (``g.output``) ends at the final norm, as llama.cpp's ``t_embd``; a rank
    graph applies the file's classifier ``cls.output.weight`` to it (llama.cpp's
    ``build_pooling`` for a causal reranker: the last token's hidden state)."""
    g.layer(-1)
    x = g.outputs(x)  # [O, n_embd]
    x = norm(g, x, "output_norm.weight", eps, "result_norm")  # [O, n_embd]
    if g.output == "embd":
        return g.set_logits(x)  # [O, n_embd]
    if g.output == "rank":
        return g.set_logits(g.linear(x, g.weight("cls.output.weight"), "result_cls"))  # [O, n_cls_out]
    w = g.weight("output.weight" if g.has("output.weight") else "token_embd.weight")
    return g.set_logits(g.linear(x, w, "result_output"))  # [O, n_vocab]


@attrs.frozen
class Moe:
    n_expert: int
    n_expert_used: int
    norm: bool  # renormalise the chosen experts' weights to sum to 1
    scale: float = 1.0  # multiplies the weights (``expert_weights_scale``)
    shared: bool = False  # a shared expert (``ffn_*_shexp``)
    shared_gate: bool = True  # the shared expert scaled by its gate ``ffn_gate_inp_shexp``; False: added as is
    gating: Literal["softmax", "sigmoid"] = "softmax"  # the router's probabilities


def moe_tensors(cfg: ModelConfig, il: int, *, shared_gate: bool = False) -> dict[str, tuple[int, ...]]:
    """The tensors ``moe_ffn`` reads in layer ``il``: the router and the experts, and with
    ``cfg.n_ff_shexp`` the shared expert (its sigmoid gate row too with ``shared_gate``)."""
    b = f"blk.{il}."
    e, ne, ff, sh = cfg.n_embd, cfg.n_expert, cfg.n_ff_exp, cfg.n_ff_shexp
    shapes = {b + "ffn_gate_inp.weight": (ne, e), b + "ffn_gate_exps.weight": (ne, ff, e),
              b + "ffn_up_exps.weight": (ne, ff, e), b + "ffn_down_exps.weight": (ne, e, ff)}
    if sh:
        if shared_gate:
            shapes[b + "ffn_gate_inp_shexp.weight"] = (e,)
        shapes.update({b + "ffn_gate_shexp.weight": (sh, e), b + "ffn_up_shexp.weight": (sh, e),
                       b + "ffn_down_shexp.weight": (e, sh)})
    return shapes


def moe_ffn(g: Graph, h: Tensor, il: int, moe: Moe, act: Activation) -> Tensor:
    """llama.cpp's ``build_moe_ffn``: the router picks ``n_expert_used`` of the layer's
    experts per token (softmax gating), each chosen expert runs its gated FFN, and the
    outputs are summed with the routing weights: ``[T, n_embd]``. A layer whose file has
    ``exp_probs_b.bias`` chooses its experts by the probabilities plus that bias."""
    b = f"blk.{il}."
    logits = g.linear(h, g.weight(b + "ffn_gate_inp.weight"), "ffn_moe_logits")  # [T, n_expert]
    bias = g.weight(b + "exp_probs_b.bias") if g.has(b + "exp_probs_b.bias") else None  # [n_expert]
    routes = g.moe_topk(logits, moe.n_expert_used, "ffn_moe_topk", gating=moe.gating, norm=moe.norm,
                        scale=moe.scale, bias=bias)  # [T, 2k]
    gate = g.moe_linear(h, g.weight(b + "ffn_gate_exps.weight"), routes, "ffn_moe_gate")  # [T, k, n_ff_exp]
    up = g.moe_linear(h, g.weight(b + "ffn_up_exps.weight"), routes, "ffn_moe_up")  # [T, k, n_ff_exp]
    par = g.glu(gate, up, act, "ffn_moe_swiglu")  # [T, k, n_ff_exp]
    down = g.moe_linear(par, g.weight(b + "ffn_down_exps.weight"), routes, "ffn_moe_down")  # [T, k, n_embd]
    out = g.moe_combine(down, routes, "ffn_moe_out")  # [T, n_embd]
    if not moe.shared:
        return out
    # the shared expert sees every token, scaled by its own sigmoid gate when it has one
    sg = g.linear(h, g.weight(b + "ffn_gate_shexp.weight"), "ffn_shexp_gate")  # [T, n_ff_shexp]
    su = g.linear(h, g.weight(b + "ffn_up_shexp.weight"), "ffn_shexp_up")
    shexp = g.linear(g.glu(sg, su, act, "ffn_shexp_act"), g.weight(b + "ffn_down_shexp.weight"), "ffn_shexp")
    if moe.shared_gate:
        shexp = g.gate_rows(shexp, h, g.weight(b + "ffn_gate_inp_shexp.weight"), "ffn_shexp_gated")  # [T, n_embd]
    return g.add(out, shexp, "ffn_out")

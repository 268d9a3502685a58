"""A small graph IR for one forward pass: tensors that know their shape, nodes in order.

An architecture (``trio_llm.models``) describes its forward pass once, as calls on a
``Graph``; every backend then executes that one description: the numpy reference
interprets the nodes (``engine/reference.py``), the Vulkan backend lowers them to
recorded dispatches (``vulkan/forward.py``). So an architecture is never written twice,
and a shape mistake is a ``GraphError`` raised here, in Python, at build time, naming
the node and the shapes, instead of wrong numbers from a GPU.

Shapes use two symbolic leading dimensions: ``T``, the tokens of a step (every live
token of every sequence, concatenated), and ``O``, the rows whose logits are wanted
(each sequence's last token). Everything else is an ``int``. Per-step values (token
ids, positions, sequence ids, output rows) are not tensors: they live in the
backends' step state, which is why one graph serves every step of a shape bucket.

The ops are deliberately few and plain (a linear layer, an RMS norm, RoPE, attention
over a layer's cache, a gated activation, an elementwise add and scale); fusions are
the lowering's business (pattern passes in ``vulkan/forward.py``), never the model's.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

import attrs

from trio_llm.errors import GraphError

Dim = int | str
TOKENS = "T"
OUTPUTS = "O"

RopeMode = Literal["normal", "neox"]
Activation = Literal["silu", "gelu", "sigmoid"]
#: what a graph's result is: the logits (generation), the final-norm hidden states
#: (llama.cpp's ``t_embd``, pooled by the embeddings edge), or a rank head's scores
#: (``cls.output.weight`` of those hidden states: llama.cpp's pooling ``rank``)
Output = Literal["logits", "embd", "rank"]
#: the tensor holding layer ``il``'s control vector, when the model has one (``model/cvec.py``)
CVEC = "cvec.{}"


@attrs.frozen(eq=False)
class Tensor:
    """A value of the graph: an input, a weight of the file, or a node's output."""

    id: int
    shape: tuple[Dim, ...]
    name: str  # the weight's GGUF name, or the node's name ("blk.3.attn_norm")
    kind: Literal["input", "weight", "value"]

    @property
    def width(self) -> int:
        """Values per row: the product of every dimension after the first."""
        n = 1
        for d in self.shape[1:]:
            assert isinstance(d, int)
            n *= d
        return n

    def __repr__(self) -> str:
        dims = ", ".join(str(d) for d in self.shape)
        return f"{self.name}[{dims}]"


@attrs.frozen(eq=False)
class Node:
    op: str
    out: Tensor
    inputs: tuple[Tensor, ...]
    attrs: Mapping[str, Any]
    layer: int  # -1 outside the blocks

    def attr(self, key: str) -> Any:
        return self.attrs[key]


@attrs.define(eq=False)
class Graph:
    """The builder and the result: ``nodes`` in execution order, ``logits`` at the end.

    ``shapes`` are the tensors the file has (numpy order: ``(n_out, n_in)`` for a
    matrix); ``weight(name)`` checks against them, so a model asks only for what exists.
    ``output`` says what the head computes (``Output``); ``logits`` is the graph's
    result whichever it is (``[O, n_vocab]``, ``[O, n_embd]`` or ``[O, n_cls_out]``),
    so the backends run and read back every kind the same way.
    """

    shapes: Mapping[str, tuple[int, ...]]
    nodes: list[Node] = attrs.field(factory=list)
    weights: dict[str, Tensor] = attrs.field(factory=dict)
    logits: Tensor | None = None
    output: Output = "logits"
    #: LoRA deltas (``model/lora.py``): matrix name -> ((lora_a, lora_b, scale), ...), added
    #: by ``linear``; ``lora_used`` says which ones a build reached
    lora: Mapping[str, tuple[tuple[str, str, float], ...]] = attrs.field(factory=dict)
    lora_used: set[str] = attrs.field(factory=set)
    #: the layers whose control vector (``model/cvec.py``) ``cvec`` added
    cvec_used: set[int] = attrs.field(factory=set)
    _ids: int = 0
    _layer: int = -1

    # -- tensors ------------------------------------------------------------------------

    def _tensor(self, shape: tuple[Dim, ...], name: str, kind: Literal["input", "weight", "value"]) -> Tensor:
        self._ids += 1
        return Tensor(self._ids, shape, name, kind)

    def has(self, name: str) -> bool:
        return name in self.shapes

    def weight(self, name: str) -> Tensor:
        """The file's tensor ``name`` (one Tensor per name, however often asked)."""
        t = self.weights.get(name)
        if t is None:
            if name not in self.shapes:
                raise GraphError(f"the model needs tensor {name!r}, which the file lacks")
            t = self.weights[name] = self._tensor(tuple(self.shapes[name]), name, "weight")
        return t

    def tokens(self) -> Tensor:
        """The step's token ids, ``[T]``."""
        return self._tensor((TOKENS,), "tokens", "input")

    def layer(self, il: int) -> Graph:
        """Name the nodes built next as layer ``il``'s (``-1``: outside the blocks)."""
        self._layer = il
        return self

    def _full(self, name: str) -> str:
        return f"blk.{self._layer}.{name}" if self._layer >= 0 else name

    def _check(self, ok: bool, name: str, problem: str) -> None:
        _expect(ok, self._full(name), problem)

    def _node(self, op: str, inputs: tuple[Tensor, ...], shape: tuple[Dim, ...], name: str, **kw: Any) -> Tensor:
        out = self._tensor(shape, self._full(name), "value")
        self.nodes.append(Node(op, out, inputs, kw, self._layer))
        return out

    # -- ops ----------------------------------------------------------------------------

    def get_rows(self, w: Tensor, ids: Tensor, name: str = "inp_embd") -> Tensor:
        """Rows of the matrix ``w`` picked by token ids: ``[T, n_embd]``."""
        self._check(w.kind == "weight" and len(w.shape) == 2, name, f"get_rows needs a weight matrix, got {w!r}")
        self._check(ids.shape == (TOKENS,), name, f"get_rows needs token ids [T], got {ids!r}")
        return self._node("get_rows", (w, ids), (TOKENS, w.shape[1]), name)

    def embd_rows(self, x: Tensor, name: str = "inp_embd_rows") -> Tensor:
        """``x`` ``[T, n]`` with the rows of the entries that carry embeddings
        (``SeqBatch.embd``) replaced by them, exactly; the other rows pass through. Where
        it sits says which transforms of the token embeddings those rows skip (gemma3:
        after the sqrt(n_embd) scale). A graph without it takes no embeddings."""
        self._check(len(x.shape) == 2 and x.shape[0] == TOKENS, name, f"embd_rows needs [T, n], got {x!r}")
        self._check(not any(n.op == "embd_rows" for n in self.nodes), name, "a graph takes embeddings once")
        return self._node("embd_rows", (x,), x.shape, name)

    def linear(self, x: Tensor, w: Tensor, name: str) -> Tensor:
        """``x @ w.T``: ``[R, n_in]`` by a weight ``[n_out, n_in]`` gives ``[R, n_out]``."""
        self._check(w.kind == "weight" and len(w.shape) == 2, name, f"linear needs a weight matrix, got {w!r}")
        self._check(len(x.shape) == 2 and x.shape[1] == w.shape[1], name,
                f"linear of {x!r} by {w!r}: input width {x.shape[-1]} != {w.shape[1]}")
        out = self._node("linear", (x, w), (x.shape[0], w.shape[0]), name)
        for i, (a, b, s) in enumerate(self.lora.get(w.name, ())):
            # llama.cpp's build_lora_mm: W x + s B (A x), an adapter at a time
            self.lora_used.add(w.name)
            low = self._node("linear", (x, self.weight(a)), (x.shape[0], self.shapes[a][0]), f"{name}_lora{i}_a")
            delta = self._node("linear", (low, self.weight(b)), out.shape, f"{name}_lora{i}_b")
            out = self.add(out, self.scale(delta, s, f"{name}_lora{i}_scaled"), f"{name}_lora{i}")
        return out

    def add(self, a: Tensor, b: Tensor, name: str) -> Tensor:
        """``a + b``, with ``b`` of ``a``'s shape or one row ``[n]`` (a bias) for every row."""
        self._check(b.shape == a.shape or b.shape == (a.width,), name, f"add of {a!r} and {b!r}: shapes differ")
        return self._node("add", (a, b), a.shape, name)

    def cvec(self, x: Tensor) -> Tensor:
        """llama.cpp's ``build_cvec``: the current layer's output ``x`` ``[T, n_embd]``
        (the residual stream after the layer) plus the layer's control vector, when the
        model has one (the tensor ``cvec.<il>``, ``model/cvec.py``); else ``x`` itself.
        Every architecture calls it once per layer, on what feeds the next."""
        name = CVEC.format(self._layer)
        if self._layer < 0 or not self.has(name):
            return x
        self.cvec_used.add(self._layer)
        return self.add(x, self.weight(name), "l_out_cvec")

    def scale(self, x: Tensor, s: float, name: str) -> Tensor:
        return self._node("scale", (x,), x.shape, name, scale=float(s))

    def rms_norm(self, x: Tensor, w: Tensor | None, eps: float, name: str, *, group: int | None = None) -> Tensor:
        """RMSNorm of every ``group`` consecutive values of each row (the whole row when
        None; a head when QK-norm), scaled by ``w`` ``[group]``; without ``w`` unscaled
        (ggml_rms_norm alone: gemma4's V norm)."""
        n = x.width if group is None else group
        self._check(x.width % n == 0, name, f"rms_norm groups of {n} do not tile {x!r}")
        if w is None:
            return self._node("rms_norm", (x,), x.shape, name, eps=float(eps), group=n)
        self._check(w.shape == (n,), name, f"rms_norm of {x!r} in groups of {n} needs a weight [{n}], got {w!r}")
        return self._node("rms_norm", (x, w), x.shape, name, eps=float(eps), group=n)

    def mul(self, x: Tensor, w: Tensor, name: str) -> Tensor:
        """``x`` times the file's one-value tensor ``w`` ``[1]`` (gemma4's
        ``layer_output_scale``: ggml_mul by a broadcast scalar)."""
        self._check(w.kind == "weight" and w.shape == (1,), name, f"mul needs a weight [1], got {w!r}")
        return self._node("mul", (x, w), x.shape, name)

    def softcap(self, x: Tensor, cap: float, name: str) -> Tensor:
        """``cap * tanh(x / cap)`` (gemma's final logit softcapping)."""
        self._check(cap > 0, name, f"softcap of {cap}")
        return self._node("softcap", (x,), x.shape, name, cap=float(cap))

    def rope(self, x: Tensor, name: str, *, n_heads: int, head_dim: int, mode: RopeMode, theta: float,
             freq_scale: float = 1.0, factors: Tensor | None = None, n_rot: int = 0,
             yarn: tuple[float, float, float] | None = None) -> Tensor:
        """Rotary embedding of every head of ``x`` ``[T, n_heads * head_dim]`` at each
        token's position; ``factors`` ``[head_dim / 2]`` divide the frequencies (llama 3
        long-context scaling), ``freq_scale`` multiplies the positions (linear scaling).
        ``n_rot`` > 0: only the first ``n_rot`` values of each head rotate (partial RoPE,
        frequencies over ``n_rot``), the rest pass through. ``yarn`` (ext_factor, low,
        high): YaRN's blend of each frequency's scaled and unscaled position, by a ramp
        over the frequency index from ``low`` to ``high`` (``rope_divisors``); its
        magnitude factor is the model's business (a softmax scale)."""
        self._check(0 <= n_rot <= head_dim and n_rot % 2 == 0, name, f"rope of {n_rot} of {head_dim} values")
        self._check(yarn is None or not n_rot or n_rot == head_dim, name, "YaRN of a partial RoPE is not supported")
        self._check(x.shape == (TOKENS, n_heads * head_dim), name,
                f"rope of {n_heads} heads of {head_dim} needs [T, {n_heads * head_dim}], got {x!r}")
        self._check(head_dim % 2 == 0, name, f"rope needs an even head_dim, got {head_dim}")
        inputs = (x,) if factors is None else (x, factors)
        if factors is not None:
            self._check(factors.shape == (head_dim // 2,), name, f"rope factors must be [{head_dim // 2}], got {factors!r}")
        kw: dict[str, Any] = {"n_rot": int(n_rot)} if n_rot and n_rot != head_dim else {}
        if yarn is not None:  # only then an attribute: every other rope node is as it was
            kw["yarn"] = tuple(float(v) for v in yarn)
        return self._node("rope", inputs, x.shape, name, n_heads=n_heads, head_dim=head_dim, mode=mode,
                          theta=float(theta), freq_scale=float(freq_scale), **kw)

    def attention(self, q: Tensor, k: Tensor | None, v: Tensor | None, name: str, *, n_head: int,
                  n_head_kv: int, head_dim: int, scale: float, window: int = 0, v_is_k: bool = False,
                  v_dim: int = 0, symmetric: bool = False, kv_layer: int = -1) -> Tensor:
        """Store this step's ``k`` and ``v`` in the current layer's cache, then causal
        grouped-query attention of ``q`` over it (a ``causal=False`` entry's rows also see
        the entry's later rows: ``SeqBatch``): ``[T, n_head * head_dim]``. Query head h
        reads KV head ``h // (n_head / n_head_kv)``. ``window`` > 0: a key at position j is
        seen from position p only if ``p - j < window`` (sliding-window layers, whose cache
        then keeps only the positions a window can still reach).

        ``v_is_k`` (``v`` must be ``k`` itself): the values are the cached keys, so the
        layer caches K alone, in K's cache type and without the Hadamard rotation of a
        quantized cache (llama.cpp's multi-head latent attention, where V is a view of
        the K cache; the caller keeps the part of each output head it wants). ``v_dim``
        > 0 says that part is the first ``v_dim`` values of each head (the latent): an
        output head's values past it are then not defined, and a backend may leave them
        unwritten (Vulkan's flash-decoding reads V as those values of each K row).

        ``symmetric`` (with a ``window``): the window also hides keys ``window`` or more
        positions *after* the row, which only a non-causal entry's rows see (llama.cpp's
        ``LLAMA_SWA_TYPE_SYMMETRIC``, EmbeddingGemma's).

        ``kv_layer`` >= 0 (``k`` and ``v`` None): the layer has no cache of its own and
        attends over earlier layer ``kv_layer``'s cache as that layer left it in this step,
        storing nothing (llama.cpp's shared-KV layers, ``hparams.has_kv(il)`` false:
        gemma3n, gemma4); the heads and window must be that layer's."""
        self._check(self._layer >= 0, name, "attention outside a layer has no cache")
        if kv_layer >= 0:
            src = self.attention_layers().get(kv_layer)
            self._check(k is None and v is None and src is not None and kv_layer < self._layer, name,
                        f"attention over layer {kv_layer}'s cache needs no k, v and that earlier layer's cache")
            assert src is not None
            self._check((src.attr("n_head_kv"), src.attr("head_dim"), src.attr("window")) == (n_head_kv, head_dim, window)
                        and not src.attrs.get("v_is_k"), name,
                        f"layer {kv_layer}'s cache has other heads or window")
            self._check(q.shape == (TOKENS, n_head * head_dim), name, f"q must be [T, {n_head * head_dim}], got {q!r}")
            return self._node("attention", (q,), q.shape, name, n_head=n_head, n_head_kv=n_head_kv,
                              head_dim=head_dim, scale=float(scale), window=int(window), kv_layer=int(kv_layer))
        assert k is not None and v is not None, "attention without k and v needs a kv_layer"
        self._check(not v_is_k or v is k, name, "v_is_k attention needs v to be k")
        self._check(n_head % n_head_kv == 0, name, f"{n_head} heads do not share {n_head_kv} KV heads evenly")
        self._check(q.shape == (TOKENS, n_head * head_dim), name, f"q must be [T, {n_head * head_dim}], got {q!r}")
        for t in (k, v):
            self._check(t.shape == (TOKENS, n_head_kv * head_dim), name,
                    f"k and v must be [T, {n_head_kv * head_dim}], got {t!r}")
        self._check(window >= 0, name, f"negative window {window}")
        self._check(not v_dim or (v_is_k and 0 < v_dim <= head_dim), name,
                    f"v_dim {v_dim} needs v_is_k and at most head_dim {head_dim}")
        self._check(not symmetric or window > 0, name, "a symmetric window needs a window")
        kw: dict[str, Any] = {"v_is_k": True} if v_is_k else {}
        if symmetric:
            kw["symmetric"] = True
        if v_dim:
            kw["v_dim"] = int(v_dim)
        return self._node("attention", (q, k, v), q.shape, name, n_head=n_head, n_head_kv=n_head_kv,
                          head_dim=head_dim, scale=float(scale), window=int(window), **kw)

    def glu(self, gate: Tensor, up: Tensor, act: Activation, name: str) -> Tensor:
        """``act(gate) * up`` (SwiGLU with silu, GeGLU with gelu's tanh form)."""
        self._check(gate.shape == up.shape, name, f"glu of {gate!r} and {up!r}: shapes differ")
        self._check(act in ("silu", "gelu", "sigmoid"), name, f"unknown activation {act!r}")
        return self._node("glu", (gate, up), gate.shape, name, act=act)

    # -- mixture of experts -------------------------------------------------------------
    # A routing is one value ``[T, 2 * k]``: the k chosen expert ids (as exact floats)
    # then their k weights, so it lives in an ordinary compute buffer and the expert
    # ops read the ids from the device (decode graphs stay recorded once).

    def moe_topk(self, logits: Tensor, k: int, name: str, *, gating: Literal["softmax", "sigmoid"] = "softmax",
                 norm: bool = True, scale: float = 1.0, bias: Tensor | None = None) -> Tensor:
        """Route each token to its ``k`` best experts: softmax (or each logit's sigmoid)
        over the router logits ``[T, n_expert]``; the top ``k`` chosen by those
        probabilities plus ``bias`` ``[n_expert]`` when given (DeepSeek-V3's selection
        bias: it picks the experts, the weights stay the unbiased probabilities);
        their probabilities (``norm``: divided by their sum) times ``scale``:
        ``[T, 2 * k]`` (ids, then weights)."""
        _expect(len(logits.shape) == 2 and logits.shape[0] == TOKENS, name,
                f"moe_topk needs router logits [T, n_expert], got {logits!r}")
        n_expert = logits.shape[1]
        assert isinstance(n_expert, int)
        _expect(0 < k <= n_expert, name, f"top-{k} of {n_expert} experts")
        _expect(gating in ("softmax", "sigmoid"), name, f"unknown gating {gating!r}")
        inputs: tuple[Tensor, ...] = (logits,)
        if bias is not None:
            _expect(bias.shape == (n_expert,), name, f"moe_topk bias must be [{n_expert}], got {bias!r}")
            inputs = (logits, bias)
        return self._node("moe_topk", inputs, (TOKENS, 2 * k), name, k=int(k), n_expert=n_expert,
                          gating=gating, norm=bool(norm), scale=float(scale))

    def moe_linear(self, x: Tensor, w: Tensor, routes: Tensor, name: str) -> Tensor:
        """Each token's chosen experts applied to it: ``x`` ``[T, n_in]`` (the same input
        for every expert) or ``[T, k, n_in]`` (one per chosen expert), by the expert
        matrices ``w`` ``[n_expert, n_out, n_in]``: ``[T, k, n_out]``."""
        _expect(w.kind == "weight" and len(w.shape) == 3, name, f"moe_linear needs 3-D expert weights, got {w!r}")
        _expect(routes.shape[0] == TOKENS and len(routes.shape) == 2 and routes.width % 2 == 0, name,
                f"moe_linear needs a routing [T, 2k], got {routes!r}")
        k = routes.width // 2
        n_in = w.shape[2]
        _expect(x.shape in ((TOKENS, n_in), (TOKENS, k, n_in)), name,
                f"moe_linear of {x!r} by {w!r}: input must be [T, {n_in}] or [T, {k}, {n_in}]")
        return self._node("moe_linear", (x, w, routes), (TOKENS, k, w.shape[1]), name, k=k)

    def moe_combine(self, y: Tensor, routes: Tensor, name: str) -> Tensor:
        """The chosen experts' outputs ``[T, k, n]`` summed with their routing weights: ``[T, n]``."""
        k = routes.width // 2
        _expect(len(y.shape) == 3 and y.shape[:2] == (TOKENS, k), name,
                f"moe_combine needs expert outputs [T, {k}, n], got {y!r}")
        return self._node("moe_combine", (y, routes), (TOKENS, y.shape[2]), name, k=k)

    # -- per-head products (multi-head latent attention: deepseek2) ------------------------

    def head_linear(self, x: Tensor, w: Tensor, name: str) -> Tensor:
        """Each head's own matrix: ``x`` ``[R, n_head * n_in]`` by ``w`` ``[n_head, n_out,
        n_in]``, head h of the output ``w[h] @ x_h``: ``[R, n_head * n_out]`` (the
        ``moe_linear`` of a routing that sends every token to every expert in order)."""
        self._check(w.kind == "weight" and len(w.shape) == 3, name, f"head_linear needs 3-D weights, got {w!r}")
        nh, n_out, n_in = (int(d) for d in w.shape)
        self._check(len(x.shape) == 2 and x.shape[1] == nh * n_in, name,
                    f"head_linear of {x!r} by {w!r}: input must be [R, {nh * n_in}]")
        return self._node("head_linear", (x, w), (x.shape[0], nh * n_out), name, n_head=nh)

    def concat(self, a: Tensor, b: Tensor, groups: int, name: str) -> Tensor:
        """Each of the ``groups`` groups of a row of ``a`` followed by the same group of
        ``b`` (per head: ``[R, G * na]`` and ``[R, G * nb]`` give ``[R, G * (na + nb)]``)."""
        self._check(len(a.shape) == 2 and len(b.shape) == 2 and a.shape[0] == b.shape[0], name,
                    f"concat of {a!r} and {b!r}: rows differ")
        self._check(groups > 0 and a.width % groups == 0 and b.width % groups == 0, name,
                    f"concat of {a!r} and {b!r} in {groups} groups")
        return self._node("concat", (a, b), (a.shape[0], a.width + b.width), name, groups=int(groups))

    # -- gated delta-net (linear attention with recurrent state: qwen35) ------------------

    def take(self, x: Tensor, group: int, start: int, n: int, name: str) -> Tensor:
        """Values ``[start, start + n)`` of every ``group`` consecutive values of each
        row: a head-interleaved split (``group`` = a head's parts) or a column range
        (``group`` = the row)."""
        self._check(len(x.shape) == 2 and x.width % group == 0 and 0 <= start and start + n <= group, name,
                    f"take [{start}, {start + n}) of groups of {group} from {x!r}")
        return self._node("take", (x,), (x.shape[0], x.width // group * n), name, group=group, start=start, n=n)

    def l2_norm(self, x: Tensor, group: int, eps: float, name: str) -> Tensor:
        """Each ``group`` values divided by their Euclidean norm (at least ``eps``)."""
        self._check(x.width % group == 0, name, f"l2_norm groups of {group} do not tile {x!r}")
        return self._node("l2_norm", (x,), x.shape, name, group=group, eps=float(eps))

    def ssm_conv(self, x: Tensor, w: Tensor, name: str) -> Tensor:
        """The short causal convolution of each channel over the sequence's last
        ``d_conv`` inputs (the ``d_conv - 1`` before this step are the layer's conv
        state), then SiLU: ``x`` ``[T, C]`` by ``w`` ``[C, d_conv]`` gives ``[T, C]``."""
        self._check(self._layer >= 0, name, "ssm_conv outside a layer has no state")
        self._check(w.kind == "weight" and len(w.shape) == 2 and x.shape == (TOKENS, w.shape[0]), name,
                    f"ssm_conv of {x!r} by {w!r}: needs [T, C] and [C, d_conv]")
        return self._node("ssm_conv", (x, w), x.shape, name, d_conv=int(w.shape[1]))

    def delta_net(self, q: Tensor, k: Tensor, v: Tensor, alpha: Tensor, beta: Tensor, dt: Tensor, a: Tensor,
                  name: str, *, n_k_heads: int, n_v_heads: int, head_dim: int, k_grouped: bool = False) -> Tensor:
        """The gated delta rule over the layer's recurrent state S ``[n_v_heads, d, d]``
        (d = ``head_dim``), per token and v head h with its k head ``h % n_k_heads``
        (ggml's tiled broadcast, qwen35), or with ``k_grouped`` ``h // (n_v_heads /
        n_k_heads)`` (each k head's v heads side by side, qwen3next):
        ``S = exp(g) S``, ``S += k (beta (v - S^T k))^T``, out = ``S^T q / sqrt(d)``,
        where the decay ``g = softplus(alpha + dt) * a`` and ``beta = sigmoid(beta)``.
        q, k ``[T, n_k_heads * d]``, v ``[T, n_v_heads * d]``, alpha and beta
        ``[T, n_v_heads]``, dt and a ``[n_v_heads]``: ``[T, n_v_heads * d]``."""
        self._check(self._layer >= 0, name, "delta_net outside a layer has no state")
        self._check(n_v_heads % n_k_heads == 0, name, f"{n_v_heads} v heads do not share {n_k_heads} k heads")
        for t, n in ((q, n_k_heads), (k, n_k_heads), (v, n_v_heads)):
            self._check(t.shape == (TOKENS, n * head_dim), name, f"delta_net needs [T, {n * head_dim}], got {t!r}")
        for t in (alpha, beta):
            self._check(t.shape == (TOKENS, n_v_heads), name,
                        f"delta_net gates must be [T, {n_v_heads}], got {t!r}")
        for t in (dt, a):
            self._check(t.shape == (n_v_heads,), name, f"delta_net dt and a must be [{n_v_heads}], got {t!r}")
        return self._node("delta_net", (q, k, v, alpha, beta, dt, a), v.shape, name, n_k_heads=n_k_heads,
                          n_v_heads=n_v_heads, head_dim=head_dim, k_grouped=bool(k_grouped))

    def gate_rows(self, x: Tensor, h: Tensor, w: Tensor, name: str) -> Tensor:
        """Each row of ``x`` times ``sigmoid(h_row . w)``: a one-output linear gate (a
        shared expert's, whose gate is a vector ``[n_in]`` in the file)."""
        self._check(w.kind == "weight" and len(w.shape) == 1 and len(h.shape) == 2 and h.shape[1] == w.shape[0],
                    name, f"gate_rows needs h [T, n] and a weight [n], got {h!r} and {w!r}")
        self._check(x.shape[0] == h.shape[0], name, f"gate_rows of {x!r} by {h!r}: rows differ")
        return self._node("gate_rows", (x, h, w), x.shape, name)

    def outputs(self, x: Tensor, name: str = "result_rows") -> Tensor:
        """The rows of ``x`` whose logits are wanted: ``[O, width]``."""
        self._check(len(x.shape) == 2 and x.shape[0] == TOKENS, name, f"outputs needs [T, n], got {x!r}")
        return self._node("outputs", (x,), (OUTPUTS, x.shape[1]), name)

    def set_logits(self, x: Tensor) -> Tensor:
        """The graph's result (logits, or the embedding head's output): ``[O, n]``."""
        self._check(len(x.shape) == 2 and x.shape[0] == OUTPUTS, "result_output", f"the result must be [O, n], got {x!r}")
        self.logits = x
        return x

    # -- queries --------------------------------------------------------------------------

    def consumers(self) -> dict[int, list[Node]]:
        """For each tensor id, the nodes that read it (in order)."""
        out: dict[int, list[Node]] = {}
        for node in self.nodes:
            for t in node.inputs:
                out.setdefault(t.id, []).append(node)
        return out

    def producers(self) -> dict[int, Node]:
        return {node.out.id: node for node in self.nodes}

    def recurrent_layers(self) -> dict[int, list[Node]]:
        """Each layer's nodes that keep recurrent state (its conv and its delta rule)."""
        out: dict[int, list[Node]] = {}
        for n in self.nodes:
            if n.op in ("ssm_conv", "delta_net"):
                out.setdefault(n.layer, []).append(n)
        return out

    def embd_width(self) -> int:
        """The width of the embedding rows the graph takes (its ``embd_rows`` node), 0
        when it takes none."""
        return next((n.out.width for n in self.nodes if n.op == "embd_rows"), 0)

    def attention_layers(self) -> dict[int, Node]:
        """Each layer's attention node (the layers that have a KV cache of their own: not
        those that read another layer's, ``kv_layer``)."""
        return {n.layer: n for n in self.nodes if n.op == "attention" and "kv_layer" not in n.attrs}


def rope_divisors(node: Node, factors: Any = None) -> Any:
    """The divisor of each frequency of a ``rope`` node, float64 ``[dim / 2]``: the angle
    of frequency i at position p is ``p * theta^(-2i/dim) / divisor_i``. That is the
    file's ``factors`` over ``freq_scale``, or with YaRN over ggml's blend
    ``freq_scale * (1 - r_i) + r_i``, where ``r_i = ext_factor * (1 - clamp((i - low) /
    max(0.001, high - low), 0, 1))`` (ggml's ``rope_yarn_ramp``): the fast frequencies keep
    their positions, the slow ones are scaled. Every backend's RoPE and the KV shift
    read their frequencies from here."""
    import numpy as np

    dim = int(node.attrs.get("n_rot", node.attr("head_dim")))
    half = dim // 2
    base = np.ones(half) if factors is None else np.asarray(factors, np.float64).reshape(half)
    fs = float(node.attr("freq_scale"))
    if "yarn" not in node.attrs:
        return base / fs
    ext, low, high = node.attr("yarn")
    i = np.arange(half, dtype=np.float64)
    ramp = (1.0 - np.clip((i - low) / max(0.001, high - low), 0.0, 1.0)) * ext
    return base / (fs * (1.0 - ramp) + ramp)


def yarn_corr_dims(n_dims: int, n_ctx_orig: int, theta: float, beta_fast: float, beta_slow: float) -> tuple[float, float]:
    """ggml's ``ggml_rope_yarn_corr_dims``: the frequency indices where YaRN's ramp starts
    and ends, from the rotations (``beta_fast``, ``beta_slow``) a frequency makes over
    the original context."""
    import math

    def dim(n_rot: float) -> float:
        return n_dims * math.log(n_ctx_orig / (n_rot * 2 * math.pi)) / (2 * math.log(theta))

    return max(0.0, float(math.floor(dim(beta_fast)))), min(n_dims - 1.0, float(math.ceil(dim(beta_slow))))


def _expect(ok: bool, name: str, problem: str) -> None:
    if not ok:
        raise GraphError(f"{name}: {problem}")

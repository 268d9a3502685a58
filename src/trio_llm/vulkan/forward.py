"""The graph of ``trio_llm.models`` lowered to recorded ops, for one shape bucket.

The batch of a step (every live token of every sequence, concatenated) runs as one
matrix: projections and the MLP are shared by all sequences, and only attention reads
per token which sequence (and so which part of the KV cache) it belongs to. A bucket
is the most tokens a graph serves; up to eight tokens the projections are
matrix-vector products that read each weight once for all tokens, beyond that tiled
matrix products. Only the rows whose logits are wanted (each entry's last token) go
through the output head, and only those logits are copied back to the host.

Lowering has three parts, none of which knows an architecture:

- ``plan_buffers``: one compute buffer ("slot") per live value, reused once a value is
  dead, in place where an op allows it (a residual add, a norm, RoPE); the plan is the
  same for every bucket, so all buckets' graphs share the buffers.
- pattern passes (``_fusions``) pick what today's decode kernels do in one dispatch:
  a q/k/v projection that rotates (adjacent-pair RoPE) and writes the KV cache in its
  epilogue (matvec ``ROPE_OUT``), gate + up + SwiGLU in one matvec (``GATE_UP``), and a
  projection that adds into the residual stream (``add``); and in decode buckets an
  RMSNorm read only by projections done by their matvecs (``NORM_IN``,
  ``TRIO_LLM_FUSE_NORM``); with ``TRIO_LLM_MATVEC_Q8=1`` the matvecs of decode buckets
  read int8 activations (``quantize_q8`` once per input, the norm before them in it:
  ``find_q8_norms``, ``q8_input``).
- emission walks the nodes in order; barriers are inserted only where a dispatch reads
  or writes what an earlier one since the last barrier wrote (or writes what one read),
  so independent projections (q, k, v; gate, up) share one.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import attrs
import numpy as np

from trio_llm.engine.memory import LayerMemory
from trio_llm.errors import GraphError
from trio_llm.graph import OUTPUTS, Graph, Node, Tensor, rope_divisors
from trio_llm.model.kvtypes import rotation_blocks
from trio_llm.vulkan.graph import Barrier, Copy, Op
from trio_llm.vulkan.kvcache import KVCache
from trio_llm.vulkan.memory import Allocator, Buffer, View, whole
from trio_llm.vulkan.ops import (
    COUNT_OUT,
    COUNT_TOKENS,
    ROPE_NEOX,
    ROPE_NONE,
    ROPE_NORMAL,
    Ops,
    attention_part_floats,
    decode_splits,
    moe_map_words,
    row_bytes,
    step_words,
)
from trio_llm.vulkan.recurrent import RecurrentState
from trio_llm.vulkan.shaders import Q8_MATVEC
from trio_llm.vulkan.weights import WeightStore

MATVEC_MAX_COLS = 8

#: ops whose output may take the buffer of their first input when that input dies there
_IN_PLACE = {"add", "scale", "mul", "softcap", "rms_norm", "rope", "glu", "embd_rows"}

#: token ids from here on in the step buffer are rows of the ``embd`` upload buffer
#: (``SeqBatch.embd``): id ``EMBD_ROW0 + i`` is row i, the step's token i; no piece of a
#: token matrix holds such a row, so the embedding lookup leaves it to ``embd_rows``
EMBD_ROW0 = 0x80000000


def embd_bytes(graph: Graph, cap: int) -> int:
    """Bytes of the ``embd`` upload buffer (a step's rows of ``SeqBatch.embd``): ``cap``
    rows of the graph's ``embd_rows`` width, none for a graph without it."""
    return 4 * cap * graph.embd_width()


def moe_map_bytes(graph: Graph, cap: int) -> int:
    """Bytes of the expert grouping map the prefill buckets' ``moe_group`` writes (one
    buffer, rewritten by every MoE layer): 0 when the graph has no experts or no bucket
    is a prefill bucket."""
    if cap <= MATVEC_MAX_COLS:
        return 0
    return max((4 * moe_map_words(int(n.inputs[1].shape[0]), n.attr("k"), cap)
                for n in graph.nodes if n.op == "moe_linear"), default=0)


def q8_scratch(graph: Graph, weights: WeightStore, ops: Ops) -> dict[str, tuple[int, str, str]]:
    """The buffers of the decode buckets' int8 activations (``Ops.matvec_q8``), for
    ``Activations.extra``: the int8 values ("q8x") and the (d, s) of each block of 32
    ("q8d") of ``MATVEC_MAX_COLS`` columns of the longest input a matvec of a
    ``Q8_MATVEC`` type reads; none when the option is off or no product qualifies.
    Every input is quantized into the same pair (``_Lowering.q8_input``)."""
    if not ops.matvec_q8 or ops.matvec_q8_min > MATVEC_MAX_COLS:
        return {}
    n = max((int(node.inputs[1].shape[1]) for node in graph.nodes
             if node.op == "linear" and weights.slots[node.inputs[1].name].qtype in Q8_MATVEC), default=0)
    if not n:
        return {}
    return {"q8x": (MATVEC_MAX_COLS * n, "compute", "device"),
            "q8d": (MATVEC_MAX_COLS * n // 32 * 8, "compute", "device")}


def dequant_scratch(graph: Graph, weights: WeightStore, ops: Ops, cap: int) -> dict[str, tuple[int, str, str]]:
    """The buffer ("wdq") into which the prefill buckets decode a weight piece to f16
    before its product (``Ops.matmul_dequant``), for ``Activations.extra``: the largest
    piece of a token-row product whose type qualifies at the largest bucket; none when
    nothing does. The products that make logits (output rows) are left alone: the head
    is the largest matrix and reads few rows."""
    if not ops.dequants_any(cap):
        return {}
    size = max((2 * (r1 - r0) * int(node.inputs[1].shape[1])
                for node in graph.nodes
                if node.op == "linear" and node.inputs[0].shape[0] != OUTPUTS
                and ops.dequants(weights.slots[node.inputs[1].name].qtype, cap)
                for r0, r1 in weights.piece_rows(node.inputs[1].name)), default=0)
    return {"wdq": (size, "compute", "device")} if size else {}


def x16_scratch(graph: Graph, ops: Ops, cap: int) -> dict[str, tuple[int, str, str]]:
    """The buffer ("xh") into which the prefill buckets convert a product's input to f16
    (``Ops.matmul_x16``), for ``Activations.extra``: ``cap`` rows of the widest
    token-row product input; none when the option is off, no kernel that reads f16
    activations runs here (matmul_nv2, matmul_cm2), or there is no prefill bucket."""
    dev = ops.kernels.device
    nv2 = ops.matmul_nv2 and ops.coopmat and dev.nv_coopmat2 and dev.nv_coopmat2_decode
    cm2 = ops.coopmat and ops.matmul_cm2 and ops.subgroup in (32, 64) and ops.matmul_cm2_variant is None
    if not ops.matmul_x16 or not (nv2 or cm2) or cap <= MATVEC_MAX_COLS:
        return {}
    n = max((int(node.inputs[1].shape[1]) for node in graph.nodes
             if node.op == "linear" and node.inputs[0].shape[0] != OUTPUTS), default=0)
    return {"xh": (2 * cap * n, "compute", "device")} if n else {}


@attrs.frozen
class Fusion:
    """Consecutive work of the graph that one dispatch does where a bucket's lowering
    allows it (``fusion_groups``; ``Ops.hybrid_fuse``). The buffer plan keeps the
    members' inputs alive up to the last member, and for a group emitted at its first
    member (``early``) gives every member's output its buffer from there on: so a
    fused dispatch, wherever in the group it runs, never overwrites a value still to be
    read, and the same plan serves the buckets that lower the group unfused."""

    kind: Literal["conv_split", "delta_gate", "delta_conv", "glu_in", "moe_out", "moe_down_out", "qk_rope",
                  "attn_gate", "into_reader"]
    nodes: tuple[int, ...]  # the members' output tensor ids, in node order
    early: bool  # emitted at the first member (else at the last)


def _only(cons: dict[int, list[Node]], t: Tensor) -> Node | None:
    readers = cons.get(t.id, [])
    return readers[0] if len(readers) == 1 else None


def conv_split_parts(node: Node, cons: dict[int, list[Node]]) -> tuple[list[tuple[Node, Node | None]], int, float] | None:
    """qwen35's conv output read only by three column-range takes that tile it, the
    ranges' heads of ``d`` channels L2-normed where a take's only reader is an
    ``l2_norm`` of groups of ``d``: ([(take, its l2_norm or None)], d, eps), or None."""
    c = node.out
    readers = cons.get(c.id, [])
    if len(readers) != 3 or any(r.op != "take" or r.attr("group") != c.width for r in readers):
        return None
    parts = sorted(readers, key=lambda r: r.attr("start"))
    end = 0
    for r in parts:
        if r.attr("start") != end:
            return None
        end += r.attr("n")
    if end != c.width:
        return None
    out: list[tuple[Node, Node | None]] = []
    heads: set[tuple[int, float]] = set()
    for r in parts:
        nrm = _only(cons, r.out)
        if nrm is not None and nrm.op == "l2_norm" and nrm.inputs[0] is r.out:
            heads.add((nrm.attr("group"), nrm.attr("eps")))
            out.append((r, nrm))
        else:
            out.append((r, None))
    if len(heads) != 1:
        return None
    ((d, eps),) = heads
    if any(r.attr("start") % d or r.attr("n") % d for r in parts):
        return None
    return out, d, eps


def _moe_out_members(node: Node, cons: dict[int, list[Node]], prod: dict[int, Node]) -> list[Node] | None:
    """A moe_combine's sum, then (qwen35moe) the add of the gated shared expert
    (``gate_rows`` read only by that add), then the residual add: the members, or None
    when the combine is not read by one add alone."""
    add = _only(cons, node.out)
    if add is None or add.op != "add" or any(t.kind != "value" or t.shape != node.out.shape for t in add.inputs):
        return None
    other = add.inputs[1] if add.inputs[0] is node.out else add.inputs[0]
    gate = prod.get(other.id)
    if gate is None or gate.op != "gate_rows" or _only(cons, gate.out) is not add:
        return [node, add]  # the residual add (qwen3moe)
    members = [node, gate, add]
    resid = _only(cons, add.out)
    if (resid is not None and resid.op == "add"
            and all(t.kind == "value" and t.shape == add.out.shape for t in resid.inputs)):
        members.append(resid)
    return members


def _glu_in(glu: Node, down: Node, cons: dict[int, list[Node]]) -> bool:
    """Whether ``glu`` is the experts' silu(gate) * up read only by their down product."""
    return (glu.op == "glu" and glu.attr("act") == "silu" and _only(cons, glu.out) is down
            and len(glu.out.shape) == 3 and all(t.kind == "value" for t in glu.inputs))


def _delta_conv_members(node: Node, cons: dict[int, list[Node]], prod: dict[int, Node]) -> list[Node] | None:
    """The conv and its split whose q, k (L2-normed in heads of the rule's d) and v are
    the delta rule's q, k, v, read by it alone: the members before the rule, or None."""
    q, k, v = node.inputs[:3]
    nq = prod.get(q.id)
    conv_node = None
    if nq is not None and nq.op == "l2_norm":
        take = prod.get(nq.inputs[0].id)
        if take is not None and take.op == "take":
            conv_node = prod.get(take.inputs[0].id)
    if conv_node is None or conv_node.op != "ssm_conv":
        return None
    split = conv_split_parts(conv_node, cons)
    if split is None:
        return None
    parts, d, _ = split
    d_rule, nk, nv = node.attr("head_dim"), node.attr("n_k_heads"), node.attr("n_v_heads")
    want = [(0, nk * d_rule, q, True), (nk * d_rule, nk * d_rule, k, True), (2 * nk * d_rule, nv * d_rule, v, False)]
    if d != d_rule:
        return None
    for (take, nrm), (start, n, t, normed) in zip(parts, want, strict=True):
        got = nrm.out if nrm is not None else take.out
        if (take.attr("start"), take.attr("n"), got, nrm is not None) != (start, n, t, normed):
            return None
        if _only(cons, got) is not node:
            return None
    return [conv_node, *(r for take, nrm in parts for r in (take, nrm) if r is not None)]


def _qk_rope_members(node: Node, cons: dict[int, list[Node]], prod: dict[int, Node]) -> list[Node] | None:
    """A rope of a per-head rms_norm read by it alone, with (qwen35's q) the take of
    the heads from their interleave with the gate before it: the members, or None.
    Partial RoPE only in the form the unfused lowering takes (neox, no factors, no
    position scaling)."""
    hd = node.attr("head_dim")
    if "n_rot" in node.attrs and (len(node.inputs) > 1 or node.attr("mode") != "neox"
                                  or node.attr("freq_scale") != 1.0):
        return None
    nrm = prod.get(node.inputs[0].id)
    if (nrm is None or nrm.op != "rms_norm" or _only(cons, nrm.out) is not node or nrm.attr("group") != hd
            or nrm.inputs[0].kind != "value"):
        return None
    take = prod.get(nrm.inputs[0].id)
    if take is not None and take.op == "take" and _only(cons, take.out) is nrm and take.attr("n") == hd:
        return [take, nrm, node]
    return [nrm, node]


def fusion_groups(graph: Graph) -> tuple[Fusion, ...]:
    """The graph's work that fused kernels can do (from its shape alone; which buckets
    lower each group fused is the lowering's choice, ``_Lowering.find_hybrid_fusions``):

    - ``conv_split``: ssm_conv -> three takes -> L2 norms of q and k (ssm_conv_split.comp);
    - ``delta_gate``: delta_net -> per-head rms_norm -> silu(z) * that (delta_net.comp's
      GATED_NORM), z computed before the delta rule;
    - ``glu_in``: the experts' silu(gate) * up read only by their down product
      (moe_matvec.comp's GLU_IN);
    - ``moe_out``: moe_combine -> + gated shared expert -> + residual (moe_combine.comp's
      SHEXP and RESID);
    - ``qk_rope``: (qwen35's take of q from its gate interleave ->) QK-norm -> RoPE (and
      the KV-cache write of k): qk_norm_rope.comp;
    - ``attn_gate``: qwen35's sigmoid(take of the gate) * attention: the decode
      attention's OUT_GATE (attn_decode.comp, attn_decode2.comp);
    - ``into_reader``: a linear read only by a rope, an attention (its v) or a glu,
      whose matvec the lowering may do where that reader is (ROPE_OUT, the v
      projection's cache write, GATE_UP: ``find_fusions``): its input must still be
      there then, which the order of the unfused plan gave only by luck of in-place
      buffers, and the level scheduler no longer does.
    """
    cons = graph.consumers()
    prod = graph.producers()
    index = {n.out.id: i for i, n in enumerate(graph.nodes)}
    out: list[Fusion] = []
    for node in graph.nodes:
        members: list[Node] | None = None
        early = False
        kind: Literal["conv_split", "delta_gate", "delta_conv", "glu_in", "moe_out", "moe_down_out", "qk_rope",
                  "attn_gate", "into_reader"]
        if node.op == "ssm_conv":
            kind, early = "conv_split", True
            split = conv_split_parts(node, cons)
            if split is not None:
                members = [node, *(r for take, nrm in split[0] for r in (take, nrm) if r is not None)]
        elif node.op == "delta_net":
            kind, early = "delta_gate", True
            nrm = _only(cons, node.out)
            glu = _only(cons, nrm.out) if nrm is not None else None
            if (nrm is not None and glu is not None and nrm.op == "rms_norm" and nrm.inputs[0] is node.out
                    and nrm.attr("group") == node.attr("head_dim") and glu.op == "glu" and glu.attr("act") == "silu"
                    and glu.inputs[1] is nrm.out and glu.inputs[0] is not nrm.out):
                z = glu.inputs[0]
                zp = prod.get(z.id)
                if z.kind == "value" and z.shape == node.out.shape and zp is not None and index[zp.out.id] < index[node.out.id]:
                    members = [node, nrm, glu]
            conv = _delta_conv_members(node, cons, prod)
            if conv is not None:  # the conv and its split too (and the gate's members where they fuse)
                whole = sorted([*conv, *(members or [node])], key=lambda n: index[n.out.id])
                ext = [t for m in whole for t in m.inputs if t.kind == "value" and t.id not in {n.out.id for n in whole}]
                if all(index[prod[t.id].out.id] < index[whole[0].out.id] for t in ext):
                    out.append(Fusion("delta_conv", tuple(n.out.id for n in whole), True))
        elif node.op == "moe_linear":
            kind = "glu_in"
            glu = prod.get(node.inputs[0].id)
            if glu is not None and _glu_in(glu, node, cons):
                members = [glu, node]
        elif node.op == "moe_combine":
            kind = "moe_out"
            members = _moe_out_members(node, cons, prod)
            down = prod.get(node.inputs[0].id)
            if (members is not None and down is not None and down.op == "moe_linear"
                    and _only(cons, down.out) is node and down.inputs[2] is node.inputs[1]):
                glu = prod.get(down.inputs[0].id)
                with_glu = [glu] if glu is not None and _glu_in(glu, down, cons) else []
                whole = sorted([*with_glu, down, *members], key=lambda n: index[n.out.id])
                out.append(Fusion("moe_down_out", tuple(n.out.id for n in whole), False))
        elif node.op == "rope":
            kind = "qk_rope"
            members = _qk_rope_members(node, cons, prod)
        elif node.op == "glu" and node.attr("act") == "sigmoid":
            kind = "attn_gate"
            gate, att = (prod.get(t.id) for t in node.inputs)
            if (gate is not None and att is not None and gate.op == "take" and att.op == "attention"
                    and _only(cons, gate.out) is node and _only(cons, att.out) is node
                    and gate.attr("n") == att.attr("head_dim") and node.inputs[0] is not node.inputs[1]):
                members = [gate, att, node]
        elif node.op == "linear":
            reader = _only(cons, node.out)
            if reader is not None and reader.op in ("rope", "attention", "glu"):
                kind, members = "into_reader", [node, reader]
        if members is not None:
            members.sort(key=lambda n: index[n.out.id])
            out.append(Fusion(kind, tuple(n.out.id for n in members), early))
    return tuple(out)


@attrs.frozen
class BufferPlan:
    """Which compute buffer holds each value: ``slot_of[tensor id]`` names a slot of
    ``slots`` (name -> (row kind "T" or "O", floats per row)); ``fusions`` the groups
    the plan made room for (``Fusion``)."""

    slot_of: dict[int, str]
    slots: dict[str, tuple[str, int]]
    fusions: tuple[Fusion, ...] = ()


def plan_buffers(graph: Graph, fusions: Sequence[Fusion] = ()) -> BufferPlan:
    """Greedy slot assignment over the node order, with liveness (a value's slot is free
    after its last reader), made safe for ``fusions`` (see ``Fusion``)."""
    last: dict[int, int] = {}
    for i, node in enumerate(graph.nodes):
        for t in node.inputs:
            last[t.id] = i
    assert graph.logits is not None
    last[graph.logits.id] = len(graph.nodes)
    index = {n.out.id: i for i, n in enumerate(graph.nodes)}
    early: dict[int, list[Tensor]] = {}  # node index -> outputs given their buffers there
    for f in fusions:
        idx = sorted(index[t] for t in f.nodes)
        members = set(f.nodes)
        for i in idx:
            for t in graph.nodes[i].inputs:
                if t.kind == "value" and t.id not in members:
                    last[t.id] = max(last.get(t.id, -1), idx[-1])
        if f.early:
            early.setdefault(idx[0], []).extend(graph.nodes[i].out for i in idx)
    # values die at their last reader, or at the end of a fusion group that reads them
    # (which need not list them among its last member's inputs)
    ends: dict[int, list[int]] = {}
    for tid, i in last.items():
        ends.setdefault(i, []).append(tid)
    slot_of: dict[int, str] = {}
    slots: dict[str, tuple[str, int]] = {}
    free: dict[tuple[str, int], list[str]] = {}

    def key_of(t: Tensor) -> tuple[str, int]:
        return ("O" if t.shape[0] == OUTPUTS else "T", t.width)

    def take(key: tuple[str, int]) -> str:
        pool = free.get(key)
        if pool:
            return pool.pop()
        name = f"s{len(slots)}"
        slots[name] = key
        return name

    for i, node in enumerate(graph.nodes):
        for t in early.get(i, []):
            if t.id not in slot_of:
                slot_of[t.id] = take(key_of(t))
        out = node.out
        key = key_of(out)
        first = node.inputs[0] if node.inputs else None
        if out.id in slot_of:  # given its buffer early (a fusion group's output)
            pass
        elif (node.op in _IN_PLACE and first is not None and first.kind == "value"
                and last.get(first.id) == i and first.shape == out.shape):
            slot_of[out.id] = slot_of[first.id]
        else:
            slot_of[out.id] = take(key)
        # every value whose life ends here, read by this node or kept for its fusion group
        # (the output's own slot stays: an in-place input's slot is now the output's)
        freed: set[str] = {slot_of[out.id]}
        for tid in ends.get(i, ()):
            s = slot_of.get(tid)
            if s is not None and s not in freed:
                freed.add(s)
                free.setdefault(slots[s], []).append(s)
        if out.id not in last:  # never read: free at once
            free.setdefault(key, []).append(slot_of[out.id])
    return BufferPlan(slot_of, slots, tuple(fusions))


@attrs.define(eq=False)
class Activations:
    """Compute buffers for up to ``cap`` tokens and ``out_cap`` output rows (the plan's
    slots), small constant arrays (RoPE frequency divisors), the step buffer and the
    logits readback (the "scratch" category)."""

    alloc: Allocator
    plan: BufferPlan
    n_vocab: int
    cap: int
    out_cap: int
    consts: dict[str, np.ndarray]  # name -> float32 values
    bufs: dict[str, Buffer] = attrs.field(factory=dict)
    #: more buffers allocated and freed with these: name -> (bytes, category, place)
    extra: dict[str, tuple[int, str, str]] = attrs.field(factory=dict)

    def allocate(self) -> None:
        if self.bufs:
            return
        try:
            for name, (kind, width) in self.plan.slots.items():
                rows = self.out_cap if kind == "O" else self.cap
                self.bufs[name] = self.alloc.create(4 * rows * width, "compute", "device")
            for name, values in self.consts.items():
                self.bufs[name] = self.alloc.create(4 * max(1, values.size), "compute", "device")
            self.bufs["step"] = self.alloc.create(4 * step_words(self.cap), "scratch", "upload")
            self.bufs["readback"] = self.alloc.create(4 * self.out_cap * self.n_vocab, "scratch", "readback")
            for name, (nbytes, category, place) in self.extra.items():
                self.bufs[name] = self.alloc.create(nbytes, category, place)
            if not self.alloc.planning:
                self._upload_consts()
        except BaseException:
            self.free()
            raise

    def _upload_consts(self) -> None:
        device = self.alloc.device
        vk = device.vk
        step = self.bufs["step"]
        assert step.array is not None
        for name, values in self.consts.items():
            data = values.astype(np.float32).view(np.uint8)
            # borrow the step buffer as staging: nothing reads it until the next forward;
            # a constant larger than it (a small bucket's step buffer against a 512-wide
            # head's RoPE factors) goes in pieces
            for at in range(0, data.nbytes, step.array.size):
                piece = data[at : at + step.array.size]
                step.array[: piece.nbytes] = piece
                with device.one_shot(f"upload {name}") as cmd:
                    region = vk.VkBufferCopy(srcOffset=0, dstOffset=at, size=piece.nbytes)
                    vk.vkCmdCopyBuffer(cmd, step.handle, self.bufs[name].handle, 1, [region])

    def free(self) -> None:
        for buf in self.bufs.values():
            self.alloc.free(buf)
        self.bufs = {}

    def view(self, name: str) -> View:
        return whole(self.bufs[name])

    @property
    def step_words(self) -> np.ndarray:
        arr = self.bufs["step"].array
        assert arr is not None
        return arr.view(np.uint32)

    def logits(self, n_out: int) -> np.ndarray:
        arr = self.bufs["readback"].array
        assert arr is not None
        n = n_out * self.n_vocab
        # a view: the caller copies it once into its result before the next step
        return arr[: 4 * n].view(np.float32).reshape(n_out, self.n_vocab)  # [n_out, n_vocab]


def head_routes(graph: Graph) -> dict[str, np.ndarray]:
    """``head_linear``'s fixed routing, one row read by every token (``moe_matvec`` with
    a routing stride of 0): head h is expert h, weight 1. Named ``heads<n>``."""
    out: dict[str, np.ndarray] = {}
    for node in graph.nodes:
        if node.op == "head_linear":
            nh = int(node.attr("n_head"))
            out[f"heads{nh}"] = np.concatenate([np.arange(nh), np.ones(nh)]).astype(np.float32)
    return out


def norm_consts(graph: Graph) -> dict[str, np.ndarray]:
    """The weight an ``rms_norm`` without one reads: ones of its group, ``ones<n>``."""
    return {f"ones{n.attr('group')}": np.ones(n.attr("group"), np.float32)
            for n in graph.nodes if n.op == "rms_norm" and len(n.inputs) == 1}


def rope_consts(graph: Graph, factors: dict[str, np.ndarray]) -> tuple[dict[int, str], dict[str, np.ndarray]]:
    """The divisor array each RoPE node reads (the file's factors over ``freq_scale``),
    one buffer per distinct array: rope node id -> buffer name, and the arrays."""
    names: dict[int, str] = {}
    arrays: dict[str, np.ndarray] = {}
    by_bytes: dict[bytes, str] = {}
    for node in graph.nodes:
        if node.op != "rope":
            continue
        half = node.attr("head_dim") // 2
        base = factors[node.inputs[1].name] if len(node.inputs) > 1 else np.ones(half, np.float32)
        if "yarn" in node.attrs:  # YaRN's per-frequency blend (full RoPE only: Graph.rope)
            arr = rope_divisors(node, base).astype(np.float32)
        else:
            arr = (base.astype(np.float64) / node.attr("freq_scale")).astype(np.float32)
        key = arr.tobytes()
        if key not in by_bytes:
            by_bytes[key] = f"rope{len(by_bytes)}"
            arrays[by_bytes[key]] = arr
        names[node.out.id] = by_bytes[key]
    return names, arrays


@attrs.define(eq=False)
class _Lowering:
    """One bucket's emission; see the module docstring."""

    ops: Ops
    graph: Graph
    plan: BufferPlan
    weights: WeightStore
    act: Activations
    kv: KVCache
    mem: dict[int, tuple[int, LayerMemory]]  # layer -> (index in kv, plan)
    rope_buf: dict[int, str]
    bucket: int
    rs: RecurrentState | None = None  # gated delta-net state buffers, by node id
    #: a graph for steps with embedding rows (``embd_rows`` copies them from the upload
    #: buffer) / with a non-causal entry (attention by attn_prefill's NONCAUSAL form)
    embd: bool = False
    noncausal: bool = False
    out: list[Op] = attrs.field(factory=list)
    _dirty: set[object] = attrs.field(factory=set)
    _read: set[object] = attrs.field(factory=set)
    _prod: dict[int, Node] = attrs.field(factory=dict)
    _cons: dict[int, list[Node]] = attrs.field(factory=dict)
    # fusions: node out id -> what it became
    _absorbed: set[int] = attrs.field(factory=set)
    _rope_out: dict[int, Node] = attrs.field(factory=dict)  # rope id -> its linear (matvec ROPE_OUT)
    _to_cache: set[int] = attrs.field(factory=set)  # rope ids that write the KV cache
    _v_out: dict[int, Node] = attrs.field(factory=dict)  # attention id -> the v linear writing the cache
    _gate_up: dict[int, tuple[Node, Node, tuple[View, int, int]]] = attrs.field(factory=dict)
    _add_into: dict[int, Node] = attrs.field(factory=dict)  # linear id -> the add it accumulates for
    _norm_in: dict[int, Node] = attrs.field(factory=dict)  # linear id -> the rms_norm its matvec does
    _norm_q8: dict[int, Node] = attrs.field(factory=dict)  # linear id -> the rms_norm its quantize does
    _grouped: int = -1  # the routing whose grouping the moe map holds now
    _q8_holds: int = -1  # the value whose int8 form the q8 scratch holds now
    _xh_holds: int = -1  # the value whose f16 form the xh scratch holds now (Ops.matmul_x16)
    _hyb: dict[int, Fusion] = attrs.field(factory=dict)  # the node that lowers a fused group -> the group
    # the level scheduler (Ops.hybrid_fuse): dispatches by barrier level, and per hazard
    # key the level of its last writer and the highest level that reads it
    _levels: list[list[Op]] = attrs.field(factory=list)
    _wlev: dict[object, int] = attrs.field(factory=dict)
    _rlev: dict[object, int] = attrs.field(factory=dict)
    _floor: int = 0

    @property
    def decode(self) -> bool:
        return self.bucket <= MATVEC_MAX_COLS

    # -- helpers ----------------------------------------------------------------------

    def emit(self, dispatches: Sequence[Op], reads: Sequence[object], writes: Sequence[object]) -> None:
        """Dispatches that may run together (they write disjoint parts), after a
        barrier if they touch what the ops since the last barrier wrote; with
        ``Ops.hybrid_fuse``, at the first barrier level after every level that wrote
        what they touch or read what they write (so independent work of later nodes
        joins an earlier level; a copy gets a level of its own, last)."""
        if self.ops.hybrid_fuse:
            lvl = self._floor
            for k in reads:
                lvl = max(lvl, self._wlev.get(k, -1) + 1)
            for k in writes:
                lvl = max(lvl, self._wlev.get(k, -1) + 1, self._rlev.get(k, -1) + 1)
            if any(isinstance(d, Copy) for d in dispatches):
                lvl = max(lvl, len(self._levels))
                self._floor = lvl + 1
            while len(self._levels) <= lvl:
                self._levels.append([])
            self._levels[lvl].extend(dispatches)
            for k in reads:
                self._rlev[k] = max(self._rlev.get(k, -1), lvl)
            for k in writes:
                self._wlev[k] = lvl
            return
        touched = set(reads) | set(writes)
        if touched & self._dirty or set(writes) & self._read:
            self.out.append(Barrier())
            self._dirty.clear()
            self._read.clear()
        self.out.extend(dispatches)
        self._dirty |= set(writes)
        self._read |= set(reads)

    def slot(self, t: Tensor) -> str:
        return self.plan.slot_of[t.id]

    def view(self, t: Tensor) -> View:
        if t.kind == "weight":
            return self.weights.view(t.name)
        return self.act.view(self.slot(t))

    def rows(self, t: Tensor) -> tuple[int, int]:
        """(count selector, capacity) of a value's rows."""
        if t.shape[0] == OUTPUTS:
            return COUNT_OUT, min(self.bucket, self.act.out_cap)
        return COUNT_TOKENS, self.bucket

    def cache(self, layer: int) -> tuple[View, View, LayerMemory]:
        i, m = self.mem[layer]
        return self.kv.k_view(i), self.kv.v_view(i), m

    @staticmethod
    def kv_layer(node: Node) -> int:
        """The layer whose cache an attention reads: its own, or (a shared-KV layer's,
        ``kv_layer``) the earlier layer's."""
        return int(node.attrs.get("kv_layer", node.layer))

    def rotation(self, node: Node) -> tuple[int, int]:
        """llama.cpp's Hadamard blocks (K, V) around this attention's quantized cache
        (none for a latent cache, ``v_is_k``), each cache's own: its types and heads."""
        if node.attrs.get("v_is_k"):
            return 0, 0
        return rotation_blocks(*self.types(self.kv_layer(node)), node.attr("head_dim"))

    def types(self, layer: int) -> tuple[str, str]:
        """The (K, V) cache types of ``layer``."""
        lay = self.kv.layers[self.mem[layer][0]]
        return lay.k_type, lay.v_type

    def single(self, w: Tensor) -> bool:
        return len(self.weights.pieces(w.name)) == 1

    def only_reader(self, t: Tensor, node: Node) -> bool:
        return [n.out.id for n in self._cons.get(t.id, [])] == [node.out.id]

    def linear_of(self, t: Tensor) -> Node | None:
        p = self._prod.get(t.id)
        return p if p is not None and p.op == "linear" else None

    # -- fusion passes ---------------------------------------------------------------

    def find_fusions(self) -> None:
        self._prod = self.graph.producers()
        self._cons = self.graph.consumers()
        pair_rows = self.ops.matvec_rs % 2 == 0
        for node in self.graph.nodes:
            if node.op == "rope" and "n_rot" in node.attrs:
                continue  # partial RoPE rotates in place; its k is stored as a plain value
            if node.op == "rope":
                lin = self.linear_of(node.inputs[0])
                readers = self._cons.get(node.out.id, [])
                if len(readers) == 1 and readers[0].op == "attention" and readers[0].inputs[1:2] == (node.out,) \
                        and readers[0].inputs[0] is not node.out and not self.rotation(readers[0])[0]:
                    self._to_cache.add(node.out.id)
                if (self.decode and pair_rows and node.attr("mode") == "normal" and lin is not None
                        and self.only_reader(lin.out, node) and self.single(lin.inputs[1])):
                    self._rope_out[node.out.id] = lin
                    self._absorbed.add(lin.out.id)
            elif node.op == "attention" and len(node.inputs) == 3:  # one that stores its v
                lin = self.linear_of(node.inputs[2])
                if (self.decode and pair_rows and lin is not None and self.only_reader(lin.out, node)
                        and self.single(lin.inputs[1]) and lin.inputs[1].shape[0] % 2 == 0
                        and not self.rotation(node)[1]):
                    self._v_out[node.out.id] = lin
                    self._absorbed.add(lin.out.id)
            elif node.op == "glu" and self.decode and node.attr("act") == "silu":
                lg, lu = self.linear_of(node.inputs[0]), self.linear_of(node.inputs[1])
                if (lg is not None and lu is not None and lg.inputs[0] is lu.inputs[0]
                        and self.only_reader(lg.out, node) and self.only_reader(lu.out, node)):
                    both = self.gate_up_view(lg.inputs[1].name, lu.inputs[1].name)
                    if both is not None:
                        self._gate_up[node.out.id] = (lg, lu, both)
                        self._absorbed |= {lg.out.id, lu.out.id}
            elif node.op == "add":
                for res, other in ((node.inputs[0], node.inputs[1]), (node.inputs[1], node.inputs[0])):
                    lin = self.linear_of(other)
                    if (lin is not None and res.kind == "value" and self.slot(res) == self.slot(node.out)
                            and self.only_reader(lin.out, node) and lin.out.id not in self._absorbed):
                        self._add_into[lin.out.id] = node
                        self._absorbed.add(node.out.id)
                        break
        if self.ops.hybrid_fuse:
            self.find_hybrid_fusions()
        if self.decode and self.ops.fuse_norm:
            self.find_norm_fusions()
        if "q8x" in self.act.bufs:
            self.find_q8_norms()

    def find_hybrid_fusions(self) -> None:
        """The plan's fusion groups this bucket lowers fused, the larger first and each
        node in one group at most, less ``Ops.hybrid_off``'s kinds: the delta rule's
        (delta_conv, delta_gate) where it is delta_net.comp (not the chunked prefill
        form, which takes conv_split), the experts' down product's (moe_down_out,
        glu_in) where it is moe_matvec (not the grouped prefill form, whose combine is
        moe_out), the attention's gate where attention is attention_decode with an
        unrotated V cache, QK-norm with RoPE everywhere; norm and gate weights f32."""
        f32 = lambda t: self.weights.slots[t.name].qtype == "F32"  # noqa: E731
        taken: set[int] = set()
        # the larger groups first: the delta rule with its conv before the conv alone and
        # the gated norm alone, the experts' down product with the FFN's end before either
        for f in sorted(self.plan.fusions, key=lambda f: f.kind not in ("delta_conv", "moe_down_out")):
            nodes = [self._prod[i] for i in f.nodes]
            if (f.kind == "into_reader" or f.kind in self.ops.hybrid_off or taken & set(f.nodes)
                    or any(n.out.id in self._absorbed for n in nodes)):
                continue  # into_reader: find_fusions' own (the plan only makes room)
            if f.kind == "delta_conv" and not self.decode:
                # decode buckets only: the H200 ran qwen35-0.8b's pp512 at 11,252 tok/s with
                # every group fused, 15,856 with delta_conv (and moe_down_out, attn_gate) off,
                # 16,669 unfused (2026-12-01 late); its parts (conv_split, delta_gate) fuse
                continue
            if f.kind == "delta_conv" and (self.chunked or not f32(nodes[0].inputs[1])
                                           or any(n.op == "rms_norm" and not f32(n.inputs[1]) for n in nodes)):
                continue
            if f.kind == "conv_split" and not f32(nodes[0].inputs[1]):
                continue
            if f.kind == "delta_gate" and (self.chunked or not f32(nodes[1].inputs[1])):
                continue
            if f.kind == "glu_in" and self.moe_grouped(nodes[-1]):
                continue
            if f.kind == "moe_down_out" and self.moe_grouped(next(n for n in nodes if n.op == "moe_linear")):
                continue
            if f.kind in ("moe_out", "moe_down_out") and any(n.op == "gate_rows" and not f32(n.inputs[2]) for n in nodes):
                continue
            if f.kind == "attn_gate":
                att = nodes[1] if nodes[1].op == "attention" else nodes[0]
                if not self.decode_split or self.rotation(att)[1]:
                    continue
            if f.kind == "qk_rope":
                if not f32(nodes[-2].inputs[1]):
                    continue
                rope = nodes[-1]
                readers = self._cons.get(rope.out.id, [])
                if ("n_rot" in rope.attrs and len(readers) == 1 and readers[0].op == "attention"
                        and readers[0].inputs[1:2] == (rope.out,) and readers[0].inputs[0] is not rope.out
                        and not self.rotation(readers[0])[0]):
                    self._to_cache.add(rope.out.id)  # the partial RoPE of k stores it too
            head = nodes[0] if f.early else nodes[-1]
            self._hyb[head.out.id] = f
            self._absorbed |= {n.out.id for n in nodes if n is not head}
            taken |= set(f.nodes)

    @property
    def decode_split(self) -> bool:
        """Whether attention runs as ``attention_decode`` here (flash-decoding)."""
        return self.decode and self.kv.part is not None and self.kv.counters is not None

    @property
    def chunked(self) -> bool:
        """Whether the delta rule runs in its chunked prefill form here."""
        return not self.decode and self.rs is not None and bool(self.rs.work)

    def moe_grouped(self, node: Node) -> bool:
        """Whether this expert product runs grouped by expert (moe_group + moe_matmul)."""
        n_expert = int(node.inputs[1].shape[0])
        return (not self.decode and self.ops.moe_grouped and "moe_map" in self.act.bufs
                and self.bucket * node.attr("k") >= self.ops.moe_grouped_min * n_expert)

    def find_norm_fusions(self) -> None:
        """An RMSNorm read only by projections goes into their matvecs (NORM_IN): each
        normalizes the norm's input as it loads it, and the rms_norm dispatch (a stage
        of the decode chain) is dropped. Only whole-row norms with an f32 weight, when
        every reader is a linear (matvec, ROPE_OUT or GATE_UP, wherever it is lowered)
        and nothing from the norm up to the last of those matvecs writes the buffer of
        the norm's input, which they now read instead of the norm's output. A norm read
        by anything else (MoE experts, the shared-expert gate, a residual add, an
        embedding's result) stays a dispatch."""
        for node, readers in self.foldable_norms():
            for r in readers:
                self._norm_in[r.out.id] = node
            self._absorbed.add(node.out.id)

    def foldable_norms(self) -> list[tuple[Node, list[Node]]]:
        """The whole-row RMSNorms (f32 weight, not yet folded) read only by linears,
        whose input's buffer nothing writes from the norm up to the last of them (where
        it is lowered: ROPE_OUT at its rope, GATE_UP at its glu), with those readers."""
        index = {n.out.id: i for i, n in enumerate(self.graph.nodes)}
        at: dict[int, int] = {}  # linear id -> the index of the node that lowers it
        for rid, lin in (*self._rope_out.items(), *self._v_out.items()):
            at[lin.out.id] = index[rid]
        for gid, (lg, lu, _) in self._gate_up.items():
            at[lg.out.id] = at[lu.out.id] = index[gid]
        logits = self.graph.logits
        out: list[tuple[Node, list[Node]]] = []
        for i, node in enumerate(self.graph.nodes):
            if node.op != "rms_norm" or len(node.inputs) != 2 or node.out is logits or node.out.id in self._absorbed:
                continue
            x, w = node.inputs
            readers = self._cons.get(node.out.id, [])
            if (not readers or x.kind != "value" or node.attr("group") != x.width
                    or self.weights.slots[w.name].qtype != "F32"
                    or any(r.op != "linear" or r.inputs[0] is not node.out for r in readers)):
                continue
            last = max(at.get(r.out.id, index[r.out.id]) for r in readers)
            written = {self.slot(n.out) for n in self.graph.nodes[i + 1 : last + 1]}
            written |= {self.slot(self._add_into[r.out.id].out) for r in readers if r.out.id in self._add_into}
            if self.slot(x) in written:
                continue
            out.append((node, readers))
        return out

    def find_q8_norms(self) -> None:
        """An RMSNorm read only by products on int8 activations goes into their
        quantize (quantize_q8.comp's NORM_IN): the norm's dispatch is dropped and the
        quantize of its output takes its stage, so those products cost no stage more
        than on f32 (``foldable_norms``' conditions, NORM_IN's)."""
        for node, readers in self.foldable_norms():
            if all(self.q8_reads(r) for r in readers):
                for r in readers:
                    self._norm_q8[r.out.id] = node
                self._absorbed.add(node.out.id)

    def q8_reads(self, lin: Node) -> bool:
        """Whether a linear's matvec reads int8 activations (``Ops.matvec_q8``)."""
        w = lin.inputs[1]
        _, cap = self.rows(lin.inputs[0])
        return ("q8x" in self.act.bufs and self.ops.q8_ok(self.weights.slots[w.name].qtype, cap)
                and lin.inputs[0].width == int(w.shape[1]))

    def matvec_in(self, lin: Node) -> tuple[Tensor, dict[str, object]]:
        """What a linear's matvec reads: its input, or (NORM_IN) the input of the norm
        it does itself, with the norm's weight and epsilon; or (``Ops.matvec_q8``) the
        q8 scratch with that input's int8 form, quantized there first if it is not
        (the scales' view then comes as ``xd``)."""
        qnorm = self._norm_q8.get(lin.out.id)
        if qnorm is not None:  # the norm done by the quantize (quantize_q8 NORM_IN)
            self.q8_input(qnorm.inputs[0], qnorm)
            return qnorm.inputs[0], {"xd": self.act.view("q8d")}
        norm = self._norm_in.get(lin.out.id)
        if norm is None:
            x = lin.inputs[0]
            if self.q8_reads(lin):
                self.q8_input(x)
                return x, {"xd": self.act.view("q8d")}
            return x, {}
        x, w = norm.inputs
        return x, {"norm": self.weights.view(w.name), "eps": norm.attr("eps")}

    def q8_input(self, x: Tensor, norm: Node | None = None) -> None:
        """quantize_q8 of value ``x`` (with ``norm``: of that RMSNorm of x) into the q8
        scratch, unless it holds that already (q, k and v, or gate and up, read one
        quantization): a dispatch stage after x is written and after the last matvec
        that read the scratch's former value."""
        key = x.id if norm is None else norm.out.id
        if self._q8_holds == key:
            return
        sel, cap = self.rows(x)
        nkw: dict[str, object] = {}
        if norm is not None:
            nkw = {"norm": self.weights.view(norm.inputs[1].name), "eps": norm.attr("eps")}
        d = self.ops.quantize_q8(self.view(x), self.act.view("q8x"), self.act.view("q8d"), self.st,
                                 n_in=x.width, x_stride=x.width, cap=cap, count_sel=sel,
                                 **nkw)  # type: ignore[arg-type]
        self.emit([d], [self.slot(x)], ["q8"])
        self._q8_holds = key

    def matvec_reads(self, x: Tensor, nkw: dict[str, object]) -> list[object]:
        """The hazard keys a matvec reading ``x`` as ``matvec_in`` gave it touches."""
        return ["q8"] if "xd" in nkw else [self.slot(x)]

    def matvec_x(self, x: Tensor, nkw: dict[str, object]) -> View:
        """The view bound as a matvec's x: the value, or its int8 form."""
        return self.act.view("q8x") if "xd" in nkw else self.view(x)

    def gate_up_view(self, gate: str, up: str) -> tuple[View, int, int] | None:
        """One view over both FFN matrices and the row where each starts in it, when a
        GATE_UP dispatch can read them: same type and segment, whole rows apart, within
        one binding, and a subgroup's two rows are the pair (rows per subgroup 2)."""
        weights = self.weights
        sg, su = weights.slots[gate], weights.slots[up]
        if sg.qtype != su.qtype or sg.segment != su.segment or sg.shape != su.shape or self.ops.matvec_rs != 2:
            return None
        rb = row_bytes(sg.qtype, sg.shape[-1])
        start = min(sg.offset, su.offset)
        end = max(sg.offset + sg.nbytes, su.offset + su.nbytes)
        if (sg.offset - start) % rb or (su.offset - start) % rb:
            return None
        if end - start > weights.alloc.device.limits.max_storage_buffer_range:
            return None
        seg = weights.segments[sg.segment].device
        assert seg is not None
        return View(seg, start, end - start), (sg.offset - start) // rb, (su.offset - start) // rb

    # -- emission ---------------------------------------------------------------------

    def run(self) -> list[Op]:
        self.find_fusions()
        for node in self.graph.nodes:
            if node.out.id in self._absorbed:
                continue
            fused = self._hyb.get(node.out.id)
            if fused is not None:
                getattr(self, "fuse_" + fused.kind)(node, [self._prod[i] for i in fused.nodes])
                continue
            lower = getattr(self, "op_" + node.op, None)
            if lower is None:
                raise GraphError(f"{node.out.name}: the Vulkan backend has no op {node.op!r}")
            lower(node)
        logits = self.graph.logits
        assert logits is not None
        n_bytes = 4 * min(self.bucket, self.act.out_cap) * self.graph.logits.width  # type: ignore[union-attr]
        self.emit([Copy(self.view(logits).sub(0, n_bytes), self.act.view("readback").sub(0, n_bytes))],
                  [self.slot(logits)], ["readback"])
        if self.ops.hybrid_fuse:
            for i, level in enumerate(self._levels):
                if i:
                    self.out.append(Barrier())
                self.out.extend(level)
        return self.out

    def op_get_rows(self, node: Node) -> None:
        w, _ = node.inputs
        qtype = self.weights.slots[w.name].qtype
        y = self.view(node.out)
        n_in = int(w.shape[1])
        ds: list[Op] = [self.ops.get_rows(qtype, piece, y, self.st, n_in=n_in, y_stride=n_in, cap=self.bucket,
                                          row0=r0, row1=r1)
                        for piece, r0, r1 in self.weights.pieces(w.name)]
        self.emit(ds, [], [self.slot(node.out)])

    def op_embd_rows(self, node: Node) -> None:
        """The rows of a step's embedding entries copied, exactly, from the upload buffer
        (``get_rows`` of F32 rows over the ids from ``EMBD_ROW0``); nothing in the graph
        of a step without them (the value stays where the op before left it)."""
        (x,) = node.inputs
        n = x.width
        if self.slot(x) != self.slot(node.out):
            d = self.ops.scale(self.view(x), self.view(node.out), self.st, n=n, stride=n, cap=self.bucket,
                               scale=1.0, count_sel=COUNT_TOKENS)
            self.emit([d], [self.slot(x)], [self.slot(node.out)])
        if not self.embd:
            return
        d = self.ops.get_rows("F32", self.act.view("embd"), self.view(node.out), self.st, n_in=n, y_stride=n,
                              cap=self.bucket, row0=EMBD_ROW0)
        self.emit([d], ["embd"], [self.slot(node.out)])

    def op_outputs(self, node: Node) -> None:
        (x,) = node.inputs
        _, cap = self.rows(node.out)
        d = self.ops.get_rows("F32", self.view(x), self.view(node.out), self.st, n_in=x.width, y_stride=x.width,
                              cap=cap, id_sel=COUNT_OUT)
        self.emit([d], [self.slot(x)], [self.slot(node.out)])

    def op_linear(self, node: Node) -> None:
        x, nkw = self.matvec_in(node)
        w = node.inputs[1]
        add_node = self._add_into.get(node.out.id)
        target = node.out if add_node is None else add_node.out
        sel, cap = self.rows(x)
        n_in, n_out = int(w.shape[1]), int(w.shape[0])
        qtype = self.weights.slots[w.name].qtype
        y = self.view(target)
        ds: list[Op] = []
        if sel == COUNT_TOKENS and self.ops.dequants(qtype, cap) and "wdq" in self.act.bufs:
            # each piece to f16 rows, then its product on those (Ops.matmul_dequant)
            wdq = self.act.view("wdq")
            for piece, r0, r1 in self.weights.pieces(w.name):
                xh = self.x16_input(x, "F16", r1 - r0, cap, r0, n_out, sel)
                self.emit([self.ops.dequant_f16(qtype, piece, wdq, n_in=n_in, n_rows=r1 - r0)], [], ["wdq"])
                self.emit([self.ops.matmul("F16", wdq, self.view(x), y, self.st, n_in=n_in, n_rows=r1 - r0,
                                           x_stride=n_in, y_stride=n_out, cap=cap, y_off=r0, count_sel=sel,
                                           add=add_node is not None, xh=xh)],
                          [self.slot(x), "wdq"] + (["xh"] if xh is not None else [])
                          + ([self.slot(target)] if add_node is not None else []),
                          [self.slot(target)])
            return
        x16 = False
        for piece, r0, r1 in self.weights.pieces(w.name):
            if cap <= MATVEC_MAX_COLS:
                for c0, mc in self.ops.col_split(cap, x_stride=n_in, y_stride=n_out, x8="xd" in nkw):
                    ds.append(self.ops.matvec(qtype, piece, self.matvec_x(x, nkw), y, self.st, n_in=n_in,
                                              n_rows=r1 - r0, x_stride=n_in, y_stride=n_out, y_off=r0, count_sel=sel,
                                              add=add_node is not None, maxc=mc, col0=c0, **nkw))  # type: ignore[arg-type]
            else:
                xh = self.x16_input(x, qtype, r1 - r0, cap, r0, n_out, sel)
                x16 |= xh is not None
                ds.append(self.ops.matmul(qtype, piece, self.view(x), y, self.st, n_in=n_in, n_rows=r1 - r0,
                                          x_stride=n_in, y_stride=n_out, cap=cap, y_off=r0, count_sel=sel,
                                          add=add_node is not None, xh=xh))
        reads = (self.matvec_reads(x, nkw) + (["xh"] if x16 else [])
                 + ([self.slot(target)] if add_node is not None else []))
        self.emit(ds, reads, [self.slot(target)])

    def x16_input(self, x: Tensor, qtype: str, n_rows: int, cap: int, y_off: int, y_stride: int,
                  sel: int) -> View | None:
        """The xh scratch holding x's live rows in f16 for a product that reads them so
        (``Ops.x16_plan``), converted (``to_f16``) when it holds another value; None for a
        product that reads x itself."""
        if "xh" not in self.act.bufs or not self.ops.x16_plan(qtype, n_rows, cap, y_off=y_off, y_stride=y_stride):
            return None
        if self._xh_holds != x.id:
            n_in = x.width
            self.emit([self.ops.to_f16(self.view(x), self.act.view("xh"), self.st, n_in=n_in, x_stride=n_in,
                                       cap=cap, count_sel=sel)], [self.slot(x)], ["xh"])
            self._xh_holds = x.id
        return self.act.view("xh")

    def op_add(self, node: Node) -> None:
        a, b = node.inputs
        sel, cap = self.rows(node.out)
        if a.kind != "value":
            raise GraphError(f"{node.out.name}: the Vulkan add needs a computed first operand")
        n = node.out.width
        d = self.ops.add(self.view(a), self.view(b), self.view(node.out), self.st, n=n, stride=n, cap=cap,
                         bcast=b.kind == "weight", count_sel=sel)
        reads = [self.slot(a)] + ([self.slot(b)] if b.kind == "value" else [])
        self.emit([d], reads, [self.slot(node.out)])

    def op_scale(self, node: Node) -> None:
        (x,) = node.inputs
        sel, cap = self.rows(node.out)
        n = node.out.width
        d = self.ops.scale(self.view(x), self.view(node.out), self.st, n=n, stride=n, cap=cap,
                           scale=node.attr("scale"), count_sel=sel)
        self.emit([d], [self.slot(x)], [self.slot(node.out)])

    def op_mul(self, node: Node) -> None:
        """``x`` times a one-value weight: read at build time, lowered as ``scale``."""
        x, w = node.inputs
        s = float(np.asarray(self.weights.model.tensor(w.name).dequantize(), np.float32).reshape(-1)[0])
        sel, cap = self.rows(node.out)
        n = node.out.width
        d = self.ops.scale(self.view(x), self.view(node.out), self.st, n=n, stride=n, cap=cap, scale=s, count_sel=sel)
        self.emit([d], [self.slot(x)], [self.slot(node.out)])

    def op_softcap(self, node: Node) -> None:
        (x,) = node.inputs
        sel, cap = self.rows(node.out)
        n = node.out.width
        d = self.ops.scale(self.view(x), self.view(node.out), self.st, n=n, stride=n, cap=cap,
                           scale=node.attr("cap"), count_sel=sel, softcap=True)
        self.emit([d], [self.slot(x)], [self.slot(node.out)])

    def op_rms_norm(self, node: Node) -> None:
        x = node.inputs[0]
        n = node.attr("group")
        # without a weight: a buffer of ones (``norm_consts``)
        w = self.view(node.inputs[1]) if len(node.inputs) == 2 else self.act.view(f"ones{n}")
        sel, cap = self.rows(node.out)
        d = self.ops.rms_norm(self.view(x), w, self.view(node.out), self.st, n=n, x_stride=n,
                              y_stride=n, eps=node.attr("eps"), cap=cap, rows_per_tok=x.width // n, count_sel=sel)
        self.emit([d], [self.slot(x)], [self.slot(node.out)])

    def _cache_target(self, node: Node) -> tuple[View, object, LayerMemory, str] | None:
        """Where a value bound for the KV cache goes: (cache view, hazard key, plan, type)."""
        if node.out.id not in self._to_cache:
            return None
        attn = self._cons[node.out.id][0]
        kc, _, m = self.cache(attn.layer)
        return kc, ("k", attn.layer), m, self.types(attn.layer)[0]

    def _partial_rope(self, node: Node) -> None:
        """qwen35's partial RoPE: the value copied to the output's buffer if it is not
        there already, then its first n_rot values of each head rotated in place."""
        x = node.inputs[0]
        if len(node.inputs) > 1 or node.attr("freq_scale") != 1.0 or node.attr("mode") != "neox":
            raise GraphError(f"{node.out.name}: partial RoPE on Vulkan is the plain half-split form only")
        w = x.width
        if self.slot(x) != self.slot(node.out):
            d = self.ops.take(self.view(x), self.view(node.out), self.st, group=w, start=0, n=w, n_out=w,
                              x_stride=w, y_stride=w, cap=self.bucket)
            self.emit([d], [self.slot(x)], [self.slot(node.out)])
        d = self.ops.rope_partial(self.view(node.out), self.st, n_heads=node.attr("n_heads"),
                                  head_dim=node.attr("head_dim"), n_rot=node.attr("n_rot"), x_stride=w,
                                  theta=node.attr("theta"), cap=self.bucket)
        self.emit([d], [self.slot(node.out)], [self.slot(node.out)])

    def op_rope(self, node: Node) -> None:
        if "n_rot" in node.attrs:
            self._partial_rope(node)
            return
        x = node.inputs[0]
        nh, hd = node.attr("n_heads"), node.attr("head_dim")
        theta = node.attr("theta")
        factors = self.act.view(self.rope_buf[node.out.id])
        cache = self._cache_target(node)
        lin = self._rope_out.get(node.out.id)
        if lin is not None:  # the projection rotates (and stores) itself: matvec ROPE_OUT
            src, nkw = self.matvec_in(lin)
            w = lin.inputs[1]
            n_rows = int(w.shape[0])
            dst, key = (self.view(node.out), self.slot(node.out)) if cache is None else (cache[0], cache[1])
            ds = [self.ops.matvec_rope(self.weights.slots[w.name].qtype, self.weights.view(w.name),
                                       self.matvec_x(src, nkw), dst, self.st, factors, n_in=int(w.shape[1]),
                                       n_rows=n_rows, x_stride=src.width, y_stride=n_rows, head_dim=hd, rope=True,
                                       theta=theta, to_cache=cache is not None, n_ctx=cache[2].rows if cache else 0,
                                       maxc=mc, col0=c0, kv_type=cache[3] if cache else "f32",
                                       **nkw)  # type: ignore[arg-type]
                  for c0, mc in self.ops.col_split(self.bucket, x_stride=src.width, y_stride=n_rows, x8="xd" in nkw,
                                                   to_cache=cache is not None)]
            self.emit(ds, self.matvec_reads(src, nkw), [key])
            return
        mode = ROPE_NORMAL if node.attr("mode") == "normal" else ROPE_NEOX
        if cache is None:
            d = self.ops.rope(self.view(x), self.view(node.out), factors, self.st, n_heads=nh, head_dim=hd,
                              x_stride=x.width, mode=mode, theta=theta, cap=self.bucket)
            self.emit([d], [self.slot(x)], [self.slot(node.out)])
        else:
            d = self.ops.rope(self.view(x), cache[0], factors, self.st, n_heads=nh, head_dim=hd, x_stride=x.width,
                              mode=mode, theta=theta, cap=self.bucket, to_cache=True, n_ctx=cache[2].rows,
                              kv_dim=x.width, kv_type=cache[3])
            self.emit([d], [self.slot(x)], [cache[1]])

    def _store(self, t: Tensor, dst: View, key: object, m: LayerMemory, nh: int, hd: int, kv_type: str) -> None:
        """Copy a computed k or v into the cache (rope.comp with mode 0)."""
        factors = self.act.view(next(iter(self.rope_buf.values())))
        d = self.ops.rope(self.view(t), dst, factors, self.st, n_heads=nh, head_dim=hd, x_stride=t.width,
                          mode=ROPE_NONE, theta=10000.0, cap=self.bucket, to_cache=True, n_ctx=m.rows,
                          kv_dim=t.width, kv_type=kv_type)
        self.emit([d], [self.slot(t)], [key])

    def op_attention(self, node: Node, out: Tensor | None = None, gate: tuple[Tensor, int, int] | None = None) -> None:
        """The cache writes and the attention; ``out`` and ``gate`` (attn_gate): the
        output gated by the sigmoid of ``gate`` = (the value holding it, its head
        stride, offset), written as ``out`` (decode buckets' attention_decode only). A
        shared-KV layer's (``kv_layer``) stores nothing and reads that layer's cache."""
        q = node.inputs[0]
        k, v = node.inputs[1:] if len(node.inputs) == 3 else (None, None)
        src = self.kv_layer(node)
        o_t = node.out if out is None else out
        kc, vc, m = self.cache(src)
        kt, vt = self.types(src)
        nh, nkv, hd = node.attr("n_head"), node.attr("n_head_kv"), node.attr("head_dim")
        window = node.attr("window")
        if node.attrs.get("v_is_k"):  # a latent cache: the values are the cached K rows
            assert k is not None
            if self.noncausal:
                raise GraphError(f"{node.out.name}: a latent attention has no non-causal kernel")
            self._store(k, kc, ("k", node.layer), m, nkv, hd, kt)
            common = dict(n_head=nh, n_head_kv=nkv, head_dim=hd, n_ctx=m.rows, q_stride=q.width,
                          o_stride=node.out.width, cap=self.bucket, scale=node.attr("scale"), k_type=kt, v_type=kt,
                          n_swa=window)
            if gate is not None or out is not None:
                raise GraphError(f"{node.out.name}: a gated latent attention has no kernel")
            dv = int(node.attrs.get("v_dim", 0))
            if self.decode_split and dv and self.ops.decode_latent_ok(nh, nkv, hd, dv):
                # flash-decoding, V the first dv values of each K row (the output head's
                # values past dv, which the graph leaves undefined, are not written)
                assert self.kv.part is not None and self.kv.counters is not None
                d = self.ops.attention_decode(self.view(q), kc, kc, self.view(node.out), whole(self.kv.part),
                                              whole(self.kv.counters), self.st,
                                              n_split=decode_splits(m.rows if not window else min(m.rows, window)),
                                              v_dim=dv, **common)  # type: ignore[arg-type]
                self.emit([d], [self.slot(q), ("k", node.layer), "kv_part"], [self.slot(node.out), "kv_part"])
                return
            if not self.decode and dv and self.ops.prefill_latent_tile(nh, nkv, hd, dv) is not None:
                # many queries: tiled flash attention (unsplit), V the first dv values of each K row
                d = self.ops.attention_prefill(self.view(q), kc, kc, self.view(node.out), self.st, v_dim=dv,
                                               **common)  # type: ignore[arg-type]
                self.emit([d], [self.slot(q), ("k", node.layer)], [self.slot(node.out)])
                return
            d = self.ops.attention(self.view(q), kc, kc, self.view(node.out), self.st, **common)  # type: ignore[arg-type]
            self.emit([d], [self.slot(q), ("k", node.layer)], [self.slot(node.out)])
            return
        kb, vb = self.rotation(node)
        if kb:  # q and k rotated in place before k is stored (they are read by this node only)
            self._rotate(q, kb)
        if k is not None and v is not None:
            self._store_kv(node, k, v, kb, vb)
        common = dict(n_head=nh, n_head_kv=nkv, head_dim=hd, n_ctx=m.rows, q_stride=q.width,
                      o_stride=node.out.width, cap=self.bucket, scale=node.attr("scale"), k_type=kt, v_type=vt,
                      n_swa=window)
        reads: list[object] = [self.slot(q), ("k", src), ("v", src)]
        self._attend(node, q, kc, vc, m, o_t, gate, reads, common)
        if vb:  # the output rotated back (the matrix is its own inverse)
            assert gate is None
            self._rotate(node.out, vb)

    def _store_kv(self, node: Node, k: Tensor, v: Tensor, kb: int, vb: int) -> None:
        """This step's k (rotated first when the cache is) and v into the layer's cache,
        unless a projection or rope writes them there itself."""
        kc, vc, m = self.cache(node.layer)
        kt, vt = self.types(node.layer)
        nkv, hd = node.attr("n_head_kv"), node.attr("head_dim")
        if kb:
            self._rotate(k, kb)
        if vb and node.out.id not in self._v_out:
            self._rotate(v, vb)
        if k.id not in self._to_cache:
            self._store(k, kc, ("k", node.layer), m, nkv, hd, kt)
        lin = self._v_out.get(node.out.id)
        if lin is not None:  # the v projection writes the cache itself (matvec ROPE_OUT, no rotation)
            src, nkw = self.matvec_in(lin)
            w = lin.inputs[1]
            n_rows = int(w.shape[0])
            ds = [self.ops.matvec_rope(self.weights.slots[w.name].qtype, self.weights.view(w.name),
                                       self.matvec_x(src, nkw), vc, self.st,
                                       self.act.view(next(iter(self.rope_buf.values()))), n_in=int(w.shape[1]),
                                       n_rows=n_rows, x_stride=src.width, y_stride=n_rows, head_dim=hd, rope=False,
                                       theta=10000.0, to_cache=True, n_ctx=m.rows, maxc=mc, col0=c0, kv_type=vt,
                                       **nkw)  # type: ignore[arg-type]
                  for c0, mc in self.ops.col_split(self.bucket, x_stride=src.width, y_stride=n_rows, x8="xd" in nkw,
                                                   to_cache=True)]
            self.emit(ds, self.matvec_reads(src, nkw), [("v", node.layer)])
        else:
            self._store(v, vc, ("v", node.layer), m, nkv, hd, vt)

    def _attend(self, node: Node, q: Tensor, kc: View, vc: View, m: LayerMemory, o_t: Tensor,
                gate: tuple[Tensor, int, int] | None, reads: list[object], common: dict[str, object]) -> None:
        """The attention of ``q`` over a cache, by the kernel this bucket and device take."""
        hd, window = node.attr("head_dim"), node.attr("window")
        if self.noncausal:
            # a step with a non-causal entry: the scalar tiled kernel reading each row's
            # highest visible position from the step buffer, whatever the bucket and device
            if gate is not None or not self.ops.prefill_ok(hd):
                raise GraphError(f"{node.out.name}: no non-causal attention kernel for this layer")
            d = self.ops.attention_prefill(self.view(q), kc, vc, self.view(node.out), self.st, noncausal=True,
                                           symmetric=bool(node.attrs.get("symmetric")),
                                           **common)  # type: ignore[arg-type]
            self.emit([d], reads, [self.slot(node.out)])
        elif self.decode_split:
            # few queries at any depth: the KV sequence split over work groups (flash-decoding)
            assert self.kv.part is not None and self.kv.counters is not None
            g = None if gate is None else (self.view(gate[0]), gate[0].width, gate[1], gate[2])
            d = self.ops.attention_decode(self.view(q), kc, vc, self.view(o_t), whole(self.kv.part),
                                          whole(self.kv.counters), self.st,
                                          n_split=decode_splits(m.rows if not window else min(m.rows, window)),
                                          gate=g, **common)  # type: ignore[arg-type]
            # the partials and counters are reused by every layer's attention
            gate_reads = [] if gate is None else [self.slot(gate[0])]
            self.emit([d], reads + gate_reads + ["kv_part"], [self.slot(o_t), "kv_part"])
        elif gate is not None:
            raise GraphError(f"{node.out.name}: the gated output is attention_decode's alone")
        elif not self.decode and self.ops.prefill_ok(hd):  # many queries: tiled flash attention
            self._attend_prefill(node, q, kc, vc, reads, common)
        else:
            d = self.ops.attention(self.view(q), kc, vc, self.view(node.out), self.st, **common)  # type: ignore[arg-type]
            self.emit([d], reads, [self.slot(node.out)])

    def _attend_prefill(self, node: Node, q: Tensor, kc: View, vc: View, reads: Sequence[object],
                        common: dict[str, object]) -> None:
        """``attention_prefill``; at depth on cooperative matrices its keys split over
        work groups (``prefill_splits``) into the KV cache's partials, added up by
        ``attention_combine`` after a barrier."""
        nh, nkv, hd = node.attr("n_head"), node.attr("n_head_kv"), node.attr("head_dim")
        n_split = self.ops.prefill_splits(int(common["n_ctx"]), nh, nkv, hd, window=node.attr("window"),  # type: ignore[call-overload]
                                          bucket=self.bucket)
        part = self.kv.part
        if part is None or part.size < 4 * attention_part_floats(self.bucket, nh, hd, n_split):
            n_split = 1
        if n_split == 1:
            d = self.ops.attention_prefill(self.view(q), kc, vc, self.view(node.out), self.st, **common)  # type: ignore[arg-type]
            self.emit([d], reads, [self.slot(node.out)])
            return
        assert part is not None
        d = self.ops.attention_prefill(self.view(q), kc, vc, self.view(node.out), self.st, part=whole(part),
                                       n_split=n_split, **common)  # type: ignore[arg-type]
        self.emit([d], [*reads, "kv_part"], ["kv_part"])  # the partials are every layer's
        c = self.ops.attention_combine(whole(part), self.view(node.out), self.st, n_head=nh, head_dim=hd,
                                       n_split=n_split, o_stride=node.out.width, cap=self.bucket)
        self.emit([c], ["kv_part"], [self.slot(node.out)])

    def _rotate(self, t: Tensor, block: int) -> None:
        sel, cap = self.rows(t)
        d = self.ops.hadamard(self.view(t), self.view(t), self.st, width=t.width, stride=t.width, block=block,
                              cap=cap, count_sel=sel)
        self.emit([d], [self.slot(t)], [self.slot(t)])

    def op_glu(self, node: Node) -> None:
        g, u = node.inputs
        sel, cap = self.rows(node.out)
        fused = self._gate_up.get(node.out.id)
        n = node.out.width
        if fused is not None:  # y = silu(gate . x) * (up . x) from one dispatch (matvec GATE_UP)
            lg, _, (view, row_a, row_b) = fused
            x, nkw = self.matvec_in(lg)
            w = lg.inputs[1]
            ds = [self.ops.matvec_gate_up(self.weights.slots[w.name].qtype, view, self.matvec_x(x, nkw),
                                          self.view(node.out), self.st, n_in=int(w.shape[1]), n_rows=n, row_a=row_a,
                                          row_b=row_b, x_stride=x.width, y_stride=n, maxc=mc, col0=c0,
                                          **nkw)  # type: ignore[arg-type]
                  for c0, mc in self.ops.col_split(cap, x_stride=x.width, y_stride=n, x8="xd" in nkw)]
            self.emit(ds, self.matvec_reads(x, nkw), [self.slot(node.out)])
            return
        d = self.ops.glu(self.view(g), self.view(u), self.view(node.out), self.st, n=n, stride=n, cap=cap,
                         act=node.attr("act"), count_sel=sel)
        self.emit([d], [self.slot(g), self.slot(u)], [self.slot(node.out)])

    # -- mixture of experts: the routing stays on the device, so the expert matvecs read
    # their ids from it and a recorded graph serves every routing

    def op_moe_topk(self, node: Node) -> None:
        x = node.inputs[0]
        bias = self.view(node.inputs[1]) if len(node.inputs) > 1 else None
        d = self.ops.moe_topk(self.view(x), self.view(node.out), self.st, n_expert=node.attr("n_expert"),
                              k=node.attr("k"), x_stride=x.width, y_stride=node.out.width, cap=self.bucket,
                              norm=node.attr("norm"), scale=node.attr("scale"),
                              sigmoid=node.attr("gating") == "sigmoid", bias=bias)
        self.emit([d], [self.slot(x)], [self.slot(node.out)])

    def op_head_linear(self, node: Node) -> None:
        """Each head through its own matrix: ``moe_matvec`` over the head "experts" with
        one fixed routing row for every token (``head_routes``)."""
        x, w = node.inputs
        nh, n_rows, n_in = (int(d) for d in w.shape)
        d = self.ops.moe_matvec(self.weights.slots[w.name].qtype, self.weights.view(w.name), self.view(x),
                                self.view(node.out), self.st, self.act.view(f"heads{nh}"), n_in=n_in, n_rows=n_rows,
                                x_stride=x.width, x_pair=n_in, y_stride=node.out.width, k=nh, cap=self.bucket,
                                r_stride=0)
        self.emit([d], [self.slot(x)], [self.slot(node.out)])

    def op_concat(self, node: Node) -> None:
        a, b = node.inputs
        grp = node.attr("groups")
        d = self.ops.concat(self.view(a), self.view(b), self.view(node.out), self.st, na=a.width // grp,
                            nb=b.width // grp, n_out=node.out.width, a_stride=a.width, b_stride=b.width,
                            y_stride=node.out.width, cap=self.bucket)
        self.emit([d], [self.slot(a), self.slot(b)], [self.slot(node.out)])

    def op_moe_linear(self, node: Node) -> None:
        x, w, routes = node.inputs
        n_expert, n_rows, n_in = (int(d) for d in w.shape)
        if self.moe_grouped(node):
            self._moe_grouped(node, n_expert, n_rows, n_in)
            return
        d = self.ops.moe_matvec(self.weights.slots[w.name].qtype, self.weights.view(w.name), self.view(x),
                                self.view(node.out), self.st, self.view(routes), n_in=n_in, n_rows=n_rows,
                                x_stride=x.width, x_pair=n_in if len(x.shape) == 3 else 0,
                                y_stride=node.out.width, k=node.attr("k"), cap=self.bucket)
        self.emit([d], [self.slot(x), self.slot(routes)], [self.slot(node.out)])

    def _moe_grouped(self, node: Node, n_expert: int, n_rows: int, n_in: int) -> None:
        """Prefill buckets: the chunk's pairs grouped by expert once per routing (the
        map is every layer's, a hazard of its own), then a tiled product per expert
        over its tokens (``moe_matmul``), so each expert's weights are read once per
        tile of 32 of its tokens rather than once per token."""
        x, w, routes = node.inputs
        k = node.attr("k")
        m = self.act.view("moe_map")
        if self._grouped != routes.id:
            g = self.ops.moe_group(self.view(routes), m, self.st, n_expert=n_expert, k=k, cap=self.bucket)
            self.emit([g], [self.slot(routes)], ["moe_map"])
            self._grouped = routes.id
        d = self.ops.moe_matmul(self.weights.slots[w.name].qtype, self.weights.view(w.name), self.view(x),
                                self.view(node.out), self.st, m, n_in=n_in, n_rows=n_rows, x_stride=x.width,
                                x_pair=n_in if len(x.shape) == 3 else 0, y_stride=node.out.width, k=k,
                                n_expert=n_expert, cap=self.bucket)
        self.emit([d], [self.slot(x), "moe_map"], [self.slot(node.out)])

    def op_moe_combine(self, node: Node) -> None:
        y, routes = node.inputs
        n = int(node.out.shape[1])
        d = self.ops.moe_combine(self.view(y), self.view(routes), self.view(node.out), self.st, n=n,
                                 k=node.attr("k"), y_stride=node.out.width, cap=self.bucket)
        self.emit([d], [self.slot(y), self.slot(routes)], [self.slot(node.out)])

    # -- gated delta-net (qwen35): the state buffers are hazards of their own

    def op_take(self, node: Node) -> None:
        (x,) = node.inputs
        d = self.ops.take(self.view(x), self.view(node.out), self.st, group=node.attr("group"),
                          start=node.attr("start"), n=node.attr("n"), n_out=node.out.width, x_stride=x.width,
                          y_stride=node.out.width, cap=self.bucket)
        self.emit([d], [self.slot(x)], [self.slot(node.out)])

    def op_l2_norm(self, node: Node) -> None:
        (x,) = node.inputs
        n = node.attr("group")
        d = self.ops.l2_norm(self.view(x), self.view(node.out), self.st, n=n, rows_per_tok=x.width // n,
                             eps=node.attr("eps"), cap=self.bucket)
        self.emit([d], [self.slot(x)], [self.slot(node.out)])

    def op_gate_rows(self, node: Node) -> None:
        x, h, w = node.inputs
        d = self.ops.gate_rows(self.view(x), self.view(h), self.view(w), self.view(node.out), self.st,
                               n=x.width, n_in=h.width, cap=self.bucket)
        self.emit([d], [self.slot(x), self.slot(h)], [self.slot(node.out)])

    def _state(self, node: Node) -> tuple[View, object]:
        if self.rs is None or node.out.id not in self.rs.bufs:
            raise GraphError(f"{node.out.name}: no recurrent state buffer for this node")
        return self.rs.view(node.out.id), ("rs", node.out.id)

    def op_ssm_conv(self, node: Node) -> None:
        x, w = node.inputs
        if self.weights.slots[w.name].qtype != "F32":
            raise GraphError(f"{node.out.name}: the Vulkan conv reads an F32 {w.name}")
        state, key = self._state(node)
        kw = dict(c=x.width, k=node.attr("d_conv"), cap=self.bucket)
        d0 = self.ops.ssm_conv(self.view(x), self.view(w), self.view(node.out), state, self.st, phase=0, **kw)
        self.emit([d0], [self.slot(x), key], [self.slot(node.out)])
        d1 = self.ops.ssm_conv(self.view(x), self.view(w), self.view(node.out), state, self.st, phase=1, **kw)
        self.emit([d1], [self.slot(x), key], [key])

    def op_delta_net(self, node: Node) -> None:
        q, k, v, alpha, beta, dt, a = node.inputs
        state, key = self._state(node)
        vq, vk, vv, va, vb, vdt, vad = (self.view(t) for t in (q, k, v, alpha, beta, dt, a))
        if not self.decode and self.rs is not None and self.rs.work:
            self._delta_chunked(node)
            return
        d = self.ops.delta_net(vq, vk, vv, va, vb, vdt, vad, self.view(node.out), state, self.st,
                               n_k=node.attr("n_k_heads"), n_v=node.attr("n_v_heads"), d=node.attr("head_dim"),
                               cap=self.bucket, k_grouped=node.attr("k_grouped"))
        self.emit([d], [self.slot(t) for t in (q, k, v, alpha, beta)] + [key], [self.slot(node.out), key])

    def _delta_chunked(self, node: Node) -> None:
        """Prefill buckets: the chunked form (``vulkan/recurrent.py``), its scratch
        shared by every layer."""
        assert self.rs is not None
        q, k, v, alpha, beta, dt, a = node.inputs
        state, key = self._state(node)
        vq, vk, vv, va, vb, vdt, vad = (self.view(t) for t in (q, k, v, alpha, beta, dt, a))
        tm, pm, gc = (self.rs.work_view(n) for n in ("T", "P", "G"))
        shape = dict(n_k=node.attr("n_k_heads"), n_v=node.attr("n_v_heads"), d=node.attr("head_dim"), cap=self.bucket,
                     runs=self.rs.n_seq, k_grouped=node.attr("k_grouped"))
        work = [("rs_work", n) for n in ("T", "P", "G")]
        self.emit([self.ops.delta_prep(vq, vk, va, vb, vdt, vad, tm, pm, gc, self.st, **shape)],
                  [self.slot(t) for t in (q, k, alpha, beta)], work)
        self.emit([self.ops.delta_chunk(vq, vk, vv, vb, tm, pm, gc, self.view(node.out), state, self.st, **shape)],
                  [self.slot(t) for t in (q, k, v, beta)] + work + [key], [self.slot(node.out), key])

    # -- fused groups (``Fusion``; ``find_hybrid_fusions``) ----------------------------

    def fuse_conv_split(self, node: Node, members: list[Node]) -> None:
        """The conv, its split into q, k and v and the L2 norms of q and k: one dispatch
        (ssm_conv_split.comp), then the state moved on (ssm_conv phase 1), which only the
        next step reads: it shares the level of whatever reads q, k and v."""
        x, w = node.inputs
        split = conv_split_parts(node, self._cons)
        assert split is not None
        parts, d, eps = split
        outs = [nrm.out if nrm is not None else take.out for take, nrm in parts]
        state, key = self._state(node)
        e1 = parts[0][0].attr("n")
        mask = sum(1 << p for p, (_, nrm) in enumerate(parts) if nrm is not None)
        y0, y1, y2 = (self.view(t) for t in outs)
        d0 = self.ops.ssm_conv_split(self.view(x), self.view(w), y0, y1, y2, state, self.st,
                                     c=x.width, k=node.attr("d_conv"), d=d, e1=e1, e2=e1 + parts[1][0].attr("n"),
                                     norm=mask, eps=eps, cap=self.bucket)
        self.emit([d0], [self.slot(x), key], [self.slot(t) for t in outs])
        d1 = self.ops.ssm_conv(self.view(x), self.view(w), self.view(outs[0]), state, self.st, phase=1, c=x.width,
                               k=node.attr("d_conv"), cap=self.bucket)
        self.emit([d1], [self.slot(x), key], [key])

    def fuse_delta_gate(self, node: Node, members: list[Node]) -> None:
        """The delta rule with the per-head RMSNorm and the silu(z) gate after it, in the
        same work groups (delta_net.comp GATED_NORM)."""
        q, k, v, alpha, beta, dt, a = node.inputs
        _, nrm, glu = members
        z = glu.inputs[0]
        state, key = self._state(node)
        vq, vk, vv, va, vb, vdt, vad = (self.view(t) for t in (q, k, v, alpha, beta, dt, a))
        d = self.ops.delta_net(vq, vk, vv, va, vb, vdt, vad, self.view(glu.out), state, self.st,
                               n_k=node.attr("n_k_heads"), n_v=node.attr("n_v_heads"), d=node.attr("head_dim"),
                               cap=self.bucket, gate=(self.view(z), self.view(nrm.inputs[1]), nrm.attr("eps")),
                               k_grouped=node.attr("k_grouped"))
        self.emit([d], [self.slot(t) for t in (q, k, v, alpha, beta, z)] + [key], [self.slot(glu.out), key])

    def fuse_delta_conv(self, node: Node, members: list[Node]) -> None:
        """The delta rule making its own q, k, v from the conv's input (and, with the
        gated norm's members, its gated output): delta_net.comp CONV (GATED_NORM); then
        the conv state moved on (ssm_conv phase 1) beside whatever reads the output."""
        x, w = node.inputs
        _, _, l2_eps = conv_split_parts(node, self._cons) or ((), 0, 0.0)
        rule = next(m for m in members if m.op == "delta_net")
        nrm = next((m for m in members if m.op == "rms_norm"), None)
        glu = next((m for m in members if m.op == "glu"), None)
        _, _, _, alpha, beta, dt, a = rule.inputs
        cstate, ckey = self._state(node)
        state, key = self._state(rule)
        out = glu.out if glu is not None else rule.out
        gate = None
        reads = [self.slot(x), ckey, self.slot(alpha), self.slot(beta), key]
        if nrm is not None and glu is not None:
            gate = (self.view(glu.inputs[0]), self.view(nrm.inputs[1]), nrm.attr("eps"))
            reads.append(self.slot(glu.inputs[0]))
        d = self.ops.delta_net(self.view(x), self.view(w), cstate, self.view(alpha), self.view(beta), self.view(dt),
                               self.view(a), self.view(out), state, self.st, n_k=rule.attr("n_k_heads"),
                               n_v=rule.attr("n_v_heads"), d=rule.attr("head_dim"), cap=self.bucket, gate=gate,
                               conv=(x.width, node.attr("d_conv"), l2_eps), k_grouped=rule.attr("k_grouped"))
        self.emit([d], reads, [self.slot(out), key])
        d1 = self.ops.ssm_conv(self.view(x), self.view(w), self.view(out), cstate, self.st, phase=1, c=x.width,
                               k=node.attr("d_conv"), cap=self.bucket)
        self.emit([d1], [self.slot(x), ckey], [ckey])

    def fuse_glu_in(self, node: Node, members: list[Node]) -> None:
        """The experts' down product reading silu(gate) * up as it loads them
        (moe_matvec.comp GLU_IN)."""
        glu = members[0]
        g, u = glu.inputs
        _, w, routes = node.inputs
        n_rows, n_in = int(w.shape[1]), int(w.shape[2])
        d = self.ops.moe_matvec(self.weights.slots[w.name].qtype, self.weights.view(w.name), self.view(g),
                                self.view(node.out), self.st, self.view(routes), n_in=n_in, n_rows=n_rows,
                                x_stride=g.width, x_pair=n_in, y_stride=node.out.width, k=node.attr("k"),
                                cap=self.bucket, up=self.view(u))
        self.emit([d], [self.slot(g), self.slot(u), self.slot(routes)], [self.slot(node.out)])

    def fuse_qk_rope(self, node: Node, members: list[Node]) -> None:
        """QK-norm and RoPE of q or k (qwen35's q read from its gate interleave, k
        stored in the KV cache): one dispatch (qk_norm_rope.comp)."""
        take = members[0] if members[0].op == "take" else None
        nrm = members[-2]
        src = take.inputs[0] if take is not None else nrm.inputs[0]
        hd = node.attr("head_dim")
        cache = self._cache_target(node)
        dst, key = (self.view(node.out), self.slot(node.out)) if cache is None else (cache[0], cache[1])
        d = self.ops.qk_norm_rope(
            self.view(src), dst, self.act.view(self.rope_buf[node.out.id]), self.st, self.view(nrm.inputs[1]),
            n_heads=node.attr("n_heads"), head_dim=hd, x_stride=src.width,
            x_head=take.attr("group") if take is not None else hd, x_off=take.attr("start") if take is not None else 0,
            mode=ROPE_NORMAL if node.attr("mode") == "normal" else ROPE_NEOX, n_rot=node.attrs.get("n_rot", hd),
            theta=node.attr("theta"), eps=nrm.attr("eps"), cap=self.bucket, to_cache=cache is not None,
            n_ctx=cache[2].rows if cache else 0, kv_dim=node.out.width, kv_type=cache[3] if cache else "f32")
        self.emit([d], [self.slot(src)], [key])

    def fuse_attn_gate(self, node: Node, members: list[Node]) -> None:
        """qwen35's attention with its sigmoid output gate applied as it is written
        (attn_decode's OUT_GATE), the gate read from its interleave with q."""
        take = next(m for m in members if m.op == "take")
        att = next(m for m in members if m.op == "attention")
        self.op_attention(att, out=node.out, gate=(take.inputs[0], take.attr("group"), take.attr("start")))

    def fuse_moe_down_out(self, node: Node, members: list[Node]) -> None:
        """The experts' down product (reading their SwiGLU where it is a member), their
        weighted sum, the gated shared expert and the residual: one dispatch
        (moe_matvec.comp COMBINE, GLU_IN, SHEXP, RESID)."""
        down = next(m for m in members if m.op == "moe_linear")
        glu = next((m for m in members if m.op == "glu"), None)
        x, w, routes = down.inputs
        src = glu.inputs[0] if glu is not None else x
        reads = [self.slot(src), self.slot(routes)] + ([self.slot(glu.inputs[1])] if glu is not None else [])
        shexp, res = self._ffn_end(members, reads)
        n_rows, n_in = int(w.shape[1]), int(w.shape[2])
        d = self.ops.moe_matvec(self.weights.slots[w.name].qtype, self.weights.view(w.name), self.view(src),
                                self.view(node.out), self.st, self.view(routes), n_in=n_in, n_rows=n_rows,
                                x_stride=src.width, x_pair=n_in if len(src.shape) == 3 else 0,
                                y_stride=node.out.width, k=down.attr("k"), cap=self.bucket,
                                up=self.view(glu.inputs[1]) if glu is not None else None,
                                combine=(self.view(res[0]) if res else None, shexp))
        self.emit([d], reads, [self.slot(node.out)])

    def _ffn_end(self, members: list[Node], reads: list[str]) -> tuple[tuple[View, View, View, int] | None,
                                                                          list[Tensor]]:
        """The MoE FFN end's extras a fused combine takes: the gated shared expert
        (x, h, gate weight, h's width) and the residual, their slots added to ``reads``."""
        inner = {m.out.id for m in members}
        gate = next((m for m in members if m.op == "gate_rows"), None)
        res = [t for m in members if m.op == "add" for t in m.inputs if t.id not in inner]
        assert len(res) <= 1
        shexp = None
        if gate is not None:
            xs, h, gw = gate.inputs
            shexp = (self.view(xs), self.view(h), self.view(gw), h.width)
            reads += [self.slot(xs), self.slot(h)]
        if res:
            reads.append(self.slot(res[0]))
        return shexp, res

    def fuse_moe_out(self, node: Node, members: list[Node]) -> None:
        """The experts' weighted sum, plus the gated shared expert, plus the residual:
        one elementwise dispatch (moe_combine.comp SHEXP, RESID)."""
        comb = members[0]
        y, routes = comb.inputs
        reads = [self.slot(y), self.slot(routes)]
        shexp, res = self._ffn_end(members, reads)
        n = int(node.out.shape[1])
        d = self.ops.moe_combine(self.view(y), self.view(routes), self.view(node.out), self.st, n=n,
                                 k=comb.attr("k"), y_stride=node.out.width, cap=self.bucket,
                                 res=self.view(res[0]) if res else None, shexp=shexp)
        self.emit([d], reads, [self.slot(node.out)])

    @property
    def st(self) -> View:
        return self.act.view("step")


def missing_ops(graph: Graph) -> list[str]:
    """The graph's ops the lowering has no ``op_`` method for (the backend refuses such
    a model at load)."""
    return sorted({n.op for n in graph.nodes if not hasattr(_Lowering, "op_" + n.op)})


def build_ops(
    ops: Ops, graph: Graph, plan: BufferPlan, weights: WeightStore, act: Activations, kv: KVCache,
    mem: list[LayerMemory], rope_buf: dict[int, str], *, bucket: int, rs: RecurrentState | None = None,
    embd: bool = False, noncausal: bool = False,
) -> list[Op]:
    """Every dispatch of one forward pass over at most ``bucket`` tokens (``embd``: of a
    step with embedding rows; ``noncausal``: of one with a non-causal entry)."""
    by_layer = {m.layer: (i, m) for i, m in enumerate(mem)}
    return _Lowering(ops, graph, plan, weights, act, kv, by_layer, rope_buf, bucket, rs, embd, noncausal).run()

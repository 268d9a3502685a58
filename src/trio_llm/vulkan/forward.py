"""The transformer forward pass as a list of ops, for one shape bucket.

The batch of a step (every live token of every sequence, concatenated) runs as one
matrix: projections and the MLP are shared by all sequences, and only attention reads
per token which sequence (and so which part of the KV cache) it belongs to. A bucket
is the most tokens a graph serves; up to eight tokens the projections are
matrix-vector products that read each weight once for all tokens, beyond that tiled
matrix products. Only the rows whose logits are wanted (each entry's last token) go
through the output head, and only those logits are copied back to the host.

Barriers sit only between dependent stages: q, k and v (or gate and up) projections,
which read the same input and write different outputs, share one.
"""

from __future__ import annotations

import attrs
import numpy as np

from trio_llm.model.config import ModelConfig
from trio_llm.vulkan.graph import Barrier, Copy, Op
from trio_llm.vulkan.memory import Allocator, Buffer, CopyJob, View, whole
from trio_llm.vulkan.ops import (
    COUNT_OUT,
    COUNT_TOKENS,
    ROPE_NEOX,
    ROPE_NONE,
    ROPE_NORMAL,
    STEP_BYTES,
    Ops,
    row_bytes,
)
from trio_llm.vulkan.weights import WeightStore

MATVEC_MAX_COLS = 8


@attrs.define(eq=False)
class Activations:
    """Compute buffers for up to ``cap`` tokens and ``out_cap`` output rows, plus the
    step buffer and the logits readback (the "scratch" category)."""

    alloc: Allocator
    cfg: ModelConfig
    cap: int
    out_cap: int
    rope_factors: np.ndarray  # [head_dim // 2] float32
    bufs: dict[str, Buffer] = attrs.field(factory=dict)

    def allocate(self) -> None:
        if self.bufs:
            return
        c = self.cfg
        sizes = {
            "x": self.cap * c.n_embd,
            "xn": self.cap * c.n_embd,
            "q": self.cap * c.q_dim,
            "k": self.cap * c.kv_dim,
            "v": self.cap * c.kv_dim,
            "att": self.cap * c.q_dim,
            "g": self.cap * c.n_ff,
            "u": self.cap * c.n_ff,
            "hid": self.out_cap * c.n_embd,
            "logits": self.out_cap * c.n_vocab,
            "factors": c.head_dim // 2,
        }
        try:
            for name, n in sizes.items():
                self.bufs[name] = self.alloc.create(4 * n, "compute", "device")
            self.bufs["step"] = self.alloc.create(STEP_BYTES, "scratch", "upload")
            self.bufs["readback"] = self.alloc.create(4 * self.out_cap * c.n_vocab, "scratch", "readback")
            self._upload_factors()
        except BaseException:
            self.free()
            raise

    def _upload_factors(self) -> None:
        device = self.alloc.device
        vk = device.vk
        step = self.bufs["step"]
        assert step.array is not None
        data = self.rope_factors.astype(np.float32).view(np.uint8)
        # borrow the step buffer as staging: nothing reads it until the next forward
        step.array[: data.nbytes] = data
        with device.one_shot("upload rope factors") as cmd:
            region = vk.VkBufferCopy(srcOffset=0, dstOffset=0, size=data.nbytes)
            vk.vkCmdCopyBuffer(cmd, step.handle, self.bufs["factors"].handle, 1, [region])

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
        n = n_out * self.cfg.n_vocab
        # a view: the caller copies it once into its result before the next step
        return arr[: 4 * n].view(np.float32).reshape(n_out, self.cfg.n_vocab)  # [n_out, n_vocab]


@attrs.define(eq=False)
class KVCache:
    """Per layer, K and V of every sequence: ``[n_seq * n_ctx, kv_dim]`` float32."""

    alloc: Allocator
    n_layer: int
    layer_bytes: int
    k: list[Buffer] = attrs.field(factory=list)
    v: list[Buffer] = attrs.field(factory=list)
    host: list[Buffer] = attrs.field(factory=list)  # the ALL-level copy, K then V per layer
    saved: bool = False  # the host copy holds the cache (the device has none)

    @property
    def on_device(self) -> bool:
        return bool(self.k)

    def allocate(self) -> None:
        if self.k:
            return
        try:
            for _ in range(self.n_layer):
                self.k.append(self.alloc.create(self.layer_bytes, "kv_cache", "device"))
                self.v.append(self.alloc.create(self.layer_bytes, "kv_cache", "device"))
        except BaseException:
            self.free_device()
            raise

    def free_device(self) -> None:
        for buf in self.k + self.v:
            self.alloc.free(buf)
        self.k, self.v = [], []

    def free_host(self) -> None:
        for buf in self.host:
            self.alloc.free(buf)
        self.host = []
        self.saved = False

    def to_host(self) -> None:
        """Copy the device cache into host buffers and free the device cache. The host
        buffers are made on the first release and kept (host memory, like the weights'
        shadow), so later cycles allocate no host memory."""
        if not self.k:
            return
        device = self.alloc.device
        vk = device.vk
        pairs = [b for kv in zip(self.k, self.v, strict=True) for b in kv]
        try:
            if [b.size for b in self.host] != [b.size for b in pairs]:
                self.free_host()
                self.host = [self.alloc.create(b.size, "kv_cache", "host") for b in pairs]
            with device.one_shot("copy KV cache to host") as cmd:
                for src, dst in zip(pairs, self.host, strict=True):
                    vk.vkCmdCopyBuffer(cmd, src.handle, dst.handle, 1, [vk.VkBufferCopy(size=src.size)])
        except BaseException:
            self.free_host()
            raise
        self.free_device()
        self.saved = True

    def restore_jobs(self) -> list[CopyJob]:
        """Copy jobs that re-create the device cache from the host copy (K and V of
        each layer in order); with no saved copy, the cache is allocated empty here."""
        if not self.saved:
            self.allocate()  # nothing when the cache stayed on the device
            return []
        self.free_device()  # what a failed restore left behind
        jobs = []
        for i, src in enumerate(self.host):
            side = self.k if i % 2 == 0 else self.v
            jobs.append(CopyJob(src.size, "kv_cache", src, side.append))
        return jobs

    def restored(self) -> None:
        """The jobs of ``restore_jobs`` have all finished: the device holds the cache."""
        self.saved = False


def build_ops(
    ops: Ops, cfg: ModelConfig, weights: WeightStore, act: Activations, kv: KVCache,
    *, bucket: int, n_ctx: int,
) -> list[Op]:
    """Every dispatch of one forward pass over at most ``bucket`` tokens."""
    E, Q, KVD, F, V = cfg.n_embd, cfg.q_dim, cfg.kv_dim, cfg.n_ff, cfg.n_vocab
    hd = cfg.head_dim
    out_cap = min(bucket, act.out_cap)
    st = act.view("step")
    a = act.view
    out: list[Op] = []

    def proj(name: str, x: View, y: View, n_in: int, n_out: int, *, add: bool = False,
             count_sel: int = COUNT_TOKENS, cap: int = bucket) -> None:
        qtype = weights.slots[name].qtype
        for w, r0, r1 in weights.pieces(name):
            if cap <= MATVEC_MAX_COLS:
                out.append(ops.matvec(
                    qtype, w, x, y, st, n_in=n_in, n_rows=r1 - r0, x_stride=n_in, y_stride=n_out,
                    y_off=r0, count_sel=count_sel, add=add, maxc=cap,
                ))
            else:
                out.append(ops.matmul(
                    qtype, w, x, y, st, n_in=n_in, n_rows=r1 - r0, x_stride=n_in, y_stride=n_out,
                    cap=cap, y_off=r0, count_sel=count_sel, add=add,
                ))

    def vec(name: str) -> View:
        return weights.view(name)

    def separate_qkv(il: int, kc: View, vc: View) -> None:
        """The q, k, v projections, then bias, QK-norm and rope with the KV write, each
        its own dispatch (prefill, and the architectures ROPE_OUT does not cover)."""
        b = f"blk.{il}."
        qkv = [b + f"attn_{t}.weight" for t in "qkv"]
        theta = cfg.rope_theta
        proj(qkv[0], a("xn"), a("q"), E, Q)  # [T, q_dim]
        proj(qkv[1], a("xn"), a("k"), E, KVD)  # [T, kv_dim]
        proj(qkv[2], a("xn"), a("v"), E, KVD)  # [T, kv_dim]
        out.append(Barrier())
        if cfg.attn_bias:
            for t, n in (("q", Q), ("k", KVD), ("v", KVD)):
                out.append(ops.add(a(t), vec(b + f"attn_{t}.bias"), a(t), st, n=n, stride=n, cap=bucket, bcast=True))
            out.append(Barrier())
        if cfg.qk_norm:
            out.append(ops.rms_norm(a("q"), vec(b + "attn_q_norm.weight"), a("q"), st, n=hd, x_stride=hd, y_stride=hd, eps=cfg.rms_eps, cap=bucket, rows_per_tok=cfg.n_head))
            out.append(ops.rms_norm(a("k"), vec(b + "attn_k_norm.weight"), a("k"), st, n=hd, x_stride=hd, y_stride=hd, eps=cfg.rms_eps, cap=bucket, rows_per_tok=cfg.n_head_kv))
            out.append(Barrier())
        out.append(ops.rope(a("q"), a("q"), a("factors"), st, n_heads=cfg.n_head, head_dim=hd, x_stride=Q, mode=rope_mode, theta=theta, cap=bucket))
        out.append(ops.rope(a("k"), kc, a("factors"), st, n_heads=cfg.n_head_kv, head_dim=hd, x_stride=KVD, mode=rope_mode, theta=theta, cap=bucket, to_cache=True, n_ctx=n_ctx, kv_dim=KVD))
        out.append(ops.rope(a("v"), vc, a("factors"), st, n_heads=cfg.n_head_kv, head_dim=hd, x_stride=KVD, mode=ROPE_NONE, theta=theta, cap=bucket, to_cache=True, n_ctx=n_ctx, kv_dim=KVD))

    def gate_up_view(gate: str, up: str) -> tuple[View, int, int] | None:
        """One view over both FFN matrices and the row where each starts in it, when a
        GATE_UP dispatch can read them: same type and segment, whole rows apart, within
        one binding, and a subgroup's two rows are the pair (rows per subgroup 2)."""
        sg, su = weights.slots[gate], weights.slots[up]
        if sg.qtype != su.qtype or sg.segment != su.segment or sg.shape != su.shape or ops.matvec_rs != 2:
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

    def ffn_block(il: int) -> None:
        """The attention output projection and the FFN of layer ``il``."""
        b = f"blk.{il}."
        proj(b + "attn_output.weight", a("att"), a("x"), Q, E, add=True)  # x += att @ wo.T
        out.append(Barrier())
        out.append(ops.rms_norm(a("x"), vec(b + "ffn_norm.weight"), a("xn"), st, n=E, x_stride=E, y_stride=E, eps=cfg.rms_eps, cap=bucket))
        out.append(Barrier())
        both = gate_up_view(b + "ffn_gate.weight", b + "ffn_up.weight") if bucket <= MATVEC_MAX_COLS else None
        if both is not None:  # g = silu(gate) * up from one dispatch (matvec.comp's GATE_UP)
            view, row_a, row_b = both
            out.append(ops.matvec_gate_up(weights.slots[b + "ffn_gate.weight"].qtype, view, a("xn"), a("g"), st,
                                          n_in=E, n_rows=F, row_a=row_a, row_b=row_b, x_stride=E, y_stride=F,
                                          maxc=bucket))
            out.append(Barrier())
        else:
            proj(b + "ffn_gate.weight", a("xn"), a("g"), E, F)  # [T, n_ff]
            proj(b + "ffn_up.weight", a("xn"), a("u"), E, F)  # [T, n_ff]
            out.append(Barrier())
            out.append(ops.swiglu(a("g"), a("u"), a("g"), st, n=F, stride=F, cap=bucket))
            out.append(Barrier())
        proj(b + "ffn_down.weight", a("g"), a("x"), F, E, add=True)  # x += swiglu @ w_down.T
        out.append(Barrier())

    rope_mode = ROPE_NORMAL if cfg.rope_mode == "normal" else ROPE_NEOX
    # llama's decode buckets rotate q and k (and store k, v) in the projections
    rope_in_proj = (bucket <= MATVEC_MAX_COLS and cfg.rope_mode == "normal" and not cfg.attn_bias
                    and not cfg.qk_norm and ops.matvec_rs % 2 == 0)
    embd = "token_embd.weight"
    for w, r0, r1 in weights.pieces(embd):
        out.append(ops.get_rows(weights.slots[embd].qtype, w, a("x"), st, n_in=E, y_stride=E, cap=bucket, row0=r0, row1=r1))
    out.append(Barrier())
    for il in range(cfg.n_layer):
        b = f"blk.{il}."
        out.append(ops.rms_norm(a("x"), vec(b + "attn_norm.weight"), a("xn"), st, n=E, x_stride=E, y_stride=E, eps=cfg.rms_eps, cap=bucket))
        out.append(Barrier())
        kc, vc = whole(kv.k[il]), whole(kv.v[il])
        theta = cfg.rope_theta
        qkv = [b + f"attn_{t}.weight" for t in "qkv"]
        if rope_in_proj and all(len(weights.pieces(n)) == 1 for n in qkv):
            # llama decode: q rotated in place, k rotated into the cache, v stored in
            # it, by the projections themselves (matvec.comp's ROPE_OUT)
            for name, dst, n, rot, cache in ((qkv[0], a("q"), Q, True, False), (qkv[1], kc, KVD, True, True),
                                             (qkv[2], vc, KVD, False, True)):
                out.append(ops.matvec_rope(
                    weights.slots[name].qtype, weights.view(name), a("xn"), dst, st, a("factors"),
                    n_in=E, n_rows=n, x_stride=E, y_stride=n, head_dim=hd, rope=rot, theta=theta,
                    to_cache=cache, n_ctx=n_ctx, maxc=bucket,
                ))
        else:
            separate_qkv(il, kc, vc)
        out.append(Barrier())
        out.append(ops.attention(a("q"), kc, vc, a("att"), st, n_head=cfg.n_head, n_head_kv=cfg.n_head_kv, head_dim=hd, n_ctx=n_ctx, q_stride=Q, o_stride=Q, cap=bucket))
        out.append(Barrier())
        ffn_block(il)
    # the head, only for the rows whose logits are wanted
    out.append(ops.get_rows("F32", a("x"), a("hid"), st, n_in=E, y_stride=E, cap=out_cap, id_sel=COUNT_OUT))
    out.append(Barrier())
    out.append(ops.rms_norm(a("hid"), vec("output_norm.weight"), a("hid"), st, n=E, x_stride=E, y_stride=E, eps=cfg.rms_eps, cap=out_cap, count_sel=COUNT_OUT))
    out.append(Barrier())
    head = "token_embd.weight" if cfg.tied_embeddings or "output.weight" not in weights.slots else "output.weight"
    proj(head, a("hid"), a("logits"), E, V, count_sel=COUNT_OUT, cap=out_cap)  # [n_out, n_vocab]
    out.append(Barrier())
    n_bytes = 4 * out_cap * V
    out.append(Copy(a("logits").sub(0, n_bytes), a("readback").sub(0, n_bytes)))
    return out

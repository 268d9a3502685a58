"""Decode attention at depth, op level: the chain of one attention dispatch per layer
(each followed by a barrier, as in the forward pass) over a KV cache of ``depth``
positions, for today's per-head ``attention`` kernel and the split ``attention_decode``
(flash-decoding) in its two forms (``--kernels``: attn_decode.comp, and attn_decode2.comp
whose row groups read the cache coalesced, ``Ops.decode_attn2``), per KV cache type. This is the part of a decode step that grows
with the context (issue 13: llama-1b decodes at 23 tok/s at 32k, llama.cpp at 470);
the rest of the step is the depth-independent graph that ``bench/decode.py`` times.

    .venv/bin/python bench/attn_depth.py --shape llama-1b --depths 1024,8192,32768,131072
    .venv/bin/python bench/attn_depth.py --shape llama-8b --types f16,q8_0 --min-chunk 128,256,512
    .venv/bin/python bench/attn_depth.py --shape llama-1b --kernels decode,decode2 --decode2-rows 2,4,8 --decode2-lanes 0,4

Prints ms per token for the whole chain (all layers), the KV bytes it reads per
second, and the ratio of the two kernels; writes ``bench/results/attn-depth-*.json``.
The cache holds zeros (the time does not depend on the values). Wall-clock per replay
of one recorded graph, so a submit and a fence wait (~20-50 us) are included.
"""

from __future__ import annotations

import argparse
import sys

import common  # noqa: F401  (puts src/ first on sys.path)
import numpy as np

from trio_llm.model.kvtypes import kv_type
from trio_llm.vulkan.device import shared_device
from trio_llm.vulkan.graph import Barrier, Graph, Op
from trio_llm.vulkan.kernels import KernelCache
from trio_llm.vulkan.memory import Allocator, whole
from trio_llm.vulkan.ops import (
    STEP_BYTES,
    Ops,
    attention_counters,
    attention_part_floats,
    decode2_lanes,
    decode_splits,
    fill_step,
)

#: (n_layer, n_head, n_head_kv, head_dim) of the synthetic presets
SHAPES = {
    "tiny": (2, 4, 2, 64),
    "llama-1b": (16, 32, 8, 64),
    "llama-8b": (32, 32, 8, 128),
    "gemma3-4b": (34, 8, 4, 256),
}


def run(args: argparse.Namespace) -> int:
    n_layer, n_head, n_kv, hd = SHAPES[args.shape]
    kvd = n_kv * hd
    device = shared_device()
    alloc = Allocator(device)
    kernels = KernelCache(device)
    sg = device.limits.subgroup_size
    kernel_set = set(args.kernels.split(","))
    if not kernel_set <= {"attention", "decode", "decode2"}:
        print(f"attn_depth: unknown kernels in --kernels {args.kernels} (attention, decode, decode2)", file=sys.stderr)
        return 2
    rows_list = [int(r) for r in args.decode2_rows.split(",")]
    lanes_list = [int(x) for x in args.decode2_lanes.split(",")]
    rows = []
    try:
        for tname in args.types.split(","):
            t = kv_type(tname)
            for depth in (int(d) for d in args.depths.split(",")):
                ntok = args.tokens
                n_ctx = depth
                rb = t.row_bytes(kvd)
                layer = n_ctx * rb
                if layer > device.limits.max_storage_buffer_range:
                    print(f"skip {tname} at {depth}: a layer's cache exceeds the binding range", file=sys.stderr)
                    continue
                bufs = [alloc.create(layer, "kv_cache", "device") for _ in range(2 * n_layer)]
                q = alloc.create(4 * ntok * n_head * hd, "scratch", "upload")
                o = alloc.create(4 * ntok * n_head * hd, "compute", "device")
                step = alloc.create(STEP_BYTES, "scratch", "upload")
                assert q.array is not None and step.array is not None
                q.array[:] = np.random.default_rng(0).standard_normal(q.size // 4).astype(np.float32).view(np.uint8)
                fill_step(step.array.view(np.uint32), np.zeros(ntok, np.uint32),
                          np.arange(depth - ntok, depth, dtype=np.uint32), np.zeros(ntok, np.uint32),
                          np.zeros(0, np.uint32))
                with device.one_shot("zero the cache") as cmd:
                    for b in bufs:
                        device.vk.vkCmdFillBuffer(cmd, b.handle, 0, b.size, 0)
                kw = {"n_head": n_head, "n_head_kv": n_kv, "head_dim": hd, "n_ctx": n_ctx,
                      "q_stride": n_head * hd, "o_stride": n_head * hd, "cap": ntok,
                      "k_type": t.name, "v_type": t.name}
                variants: dict[str, list[Op]] = {}
                ops = Ops(kernels, subgroup=sg)
                if "attention" in kernel_set:
                    variants["attention"] = [x for i in range(n_layer) for x in (
                        ops.attention(whole(q), whole(bufs[2 * i]), whole(bufs[2 * i + 1]), whole(o), whole(step),
                                      **kw),
                        Barrier())]
                extra = []
                forms = [(k, r, la) for k in ("decode", "decode2") if k in kernel_set
                         for r in (rows_list if k == "decode2" else [0])
                         for la in (lanes_list if k == "decode2" else [0])]
                for wg in (int(w) for w in args.decode_wg.split(",")):
                    # min_chunk is a multiple of the work group (two values may round to one)
                    for mc in sorted({max(wg, int(c) // wg * wg) for c in args.min_chunk.split(",")}):
                        n_split = decode_splits(n_ctx, min_chunk=mc, most=args.most)
                        part = alloc.create(4 * attention_part_floats(ntok, n_head, hd, n_split), "compute", "device")
                        cnt = alloc.create(4 * attention_counters(ntok, n_head, n_kv), "compute", "device")
                        with device.one_shot("zero counters") as cmd:
                            device.vk.vkCmdFillBuffer(cmd, cnt.handle, 0, cnt.size, 0)
                        extra += [part, cnt]
                        for form, r, la in forms:
                            dops = Ops(kernels, subgroup=sg, decode_wg=wg, decode_attn2=form == "decode2",
                                       decode2_rows=max(1, r), decode2_lanes=la)
                            if form == "decode2" and not dops.decode2_ok(n_head, n_kv, hd):
                                print(f"skip decode2 wg{wg} lanes{la}: attn_decode2 cannot run here", file=sys.stderr)
                                continue
                            lanes = la or decode2_lanes(hd, sg)
                            name = f"{form} wg{wg} chunk{mc} split{n_split}" + (f" r{r} l{lanes}" if r else "")
                            variants[name] = [x for i in range(n_layer) for x in (
                                dops.attention_decode(whole(q), whole(bufs[2 * i]), whole(bufs[2 * i + 1]), whole(o),
                                                      whole(part), whole(cnt), whole(step), n_split=n_split,
                                                      min_chunk=mc, **kw),
                                Barrier())]
                kv_bytes = 2 * n_layer * depth * rb
                base_ms = None
                for name, chain in variants.items():
                    graph = Graph.record(device, chain)
                    try:
                        st = common.repeat(lambda g=graph: common.timed(g.run)[0], args.repeats, args.warmup)
                    finally:
                        graph.close()
                    ms = 1e3 * st.median
                    base_ms = ms if base_ms is None else base_ms
                    rows.append({"type": t.name, "depth": depth, "kernel": name, "ms_per_token": ms,
                                 "kv_GB_per_s": kv_bytes / (ms / 1e3) / 1e9, "speedup": base_ms / ms,
                                 "times_s": st})
                    print(f"{t.name:5} {depth:7} {name:32} {ms:9.3f} ms  {kv_bytes / (ms / 1e3) / 1e9:8.1f} GB/s"
                          f"  x{base_ms / ms:.2f}", flush=True)
                for b in [*bufs, q, o, step, *extra]:
                    alloc.free(b)
    finally:
        kernels.close()
        alloc.free_all()
    path = common.write_result(f"attn-depth-{args.shape}", {**vars(args), "device": device.name}, rows)
    common.print_table([{k: v for k, v in r.items() if k != "times_s"} for r in rows])
    print(f"wrote {path}")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="llama-1b")
    ap.add_argument("--types", default="f16,q8_0,f32")
    ap.add_argument("--depths", default="512,4096,32768")
    ap.add_argument("--tokens", type=int, default=1, help="decode tokens per step (one sequence)")
    ap.add_argument("--decode-wg", default="128", help="attention_decode work-group sizes to try")
    ap.add_argument("--min-chunk", default="256", help="attention_decode min_chunk values to try")
    ap.add_argument("--most", type=int, default=64, help="most splits (decode_splits' cap)")
    ap.add_argument("--kernels", default="attention,decode",
                    help="which to time, the first the baseline: attention (per head), decode (attn_decode.comp), "
                         "decode2 (attn_decode2.comp, the coalesced form)")
    ap.add_argument("--decode2-rows", default="4", help="attn_decode2's rows in flight per lane to try")
    ap.add_argument("--decode2-lanes", default="0",
                    help="attn_decode2's lanes per K/V row to try (0: decode2_lanes' choice, head_dim / 8)")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    return run(ap.parse_args())


if __name__ == "__main__":
    sys.exit(main())

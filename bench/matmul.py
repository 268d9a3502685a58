"""The prefill's dense products, op level: one ``Ops.matmul`` (y = W x for every token
of a chunk) per shape of llama-1b and llama-8b (q / o, k / v, gate / up, down), weight
type and token count, on each kernel variant: ``cm2`` (matmul_cm2.comp, the default on
cooperative matrices), ``nv2`` (matmul_nv2.comp, VK_NV_cooperative_matrix2: the default
where the device has it; its tiles are ``shaders.NV2_TILES``), the matmul_cm3.comp forms of ``TRIO_LLM_CM2_VARIANT``
(``shaders.CM3_SWEEP`` by default: "v", "v+db+direct", ...), ``cm`` (matmul_cm.comp,
``TRIO_LLM_MATMUL_CM2=0``) and ``scalar`` (matmul.comp, devices without cooperative
matrices); each on the tile the backend picks ("auto") and, with ``--tiles``, on every
tile forced (``TRIO_LLM_CM2_TILE``) that the variant has a layout and shared memory for.
A variant the device cannot run is left out with a line on stderr.

    .venv/bin/python bench/matmul.py                              # the sweep (a GPU)
    .venv/bin/python bench/matmul.py --shapes llama-8b --types Q4_K,Q6_K,Q8_0 --tokens 512 --tiles all
    .venv/bin/python bench/matmul.py --variants cm2,v+db+direct --best 2 --best-out /tmp/best.txt
    .venv/bin/python bench/matmul.py --variants cm2,nv2 --tiles all      # NVIDIA's cooperative_matrix2
    .venv/bin/python bench/matmul.py --shapes small --emulate --repeats 1   # lavapipe: a dry run

Prints ms per product and TFLOP/s (2 rows n_in tokens / time), then per variant the
time of one layer's products of each model (q, k, v, o, gate, up, down at the first
token count, each variant on its auto tiles) against cm2's; writes
``bench/results/matmul-*.json``. ``--best N`` names the N matmul_cm3 variants with the
lowest layer time relative to cm2's summed over the models (in their main weight type:
llama-1b Q8_0, llama-8b Q4_K), ``--best-out`` writes them
one per line (bench/h200.sh cm2sweep runs whole pp512s on them). Time per product: a
graph of ``--per-graph`` dispatches with a barrier after each (as the forward pass runs
them: each product alone on the GPU), wall clock of its replay (one submit and fence
wait) divided by that count. Weights are random blocks of the type (sane f16 scales
where ``SCALES`` knows the type; the time does not depend on the values), activations
random normal f32; ``--check`` (on by default) reads each kind's y back once and holds it
to the first kind's within ``--check-tol`` (the err column; a kind that leaves it is
printed BAD and never named best), so a variant wrong on the GPU shows in the sweep
itself. ``--emulate`` (a device
without cooperative matrices, lavapipe) runs cm2 and the cm3 variants in their
CM_EMULATE form, which checks this script and the variants' plumbing, not a figure.
"""

from __future__ import annotations

import argparse
import math
import sys
from typing import Any

import attrs
import common
import numpy as np

from trio_llm.errors import ConfigError
from trio_llm.vulkan import shaders
from trio_llm.vulkan.device import shared_device
from trio_llm.vulkan.graph import Barrier, Copy, Graph, Op
from trio_llm.vulkan.kernels import KernelCache
from trio_llm.vulkan.memory import Allocator, Buffer, whole
from trio_llm.vulkan.ops import NV2_QTYPES, STEP_BYTES, Ops, cm2_tile, row_bytes

#: (label, rows, n_in, products of that shape per layer) of each model's dense products
SHAPES = {
    "llama-1b": [("q/o", 2048, 2048, 2), ("k/v", 512, 2048, 2), ("gate/up", 8192, 2048, 2), ("down", 2048, 8192, 1)],
    "llama-8b": [("q/o", 4096, 4096, 2), ("k/v", 1024, 4096, 2), ("gate/up", 14336, 4096, 2),
                 ("down", 4096, 14336, 1)],
    # lavapipe: odd sizes (neither a multiple of any tile), fast to emulate
    "small": [("a", 200, 256, 1), ("b", 136, 512, 1)],
}
#: ``--types model``: the weight types each model's products have (llama-8b Q4_K_M: Q4_K,
#: with Q6_K for some v and down projections)
MODEL_TYPES = {"llama-1b": "Q8_0", "llama-8b": "Q4_K,Q6_K", "small": "Q8_0,Q4_K"}
#: (block bytes, byte offsets of its f16 scale fields) of the quantized types whose
#: random blocks get sane scales, so the products are finite and ``--check`` can compare
SCALES = {"Q8_0": (34, (0,)), "Q4_0": (18, (0,)), "Q4_K": (144, (0, 2)), "Q5_K": (176, (0, 2)), "Q6_K": (210, (208,))}
#: the kinds besides the matmul_cm3 variants
BASE_KINDS = ("cm2", "nv2", "cm", "scalar")


def upload(device: Any, alloc: Allocator, dst: Buffer, data: np.ndarray) -> None:
    stage = alloc.create(data.nbytes, "scratch", "upload")
    try:
        assert stage.array is not None
        stage.array[: data.nbytes] = data.view(np.uint8).reshape(-1)
        with device.one_shot("fill") as cmd:
            device.vk.vkCmdCopyBuffer(cmd, stage.handle, dst.handle, 1, [device.vk.VkBufferCopy(size=data.nbytes)])
    finally:
        alloc.free(stage)


def weights(rng: np.random.Generator, qtype: str, nbytes: int) -> tuple[np.ndarray, bool]:
    """Random weights of ``nbytes`` and whether their products are finite (float types:
    normal values; the types of ``SCALES``: random blocks with f16 scales of about 2^-8)."""
    if qtype in ("F16", "F32"):
        dt = np.float16 if qtype == "F16" else np.float32
        return (rng.standard_normal(nbytes // np.dtype(dt).itemsize) * 0.05).astype(dt).view(np.uint8), True
    raw = rng.integers(0, 256, nbytes, dtype=np.uint8)
    if qtype not in SCALES:
        return raw, False
    size, fields = SCALES[qtype]
    blocks = raw.reshape(-1, size)
    for f in fields:
        scale = (rng.uniform(0.5, 1.0, len(blocks)) / 256).astype(np.float16)
        blocks[:, f : f + 2] = scale.view(np.uint8).reshape(-1, 2)
    return raw, True


def kind_ops(base: Ops, kind: str, tile: tuple[int, int] | None, emulate: bool) -> Ops | None:
    """The Ops that run ``kind`` (None: not on this device)."""
    dev = base.kernels.device
    coop = dev.coopmat
    if kind == "scalar":
        return attrs.evolve(base, coopmat=False, matmul_cm2=False, matmul_nv2=False, matmul_cm2_emulate=0)
    if kind == "cm":
        return (attrs.evolve(base, coopmat=True, matmul_cm2=False, matmul_nv2=False, matmul_cm2_emulate=0)
                if coop else None)
    if kind == "nv2":  # matmul_nv2 (no emulated form: a device with the NV extension or nothing)
        if not (coop and dev.nv_coopmat2 and dev.nv_coopmat2_decode):
            return None
        return attrs.evolve(base, coopmat=True, matmul_nv2=True, matmul_nv2_types=NV2_QTYPES, matmul_cm2_variant=None,
                            matmul_cm2_emulate=0, matmul_nv2_tile=tile)
    if not coop and not emulate:
        return None
    v = None if kind == "cm2" else shaders.cm3_variant(kind)
    return attrs.evolve(base, coopmat=coop, matmul_cm2=True, matmul_nv2=False, matmul_cm2_variant=v,
                        matmul_cm2_tile=tile, matmul_cm2_emulate=32 if emulate and not coop else 0)


def chosen_tile(ops: Ops, kind: str, n_rows: int, cap: int) -> str:
    if kind in ("cm", "scalar"):
        return "64x64"
    if kind == "nv2":
        plan = ops.nv2_plan("Q8_0", n_rows, cap)
        assert plan is not None
        return f"{plan[0]}x{plan[1]}" + (f"k{plan[2]}" if plan[2] != shaders.NV2_BK else "")
    v = ops.matmul_cm2_variant
    sub = ops.matmul_cm2_emulate or ops.subgroup
    bm, bn = ops.matmul_cm2_tile or (cm2_tile(n_rows, cap, ops.matmul_cm2_min_groups) if v is None
                                     else ops.cm3_tile(n_rows, cap, sub, v))
    return f"{bm}x{bn}"


def run(args: argparse.Namespace) -> int:
    device = shared_device()
    alloc = Allocator(device)
    kernels = KernelCache(device)
    base = Ops(kernels, subgroup=device.limits.subgroup_size)
    kinds = args.variants.split(",") if args.variants else ["cm2", *shaders.CM3_SWEEP]
    for k in kinds:
        if k not in BASE_KINDS:
            try:
                shaders.cm3_variant(k)
            except ValueError as exc:
                print(f"bench/matmul.py: --variants: {exc}", file=sys.stderr)
                return 2
    names = {f"{bm}x{bn}": (bm, bn) for bm, bn in dict.fromkeys((*shaders.CM3_TILES, *shaders.NV2_TILES))}
    tiles: list[tuple[int, int] | None] = []
    for t in args.tiles.split(","):
        if t in ("auto", "all"):
            tiles += [None, *(names.values() if t == "all" else [])]
        elif t in names:
            tiles.append(names[t])
        else:
            print(f"bench/matmul.py: --tiles: {t!r} is not auto, all or one of {', '.join(names)}", file=sys.stderr)
            return 2
    tiles = list(dict.fromkeys(tiles))
    token_counts = [int(t) for t in args.tokens.split(",")]
    rng = np.random.default_rng(0)
    rows_out: list[dict[str, Any]] = []
    bad: set[str] = set()  # kinds whose y left --check-tol of the first kind's somewhere
    try:
        for model in args.shapes.split(","):
            if model not in SHAPES:
                print(f"bench/matmul.py: --shapes: {model!r} is not one of {', '.join(SHAPES)}", file=sys.stderr)
                return 2
            for label, n_rows, n_in, count in SHAPES[model]:
                types = {"model": MODEL_TYPES[model], "main": MODEL_TYPES[model].split(",")[0]}.get(args.types, args.types)
                for qtype in types.split(","):
                    nbytes = n_rows * row_bytes(qtype, n_in)
                    w = alloc.create(nbytes, "weights", "device")
                    wdata, finite = weights(rng, qtype, nbytes)
                    upload(device, alloc, w, wdata)
                    for ntok in token_counts:
                        x = alloc.create(4 * ntok * n_in, "compute", "device")
                        upload(device, alloc, x, rng.standard_normal(ntok * n_in).astype(np.float32))
                        y = alloc.create(4 * ntok * n_rows, "compute", "device")
                        st = alloc.create(STEP_BYTES, "scratch", "upload")
                        assert st.array is not None
                        st.array[:16] = np.array([ntok, 0, 0, 0], np.uint32).view(np.uint8)  # only the count is read
                        flops = 2.0 * n_rows * n_in * ntok
                        back = alloc.create(4 * ntok * n_rows, "scratch", "readback") if args.check and finite else None
                        ref: np.ndarray | None = None  # the first kind's y, which the others are held to
                        for kind in kinds:
                            # cm2 and nv2 take their own tiles only; cm and scalar have one
                            kt = ([t for t in tiles if t is None or t in shaders.CM2_TILES] if kind == "cm2" else
                                  [t for t in tiles if t is None or t in shaders.NV2_TILES] if kind == "nv2" else
                                  [None] if kind in ("cm", "scalar") else tiles)
                            for tile in kt:
                                ops = kind_ops(base, kind, tile, args.emulate)
                                if ops is None:
                                    print(f"skip {kind}: not on {device.name}", file=sys.stderr)
                                    break
                                try:
                                    d = ops.matmul(qtype, whole(w), whole(x), whole(y), whole(st), n_in=n_in,
                                                   n_rows=n_rows, x_stride=n_in, y_stride=n_rows, cap=ntok)
                                    tname = chosen_tile(ops, kind, n_rows, ntok)
                                except (ConfigError, ValueError) as exc:
                                    t = f"{tile[0]}x{tile[1]}" if tile else "auto"
                                    print(f"skip {kind} {t}: {exc}", file=sys.stderr)
                                    continue
                                chain: list[Op] = []
                                for _ in range(args.per_graph):
                                    chain += [d, Barrier()]
                                graph = Graph.record(device, chain)
                                try:
                                    s = common.repeat(lambda g=graph: common.timed(g.run)[0], args.repeats,
                                                      args.warmup)
                                finally:
                                    graph.close()
                                err = None
                                if back is not None:  # y once more, read back, against the first kind's
                                    g1 = Graph.record(device, [d, Barrier(), Copy(whole(y), whole(back))])
                                    try:
                                        g1.run("check")
                                    finally:
                                        g1.close()
                                    assert back.array is not None
                                    got = back.array[: 4 * ntok * n_rows].view(np.float32).copy()
                                    if ref is None:
                                        ref = got
                                    err = float(np.abs(got - ref).max() / max(float(np.abs(ref).max()), 1e-30))
                                    if not err <= args.check_tol:
                                        bad.add(kind)
                                ms = s.median / args.per_graph * 1e3
                                row = {"model": model, "shape": label, "rows": n_rows, "n_in": n_in, "per_layer": count,
                                       "type": qtype, "tokens": ntok, "variant": kind,
                                       "tile": tname if tile is None else tname + "!", "kernel": d.kernel.name,
                                       "ms": ms, "tflops": flops / (ms / 1e3) / 1e12, "err": err, "times_s": s}
                                rows_out.append(row)
                                flag = "" if err is None else f"  err {err:.1e}" + ("" if err <= args.check_tol else " BAD")
                                print(f"{model:8} {label:7} {n_rows:5}x{n_in:<5} {qtype:4} {ntok:5} {kind:18} "
                                      f"{row['tile']:8} {ms:9.4f} ms {row['tflops']:8.2f} TFLOP/s{flag}", flush=True)
                        for b in (x, y, st, back):
                            alloc.free(b)
                    alloc.free(w)
    finally:
        kernels.close()
        alloc.free_all()
    summary = layer_summary(rows_out, token_counts[0])
    best = [v for v, _ in sorted(((v, r) for v, r in summary["score"].items() if v not in BASE_KINDS and v not in bad),
                                 key=lambda vr: vr[1])][: args.best]
    path = common.write_result("matmul", {**vars(args), "device": device.name},
                               {"rows": rows_out, "summary": summary, "best": best, "bad": sorted(bad)})
    common.print_table([{k: v for k, v in r.items() if k not in ("times_s", "per_layer")} for r in rows_out])
    print()
    common.print_table(summary["table"])
    if bad:
        print(f"NOT WITHIN --check-tol of the first kind's y (left out of --best): {', '.join(sorted(bad))}")
    if best:
        print(f"best matmul_cm3 variants (layer time against cm2, summed over the models): {', '.join(best)}")
    if args.best_out:
        with open(args.best_out, "w") as f:
            f.write("".join(f"{v}\n" for v in best))
    print(f"wrote {path}")
    return 0


def layer_summary(rows: list[dict[str, Any]], ntok: int) -> dict[str, Any]:
    """Per (model, type, variant): one layer's products at ``ntok`` tokens on the auto
    tiles (each shape times its count per layer), and the ratio to cm2's; a variant's
    score is that ratio summed over the models in their main type (llama-1b Q8_0,
    llama-8b Q4_K: most of each file's weights; every type where none of those ran)
    where both ran every shape."""
    auto = [r for r in rows if r["tokens"] == ntok and not r["tile"].endswith("!")]
    layer: dict[tuple[str, str, str], float] = {}
    shapes: dict[tuple[str, str, str], int] = {}
    for r in auto:
        key = (r["model"], r["type"], r["variant"])
        layer[key] = layer.get(key, 0.0) + r["ms"] * r["per_layer"]
        shapes[key] = shapes.get(key, 0) + 1
    table, score = [], {}
    main = {(m, t.split(",")[0]) for m, t in MODEL_TYPES.items()}
    scored = main if any(k[:2] in main for k in layer) else {k[:2] for k in layer}
    for (model, qtype, variant), ms in sorted(layer.items()):
        ref = layer.get((model, qtype, "cm2"))
        whole_set = shapes[model, qtype, variant] == len(SHAPES[model])
        ratio = ms / ref if ref and whole_set and shapes.get((model, qtype, "cm2")) == len(SHAPES[model]) else None
        table.append({"model": model, "type": qtype, "tokens": ntok, "variant": variant, "layer_ms": ms,
                      "vs_cm2": ratio if ratio is not None else math.nan})
        if ratio is not None and (model, qtype) in scored:
            score[variant] = score.get(variant, 0.0) + ratio
    return {"tokens": ntok, "table": table, "score": score}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="llama-1b,llama-8b", help=f"of {', '.join(SHAPES)}")
    ap.add_argument("--types", default="model",
                    help="weight types (Q8_0,Q4_K,Q6_K) for every shape; model: each model's own (MODEL_TYPES), "
                         "main: the first of those")
    ap.add_argument("--tokens", default="512,2048")
    ap.add_argument("--variants", default="",
                    help="cm2, cm, scalar and matmul_cm3 specs (v+db+direct, ...); default cm2 and shaders.CM3_SWEEP")
    ap.add_argument("--tiles", default="auto", help="auto (the backend's choice), all (auto and every tile "
                                                    "forced), tiles (128x128,256x128) or both (auto,128x128)")
    ap.add_argument("--emulate", action="store_true",
                    help="without cooperative matrices: cm2 and the cm3 variants emulated (a dry run, not a figure)")
    ap.add_argument("--per-graph", type=int, default=10, help="dispatches per timed graph")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--check", action=argparse.BooleanOptionalAction, default=True,
                    help="each kind's y read back once and held to the first kind's (cm2 by default)")
    ap.add_argument("--check-tol", type=float, default=5e-3,
                    help="most |y - y_first| relative to max |y_first| (f16 rounding: the bound the tests use)")
    ap.add_argument("--best", type=int, default=2, help="how many matmul_cm3 variants to name as best")
    ap.add_argument("--best-out", default="", help="write the best variants' names here, one per line")
    return run(ap.parse_args())


if __name__ == "__main__":
    sys.exit(main())

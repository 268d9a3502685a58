"""Prefill attention of whole prompts, op level: every chunk of a ``length``-token prompt
(chunks of 512 tokens, as the backend runs them, the chunk at positions [c, c + 512)
attending to all the positions before it) through one attention dispatch per layer,
each followed by a barrier, for the per-(head, token) ``attention`` kernel and the tiled
``attention_prefill`` (scalar, and on cooperative matrices where the device has them:
its tile sizes, its staged form, its keys split over 2 or 4 work groups plus the
combine; ``prefill_cm2*``: attn_prefill_cm2.comp, each subgroup owning its rows, with its
keys per tile and split the same way; ``cm3_<variant>*``: attn_prefill_cm3.comp in each of
``--variants`` (TRIO_LLM_PREFILL_CM2_VARIANT's spellings), split the same way;
``prefill_nv2*``: attn_prefill_nv2.comp (NVIDIA's cooperative_matrix2) as planned, and
``nv2_<tile>:<form>`` for each of ``--nv2``, split the same way; ``prefill`` / ``prefill_cm`` is what the forward pass runs up to 8k of
context, split in 2 at 16k and in 4 from 32k, which only the coopmat kernel's
``_split2`` / ``_split4`` rows here time).
This is the part of a prefill that grows with the square of the prompt (issue 13:
llama-1b prefilled 8k / 32k prompts at 3,974 / 1,245 tok/s, llama.cpp CUDA at 47,156 /
35,805); the projections are the rest (``bench/decode.py --pp N`` times a whole prefill
through the backend).

    .venv/bin/python bench/prefill.py --shape llama-1b --lengths 512,8192,32768
    .venv/bin/python bench/prefill.py --shape llama-8b --types f16,q8_0 --old-max 8192
    .venv/bin/python bench/prefill.py --rows 16,32 --rows-cm 32,64   # tile sizes side by side
    .venv/bin/python bench/prefill.py --lengths 8192,32768 --tail 64  # 64 new tokens after a cached prefix
    .venv/bin/python bench/prefill.py --lengths 512,8192 --kernels prefill_cm,prefill_cm2,prefill_cm2_k32
    .venv/bin/python bench/prefill.py --lengths 32768 --kernels prefill_cm2,cm3_v,cm3_v+db,cm3_v+db_split4

Prints seconds per prompt for the attention of all layers and tokens per second of it,
and the speed-up over ``attention``; writes ``bench/results/prefill-attn-*.json``. The
cache and queries are random (the time hardly depends on them). Wall-clock per replay
of one recorded graph (one submit and a fence wait included).
"""

from __future__ import annotations

import argparse
import functools
import math
import sys

import attrs
import common
import numpy as np

from trio_llm.model.kvtypes import kv_type, quantize_rows
from trio_llm.vulkan.device import shared_device
from trio_llm.vulkan.graph import Barrier, Graph, Op
from trio_llm.vulkan.kernels import KernelCache
from trio_llm.vulkan.memory import Allocator, whole
from trio_llm.vulkan.ops import (
    STEP_BYTES,
    Ops,
    attention_counters,
    attention_part_floats,
    decode_splits,
    fill_step,
)
from trio_llm.vulkan.shaders import ATTN_SWEEP, attn_variant

#: (n_layer, n_head, n_head_kv, head_dim) of the synthetic presets
SHAPES = {
    "tiny": (2, 4, 2, 64),
    "llama-1b": (16, 32, 8, 64),
    "llama-8b": (32, 32, 8, 128),
    "gemma3-4b": (34, 8, 4, 256),
}
CHUNK = 512


def run(args: argparse.Namespace) -> int:
    n_layer, n_head, n_kv, hd = SHAPES[args.shape]
    kvd = n_kv * hd
    device = shared_device()
    alloc = Allocator(device)
    kernels = KernelCache(device)
    base = Ops(kernels, subgroup=device.limits.subgroup_size, prefill_cm2=False,
               prefill_cm2_variant=None, prefill_nv2=False)  # each kind sets its own
    kinds = {"attention": base.attention}
    for r in (int(x) for x in args.rows.split(",")):
        kinds[f"prefill_r{r}" if r else "prefill"] = attrs.evolve(base, prefill_rows=r).attention_prefill
    if device.coopmat:
        for r in (int(x) for x in args.rows_cm.split(",")):
            kinds[f"prefill_cm_r{r}" if r else "prefill_cm"] = attrs.evolve(
                base, coopmat=True, prefill_cm=True, prefill_rows_cm=r).attention_prefill
        kinds["prefill_cm_staged"] = attrs.evolve(base, coopmat=True, prefill_cm=True,
                                                  prefill_cm_stage=True).attention_prefill
    # attn_prefill_cm2 (each subgroup owns its 16 rows; TRIO_LLM_PREFILL_CM2=1): the keys
    # per tile it picks, and each other that fits (a kind it cannot run is left out, not
    # run on attn_prefill_cm under its name); --emulate: its products emulated, a dry run
    emu = args.emulate and not device.coopmat
    cm3_kinds: dict[str, Ops] = {}
    if device.coopmat or emu:
        cm2 = attrs.evolve(base, coopmat=True, prefill_cm2=True, prefill_cm2_emulate=32 if emu else 0,
                           prefill_rows_cm=32 if emu else 0)
        plan = cm2.prefill_cm2_plan(n_head, n_kv, hd)
        if plan is not None:
            kinds["prefill_cm2"] = cm2.attention_prefill
            for keys in (64, 32, 16):
                k2 = attrs.evolve(cm2, prefill_cm2_keys=keys)
                if keys != plan[1] and k2.prefill_cm2_ok(n_head, n_kv, hd):
                    kinds[f"prefill_cm2_k{keys}"] = k2.attention_prefill
            for r in (int(x) for x in args.rows_cm.split(",")):  # other row tiles, their keys per tile
                r2 = attrs.evolve(cm2, prefill_rows_cm=r)
                if r and r2.prefill_cm2_ok(n_head, n_kv, hd):
                    kinds[f"prefill_cm2_r{r}"] = r2.attention_prefill
        else:
            print(f"no prefill_cm2 kinds: attn_prefill_cm2 does not run head_dim {hd} here", file=sys.stderr)
        # attn_prefill_cm3 in each variant of --variants (TRIO_LLM_PREFILL_CM2_VARIANT), where
        # its plan fits the device (at head_dim 256 too): cm3_<variant>, and _split<n> below
        for spec in filter(None, args.variants.split(",")):
            c3 = attrs.evolve(cm2, prefill_cm2_variant=attn_variant(spec))
            if c3.prefill_cm3_plan(n_head, n_kv, hd) is not None:
                cm3_kinds[f"cm3_{spec}"] = c3
                kinds[f"cm3_{spec}"] = c3.attention_prefill
            else:
                print(f"no cm3_{spec}: attn_prefill_cm3 {spec} does not fit head_dim {hd} here", file=sys.stderr)
    # attn_prefill_nv2 (VK_NV_cooperative_matrix2, TRIO_LLM_PREFILL_NV2): its plan as
    # prefill_nv2 (and _split<n> below), and each of --nv2 ("ROWSxKEYSxLANES:FORM") as
    # nv2_<spec>, where the device has the extension and the plan takes the tile
    nv2_kinds: dict[str, Ops] = {}
    if device.nv_coopmat2:
        nv2 = attrs.evolve(base, coopmat=True, prefill_nv2=True)
        if nv2.prefill_nv2_plan(n_head, n_kv, hd) is not None:
            nv2_kinds["prefill_nv2"] = nv2
        for spec in filter(None, args.nv2.split(",")):
            tile, _, form = spec.partition(":")
            r, k, w = (int(x) for x in tile.split("x"))
            n2 = attrs.evolve(nv2, prefill_nv2_tile=(r, k, w), prefill_nv2_form=form or "pf")
            if n2.prefill_nv2_plan(n_head, n_kv, hd) is not None:
                nv2_kinds[f"nv2_{spec}"] = n2
            else:
                print(f"no nv2_{spec}: attn_prefill_nv2 does not take it for head_dim {hd} here", file=sys.stderr)
        for name2, n2 in nv2_kinds.items():
            kinds[name2] = n2.attention_prefill
    chosen = args.kernels.split(",") if args.kernels else []  # [] = every kernel in kinds
    rows = []
    rng = np.random.default_rng(0)
    try:
        for tname in args.types.split(","):
            t = kv_type(tname)
            for length in (int(n) for n in args.lengths.split(",")):
                rb = t.row_bytes(kvd)
                if length * rb > device.limits.max_storage_buffer_range:
                    print(f"skip {tname} at {length}: a layer's cache exceeds the binding range", file=sys.stderr)
                    continue
                layers = min(n_layer, args.layers) if args.layers else n_layer
                bufs = [alloc.create(length * rb, "kv_cache", "device") for _ in range(2 * layers)]
                raw = (rng.standard_normal(length * kvd) * 0.5).astype(np.float32)
                cache = quantize_rows(raw.reshape(length, kvd), t.name).reshape(-1)
                stage = alloc.create(cache.nbytes, "scratch", "upload")
                assert stage.array is not None
                stage.array[: cache.nbytes] = cache.view(np.uint8)
                with device.one_shot("fill the cache") as cmd:
                    for b in bufs:
                        device.vk.vkCmdCopyBuffer(cmd, stage.handle, b.handle, 1,
                                                  [device.vk.VkBufferCopy(size=cache.nbytes)])
                alloc.free(stage)
                q = alloc.create(4 * CHUNK * n_head * hd, "scratch", "upload")
                o = alloc.create(4 * CHUNK * n_head * hd, "compute", "device")
                assert q.array is not None
                q.array[: q.size] = rng.standard_normal(q.size // 4).astype(np.float32).view(np.uint8)
                # the whole prompt in chunks, or (--tail N) only its last N tokens, as a
                # prompt whose prefix is reused from the cache
                spans = ([(length - args.tail, args.tail)] if args.tail else
                         [(c * CHUNK, min(CHUNK, length - c * CHUNK)) for c in range(math.ceil(length / CHUNK))])
                cap = max(8, 1 << (max(n for _, n in spans) - 1).bit_length())  # the bucket
                steps = []
                for p0, n in spans:
                    st = alloc.create(STEP_BYTES, "scratch", "upload")
                    assert st.array is not None
                    fill_step(st.array.view(np.uint32), np.zeros(n, np.uint32),
                              np.arange(p0, p0 + n, dtype=np.uint32), np.zeros(n, np.uint32), np.zeros(0, np.uint32))
                    steps.append(st)
                kw = {"n_head": n_head, "n_head_kv": n_kv, "head_dim": hd, "n_ctx": length,
                      "q_stride": n_head * hd, "o_stride": n_head * hd, "cap": cap,
                      "k_type": t.name, "v_type": t.name}
                n_split = decode_splits(length)
                part = alloc.create(4 * attention_part_floats(cap, n_head, hd, n_split), "compute", "device")
                cnt = alloc.create(4 * attention_counters(cap, n_head, n_kv), "compute", "device")
                with device.one_shot("zero counters") as cmd:
                    device.vk.vkCmdFillBuffer(cmd, cnt.handle, 0, cnt.size, 0)
                kinds["decode"] = functools.partial(base.attention_decode, part=whole(part), counters=whole(cnt),
                                                    n_split=n_split)
                splits = [int(x) for x in args.splits.split(",") if int(x) > 1] if device.coopmat or emu else []
                spart = alloc.create(4 * attention_part_floats(cap, n_head, hd, max(splits, default=1)),
                                     "compute", "device")
                cm = attrs.evolve(base, coopmat=True, prefill_cm=True, prefill_cm_emulate=emu, prefill_rows_cm=32 if emu else 0)
                for n in splits:  # the keys split over work groups, then the combine
                    def split_ops(q, kc, vc, o, step, n=n, cm=cm, spart=spart, **kw):  # type: ignore[no-untyped-def]
                        return [cm.attention_prefill(q, kc, vc, o, step, part=whole(spart), n_split=n, **kw),
                                Barrier(),
                                cm.attention_combine(whole(spart), o, step, n_head=kw["n_head"],
                                                     head_dim=kw["head_dim"], n_split=n, o_stride=kw["o_stride"],
                                                     cap=kw["cap"])]
                    kinds[f"prefill_cm_split{n}"] = split_ops
                    if "prefill_cm2" in kinds:
                        kinds[f"prefill_cm2_split{n}"] = functools.partial(split_ops, cm=cm2)
                    for name3, c3 in cm3_kinds.items():
                        kinds[f"{name3}_split{n}"] = functools.partial(split_ops, cm=c3)
                    for name2, n2 in nv2_kinds.items():
                        kinds[f"{name2}_split{n}"] = functools.partial(split_ops, cm=n2)
                base_s = None
                ref_o: np.ndarray | None = None  # --check: the first kind's output, which the others are held to
                back = alloc.create(o.size, "scratch", "readback") if args.check else None
                for name in chosen or list(kinds):
                    if name not in kinds:
                        print(f"skip {name}: not on {device.name}", file=sys.stderr)
                        continue
                    if (name == "attention" and length > args.old_max and not args.tail
                            or name == "decode" and not args.tail):
                        continue
                    fn = kinds[name]
                    chain: list[Op] = []
                    for st in steps:
                        for i in range(layers):
                            d = fn(whole(q), whole(bufs[2 * i]), whole(bufs[2 * i + 1]), whole(o), step=whole(st), **kw)
                            chain += [*(d if isinstance(d, list) else [d]), Barrier()]
                    graph = Graph.record(device, chain)
                    try:
                        s = common.repeat(lambda g=graph: common.timed(g.run)[0], args.repeats, args.warmup)
                    finally:
                        graph.close()
                    sec = s.median * n_layer / layers
                    base_s = sec if name == "attention" else base_s
                    n_tok = args.tail or length
                    err = None
                    if back is not None:  # the last chunk's output of the last layer, against the first kind's
                        with device.one_shot("read o") as cmd:
                            device.vk.vkCmdCopyBuffer(cmd, o.handle, back.handle, 1,
                                                      [device.vk.VkBufferCopy(size=o.size)])
                        assert back.array is not None
                        got = back.array[: 4 * spans[-1][1] * n_head * hd].view(np.float32).copy()
                        if ref_o is None:
                            ref_o = got
                        err = float(np.abs(got - ref_o).max() / max(float(np.abs(ref_o).max()), 1e-30))
                    rows.append({"type": t.name, "length": length, "tail": args.tail, "kernel": name,
                                 "s_per_prompt": sec, "attn_tok_per_s": n_tok / sec,
                                 "speedup": (base_s / sec) if base_s else None, "times_s": s, "err": err})
                    extra = f"  x{base_s / sec:.2f}" if base_s else ""
                    if err is not None:
                        extra += f"  err {err:.1e}{'  BAD' if not err <= args.check_tol else ''}"
                    print(f"{t.name:5} {length:7} {name:12} {sec:9.4f} s  {n_tok / sec:10.0f} tok/s{extra}",
                          flush=True)
                for b in [*bufs, q, o, *steps, part, cnt, spart, *([back] if back is not None else [])]:
                    alloc.free(b)
    finally:
        kernels.close()
        alloc.free_all()
    path = common.write_result(f"prefill-attn-{args.shape}", {**vars(args), "device": device.name}, rows)
    common.print_table([{k: v for k, v in r.items() if k != "times_s"} for r in rows])
    print(f"wrote {path}")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="llama-1b")
    ap.add_argument("--types", default="f16")
    ap.add_argument("--lengths", default="512,8192,32768")
    ap.add_argument("--kernels", default="", help="attention,prefill,prefill_cm,prefill_cm2,... (default: all of them)")
    ap.add_argument("--rows", default="0", help="query rows per work group of the scalar kernel to try (0: default)")
    ap.add_argument("--rows-cm", default="0", help="the same for the coopmat kernel (16, 32, 64; 0: default)")
    ap.add_argument("--variants", default=",".join(ATTN_SWEEP),
                    help="attn_prefill_cm3 variants to time as cm3_<variant> (TRIO_LLM_PREFILL_CM2_VARIANT specs; "
                         "empty: none)")
    ap.add_argument("--nv2", default="",
                    help="attn_prefill_nv2 tiles and forms to time as nv2_<spec> beside prefill_nv2 (its plan): "
                         "ROWSxKEYSxLANES:FORM, e.g. 64x64x128:pf,128x64x256:direct")
    ap.add_argument("--old-max", type=int, default=8192, help="longest prompt the old attention kernel runs")
    ap.add_argument("--splits", default="2,4", help="key splits of the coopmat kernel to try (with the combine)")
    ap.add_argument("--emulate", action="store_true",
                    help="without cooperative matrices: the split and cm2 kinds on the emulated kernels (a dry run, not a figure)")
    ap.add_argument("--tail", type=int, default=0,
                    help="only the last N tokens of each prompt (a reused prefix), with attention_decode too")
    ap.add_argument("--layers", type=int, default=0, help="layers actually run (times scaled to all); 0: all")
    ap.add_argument("--check", action="store_true",
                    help="read each kind's output back (the last chunk, last layer) and hold it to the first kind's: "
                         "a kind off by more than --check-tol of the largest value is printed BAD")
    ap.add_argument("--check-tol", type=float, default=5e-3)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    return run(ap.parse_args())


if __name__ == "__main__":
    sys.exit(main())

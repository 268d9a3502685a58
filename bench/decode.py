"""Decode (tg) and prefill (pp) speed of the Vulkan backend, with numpy side by side.

    .venv/bin/python bench/decode.py --preset llama-1b --quant Q8_0 [--backends vulkan,numpy]
        [--model PATH] [--pp 512] [--tg 128] [--repeats 3] [--warmup 1]

Like ``llama-bench -p 512 -n 128``: pp is one forward of ``pp`` prompt tokens into an
empty sequence; tg is ``tg`` single-token greedy steps from an empty context, batch 1.
For Vulkan it also replays the recorded decode graph alone (one submit and the GPU
work, no Python around it), counts the Python time of a step as the step's time
outside submit-and-wait, and reports the share of the H200's 4.8 TB/s that the weights read per token use.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import common
import numpy as np

from trio_llm.engine.backend import SeqBatch
from trio_llm.model.gguf import load_gguf

HBM_BYTES_PER_S = 4.8e12


def weight_bytes_per_token(model) -> int:  # type: ignore[no-untyped-def]
    """Bytes of weights one decode step reads: every matrix once, except the embedding,
    of which a step reads one row (unless it doubles as the output head)."""
    total = 0
    tied = "output.weight" not in model.tensors
    for name, t in model.tensors.items():
        if name == "token_embd.weight" and not tied:
            total += t.n_bytes // t.shape[0]
        else:
            total += t.n_bytes
    return total


def raw_copy_bandwidth(be, nbytes: int = 1 << 30, repeats: int = 3) -> dict:  # type: ignore[no-untyped-def]
    """Bytes per second of one ``vkCmdCopyBuffer`` from a host buffer of the weight
    shadows' memory type into device memory, and back: the bound a restore can reach."""
    alloc = be._alloc
    vk = alloc.device.vk
    host = alloc.create(nbytes, "scratch", "host")
    dev = alloc.create(nbytes, "scratch", "device")
    out = {}
    try:
        for name, src, dst in (("host_to_device", host, dev), ("device_to_host", dev, host)):
            times = []
            for _ in range(repeats + 1):
                t0 = common.now()
                with alloc.device.one_shot("raw copy") as cmd:
                    vk.vkCmdCopyBuffer(cmd, src.handle, dst.handle, 1, [vk.VkBufferCopy(size=nbytes)])
                times.append(common.now() - t0)
            out[name + "_bytes_per_s"] = common.stats([nbytes / t for t in times[1:]])
        t0 = common.now()
        alloc.free(dev)
        out["free_1gib_s"] = common.now() - t0
        t0 = common.now()
        dev = alloc.create(nbytes, "scratch", "device")
        out["alloc_1gib_s"] = common.now() - t0
        # the same bytes in four buffers, allocated and freed in four threads
        from concurrent.futures import ThreadPoolExecutor

        alloc.free(dev)
        with ThreadPoolExecutor(4) as pool:
            t0 = common.now()
            quarters = list(pool.map(lambda _: alloc.create(nbytes // 4, "scratch", "device"), range(4)))
            out["alloc_4x_threads_s"] = common.now() - t0
            t0 = common.now()
            list(pool.map(alloc.free, quarters))
            out["free_4x_threads_s"] = common.now() - t0
        dev = alloc.create(256, "scratch", "device")
    finally:
        alloc.free(host)
        alloc.free(dev)
    return out


def residency_phases(be) -> dict:  # type: ignore[no-untyped-def]
    """One release/restore of the weights taken apart: dropping graphs, freeing,
    allocating, copying, and the first forward after (which records its graph)."""
    w = be._weights
    out: dict[str, float] = {}
    step = [SeqBatch(0, np.array([1], np.int32), 0)]
    out["forward_warm_s"] = common.timed(lambda: be.forward(step))[0]
    with be._device.lock:
        out["drop_graphs_s"] = common.timed(be._drop_graphs)[0]
        out["free_weights_s"] = common.timed(w.release_device)[0]

        out["alloc_and_copy_weights_s"] = common.timed(w.upload)[0]
    out["first_forward_s"] = common.timed(lambda: be.forward(step))[0]
    out["weight_bytes"] = w.total_bytes()
    return out


def measure_residency(be, repeats: int) -> dict:  # type: ignore[no-untyped-def]
    """Release and restore at each level: seconds each way and the device bytes left."""
    from trio_llm.engine.backend import Level

    raw_bytes = min(1 << 30, be._weights.total_bytes())
    out: dict = {"raw_copy": raw_copy_bandwidth(be, raw_bytes), "phases": residency_phases(be)}
    step = [SeqBatch(0, np.array([1], np.int32), 0)]
    resident = sum(be.memory().values())
    for level in (Level.WEIGHTS, Level.ALL):
        rel: list[float] = []
        res: list[float] = []
        first: list[float] = []
        cold = 0
        for _ in range(repeats):
            rel.append(common.timed(lambda lv=level: be.release(lv))[0])
            cold = sum(be.memory().values())
            res.append(common.timed(be.restore)[0])
            first.append(common.timed(lambda: be.forward(step))[0])
        out[level.value] = {"release_s": common.stats(rel), "restore_s": common.stats(res),
                            "first_forward_s": common.stats(first),
                            "cold_bytes": cold, "resident_bytes": resident}
    return out


def gpu_breakdown(be, model, replays: int = 20) -> dict:  # type: ignore[no-untyped-def]
    """GPU time of the decode graph and of parts of it, each recorded as its own graph
    and replayed with the step buffer of the last decode step: all of it, all of it
    without barriers (what the barriers cost), and each kernel alone without barriers.
    Parts run without their barriers compute garbage; only their time matters."""
    import attrs

    from trio_llm.vulkan.graph import Barrier, Dispatch, Graph

    ops = be.lowered(1)
    dispatches = [op for op in ops if isinstance(op, Dispatch)]
    parts = {"all": ops, "no_barriers": [op for op in ops if not isinstance(op, Barrier)]}
    for name in sorted({d.kernel.name for d in dispatches}):
        parts["only_" + name] = [d for d in dispatches if d.kernel.name == name]
        # the same dispatches one after another: the latency each adds to the chain
        parts["serial_" + name] = [x for d in parts["only_" + name] for x in (d, Barrier())]
    for rs in (1, 4):  # rows per matvec subgroup other than the default
        alt = be.lowered(1, attrs.evolve(be._ops, matvec_rs=rs))
        parts[f"only_matvec_rs{rs}"] = [d for d in alt if isinstance(d, Dispatch) and d.kernel.name == "matvec"]
        parts[f"no_barriers_rs{rs}"] = [d for d in alt if not isinstance(d, Barrier)]
        parts[f"all_rs{rs}"] = alt
    # the other side of TRIO_LLM_FUSE_NORM: the norms folded into their matvecs or not
    other = be.lowered(1, attrs.evolve(be._ops, fuse_norm=not be._ops.fuse_norm))
    parts["all_fuse_norm_" + ("off" if be._ops.fuse_norm else "on")] = other
    out: dict = {"dispatches": len(dispatches), "barriers": sum(isinstance(op, Barrier) for op in ops),
                 "fuse_norm": be._ops.fuse_norm, "barriers_other_fuse_norm": sum(isinstance(op, Barrier) for op in other)}
    device = be._device
    with device.lock:
        for name, part in parts.items():
            graph = Graph.record(device, part)
            try:
                graph.run()
                times = []
                for _ in range(replays):
                    t0 = common.now()
                    graph.run()
                    times.append(common.now() - t0)
            finally:
                graph.close()
            out[name + "_ms"] = 1e3 * sorted(times)[len(times) // 2]
    mv_bytes = sum(d.views[0].size for d in dispatches if d.kernel.name == "matvec")
    out["matvec_bytes"] = mv_bytes
    out["matvec_bytes_per_s"] = mv_bytes / (out["only_matvec_ms"] / 1e3)
    return out


def pp_kernels(be, pp: int, replays: int = 10, chunk: int = 0) -> dict:  # type: ignore[no-untyped-def]
    """Where a prefill of ``pp`` tokens spends its GPU time (issue 13: prefill of 512 is a
    third of llama.cpp CUDA's): the bucket's graph whole, without barriers, and for each
    kernel its dispatches alone without barriers ("only_", throughput) and each followed
    by a barrier ("serial_", its share of the chain), plus the FLOPs of the weight
    matmuls per second. A ``pp`` above the pass size ``chunk`` is timed as its last pass
    (``start`` tokens already in the cache: what grows with depth, attention and the
    rest). Parts compute garbage; only their time matters."""
    from trio_llm.vulkan.graph import Barrier, Dispatch

    start = ((pp - 1) // chunk) * chunk if chunk and pp > chunk else 0
    pp -= start
    bucket = 1 << max(0, (pp - 1).bit_length())
    if bucket > be._cap:
        return {"skipped": f"pp {pp} exceeds the largest bucket {be._cap}"}
    ops = be.lowered(bucket)
    dispatches = [op for op in ops if isinstance(op, Dispatch)]
    parts = {"all": ops, "no_barriers": [op for op in ops if not isinstance(op, Barrier)]}
    for name in sorted({d.kernel.name for d in dispatches}):
        parts["only_" + name] = [d for d in dispatches if d.kernel.name == name]
        parts["serial_" + name] = [x for d in parts["only_" + name] for x in (d, Barrier())]
    out: dict = {"tokens": pp, "start": start, "bucket": bucket, "dispatches": len(dispatches),
                 "barriers": sum(isinstance(op, Barrier) for op in ops),
                 "kernels": {n: sum(d.kernel.name == n for d in dispatches) for n in sorted({d.kernel.name
                                                                                           for d in dispatches})}}
    out |= _time_parts(be, pp, parts, replays, start)
    cfg = be.config
    # the dense projections' multiply-adds per token: q, k, v, o, gate, up, down (the
    # output head is one matvec, for the last token only)
    per_tok = cfg.n_layer * (cfg.n_embd * (cfg.n_head + 2 * cfg.n_head_kv) * cfg.head_dim
                             + cfg.n_head * cfg.head_dim * cfg.n_embd + 3 * cfg.n_embd * cfg.n_ff)
    mm = [k for k in ("matmul_nv2", "matmul_cm3", "matmul_cm2", "matmul_cm", "matmul") if f"only_{k}_ms" in out]
    if mm and not cfg.n_expert:
        out["matmul_tflops"] = 2 * per_tok * pp / (out[f"only_{mm[0]}_ms"] / 1e3) / 1e12
    return out


DELTA_KERNELS = ("delta_net", "delta_prep", "delta_chunk")


def prefill_breakdown(be, pp: int, replays: int = 10) -> dict:  # type: ignore[no-untyped-def]
    """GPU time of the prefill graph of ``pp`` tokens (one sequence from position 0, the
    step buffer filled for it) and of parts of it: the whole graph; without the
    delta-rule dispatches (the gated delta-net layers' share of prefill is the
    difference); the delta rule alone with its barriers, in the chunked form the graph
    uses and in the token-by-token recurrence it replaced (``delta_net.comp``, the
    decode form) for an A/B, and the recurrence alone in each of delta_net.comp's
    split-lane forms (``delta_recurrent_split<DP>``, DP 0 the one-lane-per-column form;
    the backend's own, TRIO_LLM_DELTA_SPLIT, is ``delta_recurrent``). Parts compute
    garbage; only their time matters."""
    import attrs

    from trio_llm.vulkan.graph import Barrier, Dispatch

    bucket = 1 << max(0, (pp - 1).bit_length())
    if bucket > be._cap:
        return {"skipped": f"pp {pp} exceeds the largest bucket {be._cap}"}
    ops = be.lowered(bucket)
    work, be._rs.work = be._rs.work, {}  # without its scratch the lowering takes the recurrence
    try:
        recurrent = be.lowered(bucket)
        splits = {dp: be.lowered(bucket, attrs.evolve(be._ops, delta_split=dp)) for dp in (0, 2, 4, 8)
                  if dp != be._ops.delta_split and be._ops.subgroup % max(dp, 1) == 0}
    finally:
        be._rs.work = work

    def delta_only(part: list) -> list:  # type: ignore[type-arg]
        return [x for d in part if isinstance(d, Dispatch) and d.kernel.name in DELTA_KERNELS for x in (d, Barrier())]

    parts = {
        "all": ops,
        "without_delta": [op for op in ops if not (isinstance(op, Dispatch) and op.kernel.name in DELTA_KERNELS)],
        "delta_chunked": delta_only(ops),
        "delta_recurrent": delta_only(recurrent),
        "all_recurrent": recurrent,
        **{f"delta_recurrent_split{dp}": delta_only(part) for dp, part in splits.items()},
    }
    # chunked: the graph's own choice (recurrent.chunked_prefill: GPUs yes, CPU drivers no)
    out: dict = {"tokens": pp, "bucket": bucket, "chunked": bool(work), "delta_split": be._ops.delta_split,
                 "delta_dispatches": sum(isinstance(d, Dispatch) and d.kernel.name in DELTA_KERNELS for d in ops)}
    out |= _time_parts(be, pp, parts, replays)
    out["delta_share"] = 1 - out["without_delta_ms"] / out["all_ms"]
    return out


def _time_parts(be, pp: int, parts: dict, replays: int, start: int = 0) -> dict:  # type: ignore[no-untyped-def, type-arg]
    """Median GPU time (``<name>_ms``) of each dispatch list in ``parts``, recorded as a
    graph and replayed over a step of ``pp`` tokens of one sequence from position
    ``start``."""
    from trio_llm.vulkan.graph import Graph
    from trio_llm.vulkan.ops import fill_step

    out = {}
    device = be._device
    with device.lock:
        fill_step(be._act.step_words, np.zeros(pp, np.uint32), np.arange(start, start + pp, dtype=np.uint32),
                  np.zeros(pp, np.uint32), np.array([pp - 1], np.uint32))
        for name, part in parts.items():
            graph = Graph.record(device, part)
            try:
                graph.run()
                times = []
                for _ in range(replays):
                    t0 = common.now()
                    graph.run()
                    times.append(common.now() - t0)
            finally:
                graph.close()
            out[name + "_ms"] = 1e3 * sorted(times)[len(times) // 2]
    return out


MOE_GROUPED = ("moe_group", "moe_matmul")


def moe_prefill(be, pp: int, replays: int = 10) -> dict:  # type: ignore[no-untyped-def]
    """GPU time of the prefill graph of ``pp`` tokens (one sequence from position 0)
    with the expert products grouped by expert and tiled (``moe_group`` +
    ``moe_matmul``, the default) and with one ``moe_matvec`` work group per (token,
    expert) pair (``TRIO_LLM_MOE_MATMUL=0``), and on a device with cooperative matrices
    with ``moe_matmul_cm`` too (``TRIO_LLM_MOE_CM=1``), whole and the expert dispatches
    alone (each followed by a barrier: they compute garbage, only their time counts).
    pp tok/s from the whole graph's time, the backend's submit without Python."""
    import attrs

    from trio_llm.vulkan.graph import Barrier, Dispatch

    bucket = 1 << max(0, (pp - 1).bit_length())
    if bucket > be._cap or bucket <= 8 or "moe_map" not in be._act.bufs:
        return {"skipped": f"pp {pp}: no grouped expert path in bucket {bucket} (largest {be._cap})"}
    grouped = be.lowered(bucket, attrs.evolve(be._ops, moe_grouped=True, moe_grouped_min=0))
    per_pair = be.lowered(bucket, attrs.evolve(be._ops, moe_grouped=False))

    def experts(part: list, names: tuple[str, ...]) -> list:  # type: ignore[type-arg]
        return [x for d in part if isinstance(d, Dispatch) and d.kernel.name in names for x in (d, Barrier())]

    parts = {"all_grouped": grouped, "all_matvec": per_pair, "experts_grouped": experts(grouped, MOE_GROUPED),
             "experts_matvec": experts(per_pair, ("moe_matvec",))}
    if be._ops.coopmat and be._ops.subgroup in (32, 64):  # moe_matmul_cm (off by default: TRIO_LLM_MOE_CM=1)
        cm = be.lowered(bucket, attrs.evolve(be._ops, moe_grouped=True, moe_grouped_min=0, moe_cm=True))
        parts |= {"all_grouped_cm": cm, "experts_grouped_cm": experts(cm, ("moe_group", "moe_matmul_cm"))}
    out: dict = {"tokens": pp, "bucket": bucket}
    out |= _time_parts(be, pp, parts, replays)
    out["pp_tps_grouped"] = pp / (out["all_grouped_ms"] / 1e3)
    out["pp_tps_matvec"] = pp / (out["all_matvec_ms"] / 1e3)
    out["experts_speedup"] = out["experts_matvec_ms"] / out["experts_grouped_ms"]
    if "all_grouped_cm_ms" in out:
        out["pp_tps_grouped_cm"] = pp / (out["all_grouped_cm_ms"] / 1e3)
        out["experts_speedup_cm"] = out["experts_matvec_ms"] / out["experts_grouped_cm_ms"]
    return out


def run_backend(kind: str, model, pp: int, tg: int, repeats: int, warmup: int,  # type: ignore[no-untyped-def]
                residency_too: bool = False, breakdown_too: bool = False, n_cpu_moe: float = 0.0,
                prefill_too: bool = False, moe_too: bool = False, moe_sizes: tuple[int, ...] = (),
                pp_too: bool = False, max_chunk: int = 512) -> dict:
    n_ctx = max(pp, tg, *moe_sizes) + 8
    if kind == "vulkan":
        from trio_llm.vulkan.backend import VulkanBackend

        load_s, be = common.timed(lambda: VulkanBackend(model, n_ctx=n_ctx, n_seq=1, n_cpu_moe=n_cpu_moe,
                                                        max_chunk=max_chunk))
    else:
        from trio_llm.engine.reference import NumpyBackend

        load_s, be = common.timed(lambda: NumpyBackend(model, n_ctx=n_ctx, n_seq=1))
    cfg = be.config
    waited = [0.0]
    if kind == "vulkan":
        # time spent in submit + fence wait, so Python overhead = the rest of forward()
        from trio_llm.vulkan.graph import Graph

        run = Graph.run

        def timed_run(self, what="forward"):  # type: ignore[no-untyped-def]
            t0 = common.now()
            try:
                return run(self, what)
            finally:
                waited[0] += common.now() - t0

        Graph.run = timed_run  # type: ignore[method-assign]
    prompt = np.random.default_rng(0).integers(0, cfg.n_vocab, pp).astype(np.int32)  # [pp]
    pp_t: list[float] = []
    tg_t: list[float] = []
    replay_t: list[float] = []
    python_t: list[float] = []
    for i in range(warmup + repeats):
        t_pp, _ = common.timed(lambda: be.forward([SeqBatch(0, prompt, 0)]))
        tok = 1
        waited[0] = 0.0
        t0 = common.now()
        for step in range(tg):
            logits = be.forward([SeqBatch(0, np.array([tok], np.int32), step)])
            tok = int(np.argmax(logits[0]))
        t_tg = common.now() - t0
        t_py = t_tg - waited[0]
        t_rep = 0.0
        if kind == "vulkan":
            t0 = common.now()
            for _ in range(tg):
                be.replay(1)
            t_rep = common.now() - t0
        if i >= warmup:
            pp_t.append(t_pp)
            tg_t.append(t_tg)
            replay_t.append(t_rep)
            python_t.append(t_py)
        print(f"  {kind} round {i}: pp{pp} {t_pp:.3f} s, tg{tg} {t_tg:.3f} s"
              + (" (warm-up)" if i < warmup else ""), file=sys.stderr, flush=True)
    info = be.device_info()
    mem = be.memory()
    breakdown = gpu_breakdown(be, model) if kind == "vulkan" and breakdown_too else None
    ppk = pp_kernels(be, pp, chunk=max_chunk) if kind == "vulkan" and pp_too else None
    prefill = prefill_breakdown(be, pp) if kind == "vulkan" and prefill_too else None
    moe = ({n: moe_prefill(be, n) for n in moe_sizes or (pp,)} if kind == "vulkan" and moe_too else None)
    residency = measure_residency(be, repeats) if kind == "vulkan" and residency_too else None
    be.close()
    out = {
        "backend": kind,
        "device": info.get("name"),
        "load_s": load_s,
        "pp_tps": common.stats([pp / t for t in pp_t]),
        "tg_tps": common.stats([tg / t for t in tg_t]),
        "ms_per_token": common.stats([1e3 * t / tg for t in tg_t]),
        "memory": mem,
    }
    if residency is not None:
        out["residency"] = residency
    if breakdown is not None:
        out["breakdown"] = breakdown
    if ppk is not None:
        out["pp_kernels"] = ppk
    if prefill is not None:
        out["prefill_breakdown"] = prefill
    if moe is not None:
        out["moe_prefill"] = moe
    if kind == "vulkan":
        out["gpu_ms_per_token"] = common.stats([1e3 * t / tg for t in replay_t])
        out["python_us_per_token"] = common.stats([1e6 * t / tg for t in python_t])
    return out


def batched_decode(model, sizes: tuple[int, ...], steps: int, repeats: int, prompt: int = 64) -> dict:  # type: ignore[no-untyped-def]
    """Decode with B sequences per step (continuous batching's shape, issue 14 part 5):
    a Vulkan backend of max(sizes) sequences, each prefilled with ``prompt`` tokens, then
    ``steps`` forwards of one token for each of the first B, greedy on the host; per B the
    aggregate tok/s, ms per step and the replayed graph alone (GPU time). Where B columns
    cost about one the matvecs read the weights once for all of them (the bandwidth-bound
    case); a step that grows with B points at per-column work."""
    from trio_llm.vulkan.backend import VulkanBackend

    n_seq = max(sizes)
    # sequence 0 steps in every size's rounds: its depth grows by about ``steps`` per size
    be = VulkanBackend(model, n_ctx=prompt + len(sizes) * steps + 8, n_seq=n_seq)
    out: dict[int, dict] = {}  # type: ignore[type-arg]
    try:
        rng = np.random.default_rng(1)
        for s in range(n_seq):
            be.forward([SeqBatch(s, rng.integers(0, be.config.n_vocab, prompt).astype(np.int32), 0)])
        pos = [prompt] * n_seq
        toks = [1] * n_seq
        for b in sizes:
            step_t, replay_t = [], []
            for r in range(repeats + 1):
                t0 = common.now()
                for _ in range(steps // (repeats + 1) or 1):
                    logits = be.forward([SeqBatch(s, np.array([toks[s]], np.int32), pos[s]) for s in range(b)])
                    for s in range(b):
                        toks[s] = int(np.argmax(logits[s]))
                        pos[s] += 1
                n = steps // (repeats + 1) or 1
                t_step = (common.now() - t0) / n
                t0 = common.now()
                for _ in range(n):
                    be.replay(b)
                t_rep = (common.now() - t0) / n
                if r:  # the first round warms the bucket's graph
                    step_t.append(t_step)
                    replay_t.append(t_rep)
            out[b] = {"tok_s": common.stats([b / t for t in step_t]),
                      "ms_per_step": common.stats([1e3 * t for t in step_t]),
                      "gpu_ms_per_step": common.stats([1e3 * t for t in replay_t])}
            print(f"  batch {b}: {out[b]['tok_s'].median:,.0f} tok/s, {out[b]['ms_per_step'].median:.2f} ms/step, "
                  f"graph alone {out[b]['gpu_ms_per_step'].median:.2f} ms", file=sys.stderr, flush=True)
    finally:
        be.close()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--quant", default="Q8_0")
    ap.add_argument("--model", type=Path, help="a GGUF file instead of a synthetic preset")
    ap.add_argument("--backends", default="vulkan,numpy")
    ap.add_argument("--pp", type=int, default=512)
    ap.add_argument("--tg", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--residency", action="store_true", help="also time release/restore (Vulkan)")
    ap.add_argument("--n-cpu-moe", type=float, default=0.0,
                    help="keep the experts of this many layers in host memory (Vulkan; fractional)")
    ap.add_argument("--breakdown", action="store_true",
                    help="also time the decode graph's parts (Vulkan): without barriers, per kernel")
    ap.add_argument("--prefill-breakdown", action="store_true",
                    help="also time the pp graph whole, without the delta rule (its share), and the delta rule "
                         "chunked vs token by token (Vulkan, hybrid models)")
    ap.add_argument("--moe-prefill", action="store_true",
                    help="also time the pp graph with the expert products grouped by expert (the default) "
                         "against one matvec per (token, expert) pair, whole and the experts alone (Vulkan, MoE)")
    ap.add_argument("--moe-prefill-sizes", default="",
                    help="with --moe-prefill: the chunk sizes to time (e.g. 16,32,64,128,256,512; default --pp), "
                         "the crossover Ops.moe_grouped_min is set from")
    ap.add_argument("--pp-breakdown", action="store_true",
                    help="also time the pp graph's kernels (Vulkan): alone, serial, the matmuls' TFLOP/s")
    ap.add_argument("--batch-sizes", default="",
                    help="also time decode steps of B sequences for each B (e.g. 1,2,4,8: aggregate tok/s and the "
                         "graph alone; Vulkan)")
    ap.add_argument("--max-chunk", type=int, default=512,
                    help="prompt tokens a forward pass takes (the server's -ub; Vulkan, up to 4096): a longer pp "
                         "runs as passes of this many")
    args = ap.parse_args()
    path = args.model or common.model_file(args.preset, args.quant)
    model = load_gguf(path)
    per_token = weight_bytes_per_token(model)
    rows = []
    for kind in args.backends.split(","):
        r = run_backend(kind.strip(), model, args.pp, args.tg, args.repeats, args.warmup, args.residency,
                        args.breakdown, args.n_cpu_moe, args.prefill_breakdown, args.moe_prefill,
                        tuple(int(n) for n in args.moe_prefill_sizes.split(",") if n), args.pp_breakdown,
                        args.max_chunk)
        r["bytes_per_token"] = per_token
        sizes = tuple(int(b) for b in args.batch_sizes.split(",") if b)
        if sizes and kind.strip() == "vulkan":
            r["batched"] = batched_decode(model, sizes, max(args.tg, 32), args.repeats)
        r["hbm_share"] = common.stats([v * per_token / HBM_BYTES_PER_S for v in r["tg_tps"].values])
        rows.append(r)
    label = path.name if args.model else f"{args.preset} {args.quant}"
    table = [
        {
            "model": label, "backend": r["backend"], f"pp{args.pp} tok/s": r["pp_tps"],
            f"tg{args.tg} tok/s": r["tg_tps"], "ms/tok": r["ms_per_token"],
            "gpu ms/tok": r.get("gpu_ms_per_token", ""), "python us/tok": r.get("python_us_per_token", ""),
            "HBM share": r["hbm_share"],
        }
        for r in rows
    ]
    common.print_table(table)
    for r in rows:
        if "breakdown" in r:
            print(f"{r['backend']} breakdown: {r['breakdown']}")
        if "pp_kernels" in r:
            print(f"{r['backend']} pp kernels: {r['pp_kernels']}")
        if "prefill_breakdown" in r:
            print(f"{r['backend']} prefill breakdown: {r['prefill_breakdown']}")
        for b, fig in (r.get("batched") or {}).items():
            print(f"{r['backend']} batch {b}: {fig['tok_s'].median:,.0f} tok/s aggregate, "
                  f"{fig['ms_per_step'].median:.2f} ms/step, graph alone {fig['gpu_ms_per_step'].median:.2f} ms")
        for n, fig in (r.get("moe_prefill") or {}).items():
            print(f"{r['backend']} moe prefill {n}: {fig}")
        for level, fig in (r.get("residency") or {}).items():
            if level in ("raw_copy", "phases"):
                print(f"{r['backend']} {level}: {fig}")
                continue
            print(f"{r['backend']} release({level}): {fig['release_s'].median * 1e3:.1f} ms, "
                  f"restore {fig['restore_s'].median * 1e3:.1f} ms, first forward {fig['first_forward_s'].median * 1e3:.1f} ms, cold {fig['cold_bytes'] / 2**20:.1f} MiB "
                  f"of {fig['resident_bytes'] / 2**20:.1f} MiB")
    params = {"model": str(path), "preset": args.preset, "quant": args.quant, "pp": args.pp,
              "tg": args.tg, "repeats": args.repeats, "warmup": args.warmup, "n_cpu_moe": args.n_cpu_moe,
              "batch_sizes": args.batch_sizes}
    name = f"decode-{path.stem}" if args.model else f"decode-{args.preset}-{args.quant}"
    out = common.write_result(name, params, rows)
    print(f"wrote {out.relative_to(common.ROOT)}")
    model.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

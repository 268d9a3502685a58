"""Where the device memory of a released model goes (issue 12's cold memory, a diagnosis).

On the H200 a hybrid model released at level ``all`` kept 49 MiB by the driver's
per-process counter while the backend held no buffer (llama-1b: 27 MiB). This takes a
model apart, one process per model so that each counter starts from nothing:

- the driver's figure (``nvidia-smi --query-compute-apps``) with the Vulkan device open
  and nothing made, after the backend's load, after a prefill and some decode steps,
  and after ``release(all)``;
- then the pipelines destroyed one at a time, the figure after each: a pipeline whose
  destruction gives memory back held it (on NVIDIA, a shader's local memory, the
  registers it spills and its dynamically indexed arrays, is sized for the whole
  GPU's resident threads);
- then the pipeline cache and the command pool.

For a hybrid, before the release: its recurrent state read (as a context checkpoint is)
and, after a release and restore, written back (as after a wake), the figure after each
and after a release that follows each. Decode steps sampled on the device (the
server's path) come before the release, and the graphs are closed after it.

Prints a table and writes one JSON record (``bench/results/pipemem-*.json``). Without
nvidia-smi (lavapipe) the figures are None and only the pipeline list means anything.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import common
import numpy as np
from e2e import device_mib


def one(path: Path, ctx: int) -> dict[str, Any]:
    from trio_llm.engine.backend import Level, SeqBatch
    from trio_llm.engine.loader import open_backend
    from trio_llm.model.gguf import load_gguf
    from trio_llm.vulkan.device import shared_device

    pid = os.getpid()
    out: dict[str, Any] = {"model": path.name}
    dev = shared_device()
    out["device_open_mib"] = device_mib(pid)
    be: Any = open_backend("vulkan", load_gguf(path), n_ctx=ctx, n_seq=1)
    out["loaded_mib"] = device_mib(pid)
    out["kernels_after_load"] = len(be._kernels._kernels)
    # the server's warm-up passes first (runtime.warmup_sizes: 1, 2, 4, 8 and 16 tokens at 0)
    out["warm_mib"] = {}
    for n in (1, 2, 4, 8, 16):
        be.forward([SeqBatch(0, np.ones(n, np.int32), 0)])
        out["warm_mib"][n] = device_mib(pid)  # which bucket's first run grows the driver's figure
    out["warmed_mib"] = device_mib(pid)
    toks = (np.arange(64) * 7 + 11).astype(np.int32) % 1000
    be.forward([SeqBatch(0, toks, 0)])
    for i in range(8):
        be.forward([SeqBatch(0, np.array([5 + i], np.int32), 64 + i)])
    out["ran_mib"] = device_mib(pid)
    # decode steps sampled on the device, as the server runs them (llama-server's default chain)
    from trio_llm.engine.devsample import DeviceChain

    pos = 72
    for _ in range(4):
        n = min(4, be.decode_steps_max)
        us = np.full((n, 1), 0.5, np.float32)
        ids = be.decode([SeqBatch(0, np.array([7], np.int32), pos)], [DeviceChain(0.8, 40, 0.95, 0.05)], us)
        pos += int(ids.shape[0])
    out["sampled_mib"] = device_mib(pid)
    out["backend_bytes_resident"] = int(sum(be.memory().values()))
    if be._rs.sizes:
        # a hybrid: the server's context checkpoints read its state and write it back after a
        # wake (slot save/restore too), through copy_seq's host buffers
        n_pos = int(be._rs_pos[0])
        st = be.read_state(0, raw=True)
        out["state_bytes"] = int(st.nbytes)
        out["state_read_mib"] = device_mib(pid)
        be.release(Level.ALL)
        out["released_after_state_read_mib"] = device_mib(pid)
        be.restore()
        be.write_state(0, st, n_pos, raw=True)
        out["state_written_mib"] = device_mib(pid)
        be.release(Level.ALL)
        out["released_after_state_write_mib"] = device_mib(pid)
        be.restore()
    be.release(Level.ALL)
    out["released_mib"] = device_mib(pid)
    out["backend_bytes_released"] = int(sum(be.memory().values()))
    # the graphs (their descriptor pools and command buffers) and the sampler's, closed
    out["graphs"] = sorted(be._graphs)
    out["sampler_graphs"] = [repr(k) for k in be._sampler._graphs]
    be._drop_graphs()
    out["graphs_dropped_mib"] = device_mib(pid)
    kc = be._kernels
    vk = dev.vk
    rows = []
    last = out["released_mib"]
    from trio_llm.vulkan.kernels import statistics

    for key, k in sorted(kc._kernels.items(), key=lambda kv: repr(kv[0])):
        try:  # the driver's registers and local memory (TRIO_LLM_PIPELINE_STATS=1)
            stats = statistics(dev, k)
        except Exception as exc:  # a diagnosis: report, go on
            stats = {"error": repr(exc)[:200]}  # type: ignore[dict-item]
        vk.vkDestroyPipeline(dev.handle, k.pipeline, None)
        now = device_mib(pid)
        rows.append({"kernel": k.name, "defines": dict(key[1]), "spec": dict(key[2]), "local_size": k.local_size,
                     "stats": stats,
                     "mib_after": now, "freed_mib": (last - now) if (last is not None and now is not None) else None})
        last = now
    kc._kernels.clear()  # destroyed above: close() must not destroy them again
    out["pipelines"] = rows
    out["pipelines_destroyed_mib"] = last
    dev.trim_command_pool()
    out["pool_trimmed_mib"] = device_mib(pid)
    return out


def exact(v: object) -> str:
    """A statistic as the driver gave it: whole numbers in full (the H200's "Local Memory
    Size" is 2**36 plus the bytes a thread, which ``%g`` rounds away)."""
    if isinstance(v, float) and v.is_integer():
        return str(int(v))
    return f"{v:g}" if isinstance(v, float) else str(v)


def local_memory(pipelines: list[dict[str, Any]], key: str = "Local Memory Size") -> list[str]:
    """The pipelines whose local memory is above the smallest any pipeline reports (the
    H200 reports a 2**36 base for all): one line each with the bytes above it, or one
    line saying there are none."""
    sizes = [x["stats"].get(key) for x in pipelines if isinstance(x.get("stats", {}).get(key), float)]
    if not sizes:
        return [f"  no pipeline reports {key!r}"]
    floor = min(sizes)
    out = [f"  local memory above the floor ({exact(floor)}): {x['kernel']} "
           f"{','.join(f'{k}={v}' for k, v in x['defines'].items())} "
           f"spec {','.join(f'{k}={v}' for k, v in x['spec'].items())}: {exact(x['stats'][key] - floor)} bytes"
           for x in pipelines if isinstance(x.get("stats", {}).get(key), float) and x["stats"][key] > floor]
    return out or [f"  local memory: every pipeline at the floor ({exact(floor)})"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", action="append", required=True, type=Path)
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--one", action="store_true", help="(internal) one model, in this process, JSON on stdout")
    args = ap.parse_args()
    if args.one:
        print("PIPEMEM " + json.dumps(one(args.model[0], args.ctx)), flush=True)
        return 0
    results = []
    for m in args.model:
        p = subprocess.run([sys.executable, __file__, "--one", "--model", str(m), "--ctx", str(args.ctx)],
                           capture_output=True, text=True, timeout=600)
        line = next((x for x in p.stdout.splitlines() if x.startswith("PIPEMEM ")), None)
        if line is None:
            print(f"{m.name}: failed (exit {p.returncode}): {p.stderr[-2000:]}", file=sys.stderr)
            results.append({"model": m.name, "error": p.stderr[-2000:]})
            continue
        r = json.loads(line[len("PIPEMEM "):])
        results.append(r)
        print(f"\n{r['model']}: device open {r['device_open_mib']} MiB, loaded {r['loaded_mib']}, "
              f"ran {r['ran_mib']}, released {r['released_mib']}, pipelines destroyed "
              f"{r['pipelines_destroyed_mib']}, pool trimmed {r['pool_trimmed_mib']}")
        print(f"  after each warm-up bucket (tokens: MiB) {r['warm_mib']}")
        print(f"  warmed up (1..16 tokens) {r['warmed_mib']} MiB, sampled decode {r['sampled_mib']} MiB; graphs {r['graphs']}, sampler's {r['sampler_graphs']}; "
              f"released {r['released_mib']}, graphs closed {r['graphs_dropped_mib']}")
        if "state_bytes" in r:
            print(f"  recurrent state {r['state_bytes'] / 2**20:.1f} MiB: read {r['state_read_mib']} MiB, released after "
                  f"{r['released_after_state_read_mib']}, written back {r['state_written_mib']}, released after "
                  f"{r['released_after_state_write_mib']}")
        common.print_table([{"kernel": x["kernel"], "defines": ",".join(f"{k}={v}" for k, v in x["defines"].items()),
                             "spec": ",".join(f"{k}={v}" for k, v in x["spec"].items()),
                             "freed_mib": x["freed_mib"],
                             "stats": " ".join(f"{k}={exact(v)}" for k, v in x.get("stats", {}).items())[:160]}
                            for x in r["pipelines"]])
        for line in local_memory(r["pipelines"]):
            print(line)
    path = common.write_result("pipemem", {"model": [str(m) for m in args.model], "ctx": args.ctx},
                               {"rows": results})
    print(f"wrote {path}")
    return 0 if all("error" not in r for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())

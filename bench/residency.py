"""Release and restore of one backend, per level: time, bytes moved, GB/s, cold bytes.

    .venv/bin/python bench/residency.py [--model tiny:Q8_0] [--backend vulkan]
        [--ctx 4096] [--slots 1] [--levels weights,all,unload] [--repeats 5]

For each level: ``release(level)`` then ``restore()`` on the backend directly (no
server, no trio: these are the calls the residency actor makes on the backend's
worker thread), and the first forward pass after the restore timed on its own (a
lazy backend would show its deferred work there; compare with ``forward_s``, a
forward pass of a model that never slept). Bytes moved are from ``memory()``: device bytes before minus after
a release (what left the device) and after minus before a restore (what came back).
GB/s = bytes moved / seconds; "cold" is what a released model still holds. On Vulkan
the raw host-to-device copy bandwidth (one ``vkCmdCopyBuffer`` of up to 1 GiB, from
``decode.py``) is measured in the same run, and each level's restore is given as a
share of it.

On the numpy backend the "device" is host memory and a release only hands arrays
over, so its GB/s figures are bookkeeping, not bandwidth; they are printed to check
the harness. The figures that matter come from ``--backend vulkan`` (lavapipe here,
the H200 through the device tool).
"""

from __future__ import annotations

import argparse
import sys

import common
import numpy as np

from trio_llm.engine.backend import Level, SeqBatch
from trio_llm.engine.loader import open_backend
from trio_llm.model.gguf import load_gguf


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny:Q8_0", help="PRESET:QUANT (synthetic) or a .gguf path")
    ap.add_argument("--backend", default="numpy", choices=["numpy", "vulkan", "auto"])
    ap.add_argument("--ctx", type=int, default=4096, help="positions per slot")
    ap.add_argument("--slots", type=int, default=1)
    ap.add_argument("--levels", default="weights,all,unload")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()

    if args.model.endswith(".gguf"):
        path = args.model
    else:
        preset, quant = args.model.split(":")
        path = str(common.model_file(preset, quant))
    model = load_gguf(path)
    backend = open_backend(args.backend, model, n_ctx=args.ctx, n_seq=args.slots)
    probe = [SeqBatch(0, np.array([1, 2, 3], np.int32), 0)]
    backend.forward(probe)  # warm: pipelines, first-touch pages
    resident = backend.memory()
    warm_fwd = common.repeat(lambda: common.timed(lambda: backend.forward(probe))[0], args.repeats)
    rows = []
    figures: dict[str, object] = {
        "resident_bytes": resident, "device": backend.device_info(), "forward_s": warm_fwd
    }
    raw_h2d = None  # the bound a restore can reach: one plain copy into device memory
    if backend.name == "vulkan":
        from decode import raw_copy_bandwidth

        raw = raw_copy_bandwidth(backend, min(1 << 30, resident["weights"]))
        figures["raw_copy"] = raw
        raw_h2d = raw["host_to_device_bytes_per_s"].median
    for name in args.levels.split(","):
        level = Level(name)
        rel_s, res_s, fwd_s, rel_b, res_b, cold = [], [], [], [], [], {}
        for _ in range(args.repeats + 1):  # the first cycle captures shadows: unrecorded
            before = sum(backend.memory().values())
            t_rel, _ = common.timed(lambda level=level: backend.release(level))
            cold = backend.memory()
            t_res, _ = common.timed(backend.restore)
            t_fwd, _ = common.timed(lambda: backend.forward(probe))
            fwd_s.append(t_fwd)
            after = sum(backend.memory().values())
            rel_s.append(t_rel)
            res_s.append(t_res)
            rel_b.append(before - sum(cold.values()))
            res_b.append(after - sum(cold.values()))
        row = {
            "level": name,
            "release_s": common.stats(rel_s[1:]),
            "restore_s": common.stats(res_s[1:]),
            "first_fwd_s": common.stats(fwd_s[1:]),
            "released_MB": rel_b[-1] / 1e6,
            "restored_MB": res_b[-1] / 1e6,
            "cold_MB": sum(cold.values()) / 1e6,
            "release_GB/s": rel_b[-1] / common.stats(rel_s[1:]).median / 1e9,
            "restore_GB/s": res_b[-1] / common.stats(res_s[1:]).median / 1e9,
        }
        if raw_h2d is not None:
            row["raw_h2d_GB/s"] = raw_h2d / 1e9
            row["restore/raw"] = row["restore_GB/s"] / row["raw_h2d_GB/s"]
        rows.append(row)
        figures[name] = row | {"cold_bytes": cold}
    backend.close()
    print(f"{path} on {args.backend}: resident {sum(resident.values()) / 1e6:,.1f} MB {resident}")
    print(f"forward_s (3 tokens, never slept): {common.fmt(warm_fwd.median)}")
    common.print_table(rows)
    out = common.write_result("residency", vars(args) | {"path": path}, figures)
    print(f"wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

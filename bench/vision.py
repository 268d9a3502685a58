"""Seconds per image of the CPU image encoder (``trio_llm.vision``, llama-server's
``--mmproj``) on a full-size random gemma-3 projector.

    .venv/bin/python bench/vision.py                     # 27 blocks, median of 3
    .venv/bin/python bench/vision.py --layers 4 --repeats 2   # a quick run
    .venv/bin/python bench/vision.py --threads 1         # BLAS and the encoder's pool at 1

The projector is gemma-3's shape (896x896 image, patch 14 -> 4096 patches, width 1152,
n_ff 4304, 16 heads, 27 blocks, pool 4 -> 256 rows of width 2560) with random f16 block
matrices, written once by ``trio_llm.vision.synth.write_mmproj`` into
``<tempdir>/trio-llm-bench/`` and reused. ``--layers N`` encodes with the file's first
N blocks only (the same file, a shallower ``Hparams``). Time per image: wall clock of
``Projector.encode`` on one random preprocessed image, after ``--warmup`` unrecorded
calls (the first pays for page faults of the mapped file). ``--threads`` limits BLAS
through threadpoolctl as the server's ``-t`` does; the encoder's own pool follows it.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import attrs
import common
import numpy as np
from threadpoolctl import threadpool_info, threadpool_limits

from trio_llm.vision import load_projector
from trio_llm.vision.mmproj import Projector
from trio_llm.vision.synth import write_mmproj

#: gemma-3's vision tower and projector (every released size), as write_mmproj's arguments
GEMMA3 = {"n_embd_text": 2560, "image_size": 896, "patch_size": 14, "n_embd": 1152, "n_ff": 4304,
          "n_head": 16, "n_layer": 27, "n_merge": 4, "wtype": "f16"}


def projector_file() -> Path:
    directory = Path(tempfile.gettempdir()) / "trio-llm-bench"
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "mmproj-gemma3-f16-s0.gguf"
    if not path.exists():
        print(f"writing {path} ...", file=sys.stderr, flush=True)
        write_mmproj(path, **GEMMA3)  # type: ignore[arg-type]
    return path


def blas_threads() -> int | None:
    counts = [int(i["num_threads"]) for i in threadpool_info() if i.get("user_api") == "blas"]
    return max(counts) if counts else None


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=GEMMA3["n_layer"], help="blocks to run (default all 27)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--threads", type=int, default=-1, help="BLAS threads (-1: the library's default)")
    args = p.parse_args()
    if not 1 <= args.layers <= int(GEMMA3["n_layer"]):  # type: ignore[call-overload]
        raise SystemExit(f"--layers must be 1..{GEMMA3['n_layer']}")
    if args.threads > 0:
        threadpool_limits(limits=args.threads, user_api="blas")
    path = projector_file()
    full = load_projector(path)
    proj: Projector = attrs.evolve(full, hparams=attrs.evolve(full.hparams, n_layer=args.layers))
    hp = proj.hparams
    rng = np.random.default_rng(0)
    pixels = rng.uniform(-1.0, 1.0, (3, hp.image_size, hp.image_size)).astype(np.float32)  # [3, S, S]
    times: list[float] = []
    for i in range(args.warmup + args.repeats):
        t, out = common.timed(lambda: proj.encode(pixels))
        if i >= args.warmup:
            times.append(t)
        print(f"  round {i}: {t:.2f} s" + (" (warm-up)" if i < args.warmup else ""), file=sys.stderr, flush=True)
    assert out.shape == (hp.n_tokens, hp.n_embd_out) and np.isfinite(out).all()
    s_per_image = common.stats(times)
    info = common.machine_info()
    row = {
        "layers": hp.n_layer, "patches": hp.n_patches, "blas threads": blas_threads(),
        "cpus": info["affinity"] or info["cpu_count"], "s/image": s_per_image,
        "s/block": common.stats([t / hp.n_layer for t in times]),
    }
    print(f"{info['cpu']}, {row['cpus']} CPUs; medians over {args.repeats} images after {args.warmup} warm-up")
    common.print_table([row])
    params = {"layers": hp.n_layer, "repeats": args.repeats, "warmup": args.warmup, "threads": args.threads,
              "projector": {**GEMMA3, "n_layer_run": hp.n_layer}, "file": str(path)}
    figures = {"s_per_image": s_per_image, "s_per_block": row["s/block"], "blas_threads": row["blas threads"],
               "cpus": row["cpus"]}
    out_path = common.write_result("vision", params, figures)
    print(f"wrote {out_path.relative_to(common.ROOT)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

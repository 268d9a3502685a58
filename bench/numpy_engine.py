"""Prefill and decode speed of the numpy reference engine.

    .venv/bin/python bench/numpy_engine.py [--models tiny:Q8_0,qwen3-0.6b:Q8_0]
        [--pp 512] [--tg 128] [--repeats 3] [--backends numpy,vulkan]

For each synthetic model: load time (dequantize everything to float32), then
``repeats`` rounds of one prefill of ``pp`` tokens (one batch entry, one matrix
product per projection) followed by ``tg`` single-token decode steps on the same
sequence, batch 1. Per model the ``pp``/``tg`` can be given as ``preset:quant:pp:tg``
because a 0.6B model at pp512 takes minutes on a shared CPU.

Besides tokens/s it reports the effective memory bandwidth of decode (the backend's
weight bytes read per token x tokens/s; float32 for numpy): every weight is read once
per step, so that figure shows how close to the machine's memory bound it runs.
``--backends numpy,vulkan`` measures other backends side by side through the same
``Backend`` interface, which gives ratios that hold on a noisy shared machine.
"""

from __future__ import annotations

import argparse
import gc
import sys

import common
import numpy as np

from trio_llm.engine.backend import SeqBatch
from trio_llm.engine.loader import open_backend
from trio_llm.model.gguf import load_gguf


def bench_model(
    kind: str, preset: str, quant: str, pp: int, tg: int, repeats: int, warmup: int
) -> dict:
    path = common.model_file(preset, quant)
    load_s, model = common.timed(lambda: load_gguf(path))
    file_bytes = path.stat().st_size
    backend_s, be = common.timed(lambda: open_backend(kind, model, n_ctx=pp + tg, n_seq=1))
    cfg = be.config
    weight_bytes = be.memory()["weights"]
    prompt = np.random.default_rng(0).integers(0, cfg.n_vocab, pp).astype(np.int32)  # [pp]
    pp_times: list[float] = []
    tg_times: list[float] = []
    for i in range(warmup + repeats):
        t_pp, logits = common.timed(lambda: be.forward([SeqBatch(0, prompt, 0)]))
        tok = int(np.argmax(logits[0]))
        t0 = common.now()
        for step in range(tg):
            logits = be.forward([SeqBatch(0, np.array([tok], np.int32), pp + step)])
            tok = int(np.argmax(logits[0]))
        t_tg = common.now() - t0
        if i >= warmup:
            pp_times.append(t_pp)
            tg_times.append(t_tg)
        print(f"  {kind} {preset} {quant} round {i}: pp{pp} {t_pp:.3f} s, tg{tg} {t_tg:.3f} s"
              + (" (warm-up)" if i < warmup else ""), file=sys.stderr, flush=True)
    be.close()
    model.close()
    pp_tps = common.stats([pp / t for t in pp_times])
    tg_tps = common.stats([tg / t for t in tg_times])
    return {
        "backend": be.name,
        "model": f"{preset} {quant}",
        "preset": preset,
        "quant": quant,
        "shape": {
            "n_embd": cfg.n_embd, "n_layer": cfg.n_layer, "n_head": cfg.n_head,
            "n_head_kv": cfg.n_head_kv, "head_dim": cfg.head_dim, "n_ff": cfg.n_ff,
            "n_vocab": cfg.n_vocab,
        },
        "file_bytes": file_bytes,
        "weight_bytes": weight_bytes,
        "load_s": load_s + backend_s,
        "pp": pp,
        "tg": tg,
        "batch": 1,
        "n_ctx": pp + tg,
        "prefill_tok_s": pp_tps,
        "decode_tok_s": tg_tps,
        "decode_GB_s": common.stats([weight_bytes * v / 1e9 for v in tg_tps.values]),
    }


def parse_models(spec: str, pp: int, tg: int) -> list[tuple[str, str, int, int]]:
    out = []
    for item in spec.split(","):
        parts = item.strip().split(":")
        if len(parts) not in (2, 4):
            raise SystemExit(f"bad model spec {item!r}: want preset:quant or preset:quant:pp:tg")
        if len(parts) == 2:
            out.append((parts[0], parts[1], pp, tg))
        else:
            out.append((parts[0], parts[1], int(parts[2]), int(parts[3])))
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="tiny:Q8_0:512:128,qwen3-0.6b:Q8_0:128:16")
    p.add_argument("--pp", type=int, default=512)
    p.add_argument("--tg", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--backends", default="numpy", help="comma-separated: numpy, vulkan")
    args = p.parse_args()
    rows = []
    for preset, quant, pp, tg in parse_models(args.models, args.pp, args.tg):
        for kind in args.backends.split(","):
            rows.append(bench_model(kind.strip(), preset, quant, pp, tg, args.repeats, args.warmup))
            gc.collect()
    table = [
        {
            "backend": r["backend"], "model": r["model"], "weights MB": r["weight_bytes"] / 1e6,
            "load s": r["load_s"],
            "pp": r["pp"], "pp tok/s": r["prefill_tok_s"], "tg": r["tg"],
            "tg tok/s": r["decode_tok_s"], "tg GB/s": r["decode_GB_s"],
        }
        for r in rows
    ]
    print("batch 1, medians over", args.repeats, "repeats")
    common.print_table(table)
    params = {"models": args.models, "backends": args.backends, "repeats": args.repeats,
              "warmup": args.warmup}
    path = common.write_result("numpy_engine", params, rows)
    print(f"wrote {path.relative_to(common.ROOT)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

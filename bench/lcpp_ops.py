"""llama.cpp's own per-op GPU times on a prompt, for the kernels we compare against.

    .venv/bin/python bench/lcpp_ops.py --llama-vulkan PATH -m FILE [--prompt 32768]
        [--llama-arg=-ub --llama-arg=2048 ...] [--log-dir DIR]

Issue 13 measures trio-llm end to end beside llama-server; to say *which* of our
kernels is behind, the same prompt's per-op times on llama.cpp's Vulkan backend are
needed beside ours (``bench/prefill.py``: attention of whole prompts, ``bench/matmul.py``
and ``bench/decode.py --pp-breakdown``: the products). ggml-vulkan measures them
itself: with ``GGML_VK_PERF_LOGGER`` set it puts a timestamp between the graph's ops
and prints, after each graph, ``NAME: COUNT x AVG us = TOTAL us (GFLOPS/s)`` per op
name (``GGML_VK_PERF_LOGGER_FREQUENCY=1``: every graph). The timestamps serialise the
ops, so these are each op's own time, as ours are.

One llama-server (``-ngl 99 -fa on -np 1``, context the prompt + 64) answers one short
warm-up request, then the measured one: ``--prompt`` random NORMAL token ids
(bench/e2e.py's ``Prompts``; the partial-UTF-8 tokens banned as e2e does for this
server), ``n_predict`` 1, ``cache_prompt`` false. The log after the warm-up is parsed:
per op name (llama.cpp's, with shapes: ``MUL_MAT q8_0 m=2048 n=512 k=2048``,
``FLASH_ATTN_EXT dst(...) q(...) k(...)``...), the count, total microseconds and the
FLOPs where ggml counts them (matrix products and flash attention; ggml counts the
attention over every key of the cache view, masked or not). The table groups them by
kind (the name without its shapes); the JSON record keeps every name.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import tempfile
from pathlib import Path
from typing import Any

import common
import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from e2e import Prompts, Server, free_port  # noqa: E402

LINE = re.compile(r"^(?P<name>.+?): (?P<count>\d+) x (?P<avg>[0-9.e+-]+) us = (?P<total>[0-9.e+-]+) us"
                  r"(?: \((?P<gflops>[0-9.e+-]+) GFLOPS/s\))?\s*$")


def parse_timings(text: str) -> dict[str, dict[str, float]]:
    """Sum every "Vulkan Timings" block of a log: op name -> count, total_us, flops
    (0 where ggml printed no GFLOPS for it)."""
    ops: dict[str, dict[str, float]] = {}
    inside = False
    for line in text.splitlines():
        if line.startswith("Vulkan Timings:"):
            inside = True
            continue
        m = LINE.match(line) if inside else None
        if m is None:
            inside = False  # "Total time:", the separator, or anything else ends a block
            continue
        op = ops.setdefault(m["name"], {"count": 0.0, "total_us": 0.0, "flops": 0.0})
        total = float(m["total"])
        op["count"] += int(m["count"])
        op["total_us"] += total
        if m["gflops"] is not None:
            op["flops"] += float(m["gflops"]) * 1e9 * total * 1e-6
    return ops


def kind(name: str) -> str:
    """The op name without its shapes: words up to the first with '=' or '('."""
    words = []
    for w in name.split():
        if "=" in w or "(" in w:
            break
        words.append(w)
    return " ".join(words) or name


def by_kind(ops: dict[str, dict[str, float]]) -> list[dict[str, Any]]:
    out: dict[str, dict[str, float]] = {}
    for name, op in ops.items():
        k = out.setdefault(kind(name), {"count": 0.0, "total_us": 0.0, "flops": 0.0})
        for key in k:
            k[key] += op[key]
    total = sum(k["total_us"] for k in out.values()) or 1.0
    rows = []
    for name, k in sorted(out.items(), key=lambda kv: -kv[1]["total_us"]):
        rows.append({"kind": name, "count": int(k["count"]), "ms": k["total_us"] / 1e3,
                     "share": k["total_us"] / total,
                     "tflops": k["flops"] / (k["total_us"] * 1e-6) / 1e12 if k["flops"] and k["total_us"] else None})
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--llama-vulkan", type=Path, required=True, help="llama-server with the Vulkan backend")
    ap.add_argument("-m", "--model", type=Path, required=True)
    ap.add_argument("--prompt", type=int, default=32768, help="prompt tokens of the measured request")
    ap.add_argument("--llama-arg", action="append", default=[], help="an extra flag for llama-server (repeatable)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--start-timeout", type=float, default=300)
    ap.add_argument("--request-timeout", type=float, default=600)
    ap.add_argument("--log-dir", type=Path)
    args = ap.parse_args()

    prompts = Prompts(args.model, args.seed, "hello")
    ban = prompts.partial_utf8()
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="lcpp-ops-"))
    port = free_port()
    ctx = args.prompt + 64
    argv = [str(args.llama_vulkan), "-m", str(args.model), "-ngl", "99", "-fa", "on", "-np", "1", "-c", str(ctx),
            "--port", str(port), "--host", "127.0.0.1", *args.llama_arg]
    env = dict(os.environ, GGML_VK_PERF_LOGGER="1", GGML_VK_PERF_LOGGER_FREQUENCY="1")
    lib = str(args.llama_vulkan.resolve().parent)
    env["LD_LIBRARY_PATH"] = lib + (":" + env["LD_LIBRARY_PATH"] if env.get("LD_LIBRARY_PATH") else "")
    log = log_dir / f"lcpp-ops-{args.model.stem}-{args.prompt}.log"
    print(f"lcpp_ops: start {' '.join(argv)}", file=sys.stderr, flush=True)
    server = Server("vulkan", argv, env, log, port)
    answer: dict[str, Any] = {}
    try:
        server.wait_healthy(common.now() + args.start_timeout)
        body: dict[str, Any] = {"n_predict": 1, "cache_prompt": False, "temperature": 0,
                                "logit_bias": [[t, False] for t in ban]}
        with httpx.Client(base_url=server.url, timeout=args.request_timeout) as c:
            r = c.post("/completion", json={**body, "prompt": prompts.ids(min(args.prompt, 512), 0)})
            if r.status_code != 200:
                raise SystemExit(f"lcpp_ops: warm-up answered HTTP {r.status_code}: {r.text[:300]}")
            start = log.stat().st_size
            r = c.post("/completion", json={**body, "prompt": prompts.ids(args.prompt, 1)})
            if r.status_code != 200:
                raise SystemExit(f"lcpp_ops: HTTP {r.status_code}: {r.text[:300]}")
            answer = r.json().get("timings") or {}
    finally:
        server.stop()
    with log.open("rb") as f:
        f.seek(start)
        text = f.read().decode(errors="replace")
    ops = parse_timings(text)
    if not ops:
        raise SystemExit(f"lcpp_ops: no 'Vulkan Timings' in {log} (is this llama-server's Vulkan build?)")
    rows = by_kind(ops)
    common.print_table([{"kind": r["kind"], "count": r["count"], "ms": f"{r['ms']:.2f}", "share": f"{r['share']:.3f}",
                         "TFLOP/s": "" if r["tflops"] is None else f"{r['tflops']:.1f}"} for r in rows])
    gpu_ms = sum(r["ms"] for r in rows)
    print(f"ops {gpu_ms:.1f} ms in all; the server's prompt_ms {answer.get('prompt_ms', float('nan')):.1f} "
          f"({answer.get('prompt_per_second', float('nan')):,.0f} tok/s with the timestamps between ops)")
    out = common.write_result(f"lcpp-ops-{args.model.stem}", vars(args),
                              {"timings": answer, "by_kind": rows, "ops": ops, "log": str(log), "banned": len(ban)})
    print(f"wrote {out.relative_to(common.ROOT)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Hand-off latency between two real servers sharing one arena.

    .venv/bin/python bench/handoff.py [--model tiny:Q8_0] [--backend numpy]
        [--handoffs 60] [--sleep-mode weights] [--tokens 4] [--timeout 60]
        [--arena-budget MIB|auto]

Starts two ``trio-llm serve`` processes on one fresh arena, then sends N streaming
``/completion`` requests alternating between them, one at a time. Every request
goes to the server that is cold (the other one holds the GPU), so each is one
hand-off: the holder notices the waiter (10 ms probe), releases, gives the token
back, and the requester takes it, restores and decodes.

Hand-off latency = request sent → first token event (docs/BENCHMARKS.md). A request
that gets no first token within ``--timeout`` counts as stranded. The warm figure
(the same server asked twice in a row, no hand-off) is measured too, so the
hand-off cost is the difference. Reference fork on an RX 580: median 0.309 s over 60,
0 stranded.

With ``--arena-budget`` both servers run co-resident (``docs/arbiter.md``): when both
fit, nobody yields, and the "hand-off" figure is a co-resident pair's request latency,
which should equal the warm figure (``server_cycles`` then shows no yields).
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import common
import httpx
import trio


async def start(path: Path, arena: Path, backend: str, mode: str,
                budget: str | None = None) -> tuple[trio.Process, str]:
    proc = await trio.lowlevel.open_process(
        [sys.executable, "-m", "trio_llm", "serve", "-m", str(path), "--port", "0",
         "--backend", backend, "--vram-arena", str(arena), "--sleep-mode", mode,
         *(["--arena-budget", budget] if budget else [])],
        stderr=subprocess.PIPE,
    )
    assert proc.stderr is not None
    buf, url = b"", ""
    with trio.fail_after(600):
        while True:
            chunk = await proc.stderr.receive_some()
            if not chunk:
                raise RuntimeError("server exited during start-up")
            buf += chunk
            text = buf.decode(errors="replace")
            if m := re.search(r"listening on (http://\S+)", text):
                url = m.group(1)
            if "trio-llm: ready" in text:
                break
    return proc, url


async def first_token(client: httpx.AsyncClient, tokens: int, timeout: float) -> float | None:
    body = {"prompt": "Once upon a time", "n_predict": tokens, "stream": True, "ignore_eos": True}
    t0 = common.now()
    first: float | None = None
    with trio.move_on_after(timeout):
        async with client.stream("POST", "/completion", json=body) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: ") and first is None:
                    first = common.now() - t0
    return first


async def run(args: argparse.Namespace) -> dict[str, object]:
    if args.model.endswith(".gguf"):
        path = Path(args.model)
    else:
        preset, quant = args.model.split(":")
        path = common.model_file(preset, quant)
    arena = Path(tempfile.mkdtemp(prefix="trio-llm-arena-"))
    procs = []
    try:
        for _ in range(2):
            procs.append(await start(path, arena, args.backend, args.sleep_mode, args.arena_budget))
        clients = [httpx.AsyncClient(base_url=url, timeout=args.timeout) for _, url in procs]
        warm: list[float] = []
        handoffs: list[float] = []
        stranded = 0
        # the second server loaded last and holds the token: begin with the first
        for i in range(args.handoffs):
            latency = await first_token(clients[i % 2], args.tokens, args.timeout)
            if latency is None:
                stranded += 1
            else:
                handoffs.append(latency)
            if i % 10 == 9:  # now and then, the same server again: no hand-off
                w = await first_token(clients[i % 2], args.tokens, args.timeout)
                if w is not None:
                    warm.append(w)
        props = [(await c.get("/props")).json()["residency"] for c in clients]
        for c in clients:
            await c.aclose()
    finally:
        for proc, _ in procs:
            proc.terminate()
            with trio.move_on_after(30):
                await proc.wait()
    ordered = sorted(handoffs)
    p95 = ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))] if ordered else float("nan")
    return {
        "handoff_s": common.stats(handoffs) if handoffs else None,
        "handoff_p95_s": p95,
        "warm_first_token_s": common.stats(warm) if warm else None,
        "stranded": stranded,
        "handoffs": args.handoffs,
        "server_cycles": [p["cycles"] for p in props],
        "exit_codes": [proc.returncode for proc, _ in procs],
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny:Q8_0", help="PRESET:QUANT (synthetic) or a .gguf path")
    ap.add_argument("--backend", default="numpy", choices=["numpy", "vulkan", "auto"])
    ap.add_argument("--handoffs", type=int, default=60)
    ap.add_argument("--sleep-mode", default="weights", choices=["weights", "all", "unload"])
    ap.add_argument("--tokens", type=int, default=4)
    ap.add_argument("--timeout", type=float, default=60.0)
    ap.add_argument("--arena-budget", default=None, help="MIB or auto: the two servers co-resident")
    args = ap.parse_args()
    figures = trio.run(run, args)
    h = figures["handoff_s"]
    w = figures["warm_first_token_s"]
    common.print_table([{
        "handoffs": args.handoffs,
        "median_s": h.median if h else "-",
        "p95_s": figures["handoff_p95_s"],
        "max_s": h.max if h else "-",
        "warm_median_s": w.median if w else "-",
        "stranded": figures["stranded"],
        "exit_codes": figures["exit_codes"],
    }])
    out = common.write_result("handoff", vars(args), figures)
    print(f"wrote {out}", file=sys.stderr)
    return 0 if figures["stranded"] == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())

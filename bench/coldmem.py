"""A model's device memory resident and after ``POST /sleep?level=all``, through ``trio-llm serve``.

    .venv/bin/python bench/coldmem.py --model FILE [--model FILE ...] [--backend vulkan]
        [--ctx 4096] [--n-predict 16] [--arg=-ctk --arg=q8_0]

Issue 12's check for hybrid models, end to end: per model, one server (``--sleep-mode
all``, one slot) answers a greedy request (``cache_prompt`` on), is put to sleep at
``all``, then answers the same request again. It records:
- the device memory resident, cold and after the wake, from the backend's own
  accounting (``/props`` ``residency.device_bytes_total``) and, on an NVIDIA GPU, from the
  driver's per-process counter (``nvidia-smi --query-compute-apps``, which also counts the
  Vulkan context the process keeps while cold);
- whether the answer after the wake equals the one before, and the wake's
  ``timings.cache_n`` (the prompt reused from the restored cache or a state checkpoint).

A row passes when the continuation is the same, ``cache_n > 0`` and the cold backend
bytes are at most 5 % of the resident ones; the exit code is 1 if a row fails. The
driver's figures are reported beside them, not judged: they include the process's
Vulkan context, which no release gives back.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

import common
import httpx
from e2e import Server, ServerFailed, device_mib, free_port

PROMPT = "Once upon a time, in a town by the sea, there lived a keeper of lights who " * 4


def props_bytes(c: httpx.Client) -> tuple[str, int]:
    """(residency state, device bytes by the backend's accounting) from /props."""
    r = c.get("/props", timeout=30)
    r.raise_for_status()
    res = r.json().get("residency") or {}
    return str(res.get("state")), int(res.get("device_bytes_total") or 0)


def ask(c: httpx.Client, n_predict: int, timeout: float) -> dict[str, Any]:
    r = c.post("/completion", json={"prompt": PROMPT, "n_predict": n_predict, "temperature": 0,
                                    "cache_prompt": True}, timeout=timeout)
    if r.status_code != 200:
        raise ServerFailed(f"/completion: HTTP {r.status_code}: {r.text[:300]}")
    return dict(r.json())


def measure(c: httpx.Client, pid: int) -> dict[str, Any]:
    state, backend = props_bytes(c)
    return {"state": state, "backend_bytes": backend, "driver_mib": device_mib(pid)}


def one(path: Path, args: argparse.Namespace, log_dir: Path) -> dict[str, Any]:
    port = free_port()
    argv = [sys.executable, "-m", "trio_llm", "serve", "-m", str(path), "-c", str(args.ctx), "-np", "1",
            "--port", str(port), "--host", "127.0.0.1", "--backend", args.backend, "--sleep-mode", "all",
            *args.arg]
    srv = Server("trio", argv, dict(os.environ), log_dir / f"coldmem-{path.stem}.log", port)
    try:
        srv.wait_healthy(common.now() + args.timeout)
        with httpx.Client(base_url=srv.url) as c:
            first = ask(c, args.n_predict, args.timeout)
            resident = measure(c, srv.proc.pid)
            r = c.post("/sleep", params={"level": "all"}, timeout=args.timeout)
            if r.status_code != 200:
                raise ServerFailed(f"/sleep: HTTP {r.status_code}: {r.text[:300]}")
            deadline = common.now() + args.timeout
            while props_bytes(c)[0] != "cold":
                if common.now() > deadline:
                    raise ServerFailed("the server did not go cold after POST /sleep?level=all")
                time.sleep(0.05)
            cold = measure(c, srv.proc.pid)
            again = ask(c, args.n_predict, args.timeout)
            woken = measure(c, srv.proc.pid)
    finally:
        code = srv.stop()
    cache_n = int((again.get("timings") or {}).get("cache_n", 0))
    share = cold["backend_bytes"] / resident["backend_bytes"] if resident["backend_bytes"] else None
    checks = {
        "same_continuation": first.get("content") == again.get("content"),
        "prompt_reused": cache_n > 0,
        "cold_at_most_5pct": share is not None and share <= 0.05,
    }
    return {"model": path.name, "resident": resident, "cold": cold, "after_wake": woken,
            "cold_share_backend": share, "cache_n_after_wake": cache_n,
            "tokens": int((first.get("timings") or {}).get("predicted_n", 0)), "checks": checks,
            "passed": all(checks.values()), "exit": code}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", "-m", action="append", required=True, help="a .gguf file (repeatable)")
    ap.add_argument("--backend", default="vulkan", choices=["numpy", "vulkan", "auto"])
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--n-predict", type=int, default=16)
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per start and per request")
    ap.add_argument("--arg", action="append", default=[], help="one more `trio-llm serve` argument (repeatable; "
                    "--arg=-ctk for one that starts with a dash)")
    ap.add_argument("--log-dir", default="bench/results/coldmem-logs")
    args = ap.parse_args()
    paths = [Path(m) for m in args.model]
    for p in paths:
        if not p.is_file():
            print(f"coldmem: no such model file: {p}", file=sys.stderr)
            return 2
    rows = []
    for p in paths:
        try:
            rows.append(one(p, args, Path(args.log_dir)))
        except (ServerFailed, httpx.HTTPError) as e:
            print(f"coldmem: {p.name}: {e}", file=sys.stderr)
            rows.append({"model": p.name, "error": str(e), "passed": False})
    table = []
    for r in rows:
        if "error" in r:
            table.append({"model": r["model"], "result": "error"})
            continue
        mib = 1 << 20
        table.append({
            "model": r["model"],
            "resident MiB": r["resident"]["backend_bytes"] / mib,
            "cold MiB": r["cold"]["backend_bytes"] / mib,
            "cold share": r["cold_share_backend"],
            "driver resident MiB": r["resident"]["driver_mib"] if r["resident"]["driver_mib"] is not None else "",
            "driver cold MiB": r["cold"]["driver_mib"] if r["cold"]["driver_mib"] is not None else "",
            "cache_n after wake": r["cache_n_after_wake"],
            "same answer": r["checks"]["same_continuation"],
            "result": "pass" if r["passed"] else "FAIL",
        })
    common.print_table(table)
    out = common.write_result("coldmem", vars(args), {"rows": rows})
    print(f"wrote {out}")
    return 0 if all(r["passed"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())

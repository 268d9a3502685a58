"""Time to first token and tokens/s through the HTTP server vs direct engine calls.

    .venv/bin/python bench/server.py [--model demo:Q8_0] [--backend numpy]
        [--prompt 64] [--tokens 64] [--clients 1,4] [--repeats 3]

For each client count N:

* direct: the backend driven in-process the way the slots loop drives it, with no
  HTTP, queue or sampling in between: one prefill forward per sequence, then decode
  steps batching all N sequences into one forward (greedy argmax);
* http: a real ``trio-llm serve -np N`` process; N concurrent streaming
  ``/completion`` requests (a distinct random token prompt each, ``cache_prompt``
  off, ``ignore_eos``), TTFT = request sent → first SSE event, decode tok/s = tokens
  after the first ÷ time after the first.

The ratio http/direct is the server's overhead (HTTP, JSON, SSE, queue, sampling,
the trio loop); absolute numbers on a shared CPU are only comparable within one run.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys

import common
import httpx
import numpy as np
import trio

from trio_llm.engine.backend import SeqBatch
from trio_llm.engine.loader import open_backend
from trio_llm.model.gguf import load_gguf


def prompts(n: int, length: int, n_vocab: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(10, n_vocab, length).tolist() for _ in range(n)]


def direct(path: str, backend: str, n_clients: int, p_len: int, t_len: int, repeats: int) -> dict:
    model = load_gguf(path)
    be = open_backend(backend, model, n_ctx=p_len + t_len + 8, n_seq=n_clients)
    ttfts: list[float] = []
    tps: list[float] = []
    agg: list[float] = []
    for r in range(repeats + 1):
        ps = prompts(n_clients, p_len, be.config.n_vocab, seed=r)
        t0 = common.now()
        first: list[float] = []
        toks = []
        for i, p in enumerate(ps):  # the slots loop packs prompts into one pass; with -b >= N*P it is one forward
            logits = be.forward([SeqBatch(i, np.asarray(p, np.int32), 0)])
            toks.append(int(np.argmax(logits[0])))
            first.append(common.now() - t0)
        t_first = common.now()
        for step in range(t_len - 1):
            batch = [SeqBatch(i, np.array([toks[i]], np.int32), p_len + step) for i in range(n_clients)]
            logits = be.forward(batch)  # [n_clients, n_vocab]
            toks = [int(np.argmax(row)) for row in logits]
        t_end = common.now()
        if r == 0:
            continue  # warm-up
        ttfts.extend(first)
        tps.append((t_len - 1) / (t_end - t_first))
        agg.append(n_clients * t_len / (t_end - t0))
    be.close()
    model.close()
    return {"ttft_s": common.stats(ttfts), "decode_tps": common.stats(tps), "aggregate_tps": common.stats(agg)}


async def start_server(path: str, backend: str, n_clients: int, ctx: int) -> tuple[trio.Process, str]:
    proc = await trio.lowlevel.open_process(
        [sys.executable, "-m", "trio_llm", "serve", "-m", path, "--port", "0", "--backend", backend,
         "-np", str(n_clients), "-c", str(ctx * n_clients), "--temp", "0", "-b", "4096"],
        stderr=subprocess.PIPE,
    )
    assert proc.stderr is not None
    buf, url = b"", ""
    with trio.fail_after(300):
        while b"trio-llm: ready" not in buf:
            chunk = await proc.stderr.receive_some()
            if not chunk:
                raise RuntimeError("server exited: " + buf.decode(errors="replace"))
            buf += chunk
            m = re.search(rb"listening on (http://\S+)", buf)
            if m:
                url = m.group(1).decode()
    return proc, url


async def one_stream(c: httpx.AsyncClient, prompt: list[int], t_len: int) -> tuple[float, float, int]:
    """(ttft, seconds after the first token, tokens after the first)."""
    body = {"prompt": prompt, "n_predict": t_len, "stream": True, "cache_prompt": False,
            "ignore_eos": True, "temperature": 0}
    t0 = common.now()
    t_first = None
    n = 0
    async with c.stream("POST", "/completion", json=body) as r:
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            ev = json.loads(line[6:])
            if ev.get("stop"):
                break
            n += 1
            if t_first is None:
                t_first = common.now()
    t_end = common.now()
    assert t_first is not None and n == t_len, (n, t_len)
    return t_first - t0, t_end - t_first, n - 1


async def http(path: str, backend: str, n_clients: int, p_len: int, t_len: int, repeats: int, n_vocab: int) -> dict:
    proc, url = await start_server(path, backend, n_clients, p_len + t_len + 8)
    ttfts: list[float] = []
    tps: list[float] = []
    agg: list[float] = []
    try:
        async with httpx.AsyncClient(base_url=url, timeout=600) as c:
            for r in range(repeats + 1):
                ps = prompts(n_clients, p_len, n_vocab, seed=100 + r)
                results: list[tuple[float, float, int]] = []

                async def run(p: list[int], out: list[tuple[float, float, int]] = results) -> None:
                    out.append(await one_stream(c, p, t_len))

                t0 = common.now()
                async with trio.open_nursery() as nursery:
                    for p in ps:
                        nursery.start_soon(run, p)
                wall = common.now() - t0
                if r == 0:
                    continue
                ttfts.extend(x[0] for x in results)
                tps.extend(x[2] / x[1] for x in results)
                agg.append(n_clients * t_len / wall)
    finally:
        proc.terminate()
        await proc.wait()
    return {"ttft_s": common.stats(ttfts), "decode_tps": common.stats(tps), "aggregate_tps": common.stats(agg)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="demo:Q8_0", help="preset:quant of a synthetic model")
    ap.add_argument("--backend", default="numpy")
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--clients", default="1,4")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    preset, quant = args.model.split(":")
    path = str(common.model_file(preset, quant))
    n_vocab = load_gguf(path).config.n_vocab
    rows = []
    figures = {}
    for n in [int(x) for x in args.clients.split(",")]:
        d = direct(path, args.backend, n, args.prompt, args.tokens, args.repeats)
        h = trio.run(http, path, args.backend, n, args.prompt, args.tokens, args.repeats, n_vocab)
        figures[f"np{n}"] = {"direct": d, "http": h}
        for mode, f in (("direct", d), ("http", h)):
            rows.append({
                "clients": n, "mode": mode,
                "ttft_ms": 1e3 * f["ttft_s"].median,
                "decode_tok/s/client": f["decode_tps"].median,
                "aggregate_tok/s": f["aggregate_tps"].median,
            })
        rows.append({
            "clients": n, "mode": "http/direct",
            "ttft_ms": h["ttft_s"].median / d["ttft_s"].median,
            "decode_tok/s/client": h["decode_tps"].median / d["decode_tps"].median,
            "aggregate_tok/s": h["aggregate_tps"].median / d["aggregate_tps"].median,
        })
    print(f"model {args.model}, backend {args.backend}, prompt {args.prompt} tokens, "
          f"{args.tokens} generated, greedy, medians of {args.repeats}")
    common.print_table(rows)
    out = common.write_result("server", vars(args), figures)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

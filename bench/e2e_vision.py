"""An image request end to end through HTTP: `trio-llm serve --mmproj` beside
llama-server (CUDA, Vulkan) with the same text model and the same projector file.

    .venv/bin/python bench/e2e_vision.py --model TEXT.gguf --mmproj MMPROJ.gguf
        [--llama-cuda PATH] [--llama-vulkan PATH] [--backend vulkan] [--repeats 3]
        [--n-predict 32] [--image-size 896] [--trio-arg FLAG ...]

What a client of a vision model waits for: per server, one warm-up request, then
``--repeats`` ``/completion`` requests of a short text with one image each (a new
random image every request, so no server answers from a cache of encoded images or of
the prompt: ``cache_prompt: false``), ``n_predict`` tokens greedy with ``ignore_eos``.
Every server gets the same ``logit_bias`` banning the tokens that are not whole UTF-8
alone (bench/e2e.py's ``--ban-partial-utf8``: llama-server answers HTTP 500 to a
random-weight model's broken UTF-8). Kept per request: the client's wall time, the server's ``timings`` (prompt_n counts
the image's rows), and (streamed, once per server) the time to the first token. The
media marker is fixed for every server through ``LLAMA_MEDIA_MARKER``.

The encoder is where trio-llm differs most: it runs on the CPU (numpy) while
llama-server offloads it to the GPU, so the record also times ``Projector.encode``
alone in this process (the host's cores), to say how much of the wall time it is.

Prints one table and writes ``bench/results/e2e-vision-<stamp>.json`` (bench/common.py).
"""

from __future__ import annotations

import argparse
import base64
import io
import os
import sys
import time
from pathlib import Path
from typing import Any

import common
import httpx
import numpy as np
from e2e import Prompts, Server, ServerFailed, free_port

MARKER = "<__media__>"
TEXT = "<start_of_turn>user\nDescribe this picture: {}<end_of_turn>\n<start_of_turn>model\n"


def image_png(seed: int, size: int) -> bytes:
    from PIL import Image

    rng = np.random.default_rng(seed)
    arr = rng.integers(0, 256, (size, size, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr, "RGB").save(buf, format="PNG")
    return buf.getvalue()


def body(seed: int, size: int, n_predict: int, stream: bool, ban: list[int] | None = None) -> dict[str, Any]:
    data = base64.b64encode(image_png(seed, size)).decode()
    b: dict[str, Any] = {"prompt": {"prompt_string": TEXT.format(MARKER), "multimodal_data": [data]},
                         "n_predict": n_predict, "stream": stream, "cache_prompt": False, "ignore_eos": True,
                         "temperature": 0}
    if ban:  # e2e.py's --ban-partial-utf8: llama-server answers 500 to a random model's broken UTF-8
        b["logit_bias"] = [[t, False] for t in ban]
    return b


def argv_of(name: str, args: argparse.Namespace, port: int) -> tuple[list[str], dict[str, str]]:
    env = dict(os.environ, LLAMA_MEDIA_MARKER=MARKER)
    common_flags = ["-m", str(args.model), "--mmproj", str(args.mmproj), "-c", str(args.ctx), "-np", "1",
                    "--port", str(port)]
    if name == "trio":
        return [sys.executable, "-m", "trio_llm", "serve", *common_flags, "--backend", args.backend,
                *args.trio_arg], env
    binary = args.llama_cuda if name == "cuda" else args.llama_vulkan
    if name == "vulkan":
        env["LD_LIBRARY_PATH"] = str(Path(binary).parent)
    return [str(binary), *common_flags, "-ngl", "99", "-fa", "on"], env


def measure(name: str, args: argparse.Namespace, logs: Path, ban: list[int]) -> dict[str, Any]:
    port = free_port()
    argv, env = argv_of(name, args, port)
    server = Server(name, argv, env, logs / f"{name}.log", port)
    out: dict[str, Any] = {"argv": argv}
    try:
        out["ready_s"] = server.wait_healthy(common.now() + args.start_timeout)
        with httpx.Client(base_url=server.url, timeout=args.request_timeout) as c:
            seed = 1000
            r = c.post("/completion", json=body(seed, args.image_size, args.n_predict, False, ban))
            if r.status_code != 200:
                raise ServerFailed(f"{name}: HTTP {r.status_code}: {r.text[:300]}")
            runs = []
            for i in range(args.repeats):
                t0 = common.now()
                r = c.post("/completion", json=body(seed + 1 + i, args.image_size, args.n_predict, False, ban))
                wall = common.now() - t0
                if r.status_code != 200:
                    raise ServerFailed(f"{name}: HTTP {r.status_code}: {r.text[:300]}")
                t = r.json()["timings"]
                runs.append({"wall_s": wall, **{k: float(t[k]) for k in ("prompt_n", "prompt_ms", "predicted_n",
                                                                          "predicted_ms")}})
            out["runs"] = runs
            t0 = common.now()
            with c.stream("POST", "/completion",
                          json=body(seed + 99, args.image_size, args.n_predict, True, ban)) as s:
                for line in s.iter_lines():
                    if line.startswith("data:"):
                        out["ttft_s"] = common.now() - t0
                        break
    except (ServerFailed, httpx.HTTPError) as exc:
        out["error"] = str(exc)[:2000]
    finally:
        server.stop()
    return out


def encode_alone(args: argparse.Namespace) -> dict[str, Any]:
    """``Projector.encode`` of one image in this process: the CPU encoder's share."""
    from trio_llm.vision import decode_image, load_projector, preprocess

    proj = load_projector(args.mmproj)
    pixels = preprocess(decode_image(image_png(7, args.image_size)), proj)
    proj.encode(pixels)  # warm: the mapped weights read once
    t0 = time.perf_counter()
    proj.encode(pixels)
    return {"encode_s": time.perf_counter() - t0, "n_tokens": proj.n_tokens, "cpus": os.cpu_count()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--mmproj", type=Path, required=True)
    ap.add_argument("--llama-cuda", type=Path)
    ap.add_argument("--llama-vulkan", type=Path)
    ap.add_argument("--backend", default="vulkan")
    ap.add_argument("--trio-arg", action="append", default=[])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--n-predict", type=int, default=32)
    ap.add_argument("--image-size", type=int, default=896, help="side of the random square test image")
    ap.add_argument("--ctx", type=int, default=2048)
    ap.add_argument("--start-timeout", type=float, default=600)
    ap.add_argument("--request-timeout", type=float, default=600)
    ap.add_argument("--log-dir", type=Path, default=Path("bench/results/e2e-vision-logs"))
    ap.add_argument("--no-trio", action="store_true")
    args = ap.parse_args()

    servers = [s for s, on in (("trio", not args.no_trio), ("vulkan", args.llama_vulkan), ("cuda", args.llama_cuda))
               if on]
    figures: dict[str, Any] = {"encode": encode_alone(args)} if not args.no_trio else {}
    # the same ban for every server (the same decode for all): the tokens that are not
    # whole UTF-8 alone, which a random model emits and llama-server answers 500 to
    ban = Prompts(args.model, 0, "hello").partial_utf8()
    figures["banned_tokens"] = len(ban)
    for name in servers:
        figures[name] = measure(name, args, args.log_dir, ban)
    rows = []
    for name in servers:
        f = figures[name]
        runs = f.get("runs") or []
        row: dict[str, Any] = {"server": name}
        if runs:
            row |= {"wall_s": float(np.median([r["wall_s"] for r in runs])),
                    "prompt_ms": float(np.median([r["prompt_ms"] for r in runs])),
                    "prompt_n": runs[0]["prompt_n"],
                    "tg_tok_s": float(np.median([1e3 * r["predicted_n"] / r["predicted_ms"] for r in runs]))}
        row["ttft_s"] = f.get("ttft_s")
        row["error"] = f.get("error", "")[:80]
        rows.append(row)
    trio = next((r for r in rows if r["server"] == "trio" and "wall_s" in r), None)
    for r in rows:
        if trio is not None and "wall_s" in r and r is not trio:
            r["trio_wall_ratio"] = r["wall_s"] / trio["wall_s"]  # >1: trio-llm answers sooner
    common.print_table(rows)
    if "encode" in figures:
        print(f"encode alone (this process, {figures['encode']['cpus']} CPUs): {figures['encode']['encode_s']:.2f} s")
    path = common.write_result("e2e-vision", vars(args), {"rows": rows, **figures})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

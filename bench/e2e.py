"""End to end through HTTP: `trio-llm serve` beside llama-server (CUDA, Vulkan), same file.

    .venv/bin/python bench/e2e.py --model FILE [--prompts 512,8192,32768,131072]
        [--model FILE2 --prompts 512,16384 ...] [--clients K]
        [--llama-cuda PATH] [--llama-vulkan PATH] [--wait-for FILE]
        [--backend vulkan] [--repeats 3] [--n-predict 128] [--budget-s S]
        [--text-prompts] [--ctx max|row] [--log-dir DIR]

The figure a user sees is what a client measures (docs BENCHMARKS: "a speed figure is
what a client sees"), so every number here comes from `/completion` answers of a real
server process, one server at a time on the same GGUF file:

* trio-llm: ``sys.executable -m trio_llm serve -m FILE -c CTX -np 1 --port P --backend B``
  (the project's own Python, so the tree under test is the one on ``PYTHONPATH``);
* llama-server CUDA and llama-server Vulkan when their paths are given:
  ``-m FILE -ngl 99 -fa on -np 1 -c CTX --port P`` (the October 2026 source's flags;
  its own start-up warm-up, an empty decode, stays on as users run it: it only moves
  the time to ready, and every row below has its own warm-up request anyway). The
  Vulkan build finds its libraries through ``LD_LIBRARY_PATH`` = the binary's folder.

Per prompt length (a row): one warm-up request of that length, ``--repeats`` requests
(``n_predict`` 128, ``cache_prompt: false``, ``ignore_eos: true``, ``temperature: 0``)
whose ``timings.prompt_per_second`` / ``predicted_per_second`` / ``prompt_n`` /
``predicted_n`` and client wall time are kept, then one streamed request (``stream:
true``) for the time to first token: request sent -> first SSE ``data:`` event (only up
to ``--ttft-max`` tokens when given: beyond, it is about ``prompt_ms`` anyway). The
prompt is random ordinary token ids (GGUF token type NORMAL, fixed seed, BOS first,
the same ids for every server), or ``"hello " * (n - 1)`` with ``--text-prompts``; a
server that answers an id prompt with HTTP 5xx is retried with the text prompt for that
row and the record says so. The servers of ``--ban-partial-utf8`` (default the Vulkan
llama-server, which answers HTTP 500 when a random-weight model's answer is not valid
UTF-8) get a ``logit_bias`` that bans the tokens that are not whole UTF-8 alone (the
record counts them): the same prefill, and as many tokens decoded at the same depths. ``--clients K``: a server with ``-np K``, K concurrent requests of a
``--client-prompt``-token prompt x 128 tokens; aggregate tok/s = tokens generated ÷
wall time of the round.

Contexts: ``--ctx max`` (default) starts each server once per model with ``-c`` = the
longest prompt + n_predict + ``--ctx-margin``; ``--ctx row`` starts one per row with
its own ``-c`` (slower: a start per row). Servers run in the order trio-llm, Vulkan,
CUDA, so a CUDA build in the background (``--wait-for`` its done-marker) overlaps our
own measurement. ``--budget-s`` bounds the whole run: a row whose estimated time (from
the rates of the previous row on the same server, scaled for length) does not fit in
what is left, less ``--reserve-s`` per server start still to come, is skipped and listed
under ``skipped`` in the record; a request cut by the budget ends its row early.

Prints one table (per model and prompt length: each server's prefill and decode tok/s,
time to first token, and trio-llm's ratio to each llama.cpp) and writes one JSON record
``bench/results/e2e-<stamp>.json`` (bench/common.py: command, machine, commit, every
figure as min/median/max) — also when interrupted, with what was measured by then.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import common
import httpx
import numpy as np

SERVERS = ("trio", "vulkan", "cuda")  # measurement order; ratios are trio / the others
TIMING_KEYS = ("prompt_per_second", "predicted_per_second", "prompt_n", "predicted_n", "prompt_ms", "predicted_ms")


class BudgetExhausted(Exception):
    """The run's time budget ran out (a request was cut, or no time is left)."""


class ServerFailed(Exception):
    """A server did not start, or died, or answered with an error we cannot work around."""


class Terminated(BaseException):
    """SIGTERM (e.g. from `timeout`): unwind, stop the server, write what we have."""


# -- prompts ----------------------------------------------------------------------


class Prompts:
    """Token-id and text prompts of given lengths, identical for every server.

    Ids are drawn from the vocabulary's NORMAL tokens (control, byte and unused tokens
    would make the request unlike a client's, and some servers refuse them), with a
    seed derived from (seed, length, index) so that row n's k-th prompt is the same ids
    on every server and differs between repeats.
    """

    def __init__(self, path: Path, seed: int, word: str) -> None:
        import gguf

        reader = gguf.GGUFReader(str(path), "r")

        def field(key: str) -> Any:
            f = reader.fields.get(key)
            return None if f is None else f.contents()

        tokens = field("tokenizer.ggml.tokens") or []
        types = field("tokenizer.ggml.token_type")
        self.n_vocab = len(tokens)
        if types is None:
            normal = np.arange(self.n_vocab)
        else:
            normal = np.flatnonzero(np.asarray(types) == int(gguf.TokenType.NORMAL))
        if len(normal) == 0:
            raise SystemExit(f"e2e: {path}: the vocabulary has no NORMAL tokens to build prompts from")
        self.normal = normal
        bos = field("tokenizer.ggml.bos_token_id")
        add_bos = field("tokenizer.ggml.add_bos_token")
        self.bos = int(bos) if bos is not None and add_bos is not False else None
        self.seed = seed
        self.word = word
        self._path = path
        self._partial: list[int] | None = None

    def partial_utf8(self) -> list[int]:
        """The ids whose text alone is not whole UTF-8 (byte-level BPE's single bytes of
        0x80 and up and merges that split a character; SentencePiece's byte-fallback
        tokens <0x80>..<0xFF>). Banned through ``logit_bias`` for the servers of
        ``--ban-partial-utf8``: the October 2026 llama-server parses every answer with its
        chat parser, which fails on invalid UTF-8 with HTTP 500, and a random-weight model
        emits such tokens. With them banned, every answer is a concatenation of whole
        UTF-8 pieces. Read through trio-llm's tokenizer (the token pieces as bytes)."""
        if self._partial is None:
            import gguf

            from trio_llm.model.tokenizer import Tokenizer

            reader = gguf.GGUFReader(str(self._path), "r")
            md = {k: f.contents() for k, f in reader.fields.items() if k.startswith("tokenizer.")}
            tok = Tokenizer.from_metadata(md)
            bad = []
            for t in range(tok.n_vocab):
                try:
                    tok.token_to_piece(t).decode("utf-8")
                except UnicodeDecodeError:
                    bad.append(t)
            self._partial = bad
        return self._partial

    def ids(self, n: int, index: int) -> list[int]:
        rng = np.random.default_rng([self.seed, n, index])
        body = self.normal[rng.integers(0, len(self.normal), n)].tolist()
        if self.bos is not None:
            body[0] = self.bos
        return [int(t) for t in body]

    def text(self, n: int) -> str:
        # "hello hello ..." is one token per word in the usual BPE vocabularies; the
        # server adds BOS, so n - 1 words make about n tokens (prompt_n says exactly).
        return " ".join([self.word] * max(1, n - 1))


# -- servers ----------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    """One server process on loopback, its output in a log file, stopped by pid."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str], log: Path, port: int) -> None:
        self.name, self.argv, self.log, self.port = name, argv, log, port
        self.url = f"http://127.0.0.1:{port}"
        log.parent.mkdir(parents=True, exist_ok=True)
        self._log_file = log.open("wb")
        self.proc = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=self._log_file, stderr=subprocess.STDOUT, env=env
        )

    def tail(self, lines: int = 20) -> str:
        try:
            text = self.log.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def wait_healthy(self, deadline: float) -> float:
        """Seconds from process start to the first /health 200."""
        t0 = common.now()
        with httpx.Client(base_url=self.url, timeout=5) as c:
            while True:
                if self.proc.poll() is not None:
                    raise ServerFailed(f"{self.name} exited with {self.proc.returncode} before /health answered 200:\n"
                                       + self.tail())
                try:
                    if c.get("/health").status_code == 200:
                        return common.now() - t0
                except httpx.HTTPError:
                    pass
                if common.now() > deadline:
                    raise ServerFailed(f"{self.name}: /health not 200 in time:\n" + self.tail())
                time.sleep(0.05)

    def stop(self) -> int | None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=15)
        self._log_file.close()
        return self.proc.returncode


# -- requests ---------------------------------------------------------------------


def body(prompt: list[int] | str, n_predict: int, stream: bool, ban: list[int] | None = None) -> dict[str, Any]:
    b: dict[str, Any] = {"prompt": prompt, "n_predict": n_predict, "stream": stream, "cache_prompt": False,
                         "ignore_eos": True, "temperature": 0}
    if ban:
        b["logit_bias"] = [[t, False] for t in ban]
    return b


def http_error(r: httpx.Response) -> str:
    return f"HTTP {r.status_code}: {r.text[:300]}"


def complete(c: httpx.Client, prompt: list[int] | str, n_predict: int, timeout: float,
             ban: list[int] | None = None) -> dict[str, Any]:
    """One non-streamed /completion; its timings plus the client's wall time."""
    t0 = common.now()
    try:
        r = c.post("/completion", json=body(prompt, n_predict, False, ban), timeout=timeout)
    except httpx.TimeoutException as e:
        raise BudgetExhausted(f"request cut after {timeout:.0f} s") from e
    wall = common.now() - t0
    if r.status_code != 200:
        raise httpx.HTTPStatusError(http_error(r), request=r.request, response=r)
    t = r.json().get("timings") or {}
    missing = [k for k in TIMING_KEYS if k not in t]
    if missing:
        raise ServerFailed(f"answer without timings {missing}: {r.text[:300]}")
    return {**{k: float(t[k]) for k in TIMING_KEYS}, "wall_s": wall}


def stream(c: httpx.Client, prompt: list[int] | str, n_predict: int, timeout: float,
           ban: list[int] | None = None) -> dict[str, Any]:
    """One streamed /completion: time to the first SSE data event, wall time, events."""
    t0 = common.now()
    ttft: float | None = None
    events = 0
    last: dict[str, Any] = {}
    try:
        with c.stream("POST", "/completion", json=body(prompt, n_predict, True, ban), timeout=timeout) as r:
            if r.status_code != 200:
                r.read()
                raise httpx.HTTPStatusError(http_error(r), request=r.request, response=r)
            for line in r.iter_lines():
                if not line.startswith("data:"):
                    continue
                if ttft is None:
                    ttft = common.now() - t0
                payload = line[5:].strip()
                if payload == "[DONE]":
                    break
                ev = json.loads(payload)
                if "error" in ev:
                    raise ServerFailed(f"stream error event: {payload[:300]}")
                events += 1
                last = ev
                if ev.get("stop"):
                    break
    except httpx.TimeoutException as e:
        raise BudgetExhausted(f"streamed request cut after {timeout:.0f} s") from e
    wall = common.now() - t0
    if ttft is None:
        raise ServerFailed("stream ended without a data event")
    out: dict[str, Any] = {"ttft_s": ttft, "wall_s": wall, "events": events}
    t = last.get("timings") or {}
    for k in TIMING_KEYS:
        if k in t:
            out[k] = float(t[k])
    return out


# -- the run ----------------------------------------------------------------------


class Run:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.t0 = common.now()
        self.deadline = self.t0 + args.budget_s if args.budget_s else float("inf")
        self.figures: dict[str, Any] = {}
        self.skipped: list[dict[str, Any]] = []
        self.servers_run: list[dict[str, Any]] = []
        self.log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="e2e-logs-"))
        self.starts_left = 0

    # budget

    def left(self) -> float:
        return self.deadline - common.now()

    def ban(self, server: str, prompts: Prompts, out: dict[str, Any]) -> list[int] | None:
        """``--ban-partial-utf8``: the ids this server's requests ban (``Prompts.partial_utf8``),
        their count kept in ``out``; None for the other servers. Prefill is the same work;
        decode generates as many tokens at the same depths, other ones."""
        if server not in self.args.ban_partial_utf8:
            return None
        ids = prompts.partial_utf8()
        out["banned_partial_utf8"] = len(ids)
        return ids

    def request_timeout(self) -> float:
        return max(1.0, min(self.args.request_timeout, self.left()))

    def skip(self, model: str, server: str, what: str, reason: str) -> None:
        self.skipped.append({"model": model, "server": server, "what": what, "reason": reason})
        print(f"e2e: skip {server} {model} {what}: {reason}", file=sys.stderr, flush=True)

    # servers

    def argv(self, server: str, model: Path, ctx: int, n_par: int, port: int) -> tuple[list[str], dict[str, str]]:
        a = self.args
        env = dict(os.environ)
        if server == "trio":
            argv = [sys.executable, "-m", "trio_llm", "serve", "-m", str(model), "-c", str(ctx),
                    "-np", str(n_par), "--port", str(port), "--host", "127.0.0.1", "--backend", a.backend,
                    *a.trio_arg]
            return argv, env
        binary = a.llama_cuda if server == "cuda" else a.llama_vulkan
        argv = [str(binary), "-m", str(model), "-ngl", "99", "-fa", "on", "-np", str(n_par), "-c", str(ctx),
                "--port", str(port), "--host", "127.0.0.1", *a.llama_arg]
        lib = str(Path(binary).resolve().parent)
        env["LD_LIBRARY_PATH"] = lib + (":" + env["LD_LIBRARY_PATH"] if env.get("LD_LIBRARY_PATH") else "")
        return argv, env

    def start(self, server: str, label: str, model: Path, ctx: int, n_par: int) -> tuple[Server, dict[str, Any]]:
        self.starts_left = max(0, self.starts_left - 1)
        port = free_port()
        argv, env = self.argv(server, model, ctx, n_par, port)
        log = self.log_dir / f"{server}-{label}-c{ctx}-np{n_par}.log"
        print(f"e2e: start {server}: {' '.join(argv)}", file=sys.stderr, flush=True)
        s = Server(server, argv, env, log, port)
        info: dict[str, Any] = {"server": server, "model": label, "argv": argv, "ctx": ctx, "n_parallel": n_par,
                                "log": str(log), "loadavg_at_start": os.getloadavg()}
        self.servers_run.append(info)
        try:
            info["ready_s"] = s.wait_healthy(min(self.deadline, common.now() + self.args.start_timeout))
            info["device_mib_ready"] = device_mib(s.proc.pid)
        except BaseException:
            info["exit"] = s.stop()
            raise
        return s, info

    # rows

    def estimate(self, prev: list[dict[str, Any]], n: int) -> float | None:
        """Seconds a row of length n will take on a server, from its earlier rows.

        Per-token time grows with depth (attention reads every earlier position): with
        two or more rows it is fitted as a + b*n (prefill: average over the prompt;
        decode: at the prompt's depth), which matched trio-llm's H200 figures of
        512/8k/32k within 5 %; from one row, the prefill rate is taken to fall as
        (n / n_prev) ** 0.35 and the decode rate as ** 0.6 (trio-llm on the H200, issue
        13: 512 -> 8k on llama-1b, 512 -> 16k on llama-8b; llama.cpp falls less, so its
        estimates err long). Times the requests of a row (warm-up, repeats, streamed).
        """
        if not prev:
            return None
        last = prev[-1]
        if len(prev) >= 2 and n > last["n"] > prev[-2]["n"]:
            first = prev[-2]

            def per_token(key: str) -> float:
                t1, t2 = 1 / first[key], 1 / last[key]
                b = max(0.0, (t2 - t1) / (last["n"] - first["n"]))
                return t2 + b * (n - last["n"])

            pp_s, tg_s = per_token("pp"), per_token("tg")
        else:
            r = max(1.0, n / last["n"])
            pp_s, tg_s = r**0.35 / last["pp"], r**0.6 / last["tg"]
        per = n * pp_s + self.args.n_predict * tg_s + last["overhead_s"]
        return per * (self.args.repeats + self.args.warmups + self.streamed(n))

    def streamed(self, n: int) -> bool:
        """Whether row n gets its streamed request (time to first token)."""
        return not self.args.ttft_max or n <= self.args.ttft_max

    def row(self, s: Server, prompts: Prompts, n: int, text: bool) -> dict[str, Any]:
        a = self.args
        out: dict[str, Any] = {"prompt_tokens_asked": n}
        ban = self.ban(s.name, prompts, out)
        with httpx.Client(base_url=s.url) as c:
            def ask(index: int, fn: Callable[..., dict[str, Any]]) -> dict[str, Any]:
                nonlocal text
                p: list[int] | str = prompts.text(n) if text else prompts.ids(n, index)
                try:
                    return fn(c, p, a.n_predict, self.request_timeout(), ban)
                except httpx.HTTPStatusError as e:
                    if text or e.response.status_code < 500:
                        raise ServerFailed(str(e)) from e
                    out["fallback_to_text"] = str(e)[:300]
                    print(f"e2e: {s.name}: id prompt refused ({str(e)[:120]}); text prompts for this row",
                          file=sys.stderr, flush=True)
                    text = True
                    return fn(c, prompts.text(n), a.n_predict, self.request_timeout(), ban)

            if a.warmups:  # --warmups 0: a 128k row is minutes per request
                out["warmup"] = ask(0, complete)
            reps: list[dict[str, Any]] = []
            out["repeats"] = reps
            try:
                for i in range(a.repeats):
                    reps.append(ask(1 + i, complete))
                if self.streamed(n):
                    out["stream"] = ask(1 + a.repeats, stream)
            except BudgetExhausted as e:
                out["cut"] = str(e)
                if not reps:
                    raise
            out["prompt_kind"] = "text" if text else "ids"
        return out

    def clients(self, s: Server, prompts: Prompts, k: int, text: bool) -> dict[str, Any]:
        """K concurrent non-streamed requests per round: one warm-up round, then repeats."""
        a = self.args
        n = a.client_prompt
        rounds: list[dict[str, Any]] = []
        errors: list[str] = []
        out_fallback = ""
        out: dict[str, Any] = {"clients": k, "prompt_tokens_asked": n}
        ban = self.ban(s.name, prompts, out)

        def one(i: int, r: int, results: list[Any]) -> None:
            try:
                with httpx.Client(base_url=s.url) as c:
                    p: list[int] | str = prompts.text(n) if text else prompts.ids(n, 1000 * r + i)
                    results[i] = complete(c, p, a.n_predict, self.request_timeout(), ban)
            except Exception as e:  # reported in the record; the round is not counted
                errors.append(f"client {i}: {e}"[:300])

        r = 0  # round 0 is the warm-up
        while r <= a.repeats and self.left() > 0:
            results: list[Any] = [None] * k
            threads = [threading.Thread(target=one, args=(i, r, results), daemon=True) for i in range(k)]
            t0 = common.now()
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            wall = common.now() - t0
            if errors and r == 0 and not text and any("HTTP 5" in e for e in errors):
                out_fallback = errors[0]  # as in the rows: a 5xx on id prompts -> text prompts
                errors.clear()
                text = True
                continue  # the warm-up again, with text
            if errors:
                break
            if r > 0:
                rounds.append({"wall_s": wall, "requests": results,
                               "aggregate_tps": sum(x["predicted_n"] for x in results) / wall})
            r += 1
        out.update(rounds=rounds, prompt_kind="text" if text else "ids")
        if out_fallback:
            out["fallback_to_text"] = out_fallback
        if errors:
            out["errors"] = errors
        if rounds:
            out["aggregate_tps"] = common.stats([x["aggregate_tps"] for x in rounds])
            out["decode_tps_per_client"] = common.stats(
                [q["predicted_per_second"] for x in rounds for q in x["requests"]])
            out["wall_s"] = common.stats([x["wall_s"] for x in rounds])
        return out

    # one server on one model

    def measure(self, server: str, job: dict[str, Any], result: dict[str, Any]) -> None:
        """All rows (and the clients round) of one server on one model, into ``result``
        (already part of the record, so that whatever is measured survives a failure
        or an interruption); a failing server ends its rows, with the reason listed."""
        a = self.args
        label, model, lengths = job["label"], job["path"], job["prompts"]
        prompts: Prompts = job["prompt_maker"]
        text = a.text_prompts
        prev: list[dict[str, Any]] = []
        srv: Server | None = None
        per_row_start = a.ctx == "row"

        def stop() -> None:
            nonlocal srv
            if srv is not None:
                result["starts"][-1]["exit"] = srv.stop()
                srv = None

        if a.mem_only:
            self.memory_only(server, job, result)
            return
        try:
            for n in lengths:
                est = self.estimate(prev, n)
                room = self.left() - a.reserve_s * self.starts_left
                if (est or 0.0) > room or room <= 0:
                    why = f"estimated {est:.0f} s" if est is not None else "a first row"
                    self.skip(label, server, f"prompt {n}", f"{why}, {room:.0f} s left in the budget "
                                                            f"beyond {a.reserve_s:.0f} s per server start to come")
                    if per_row_start:
                        self.starts_left = max(0, self.starts_left - 1)
                    continue
                if srv is None or per_row_start:
                    stop()
                    ctx = (max(lengths) if a.ctx == "max" else n) + a.n_predict + a.ctx_margin
                    srv, info = self.start(server, label, model, ctx, 1)
                    result["starts"].append(info)
                t_row = common.now()
                try:
                    r = self.row(srv, prompts, n, text)
                except BudgetExhausted as e:
                    self.skip(label, server, f"prompt {n}", f"cut by the budget ({e})")
                    break
                text = text or r["prompt_kind"] == "text"  # once refused, the rest of the rows too
                summary = summarize(r)
                result["rows"][str(n)] = {**r, **summary, "estimated_s": est, "took_s": common.now() - t_row,
                                          "device_mib": device_mib(srv.proc.pid)}
                pp, tg = summary["prefill_tps"].median, summary["decode_tps"].median
                overhead = max(0.0, summary["wall_s"].median - summary["prompt_ms"].median / 1e3
                               - summary["predicted_ms"].median / 1e3)
                prev.append({"n": n, "pp": pp, "tg": tg, "overhead_s": overhead})
                print(f"e2e: {server} {label} prompt {n}: prefill {pp:,.0f} tok/s, decode {tg:,.1f} tok/s"
                      + (f", ttft {1e3 * r['stream']['ttft_s']:,.0f} ms" if "stream" in r else ""),
                      file=sys.stderr, flush=True)
        except (ServerFailed, httpx.HTTPError) as e:
            result["error"] = f"{type(e).__name__}: {e}"[:2000]
            self.skip(label, server, "the rest", result["error"])
            if not per_row_start and srv is None:  # it never started: no clients round either
                return
        finally:
            stop()
        k = job["clients"]
        if not k:
            return
        if self.left() - a.reserve_s * self.starts_left < 0:
            self.skip(label, server, f"{k} clients", "no time left in the budget")
            self.starts_left = max(0, self.starts_left - 1)
            return
        ctx = k * (a.client_prompt + a.n_predict + a.ctx_margin)
        try:
            srv, info = self.start(server, label, model, ctx, k)
        except ServerFailed as e:
            self.skip(label, server, f"{k} clients", str(e)[:2000])
            return
        result["starts"].append(info)
        try:
            result["clients"] = c = self.clients(srv, prompts, k, text)
        finally:
            stop()
        if "aggregate_tps" in c:
            print(f"e2e: {server} {label} {k} clients: aggregate {c['aggregate_tps'].median:,.0f} tok/s",
                  file=sys.stderr, flush=True)

    def memory_only(self, server: str, job: dict[str, Any], result: dict[str, Any]) -> None:
        """``--mem-only``: the server started at the context of the longest prompt, one
        short request (``--mem-prompt`` tokens, 16 generated), then the device memory the
        process holds (issue 13 item 5: trio-llm at -c 131072 with a q8_0 cache beside
        llama-server with the same flags); no speed rows."""
        a = self.args
        label, model, lengths = job["label"], job["path"], job["prompts"]
        ctx = max(lengths) + a.n_predict + a.ctx_margin
        try:
            srv, info = self.start(server, label, model, ctx, 1)
        except ServerFailed as e:
            self.skip(label, server, f"memory at {ctx}", str(e)[:2000])
            return
        result["starts"].append(info)
        try:
            prompts: Prompts = job["prompt_maker"]
            ban = self.ban(server, prompts, result)
            with httpx.Client(base_url=srv.url) as c:
                p: list[int] | str = prompts.text(a.mem_prompt) if a.text_prompts else prompts.ids(a.mem_prompt, 0)
                try:
                    r = complete(c, p, 16, self.request_timeout(), ban)
                except httpx.HTTPStatusError as e:  # the Vulkan llama-server's invalid-UTF-8 500
                    if e.response.status_code < 500:
                        raise
                    r = complete(c, prompts.text(a.mem_prompt), 16, self.request_timeout(), ban)
            mib = device_mib(srv.proc.pid)
            result["memory"] = {"ctx": ctx, "device_mib": mib, "ready_device_mib": info.get("device_mib_ready"),
                                "answer": r}
            print(f"e2e: {server} {label} -c {ctx}: {mib if mib is not None else '?'} MiB of device memory",
                  file=sys.stderr, flush=True)
        except (ServerFailed, httpx.HTTPError) as e:
            result["error"] = f"{type(e).__name__}: {e}"[:2000]
            self.skip(label, server, f"memory at {ctx}", result["error"])
        finally:
            result["starts"][-1]["exit"] = srv.stop()

    def wait_for(self, server: str, path: Path, limit: float = float("inf")) -> bool:
        """Wait (within the budget, at most ``limit`` s) for a file to appear: the CUDA
        build's done-marker, or a model still being made (written whole, then renamed)."""
        if path.exists():
            return True
        print(f"e2e: waiting for {path} before {server} ...", file=sys.stderr, flush=True)
        t0 = common.now()
        while not path.exists():
            if self.left() <= self.args.reserve_s or common.now() - t0 > limit:
                return False
            time.sleep(1)
        self.figures.setdefault("waited_s", {})[f"{server}:{path.name}"] = common.now() - t0
        return True


def summarize(r: dict[str, Any]) -> dict[str, Any]:
    reps = r["repeats"]
    out = {
        "prefill_tps": common.stats([x["prompt_per_second"] for x in reps]),
        "decode_tps": common.stats([x["predicted_per_second"] for x in reps]),
        "prompt_n": common.stats([x["prompt_n"] for x in reps]),
        "predicted_n": common.stats([x["predicted_n"] for x in reps]),
        "prompt_ms": common.stats([x["prompt_ms"] for x in reps]),
        "predicted_ms": common.stats([x["predicted_ms"] for x in reps]),
        "wall_s": common.stats([x["wall_s"] for x in reps]),
    }
    if "stream" in r:
        out["ttft_s"] = common.stats([r["stream"]["ttft_s"]])
        out["stream_wall_s"] = common.stats([r["stream"]["wall_s"]])
    return out


def ratios(per_server: dict[str, Any]) -> dict[str, Any]:
    """trio-llm's median ÷ each llama.cpp's median, per row and figure."""
    out: dict[str, Any] = {}
    trio = per_server.get("trio")
    if not trio:
        return out
    for other in ("cuda", "vulkan"):
        o = per_server.get(other)
        if not o:
            continue
        rows: dict[str, Any] = {}
        for n, row in trio["rows"].items():
            orow = o["rows"].get(n)
            if orow:
                rows[n] = {f: row[f].median / orow[f].median
                           for f in ("prefill_tps", "decode_tps") if orow[f].median}
        tc, oc = trio.get("clients", {}), o.get("clients", {})
        if "aggregate_tps" in tc and "aggregate_tps" in oc:
            rows[f"clients{tc['clients']}"] = {"aggregate_tps": tc["aggregate_tps"].median / oc["aggregate_tps"].median}
        out[f"trio/{other}"] = rows
    return out


def table(figures: dict[str, Any], servers: list[str]) -> tuple[list[dict[str, Any]], list[str]]:
    """Rows per model and prompt length (and one per clients round: aggregate tok/s in
    the tg columns); columns: each server's pp/tg/ttft, then trio-llm's ratios."""
    others = [o for o in ("cuda", "vulkan") if o in servers and "trio" in servers]
    cols = ["model", "prompt"] + [f"{s} {f}" for s in servers for f in ("pp", "tg", "ttft ms")]
    cols += [f"{f}/{o}" for o in others for f in ("pp", "tg")]
    rows: list[dict[str, Any]] = []
    for label, per in figures["models"].items():
        lengths = sorted({int(n) for s in per.values() for n in s["rows"]})
        rat = ratios(per)
        for n in lengths:
            row: dict[str, Any] = dict.fromkeys(cols, "") | {"model": label, "prompt": n}
            for s in servers:
                r = per.get(s, {}).get("rows", {}).get(str(n))
                if r:
                    row[f"{s} pp"], row[f"{s} tg"] = r["prefill_tps"], r["decode_tps"]
                    if "ttft_s" in r:
                        row[f"{s} ttft ms"] = 1e3 * r["ttft_s"].median
            for o in others:
                q = rat.get(f"trio/{o}", {}).get(str(n), {})
                row[f"pp/{o}"], row[f"tg/{o}"] = q.get("prefill_tps", ""), q.get("decode_tps", "")
            rows.append(row)
        ks = {s: per[s]["clients"] for s in servers if "aggregate_tps" in per.get(s, {}).get("clients", {})}
        if ks:
            k = next(iter(ks.values()))["clients"]
            row = dict.fromkeys(cols, "") | {"model": label, "prompt": f"{k} clients"}
            for s in ks:
                row[f"{s} tg"] = ks[s]["aggregate_tps"]
            for o in others:
                row[f"tg/{o}"] = rat.get(f"trio/{o}", {}).get(f"clients{k}", {}).get("aggregate_tps", "")
            rows.append(row)
    return rows, cols


def gpu_info() -> str | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def device_mib(pid: int) -> float | None:
    """Device memory the process ``pid`` holds, in MiB, from ``nvidia-smi
    --query-compute-apps`` (Vulkan and CUDA processes alike); None without nvidia-smi
    (lavapipe) or when the process holds none."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=20, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    for line in out.stdout.splitlines():
        parts = [x.strip() for x in line.split(",")]
        if len(parts) == 2 and parts[0] == str(pid):
            try:
                return float(parts[1])
            except ValueError:
                return None
    return None


def lengths_arg(s: str) -> list[int]:
    try:
        v = [int(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma-separated list of token counts: {s!r}") from None
    if not v or min(v) < 2:
        raise argparse.ArgumentTypeError(f"prompt lengths must be >= 2: {s!r}")
    return v


def main() -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("-m", "--model", action="append", required=True, type=Path,
                    help="GGUF file (repeat for several models; --prompts/--clients pair with them in order)")
    ap.add_argument("--prompts", action="append", type=lengths_arg,
                    help="prompt lengths in tokens (default 512,8192,32768,131072); one list for all models, "
                         "or one per --model")
    ap.add_argument("--clients", action="append", type=int,
                    help="K concurrent clients x n_predict tokens with -np K (0: none); one, or one per --model")
    ap.add_argument("--client-prompt", type=int, default=128, help="prompt tokens of each concurrent client")
    ap.add_argument("--llama-cuda", type=Path, help="llama-server built with CUDA")
    ap.add_argument("--llama-vulkan", type=Path, help="llama-server with the Vulkan backend")
    ap.add_argument("--wait-for", type=Path, help="before llama-server CUDA, wait (within the budget) for this file "
                                                   "to exist: the background build's done-marker")
    ap.add_argument("--wait-model-s", type=float, default=0,
                    help="how long to wait for a --model file that does not exist yet (being made elsewhere); "
                         "0: a missing file is an error")
    ap.add_argument("--no-trio", action="store_true", help="only the llama-servers")
    ap.add_argument("--backend", default="vulkan", help="trio-llm serve --backend (default vulkan)")
    ap.add_argument("--trio-arg", action="append", default=[], help="an extra flag for trio-llm serve (repeatable)")
    ap.add_argument("--llama-arg", action="append", default=[], help="an extra flag for llama-server (repeatable)")
    ap.add_argument("--mem-only", action="store_true",
                    help="no speed rows: each server at the longest prompt's context, one short request, then the "
                         "device memory it holds (nvidia-smi)")
    ap.add_argument("--mem-prompt", type=int, default=512, help="with --mem-only: the request's prompt tokens")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--warmups", type=int, choices=(0, 1), default=1,
                    help="a warm-up request per row before the repeats (0: none, for rows of minutes)")
    ap.add_argument("--ttft-max", type=int, default=0,
                    help="the streamed request (time to first token) only for prompts up to this length (0: all); "
                         "for long prompts it is about prompt_ms and costs a whole request more")
    ap.add_argument("--n-predict", type=int, default=128)
    ap.add_argument("--ban-partial-utf8", type=lambda v: [x for x in v.split(",") if x], default=["vulkan"],
                    metavar="SERVERS",
                    help="comma list of servers (trio, vulkan, cuda) whose requests ban, through logit_bias, the "
                         "tokens that are not whole UTF-8 alone (default vulkan: the prebuilt Vulkan llama-server "
                         "answers HTTP 500 to a random-weight model's invalid UTF-8; '' for none)")
    ap.add_argument("--text-prompts", action="store_true", help='prompts of plain text ("hello " * n) for every server')
    ap.add_argument("--text-word", default="hello",
                    help="the word of text prompts, repeated with spaces (default hello; a random-weight model "
                         "must answer it with valid UTF-8, or the prebuilt Vulkan llama-server answers 500)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ctx", choices=("max", "row"), default="max",
                    help="one server per model with -c for the longest prompt, or one per row")
    ap.add_argument("--ctx-margin", type=int, default=64)
    ap.add_argument("--budget-s", type=float, default=0, help="bound on the whole run (0: none); rows that would "
                                                              "not fit are skipped and listed in the record")
    ap.add_argument("--reserve-s", type=float, default=20, help="time kept back per server start still to come")
    ap.add_argument("--start-timeout", type=float, default=300)
    ap.add_argument("--request-timeout", type=float, default=1800)
    ap.add_argument("--log-dir", type=Path, help="server logs (default: a new temporary folder)")
    ap.add_argument("--note", default="", help="free text kept in the record (e.g. what ran beside)")
    args = ap.parse_args()

    def per_model(values: list[Any] | None, default: Any, what: str) -> list[Any]:
        if not values:
            return [default] * len(args.model)
        if len(values) == 1:
            return values * len(args.model)
        if len(values) != len(args.model):
            ap.error(f"give one {what} or one per --model ({len(args.model)})")
        return values

    if args.repeats < 1 or args.n_predict < 1:
        ap.error("--repeats and --n-predict must be >= 1")
    prompt_lists = per_model(args.prompts, [512, 8192, 32768, 131072], "--prompts")
    client_counts = per_model(args.clients, 0, "--clients")
    if not args.wait_model_s:
        for m in args.model:
            if not m.is_file():
                ap.error(f"{m}: no such file")
    for p in (args.llama_cuda, args.llama_vulkan):
        if p is not None and args.wait_for is None and not p.exists():
            ap.error(f"{p}: no such file")
    servers = ([] if args.no_trio else ["trio"]) + [s for s, p in (("vulkan", args.llama_vulkan),
                                                                   ("cuda", args.llama_cuda)) if p is not None]
    if not servers:
        ap.error("nothing to measure")

    run = Run(args)
    jobs: list[dict[str, Any]] = []
    for path, lengths, k in zip(args.model, prompt_lists, client_counts, strict=True):
        jobs.append({"label": path.name.removesuffix(".gguf"), "path": path, "prompts": lengths, "clients": k})
    run.starts_left = sum(len(servers) * ((len(j["prompts"]) if args.ctx == "row" else 1) + bool(j["clients"]))
                          for j in jobs)
    figures: dict[str, Any] = {"models": {j["label"]: {} for j in jobs}}
    run.figures = figures

    def on_term(signum: int, frame: Any) -> None:
        raise Terminated()

    signal.signal(signal.SIGTERM, on_term)
    interrupted = None
    try:
        for server in servers:
            if server == "cuda" and args.wait_for is not None and not run.wait_for(server, args.wait_for):
                for j in jobs:
                    run.skip(j["label"], server, "all", f"{args.wait_for} did not appear within the budget")
                continue
            binary = {"cuda": args.llama_cuda, "vulkan": args.llama_vulkan}.get(server)
            if binary is not None and not binary.exists():
                for j in jobs:
                    run.skip(j["label"], server, "all", f"{binary} does not exist (build failed?)")
                continue
            for j in jobs:
                if not j["path"].exists() and not run.wait_for(server, j["path"], args.wait_model_s):
                    run.skip(j["label"], server, "all", f"{j['path']} did not appear in time")
                    continue
                if "prompt_maker" not in j:
                    j["prompt_maker"] = Prompts(j["path"], args.seed, args.text_word)
                result: dict[str, Any] = {"rows": {}, "starts": []}
                figures["models"][j["label"]][server] = result
                run.measure(server, j, result)
    except (Terminated, KeyboardInterrupt) as e:
        interrupted = type(e).__name__
        print(f"e2e: interrupted ({interrupted}); writing what was measured", file=sys.stderr, flush=True)
    figures["ratios"] = {label: ratios(per) for label, per in figures["models"].items()}
    figures["skipped"] = run.skipped
    figures["servers_started"] = run.servers_run
    figures["elapsed_s"] = common.now() - run.t0
    if interrupted:
        figures["interrupted"] = interrupted
    params = {**vars(args), "servers": servers, "jobs": [{k: v for k, v in j.items() if k != "prompt_maker"}
                                                         for j in jobs],
              "gpu": gpu_info(), "log_dir": str(run.log_dir)}
    print(f"n_predict {args.n_predict}, median of {args.repeats} ({'one warm-up' if args.warmups else 'no warm-up'}), "
          f"cache_prompt off, -np 1; "
          f"pp/tg = prefill/decode tok/s from timings; ttft = first SSE event of one streamed request; "
          f"ratios are trio-llm / llama.cpp")
    rows, cols = table(figures, servers)
    if args.mem_only:
        rows = [{"model": label, **{f"{s} MiB": (per.get(s, {}).get("memory") or {}).get("device_mib") or ""
                                    for s in servers},
                 "ctx": next((m["ctx"] for m in (per.get(s, {}).get("memory") for s in servers) if m), "")}
                for label, per in figures["models"].items()]
        cols = ["model", "ctx", *[f"{s} MiB" for s in servers]]
        print("device memory held after one short request (nvidia-smi per process)")
    common.print_table(rows, cols)
    for s in run.skipped:
        print(f"skipped: {s['server']} {s['model']} {s['what']}: {s['reason']}")
    out = common.write_result("e2e", params, figures)
    print(f"wrote {out}")
    measured = any(per.get(s, {}).get("rows") or per.get(s, {}).get("memory")
                   for per in figures["models"].values() for s in servers)
    return 1 if interrupted or not measured else 0


if __name__ == "__main__":
    sys.exit(main())

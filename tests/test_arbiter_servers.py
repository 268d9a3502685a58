"""Real ``trio-llm serve`` processes (numpy backend, tiny model) sharing one arena:
alternating requests, three servers, SIGKILL of a waiter and of a holder, SIGTERM of
cold servers at every level, and the reference fork's stand-in on the same arena."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from serve_procs import wait_ready

pytestmark = pytest.mark.slow

SERVE = [sys.executable, "-m", "trio_llm", "serve", "--backend", "numpy", "--port", "0"]
STANDIN = [sys.executable, str(Path(__file__).with_name("standin.py"))]


class Server:
    def __init__(self, proc: trio.Process, url: str, log: list[str]) -> None:
        self.proc, self.url, self.log = proc, url, log
        self.http = httpx.AsyncClient(base_url=url, timeout=120)

    async def residency(self) -> dict[str, Any]:
        r = await self.http.get("/props")
        return r.json()["residency"]  # type: ignore[no-any-return]

    async def complete(self, prompt: str, n: int = 4, **extra: Any) -> dict[str, Any]:
        r = await self.http.post("/completion", json={"prompt": prompt, "n_predict": n, **extra})
        assert r.status_code == 200, r.text
        return r.json()  # type: ignore[no-any-return]

    async def until(self, pred: Any, what: str) -> dict[str, Any]:
        """Poll /props (read-only: never wakes the model) until ``pred`` holds."""
        with trio.fail_after(30):
            while True:
                res = await self.residency()
                if pred(res):
                    return res
                await trio.sleep(0.05)

    async def stop(self, sig: int = signal.SIGTERM) -> tuple[int, str]:
        await self.http.aclose()
        self.proc.send_signal(sig)
        assert self.proc.stderr is not None
        out = b""
        with trio.fail_after(30):
            while chunk := await self.proc.stderr.receive_some():
                out += chunk
            code = await self.proc.wait()
        return code, out.decode()


async def start(model: Path, arena: Path, *extra: str) -> Server:
    proc = await trio.lowlevel.open_process(
        [*SERVE, "-m", str(model), "--vram-arena", str(arena), *extra], stderr=subprocess.PIPE
    )
    url, log = await wait_ready(proc, 90)
    return Server(proc, url, log)


def cold(res: dict[str, Any]) -> bool:
    return res["state"] in ("cold", "unloaded") and not res["token_held"]


async def test_two_servers_alternate_and_keep_their_prompt_cache(
    tiny_model: Path, tmp_path: Path
) -> None:
    a = await start(tiny_model, tmp_path)
    b = await start(tiny_model, tmp_path)  # waits for the token, A yields (idle)
    res_a = await a.until(cold, "A yields to B's load")
    assert res_a["cycles"]["yields"] == 1
    assert (await b.residency())["token_held"]
    prompt = "The quick brown fox jumps over"
    cached = []
    for _ in range(3):
        for s in (a, b):
            out = await s.complete(prompt)
            cached.append(out["timings"]["cache_n"])
    # the first request of each server evaluates the prompt, every later one reuses it
    # across a release/restore cycle (level weights keeps the KV cache)
    assert cached[:2] == [0, 0] and min(cached[2:]) > 0
    res_a, res_b = await a.residency(), await b.residency()
    assert res_a["cycles"]["wakes"] == 3 and res_b["cycles"]["wakes"] == 3
    assert res_a["token_held"] != res_b["token_held"]  # never both resident
    holder, idle = (a, b) if res_a["token_held"] else (b, a)
    code, log = await idle.stop()  # SIGTERM of the cold one
    assert code == 0 and "Traceback" not in log
    code, log = await holder.stop()
    assert code == 0 and "Traceback" not in log


async def test_three_servers_every_level_and_cold_sigterm(
    tiny_model: Path, tmp_path: Path
) -> None:
    servers = []
    for level in ("weights", "all", "unload"):
        servers.append(await start(tiny_model, tmp_path, "--sleep-mode", level))
    for _ in range(2):
        for s in servers:
            # ignore_eos: the default seed is random, and an early end-of-generation
            # token (about one run in ten on the tiny model) would stop short of 3
            out = await s.complete("Hello there, my friend", n=3, ignore_eos=True)
            assert out["tokens_predicted"] == 3
            res = await s.residency()
            assert res["state"] == "resident" and res["token_held"]
    for s, state in zip(servers[:2], ("cold", "cold"), strict=True):
        res = await s.until(cold, "yielded")
        assert res["state"] == state
    res_all = await servers[1].residency()
    assert res_all["device_bytes_total"] == 0  # level all: nothing left on the device
    # the unload server holds the token now; make it cold too, then stop everyone
    await servers[0].complete("again", n=1)
    res_unload = await servers[2].until(cold, "yielded")
    assert res_unload["state"] == "unloaded"
    for s in servers:
        code, log = await s.stop()
        assert code == 0 and "Traceback" not in log, log


async def _doomed(server: Server, body: dict[str, Any]) -> None:
    """A request whose server (or whose client side) is about to go away."""
    try:
        await server.http.post("/completion", json=body)
    except httpx.HTTPError:
        pass


async def _processing(server: Server) -> None:
    with trio.fail_after(30):
        while not any(s["is_processing"] for s in (await server.http.get("/slots")).json()):
            await trio.sleep(0.02)


async def test_sigkill_of_a_waiter_and_of_a_holder(tiny_model: Path, tmp_path: Path) -> None:
    a = await start(tiny_model, tmp_path)
    long = {"prompt": "Tell me a long story", "n_predict": 2000, "ignore_eos": True}

    # A is busy; a stand-in registers on want.lock and waits; it is SIGKILLed, and
    # A, once idle, sees nobody waiting (the kernel dropped the dead waiter's lock)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_doomed, a, long)
        await _processing(a)
        standin = subprocess.Popen(
            [*STANDIN, "--arena", str(tmp_path), "--hold", "0"], stdout=subprocess.PIPE, text=True
        )
        assert standin.stdout is not None
        assert (await trio.to_thread.run_sync(standin.stdout.readline)).strip() == "waiting"
        standin.send_signal(signal.SIGKILL)
        await trio.to_thread.run_sync(standin.wait)
        nursery.cancel_scope.cancel()  # client gone: the generation stops, A goes idle
    await a.until(lambda r: r["arbiter"]["probes"] > 0, "A probes")
    await trio.sleep(0.5)  # idle well past the grace, probing every 10 ms
    res = await a.residency()
    assert res["state"] == "resident" and res["cycles"]["yields"] == 0

    # A holds while decoding a long answer, B waits, A is SIGKILLed: B gets the GPU
    b = await start(tiny_model, tmp_path, "--no-warmup")  # A (idle) yields to B's load
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_doomed, a, long)  # A wakes: B (idle) yields to it
        await a.until(lambda r: r["token_held"], "A holds")
        nursery.start_soon(b.complete, "Now me", 2)
        await b.until(lambda r: r["arbiter"]["waiting"], "B waits")
        assert (await b.residency())["state"] == "cold"
        a.proc.send_signal(signal.SIGKILL)
    res = await b.residency()  # B's request was answered, so B got the token
    assert res["state"] == "resident" and res["token_held"]
    await a.http.aclose()
    await a.proc.wait()
    code, log = await b.stop()
    assert code == 0 and "Traceback" not in log


async def test_interoperates_with_the_reference_stand_in(tiny_model: Path, tmp_path: Path) -> None:
    a = await start(tiny_model, tmp_path)
    # the stand-in takes the token the reference fork's way: A (idle) yields to it
    standin = subprocess.Popen(
        [*STANDIN, "--arena", str(tmp_path), "--hold", "60", "--until-stdin"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )
    assert standin.stdin is not None and standin.stdout is not None
    read = standin.stdout.readline
    assert (await trio.to_thread.run_sync(read)).strip() == "waiting"
    assert (await trio.to_thread.run_sync(read)).strip() == "token"
    await a.until(cold, "A yielded to the stand-in")
    # a request to A waits while the stand-in holds, and is served once it lets go
    async with trio.open_nursery() as nursery:
        nursery.start_soon(a.complete, "hi", 1)
        await a.until(lambda r: r["arbiter"]["waiting"], "A waits")
        standin.stdin.write("release\n")
        standin.stdin.flush()
    assert (await trio.to_thread.run_sync(read)).strip() == "released"
    assert await trio.to_thread.run_sync(standin.wait) == 0
    # the stand-in (plain blocking flock) now waits while A holds, and gets it when A yields
    standin = subprocess.Popen(
        [*STANDIN, "--arena", str(tmp_path), "--hold", "0"], stdout=subprocess.PIPE, text=True
    )
    assert standin.stdout is not None
    assert (await trio.to_thread.run_sync(standin.stdout.readline)).strip() == "waiting"
    assert (await trio.to_thread.run_sync(standin.stdout.readline)).strip() == "token"
    assert await trio.to_thread.run_sync(standin.wait) == 0
    res = await a.until(cold, "A yielded again")
    assert res["cycles"]["yields"] == 2
    code, log = await a.stop()
    assert code == 0 and "Traceback" not in log


async def test_sigterm_while_waiting_for_the_token_at_load_exits_0(
    tiny_model: Path, tmp_path: Path
) -> None:
    """Coordinated load: a server whose arena token is held elsewhere does not load
    (``/health`` says loading), and a SIGTERM meanwhile is an ordinary clean stop."""
    standin = subprocess.Popen(
        [*STANDIN, "--arena", str(tmp_path), "--hold", "120", "--until-stdin"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )
    assert standin.stdin is not None and standin.stdout is not None
    assert (await trio.to_thread.run_sync(standin.stdout.readline)).strip() == "waiting"
    assert (await trio.to_thread.run_sync(standin.stdout.readline)).strip() == "token"
    proc = await trio.lowlevel.open_process(
        [*SERVE, "-m", str(tiny_model), "--vram-arena", str(tmp_path)], stderr=subprocess.PIPE
    )
    assert proc.stderr is not None
    buf = b""
    with trio.fail_after(60):
        while b"waiting for the GPU token" not in buf:
            chunk = await proc.stderr.receive_some()
            assert chunk, buf.decode()
            buf += chunk
    url = re.search(r"listening on (http://\S+)", buf.decode())
    assert url is not None
    async with httpx.AsyncClient(base_url=url.group(1), timeout=30) as http:
        assert (await http.get("/health")).status_code == 503
    proc.send_signal(signal.SIGTERM)
    with trio.fail_after(30):
        while chunk := await proc.stderr.receive_some():
            buf += chunk
        assert await proc.wait() == 0
    assert b"Traceback" not in buf and b"loading model" not in buf
    standin.stdin.close()
    assert await trio.to_thread.run_sync(standin.wait) == 0


@pytest.mark.vulkan
async def test_two_vulkan_servers_hand_off_device_memory(tiny_model: Path, tmp_path: Path) -> None:
    """The same hand-off on the Vulkan backend (lavapipe in CI): a cold server at level
    all holds no device memory, one at level weights keeps its KV cache, and the
    prompt cache survives the round trip through the host."""
    a = await start(tiny_model, tmp_path, "--backend", "vulkan", "--sleep-mode", "all")
    b = await start(tiny_model, tmp_path, "--backend", "vulkan", "--sleep-mode", "weights")
    res_a = await a.until(cold, "A yields to B's load")
    assert res_a["device_bytes_total"] == 0
    prompt = "The quick brown fox jumps over"
    outs = []
    for s in (a, b, a, b):
        outs.append(await s.complete(prompt, n=2, temperature=0))
    assert [o["timings"]["cache_n"] > 0 for o in outs] == [False, False, True, True]
    # greedy: the same answer from the restored KV cache as from the fresh prefill
    assert outs[0]["content"] == outs[2]["content"] and outs[1]["content"] == outs[3]["content"]
    res_a = await a.until(cold, "A yields to B's request")
    assert res_a["device_bytes_total"] == 0
    res_b = (await b.residency())
    assert res_b["state"] == "resident"
    await a.complete(prompt, n=1)
    res_b = await b.until(cold, "B yields")
    assert res_b["device_bytes"]["weights"] == 0 and res_b["device_bytes"]["kv_cache"] > 0
    for s in (a, b):
        code, log = await s.stop()
        assert code == 0 and "Traceback" not in log, log

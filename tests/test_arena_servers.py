"""The quantum across real processes (issue 16): real ``trio-llm serve`` processes
(numpy backend, tiny model) and the reference fork's stand-in on one arena, real
flock. A steady stream on one server against a waiter: the waiter is served within
the quantum bound while the stream is still running, and the paused stream resumes
with exactly the tokens of an uninterrupted run. SIGKILL of a paused holder and of
a waiter: nothing stranded, the token free afterwards."""

from __future__ import annotations

import json
import signal
import subprocess
from pathlib import Path

import pytest
import trio

from test_arbiter_servers import STANDIN, Server, start

pytestmark = pytest.mark.slow

QUANTUM = 0.5
#: the waiter's bound: the quantum, one forward pass, one hand-off (release, the
#: waiter's poll, a restore) and the scheduling noise of a shared 2-core machine
BOUND = QUANTUM + 2.5
LONG = {"temperature": 0, "ignore_eos": True, "stream": True}


async def stream_tokens(server: Server, prompt: str, n: int, times: list[float]) -> list[int]:
    """A greedy streamed completion of exactly ``n`` tokens; ``times`` gets the
    arrival time of each token."""
    tokens: list[int] = []
    body = {"prompt": prompt, "n_predict": n, "return_tokens": True, **LONG}
    async with server.http.stream("POST", "/completion", json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            msg = json.loads(line[6:])
            if not msg.get("stop"):
                tokens.extend(msg["tokens"])
                times.append(trio.current_time())
    return tokens


async def reference(server: Server, prompt: str, n: int) -> list[int]:
    body = {"prompt": prompt, "n_predict": n, "return_tokens": True, **LONG, "stream": False}
    r = await server.http.post("/completion", json=body)
    assert r.status_code == 200, r.text
    return list(r.json()["tokens"])


async def test_a_steady_stream_yields_to_a_waiter_within_the_quantum(
    tiny_model: Path, tmp_path: Path
) -> None:
    quantum = ("--arena-quantum", str(QUANTUM), "--sleep-mode", "all", "--metrics")
    a = await start(tiny_model, tmp_path, *quantum)
    b = await start(tiny_model, tmp_path, *quantum)  # b holds after start-up
    try:
        prompt, n = "Once upon a time", 1500
        times: list[float] = []
        got: list[int] = []
        waits: list[float] = []

        async def long_stream() -> None:
            got.extend(await stream_tokens(a, prompt, n, times))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(long_stream)
            with trio.fail_after(60):
                while len(times) < 5:
                    await trio.sleep(0.01)
            await trio.sleep(QUANTUM)  # a has held the GPU for its quantum
            for i in range(3):  # three waits, each against the stream
                sent = trio.current_time()
                await b.complete(f"Question {i}?")
                waits.append(trio.current_time() - sent)
                assert len(times) < n, "the stream ended before the waiter was served"
                await trio.sleep(QUANTUM)  # back to a; it holds again
        print("waits behind the stream:", [round(w, 3) for w in waits])
        assert max(waits) <= BOUND, waits
        assert got == await reference(a, prompt, n)  # paused, resumed unchanged
        res_a, res_b = await a.residency(), await b.residency()
        assert res_a["cycles"]["quantum_yields"] >= 3, res_a["cycles"]
        assert res_a["arbiter"]["quantum"] == QUANTUM
        assert res_b["cycles"]["yields"] >= 3  # b gave it back to the paused stream
        metrics = (await a.http.get("/metrics")).text
        assert 'trio_llm_arena_yields_total{reason="quantum"}' in metrics
    finally:
        for s in (a, b):
            code, err = await s.stop()
            assert code == 0, err


async def test_quantum_0_keeps_todays_rule(tiny_model: Path, tmp_path: Path) -> None:
    """``--arena-quantum 0``: the waiter is served only once the stream is over."""
    a = await start(tiny_model, tmp_path, "--arena-quantum", "0")
    b = await start(tiny_model, tmp_path, "--arena-quantum", "0")
    try:
        times: list[float] = []
        async with trio.open_nursery() as nursery:
            nursery.start_soon(stream_tokens, a, "Once upon a time", 150, times)
            with trio.fail_after(60):
                while not times:
                    await trio.sleep(0.01)
            await b.complete("Question?")
            answered = trio.current_time()
        assert len(times) == 150 and answered >= times[-1]
        assert (await a.residency())["cycles"]["quantum_yields"] == 0
    finally:
        for s in (a, b):
            await s.stop()


async def test_the_stand_in_waiter_is_served_within_the_quantum(
    tiny_model: Path, tmp_path: Path
) -> None:
    """The reference fork's side, blocking flock and no idea of a quantum, waiting
    against a streaming trio-llm server: it gets the token mid-stream, and the
    stream resumes unchanged after it lets go."""
    a = await start(tiny_model, tmp_path, "--arena-quantum", str(QUANTUM))
    standin = None
    try:
        prompt, n = "Once upon a time", 1500
        times: list[float] = []
        got: list[int] = []

        async def long_stream() -> None:
            got.extend(await stream_tokens(a, prompt, n, times))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(long_stream)
            with trio.fail_after(60):
                while len(times) < 5:
                    await trio.sleep(0.01)
            await trio.sleep(QUANTUM)
            sent = trio.current_time()
            standin = await trio.lowlevel.open_process(
                [*STANDIN, "--arena", str(tmp_path), "--hold", "0.3"], stdout=subprocess.PIPE
            )
            assert standin.stdout is not None
            out = b""
            with trio.fail_after(30):
                while b"token" not in out:
                    out += await standin.stdout.receive_some()
            waited = trio.current_time() - sent
            assert len(times) < n
            with trio.fail_after(30):
                assert await standin.wait() == 0
        assert waited <= BOUND
        assert got == await reference(a, prompt, n)
    finally:
        if standin is not None and standin.returncode is None:
            standin.kill()
        await a.stop()


async def test_sigkill_of_a_paused_holder_and_of_a_waiter(tiny_model: Path, tmp_path: Path) -> None:
    """a, paused by its quantum with a stream in flight, waits for the token: SIGKILL
    it; b keeps serving. Then b streams and c waits: SIGKILL c; b keeps the GPU and
    nothing is left registered. The token is free once b is stopped."""
    quantum = ("--arena-quantum", str(QUANTUM))
    a = await start(tiny_model, tmp_path, *quantum)
    b = await start(tiny_model, tmp_path, *quantum)
    c = None
    try:
        times: list[float] = []
        async with trio.open_nursery() as nursery:

            async def doomed() -> None:
                try:
                    await stream_tokens(a, "Once upon a time", 1500, times)
                except Exception:  # noqa: BLE001 - the server is killed under it
                    pass

            nursery.start_soon(doomed)
            with trio.fail_after(60):
                while len(times) < 5:
                    await trio.sleep(0.01)
            await trio.sleep(QUANTUM)
            # b's request makes a pause; while b holds the GPU, hold it busy
            b_times: list[float] = []
            nursery.start_soon(stream_tokens, b, "Another story", 400, b_times)
            res = await a.until(lambda r: r["state"] != "resident" and r["arbiter"]["waiting"], "a paused")
            assert res["cycles"]["quantum_yields"] >= 1
            a.proc.send_signal(signal.SIGKILL)
            with trio.fail_after(30):
                await a.proc.wait()
            await b.complete("Still there?")
        c = await start(tiny_model, tmp_path, *quantum)  # waits for the token at load
        b_times = []
        async with trio.open_nursery() as nursery:
            nursery.start_soon(stream_tokens, b, "A third story", 300, b_times)
            with trio.fail_after(60):
                while len(b_times) < 3:
                    await trio.sleep(0.01)
            c.proc.send_signal(signal.SIGKILL)
            with trio.fail_after(30):
                await c.proc.wait()
        await b.complete("And now?")
        res = await b.residency()
        assert res["state"] == "resident" and res["token_held"]
    finally:
        for s in (a, c):
            if s is not None and s.proc.returncode is None:
                s.proc.kill()
        code, err = await b.stop()
        assert code == 0, err
    # nothing stranded: the token is free and nobody is registered
    probe = await trio.lowlevel.open_process(
        [*STANDIN, "--arena", str(tmp_path), "--hold", "0"], stdout=subprocess.PIPE
    )
    with trio.fail_after(10):
        assert await probe.wait() == 0

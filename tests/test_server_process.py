"""`trio-llm serve` as a real process: flags, start-up errors and signals."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import trio

from serve_procs import wait_ready
from trio_llm.runtime import main, parse_config

SERVE = [sys.executable, "-m", "trio_llm", "serve"]


def run_serve(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*SERVE, *args], capture_output=True, text=True, timeout=120)


def test_unknown_flag_is_one_line_and_exit_2() -> None:
    r = run_serve("--definitely-not-a-flag", "3")
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "--definitely-not-a-flag" in lines[0]


# The next two call the command's main() in this process: the same code path as the
# real process above, without paying an interpreter start per case.


@pytest.mark.parametrize(
    "args",
    [["-np", "0"], ["--port", "x"], ["--backend", "cuda"], ["--sleep-mode", "deep"],
     ["--top-p", "3"], ["--typical", "1.5"], ["-c"], ["--sleep-idle-seconds", "-5"], ["-ngl", "lots"]],
)
def test_bad_flag_values_are_one_line_and_exit_2(args: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(args) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err


def test_compatibility_flags_are_accepted() -> None:
    config = parse_config(["-ngl", "99", "--n-cpu-moe", "4", "-np", "3", "-c", "0", "-a", "x", "--no-warmup"])
    assert (config.n_gpu_layers, config.n_cpu_moe, config.parallel, config.ctx_size) == (99, 4, 3, 0)
    assert config.alias == "x" and config.warmup is False
    assert parse_config(["-ngl", "all"]).n_gpu_layers == -1
    assert parse_config(["--typical", "0.7"]).typical_p == 0.7


def test_a_bad_model_file_is_one_line_and_exit_1(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + b"\x00" * 20)
    assert main(["-m", str(bad), "--port", "0", "--backend", "numpy"]) == 1
    err = capsys.readouterr().err
    errors = [ln for ln in err.splitlines() if "error" in ln]
    assert len(errors) == 1 and "broken.gguf" in errors[0]
    assert "Traceback" not in err
    assert main(["-m", str(tmp_path / "missing.gguf"), "--port", "0"]) == 1
    err = capsys.readouterr().err
    assert "missing.gguf" in err and "Traceback" not in err


def test_a_port_in_use_is_one_line_and_exit_1(tiny_model: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["-m", str(tiny_model), "--port", str(port), "--backend", "numpy"]) == 1
    err = capsys.readouterr().err
    assert len([ln for ln in err.splitlines() if "error" in ln]) == 1 and "Traceback" not in err


async def _start(model: Path, *extra: str) -> tuple[trio.Process, str, list[str]]:
    """Start a server on a free port; return it once it logs "ready", with its URL."""
    proc = await trio.lowlevel.open_process(
        [*SERVE, "-m", str(model), "--port", "0", "--backend", "numpy", *extra],
        stderr=subprocess.PIPE,
    )
    url, log = await wait_ready(proc, 60)
    return proc, url, log


async def _rest_of_log(proc: trio.Process) -> str:
    assert proc.stderr is not None
    out = b""
    while chunk := await proc.stderr.receive_some():
        out += chunk
    return out.decode()


async def test_sigterm_lets_a_streaming_request_finish_then_exits_0(tiny_model: Path) -> None:
    proc, url, _ = await _start(tiny_model, "--shutdown-timeout", "20")
    body = {"prompt": "Once upon a time", "n_predict": 24, "ignore_eos": True, "stream": True}
    async with httpx.AsyncClient(base_url=url, timeout=60) as c:
        async with c.stream("POST", "/completion", json=body) as r:
            lines = r.aiter_lines()
            first = await lines.__anext__()
            assert first.startswith("data: ")
            proc.send_signal(signal.SIGTERM)
            rest = [ln async for ln in lines if ln.startswith("data: ")]
    assert '"stop": true' in rest[-1]  # the request in flight was answered in full
    with trio.fail_after(15):
        log = await _rest_of_log(proc)
        code = await proc.wait()
    assert code == 0
    assert "Traceback" not in log


async def test_sigint_when_idle_exits_0(tiny_model: Path) -> None:
    proc, url, _ = await _start(tiny_model, "-np", "2", "--metrics")
    async with httpx.AsyncClient(base_url=url, timeout=60) as c:
        assert (await c.get("/health")).status_code == 200
    # on the wire, header names are Title-Case as llama-server sends them (clients
    # that look them up case-sensitively, llama.cpp's own tests among them, find them)
    host, port = url.removeprefix("http://").rsplit(":", 1)
    stream = await trio.open_tcp_stream(host, int(port))
    async with stream:
        await stream.send_all(f"GET /metrics HTTP/1.1\r\nHost: {host}\r\nOrigin: http://localhost\r\n"
                              "Connection: close\r\n\r\n".encode())
        raw = b""
        with trio.fail_after(30):
            while b"\r\n\r\n" not in raw and (chunk := await stream.receive_some()):
                raw += chunk
    head = raw.split(b"\r\n\r\n", 1)[0]
    assert head.startswith(b"HTTP/1.1 200")
    assert b"\r\nContent-Type: text/plain" in head and b"\r\nProcess-Start-Time-Unix: " in head
    proc.send_signal(signal.SIGINT)
    with trio.fail_after(15):
        log = await _rest_of_log(proc)
        code = await proc.wait()
    assert code == 0 and "Traceback" not in log


@pytest.mark.vulkan
async def test_ubatch_above_512_is_one_pass_with_the_same_answer(tiny_model: Path) -> None:
    """``-ub 1024 -b 1024`` (llama-server's physical batch): the Vulkan backend's passes
    take up to 1024 tokens (/props, the log) where the default's take 512, and a
    1,100-token prompt gets the same greedy tokens from both (the passes themselves:
    tests/test_vulkan_ubatch.py)."""
    prompt = [5 + (i * 7) % 1000 for i in range(1100)]
    body = {"prompt": prompt, "n_predict": 12, "temperature": 0, "cache_prompt": False, "return_tokens": True}
    answers = []
    for flags in (["-ub", "1024", "-b", "1024"], []):
        proc = await trio.lowlevel.open_process(
            [*SERVE, "-m", str(tiny_model), "--port", "0", "--backend", "vulkan", "-c", "2048", "--no-warmup",
             *flags], stderr=subprocess.PIPE)
        try:
            url, log = await wait_ready(proc, 90)
            async with httpx.AsyncClient(base_url=url, timeout=120) as c:
                r = await c.post("/completion", json=body)
                assert r.status_code == 200, r.text
                answers.append(r.json()["tokens"])
                dev = (await c.get("/props")).json()["device"]
            want = 1024 if flags else 512
            assert dev["max_chunk"] == want
            assert any(f"up to {want} tokens a pass" in line for line in log)
        finally:
            proc.terminate()
            await proc.wait()
    assert answers[0] == answers[1] and len(answers[0]) == 12

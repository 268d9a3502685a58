"""The runner's pieces: server flags, run lengths and bounds, Ctrl-C detection, and a
set-up failure (a server that cannot start) ending in a clean, failed report."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from trio_llm.errors import ScenarioError
from trio_llm.scenario import format as fmt
from trio_llm.scenario import report
from trio_llm.scenario.runner import Options, interrupted, new_record, run_scenario
from trio_llm.scenario.servers import ServerSlot, ensure_model

BASE = """
[scenario]
length = 2
full_length = 20
timeout_s = 30
[[server]]
name = "a"
sleep_mode = "weights"
sleep_idle_seconds = 2.5
[[server]]
name = "plain"
arena = false
np = 4
ctx = 1024
args = ["--no-warmup"]
[[phase]]
[[phase.step]]
server = "a"
prompt = "x"
"""


def _slot(spec: fmt.ServerSpec, tmp_path: Path) -> ServerSlot:
    return ServerSlot(spec, tmp_path / "m.gguf", "numpy", tmp_path / "arena", tmp_path / "log")


def test_server_flags(tmp_path: Path) -> None:
    s = fmt.loads(BASE)
    arena, plain = (_slot(spec, tmp_path) for spec in s.servers)
    arena.port = 8081
    cmd = arena.command()
    assert cmd[1:4] == ["-m", "trio_llm", "serve"]
    flags = " ".join(cmd[4:])
    assert f"-m {tmp_path / 'm.gguf'} --host 127.0.0.1 --port 8081 -np 1 -c 512 --backend numpy" in flags
    assert f"--vram-arena {tmp_path / 'arena'} --sleep-mode weights --sleep-idle-seconds 2.5" in flags
    flags = " ".join(plain.command())
    assert "--vram-arena" not in flags and "--sleep-mode" not in flags
    assert flags.endswith("-np 4 -c 1024 --backend numpy --no-warmup")


def test_lengths_and_bounds(tmp_path: Path) -> None:
    s = fmt.loads(BASE)
    short = new_record(s, Options(out=tmp_path))
    assert (short.scenario["length"], short.scenario["timeout_s"]) == (2, 30.0)
    assert short.scenario["backend"] == "auto"
    full = new_record(s, Options(out=tmp_path, full=True, backend="numpy"))
    # the full timeout defaults to the short one scaled by the length
    assert (full.scenario["length"], full.scenario["timeout_s"]) == (20, 300.0)
    assert full.scenario["backend"] == "numpy"
    custom = new_record(s, Options(out=tmp_path, length=5))
    assert (custom.scenario["length"], custom.scenario["timeout_s"]) == (5, 75.0)


def test_interrupt_is_seen_through_exception_groups() -> None:
    assert interrupted(KeyboardInterrupt())
    nested = BaseExceptionGroup("outer", [ValueError(), BaseExceptionGroup("inner", [KeyboardInterrupt()])])
    assert interrupted(nested)
    assert not interrupted(ExceptionGroup("outer", [ValueError()]))
    assert not interrupted(RuntimeError())


async def test_missing_model_file_is_a_scenario_error(tmp_path: Path) -> None:
    s = fmt.loads(BASE.replace('name = "a"\n', f'name = "a"\nmodel = "{tmp_path / "none.gguf"}"\n', 1))
    with pytest.raises(ScenarioError, match="none.gguf does not exist"):
        await ensure_model(s.servers[0], tmp_path)


async def test_a_server_that_cannot_start_fails_the_run_cleanly(tmp_path: Path) -> None:
    """A corrupt model file: the server exits while starting; the run ends at once
    with a failed report that quotes the server's log, and nothing is left running."""
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + os.urandom(64))
    text = BASE.replace('name = "a"\n', f'name = "a"\nmodel = "{bad}"\n', 1)
    s = fmt.loads(text, tmp_path / "broken.toml")
    record = await run_scenario(s, Options(out=tmp_path / "out", backend="numpy", verbose=False))
    summary = report.write(record, tmp_path / "out")
    assert not summary.passed
    assert "server a exited with" in summary.text and "while starting" in summary.text
    assert record.requests == []
    starts = [e for e in record.events if e.kind == "start"]
    assert len(starts) == 1
    with pytest.raises(ProcessLookupError):
        os.kill(int(starts[0].detail.split()[1]), 0)
    assert (tmp_path / "out" / "logs" / "a.log").read_text().strip()

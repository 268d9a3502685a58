"""Every shipped scenario, short version, for real: server processes on loopback
ports sharing a real arena (flock), the numpy backend, the tiny model.

Each test asserts the scenario's own expectations and prints its report summary on
failure; together they are the end-to-end check of the arbiter, residency and
server working as one.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from trio_llm.scenario import format as fmt
from trio_llm.scenario import report
from trio_llm.scenario.runner import Options, run_scenario

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = sorted((ROOT / "scenarios").glob("*.toml"))


@pytest.fixture(scope="session")
def scenario_models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One model folder for every scenario of the session: the tiny model is made once."""
    return tmp_path_factory.mktemp("scenario-models")


@pytest.mark.parametrize("path", SHIPPED, ids=[p.stem for p in SHIPPED])
async def test_shipped_scenario_short(path: Path, tmp_path: Path, scenario_models: Path) -> None:
    scenario = fmt.load(path)
    options = Options(out=tmp_path, backend="numpy", model_dir=scenario_models, verbose=False)
    record = await run_scenario(scenario, options)
    summary = report.write(record, tmp_path)
    assert summary.passed, summary.text + "\n" + "\n".join(record.notes)
    assert (tmp_path / "timeline.png").stat().st_size > 0
    # nothing left running: every process the runner started has exited
    for event in record.events:
        if event.kind == "start":
            pid = int(event.detail.split()[1])
            with pytest.raises(ProcessLookupError):
                os.kill(pid, 0)


async def test_replayed_references(tmp_path: Path, scenario_models: Path) -> None:
    """``--reference replay`` for real: every answered request of every scenario server
    is asked again, in its server's order, of a plain twin, and matched by request."""
    scenario = fmt.load(ROOT / "scenarios" / "pinned.toml")
    options = Options(out=tmp_path, backend="numpy", model_dir=scenario_models, verbose=False, reference="replay")
    record = await run_scenario(scenario, options)
    summary = report.write(record, tmp_path)
    assert summary.passed, summary.text + "\n" + "\n".join(record.notes)
    answered = sorted(r.id for r in record.requests if r.outcome == "ok")
    assert answered and sorted(x.request_id for x in record.references) == answered  # type: ignore[type-var]
    twins = {s["name"] for s in record.servers if s.get("reference")}
    assert twins == {f"reference-{r.server}" for r in record.requests if r.outcome == "ok"}
    assert record.scenario["reference"] == "replay"


def test_interrupt_stops_every_server(tmp_path: Path, scenario_models: Path) -> None:
    """Ctrl-C in the middle of a run: exit 130, a partial report, no server left."""
    cmd = [sys.executable, "-m", "trio_llm", "scenario", "run", "frozen-holder",
           "--backend", "numpy", "--model-dir", str(scenario_models), "--out", str(tmp_path)]
    with subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True) as proc:
        assert proc.stdout is not None
        seen = []
        for line in proc.stdout:
            seen.append(line)
            if "stop a" in line:  # the holder is frozen mid-decode: a messy moment
                break
        else:
            pytest.fail("the run ended before the fault step:\n" + "".join(seen))
        proc.send_signal(signal.SIGINT)
        rest = proc.stdout.read()
        assert proc.wait(timeout=60) == 130, "".join(seen) + rest
    assert "every server process was stopped" in rest
    data = json.loads((tmp_path / "report.json").read_text())
    assert data["interrupted"] is True
    pids = [int(e["detail"].split()[1]) for e in data["events"] if e["kind"] == "start"]
    assert len(pids) == 2
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)

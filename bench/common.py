"""Helpers every benchmark script shares (see docs/BENCHMARKS.md).

A benchmark run prints a short table and writes one JSON record to
``bench/results/<name>-<UTC timestamp>.json`` holding the command line, the machine,
the git commit, the parameters and every figure with min/median/max over repeats, so
numbers quoted anywhere can be traced back to the run that produced them.

Wall-clock time is allowed here (unlike in ``src/``): a benchmark measures the real
machine, and ``time.perf_counter`` is the clock for that.

Scripts run as ``.venv/bin/python bench/<script>.py`` and ``import common``; importing
it also puts the checkout's ``src/`` first on ``sys.path``, so a benchmark measures
the code of this tree even where the package is installed from elsewhere.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import attrs

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
if str(ROOT / "src") not in sys.path:
    sys.path.insert(0, str(ROOT / "src"))


@attrs.frozen
class Stats:
    """Summary of repeated measurements of one figure."""

    values: tuple[float, ...]

    @property
    def min(self) -> float:
        return min(self.values)

    @property
    def median(self) -> float:
        return statistics.median(self.values)

    @property
    def max(self) -> float:
        return max(self.values)

    def to_json(self) -> dict[str, Any]:
        return {"min": self.min, "median": self.median, "max": self.max, "values": list(self.values)}


def stats(values: Sequence[float]) -> Stats:
    if not values:
        raise ValueError("no measurements")
    return Stats(tuple(float(v) for v in values))


def now() -> float:
    """The benchmark clock: monotonic, high resolution, real time."""
    return time.perf_counter()


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    """(seconds, result) of one call."""
    t0 = now()
    result = fn()
    return now() - t0, result


def repeat(fn: Callable[[], float], repeats: int, warmup: int = 1) -> Stats:
    """Run ``fn`` (which returns one figure) ``warmup`` times unrecorded, then
    ``repeats`` times; the first runs pay for page faults and caches."""
    for _ in range(warmup):
        fn()
    return stats([fn() for _ in range(repeats)])


def git_commit() -> dict[str, Any]:
    def git(*args: str) -> str:
        try:
            out = subprocess.run(
                ["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=30, check=True
            )
        except (OSError, subprocess.SubprocessError):
            return ""
        return out.stdout.strip()

    return {"commit": git("rev-parse", "HEAD") or None, "dirty": bool(git("status", "--porcelain", "--untracked-files=no"))}


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _mem_total() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def machine_info() -> dict[str, Any]:
    import numpy as np

    blas: Any = None
    try:
        cfg = np.show_config(mode="dicts")  # type: ignore[call-arg]
        blas = cfg.get("Build Dependencies", {}).get("blas", {}).get("name")
    except (TypeError, AttributeError):
        pass
    return {
        "hostname": platform.node(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "numpy": np.__version__,
        "blas": blas,
        "cpu": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "mem_total_bytes": _mem_total(),
        "loadavg": os.getloadavg() if hasattr(os, "getloadavg") else None,
    }


def model_file(preset: str, quant: str, seed: int = 0) -> Path:
    """A synthetic model of ``preset``, made once and cached across benchmark runs.

    The file name carries the generator version, so a change to ``make-model`` that
    changes the bytes makes a new file instead of reusing a stale one.
    """
    import platformdirs

    from trio_llm.model.synth import generator_version, make_model

    directory = Path(platformdirs.user_cache_dir("trio-llm")) / "bench-models"
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{preset}-{quant}-s{seed}-{generator_version()}.gguf"
    if not path.exists():
        print(f"making {path.name} ...", file=sys.stderr, flush=True)
        make_model(preset, quant, path, seed=seed)
    return path


def fmt(x: Any) -> str:
    if isinstance(x, Stats):
        return fmt(x.median)
    if isinstance(x, float):
        if x == 0 or 0.01 <= abs(x) < 1e6:
            return f"{x:,.2f}" if abs(x) < 100 else f"{x:,.0f}"
        return f"{x:.3g}"
    return str(x)


def print_table(rows: Sequence[dict[str, Any]], columns: Sequence[str] | None = None) -> None:
    """A plain-text table; Stats cells show their median."""
    if not rows:
        return
    cols = list(columns or rows[0].keys())
    cells = [[fmt(r.get(c, "")) for c in cols] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(cols)]
    print("  ".join(c.rjust(w) for c, w in zip(cols, widths, strict=True)))
    print("  ".join("-" * w for w in widths))
    for row in cells:
        print("  ".join(v.rjust(w) for v, w in zip(row, widths, strict=True)))


def _jsonable(x: Any) -> Any:
    if isinstance(x, Stats):
        return x.to_json()
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_jsonable(v) for v in x]
    if hasattr(x, "item"):  # numpy scalars
        return x.item()
    if isinstance(x, Path):
        return str(x)
    return x


#: the environment variables a record keeps: the backend's and the Vulkan loader's
#: settings (an A/B through TRIO_LLM_* would otherwise leave two records that differ
#: only in their timestamps)
SETTINGS_PREFIXES = ("TRIO_LLM_", "GGML_VK_", "VK_ICD_FILENAMES", "VK_DRIVER_FILES")


def settings() -> dict[str, str]:
    """The environment's settings that change what a run measures (``SETTINGS_PREFIXES``)."""
    return {k: v for k, v in sorted(os.environ.items()) if k.startswith(SETTINGS_PREFIXES)}


def write_result(name: str, params: dict[str, Any], figures: Any) -> Path:
    """Write the JSON record of a run; returns its path."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    stamp = dt.datetime.now(dt.UTC).strftime("%Y%m%dT%H%M%SZ")
    path = RESULTS / f"{name}-{stamp}.json"
    record = {
        "name": name,
        "command": shlex.join([sys.executable, *sys.argv]),
        "started_utc": stamp,
        "git": git_commit(),
        "machine": machine_info(),
        "settings": settings(),
        "params": _jsonable(params),
        "figures": _jsonable(figures),
    }
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(record, indent=2) + "\n")
    tmp.replace(path)
    return path

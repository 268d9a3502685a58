"""``make serve`` installs only what serving needs (issue 15, item 5): the closure of
``pyproject.toml``'s plain dependencies (no extras), read from the installed
distributions' metadata, holds no torch and no transformers."""

from __future__ import annotations

import importlib.metadata as md
import re
import tomllib
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement

PYPROJECT = Path(__file__).resolve().parent.parent / "pyproject.toml"


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def test_the_serving_install_pulls_no_torch() -> None:
    project = tomllib.loads(PYPROJECT.read_text())["project"]
    env = dict(default_environment(), extra="")
    todo = [Requirement(r) for r in project["dependencies"]]
    seen: set[str] = set()
    while todo:
        req = todo.pop()
        if (req.marker and not req.marker.evaluate(env)) or _norm(req.name) in seen:
            continue
        seen.add(_norm(req.name))
        todo += [Requirement(r) for r in md.distribution(req.name).requires or []]
    assert {"trio", "numpy", "gguf", "hypercorn", "llguidance"} <= seen
    assert not seen & {"torch", "transformers", "accelerate", "xllamacpp", "pytest"}, sorted(seen)
    assert "torch" in " ".join(project["optional-dependencies"]["reference"])  # where it lives instead

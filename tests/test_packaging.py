"""Packaging. ``make serve`` installs only what serving needs (issue 15, item 5): the
closure of ``pyproject.toml``'s plain dependencies (no extras), read from the installed
distributions' metadata, holds no torch and no transformers. A non-editable install (a
wheel) carries the shaders and their prebuilt SPIR-V and finds them (issue 13, item 4)."""

from __future__ import annotations

import importlib.metadata as md
import json
import os
import re
import subprocess
import sys
import tarfile
import tomllib
import zipfile
from pathlib import Path

import pytest
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


REPO = PYPROJECT.parent


def _run(*cmd: str, cwd: Path | None = None, env: dict[str, str] | None = None) -> str:
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, check=False)
    assert proc.returncode == 0, f"{cmd[:4]} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    return proc.stdout

#: run inside the installed wheel (PYTHONPATH = the install target alone): where the
#: shaders resolve, the default set's keys, and what a lookup writes to the cache
_INSTALLED_PROBE = """
import json, sys
import trio_llm
from trio_llm.vulkan import shaders
out = {"module": trio_llm.__file__, "dir": str(shaders.shader_dir()), "cache": str(shaders.cache_dir())}
out["keys"] = sorted({f"{n}-{shaders.cache_key(n, d)}.spv" for n, d in shaders.all_variants()})
cache = shaders.cache_dir()
listing = lambda: sorted(p.name for p in cache.glob("*")) if cache.exists() else []
code = shaders.spirv("add")
out["add"] = code.hex()
out["after_shipped"] = listing()
extra = shaders.spirv("swiglu", {"GELU": 1, "UNUSED": 7})  # in no shipped set: compiled now
out["extra_magic"] = extra[:4].hex()
out["after_extra"] = listing()
print(json.dumps(out))
"""


def test_a_wheel_carries_the_shaders_and_their_spirv(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 13, item 4: the sdist of the working tree, and the wheel built from it,
    carry ``shaders/``'s GLSL and the SPIR-V ``shaders/build/`` holds; installed with
    ``pip install --target`` (no repository beside it), trio-llm resolves its shaders
    inside the package and reads a default variant's shipped SPIR-V without compiling
    (nothing is written to the writable cache), while a variant outside the shipped set
    compiles into the user cache, not into the package."""
    from trio_llm.vulkan import shaders

    monkeypatch.delenv("TRIO_LLM_SHADER_DIR", raising=False)
    monkeypatch.delenv("TRIO_LLM_SHADER_CACHE", raising=False)
    assert shaders.shader_dir() == REPO / "shaders"  # a checkout reads its own tree
    add = shaders.spirv("add")  # at least one default variant in shaders/build
    default = {f"{n}-{shaders.cache_key(n, d)}.spv" for n, d in shaders.all_variants()}
    built = {p.name for p in (REPO / "shaders" / "build").glob("*.spv")}
    present = default & built
    assert f"add-{shaders.cache_key('add')}.spv" in present
    glsl = {p.name for p in (REPO / "shaders").iterdir() if p.suffix in (".comp", ".glsl")}

    # the sdist through setuptools' PEP 517 hook (what `python -m build` calls first)
    build_sdist = f"from setuptools import build_meta; print(build_meta.build_sdist({str(tmp_path)!r}))"
    sdist = tmp_path / _run(sys.executable, "-c", build_sdist, cwd=REPO).strip().splitlines()[-1]
    with tarfile.open(sdist) as tar:
        names = set(tar.getnames())
        root = tar.getnames()[0].split("/")[0]
        assert {f"{root}/shaders/{g}" for g in glsl} <= names
        assert {f"{root}/shaders/build/{s}" for s in present} <= names
        tar.extractall(tmp_path / "sdist", filter="data")
    _run(sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "--no-index",
         "-w", str(tmp_path / "wheel"), str(tmp_path / "sdist" / root))
    (wheel,) = (tmp_path / "wheel").glob("trio_llm-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
    assert {f"trio_llm/_shaders/{g}" for g in glsl} <= names
    assert {f"trio_llm/_shaders/build/{s}" for s in present} <= names
    assert not {n for n in names if n.startswith("shaders/")}  # nothing outside the package

    site = tmp_path / "site"
    _run(sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--target", str(site), str(wheel))
    # the venv's site-packages still give the dependencies (and the compiler wheels)
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRIO_LLM_SHADER")}
    env.update(PYTHONPATH=str(site), XDG_CACHE_HOME=str(tmp_path / "xdg"))
    out = json.loads(_run(sys.executable, "-c", _INSTALLED_PROBE, cwd=tmp_path, env=env))
    assert Path(out["module"]).is_relative_to(site)
    assert out["dir"] == str(site / "trio_llm" / "_shaders")
    assert Path(out["cache"]).is_relative_to(tmp_path / "xdg")  # never inside the package
    assert set(out["keys"]) == default  # the installed sources key every variant alike
    assert bytes.fromhex(out["add"]) == add and out["after_shipped"] == []  # read, not compiled
    assert out["extra_magic"] == "03022307" and len(out["after_extra"]) == 1
    assert out["after_extra"][0].startswith("swiglu-")

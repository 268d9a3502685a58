"""``-hf REPO[:QUANT]``: find the model in llama.cpp's local cache (the download, when
it is not there, is ``hf_download``'s; this module only reads).

llama.cpp (October 2026, ``common/hf-cache.cpp``) keeps ``-hf`` downloads in the
Hugging Face hub layout: the cache directory is the first of ``$LLAMA_CACHE``,
``$HF_HUB_CACHE``, ``$HUGGINGFACE_HUB_CACHE``, ``$HF_HOME/hub``,
``$XDG_CACHE_HOME/huggingface/hub``, ``~/.cache/huggingface/hub``; a repository
lives in ``models--<owner>--<name>/``, ``refs/main`` (else any ref) holds the commit,
and the files are under ``snapshots/<commit>/``. Older llama.cpp wrote one flat file,
``<owner>_<name>_<file>.gguf``, into ``$LLAMA_CACHE`` or ``~/.cache/llama.cpp``: such a
cache (the one USERS.md's deployment has on its volume) is searched too.

Which file of the repository: ``-hff`` names it (case-insensitively); else the first
model GGUF (not an mmproj, imatrix or speculative sidecar) whose name holds the quant
tag followed by ``.`` or ``-`` (case-insensitively), the first part of a split model;
without a tag, Q4_K_M, then Q8_0, then the first model file - llama.cpp's
``find_best_model``.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping
from pathlib import Path, PurePosixPath

from trio_llm.errors import ModelLoadError

_SIDECARS = ("mmproj", "imatrix", "mtp-", "eagle3-", "dflash-", "dspark-")
_SPLIT = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$", re.IGNORECASE)


class NotCached(ModelLoadError):
    """``-hf`` names a repository or file that is not in the local cache."""


def hub_cache_dir(env: Mapping[str, str]) -> Path:
    for var, sub in (("LLAMA_CACHE", ""), ("HF_HUB_CACHE", ""), ("HUGGINGFACE_HUB_CACHE", ""),
                     ("HF_HOME", "hub"), ("XDG_CACHE_HOME", "huggingface/hub")):
        if env.get(var):
            return Path(env[var]) / sub if sub else Path(env[var])
    return Path(env.get("HOME") or Path.home()) / ".cache" / "huggingface" / "hub"


def flat_cache_dir(env: Mapping[str, str]) -> Path:
    """llama.cpp's ``fs_get_cache_directory`` on Linux: ``$LLAMA_CACHE``, else
    ``$XDG_CACHE_HOME/llama.cpp``, else ``~/.cache/llama.cpp``."""
    if env.get("LLAMA_CACHE"):
        return Path(env["LLAMA_CACHE"])
    if env.get("XDG_CACHE_HOME"):
        return Path(env["XDG_CACHE_HOME"]) / "llama.cpp"
    return Path(env.get("HOME") or Path.home()) / ".cache" / "llama.cpp"


def split_repo_tag(spec: str) -> tuple[str, str]:
    repo, _, tag = spec.partition(":")
    return repo, tag


def _is_model(path: str) -> bool:
    name = path.rsplit("/", 1)[-1]
    return name.endswith(".gguf") and not any(s in name for s in _SIDECARS)


def _first_part(path: str) -> bool:
    m = _SPLIT.search(path)
    return m is None or int(m.group(1)) == 1


def pick(files: list[str], tag: str, hf_file: str | None) -> str | None:
    """The file of a repository's ``files`` (relative paths) that ``-hf``/``-hff`` mean."""
    if hf_file:
        return next((f for f in files if f.lower() == hf_file.lower()), None)
    for t in [tag] if tag else ["Q4_K_M", "Q8_0"]:
        pattern = re.compile(re.escape(t) + r"[.-]", re.IGNORECASE)
        for f in files:
            if _is_model(f) and _first_part(f) and pattern.search(f):
                return f
    if not tag:
        return next((f for f in files if _is_model(f) and _first_part(f)), None)
    return None


def _snapshot(repo_dir: Path) -> Path | None:
    refs = repo_dir / "refs"
    commits: list[str] = []
    if refs.is_dir():
        main = refs / "main"
        ordered = [main] + sorted(p for p in refs.iterdir() if p != main)
        for ref in ordered:
            if ref.is_file():
                commit = ref.read_text().strip()
                if re.fullmatch(r"[0-9a-fA-F]{40}", commit):
                    commits.append(commit)
    for commit in commits:
        snap = repo_dir / "snapshots" / commit
        if snap.is_dir():
            return snap
    return None


def resolve(spec: str, hf_file: str | None = None, env: Mapping[str, str] | None = None) -> Path:
    """The cached file for ``-hf spec`` (and ``-hff``); ``NotCached`` names where it looked."""
    env = os.environ if env is None else env
    repo, tag = split_repo_tag(spec)
    hub = hub_cache_dir(env)
    repo_dir = hub / ("models--" + repo.replace("/", "--"))
    snap = _snapshot(repo_dir) if repo_dir.is_dir() else None
    if snap is not None:
        files = sorted(str(p.relative_to(snap)) for p in snap.rglob("*") if p.is_file())
        chosen = pick(files, tag, hf_file)
        if chosen is not None:
            return snap / chosen
    flat = flat_cache_dir(env)
    prefix = repo.replace("/", "_") + "_"
    if flat.is_dir():
        names = sorted(p.name[len(prefix):] for p in flat.iterdir()
                       if p.name.startswith(prefix) and p.is_file())
        chosen = pick(names, tag, hf_file)
        if chosen is not None:
            return flat / (prefix + chosen)
    what = hf_file or (f"quant {tag}" if tag else "a GGUF model file")
    raise NotCached(spec, f"-hf: {what} is not in the local cache ({repo_dir}, or {flat}/{prefix}*.gguf); "
                          "nothing is downloaded: put the file there or use -m")


_SPLIT_NAME = re.compile(r"^(.+)-(\d{5})-of-(\d{5})$", re.IGNORECASE)
_TAG = re.compile(r"[-.]([A-Z0-9_]+)$", re.IGNORECASE)


def cached_models(env: Mapping[str, str] | None = None) -> list[str]:
    """``-cl/--cache-list``: the ``REPO:TAG`` of every model in the hub cache, as
    llama.cpp's ``common_list_cached_models`` lists them: a GGUF file's first part
    whose name ends in a quant tag (``-Q4_K_M.gguf``), sidecars (projectors, draft
    heads) left out, each repository and tag once, repositories in name order."""
    env = os.environ if env is None else env
    hub = hub_cache_dir(env)
    out: list[str] = []
    if not hub.is_dir():
        return out
    for repo_dir in sorted(hub.glob("models--*--*")):
        snap = _snapshot(repo_dir)
        if snap is None:
            continue
        repo = repo_dir.name.removeprefix("models--").replace("--", "/", 1)
        for f in sorted(str(p.relative_to(snap)) for p in snap.rglob("*.gguf") if p.is_file()):
            prefix = f[: -len(".gguf")]
            index = 1
            m = _SPLIT_NAME.match(prefix)
            if m is not None:
                prefix, index = m.group(1), int(m.group(2))
            tag = _TAG.search(prefix)
            if index != 1 or tag is None or any(s in prefix for s in ("mmproj", *_SIDECARS[2:])):
                continue
            entry = f"{repo}:{tag.group(1).upper()}"
            if entry not in out:
                out.append(entry)
    return out


def _quant_bits(name: str) -> int | None:
    """The bit depth of a file name's trailing quant tag (``Q4_K_M`` 4, ``F16`` 16; a
    split model's ``-00001-of-00003`` left out)."""
    stem = name.rsplit("/", 1)[-1].removesuffix(".gguf")
    split = _SPLIT_NAME.match(stem)
    if split is not None:
        stem = split.group(1)
    tag = re.split(r"[-.]", stem)[-1]
    m = re.search(r"\d+", tag)
    return int(m.group()) if m else None


def best_mmproj(files: Iterable[str], model: str) -> str | None:
    """The projector of a repository's ``files`` (relative ``/`` paths) that goes with
    ``model`` (one of them), or None: among the ``.gguf`` files whose name holds
    ``mmproj``, one in the model's directory or a parent of it, the deepest, then the
    one whose quant bit depth is nearest the model's (llama.cpp's ``find_best_mmproj``
    in ``common/download.cpp``, October 2026)."""
    model_dir = PurePosixPath(model).parent.parts
    want = _quant_bits(model)
    best: tuple[int, int] | None = None
    chosen = None
    for f in sorted(files):
        p = PurePosixPath(f)
        if not p.name.endswith(".gguf") or "mmproj" not in p.name.lower() or f == model:
            continue
        parts = p.parent.parts
        if parts != model_dir[: len(parts)]:
            continue
        bits = _quant_bits(p.name)
        distance = abs(bits - want) if bits is not None and want is not None else 1 << 16
        key = (-len(parts), distance)
        if best is None or key < best:
            best, chosen = key, f
    return chosen


def find_mmproj(model: Path, spec: str) -> Path | None:
    """The projector file llama-server's ``-hf`` takes beside ``model`` (a file of the
    local cache, for ``-hf spec``), or None: ``best_mmproj`` among the files of the
    model's snapshot, or of the flat cache's files of the same repository."""
    snap = next((p for p in model.parents if p.parent.name == "snapshots"), None)
    if snap is not None:
        root = snap
        files = [p.relative_to(snap).as_posix() for p in snap.rglob("*.gguf") if p.is_file()]
    else:  # the flat cache: <owner>_<name>_<file>, one directory for every repository
        root = model.parent
        prefix = split_repo_tag(spec)[0].replace("/", "_") + "_"
        files = [p.name for p in root.iterdir() if p.is_file() and p.name.endswith(".gguf")
                 and p.name.startswith(prefix)]
    chosen = best_mmproj(files, model.relative_to(root).as_posix())
    return None if chosen is None else root / chosen

"""``-hf`` online (model/hf_download.py) against a Hugging Face hub stand-in on loopback,
and against llama.cpp itself.

``Hub`` answers the routes llama.cpp's ``-hf`` uses, in the hub's shapes:
``GET /api/models/<repo>/refs`` (``branches`` with ``name`` and ``targetCommit``),
``GET /api/models/<repo>/tree/<commit>?recursive=true`` (items with ``type``, ``oid``,
``size``, ``path`` and, for LFS files, ``lfs.oid``), and ``HEAD``/``GET
/<repo>/resolve/<commit>/<path>``: an LFS file is a 302 to the "CDN" on another origin
(``localhost`` instead of ``127.0.0.1``, with a signed-looking query) that answers with
the sha256 as ``ETag`` and takes ranges, a small file is answered directly; an
unknown repository is a 404 with ``X-Error-Code: RepoNotFound``. Tests point at it
with ``MODEL_ENDPOINT`` and count what it was asked.

The reference tests run llama.cpp's own ``-hf`` (``xllamacpp.Server`` with
``params.model.hf_repo``: ``common_models_handler_apply`` of October 2026, HTTP client
compiled in) in a child process, with the same endpoint and cache: a child because
llama.cpp reads the cache directory once per process, and because the server would
otherwise wait for the GIL that the constructor holds. The cache each program writes
is the other's, byte for byte and link for link.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

import attrs
import pytest
import trio

from test_download import QuietHandler, Request, _no_proxy  # noqa: F401  (the fixture)
from trio_llm.model.hf_cache import NotCached, find_mmproj, resolve
from trio_llm.model.hf_download import HubError, fetch, split_info, split_parts, valid_repo_id
from trio_llm.runtime import parse_config, serve

PAUSES: list[float] = []
FAST: dict[str, Any] = {"retry_delay": 0.01, "timeout": 5.0, "pause": PAUSES.append}
COMMIT = "0123456789abcdef0123456789abcdef01234567"
TOKEN = "hf_" + "a1B2c3D4e5" * 4  # the shape llama.cpp sends to the API


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _git_oid(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@attrs.define
class Hub:
    """The hub's repositories (repo -> path -> bytes; ``.gguf`` files are LFS) and what
    it was asked."""

    port: int = 0
    repos: dict[str, dict[str, bytes]] = attrs.Factory(dict)
    commits: dict[str, str] = attrs.Factory(dict)
    requests: list[Request] = attrs.Factory(list)
    lock: threading.Lock = attrs.Factory(threading.Lock)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def add(self, repo: str, files: dict[str, bytes], commit: str = COMMIT) -> None:
        self.repos[repo] = files
        self.commits[repo] = commit

    def paths(self) -> list[str]:
        return [f"{r.method} {r.path.split('?')[0]}" for r in self.requests]

    def downloads(self) -> list[str]:
        return [p for p in self.paths() if p.startswith("GET /cdn/") or ("/resolve/" in p and p.startswith("GET"))]


class _HubHandler(QuietHandler):
    server: _HubServer

    def _send(self, status: int, data: bytes = b"", body: bool = True, **headers: str) -> None:
        self.send_response(status)
        for k, v in headers.items():
            self.send_header(k.replace("_", "-"), v)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if body:
            self.wfile.write(data)

    def _json(self, value: object, status: int = 200, **headers: str) -> None:
        self._send(status, json.dumps(value).encode(), Content_Type="application/json; charset=utf-8", **headers)

    def _answer(self, body: bool) -> None:
        hub = self.server.hub
        with hub.lock:
            hub.requests.append(Request(self.command, self.path, {k.lower(): v for k, v in self.headers.items()}))
        url = urlsplit(self.path)
        parts = [unquote(p) for p in url.path.strip("/").split("/")]
        if parts[0] == "cdn":  # the CDN: one blob by its sha256, ranges taken
            data = next((d for files in hub.repos.values() for d in files.values() if _sha(d) == parts[1]), None)
            if data is None:
                return self._send(404, body=body)
            status, extra = 200, {}
            rng = self.headers.get("Range")
            if rng and body:
                start = int(rng.removeprefix("bytes=").split("-")[0])
                data, status = data[start:], 206
                extra["Content_Range"] = f"bytes {start}-{start + len(data) - 1}/{start + len(data)}"
            return self._send(status, data, body, ETag=f'"{parts[1]}"', Accept_Ranges="bytes",
                              Content_Type="application/octet-stream", **extra)
        if parts[0] == "api" and parts[1] == "models" and len(parts) >= 5:
            repo = "/".join(parts[2:4])
            if repo not in hub.repos:
                return self._json({"error": "Repository not found"}, 404, X_Error_Code="RepoNotFound")
            files, commit = hub.repos[repo], hub.commits[repo]
            if parts[4] == "refs":
                return self._json({"branches": [{"name": "main", "ref": "refs/heads/main", "targetCommit": commit}],
                                   "converts": [], "tags": []})
            if parts[4] == "tree" and parts[5] in (commit, "main"):
                items: list[dict[str, Any]] = []
                dirs = sorted({str(Path(p).parent) for p in files} - {"."})
                items += [{"type": "directory", "oid": "0" * 40, "size": 0, "path": d} for d in dirs]
                for path, data in sorted(files.items()):
                    item: dict[str, Any] = {"type": "file", "oid": _git_oid(data), "size": len(data), "path": path}
                    if path.endswith(".gguf"):
                        item["lfs"] = {"oid": _sha(data), "size": len(data), "pointerSize": 134}
                    items.append(item)
                return self._json(items)
        if len(parts) >= 5 and parts[2] == "resolve":
            repo, rev, path = "/".join(parts[:2]), parts[3], "/".join(parts[4:])
            files = hub.repos.get(repo, {})
            if path not in files or rev not in (hub.commits.get(repo), "main"):
                return self._json({"error": "Entry not found"}, 404, X_Error_Code="EntryNotFound")
            data = files[path]
            if path.endswith(".gguf"):  # LFS: a redirect to the CDN, on another origin
                return self._send(302, b"", body, Location=f"http://localhost:{hub.port}/cdn/{_sha(data)}"
                                  "?X-Amz-Signature=s3cr3t&X-Amz-Expires=3600",
                                  X_Linked_Etag=f'"{_sha(data)}"', X_Linked_Size=str(len(data)),
                                  X_Repo_Commit=hub.commits[repo], ETag=f'"{_git_oid(data)}"')
            return self._send(200, data, body, ETag=f'"{_git_oid(data)}"', X_Repo_Commit=hub.commits[repo],
                              Accept_Ranges="bytes")
        return self._json({"error": "Not found"}, 404)


class _HubServer(ThreadingHTTPServer):
    daemon_threads = True
    hub: Hub


@pytest.fixture
def hub(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[Hub]:
    """The hub, with ``MODEL_ENDPOINT`` pointing at it and ``LLAMA_CACHE`` at a fresh
    directory (``tmp_path / "cache"``)."""
    server = _HubServer(("127.0.0.1", 0), _HubHandler)
    server.hub = Hub(port=server.server_address[1])
    thread = threading.Thread(target=server.serve_forever, args=(0.01,), daemon=True)
    thread.start()
    monkeypatch.setenv("MODEL_ENDPOINT", server.hub.endpoint)
    monkeypatch.delenv("HF_ENDPOINT", raising=False)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setenv("LLAMA_CACHE", str(tmp_path / "cache"))
    try:
        yield server.hub
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


def _blob(tag: str, size: int = 3000) -> bytes:
    """Stand-in bytes of a GGUF file (the fetch does not read them)."""
    return (b"GGUF" + tag.encode()) * (size // (4 + len(tag)))


SPLIT = [f"Q4_K_M/m-Q4_K_M-{i:05d}-of-00003.gguf" for i in (1, 2, 3)]


def _repo_files() -> dict[str, bytes]:
    files = {
        "README.md": b"# a model\n",
        "m-Q8_0.gguf": _blob("q8"),
        "m-IQ4_XS.gguf": _blob("iq4"),
        "mmproj-m-F16.gguf": _blob("mm16"),
        "mmproj-m-Q8_0.gguf": _blob("mm8"),
        "sub/m-Q6_K.gguf": _blob("q6"),
        "imatrix.gguf": _blob("imat"),
    }
    files.update({p: _blob(f"part{i}", 50_000 + i) for i, p in enumerate(SPLIT)})
    return files


def _tree(root: Path) -> dict[str, str]:
    """Every entry under ``root``: a link's target, a file's sha256, "dir" for a
    directory."""
    out = {}
    for p in sorted(root.rglob("*")):
        rel = p.relative_to(root).as_posix()
        if p.is_symlink():
            out[rel] = "-> " + os.readlink(p)
        elif p.is_dir():
            out[rel] = "dir"
        else:
            out[rel] = _sha(p.read_bytes())
    return out


def _repo_dir(cache: Path, repo: str = "o/r") -> Path:
    return cache / ("models--" + repo.replace("/", "--"))


# --- the first fetch and the cache --------------------------------------------------


def test_a_fetch_writes_the_hub_layout_that_resolve_finds(hub: Hub, tmp_path: Path) -> None:
    hub.add("o/r", _repo_files())
    got = fetch("o/r:Q8_0", **FAST)
    repo_dir = _repo_dir(tmp_path / "cache")
    snap = repo_dir / "snapshots" / COMMIT
    assert (repo_dir / "refs" / "main").read_text() == COMMIT
    assert got.model == snap / "m-Q8_0.gguf" and got.mmproj == snap / "mmproj-m-Q8_0.gguf"  # nearest bits
    for name in ("m-Q8_0.gguf", "mmproj-m-Q8_0.gguf"):
        data = _repo_files()[name]
        assert os.readlink(snap / name) == f"../../blobs/{_sha(data)}"
        assert (snap / name).read_bytes() == data
    assert sorted(p.name for p in (repo_dir / "blobs").iterdir()) == sorted(
        _sha(_repo_files()[n]) for n in ("m-Q8_0.gguf", "mmproj-m-Q8_0.gguf"))  # no .etag, no partial
    assert hub.paths()[:2] == ["GET /api/models/o/r/refs", f"GET /api/models/o/r/tree/{COMMIT}"]
    assert hub.requests[1].path.endswith("?recursive=true")
    assert hub.paths()[2:6] == [f"HEAD /o/r/resolve/{COMMIT}/m-Q8_0.gguf", f"HEAD /cdn/{_sha(_blob('q8'))}",
                                f"GET /o/r/resolve/{COMMIT}/m-Q8_0.gguf", f"GET /cdn/{_sha(_blob('q8'))}"]
    # what a later start (or llama-server) reads
    assert resolve("o/r:Q8_0") == got.model and find_mmproj(got.model, "o/r:Q8_0") == got.mmproj


def test_a_second_fetch_asks_nothing(hub: Hub) -> None:
    hub.add("o/r", _repo_files())
    first = fetch("o/r:Q8_0", **FAST)
    n = len(hub.requests)
    assert fetch("o/r:Q8_0", **FAST) == first
    assert len(hub.requests) == n


def test_a_split_model_brings_every_part(hub: Hub, tmp_path: Path) -> None:
    hub.add("o/r", _repo_files())
    got = fetch("o/r:Q4_K_M", mmproj=False, **FAST)
    snap = _repo_dir(tmp_path / "cache") / "snapshots" / COMMIT
    assert got.model == snap / SPLIT[0] and got.mmproj is None
    assert [(snap / p).read_bytes() for p in SPLIT] == [_repo_files()[p] for p in SPLIT]
    assert len(hub.downloads()) == 2 * 3  # resolve + CDN for each part
    # a part missing from the snapshot: listed again, nothing downloaded (its blob is there)
    (snap / SPLIT[1]).unlink()
    n = len(hub.requests)
    assert fetch("o/r:Q4_K_M", mmproj=False, **FAST) == got
    assert hub.paths()[n:] == ["GET /api/models/o/r/refs", f"GET /api/models/o/r/tree/{COMMIT}"]
    assert (snap / SPLIT[1]).read_bytes() == _repo_files()[SPLIT[1]]


def test_the_projector_only_when_wanted(hub: Hub, tmp_path: Path) -> None:
    hub.add("o/r", _repo_files())
    got = fetch("o/r:IQ4_XS", mmproj=False, **FAST)
    assert got.mmproj is None
    assert not any("mmproj" in p for p in hub.paths())
    hub.add("p/q", {"m-F16.gguf": _blob("f16"), "mmproj-F32.gguf": _blob("f32"), "mmproj-F16.gguf": _blob("mf16")})
    assert fetch("p/q", **FAST).mmproj == _repo_dir(tmp_path / "cache", "p/q") / "snapshots" / COMMIT / \
        "mmproj-F16.gguf"


@pytest.mark.parametrize(("spec", "hf_file", "want"), [
    ("o/r", None, "m-Q8_0.gguf"),  # no tag: Q4_K_M (only a split one here: its first part, below), then Q8_0
    ("o/r:q6_k", None, "sub/m-Q6_K.gguf"),  # a tag in any case, in a subdirectory
    ("o/r:IQ4_XS", None, "m-IQ4_XS.gguf"),
    ("o/r:Q4_K_M", None, SPLIT[0]),
    ("o/r", "sub/m-Q6_K.gguf", "sub/m-Q6_K.gguf"),  # -hff
    ("o/r:Q8_0", "m-IQ4_XS.gguf", "m-IQ4_XS.gguf"),  # -hff over the tag
])
def test_which_file(hub: Hub, tmp_path: Path, spec: str, hf_file: str | None, want: str) -> None:
    files = _repo_files()
    if spec == "o/r" and hf_file is None:
        files = {k: v for k, v in files.items() if not k.startswith("Q4_K_M/")}
    hub.add("o/r", files)
    got = fetch(spec, hf_file, mmproj=False, **FAST)
    assert got.model == _repo_dir(tmp_path / "cache") / "snapshots" / COMMIT / want
    assert got.model.read_bytes() == files[want]


# --- failures: one line each ---------------------------------------------------------


def test_a_repository_that_is_not_there(hub: Hub) -> None:
    with pytest.raises(HubError, match=r"repository o/nope not found at .*HTTP 404: Repository not found") as caught:
        fetch("o/nope:Q8_0", **FAST)
    assert caught.value.status == 404 and "\n" not in str(caught.value)
    assert hub.paths() == ["GET /api/models/o/nope/refs"]


def test_no_file_for_the_quant_lists_the_repository(hub: Hub, tmp_path: Path) -> None:
    hub.add("o/r", _repo_files())
    with pytest.raises(HubError) as caught:
        fetch("o/r:Q5_K_S", **FAST)
    text = str(caught.value)
    assert "no GGUF model file for quant Q5_K_S in repository o/r" in text and "\n" not in text
    assert "m-Q8_0.gguf" in text and "mmproj-m-F16.gguf" in text and "README" not in text
    assert len(hub.requests) == 2 and hub.downloads() == []
    with pytest.raises(HubError, match="no file nope.gguf in repository o/r"):
        fetch("o/r", "nope.gguf", **FAST)


def test_the_network_down(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {"MODEL_ENDPOINT": f"http://127.0.0.1:{port}", "LLAMA_CACHE": str(tmp_path / "cache")}
    PAUSES.clear()
    with pytest.raises(HubError, match=r"cannot list repository o/r: .*failed after 2 attempts: ConnectError") as c:
        fetch("o/r:Q8_0", env=env, attempts=2, **FAST)
    assert "--offline" in str(c.value) and PAUSES == [0.01]


def test_an_unwritable_cache(hub: Hub, tmp_path: Path) -> None:
    hub.add("o/r", _repo_files())
    (tmp_path / "file").write_text("not a directory")
    env = {"MODEL_ENDPOINT": hub.endpoint, "LLAMA_CACHE": str(tmp_path / "file" / "cache")}
    with pytest.raises(HubError, match="cannot write the cache at .*file/cache/models--o--r"):
        fetch("o/r:Q8_0", env=env, **FAST)


def test_the_token(hub: Hub) -> None:
    hub.add("o/r", _repo_files())
    fetch("o/r:Q8_0", mmproj=False, token=TOKEN, **FAST)
    hub_side = [r for r in hub.requests if not r.path.startswith("/cdn/")]
    assert hub_side and all(r.headers["authorization"] == f"Bearer {TOKEN}" for r in hub_side)
    # the CDN is another origin: the token is not sent there
    assert all("authorization" not in r.headers for r in hub.requests if r.path.startswith("/cdn/"))
    # a token not shaped as the hub's: the API gets none (llama.cpp's is_valid_hf_token), the files do
    hub.requests.clear()
    fetch("o/r:IQ4_XS", mmproj=False, token="secret", **FAST)
    assert all("authorization" not in r.headers for r in hub.requests if r.path.startswith("/api/"))
    assert all(r.headers["authorization"] == "Bearer secret" for r in hub.requests if "/resolve/" in r.path)


def test_split_names_and_repo_ids() -> None:
    assert split_info("a/m-Q4_K_M-00002-of-00003.gguf") == ("a/m-Q4_K_M", 2, 3)
    assert split_info("m-Q8_0.gguf") == ("m-Q8_0", 1, 1) and split_info("README.md") is None
    assert split_parts(["x-00001-of-00002.gguf", "y-00002-of-00002.gguf", "x-00002-of-00002.gguf"],
                       "x-00001-of-00002.gguf") == ["x-00001-of-00002.gguf", "x-00002-of-00002.gguf"]
    assert valid_repo_id("ggml-org/gemma-3-4b-it-GGUF") and valid_repo_id("a_b/c.d")
    assert not valid_repo_id("a/b/c") and not valid_repo_id("a//b") and not valid_repo_id("a/-b")
    assert not valid_repo_id("a/b..c") and not valid_repo_id("a b/c")


# --- through trio-llm serve ----------------------------------------------------------


def test_parsing_defers_the_download_and_offline_is_cache_only(hub: Hub) -> None:
    hub.add("o/r", _repo_files())
    config = parse_config(["-hf", "o/r:Q8_0"])
    assert config.model is None and config.alias == "o/r:Q8_0"
    with pytest.raises(NotCached, match="nothing is downloaded: put the file there or use -m"):
        parse_config(["-hf", "o/r:Q8_0", "--offline"])
    assert hub.requests == []
    got = fetch("o/r:Q8_0", **FAST)
    n = len(hub.requests)
    for flags in ([], ["--offline"]):
        config = parse_config(["-hf", "o/r:Q8_0", *flags])
        assert (config.model, config.mmproj) == (got.model, got.mmproj)
    assert parse_config(["-hf", "o/r:Q8_0", "--no-mmproj"]).mmproj is None
    assert len(hub.requests) == n


async def test_serve_downloads_at_startup(hub: Hub, tiny_model: Path, tmp_path: Path) -> None:
    import httpx

    hub.add("o/r", {"tiny-Q8_0.gguf": tiny_model.read_bytes()})
    config = parse_config(["--port", "0", "--backend", "numpy", "--no-warmup", "-c", "256", "-hf", "o/r:Q8_0",
                           "-hft", TOKEN])
    async with trio.open_nursery() as nursery:
        handle = await nursery.start(serve, config)
        with trio.fail_after(120):
            await handle.context.loaded.wait()
        async with httpx.AsyncClient(base_url=handle.url, timeout=60) as c:
            props = (await c.get("/props")).json()
        handle.shutdown()
    assert props["model_path"] == str(_repo_dir(tmp_path / "cache") / "snapshots" / COMMIT / "tiny-Q8_0.gguf")
    assert len(hub.downloads()) == 2 and hub.requests[0].headers["authorization"] == f"Bearer {TOKEN}"


@pytest.mark.parametrize("case", ["404", "quant"])
def test_a_failed_start_is_one_line(hub: Hub, case: str) -> None:
    hub.add("o/r", _repo_files())
    spec = "o/nope:Q8_0" if case == "404" else "o/r:Q3_K_S"
    r = subprocess.run([sys.executable, "-m", "trio_llm", "serve", "--port", "0", "--backend", "numpy", "-hf", spec],
                       capture_output=True, text=True, timeout=120, env=dict(os.environ))
    lines = [ln for ln in r.stderr.strip().splitlines() if not ln.startswith("trio-llm: listening on ")]
    assert r.returncode == 1 and len(lines) == 1 and lines[0].startswith("trio-llm serve: error: "), r.stderr
    assert ("404" if case == "404" else "Q3_K_S") in lines[0]


# --- llama.cpp as the reference ------------------------------------------------------

_LLAMA = """
import json, os, sys, xllamacpp
args = json.loads(sys.argv[1])
p = xllamacpp.CommonParams()
p.model.hf_repo = args["spec"]
p.model.hf_file = args.get("hf_file") or ""
p.model.path = "/not-used.gguf"  # xllamacpp wants one; llama.cpp's -hf replaces it
p.offline = args.get("offline", False)
p.no_mmproj = args.get("no_mmproj", False)
p.n_ctx, p.n_parallel, p.warmup, p.verbosity = 256, 1, False, -1
p.cpuparams.n_threads = p.cpuparams_batch.n_threads = 1
try:
    s = xllamacpp.Server(p)
except Exception as exc:
    print(json.dumps({"loaded": False, "error": str(exc)}), flush=True)
else:
    print(json.dumps({"loaded": True}), flush=True)
os._exit(0)  # the server's shutdown is not what is tested
"""


def _llama(hub: Hub, cache: Path, spec: str, **kw: Any) -> dict[str, Any]:
    """llama-server's -hf (xllamacpp, in a child process) with ``cache`` as LLAMA_CACHE."""
    pytest.importorskip("xllamacpp")
    env = dict(os.environ, MODEL_ENDPOINT=hub.endpoint, LLAMA_CACHE=str(cache))
    r = subprocess.run([sys.executable, "-c", _LLAMA, json.dumps({"spec": spec, **kw})], capture_output=True,
                       text=True, timeout=120, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    return dict(json.loads(r.stdout.strip().splitlines()[-1]))


def test_llama_cpp_writes_the_cache_we_read_without_a_request(hub: Hub, tiny_model: Path, tmp_path: Path) -> None:
    files = {"tiny-Q8_0.gguf": tiny_model.read_bytes(), "README.md": b"# tiny\n"}
    hub.add("o/r", files)
    theirs = tmp_path / "theirs"
    assert _llama(hub, theirs, "o/r:Q8_0")["loaded"]
    assert hub.paths()[:2] == ["GET /api/models/o/r/refs", f"GET /api/models/o/r/tree/{COMMIT}"]
    n = len(hub.requests)
    env = {"LLAMA_CACHE": str(theirs), "MODEL_ENDPOINT": hub.endpoint}
    snap = _repo_dir(theirs) / "snapshots" / COMMIT
    assert fetch("o/r:Q8_0", env=env, **FAST).model == snap / "tiny-Q8_0.gguf"
    assert parse_config(["-hf", "o/r:Q8_0"], env).model == snap / "tiny-Q8_0.gguf"
    assert len(hub.requests) == n
    # the same layout as ours, link for link
    ours = tmp_path / "ours"
    fetch("o/r:Q8_0", env={"LLAMA_CACHE": str(ours), "MODEL_ENDPOINT": hub.endpoint}, **FAST)
    assert _tree(ours) == _tree(theirs)


def test_llama_cpp_uses_our_cache_without_a_download(hub: Hub, tiny_model: Path, tmp_path: Path) -> None:
    hub.add("o/r", {"tiny-Q8_0.gguf": tiny_model.read_bytes()})
    fetch("o/r:Q8_0", **FAST)
    hub.requests.clear()
    assert _llama(hub, tmp_path / "cache", "o/r:Q8_0")["loaded"]
    # online, llama-server lists the repository at every start, and downloads nothing
    assert hub.paths() == ["GET /api/models/o/r/refs", f"GET /api/models/o/r/tree/{COMMIT}"]
    hub.requests.clear()
    assert _llama(hub, tmp_path / "cache", "o/r:Q8_0", offline=True)["loaded"]
    assert hub.requests == []


@pytest.mark.parametrize(("spec", "hf_file", "no_mmproj"), [
    ("o/r:Q4_K_M", None, False),  # a split model, and the projector nearest its bits
    ("o/r", None, False),  # no tag: the first part of the Q4_K_M split
    ("o/r:Q8_0", None, True),  # --no-mmproj
    ("o/r", "sub/m-Q6_K.gguf", False),  # -hff in a subdirectory: a projector above it
])
def test_llama_cpp_fetches_the_same_files(hub: Hub, tmp_path: Path, spec: str, hf_file: str | None,
                                          no_mmproj: bool) -> None:
    """Stand-in files llama.cpp cannot load: its download (done before the load) is
    what is compared."""
    hub.add("o/r", _repo_files())
    _llama(hub, tmp_path / "theirs", spec, hf_file=hf_file, no_mmproj=no_mmproj)
    theirs_asked = sorted(p for p in hub.downloads() if p.startswith("GET /o/r/resolve/"))
    hub.requests.clear()
    fetch(spec, hf_file, mmproj=not no_mmproj,
          env={"LLAMA_CACHE": str(tmp_path / "ours"), "MODEL_ENDPOINT": hub.endpoint}, **FAST)
    assert sorted(p for p in hub.downloads() if p.startswith("GET /o/r/resolve/")) == theirs_asked
    assert _tree(tmp_path / "ours") == _tree(tmp_path / "theirs")

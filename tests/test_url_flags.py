"""-mu/--model-url and --mmproj-url through ``trio-llm serve``: the files come from a
real HTTP server on loopback (``model/download.py`` is tested on its own in
tests/test_download.py), to -m / --mmproj's path or to $LLAMA_CACHE's file of the
URL's name, as llama-server; a projector is not fetched for a text model that takes
no image here; a download that fails stops the start in one line."""

from __future__ import annotations

import hashlib
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from test_download import QuietHandler
from trio_llm.runtime import parse_config, serve
from trio_llm.vision.synth import write_mmproj


class _Files(QuietHandler):
    root: Path
    log: list[tuple[str, str]]

    def _answer(self, body: bool) -> None:
        self.log.append((self.command, self.path.split("?")[0]))
        f = self.root / self.path.split("?")[0].lstrip("/")
        if not f.is_file():
            self.send_response(404)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        data = f.read_bytes()
        self.send_response(200)
        self.send_header("ETag", '"' + hashlib.sha256(data).hexdigest()[:16] + '"')
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if body:
            self.wfile.write(data)


@pytest.fixture
def site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[str, Path, list[tuple[str, str]]]]:
    for var in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy"):
        monkeypatch.delenv(var, raising=False)
    root = tmp_path / "site"
    root.mkdir()
    log: list[tuple[str, str]] = []
    handler = type("H", (_Files,), {"root": root, "log": log})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, args=(0.01,), daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", root, log
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


async def _serve_once(argv: list[str], env: dict[str, str]) -> dict[str, Any]:
    """Start a server from ``argv`` (numpy, port 0), wait for the model, return /props."""
    config = parse_config(["--port", "0", "--backend", "numpy", "--no-warmup", "-c", "256", *argv], env)
    async with trio.open_nursery() as nursery:
        handle = await nursery.start(serve, config)
        with trio.fail_after(120):
            await handle.context.loaded.wait()
        async with httpx.AsyncClient(base_url=handle.url, timeout=60) as c:
            props = (await c.get("/props")).json()
            r = await c.post("/completion", json={"prompt": "hi", "n_predict": 2})
            assert r.status_code == 200, r.text
        handle.shutdown()
    return dict(props)


async def test_a_model_from_its_url(site: tuple[str, Path, list[tuple[str, str]]], tiny_model: Path,
                                    tmp_path: Path) -> None:
    base, root, log = site
    (root / "m").mkdir()
    (root / "m" / "tiny.gguf").write_bytes(tiny_model.read_bytes())
    dest = tmp_path / "models" / "mine.gguf"
    props = await _serve_once(["-mu", f"{base}/m/tiny.gguf", "-m", str(dest)], {})
    assert dest.read_bytes() == tiny_model.read_bytes() and props["model_path"] == str(dest)
    assert log.count(("GET", "/m/tiny.gguf")) == 1
    await _serve_once(["-mu", f"{base}/m/tiny.gguf", "-m", str(dest)], {})  # the same ETag: no GET
    assert log.count(("GET", "/m/tiny.gguf")) == 1 and log.count(("HEAD", "/m/tiny.gguf")) == 2
    # without -m: $LLAMA_CACHE's file of the URL's name (query and fragment left out)
    cache = tmp_path / "cache"
    props = await _serve_once(["--model-url", f"{base}/m/tiny.gguf?download=true"], {"LLAMA_CACHE": str(cache)})
    assert props["model_path"] == str(cache / "tiny.gguf") and (cache / "tiny.gguf").is_file()
    # --offline: the local file, and not a request
    n = len(log)
    await _serve_once(["-mu", f"{base}/m/tiny.gguf", "-m", str(dest), "--offline"], {})
    assert len(log) == n


async def test_a_projector_from_its_url_only_where_images_are_taken(
        site: tuple[str, Path, list[tuple[str, str]]], model_path: Any, tmp_path: Path) -> None:
    from trio_llm.model.gguf import load_gguf

    base, root, log = site
    gemma = model_path("tiny-gemma3", "Q8_0")
    write_mmproj(root / "mmproj.gguf", n_embd_text=load_gguf(gemma).config.n_embd, wtype="f16", seed=3,
                 image_size=64, patch_size=8, n_embd=64, n_ff=128, n_head=4, n_layer=2, n_merge=2)
    dest = tmp_path / "proj.gguf"
    props = await _serve_once(["-m", str(gemma), "--mmproj-url", f"{base}/mmproj.gguf", "--mmproj", str(dest)], {})
    assert props["modalities"]["vision"] and dest.read_bytes() == (root / "mmproj.gguf").read_bytes()
    # a qwen35 text model takes no image here: nothing is fetched, text only (the user's
    # Qwen3.5-4B llama-swap line names both flags)
    n = len(log)
    other = tmp_path / "other.gguf"
    props = await _serve_once(["-m", str(model_path("tiny-qwen35", "Q8_0")), "--mmproj-url", f"{base}/mmproj.gguf",
                               "--mmproj", str(other)], {})
    assert not props["modalities"]["vision"] and not other.exists() and len(log) == n


def test_a_failed_download_is_one_line(site: tuple[str, Path, list[tuple[str, str]]], tmp_path: Path) -> None:
    base, _, _ = site
    r = subprocess.run([sys.executable, "-m", "trio_llm", "serve", "--port", "0", "--backend", "numpy",
                        "-mu", f"{base}/nope.gguf?token=secret", "-m", str(tmp_path / "x.gguf")],
                       capture_output=True, text=True, timeout=120)
    lines = [ln for ln in r.stderr.strip().splitlines() if not ln.startswith("trio-llm: listening on ")]
    assert r.returncode == 1 and len(lines) == 1 and "404" in lines[0], r.stderr
    assert "secret" not in r.stderr and not (tmp_path / "x.gguf").exists()

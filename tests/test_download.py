"""model.download against a real HTTP server on loopback.

``Served`` is what the server does (its bytes, ETag, Accept-Ranges, failures, a cut or
a stall mid-body) and what it was asked (``requests``, with their headers); tests
change it between calls. Nothing leaves the machine.
"""

from __future__ import annotations

import logging
import random
import socket
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import attrs
import pytest

from trio_llm import __version__
from trio_llm.errors import ConfigError, ModelLoadError
from trio_llm.model.download import (
    DownloadError,
    cache_dir,
    default_path,
    download,
    masked_url,
    resume_offset,
    use_cached,
)

DATA = random.Random(0).randbytes(300_000)
#: every wait between attempts, in order: ``download``'s ``pause`` here (its default is
#: trio's sleep from a worker thread; these tests call it from plain threads)
PAUSES: list[float] = []
FAST = {"retry_delay": 0.01, "timeout": 5.0, "pause": PAUSES.append}


@attrs.frozen
class Request:
    method: str
    path: str
    headers: dict[str, str]  # lower-case names


@attrs.define
class Served:
    data: bytes = DATA
    etag: str | None = '"v1"'
    accept_ranges: str | None = "bytes"
    honour_range: bool = True  # False: a Range header is ignored (200, the whole file)
    status: int | None = None  # every request answers this, empty
    head_status: int | None = None  # HEAD answers this
    fail_gets: int = 0  # the next N GETs answer fail_status
    fail_status: int = 500
    cuts: int = 0  # the next N GETs stop after cut_after body bytes...
    cut_after: int = 100_000
    stall: bool = False  # ...and then hang (until the test ends) instead of closing
    get_length: bool = True  # False: GET sends no Content-Length (the body ends at close)
    after_head: Callable[[Served], None] | None = None  # called once a HEAD is answered
    port: int = 0
    requests: list[Request] = attrs.Factory(list)
    released: threading.Event = attrs.Factory(threading.Event)

    def methods(self) -> list[str]:
        return [r.method for r in self.requests]

    def gets(self) -> list[Request]:
        return [r for r in self.requests if r.method == "GET"]


class QuietHandler(BaseHTTPRequestHandler):
    """A test server's handler: no request log; HEAD and GET both go to ``_answer``,
    which sends the body only for GET (test_hf_download and test_url_flags use it too)."""

    def log_message(self, format: str, *args: object) -> None:
        pass

    def do_HEAD(self) -> None:
        self._answer(body=False)

    def do_GET(self) -> None:
        self._answer(body=True)

    def _answer(self, body: bool) -> None:
        raise NotImplementedError


class _Handler(QuietHandler):
    server: _Server

    def _empty(self, status: int, **headers: str) -> None:
        self.send_response(status)
        for k, v in headers.items():
            self.send_header(k, v)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def _answer(self, body: bool) -> None:
        s = self.server.served
        s.requests.append(Request(self.command, self.path, {k.lower(): v for k, v in self.headers.items()}))
        if self.path.startswith("/redirect/"):
            return self._empty(302, Location=self.path.removeprefix("/redirect"))
        if s.status is not None:
            return self._empty(s.status)
        if not body and s.head_status is not None:
            return self._empty(s.head_status)
        if body and s.fail_gets:
            s.fail_gets -= 1
            return self._empty(s.fail_status)
        data, status, extra = s.data, 200, {}
        rng, if_range = self.headers.get("Range"), self.headers.get("If-Range")
        if body and rng and s.honour_range and (if_range is None or if_range == s.etag):
            start = int(rng.removeprefix("bytes=").split("-")[0])
            if start >= len(data):
                return self._empty(416, **{"Content-Range": f"bytes */{len(data)}"})
            data, status = data[start:], 206
            extra["Content-Range"] = f"bytes {start}-{len(s.data) - 1}/{len(s.data)}"
        self.send_response(status)
        for k, v in extra.items():
            self.send_header(k, v)
        if s.etag is not None:
            self.send_header("ETag", s.etag)
        if s.accept_ranges is not None:
            self.send_header("Accept-Ranges", s.accept_ranges)
        if not body or s.get_length:
            self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if not body:
            if s.after_head is not None:
                s.after_head(s)
            return
        if s.cuts:
            s.cuts -= 1
            self.wfile.write(data[:s.cut_after])
            self.wfile.flush()
            if s.stall:
                s.released.wait(10)
            return  # HTTP/1.0: the connection closes here
        self.wfile.write(data)


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    served: Served


@pytest.fixture(autouse=True)
def _no_proxy(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy"):
        monkeypatch.delenv(var, raising=False)


@pytest.fixture
def served() -> Iterator[Served]:
    server = _Server(("127.0.0.1", 0), _Handler)
    server.served = Served(port=server.server_address[1])
    thread = threading.Thread(target=server.serve_forever, args=(0.01,), daemon=True)
    thread.start()
    try:
        yield server.served
    finally:
        server.served.released.set()
        server.shutdown()
        server.server_close()
        thread.join(5)


@pytest.fixture
def url(served: Served) -> str:
    return f"http://127.0.0.1:{served.port}/models/model.gguf"


def _partial(path: Path) -> Path:
    return path.with_name(path.name + ".downloadInProgress")


def _etag(path: Path) -> str:
    return path.with_name(path.name + ".etag").read_text()


# --- the first download and the cache ---------------------------------------------


def test_first_download_writes_the_file_and_its_etag(served: Served, url: str, tmp_path: Path) -> None:
    path = tmp_path / "a" / "b" / "model.gguf"
    assert download(url, path, **FAST) == path
    assert path.read_bytes() == DATA
    assert _etag(path) == '"v1"'
    assert not _partial(path).exists()
    assert served.methods() == ["HEAD", "GET"]
    for r in served.requests:
        assert r.headers["user-agent"] == f"trio-llm/{__version__}"
        assert r.headers["accept-encoding"] == "identity"
        assert "authorization" not in r.headers
        assert "range" not in r.headers


def test_same_etag_uses_the_cached_file_without_a_get(served: Served, url: str, tmp_path: Path) -> None:
    path = tmp_path / "model.gguf"
    download(url, path, **FAST)
    served.requests.clear()
    served.data = b"a different file with the same etag"
    assert download(url, path, **FAST) == path
    assert path.read_bytes() == DATA
    assert served.methods() == ["HEAD"]


def test_a_changed_etag_downloads_again(served: Served, url: str, tmp_path: Path) -> None:
    path = tmp_path / "model.gguf"
    download(url, path, **FAST)
    served.data, served.etag = b"version two" * 1000, '"v2"'
    served.requests.clear()
    download(url, path, **FAST)
    assert path.read_bytes() == b"version two" * 1000
    assert _etag(path) == '"v2"'
    assert served.methods() == ["HEAD", "GET"]


def test_a_file_without_its_etag_sidecar_is_downloaded_again(served: Served, url: str, tmp_path: Path) -> None:
    path = tmp_path / "model.gguf"
    path.write_bytes(b"put there by hand")
    download(url, path, **FAST)
    assert path.read_bytes() == DATA
    assert _etag(path) == '"v1"'


def test_no_etag_on_the_server_uses_the_cached_file(served: Served, url: str, tmp_path: Path) -> None:
    path = tmp_path / "model.gguf"
    served.etag = None
    download(url, path, **FAST)
    assert not path.with_name("model.gguf.etag").exists()
    served.data = b"changed, but nothing says so"
    served.requests.clear()
    download(url, path, **FAST)
    assert path.read_bytes() == DATA
    assert served.methods() == ["HEAD"]


@pytest.mark.parametrize("head_status", [404, 500])
def test_a_failing_head_uses_the_cached_file(served: Served, url: str, tmp_path: Path, head_status: int) -> None:
    path = tmp_path / "model.gguf"
    path.write_bytes(b"cached")
    served.head_status = head_status
    assert download(url, path, **FAST) == path
    assert path.read_bytes() == b"cached"
    assert served.methods() == ["HEAD"]  # no retries, no GET


def test_no_server_at_all_uses_the_cached_file(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    path = tmp_path / "model.gguf"
    path.write_bytes(b"cached")
    assert download(f"http://127.0.0.1:{port}/model.gguf", path, **FAST) == path
    with pytest.raises(DownloadError, match="HEAD failed after 2 attempts: ConnectError"):
        download(f"http://127.0.0.1:{port}/model.gguf", tmp_path / "other.gguf", attempts=2, **FAST)


def test_a_head_404_without_a_file_fails_at_once(served: Served, url: str, tmp_path: Path) -> None:
    served.status = 404
    with pytest.raises(DownloadError) as caught:
        download(url, tmp_path / "model.gguf", retry_delay=5.0, pause=PAUSES.append)
    assert caught.value.status == 404
    assert isinstance(caught.value, ModelLoadError)
    assert served.methods() == ["HEAD"]


def test_a_head_500_without_a_file_is_retried(served: Served, url: str, tmp_path: Path) -> None:
    served.head_status = 500
    with pytest.raises(DownloadError, match="HEAD failed after 3 attempts: HTTP 500"):
        download(url, tmp_path / "model.gguf", **FAST)
    assert served.methods() == ["HEAD"] * 3


def test_offline_uses_the_file_and_asks_nothing(served: Served, url: str, tmp_path: Path) -> None:
    path = tmp_path / "model.gguf"
    path.write_bytes(b"cached")
    assert download(url, path, offline=True) == path
    with pytest.raises(DownloadError, match="offline") as caught:
        download(url, tmp_path / "missing.gguf", offline=True)
    assert str(tmp_path / "missing.gguf") in str(caught.value)
    assert served.requests == []


def test_redirects_are_followed(served: Served, url: str, tmp_path: Path) -> None:
    path = tmp_path / "model.gguf"
    download(url.replace("/models/", "/redirect/models/"), path, token="hf_x", **FAST)
    assert path.read_bytes() == DATA
    assert served.methods() == ["HEAD", "HEAD", "GET", "GET"]
    assert _etag(path) == '"v1"'


# --- interrupted downloads ---------------------------------------------------------


def test_a_cut_body_leaves_the_partial_and_the_next_call_resumes(served: Served, url: str, tmp_path: Path) -> None:
    path = tmp_path / "model.gguf"
    served.cuts = 1
    with pytest.raises(DownloadError, match="after 1 attempts"):
        download(url, path, attempts=1, **FAST)
    assert not path.exists()
    assert _partial(path).read_bytes() == DATA[:100_000]
    served.requests.clear()
    download(url, path, attempts=1, **FAST)
    assert path.read_bytes() == DATA
    assert not _partial(path).exists()
    (get,) = served.gets()
    assert get.headers["range"] == "bytes=100000-"
    assert get.headers["if-range"] == '"v1"'


@pytest.mark.parametrize("accept_ranges", [None, "none"])
def test_without_range_support_a_partial_is_started_over(
        served: Served, url: str, tmp_path: Path, accept_ranges: str | None) -> None:
    path = tmp_path / "model.gguf"
    served.accept_ranges = accept_ranges
    served.cuts = 1
    download(url, path, **FAST)  # the second attempt starts over
    assert path.read_bytes() == DATA
    assert [g.headers.get("range") for g in served.gets()] == [None, None]


def test_a_cut_within_one_call_is_resumed_by_the_next_attempt(served: Served, url: str, tmp_path: Path) -> None:
    path = tmp_path / "model.gguf"
    served.cuts, served.cut_after = 2, 50_000
    download(url, path, **FAST)
    assert path.read_bytes() == DATA
    assert [g.headers.get("range") for g in served.gets()] == [None, "bytes=50000-", "bytes=100000-"]


def test_a_server_that_ignores_the_range_starts_the_partial_over(served: Served, url: str, tmp_path: Path) -> None:
    path = tmp_path / "model.gguf"
    _partial(path).write_bytes(b"x" * 1000)
    served.honour_range = False
    download(url, path, attempts=1, **FAST)
    assert path.read_bytes() == DATA
    assert served.gets()[0].headers["range"] == "bytes=1000-"


def test_a_partial_of_an_older_version_is_not_resumed(served: Served, url: str, tmp_path: Path) -> None:
    path = tmp_path / "model.gguf"
    served.cuts = 1
    with pytest.raises(DownloadError):
        download(url, path, attempts=1, **FAST)
    assert path.with_name("model.gguf.downloadInProgress.etag").read_text() == '"v1"'
    served.data, served.etag = DATA[::-1], '"v2"'
    served.requests.clear()
    download(url, path, attempts=1, **FAST)
    assert path.read_bytes() == DATA[::-1]
    assert "range" not in served.gets()[0].headers
    assert not path.with_name("model.gguf.downloadInProgress.etag").exists()
    assert _etag(path) == '"v2"'


def test_a_change_between_head_and_get_restarts_through_if_range(served: Served, url: str, tmp_path: Path) -> None:
    path = tmp_path / "model.gguf"
    _partial(path).write_bytes(DATA[:1000])  # no sidecar: as llama.cpp leaves one

    def update(s: Served) -> None:
        s.data, s.etag = DATA[::-1], '"v2"'

    served.after_head = update
    download(url, path, attempts=1, **FAST)
    (get,) = served.gets()
    assert (get.headers["range"], get.headers["if-range"]) == ("bytes=1000-", '"v1"')
    assert path.read_bytes() == DATA[::-1]  # the 200 started it over
    assert _etag(path) == '"v2"'  # the version the GET sent


def test_a_partial_as_long_as_the_file_is_started_over(served: Served, url: str, tmp_path: Path) -> None:
    path = tmp_path / "model.gguf"
    _partial(path).write_bytes(b"y" * (len(DATA) + 5))
    download(url, path, attempts=1, **FAST)
    assert path.read_bytes() == DATA
    assert "range" not in served.gets()[0].headers


def test_a_stall_mid_body_times_out_and_resumes(served: Served, url: str, tmp_path: Path) -> None:
    path = tmp_path / "model.gguf"
    served.cuts, served.stall = 1, True
    with pytest.raises(DownloadError, match="ReadTimeout"):
        download(url, path, attempts=1, retry_delay=0.01, timeout=0.3, pause=PAUSES.append)
    assert _partial(path).stat().st_size == 100_000
    download(url, path, attempts=1, **FAST)
    assert path.read_bytes() == DATA


def test_a_short_body_fails_the_size_check_and_keeps_the_partial(served: Served, url: str, tmp_path: Path) -> None:
    path = tmp_path / "model.gguf"
    served.get_length, served.cuts = False, 1  # the body ends early at a clean close
    with pytest.raises(DownloadError, match=f"got 100000 bytes of {len(DATA)}"):
        download(url, path, attempts=1, **FAST)
    assert not path.exists()
    assert _partial(path).stat().st_size == 100_000
    download(url, path, attempts=1, **FAST)
    assert path.read_bytes() == DATA


def test_the_file_appears_only_when_complete(served: Served, url: str, tmp_path: Path) -> None:
    path = tmp_path / "model.gguf"
    seen: list[tuple[int, int | None, bool]] = []
    served.cuts = 1
    download(url, path, progress=lambda done, total: seen.append((done, total, path.exists())), **FAST)
    assert not any(exists for _, _, exists in seen)
    assert seen[-1][:2] == (len(DATA), len(DATA))
    # a new version: the old file stays whole at path until the new one replaces it
    served.data, served.etag = b"new" * 50_000, '"v2"'
    seen.clear()
    download(url, path, progress=lambda done, total: seen.append((done, total, path.read_bytes() == DATA)), **FAST)
    assert seen and all(same for _, _, same in seen)
    assert path.read_bytes() == b"new" * 50_000


def test_progress_raising_stops_the_download_and_keeps_the_partial(served: Served, url: str, tmp_path: Path) -> None:
    path = tmp_path / "model.gguf"

    def stop(done: int, total: int | None) -> None:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        download(url, path, progress=stop, **FAST)
    assert not path.exists()
    assert _partial(path).exists()
    assert len(served.gets()) == 1


def test_progress_is_logged_a_few_times(served: Served, url: str, tmp_path: Path,
                                        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="trio_llm.model.download")
    served.data = DATA * 20  # 6 MB: several chunks
    download(url, tmp_path / "model.gguf", **FAST)
    lines = [r.getMessage() for r in caplog.records]
    assert 1 <= sum("%" in line for line in lines) <= 10
    assert lines[-1].startswith("downloaded ")


# --- HTTP failures -----------------------------------------------------------------


def test_a_500_is_retried_then_succeeds(served: Served, url: str, tmp_path: Path) -> None:
    path = tmp_path / "model.gguf"
    served.fail_gets = 2
    download(url, path, **FAST)
    assert path.read_bytes() == DATA
    assert served.methods() == ["HEAD", "GET", "GET", "GET"]


@pytest.mark.parametrize("status", [408, 429, 503])
def test_transient_statuses_are_retried(served: Served, url: str, tmp_path: Path, status: int) -> None:
    served.fail_gets, served.fail_status = 1, status
    download(url, tmp_path / "model.gguf", **FAST)
    assert len(served.gets()) == 2


def test_too_many_failures_are_an_error(served: Served, url: str, tmp_path: Path) -> None:
    served.fail_gets = 3
    with pytest.raises(DownloadError, match="download failed after 3 attempts: HTTP 500"):
        download(url, tmp_path / "model.gguf", **FAST)
    assert len(served.gets()) == 3


@pytest.mark.parametrize("status", [401, 403, 404])
def test_a_4xx_on_get_fails_at_once(served: Served, url: str, tmp_path: Path, status: int) -> None:
    served.fail_gets, served.fail_status = 99, status
    t0 = time.monotonic()
    with pytest.raises(DownloadError, match=f"HTTP {status}") as caught:
        download(url, tmp_path / "model.gguf", retry_delay=2.0, pause=PAUSES.append)
    assert time.monotonic() - t0 < 1.5
    assert caught.value.status == status
    assert len(served.gets()) == 1


def test_the_bearer_token_is_sent(served: Served, url: str, tmp_path: Path) -> None:
    download(url, tmp_path / "model.gguf", token="hf_secret", **FAST)
    assert [r.headers["authorization"] for r in served.requests] == ["Bearer hf_secret"] * 2


def test_a_query_string_is_masked_in_errors_and_logs(served: Served, url: str, tmp_path: Path,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="trio_llm.model.download")
    served.fail_gets = 99
    with pytest.raises(DownloadError) as caught:
        download(url + "?token=SECRET&x=1", tmp_path / "model.gguf", **FAST)
    assert "SECRET" not in str(caught.value)
    assert "/models/model.gguf?****" in str(caught.value)
    assert "SECRET" not in caplog.text
    served.status = 404
    with pytest.raises(DownloadError) as caught:
        download(url.replace("http://", "http://me:pw@") + "?sig=SECRET", tmp_path / "m.gguf", **FAST)
    assert "SECRET" not in str(caught.value) and "pw" not in str(caught.value)


# --- names and places --------------------------------------------------------------


def test_masked_url() -> None:
    assert masked_url("https://u:p@host:8443/a/b.gguf?x=1#frag") == "https://****:****@host:8443/a/b.gguf?****"
    assert masked_url("http://[::1]/f") == "http://[::1]/f"


def test_default_path_is_the_last_component_in_the_cache(tmp_path: Path) -> None:
    assert default_path("https://h/org/repo/resolve/main/m-Q4_K_M.gguf?download=true#x", tmp_path) == \
        tmp_path / "m-Q4_K_M.gguf"
    assert default_path("http://h/m%20x.gguf", tmp_path) == tmp_path / "m%20x.gguf"
    with pytest.raises(ConfigError):
        default_path("https://h/dir/", tmp_path)


def test_cache_dir_as_llama_cpp() -> None:
    assert cache_dir({"LLAMA_CACHE": "/c", "XDG_CACHE_HOME": "/x", "HOME": "/h"}) == Path("/c")
    assert cache_dir({"XDG_CACHE_HOME": "/x", "HOME": "/h"}) == Path("/x/llama.cpp")
    assert cache_dir({"HOME": "/h"}) == Path("/h/.cache/llama.cpp")


def test_decisions() -> None:
    assert use_cached("", "") and use_cached("", '"a"') and use_cached('"a"', '"a"')
    assert not use_cached('"a"', "") and not use_cached('"a"', '"b"')
    assert resume_offset(None, True, 10) == 0
    assert resume_offset(4, True, 10) == 4
    assert resume_offset(4, True, None) == 4
    assert resume_offset(4, False, 10) == 0
    assert resume_offset(10, True, 10) == 0
    assert resume_offset(4, True, 10, '"a"', '"a"') == 4
    assert resume_offset(4, True, 10, '"a"', '"b"') == 0
    assert resume_offset(4, True, 10, "", '"b"') == 4  # a partial llama.cpp left


async def test_the_default_pause_is_trios_sleep(autojump_clock: object) -> None:
    """The wait between attempts is trio's sleep, from the worker thread ``download`` runs
    on: trio's clock measures it exactly (no wall-clock sleep in src/)."""
    import trio

    from trio_llm.model.download import trio_pause

    t0 = trio.current_time()
    await trio.to_thread.run_sync(trio_pause, 5.0)
    assert trio.current_time() - t0 == 5.0

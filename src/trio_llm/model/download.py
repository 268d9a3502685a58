"""``-mu/--model-url`` and ``--mmproj-url``: one file from a URL into a local path.

The behaviour of llama.cpp's ``common_download_file_single`` (``common/download.cpp``,
October 2026), so that a cache directory filled by llama-server is reused as is and
the other way round:

- offline: the file must already be there, else ``DownloadError``; nothing is asked.
- online: HEAD the URL, redirects followed (Hugging Face answers ``resolve/`` with
  one). A failed HEAD (no answer, or a status other than 2xx) falls back to the local
  file when there is one. With the server's ``ETag`` in hand, an existing file is kept
  as it is when the server sends no ETag or the ``<path>.etag`` sidecar holds the
  same one; otherwise the file is fetched into ``<path>.downloadInProgress``, renamed
  onto ``path`` once complete, and then the sidecar is written (both steps atomic:
  a crash between them costs a re-download, never a stale file taken for new).
- a partial file is resumed with ``Range: bytes=<size>-`` when the HEAD advertised
  ``Accept-Ranges`` other than ``none``, else it is started over; each GET is an
  attempt, ``attempts`` in all, waiting ``retry_delay``, then twice as long, and so
  on between them.

Where this differs from llama.cpp, on purpose:

- The old file stays at ``path`` until the new one replaces it (llama.cpp deletes
  it before downloading): ``path`` is always a whole file, one version or the
  other, at the cost of disk space for both while the new one arrives.
- A partial file is resumed only if it is of the server's version: a fresh one gets
  its own sidecar, ``<path>.downloadInProgress.etag``, and one of another ETag is
  started over (llama.cpp resumes whatever is there, splicing two versions after
  an update; a partial without that sidecar, one llama.cpp left, is resumed as it
  would). A resume also sends ``If-Range`` with a strong ETag, and a ``200`` answer
  (the file changed since the HEAD, or the server ignores ranges) starts the partial
  over; llama.cpp refuses anything but ``206`` for a resume, failing every attempt.
- A size check: the file must have the length the server announced
  (``Content-Length``, or the total of ``Content-Range``), else the attempt failed
  and the partial is kept for the next one.
- A 4xx other than 408/429 ends the download at once; llama.cpp retries every
  failure. The HEAD is retried too when there is no local file to fall back to.
- ``Accept-Encoding: identity``: ranges and lengths count the file's own bytes.

Cancellation: ``progress`` is called after every chunk on the calling thread, and
whatever it raises ends the download (the partial file stays for a resume). From a
``trio.to_thread.run_sync`` worker, ``progress`` can be
``lambda done, total: trio.from_thread.check_cancelled()``.

Every URL in a message or a log line is masked (``masked_url``): a query string or
user information may carry a credential.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from trio_llm import __version__
from trio_llm.errors import ConfigError, ModelLoadError

if TYPE_CHECKING:
    import httpx

log = logging.getLogger(__name__)

PARTIAL_SUFFIX = ".downloadInProgress"
ETAG_SUFFIX = ".etag"
#: without a known size, a progress line every this many bytes
PROGRESS_STEP_UNSIZED = 256 << 20

Progress = Callable[[int, int | None], None]


class DownloadError(ModelLoadError):
    """A file could not be downloaded (or, offline, is not there). ``status`` is the
    HTTP status that ended it, when one did. The message names the local path and the
    masked URL; the CLI prints it as one line and exits 1."""

    def __init__(self, path: object, problem: str, status: int | None = None) -> None:
        self.status = status
        super().__init__(path, problem)


class _Retry(Exception):
    """An attempt failed in a way another attempt may not."""


def masked_url(url: str) -> str:
    """``url`` fit for a log line: user information and the query string masked, the
    fragment dropped (llama.cpp's ``common_http_show_masked_url`` shows no query)."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    try:
        port = parts.port
    except ValueError:
        port = None
    user = "****:****@" if parts.username is not None or parts.password is not None else ""
    query = "?****" if parts.query else ""
    return f"{parts.scheme}://{user}{host}{'' if port is None else f':{port}'}{parts.path}{query}"


def cache_dir(env: Mapping[str, str] | None = None) -> Path:
    """llama.cpp's cache directory (``hf_cache.flat_cache_dir``): where a URL's file goes
    without a path of its own."""
    from trio_llm.model.hf_cache import flat_cache_dir

    return flat_cache_dir(os.environ if env is None else env)


def default_path(url: str, cache: Path) -> Path:
    """Where a URL's file goes without ``-m``: its last path component, without query
    or fragment, in ``cache`` (llama.cpp's ``get_default_local_path``). Not
    percent-decoded, as llama.cpp does not."""
    name = url.split("#", 1)[0].split("?", 1)[0].rsplit("/", 1)[-1]
    if name in ("", ".", ".."):
        raise ConfigError(f"{masked_url(url)}: the URL names no file to save it as")
    return cache / name


def use_cached(server_etag: str, saved_etag: str) -> bool:
    """Whether an existing local file stands for the server's: the server gives no
    ETag to compare with, or the sidecar holds the same one."""
    return not server_etag or server_etag == saved_etag


def resume_offset(partial_size: int | None, ranges: bool, total: int | None,
                  partial_etag: str = "", etag: str = "") -> int:
    """Where the next GET starts: the partial file's end when the server takes ranges,
    the partial is shorter than the whole and of the same version (its recorded ETag is
    the server's, or none was recorded), else 0 (start over)."""
    if not partial_size or not ranges:
        return 0
    if partial_etag and partial_etag != etag:
        return 0
    if total is not None and partial_size >= total:
        return 0
    return partial_size


def retryable(status: int) -> bool:
    """Whether another attempt may fare better after this HTTP error status."""
    return status >= 500 or status in (408, 429)


def trio_pause(seconds: float) -> None:
    """The wait between attempts from a ``trio.to_thread`` worker: trio's own sleep (its
    clock, so a ``MockClock`` governs it; a cancellation ends it)."""
    import trio

    trio.from_thread.run(trio.sleep, seconds)


def download(url: str, path: Path, *, token: str | None = None, offline: bool = False,
             progress: Progress | None = None, attempts: int = 3, retry_delay: float = 1.0,
             timeout: float = 30.0, pause: Callable[[float], None] = trio_pause,
             sidecar: bool = True) -> Path:
    """``url``'s file at ``path`` (returned), fetched only if needed: see the module
    docstring. Blocking: run it on a trio worker thread (``pause`` waits between
    attempts, trio's sleep by default). ``timeout`` bounds each network wait
    (connecting, each read), not the whole download.

    ``sidecar=False`` is for a file whose name says its version (a blob of the Hugging
    Face hub cache, named by its hash): an existing file is used without asking the
    server, and no ``.etag`` sidecar is read or written, as llama.cpp's ``skip_etag``."""
    path = Path(path)
    shown = masked_url(url)
    if offline:
        if path.exists():
            log.debug("using cached file (offline mode): %s", path)
            return path
        raise DownloadError(path, f"not in the cache, and offline mode forbids downloading {shown}")
    if not sidecar and path.exists():
        log.debug("using cached file: %s", path)
        return path
    if urlsplit(url).scheme not in ("http", "https"):
        raise DownloadError(path, f"{shown}: only http and https URLs can be downloaded")
    import httpx

    headers = {"User-Agent": f"trio-llm/{__version__}", "Accept-Encoding": "identity"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    attempts = max(1, attempts)
    with httpx.Client(headers=headers, timeout=timeout, follow_redirects=True) as client:
        head = _head(client, url, path, attempts, retry_delay, pause)
        if head is None:
            return path
        etag = head.headers.get("ETag", "")
        total = _int(head.headers.get("Content-Length"))
        ranges = "Accept-Ranges" in head.headers and head.headers["Accept-Ranges"].strip().lower() != "none"
        if path.exists() and use_cached(etag, _read_etag(path)):
            log.debug("using cached file (%s): %s", "same etag" if etag else "no server etag", path)
            return path
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise DownloadError(path, f"cannot create the directory: {exc.strerror}") from None
        partial = path.with_name(path.name + PARTIAL_SUFFIX)
        why = ""
        for attempt in range(attempts):
            if attempt:
                _wait(pause, retry_delay * 2 ** (attempt - 1), shown, why, attempt, attempts)
            try:
                version = _pull(client, url, path, partial, ranges=ranges, etag=etag,
                                head_total=total, progress=progress, sidecar=sidecar)
            except _Retry as exc:
                why = str(exc)
                continue
            try:
                os.replace(partial, path)
            except OSError as exc:
                raise DownloadError(path, f"cannot rename {partial.name} onto it: {exc.strerror}") from None
            if sidecar:
                _write_etag(path, version)
                _write_etag(partial, "")
            return path
    raise DownloadError(path, f"{shown}: download failed after {attempts} attempts: {why}")


def _head(client: httpx.Client, url: str, path: Path, attempts: int, retry_delay: float,
          pause: Callable[[float], None]) -> httpx.Response | None:
    """The HEAD's answer, or None when it failed and ``path`` exists (use it as is)."""
    import httpx

    shown = masked_url(url)
    why = ""
    for attempt in range(attempts):
        if attempt:
            _wait(pause, retry_delay * 2 ** (attempt - 1), shown, why, attempt, attempts)
        status = None
        try:
            r = client.head(url)
        except httpx.HTTPError as exc:
            why = _describe(exc, url)
        else:
            if 200 <= r.status_code < 300:
                return r
            status = r.status_code
            why = f"HTTP {status}"
        if path.exists():
            log.info("HEAD %s failed (%s): using the cached file %s", shown, why, path)
            return None
        if status is not None and not retryable(status):
            raise DownloadError(path, f"{shown}: HTTP {status}", status)
    raise DownloadError(path, f"{shown}: HEAD failed after {attempts} attempts: {why}")


def _pull(client: httpx.Client, url: str, path: Path, partial: Path, *, ranges: bool,
          etag: str, head_total: int | None, progress: Progress | None, sidecar: bool = True) -> str:
    """One GET into ``partial``, resumed where it can be. Returns, once ``partial`` is
    whole, the ETag of what it holds (the GET's, else the HEAD's); raises ``_Retry``
    for a failure worth another attempt, ``DownloadError`` for one that is not."""
    import httpx

    shown = masked_url(url)
    try:
        size: int | None = partial.stat().st_size
    except FileNotFoundError:
        size = None
    offset = resume_offset(size, ranges, head_total, _read_etag(partial) if sidecar else "", etag)
    headers: dict[str, str] = {}
    if offset:
        headers["Range"] = f"bytes={offset}-"
        if etag and not etag.startswith("W/"):
            headers["If-Range"] = etag
    try:
        with client.stream("GET", url, headers=headers) as r:
            status = r.status_code
            if status == 416:
                partial.unlink(missing_ok=True)
                raise _Retry(f"HTTP 416 for a resume at byte {offset}: starting over")
            if status >= 400:
                if retryable(status):
                    raise _Retry(f"HTTP {status}")
                raise DownloadError(path, f"{shown}: HTTP {status}", status)
            length = _int(r.headers.get("Content-Length"))
            if status == 206 and offset:
                start, total = _content_range(r.headers.get("Content-Range", ""))
                if start is not None and start != offset:
                    partial.unlink(missing_ok=True)
                    raise _Retry(f"asked for byte {offset} on, got {start} on: starting over")
                if total is None and length is not None:
                    total = offset + length
            elif status == 200:
                if offset:
                    log.info("%s: the server sent the whole file, not the rest: starting over", shown)
                offset, total = 0, length
            else:
                raise _Retry(f"unexpected HTTP {status}")
            total = head_total if total is None else total
            version = r.headers.get("ETag") or etag
            _log_start(shown, path, offset, total)
            if not offset:  # emptied first: a crash never leaves old bytes under a new ETag
                partial.unlink(missing_ok=True)
                if sidecar:
                    _write_etag(partial, version)
            done = _receive(r, partial, offset, total, shown, progress)
    except httpx.HTTPError as exc:
        raise _Retry(_describe(exc, url)) from None
    except OSError as exc:
        raise DownloadError(partial, f"cannot write: {exc.strerror or exc}") from None
    if total is not None and done != total:
        if done > total:
            partial.unlink(missing_ok=True)
        raise _Retry(f"got {done} bytes of {total}")
    log.info("downloaded %s (%s)", path, _size(done))
    return version


def _receive(r: httpx.Response, partial: Path, offset: int, total: int | None, shown: str,
             progress: Progress | None) -> int:
    """The body into ``partial`` from ``offset`` on (the file cut there), synced to
    disk; the partial's size after."""
    step = max(total // 10, 1) if total else PROGRESS_STEP_UNSIZED
    next_log = offset + step
    done = offset
    with open(partial, "r+b" if offset else "wb") as f:
        f.seek(offset)
        f.truncate()
        for chunk in r.iter_raw():  # as it arrives: a cut loses nothing received
            f.write(chunk)
            done += len(chunk)
            if done >= next_log and done != total:
                pct = f"{100 * done // total}%, " if total else ""
                log.info("downloading %s: %s%s", shown, pct, _size(done))
                next_log = done + step
            if progress is not None:
                progress(done, total)
        f.flush()
        os.fsync(f.fileno())
    return done


def _wait(pause: Callable[[float], None], seconds: float, shown: str, why: str, attempt: int,
          attempts: int) -> None:
    log.warning("%s: %s; retrying in %.3g s (attempt %d of %d)", shown, why, seconds,
                attempt + 1, attempts)
    pause(seconds)


def _log_start(shown: str, path: Path, offset: int, total: int | None) -> None:
    of = f" of {_size(total)}" if total is not None else ""
    if offset:
        log.info("resuming %s into %s at %s%s", shown, path, _size(offset), of)
    else:
        log.info("downloading %s into %s (%s)", shown, path, _size(total) if total is not None else "size unknown")


def _read_etag(path: Path) -> str:
    """The ETag the sidecar ``<path>.etag`` saved with ``path`` (its first line), or ""."""
    try:
        text = path.with_name(path.name + ETAG_SUFFIX).read_text(encoding="utf-8", errors="replace")
    except FileNotFoundError:
        return ""
    except OSError as exc:
        log.warning("cannot read the etag of %s: %s", path, exc.strerror)
        return ""
    return text.splitlines()[0] if text else ""


def _write_etag(path: Path, etag: str) -> None:
    """The sidecar ``<path>.etag`` for ``path``'s version, replaced atomically; removed
    for "" (no ETag). A failure costs a re-download, so it is logged, not raised."""
    sidecar = path.with_name(path.name + ETAG_SUFFIX)
    tmp = path.with_name(path.name + ETAG_SUFFIX + ".tmp")
    try:
        if not etag:
            sidecar.unlink(missing_ok=True)
            return
        tmp.write_bytes(etag.encode("utf-8"))
        os.replace(tmp, sidecar)
    except OSError as exc:
        log.warning("cannot write the etag of %s: %s", path, exc.strerror)


def _content_range(value: str) -> tuple[int | None, int | None]:
    """``bytes START-END/TOTAL`` as (START, TOTAL); None for what is absent or ``*``."""
    unit, _, spec = value.strip().partition(" ")
    if unit.lower() != "bytes":
        return None, None
    span, _, total = spec.partition("/")
    return _int(span.partition("-")[0]), _int(total)


def _int(value: str | None) -> int | None:
    try:
        n = int(value) if value is not None else None
    except ValueError:
        return None
    return n if n is None or n >= 0 else None


def _describe(exc: Exception, url: str) -> str:
    text = str(exc).replace(url, masked_url(url))
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _size(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB" if n >= 1 << 20 else f"{n} bytes"

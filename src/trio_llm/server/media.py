"""Images in prompts (llama-server's ``--mmproj``, through libmtmd): from the bytes a
request carries to prompt positions holding embedding rows.

A prompt here stays a tuple of ints. The positions of an image hold its *media id*, a
negative number derived from the image's pixels (so two requests sending the same
image share a prompt-cache prefix, as llama-server's chunk ids do), and the request's
``TaskParams.media`` maps each media id to the image's embedding rows
``[n_tokens, n_embd]``. The slots feed such a run to the backend whole, as one
non-causal entry (``SeqBatch(embd=..., causal=False)``): llama.cpp decodes gemma3's
image batch with causal attention off.

Tokenization follows ``mtmd_tokenize`` (tools/mtmd/mtmd.cpp, October 2026): the text is
split at each ``<__media__>`` marker, every text piece is tokenized on its own (specials
parsed, no BOS), each image is written as ``<start_of_image>``, its rows,
``<end_of_image>`` (gemma3's wrapping, tokenized the same way), and one BOS goes in
front when the vocabulary adds one. The count of markers and of images must match.

Cancellation. A request's parse (its images' encodes with it) runs on a worker thread
that is never abandoned: the encoder holds its lock and every core. So that a request
whose client went away does not hold them for the rest of its image (about 30 s for
gemma-3's on a few cores), ``run_sync_cancellable`` sets the parse's cancel event
when the request is cancelled, and the encoder stops at its next check, within one
piece of a transformer block (``vision.siglip``); nothing of it is cached. A parse
that is waiting rather than encoding leaves at once: the event is a
``vision.cancel.CancelEvent``, which wakes the conditions its thread waits on as it
is set, both for the encoder's turn (``siglip``'s ``TurnLock``, one encode at a time)
and for another request's encode of the same image (below). Remote images are
fetched on trio before the parse (``fetch_images``), where a cancellation ends the
download at once.

Shared encodes. Two requests sending the same new image at once encode it once: the
first to find it neither cached nor being encoded records an in-flight entry by
content (the media id) and encodes; one coming while that runs waits on the entry
(not on the encoder's turn, so a request for another image is not held up by it) and
takes the rows when they come, as from the cache. If the encoding request is
cancelled, its entry goes and a waiter takes the encode over, from the start: a
cancellation never stops another request's image, and a waiter never ends in an
error or hangs for it.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import contextvars
import hashlib
import os
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, NoReturn, TypeVar

import attrs
import numpy as np
import outcome
import trio

from trio_llm.errors import ConfigError, EncodeCancelled, InvalidRequest
from trio_llm.vision.cancel import CancelEvent, woken_by
from trio_llm.vision.cancel import check as _check

#: libmtmd's default media marker; llama-server uses it only when LLAMA_MEDIA_MARKER
#: says so (``media_marker``)
MARKER = "<__media__>"
#: gemma3's wrapping of an image (mtmd.cpp: ``img_beg`` / ``img_end``)
IMG_BEG = "<start_of_image>"
IMG_END = "<end_of_image>"
#: encoded images kept, by content (a conversation sends its images again every turn)
CACHE_IMAGES = 16


def media_marker(environ: Mapping[str, str] | None = None) -> str:
    """The marker that stands for an image in a prompt's text: ``LLAMA_MEDIA_MARKER``
    if set, else a random one per process, as llama-server (October 2026,
    ``get_media_marker``) does so that text cannot smuggle a marker in; ``/props``
    reports it (``media_marker``)."""
    env = os.environ if environ is None else environ
    marker = env.get("LLAMA_MEDIA_MARKER")
    if marker is not None:
        if not marker:
            raise ConfigError("LLAMA_MEDIA_MARKER: media_marker must not be empty")
        return marker
    return f"<__media_{secrets.token_hex(8)}__>"


def is_media(token: int) -> bool:
    return token < 0


def media_id(pixels: np.ndarray) -> int:
    """The negative id of an image's positions, from its decoded pixels: 31 bits of a
    SHA-256, so that it is an int32 like a token id (a slot file stores them)."""
    h = hashlib.sha256(repr(pixels.shape).encode() + pixels.tobytes()).digest()
    return -1 - (int.from_bytes(h[:4], "little") & 0x7FFFFFFF)


def decode_base64(text: Any, what: str) -> bytes:
    if not isinstance(text, str):
        raise InvalidRequest(f"{what} must be a base64 string")
    try:
        return base64.b64decode(text, validate=False)
    except (binascii.Error, ValueError):
        raise InvalidRequest(f"{what} is not valid base64") from None


#: llama-server's limits on a remote image (``handle_media``): 10 MB in 10 s
REMOTE_MAX_BYTES = 10 * 1024 * 1024
REMOTE_TIMEOUT_S = 10.0


def _is_remote(url: Any) -> bool:
    return isinstance(url, str) and url.startswith(("http://", "https://"))


def image_url_bytes(url: Any, media_path: Path | None = None, fetched: Mapping[str, bytes] | None = None) -> bytes:
    """The image of an OpenAI ``image_url`` part, as llama-server reads one: a base64
    ``data:`` URL; an ``http(s)://`` URL, taken from ``fetched`` (``fetch_images`` got
    it beforehand, on trio); a ``file://`` path relative to ``--media-path``, only with
    it and never outside it."""
    if not isinstance(url, str) or not url:
        raise InvalidRequest("image_url.url must be a non-empty string")
    if url.startswith("data:"):
        head, sep, data = url.partition(",")
        if not sep or ";base64" not in head:
            raise InvalidRequest("Invalid image_url.url format: a data: URL must be base64 (data:image/...;base64,...)")
        return decode_base64(data, "image_url.url")
    if _is_remote(url):
        if fetched is None or url not in fetched:
            raise RuntimeError("remote images are fetched before the request is parsed (fetch_images)")
        return fetched[url]
    if url.startswith("file://"):
        return _local_file(url[len("file://"):], media_path)
    raise InvalidRequest("Invalid image_url.url value")


def _http_client() -> Any:
    """An ``httpx.AsyncClient`` for one download. Blocking (the import, the TLS context
    reading its CA file): call on a worker thread."""
    import httpx

    from trio_llm import __version__

    return httpx.AsyncClient(timeout=REMOTE_TIMEOUT_S, follow_redirects=True,
                             headers={"User-Agent": f"trio-llm/{__version__}"})


async def fetch_image(url: str) -> bytes:
    """A remote image, as llama-server fetches one: at most ``REMOTE_MAX_BYTES``, the
    whole download within ``REMOTE_TIMEOUT_S``, redirects followed; any failure is a
    400 "Failed to download image". On trio, so a cancelled request ends its download
    at once (a blocking client on a worker thread would run on to its timeout)."""
    client = await trio.to_thread.run_sync(_http_client)
    import httpx  # imported by _http_client

    data = bytearray()
    try:
        async with client:
            with trio.move_on_after(REMOTE_TIMEOUT_S) as deadline:
                async with client.stream("GET", url) as r:
                    if not 200 <= r.status_code < 300:
                        raise InvalidRequest(f"Failed to download image: HTTP {r.status_code}")
                    async for chunk in r.aiter_bytes():
                        data += chunk
                        if len(data) > REMOTE_MAX_BYTES:
                            raise InvalidRequest(f"Failed to download image: larger than {REMOTE_MAX_BYTES} bytes")
    except httpx.HTTPError as exc:
        raise InvalidRequest(f"Failed to download image: {type(exc).__name__}") from None
    if deadline.cancelled_caught:
        raise InvalidRequest(f"Failed to download image: not done within {REMOTE_TIMEOUT_S:g} s")
    return bytes(data)


async def fetch_images(messages: Any) -> dict[str, bytes]:
    """The remote images of OpenAI chat messages (``image_url`` parts with an
    ``http(s)://`` URL), each URL fetched once, one after another: what
    ``extract_images`` takes as ``fetched``."""
    fetched: dict[str, bytes] = {}
    for url in _image_urls(messages):
        if _is_remote(url) and url not in fetched:
            fetched[url] = await fetch_image(url)
    return fetched


def _local_file(rel: str, media_path: Path | None) -> bytes:
    if media_path is None:
        raise InvalidRequest("file:// URLs are not allowed unless --media-path is specified")
    root = media_path.resolve()
    parts = rel.split("/")
    if not rel or rel.startswith("/") or any(p in ("", ".", "..") for p in parts) or "\\" in rel or "\0" in rel:
        raise InvalidRequest("file path is not allowed")
    path = (root / rel).resolve()
    if not path.is_relative_to(root):  # a symlink out of the directory
        raise InvalidRequest("file path is not allowed")
    try:
        return path.read_bytes()
    except OSError:
        raise InvalidRequest("file does not exist or cannot be opened") from None


@attrs.frozen
class MediaStatistics:
    n_encoded: int  # images run through the encoder
    n_cached: int  # images found in its cache, or taken from another request's encode of them
    t_encode: float  # seconds of encoding (worker threads)


@attrs.define(eq=False)
class _Encoding:
    """An image one request is encoding; requests sending it meanwhile wait for
    ``rows`` (under the encoder's condition) instead of encoding it again."""

    rows: np.ndarray | None = None  # set once the encode is done; None while it runs, or if given up


@attrs.define(eq=False)
class MediaEncoder:
    """The loaded projector behind the HTTP edge: images to embedding rows (on the
    CPU, ``trio_llm.vision``), the last ``CACHE_IMAGES`` kept by content, an image
    being encoded shared with the requests that send it meanwhile. Thread-safe:
    requests parse on worker threads."""

    projector: Any  # trio_llm.vision.Projector
    tokenizer: Any  # trio_llm.model.tokenizer.Tokenizer
    marker: str = attrs.field(factory=media_marker)
    #: rows a pass holds (-b/-ub): an image is decoded in one pass (its rows attend to
    #: each other), so a larger one is refused, as llama.cpp refuses it
    max_rows: int = 1 << 30
    _cache: OrderedDict[int, np.ndarray] = attrs.field(init=False, factory=OrderedDict)
    #: the images being encoded, by media id: their encoding request's entry
    _encoding: dict[int, _Encoding] = attrs.field(init=False, factory=dict)
    #: guards the cache, the entries and the figures; notified when an entry ends
    _cond: threading.Condition = attrs.field(init=False, factory=threading.Condition)
    n_encoded: int = 0  # images run through the encoder (not found in the cache); not cancelled ones
    n_cached: int = 0  # images found in the cache, or taken from another request's encode
    t_encode: float = 0.0  # seconds spent encoding (images encoded whole)

    def statistics(self) -> MediaStatistics:
        with self._cond:
            return MediaStatistics(self.n_encoded, self.n_cached, self.t_encode)

    @property
    def n_tokens(self) -> int:
        """Positions an image takes."""
        return int(self.projector.n_tokens)

    def encode(self, data: bytes, cancel: threading.Event | None = None) -> tuple[int, np.ndarray]:
        """(media id, rows ``[n_tokens, n_embd]`` float32) of an image file's bytes:
        from the cache; else from another request encoding the same image now (waited
        for); else encoded here. Once ``cancel`` is set it raises ``EncodeCancelled`` at
        its next check (the encoder's, within one piece of a block; at once while it
        waits, for a ``CancelEvent``) and caches nothing."""
        from trio_llm.vision import decode_image, preprocess

        _check(cancel)
        pixels = decode_image(data)  # [h, w, 3] uint8
        mid = media_id(pixels)
        found = self._cached_or_claim(mid, cancel)
        if isinstance(found, np.ndarray):
            return mid, found
        mine = found
        rows: np.ndarray | None = None
        try:
            # a duration measured on a worker thread, where trio's clock cannot be read; it
            # is only reported (/metrics), nothing waits on it
            t0 = time.perf_counter()
            planar = preprocess(pixels, self.projector)  # [3, S, S]
            got = np.ascontiguousarray(self.projector.encode(planar, cancel=cancel), dtype=np.float32)
            got.setflags(write=False)
            t = time.perf_counter() - t0
            rows = got  # last: rows set means done, t with it
        finally:
            with self._cond:
                # done or given up: either way the waiters look again (one takes over if given up)
                del self._encoding[mid]
                if rows is not None:
                    mine.rows = rows
                    self.t_encode += t
                    self.n_encoded += 1
                    self._cache[mid] = rows
                    while len(self._cache) > CACHE_IMAGES:
                        self._cache.popitem(last=False)
                self._cond.notify_all()
        assert rows is not None
        return mid, rows

    def _cached_or_claim(self, mid: int, cancel: threading.Event | None) -> np.ndarray | _Encoding:
        """Image ``mid``'s rows, from the cache or from another request's encode of it
        (waited for); else a new in-flight entry, this caller's to encode and end. A
        waiter whose encoder gives up looks again: it claims the image itself unless
        another waiter already has (then it waits for that one)."""
        with self._cond, woken_by(cancel, self._cond):
            while True:
                rows = self._cache.get(mid)
                if rows is not None:
                    self._cache.move_to_end(mid)
                    self.n_cached += 1
                    return rows
                theirs = self._encoding.get(mid)
                if theirs is None:
                    mine = self._encoding[mid] = _Encoding()
                    return mine
                while theirs.rows is None and self._encoding.get(mid) is theirs:
                    _check(cancel)
                    self._cond.wait()
                if theirs.rows is not None:  # (it may have left the cache since, to newer images)
                    self.n_cached += 1
                    return theirs.rows

    def _text(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special=False, parse_special=True))

    def tokenize(self, text: str, images: Sequence[bytes], table: dict[int, np.ndarray], *,
                 add_special: bool = True, cancel: threading.Event | None = None) -> list[int]:
        """``text`` with one image per marker, as ``mtmd_tokenize`` does; the images'
        rows go into ``table`` (media id -> rows). ``cancel``: as ``encode``'s."""
        if images and self.n_tokens > self.max_rows:
            raise InvalidRequest(f"an image takes {self.n_tokens} positions, more than one pass holds ({self.max_rows}:"
                                 " -b/-ub): it cannot be decoded")
        pieces = text.split(self.marker)
        if len(pieces) - 1 != len(images):
            raise InvalidRequest(f"number of bitmaps ({len(images)}) does not match number of markers "
                                 f"({len(pieces) - 1})")
        ids: list[int] = []
        for i, piece in enumerate(pieces):
            if piece:
                ids += self._text(piece)
            if i < len(images):
                mid, rows = self.encode(images[i], cancel)
                table[mid] = rows
                ids += self._text(IMG_BEG)
                ids += [mid] * rows.shape[0]
                ids += self._text(IMG_END)
        tok = self.tokenizer
        if add_special and tok.add_bos and tok.bos_id is not None:
            ids.insert(0, tok.bos_id)
        if add_special and tok.add_eos and tok.eos_id is not None:
            ids.append(tok.eos_id)
        return ids


def media_runs(prompt: Sequence[int]) -> list[tuple[int, int]]:
    """(start, end) of every image's positions in ``prompt``."""
    runs: list[tuple[int, int]] = []
    i, n = 0, len(prompt)
    while i < n:
        if prompt[i] < 0:
            j = i
            while j < n and prompt[j] == prompt[i]:
                j += 1
            runs.append((i, j))
            i = j
        else:
            i += 1
    return runs


def cut_before_media(prompt: Sequence[int], keep: int) -> int:
    """``keep`` moved back to the start of the image it ends inside (an image's rows
    see each other: a part of one is never kept), else unchanged."""
    if 0 < keep < len(prompt) and prompt[keep - 1] < 0 and prompt[keep] == prompt[keep - 1]:
        while keep > 0 and prompt[keep - 1] == prompt[keep]:
            keep -= 1
    return keep


def render(prompt: Sequence[int], decode: Any, marker: str = MARKER) -> str:
    """A prompt as text, each image written as the media marker (as llama-server's
    ``server_tokens`` detokenizes one)."""
    if not prompt or min(prompt) >= 0:  # no image: one decode, no Python pass over the ids
        return str(decode(list(prompt)))
    out: list[str] = []
    start = 0
    for a, b in media_runs(prompt):
        out.append(decode(list(prompt[start:a])))
        out.append(marker)
        start = b
    out.append(decode(list(prompt[start:])))
    return "".join(out)


T = TypeVar("T")


async def run_sync_cancellable(fn: Callable[[threading.Event], T]) -> T:
    """``fn(cancel)`` on a worker thread: a request's parse, which may encode images.

    Waited for as ``trio.to_thread.run_sync(abandon_on_cancel=False)`` waits (same
    default thread limiter): the thread is never left running behind the task, since
    an encode holds the encoder's lock and every core. What that call lacks is word of
    the cancellation while it waits. Here the task's cancellation sets ``cancel`` (a
    ``CancelEvent``) the moment it is delivered; the encoder stops at its next check
    with ``EncodeCancelled``, a parse waiting for the encoder's turn or for another
    request's encode of its image wakes and leaves the same way, and the caller gets
    ``trio.Cancelled``. A ``fn`` that ends anyway returns its value (the caller's next
    checkpoint raises).

    Not a watcher task beside ``to_thread.run_sync`` setting the event: its nursery
    would hand every caller the cancellation wrapped in an ExceptionGroup.
    """
    cancel = CancelEvent()  # its setting also wakes the parse if it is waiting (vision.cancel)
    task = trio.lowlevel.current_task()
    token = trio.lowlevel.current_trio_token()
    limiter = trio.to_thread.current_default_thread_limiter()
    borrower = object()
    await limiter.acquire_on_behalf_of(borrower)
    context = contextvars.copy_context()

    def deliver(result: outcome.Outcome[T]) -> None:  # on the worker thread, fn done
        def back() -> None:
            limiter.release_on_behalf_of(borrower)
            trio.lowlevel.reschedule(task, result)

        with contextlib.suppress(trio.RunFinishedError):
            token.run_sync_soon(back)

    try:
        trio.lowlevel.start_thread_soon(lambda: context.run(fn, cancel), deliver, name="trio-llm parse")
    except BaseException:
        limiter.release_on_behalf_of(borrower)
        raise
    raise_cancel: list[Callable[[], NoReturn]] = []

    def abort(rc: Callable[[], NoReturn]) -> trio.lowlevel.Abort:
        raise_cancel[:] = [rc]
        cancel.set()
        return trio.lowlevel.Abort.FAILED  # the thread's end reschedules the task

    try:
        result: T = await trio.lowlevel.wait_task_rescheduled(abort)
    except EncodeCancelled:
        if raise_cancel:
            raise_cancel[0]()  # trio.Cancelled, for the scope that was cancelled
        raise
    return result


def _is_text(part: Any) -> bool:
    return isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)


def _part_url(part: dict[str, Any]) -> Any:
    url = part.get("image_url")
    return url.get("url") if isinstance(url, dict) else url


def _image_urls(messages: Any) -> Iterator[Any]:
    """The URL of every ``image_url`` part of ``messages``, in order (as
    ``extract_images`` walks them)."""
    if not isinstance(messages, list):
        return
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list):
            for part in content:
                if isinstance(part, dict) and part.get("type") == "image_url":
                    yield _part_url(part)


def extract_images(messages: Any, marker: str | None, media_path: Path | None = None,
                   fetched: Mapping[str, bytes] | None = None) -> tuple[Any, list[bytes]]:
    """OpenAI chat messages with each ``image_url`` part replaced by a text part holding
    the marker, and the images' bytes in order (llama-server's
    ``oaicompat_chat_params_parse``); remote ones come from ``fetched``
    (``fetch_images``). Without a projector (``marker`` None) an image part is
    refused."""
    if not isinstance(messages, list):
        return messages, []
    images: list[bytes] = []
    out = []
    for i, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list):
            out.append(message)
            continue
        # llama-server joins text parts with newlines but glues a marker to the text
        # on both sides of it: [text "a", image, text "b", text "c"] is "a<m>b\nc"
        parts: list[Any] = []
        glue = False
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "image_url":
                if marker is None:
                    raise InvalidRequest("image input is not supported - hint: if this is unexpected, you may need "
                                         "to provide the mmproj")
                images.append(image_url_bytes(_part_url(part), media_path, fetched))
                if parts and _is_text(parts[-1]):
                    parts[-1] = {**parts[-1], "text": parts[-1]["text"] + marker}
                else:
                    parts.append({"type": "text", "text": marker})
                glue = True
                continue
            if kind == "input_audio":
                raise InvalidRequest(f"messages[{i}].content[{j}]: audio input is not supported")
            if glue and _is_text(part) and parts and _is_text(parts[-1]):
                parts[-1] = {**parts[-1], "text": parts[-1]["text"] + part["text"]}
            else:
                parts.append(part)
            glue = False
        out.append({**message, "content": parts})
    return out, images

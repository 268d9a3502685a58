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
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import os
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import numpy as np

from trio_llm.errors import ConfigError, InvalidRequest

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


def image_url_bytes(url: Any, media_path: Path | None = None) -> bytes:
    """The image of an OpenAI ``image_url`` part, as llama-server reads one: a base64
    ``data:`` URL; an ``http(s)://`` URL, fetched (at most ``REMOTE_MAX_BYTES`` within
    ``REMOTE_TIMEOUT_S``); a ``file://`` path relative to ``--media-path``, only with it
    and never outside it."""
    if not isinstance(url, str) or not url:
        raise InvalidRequest("image_url.url must be a non-empty string")
    if url.startswith("data:"):
        head, sep, data = url.partition(",")
        if not sep or ";base64" not in head:
            raise InvalidRequest("Invalid image_url.url format: a data: URL must be base64 (data:image/...;base64,...)")
        return decode_base64(data, "image_url.url")
    if url.startswith(("http://", "https://")):
        return _fetch(url)
    if url.startswith("file://"):
        return _local_file(url[len("file://"):], media_path)
    raise InvalidRequest("Invalid image_url.url value")


def _fetch(url: str) -> bytes:
    import httpx

    from trio_llm import __version__

    try:
        with httpx.stream("GET", url, timeout=REMOTE_TIMEOUT_S, follow_redirects=True,
                          headers={"User-Agent": f"trio-llm/{__version__}"}) as r:
            if not 200 <= r.status_code < 300:
                raise InvalidRequest(f"Failed to download image: HTTP {r.status_code}")
            data = bytearray()
            for chunk in r.iter_bytes():
                data += chunk
                if len(data) > REMOTE_MAX_BYTES:
                    raise InvalidRequest(f"Failed to download image: larger than {REMOTE_MAX_BYTES} bytes")
    except httpx.HTTPError as exc:
        raise InvalidRequest(f"Failed to download image: {type(exc).__name__}") from None
    return bytes(data)


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
    n_cached: int  # images found in its cache instead
    t_encode: float  # seconds of encoding (worker threads)


@attrs.define(eq=False)
class MediaEncoder:
    """The loaded projector behind the HTTP edge: images to embedding rows (on the
    CPU, ``trio_llm.vision``), the last ``CACHE_IMAGES`` kept by content. Thread-safe:
    requests parse on worker threads."""

    projector: Any  # trio_llm.vision.Projector
    tokenizer: Any  # trio_llm.model.tokenizer.Tokenizer
    marker: str = attrs.field(factory=media_marker)
    #: rows a pass holds (-b/-ub): an image is decoded in one pass (its rows attend to
    #: each other), so a larger one is refused, as llama.cpp refuses it
    max_rows: int = 1 << 30
    _cache: OrderedDict[int, np.ndarray] = attrs.field(init=False, factory=OrderedDict)
    _lock: threading.Lock = attrs.field(init=False, factory=threading.Lock)
    n_encoded: int = 0  # images run through the encoder (not found in the cache)
    n_cached: int = 0  # images found in the cache
    t_encode: float = 0.0  # seconds spent encoding

    def statistics(self) -> MediaStatistics:
        with self._lock:
            return MediaStatistics(self.n_encoded, self.n_cached, self.t_encode)

    @property
    def n_tokens(self) -> int:
        """Positions an image takes."""
        return int(self.projector.n_tokens)

    def encode(self, data: bytes) -> tuple[int, np.ndarray]:
        """(media id, rows ``[n_tokens, n_embd]`` float32) of an image file's bytes."""
        from trio_llm.vision import decode_image, preprocess

        pixels = decode_image(data)  # [h, w, 3] uint8
        mid = media_id(pixels)
        with self._lock:
            rows = self._cache.get(mid)
            if rows is not None:
                self._cache.move_to_end(mid)
                self.n_cached += 1
                return mid, rows
        # a duration measured on a worker thread, where trio's clock cannot be read; it
        # is only reported (/metrics), nothing waits on it
        t0 = time.perf_counter()
        rows = np.ascontiguousarray(self.projector.encode(preprocess(pixels, self.projector)), dtype=np.float32)
        rows.setflags(write=False)
        with self._lock:
            self.t_encode += time.perf_counter() - t0
            self.n_encoded += 1
            self._cache[mid] = rows
            while len(self._cache) > CACHE_IMAGES:
                self._cache.popitem(last=False)
        return mid, rows

    def _text(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special=False, parse_special=True))

    def tokenize(self, text: str, images: Sequence[bytes], table: dict[int, np.ndarray], *,
                 add_special: bool = True) -> list[int]:
        """``text`` with one image per marker, as ``mtmd_tokenize`` does; the images'
        rows go into ``table`` (media id -> rows)."""
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
                mid, rows = self.encode(images[i])
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


def _is_text(part: Any) -> bool:
    return isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)


def extract_images(messages: Any, marker: str | None, media_path: Path | None = None) -> tuple[Any, list[bytes]]:
    """OpenAI chat messages with each ``image_url`` part replaced by a text part holding
    the marker, and the images' bytes in order (llama-server's
    ``oaicompat_chat_params_parse``). Without a projector (``marker`` None) an image
    part is refused."""
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
                url = part.get("image_url")
                images.append(image_url_bytes(url.get("url") if isinstance(url, dict) else url, media_path))
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

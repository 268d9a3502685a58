"""A request that is gone stops its image work: the encoder's cancel event
(``vision.siglip``), the parse thread that sets it when the request's scope is cancelled
(``server.media.run_sync_cancellable``), and remote images fetched on trio
(``server.media.fetch_image``).

Where an encode is, is read from the tensors it reads (``WatchedTensors``), and the
cancellations are made from there, in the encoding thread, at a chosen point: the
assertions are on blocks run and names read, not on how fast a loaded machine is.
"""

from __future__ import annotations

import io
import threading
from collections.abc import Callable, Iterator, Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import attrs
import numpy as np
import pytest
import trio
from PIL import Image
from threadpoolctl import threadpool_limits

from trio_llm.errors import EncodeCancelled
from trio_llm.server import media as MD
from trio_llm.vision import Projector, decode_image, load_projector, preprocess, siglip
from trio_llm.vision import synth as vsynth

N_LAYER = 6


@pytest.fixture(scope="module")
def projector(tmp_path_factory: pytest.TempPathFactory) -> Projector:
    path = tmp_path_factory.mktemp("mmproj") / "mm-f32.gguf"
    vsynth.write_mmproj(path, n_embd_text=256, image_size=64, patch_size=8, n_embd=64, n_ff=128, n_head=4,
                        n_layer=N_LAYER, n_merge=2, wtype="f32")
    return load_projector(path)


@pytest.fixture(scope="module")
def png() -> bytes:
    pixels = np.random.default_rng(11).integers(0, 256, (64, 64, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, "PNG")
    return out.getvalue()


class WatchedTensors(Mapping[str, Any]):
    """A projector's tensors as the encoder reads them, noting every name it reads (in
    the encoding thread: the workers get their matrices from it) and calling
    ``on_read(name)`` first: a window on where an encode is, without touching it."""

    def __init__(self, tensors: Mapping[str, Any], on_read: Callable[[str], None] = lambda name: None) -> None:
        self._tensors = tensors
        self.on_read = on_read
        self.read: list[str] = []

    def __getitem__(self, name: str) -> Any:
        self.read.append(name)
        self.on_read(name)
        return self._tensors[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)

    def blocks(self) -> list[int]:
        """The blocks entered, in order (each reads its ln1.weight once, first)."""
        return [int(n.split(".")[2]) for n in self.read if n.startswith("v.blk.") and n.endswith(".ln1.weight")]


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(("at", "last"), [("v.blk.2.ln1.weight", "v.blk.2.ln1.bias"),
                                          ("v.blk.1.attn_k.weight", "v.blk.1.attn_k.bias")])
def test_encode_stops_at_the_next_piece_once_cancelled(projector: Projector, threads: int, at: str, last: str) -> None:
    """The cancel event set as the encoder reaches ``at`` (a block's start, a projection
    in the middle of one): it raises EncodeCancelled before the next piece of work
    (the piece whose weights it was reading never runs: nothing after ``last`` is
    read), frees the encode lock, and the next encode is whole and exact."""
    proj = projector
    pixels = np.random.default_rng(5).uniform(-1.0, 1.0, (3, 64, 64)).astype(np.float32)
    cancel = threading.Event()

    def on_read(name: str) -> None:
        if name == at:
            cancel.set()

    tensors = WatchedTensors(proj._tensors, on_read)
    with threadpool_limits(limits=threads, user_api="blas"):
        want = proj.encode(pixels)  # the same threads: the same rounding
        with pytest.raises(EncodeCancelled):
            siglip.encode(proj.hparams, tensors, pixels, cancel=cancel)
        assert tensors.read[-1] == last  # the piece's weights fetched, the piece not run
        assert "v.post_ln.weight" not in tensors.read and max(tensors.blocks()) <= 2
        assert not siglip._ENCODE_LOCK.locked()
        # already set before it starts: nothing is read
        tensors.read.clear()
        with pytest.raises(EncodeCancelled):
            siglip.encode(proj.hparams, tensors, pixels, cancel=cancel)
        assert tensors.read == []
        got = siglip.encode(proj.hparams, tensors, pixels, cancel=threading.Event())
    assert tensors.blocks() == list(range(N_LAYER))
    np.testing.assert_array_equal(got, want)


# ---------------------------------------------------------------- the server's side


def _watched(proj: Projector, on_read: Callable[[str], None]) -> tuple[Projector, WatchedTensors]:
    """The projector, its tensors watched; ``on_read`` is called once a name (the first
    encode to read it: a later one reads the same names again)."""
    seen: set[str] = set()

    def once(name: str) -> None:
        if name not in seen:
            seen.add(name)
            on_read(name)

    tensors = WatchedTensors(proj._tensors, once)
    return attrs.evolve(proj, tensors=tensors), tensors


def _reference(proj: Projector, png: bytes) -> np.ndarray:
    return proj.encode(preprocess(decode_image(png), proj))


async def test_a_cancelled_request_stops_its_encode(projector: Projector, png: bytes) -> None:
    """The request's scope cancelled while its image is in block 2: control comes back
    as the encoder reaches its next check (block 2 runs no work, later blocks are never
    entered), the encode lock is free, nothing is cached or counted, and the next
    request for the image encodes it whole."""
    token = trio.lowlevel.current_trio_token()
    scope = trio.CancelScope()

    def on_read(name: str) -> None:
        if name == "v.blk.2.ln1.weight":
            trio.from_thread.run_sync(scope.cancel, trio_token=token)  # as the client leaves

    proj, tensors = _watched(projector, on_read)
    enc = MD.MediaEncoder(proj, tokenizer=None)
    with scope:
        await MD.run_sync_cancellable(lambda cancel: enc.encode(png, cancel))
    assert scope.cancelled_caught
    assert tensors.blocks() == [0, 1, 2] and tensors.read[-1] == "v.blk.2.ln1.bias"
    assert not siglip._ENCODE_LOCK.locked()
    assert enc.statistics() == MD.MediaStatistics(0, 0, 0.0) and not enc._cache
    mid, rows = await MD.run_sync_cancellable(lambda cancel: enc.encode(png, cancel))
    assert tensors.blocks() == [0, 1, 2, *range(N_LAYER)]
    assert enc.statistics().n_encoded == 1 and enc.statistics().n_cached == 0
    np.testing.assert_array_equal(rows, _reference(projector, png))


async def test_another_request_for_the_image_keeps_its_encode(projector: Projector, png: bytes) -> None:
    """Two requests send one image at once: the first's client leaves in block 2; the
    second, started while the first held the encoder, still gets the image's rows (its
    own encode, whole)."""
    token = trio.lowlevel.current_trio_token()
    first = trio.CancelScope()
    results: list[tuple[int, np.ndarray]] = []

    async def second() -> None:
        results.append(await MD.run_sync_cancellable(lambda cancel: enc.encode(png, cancel)))

    async with trio.open_nursery() as nursery:
        def on_read(name: str) -> None:
            if name == "v.blk.1.ln1.weight":
                trio.from_thread.run_sync(nursery.start_soon, second, trio_token=token)
            elif name == "v.blk.2.ln1.weight":
                trio.from_thread.run_sync(first.cancel, trio_token=token)

        proj, tensors = _watched(projector, on_read)
        enc = MD.MediaEncoder(proj, tokenizer=None)
        with first:
            await MD.run_sync_cancellable(lambda cancel: enc.encode(png, cancel))
    assert first.cancelled_caught
    assert tensors.blocks() == [0, 1, 2, *range(N_LAYER)]  # the first stopped, the second whole
    [(mid, rows)] = results
    np.testing.assert_array_equal(rows, _reference(projector, png))
    assert enc.statistics().n_encoded == 1 and list(enc._cache) == [mid]


async def test_a_request_cancelled_while_waiting_leaves_the_other_encoding(projector: Projector, png: bytes) -> None:
    """The second request's client leaves while the first's encode holds the encoder:
    the first goes on to the end; the second encodes nothing and is gone once its turn
    comes."""
    token = trio.lowlevel.current_trio_token()
    second_scope = trio.CancelScope()
    results: list[tuple[int, np.ndarray]] = []

    async def second() -> None:
        with second_scope:
            results.append(await MD.run_sync_cancellable(lambda cancel: enc.encode(png, cancel)))

    async with trio.open_nursery() as nursery:
        def on_read(name: str) -> None:
            if name == "v.blk.1.ln1.weight":
                trio.from_thread.run_sync(nursery.start_soon, second, trio_token=token)
            elif name == "v.blk.3.ln1.weight":
                trio.from_thread.run_sync(second_scope.cancel, trio_token=token)

        proj, tensors = _watched(projector, on_read)
        enc = MD.MediaEncoder(proj, tokenizer=None)
        mid, rows = await MD.run_sync_cancellable(lambda cancel: enc.encode(png, cancel))
    assert second_scope.cancelled_caught and not results
    assert tensors.blocks() == list(range(N_LAYER))  # one encode: the first's, whole
    assert "v.post_ln.weight" in tensors.read
    np.testing.assert_array_equal(rows, _reference(projector, png))
    assert enc.statistics().n_encoded == 1 and list(enc._cache) == [mid]


async def test_the_parse_thread_is_waited_for() -> None:
    """A parse without images is not abandoned either: the task waits for the thread,
    which sees the event set, and gets its value; the next checkpoint raises."""
    token = trio.lowlevel.current_trio_token()
    seen: list[bool] = []

    def parse(cancel: threading.Event) -> int:
        trio.from_thread.run_sync(scope.cancel, trio_token=token)
        seen.append(cancel.is_set())
        return 7

    with trio.CancelScope() as scope:
        assert await MD.run_sync_cancellable(parse) == 7
        await trio.lowlevel.checkpoint()
    assert scope.cancelled_caught and seen == [True]


async def test_a_stalled_download_ends_on_cancel() -> None:
    """A server on loopback sends the headers and a few bytes of an image, then nothing:
    the request's cancellation ends the download at once (the connection is closed),
    long before the 10 s limit."""
    token = trio.lowlevel.current_trio_token()
    scope = trio.CancelScope()
    cancelled_at: list[float] = []
    closed: list[bool] = []
    handled = threading.Event()

    def cancel_now() -> None:
        cancelled_at.append(trio.current_time())
        scope.cancel()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            try:
                self.send_response(200)
                self.send_header("Content-Type", "image/png")
                self.send_header("Content-Length", "100000")
                self.end_headers()
                self.wfile.write(b"\x89PNG\r\n\x1a\n")
                self.wfile.flush()
                trio.from_thread.run_sync(cancel_now, trio_token=token)
                self.connection.settimeout(MD.REMOTE_TIMEOUT_S)
                closed.append(self.rfile.read(1) == b"")  # the client hung up
            finally:
                handled.set()

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        with scope:
            await MD.fetch_image(f"http://127.0.0.1:{server.server_address[1]}/slow.png")
        done_at = trio.current_time()
        await trio.to_thread.run_sync(handled.wait, 2 * MD.REMOTE_TIMEOUT_S)
    finally:
        server.shutdown()
        server.server_close()
    assert scope.cancelled_caught and closed == [True]
    assert done_at - cancelled_at[0] < MD.REMOTE_TIMEOUT_S / 2

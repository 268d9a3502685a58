"""A request that is gone stops its image work: the encoder's cancel event
(``vision.siglip``), the parse thread that sets it when the request's scope is cancelled
(``server.media.run_sync_cancellable``), a parse that waits (for the encoder's turn,
for another request's encode of the same image) and leaves at once when cancelled
(``vision.cancel``), and remote images fetched on trio (``server.media.fetch_image``).

Where an encode is, is read from the tensors it reads (``WatchedTensors``), and the
cancellations are made from there, in the encoding thread, at a chosen point; a thread
waiting is seen through the condition it waits on (``WatchedCondition``). The encoding
thread is held at its point until the other threads have done what the test orders
(events, with only a long guard against a hang, never a deadline a loaded machine
could miss): the assertions are on blocks run, names read and counters, not on how
fast a loaded machine is.
"""

from __future__ import annotations

import io
import queue
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
from trio_llm.vision.cancel import CancelEvent, TurnLock

N_LAYER = 6
#: how long a test thread waits for another to reach its point before the test fails:
#: a guard against a hang, never reached when the code is right
GUARD_S = 60.0


@pytest.fixture(scope="module")
def projector(tmp_path_factory: pytest.TempPathFactory) -> Projector:
    path = tmp_path_factory.mktemp("mmproj") / "mm-f32.gguf"
    vsynth.write_mmproj(path, n_embd_text=256, image_size=64, patch_size=8, n_embd=64, n_ff=128, n_head=4,
                        n_layer=N_LAYER, n_merge=2, wtype="f32")
    return load_projector(path)


def _png(seed: int) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (64, 64, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, "PNG")
    return out.getvalue()


@pytest.fixture(scope="module")
def png() -> bytes:
    return _png(11)


@pytest.fixture(scope="module")
def png2() -> bytes:
    return _png(12)


def wait_for(event: threading.Event) -> None:
    """In a test's thread: wait until another thread has reached its point."""
    assert event.wait(GUARD_S), "the other thread never got there"


class WatchedCondition(threading.Condition):
    """A condition that calls ``on_wait()`` as a thread starts waiting on it: the thread
    holds it then and releases it only inside ``wait()``, so whatever the test does from
    that call on (a notify, a cancel event set) reaches the waiting thread."""

    def __init__(self, on_wait: Callable[[], None]) -> None:
        super().__init__()
        self.on_wait = on_wait

    def wait(self, timeout: float | None = None) -> bool:
        self.on_wait()
        return super().wait(timeout)


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


def watched(proj: Projector, on_read: Callable[[str], None]) -> tuple[Projector, WatchedTensors]:
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

    proj, tensors = watched(projector, on_read)
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


async def test_two_requests_for_one_new_image_share_its_encode(projector: Projector, png: bytes) -> None:
    """The second request for an image the first is encoding waits for that encode and
    takes its rows: one encode (n_encoded 1, n_cached 1), the same rows for both."""
    token = trio.lowlevel.current_trio_token()
    waiting = threading.Event()
    results: list[tuple[int, np.ndarray]] = []

    async def second() -> None:
        results.append(await MD.run_sync_cancellable(lambda cancel: enc.encode(png, cancel)))

    async with trio.open_nursery() as nursery:
        def on_read(name: str) -> None:
            if name == "v.blk.1.ln1.weight":
                trio.from_thread.run_sync(nursery.start_soon, second, trio_token=token)
                wait_for(waiting)  # the second waits for this encode

        proj, tensors = watched(projector, on_read)
        enc = MD.MediaEncoder(proj, tokenizer=None)
        enc._cond = WatchedCondition(waiting.set)
        mid, rows = await MD.run_sync_cancellable(lambda cancel: enc.encode(png, cancel))
    assert tensors.blocks() == list(range(N_LAYER))  # one encode
    [(mid2, rows2)] = results
    assert mid2 == mid and rows2 is rows
    np.testing.assert_array_equal(rows, _reference(projector, png))
    assert (enc.statistics().n_encoded, enc.statistics().n_cached) == (1, 1)
    assert list(enc._cache) == [mid] and not enc._encoding and not siglip._ENCODE_LOCK.locked()


async def test_another_request_for_the_image_takes_over_its_encode(projector: Projector, png: bytes) -> None:
    """Two requests send one image at once: the second waits for the first's encode;
    the first's client leaves in block 1; the second takes the encode over and gets the
    image's rows (its own encode, whole), never an error."""
    token = trio.lowlevel.current_trio_token()
    first = trio.CancelScope()
    waiting = threading.Event()
    results: list[tuple[int, np.ndarray]] = []

    async def second() -> None:
        results.append(await MD.run_sync_cancellable(lambda cancel: enc.encode(png, cancel)))

    async with trio.open_nursery() as nursery:
        def on_read(name: str) -> None:
            if name == "v.blk.1.ln1.weight":
                trio.from_thread.run_sync(nursery.start_soon, second, trio_token=token)
                wait_for(waiting)
                trio.from_thread.run_sync(first.cancel, trio_token=token)

        proj, tensors = watched(projector, on_read)
        enc = MD.MediaEncoder(proj, tokenizer=None)
        enc._cond = WatchedCondition(waiting.set)
        with first:
            await MD.run_sync_cancellable(lambda cancel: enc.encode(png, cancel))
    assert first.cancelled_caught
    assert tensors.blocks() == [0, 1, *range(N_LAYER)]  # the first stopped, the second whole
    [(mid, rows)] = results
    np.testing.assert_array_equal(rows, _reference(projector, png))
    assert (enc.statistics().n_encoded, enc.statistics().n_cached) == (1, 0)
    assert list(enc._cache) == [mid] and not enc._encoding and not siglip._ENCODE_LOCK.locked()


async def test_of_two_waiters_one_takes_over_the_other_waits_for_it(projector: Projector, png: bytes) -> None:
    """Three requests for one image: the first is cancelled with two waiting; one of
    them encodes the image again, the other takes its rows (n_encoded 1, n_cached 1)."""
    token = trio.lowlevel.current_trio_token()
    first = trio.CancelScope()
    waits: queue.Queue[None] = queue.Queue()
    results: list[tuple[int, np.ndarray]] = []

    async def another() -> None:
        results.append(await MD.run_sync_cancellable(lambda cancel: enc.encode(png, cancel)))

    async with trio.open_nursery() as nursery:
        def on_read(name: str) -> None:
            if name == "v.blk.1.ln1.weight":
                for _ in range(2):  # one at a time: each waiting before the next starts
                    trio.from_thread.run_sync(nursery.start_soon, another, trio_token=token)
                    waits.get(timeout=GUARD_S)
                trio.from_thread.run_sync(first.cancel, trio_token=token)

        proj, tensors = watched(projector, on_read)
        enc = MD.MediaEncoder(proj, tokenizer=None)
        enc._cond = WatchedCondition(lambda: waits.put(None))
        with first:
            await MD.run_sync_cancellable(lambda cancel: enc.encode(png, cancel))
    assert first.cancelled_caught
    assert tensors.blocks() == [0, 1, *range(N_LAYER)]
    [(mid, rows), (mid2, rows2)] = results
    assert mid2 == mid and rows2 is rows
    np.testing.assert_array_equal(rows, _reference(projector, png))
    assert (enc.statistics().n_encoded, enc.statistics().n_cached) == (1, 1)
    assert not enc._encoding and not siglip._ENCODE_LOCK.locked()


@pytest.mark.parametrize("same_image", [True, False], ids=["same-image", "another-image"])
async def test_a_request_cancelled_while_waiting_leaves_at_once(projector: Projector, png: bytes, png2: bytes,
                                                               same_image: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """The second request's client leaves while the first's encode holds the encoder
    (held still in block 1): the second, waiting for that encode (same image) or for the
    encoder's turn (another image), is gone before the first's encode goes on; the
    first goes on to the end; the second encoded nothing, and the lock is free after."""
    token = trio.lowlevel.current_trio_token()
    second_scope = trio.CancelScope()
    waiting = threading.Event()
    gone = threading.Event()
    results: list[tuple[int, np.ndarray]] = []
    image = png if same_image else png2

    async def second() -> None:
        with second_scope:
            results.append(await MD.run_sync_cancellable(lambda cancel: enc.encode(image, cancel)))
        gone.set()

    async with trio.open_nursery() as nursery:
        def on_read(name: str) -> None:
            if name == "v.blk.1.ln1.weight":
                trio.from_thread.run_sync(nursery.start_soon, second, trio_token=token)
                wait_for(waiting)
                trio.from_thread.run_sync(second_scope.cancel, trio_token=token)
                wait_for(gone)  # the second has returned, and this encode is still in block 1

        proj, tensors = watched(projector, on_read)
        enc = MD.MediaEncoder(proj, tokenizer=None)
        lock = TurnLock()
        if same_image:
            enc._cond = WatchedCondition(waiting.set)
        else:
            lock = TurnLock(cond=WatchedCondition(waiting.set))
        monkeypatch.setattr(siglip, "_ENCODE_LOCK", lock)
        mid, rows = await MD.run_sync_cancellable(lambda cancel: enc.encode(png, cancel))
    assert second_scope.cancelled_caught and not results
    assert tensors.blocks() == list(range(N_LAYER))  # one encode: the first's, whole
    assert "v.post_ln.weight" in tensors.read
    np.testing.assert_array_equal(rows, _reference(projector, png))
    assert enc.statistics().n_encoded == 1 and list(enc._cache) == [mid] and not enc._encoding
    assert not lock.locked() and lock.n_waiting == 0


def test_turn_lock_cancelled_waiter_leaves_and_the_turn_passes_on() -> None:
    """Real threads on one ``TurnLock``: while the holder holds it, a waiter whose
    ``CancelEvent`` is set leaves at once with EncodeCancelled; another waiter (a plain
    event) gets the turn when the holder lets go (the cancelled one's wake-up took
    nothing from it); the lock is free at the end."""
    waits: queue.Queue[None] = queue.Queue()
    lock = TurnLock(cond=WatchedCondition(lambda: waits.put(None)))
    held = threading.Event()
    release = threading.Event()
    log: list[str] = []
    cancel = CancelEvent()

    def holder() -> None:
        with lock.hold():
            held.set()
            wait_for(release)
            log.append("let go")

    def waiter(name: str, cancel: threading.Event) -> None:
        try:
            with lock.hold(cancel):
                log.append(f"{name} got it")
        except EncodeCancelled:
            log.append(f"{name} left")

    threads = [threading.Thread(target=holder), threading.Thread(target=waiter, args=("cancelled", cancel)),
               threading.Thread(target=waiter, args=("plain", threading.Event()))]
    threads[0].start()
    wait_for(held)
    for t in threads[1:]:  # each waiting before the next starts
        t.start()
        waits.get(timeout=GUARD_S)
    cancel.set()
    threads[1].join(GUARD_S)
    assert not threads[1].is_alive() and log == ["cancelled left"]  # the holder still holds it
    assert lock.locked()
    release.set()
    for t in threads:
        t.join(GUARD_S)
    assert log == ["cancelled left", "let go", "plain got it"]
    assert not lock.locked() and lock.n_waiting == 0


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
                try:
                    closed.append(self.rfile.read(1) == b"")  # the client hung up (FIN)
                except ConnectionResetError:
                    closed.append(True)  # ... or reset the connection (RST), as it may under load
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

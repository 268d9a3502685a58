"""gemma-3 with an image, end to end: ``trio-llm serve --mmproj`` over real HTTP
against llama.cpp itself (the xllamacpp wheel's llama-server, libmtmd inside) on the same
tiny text model and the same tiny projector file: the prompt's length, the greedy
tokens and their top log-probabilities must agree (the rule of tests/llamacpp_ref.py).
Then what only the server does: the prompt cache across requests with images, the
refusals, and /props."""

from __future__ import annotations

import base64
import io
import os
import subprocess
import sys
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import trio
import xllamacpp
from PIL import Image

from conftest import ServeFactory
from llamacpp_ref import N_PROBS, TIE_TOL, server_params
from test_image_cancel import WatchedCondition, wait_for, watched
from trio_llm.config import ServerConfig
from trio_llm.model.gguf import load_gguf
from trio_llm.runtime import ServerHandle
from trio_llm.server import media as MD
from trio_llm.vision import siglip
from trio_llm.vision.cancel import CancelEvent, TurnLock
from trio_llm.vision.synth import write_mmproj

Start = Callable[..., Awaitable[ServerHandle]]

#: llama-server's marker is random per process unless this says otherwise; both servers
#: of these tests read it (test_random_marker starts one without it)
os.environ["LLAMA_MEDIA_MARKER"] = "<__media__>"

#: the projector: 64x64 pixels in patches of 8, pooled 2x2: 16 rows an image
MMPROJ = dict(image_size=64, patch_size=8, n_embd=64, n_ff=128, n_head=4, n_layer=2, n_merge=2)
N_IMG = 16
#: top-logprob agreement asked here: tighter than llamacpp_ref's 0.15, because these
#: answers part by less (0.018 at most, measured on every case below) and feeding the
#: image's rows causally, as text, moves them by 0.07-0.10: the looser bound would
#: not see that mistake
VISION_TOL = 0.04
N_PREDICT = 12
TURN = "<start_of_turn>user\n{}<end_of_turn>\n<start_of_turn>model\n"


def png(seed: int, size: tuple[int, int] = (48, 40), mode: str = "RGB") -> bytes:
    rng = np.random.default_rng(seed)
    arr = rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr, "RGB").convert(mode).save(buf, format="PNG")
    return buf.getvalue()


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    from trio_llm.model.synth import make_model

    d = tmp_path_factory.mktemp("vision")
    text = make_model("tiny-gemma3", "Q8_0", d / "tiny-gemma3.gguf", sharp=True)
    n_embd = load_gguf(text).config.n_embd
    mmproj = d / "mmproj-tiny-f16.gguf"
    write_mmproj(mmproj, n_embd_text=n_embd, wtype="f16", seed=3, **MMPROJ)
    return text, mmproj


@pytest.fixture(scope="module")
def llamacpp(files: tuple[Path, Path]) -> AsyncIterator[httpx.Client]:
    text, mmproj = files
    params = server_params(text, 512)
    params.mmproj.path = str(mmproj)
    server = xllamacpp.Server(params)
    with httpx.Client(base_url=server.listening_address, timeout=120.0) as client:
        yield client
    del server


@pytest.fixture
def start(files: tuple[Path, Path], serve_config: ServeFactory) -> Start:
    def go(**overrides: Any) -> Awaitable[ServerHandle]:
        text, mmproj = files
        kw: dict[str, Any] = {"model": text, "mmproj": mmproj, "port": 0, "backend": "numpy", "ctx_size": 512,
                              "parallel": 1, "shutdown_timeout": 2.0, "temp": 0.0} | overrides
        return serve_config(ServerConfig(**kw), load_timeout=120)

    return go


def _steps(out: dict[str, Any]) -> list[tuple[int, dict[int, float] | None]]:
    """(token, top logprobs) per generated token of a /completion answer (return_tokens,
    n_probs), as tests/llamacpp_ref.py pairs them (tiny vocabularies have no UTF-8 runs
    worth the splitting: a token without its own entry gets None)."""
    tokens = [int(t) for t in out["tokens"]]
    probs = out.get("completion_probabilities") or []
    steps: list[tuple[int, dict[int, float] | None]] = []
    j = 0
    for t in tokens:
        top = None
        if j < len(probs) and int(probs[j]["id"]) == t:
            top = {int(p["id"]): float(p["logprob"]) for p in probs[j]["top_logprobs"]}
            j += 1
        steps.append((t, top))
    return steps


def agree(ours: dict[str, Any], theirs: dict[str, Any]) -> str:
    """"" when the two answers agree; else why not."""
    a, b = _steps(ours), _steps(theirs)
    for i, ((ta, pa), (tb, pb)) in enumerate(zip(a, b, strict=False)):
        if pa is not None and pb is not None:
            for tid, lp in pb.items():
                if tid in pa and abs(pa[tid] - lp) > VISION_TOL:
                    return f"step {i}: token {tid} logprob {pa[tid]:.4f} here, {lp:.4f} in llama.cpp"
        if ta != tb:
            if pb is None or ta not in pb or abs(pb[ta] - pb[tb]) > TIE_TOL:
                return f"step {i}: token {ta} here, {tb} in llama.cpp ({a} vs {b})"
            return ""  # a near-tie: the texts part here, nothing after is compared
    if len(a) != len(b):
        return f"{len(a)} tokens here, {len(b)} in llama.cpp"
    return ""


def completion_body(text: str, images: list[bytes], **kw: Any) -> dict[str, Any]:
    return {"prompt": {"prompt_string": text, "multimodal_data": [b64(i) for i in images]}, "n_predict": N_PREDICT,
            "temperature": 0.0, "n_probs": N_PROBS, "return_tokens": True, "cache_prompt": False} | kw


CASES = [
    ("one image", TURN.format("Describe <__media__> in a few words."), [png(1)]),
    ("image first", TURN.format("<__media__>what is it"), [png(2, (64, 64))]),
    ("two images", TURN.format("compare <__media__> and <__media__> please"), [png(3, (30, 70)), png(4, (100, 20))]),
    ("rgba and grey", TURN.format("<__media__> <__media__>"), [png(5, mode="RGBA"), png(6, mode="L")]),
]


@pytest.mark.parametrize("backend", ["numpy", pytest.param("vulkan", marks=pytest.mark.vulkan)])
async def test_completion_with_images_agrees_with_llamacpp(start: Start, llamacpp: httpx.Client, backend: str) -> None:
    """/completion with multimodal_data: llama.cpp's prompt length and greedy answer."""
    handle = await start(backend=backend)
    async with httpx.AsyncClient(base_url=handle.url, timeout=300) as c:
        for name, text, images in CASES:
            body = completion_body(text, images)
            theirs = await trio.to_thread.run_sync(lambda b=body: llamacpp.post("/completion", json=b).json())
            r = await c.post("/completion", json=body)
            assert r.status_code == 200, r.text
            ours = r.json()
            assert ours["timings"]["prompt_n"] == theirs["timings"]["prompt_n"], name
            why = agree(ours, theirs)
            assert not why, f"{name}: {why}"
            assert ours["prompt"].count("<__media__>") == len(images)


async def test_chat_image_url_agrees_with_llamacpp(start: Start, llamacpp: httpx.Client) -> None:
    """/v1/chat/completions with image_url parts: the same answer as llama-server's."""
    handle = await start()
    url = "data:image/png;base64," + b64(png(7))
    body = {"messages": [{"role": "user", "content": [{"type": "text", "text": "What is in"},
                                                       {"type": "image_url", "image_url": {"url": url}},
                                                       {"type": "text", "text": "this picture?"}]}],
            "max_tokens": N_PREDICT, "temperature": 0.0, "cache_prompt": False}
    theirs = await trio.to_thread.run_sync(lambda: llamacpp.post("/v1/chat/completions", json=body).json())
    async with httpx.AsyncClient(base_url=handle.url, timeout=300) as c:
        r = await c.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    ours = r.json()
    assert ours["usage"]["prompt_tokens"] == theirs["usage"]["prompt_tokens"]
    assert ours["choices"][0]["message"]["content"] == theirs["choices"][0]["message"]["content"]


async def test_prompt_cache_with_images(start: Start) -> None:
    """The same image again is reused from the cache and answers exactly as a fresh
    evaluation; another image is evaluated from its start."""
    handle = await start()
    first = TURN.format("Look: <__media__> and say")
    second = TURN.format("Look: <__media__> and tell me more")
    async with httpx.AsyncClient(base_url=handle.url, timeout=300) as c:
        async def ask(text: str, image: bytes, cache: bool) -> dict[str, Any]:
            r = await c.post("/completion", json=completion_body(text, [image], cache_prompt=cache))
            assert r.status_code == 200, r.text
            return r.json()

        await ask(first, png(8), True)
        cached = await ask(second, png(8), True)
        fresh = await ask(second, png(8), False)
        assert cached["tokens"] == fresh["tokens"]
        # the whole image came from the cache (it sits after "<bos><start_of_turn>user\nLook: <start_of_image>")
        assert cached["timings"]["cache_n"] > N_IMG
        other = await ask(second, png(9), True)
        assert other["timings"]["cache_n"] < cached["timings"]["cache_n"] - N_IMG + 1


async def test_refusals(start: Start) -> None:
    handle = await start()
    async with httpx.AsyncClient(base_url=handle.url, timeout=60) as c:
        props = (await c.get("/props")).json()
        assert props["modalities"] == {"vision": True, "audio": False}
        cases = [
            (completion_body(TURN.format("<__media__> <__media__>"), [png(1)]), "number of bitmaps (1)"),
            (completion_body(TURN.format("no marker"), [png(1)]), "number of bitmaps (1)"),
            ({"prompt": {"prompt_string": "x <__media__>", "multimodal_data": ["!!not base64!!"]}}, "not valid base64"),
            ({"prompt": {"prompt_string": "x <__media__>", "multimodal_data": [b64(b"not an image")]}}, "image"),
            ({"prompt": "a marker alone <__media__>"}, "number of bitmaps (0)"),
            ({"messages": [{"role": "user", "content": [{"type": "image_url",
                                                         "image_url": {"url": "http://127.0.0.1:9/y.png"}}]}]},
             "Failed to download image"),
            ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "file://a.png"}}]}]},
             "not allowed unless --media-path"),
        ]
        for body, why in cases:
            path = "/v1/chat/completions" if "messages" in body else "/completion"
            r = await c.post(path, json=body)
            assert r.status_code == 400, (body, r.text)
            assert why in r.json()["error"]["message"], r.text
        # and the server goes on serving
        r = await c.post("/completion", json=completion_body(TURN.format("<__media__>"), [png(1)]))
        assert r.status_code == 200, r.text


async def test_text_only_server_refuses_images(start: Start) -> None:
    handle = await start(mmproj=None)
    async with httpx.AsyncClient(base_url=handle.url, timeout=60) as c:
        assert (await c.get("/props")).json()["modalities"]["vision"] is False
        r = await c.post("/completion", json=completion_body(TURN.format("<__media__>"), [png(1)]))
        assert r.status_code == 400 and "does not support multimodal" in r.text
        body = {"messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "data:image/png;base64," + b64(png(1))}}]}]}
        r = await c.post("/v1/chat/completions", json=body)
        assert r.status_code == 400 and "mmproj" in r.text


async def test_random_marker(start: Start, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without LLAMA_MEDIA_MARKER the marker is random per process (llama-server's): /props
    says which, and libmtmd's default is then plain text."""
    monkeypatch.delenv("LLAMA_MEDIA_MARKER")
    handle = await start()
    async with httpx.AsyncClient(base_url=handle.url, timeout=60) as c:
        marker = (await c.get("/props")).json()["media_marker"]
        assert marker.startswith("<__media_") and marker != "<__media__>"
        r = await c.post("/completion", json=completion_body(TURN.format(f"see {marker}"), [png(1)]))
        assert r.status_code == 200 and r.json()["prompt"].count(marker) == 1, r.text
        r = await c.post("/completion", json={"prompt": "plain <__media__> text", "n_predict": 2})
        assert r.status_code == 200 and "<__media__>" in r.json()["prompt"], r.text


async def test_projectors_this_server_cannot_run(start: Start, files: tuple[Path, Path], tmp_path: Path,
                                                 tiny_model: Path) -> None:
    """Another encoder type, or a text model without image input here: a warning and a
    text-only server (images 400). A text model given as the projector stops the start
    in one line, as llama-server does."""
    import gguf

    w = gguf.GGUFWriter(path=None, arch="clip")
    w.add_bool("clip.has_vision_encoder", True)
    w.add_string("clip.projector_type", "pixtral")
    w.add_tensor("v.patch_embd.weight", np.zeros((4, 4), np.float32))
    pixtral = tmp_path / "mmproj-pixtral.gguf"
    w.write_header_to_file(pixtral)
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    for overrides in ({"mmproj": pixtral}, {"model": tiny_model}):
        handle = await start(**overrides)
        async with httpx.AsyncClient(base_url=handle.url, timeout=60) as c:
            assert (await c.get("/props")).json()["modalities"]["vision"] is False
            r = await c.post("/completion", json=completion_body(TURN.format("<__media__>"), [png(1)]))
            assert r.status_code == 400 and "does not support multimodal" in r.text
            r = await c.post("/completion", json={"prompt": "hello", "n_predict": 2})
            assert r.status_code == 200
    text, _ = files
    proc = await trio.run_process([sys.executable, "-m", "trio_llm", "serve", "-m", str(text), "--mmproj", str(text),
                                   "--backend", "numpy", "--port", "0", "--no-warmup"],
                                  capture_stdout=True, capture_stderr=True, check=False)
    lines = proc.stderr.decode().strip().splitlines()
    assert proc.returncode == 1 and "not a multimodal projector" in lines[-1], proc.stderr.decode()


async def test_image_larger_than_a_pass(start: Start) -> None:
    """An image is decoded in one pass: with -ub below its rows, a request with one is
    refused (400) and text is still served."""
    handle = await start(ubatch_size=N_IMG // 2)
    async with httpx.AsyncClient(base_url=handle.url, timeout=60) as c:
        r = await c.post("/completion", json=completion_body(TURN.format("<__media__>"), [png(1)]))
        assert r.status_code == 400 and f"takes {N_IMG} positions" in r.text, r.text
        r = await c.post("/completion", json={"prompt": "hello", "n_predict": 2})
        assert r.status_code == 200


async def test_slot_save_restore_and_streamed_chat_with_an_image(start: Start, tmp_path: Path) -> None:
    """A slot that holds an image survives save, erase and restore: the same request
    then reuses it (the image's positions carry its content id in the file); a streamed
    chat with the same image encodes nothing again."""
    handle = await start(slot_save_path=tmp_path, metrics=True)
    text = TURN.format("Look: <__media__> and say")
    media = handle.context.engine.media  # type: ignore[union-attr]
    async with httpx.AsyncClient(base_url=handle.url, timeout=300) as c:
        first = (await c.post("/completion", json=completion_body(text, [png(11)], cache_prompt=True))).json()
        assert media.n_encoded == 1
        r = await c.post("/slots/0?action=save", json={"filename": "img.bin"})
        assert r.status_code == 200 and r.json()["n_saved"] > N_IMG, r.text
        assert (await c.post("/slots/0?action=erase")).status_code == 200
        r = await c.post("/slots/0?action=restore", json={"filename": "img.bin"})
        assert r.status_code == 200, r.text
        again = (await c.post("/completion", json=completion_body(text, [png(11)], cache_prompt=True))).json()
        assert again["tokens"] == first["tokens"]
        assert again["timings"]["prompt_n"] == 1  # all but the last token from the restored cache
        url = "data:image/png;base64," + b64(png(11))
        body = {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                                           {"type": "text", "text": "and now?"}]}],
                "max_tokens": 4, "stream": True}
        events = []
        async with c.stream("POST", "/v1/chat/completions", json=body) as s:
            assert s.status_code == 200
            async for line in s.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    events.append(line)
        assert len(events) >= 2
        assert media.n_encoded == 1  # the same image: from the encoder's cache
        metrics = (await c.get("/metrics")).text
        assert "trio_llm_images_encoded_total 1.0" in metrics
        assert "trio_llm_images_cached_total 2.0" in metrics
        seconds = next(float(ln.split()[-1]) for ln in metrics.splitlines()
                       if ln.startswith("trio_llm_image_encode_seconds_total"))
        assert seconds > 0


async def test_hf_line_takes_the_cached_projector(files: tuple[Path, Path], tmp_path: Path) -> None:
    """A llama-swap line as users write it for gemma-3 (``-hf REPO:QUANT``, no --mmproj),
    as a real process: the projector cached beside the model is loaded (llama.cpp's
    choice among several), /props says vision, and an image is answered; with
    --no-mmproj the same line serves text only."""
    from serve_procs import wait_ready

    text, mmproj = files
    snap = tmp_path / "models--unsloth--gemma-3-4b-it-GGUF" / "snapshots" / ("0" * 40)
    snap.mkdir(parents=True)
    (snap.parent.parent / "refs").mkdir()
    (snap.parent.parent / "refs" / "main").write_text("0" * 40)
    (snap / "gemma-3-4b-it-UD-Q4_K_XL.gguf").symlink_to(text)
    (snap / "mmproj-F16.gguf").symlink_to(mmproj)
    (snap / "mmproj-F32.gguf").write_bytes(b"not chosen: 32 bits are further from 4 than 16")
    env = dict(os.environ, LLAMA_CACHE=str(tmp_path))
    line = ["-hf", "unsloth/gemma-3-4b-it-GGUF:Q4_K_XL", "--ctx-size", "512", "--temp", "1.0", "--top-k", "64",
            "--top-p", "0.95", "--no-warmup", "--port", "0", "--mlock", "--no-mmap", "--backend", "numpy"]
    for extra, vision in (([], True), (["--no-mmproj"], False)):
        proc = await trio.lowlevel.open_process([sys.executable, "-m", "trio_llm", "serve", *line, *extra],
                                                stderr=subprocess.PIPE, env=env)
        try:
            url, _ = await wait_ready(proc, 120)
            async with httpx.AsyncClient(base_url=url, timeout=120) as c:
                assert (await c.get("/props")).json()["modalities"]["vision"] is vision
                r = await c.post("/completion", json=completion_body(TURN.format("<__media__>"), [png(1)]))
                assert r.status_code == (200 if vision else 400), r.text
        finally:
            proc.terminate()
            await proc.wait()


async def test_media_path_file_urls(start: Start, tmp_path: Path) -> None:
    """--media-path: a file:// image answers as the same image sent inline."""
    (tmp_path / "pics").mkdir()
    (tmp_path / "pics" / "one.png").write_bytes(png(12))
    handle = await start(media_path=tmp_path)

    def chat(url: str) -> dict[str, Any]:
        return {"messages": [{"role": "user", "content": [{"type": "text", "text": "see"},
                                                           {"type": "image_url", "image_url": {"url": url}}]}],
                "max_tokens": 6, "temperature": 0.0, "cache_prompt": False}

    async with httpx.AsyncClient(base_url=handle.url, timeout=120) as c:
        by_file = await c.post("/v1/chat/completions", json=chat("file://pics/one.png"))
        inline = await c.post("/v1/chat/completions", json=chat("data:image/png;base64," + b64(png(12))))
        assert by_file.status_code == inline.status_code == 200, by_file.text
        assert by_file.json()["choices"][0]["message"] == inline.json()["choices"][0]["message"]
        r = await c.post("/v1/chat/completions", json=chat("file://../x.png"))
        assert r.status_code == 400 and "not allowed" in r.text


# -- concurrent requests and the encoder (server.media's shared encodes, vision.cancel) --
# The encode of the first request is held still in block 1 (a hook on the tensors it
# reads, in its thread) while the test orders the rest through events: a thread waiting
# is seen on the condition it waits on, a server-side cancellation on the request's
# cancel event or its parse's trio.Cancelled. Nothing asserted depends on timing.


def _held_in_block_1(media: Any, then: Callable[[], None]) -> Any:
    """``media``'s projector watched: ``then()`` runs in the first encode's thread as it
    enters block 1, the encode held there until it returns. The watched tensors."""
    def on_read(name: str) -> None:
        if name == "v.blk.1.ln1.weight":
            then()

    media.projector, tensors = watched(media.projector, on_read)
    return tensors


async def _one_image_twice(start: Start, llamacpp: httpx.Client, seed: int) -> tuple[Any, Any, threading.Event,
                                                                                    dict[str, Any], Any]:
    """A started server whose encoder's condition sets the returned event when a thread
    waits on it, one new image's /completion body, and llama.cpp's answer to it:
    (handle, media, waiting, body, theirs)."""
    handle = await start()
    media = handle.context.engine.media  # type: ignore[union-attr]
    waiting = threading.Event()
    media._cond = WatchedCondition(waiting.set)
    body = completion_body(TURN.format("Look: <__media__> and say"), [png(seed)])
    theirs = await trio.to_thread.run_sync(lambda: llamacpp.post("/completion", json=body).json())
    return handle, media, waiting, body, theirs


async def test_concurrent_requests_for_one_new_image_encode_it_once(start: Start, llamacpp: httpx.Client) -> None:
    """Two requests send one new image at once: the second, sent while the first's
    encode is in block 1, waits for that encode and takes its rows: one encode
    (n_encoded 1, n_cached 1), and both answer as llama.cpp does."""
    handle, media, waiting, body, theirs = await _one_image_twice(start, llamacpp, 20)
    token = trio.lowlevel.current_trio_token()
    answers: list[httpx.Response] = []
    async with httpx.AsyncClient(base_url=handle.url, timeout=300) as c, trio.open_nursery() as nursery:
        async def ask() -> None:
            answers.append(await c.post("/completion", json=body))

        def then() -> None:
            trio.from_thread.run_sync(nursery.start_soon, ask, trio_token=token)
            wait_for(waiting)  # the second request waits for this encode

        tensors = _held_in_block_1(media, then)
        nursery.start_soon(ask)
    assert [r.status_code for r in answers] == [200, 200], [r.text for r in answers]
    for r in answers:
        why = agree(r.json(), theirs)
        assert not why, why
    assert tensors.blocks() == [0, 1]  # one encode
    assert (media.n_encoded, media.n_cached) == (1, 1) and not media._encoding


async def test_the_other_request_takes_over_when_the_first_leaves(start: Start, llamacpp: httpx.Client,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Two requests send one new image at once and the first's client disconnects in
    its encode's block 1, the second waiting for that encode: the second encodes the
    image itself and answers as llama.cpp does; the first's encode is not counted."""
    cancels: list[CancelEvent] = []

    class Recorded(CancelEvent):
        def __init__(self) -> None:
            super().__init__()
            cancels.append(self)

    monkeypatch.setattr(MD, "CancelEvent", Recorded)
    handle, media, waiting, body, theirs = await _one_image_twice(start, llamacpp, 21)
    token = trio.lowlevel.current_trio_token()
    first_scope = trio.CancelScope()
    answers: list[httpx.Response] = []
    async with httpx.AsyncClient(base_url=handle.url, timeout=300) as c, trio.open_nursery() as nursery:
        async def first() -> None:
            with first_scope:
                await c.post("/completion", json=body)

        async def second() -> None:
            answers.append(await c.post("/completion", json=body))

        def then() -> None:
            trio.from_thread.run_sync(nursery.start_soon, second, trio_token=token)
            wait_for(waiting)
            trio.from_thread.run_sync(first_scope.cancel, trio_token=token)  # the first's client leaves
            wait_for(cancels[0])  # the server saw it go: the first's parse is cancelled

        tensors = _held_in_block_1(media, then)
        nursery.start_soon(first)
    assert first_scope.cancelled_caught
    [r] = answers
    assert r.status_code == 200, r.text
    why = agree(r.json(), theirs)
    assert not why, why
    assert tensors.blocks() == [0, 1, 0, 1]  # the first's stopped in block 1, the second's whole
    assert (media.n_encoded, media.n_cached) == (1, 0) and not media._encoding
    assert not siglip._ENCODE_LOCK.locked()


async def test_a_request_waiting_for_the_encoder_leaves_at_once(start: Start, llamacpp: httpx.Client,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """A request for another image waits for the encoder's turn while the first's
    encode holds it (held in block 1); its client disconnects: its parse returns while
    the first's encode is still held, not when the turn would have come. The first
    then answers as llama.cpp does, the second's image was never encoded, and the
    encoder's lock is free with no one waiting."""
    waiting, gone = threading.Event(), threading.Event()
    lock = TurnLock(cond=WatchedCondition(waiting.set))
    monkeypatch.setattr(siglip, "_ENCODE_LOCK", lock)
    run = MD.run_sync_cancellable

    async def recorded(fn: Callable[[threading.Event], Any]) -> Any:
        try:
            return await run(fn)
        except trio.Cancelled:
            gone.set()  # the parse's thread has ended (the call waits for it)
            raise

    monkeypatch.setattr(MD, "run_sync_cancellable", recorded)
    handle = await start()
    media = handle.context.engine.media  # type: ignore[union-attr]
    token = trio.lowlevel.current_trio_token()
    body = completion_body(TURN.format("Look: <__media__> and say"), [png(22)])
    other = completion_body(TURN.format("And <__media__>?"), [png(23)])
    theirs = await trio.to_thread.run_sync(lambda: llamacpp.post("/completion", json=body).json())
    second_scope = trio.CancelScope()
    answers: list[httpx.Response] = []
    async with httpx.AsyncClient(base_url=handle.url, timeout=300) as c, trio.open_nursery() as nursery:
        async def first() -> None:
            answers.append(await c.post("/completion", json=body))

        async def second() -> None:
            with second_scope:
                await c.post("/completion", json=other)

        def then() -> None:
            trio.from_thread.run_sync(nursery.start_soon, second, trio_token=token)
            wait_for(waiting)  # the second waits for the encoder's turn
            trio.from_thread.run_sync(second_scope.cancel, trio_token=token)  # its client leaves
            wait_for(gone)  # its parse is over, this encode still in block 1

        tensors = _held_in_block_1(media, then)
        nursery.start_soon(first)
    assert second_scope.cancelled_caught
    [r] = answers
    assert r.status_code == 200, r.text
    why = agree(r.json(), theirs)
    assert not why, why
    assert tensors.blocks() == [0, 1]  # the first's encode only
    assert (media.n_encoded, media.n_cached) == (1, 0) and len(media._cache) == 1 and not media._encoding
    assert not lock.locked() and lock.n_waiting == 0

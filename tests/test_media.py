"""Images in prompts, the server's side (server/media.py, the slots' planning, -hf's
projector): pure functions, no model."""

from __future__ import annotations

import base64
from pathlib import Path

import numpy as np
import pytest

from trio_llm.errors import ConfigError, InvalidRequest
from trio_llm.model.hf_cache import find_mmproj
from trio_llm.server import media as MD
from trio_llm.server.slots import Work, plan_batch

IMG = -7  # a media id


def test_media_runs_and_cut() -> None:
    p = [2, 5, IMG, IMG, IMG, 6, -9, -9, 4]
    assert MD.media_runs(p) == [(2, 5), (6, 8)]
    # a prefix that ends inside an image goes back to the image's start
    assert MD.cut_before_media(p, 3) == 2
    assert MD.cut_before_media(p, 4) == 2
    assert MD.cut_before_media(p, 7) == 6
    # at a boundary, or in text: unchanged
    for keep in (0, 1, 2, 5, 6, 8, 9):
        assert MD.cut_before_media(p, keep) == keep


def test_render_writes_the_marker() -> None:
    def decode(ids: list[int]) -> str:
        assert all(i >= 0 for i in ids)
        return "".join(f"[{i}]" for i in ids)

    assert MD.render([1, IMG, IMG, 2, 3], decode) == "[1]<__media__>[2][3]"


def test_media_id_is_content_and_int32() -> None:
    a = np.arange(12, dtype=np.uint8).reshape(2, 2, 3)
    b = a.copy()
    b[0, 0, 0] = 99
    assert MD.media_id(a) == MD.media_id(a.copy())
    assert MD.media_id(a) != MD.media_id(b)
    # the same bytes in another shape are another image
    assert MD.media_id(a) != MD.media_id(a.reshape(1, 4, 3))
    for x in (a, b):
        assert -(2**31) <= MD.media_id(x) < 0


def test_image_urls() -> None:
    data = b"\x89PNG not really"
    url = "data:image/png;base64," + base64.b64encode(data).decode()
    assert MD.image_url_bytes(url) == data
    for bad, why in [("file://a.png", "unless --media-path"),
                     ("data:image/png,rawbytes", "must be base64"), ("", "non-empty"), (3, "non-empty"),
                     ("nonsense", "Invalid image_url")]:
        with pytest.raises(InvalidRequest, match=why):
            MD.image_url_bytes(bad)


def test_file_urls_under_media_path(tmp_path: Path) -> None:
    """llama-server's --media-path: relative file:// paths inside the directory, nothing
    outside it (no .., no absolute path, no symlink out)."""
    root = tmp_path / "media"
    (root / "sub").mkdir(parents=True)
    (root / "sub" / "a.png").write_bytes(b"A")
    (tmp_path / "secret.png").write_bytes(b"S")
    (root / "link.png").symlink_to(tmp_path / "secret.png")
    assert MD.image_url_bytes("file://sub/a.png", root) == b"A"
    for bad in ("file://../secret.png", "file://sub/../../secret.png", "file:///etc/passwd", "file://link.png",
                "file://", "file://sub//a.png"):
        with pytest.raises(InvalidRequest, match="not allowed"):
            MD.image_url_bytes(bad, root)
    with pytest.raises(InvalidRequest, match="does not exist"):
        MD.image_url_bytes("file://sub/none.png", root)


async def test_remote_urls_are_fetched() -> None:
    """http(s) image URLs are fetched as llama-server fetches them (a real server on
    loopback), on trio before the parse: the body, an HTTP error, a body over the size
    limit, a refused connection; the parse takes them from what was fetched."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    big = b"x" * (MD.REMOTE_MAX_BYTES + 1)
    paths: list[str] = []

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            paths.append(self.path)
            body = {"/a.png": b"PNGDATA", "/big.png": big}.get(self.path)
            self.send_response(200 if body is not None else 404)
            self.send_header("Content-Length", str(len(body or b"")))
            self.end_headers()
            self.wfile.write(body or b"")

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        assert await MD.fetch_image(base + "/a.png") == b"PNGDATA"
        with pytest.raises(InvalidRequest, match="HTTP 404"):
            await MD.fetch_image(base + "/none.png")
        with pytest.raises(InvalidRequest, match="larger than"):
            await MD.fetch_image(base + "/big.png")
        # every remote image of the messages, each URL once
        part = {"type": "image_url", "image_url": {"url": base + "/a.png"}}
        messages = [{"role": "user", "content": [part, {"type": "text", "text": "and"}, part]}]
        paths.clear()
        fetched = await MD.fetch_images(messages)
        assert fetched == {base + "/a.png": b"PNGDATA"} and paths == ["/a.png"]
        assert MD.extract_images(messages, "<m>", fetched=fetched)[1] == [b"PNGDATA", b"PNGDATA"]
    finally:
        server.shutdown()
        server.server_close()
    with pytest.raises(InvalidRequest, match="Failed to download image"):
        await MD.fetch_image(base + "/a.png")  # nobody listens there now


def test_extract_images() -> None:
    url = "data:image/png;base64," + base64.b64encode(b"one").decode()
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "what is"}, {"type": "image_url", "image_url": {"url": url}},
                                     {"type": "text", "text": "this?"}]},
    ]
    out, images = MD.extract_images(messages, "<m>")
    assert images == [b"one"]
    assert out[0] == messages[0]
    # the marker is glued to the text on both sides (llama-server's join)
    assert out[1]["content"] == [{"type": "text", "text": "what is<m>this?"}]
    assert messages[1]["content"][1]["type"] == "image_url"  # the request's copy is untouched
    with pytest.raises(InvalidRequest, match="provide the mmproj"):
        MD.extract_images(messages, None)
    with pytest.raises(InvalidRequest, match="audio"):
        MD.extract_images([{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}], "<m>")


def test_extract_images_joins_as_llama_server() -> None:
    """What llama-server's /apply-template gives for these part lists (checked with the
    xllamacpp wheel): text parts joined by newlines, a marker glued to its neighbours."""
    img = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}

    def text(t: str) -> dict[str, str]:
        return {"type": "text", "text": t}

    cases = [([img, text("a")], ["<m>a"]), ([text("a"), img], ["a<m>"]),
             ([text("a"), text("b"), img, text("c")], ["a", "b<m>c"]), ([img, img], ["<m><m>"]),
             ([text("a"), img, text("b"), text("c")], ["a<m>b", "c"])]
    for parts, want in cases:
        out, images = MD.extract_images([{"role": "user", "content": parts}], "<m>")
        assert [p["text"] for p in out[0]["content"]] == want and len(images) == parts.count(img)


def test_media_marker() -> None:
    """LLAMA_MEDIA_MARKER if set, else a random marker per process (llama-server's)."""
    assert MD.media_marker({"LLAMA_MEDIA_MARKER": "<__media__>"}) == "<__media__>"
    a, b = MD.media_marker({}), MD.media_marker({})
    assert a != b and a.startswith("<__media_") and a.endswith("__>") and a != MD.MARKER
    with pytest.raises(ConfigError, match="must not be empty"):
        MD.media_marker({"LLAMA_MEDIA_MARKER": ""})


def test_plan_batch_keeps_an_image_whole() -> None:
    rows = np.zeros((6, 4), np.float32)
    img = Work(1, (IMG,) * 6, 10, False, rows)
    text = Work(2, (5, 6, 7, 8), 0, False)
    dec = Work(0, (9,), 30, True)
    # room for everything: the image whole, then text
    plan = plan_batch([dec, img, text], 16)
    assert [w.id_slot for w in plan] == [0, 1, 2] and plan[1] is img
    # past the budget beside decoding tokens only: whole all the same (many decoding
    # slots must not hold it back for ever); the prompt after it waits
    plan = plan_batch([dec, img, text], 5)
    assert [w.id_slot for w in plan] == [0, 1] and plan[1] is img
    # beside another prompt's chunk that used the room, it waits for a later pass
    plan = plan_batch([dec, text, img], 5)
    assert [w.id_slot for w in plan] == [0, 2] and plan[1].tokens == (5, 6, 7, 8)
    # alone it goes whole even past the budget (it cannot be split)
    plan = plan_batch([img], 4)
    assert plan == [img]


def _snapshot(cache: Path, repo: str, files: list[str]) -> Path:
    snap = cache / ("models--" + repo.replace("/", "--")) / "snapshots" / ("0" * 40)
    for f in files:
        (snap / f).parent.mkdir(parents=True, exist_ok=True)
        (snap / f).write_bytes(b"GGUF")
    return snap


def test_find_mmproj_hub_layout(tmp_path: Path) -> None:
    snap = _snapshot(tmp_path, "ggml-org/gemma-3-4b-it-GGUF", [
        "gemma-3-4b-it-Q4_K_M.gguf", "mmproj-model-f16.gguf", "mmproj-model-f32.gguf",
        "sub/gemma-3-4b-it-Q8_0.gguf", "sub/mmproj-Q8_0.gguf", "other/mmproj-f16.gguf",
    ])
    # the model's own directory first; among those, the nearest bit depth (4: f16 before f32)
    assert find_mmproj(snap / "gemma-3-4b-it-Q4_K_M.gguf", "ggml-org/gemma-3-4b-it-GGUF") == snap / "mmproj-model-f16.gguf"
    # a deeper directory that holds the model wins over its parent's
    assert find_mmproj(snap / "sub/gemma-3-4b-it-Q8_0.gguf", "x/y") == snap / "sub/mmproj-Q8_0.gguf"
    snap2 = _snapshot(tmp_path, "a/b", ["m-Q4_K_M.gguf", "other/mmproj-f16.gguf"])
    assert find_mmproj(snap2 / "m-Q4_K_M.gguf", "a/b") is None  # not in a directory above the model


def test_find_mmproj_flat_layout(tmp_path: Path) -> None:
    for name in ["unsloth_gemma-3-4b-it-GGUF_gemma-3-4b-it-Q4_K_M.gguf", "unsloth_gemma-3-4b-it-GGUF_mmproj-F16.gguf",
                 "unsloth_other-GGUF_mmproj-F16.gguf"]:
        (tmp_path / name).write_bytes(b"GGUF")
    model = tmp_path / "unsloth_gemma-3-4b-it-GGUF_gemma-3-4b-it-Q4_K_M.gguf"
    assert find_mmproj(model, "unsloth/gemma-3-4b-it-GGUF:Q4_K_M") == tmp_path / "unsloth_gemma-3-4b-it-GGUF_mmproj-F16.gguf"
    assert find_mmproj(model, "someone/else") is None

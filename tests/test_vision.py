"""gemma-3 vision (``trio_llm.vision``): the mmproj loader, llama.cpp's preprocessing and
the numpy SigLIP encoder.

The encoder is checked against Hugging Face's ``SiglipVisionModel`` and
``Gemma3MultiModalProjector`` with the weights read back from a synthetic mmproj, and
against llama.cpp itself (xllamacpp: it loads the synthetic file and, with
``MTMD_DEBUG_EMBEDDINGS`` naming a file, dumps the embeddings it computed for an
image sent through its server). The resize is checked against Pillow's own
``Image.resize(BILINEAR)``, the C code llama.cpp's ``resize_pillow`` was ported from,
and on a 2x2 image by hand.
"""

from __future__ import annotations

import base64
import io
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from trio_llm.errors import InvalidRequest, ModelLoadError
from trio_llm.vision import Projector, decode_image, load_projector, preprocess
from trio_llm.vision import synth as vsynth
from trio_llm.vision.image import fit_to_square, resize_bilinear_pillow
from trio_llm.vision.mmproj import UnsupportedProjector
from trio_llm.vision.siglip import Hparams, tensor_shapes

TINY = dict(n_embd_text=256, image_size=64, patch_size=8, n_embd=64, n_ff=128, n_head=4, n_layer=2,
            n_merge=2)


@pytest.fixture(scope="module")
def mmproj_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("mmproj")


def _tiny(directory: Path, wtype: str = "f16", **over: int) -> Path:
    kw = {**TINY, **over}
    name = f"mm-{wtype}-" + "-".join(f"{k}{v}" for k, v in sorted(over.items())) + ".gguf"
    path = directory / name
    return path if path.exists() else vsynth.write_mmproj(path, wtype=wtype, **kw)  # type: ignore[arg-type]


# ---------------------------------------------------------------- the loader


def test_load_tiny_projector(mmproj_dir: Path) -> None:
    proj = load_projector(_tiny(mmproj_dir))
    assert isinstance(proj, Projector)
    assert (proj.image_size, proj.patch_size, proj.n_merge) == (64, 8, 2)
    assert proj.n_tokens == ((64 // 8) // 2) ** 2 == 16
    assert proj.n_embd_out == 256
    assert proj.image_mean == proj.image_std == (0.5, 0.5, 0.5)
    assert proj.hparams.ffn_op == "gelu" and proj.hparams.eps == 1e-6
    assert proj.path == mmproj_dir / proj.path.name


def test_default_pool_is_four_when_the_key_is_absent(mmproj_dir: Path) -> None:
    # the converter writes clip.vision.projector.scale_factor only when it is not 4
    path = _tiny(mmproj_dir, n_merge=4)
    proj = load_projector(path)
    assert "clip.vision.projector.scale_factor" not in proj.metadata
    assert proj.n_merge == 4 and proj.n_tokens == 4


@pytest.mark.parametrize("wtype", ["f32", "f16", "q8_0"])
def test_tensor_types_as_the_converter_writes_them(mmproj_dir: Path, wtype: str) -> None:
    proj = load_projector(_tiny(mmproj_dir, wtype))
    types = {n: t.ggml_type.name for n, t in proj._tensors.items()}
    assert types["v.patch_embd.weight"] == types["v.position_embd.weight"] == "F32"
    assert types["mm.input_projection.weight"] == "F16"
    assert types["v.blk.0.ln1.weight"] == types["v.blk.1.ffn_up.bias"] == "F32"
    assert types["v.blk.1.attn_q.weight"] == wtype.upper()
    assert proj.metadata["general.architecture"] == "clip"
    assert proj.metadata["general.type"] == "mmproj"


def _one_line(exc: pytest.ExceptionInfo[ModelLoadError], path: Path) -> str:
    text = str(exc.value)
    assert "\n" not in text and text.startswith(str(path))
    return text


def test_refuses_a_text_model(model_path) -> None:  # type: ignore[no-untyped-def]
    path = model_path("tiny-gemma3", "Q8_0")
    with pytest.raises(ModelLoadError) as exc:
        load_projector(path)
    assert not isinstance(exc.value, UnsupportedProjector)  # a wrong file: the server does not start
    assert "general.architecture is 'gemma3'" in _one_line(exc, path)


def _bare_clip(path: Path, **kv: object) -> Path:
    import gguf

    w = gguf.GGUFWriter(path=None, arch="clip")
    for key, value in kv.items():
        key = key.replace("__", ".")
        if isinstance(value, bool):
            w.add_bool(key, value)
        else:
            w.add_string(key, str(value))
    w.add_tensor("v.patch_embd.weight", np.zeros((4, 4), np.float32))
    w.write_header_to_file(path)
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_refuses_other_projector_types(tmp_path: Path) -> None:
    path = _bare_clip(tmp_path / "pixtral.gguf", clip__has_vision_encoder=True, clip__projector_type="pixtral")
    with pytest.raises(UnsupportedProjector) as exc:
        load_projector(path)
    assert "projector type 'pixtral' is not supported" in _one_line(exc, path)


def test_refuses_an_audio_only_projector(tmp_path: Path) -> None:
    path = _bare_clip(tmp_path / "audio.gguf", clip__has_audio_encoder=True, clip__projector_type="ultravox")
    with pytest.raises(UnsupportedProjector) as exc:
        load_projector(path)
    assert "audio only" in _one_line(exc, path)


def test_refuses_truncated_and_non_gguf_files(mmproj_dir: Path, tmp_path: Path) -> None:
    whole = _tiny(mmproj_dir).read_bytes()
    for cut in (len(whole) // 2, 100, 10):
        path = tmp_path / f"cut{cut}.gguf"
        path.write_bytes(whole[:cut])
        with pytest.raises(ModelLoadError) as exc:
            load_projector(path)
        assert "truncated" in _one_line(exc, path)
    path = tmp_path / "text.gguf"
    path.write_bytes(b"hello, not a model")
    with pytest.raises(ModelLoadError) as exc:
        load_projector(path)
    assert "not a GGUF file" in _one_line(exc, path)
    with pytest.raises(ModelLoadError) as exc:
        load_projector(tmp_path / "absent.gguf")
    assert "no such file" in str(exc.value)


def test_refuses_missing_tensors_and_wrong_shapes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def without_post_ln(hp: Hparams) -> dict[str, tuple[int, ...]]:
        shapes = tensor_shapes(hp)
        del shapes["v.post_ln.bias"]
        return shapes

    def wide_ffn(hp: Hparams) -> dict[str, tuple[int, ...]]:
        shapes = tensor_shapes(hp)
        shapes["v.blk.1.ffn_up.weight"] = (hp.n_ff + 32, hp.n_embd)
        return shapes

    monkeypatch.setattr(vsynth, "tensor_shapes", without_post_ln)
    path = vsynth.write_mmproj(tmp_path / "missing.gguf", **TINY)  # type: ignore[arg-type]
    with pytest.raises(ModelLoadError) as exc:
        load_projector(path)
    assert "missing tensor 'v.post_ln.bias'" in _one_line(exc, path)
    monkeypatch.setattr(vsynth, "tensor_shapes", wide_ffn)
    path = vsynth.write_mmproj(tmp_path / "wide.gguf", **TINY)  # type: ignore[arg-type]
    with pytest.raises(ModelLoadError) as exc:
        load_projector(path)
    assert "'v.blk.1.ffn_up.weight' has shape (160, 64), expected (128, 64)" in _one_line(exc, path)


# ---------------------------------------------------------------- the encoder against transformers


def _hf_reference(proj: Projector):  # type: ignore[no-untyped-def]
    """SiglipVisionModel + Gemma3MultiModalProjector holding the file's weights."""
    torch = pytest.importorskip("torch")
    from transformers import Gemma3Config, SiglipVisionConfig
    from transformers.models.gemma3.configuration_gemma3 import Gemma3TextConfig
    from transformers.models.gemma3.modeling_gemma3 import Gemma3MultiModalProjector
    from transformers.models.siglip.modeling_siglip import SiglipVisionModel

    hp = proj.hparams
    vcfg = SiglipVisionConfig(hidden_size=hp.n_embd, intermediate_size=hp.n_ff, num_hidden_layers=hp.n_layer,
                              num_attention_heads=hp.n_head, image_size=hp.image_size, patch_size=hp.patch_size,
                              layer_norm_eps=hp.eps, hidden_act="gelu_pytorch_tanh", num_channels=3,
                              vision_use_head=False)
    vcfg._attn_implementation = "eager"
    tower = SiglipVisionModel(vcfg).eval()
    cfg = Gemma3Config(vision_config=vcfg.to_dict(), text_config=Gemma3TextConfig(hidden_size=hp.n_embd_out).to_dict(),
                       mm_tokens_per_image=hp.n_tokens)
    head = Gemma3MultiModalProjector(cfg).eval()

    def w(name: str):  # type: ignore[no-untyped-def]
        return torch.from_numpy(proj._tensors[name].dequantize())

    state = {
        "vision_model.embeddings.patch_embedding.weight": w("v.patch_embd.weight"),
        "vision_model.embeddings.patch_embedding.bias": w("v.patch_embd.bias"),
        "vision_model.embeddings.position_embedding.weight": w("v.position_embd.weight"),
        "vision_model.post_layernorm.weight": w("v.post_ln.weight"),
        "vision_model.post_layernorm.bias": w("v.post_ln.bias"),
    }
    ours = {"layer_norm1": "ln1", "layer_norm2": "ln2", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
            "self_attn.v_proj": "attn_v", "self_attn.out_proj": "attn_out", "mlp.fc1": "ffn_up", "mlp.fc2": "ffn_down"}
    for il in range(hp.n_layer):
        for hf, gg in ours.items():
            for kind in ("weight", "bias"):
                state[f"vision_model.encoder.layers.{il}.{hf}.{kind}"] = w(f"v.blk.{il}.{gg}.{kind}")
    if "embeddings.patch_embedding.weight" in tower.state_dict():  # transformers 5 has no vision_model.
        state = {k.removeprefix("vision_model."): t for k, t in state.items()}
    missing, unexpected = tower.load_state_dict(state, strict=False)
    assert not unexpected and all("position_ids" in m for m in missing), (missing, unexpected)
    head.load_state_dict({
        "mm_input_projection_weight": w("mm.input_projection.weight"),
        "mm_soft_emb_norm.weight": w("mm.soft_emb_norm.weight") - 1.0,  # the converter stored 1 + w
    })

    def run(pixels: np.ndarray) -> np.ndarray:
        with torch.no_grad():
            x = torch.from_numpy(pixels)[None]  # [1, 3, S, S]
            hidden = tower(pixel_values=x).last_hidden_state  # [1, n_patches, n_embd]
            return head(hidden)[0].numpy()  # [n_tokens, n_embd_out]

    return run


@pytest.mark.reference
@pytest.mark.parametrize("wtype", ["f32", "f16", "q8_0"])
def test_encoder_matches_transformers(mmproj_dir: Path, wtype: str) -> None:
    proj = load_projector(_tiny(mmproj_dir, wtype))
    run = _hf_reference(proj)
    rng = np.random.default_rng(7)
    for _ in range(2):
        pixels = rng.uniform(-1.0, 1.0, (3, 64, 64)).astype(np.float32)
        ours = proj.encode(pixels)
        theirs = run(pixels)
        assert ours.shape == theirs.shape == (16, 256) and ours.dtype == np.float32
        err = float(np.abs(ours - theirs).max() / np.abs(theirs).max())
        assert err < 5e-5, err


@pytest.mark.reference
def test_encoder_matches_transformers_with_gemma3s_pool(mmproj_dir: Path) -> None:
    # the default pool of 4 over 16 patches a side, odd head count
    proj = load_projector(_tiny(mmproj_dir, "f32", image_size=64, patch_size=4, n_merge=4, n_head=2, n_layer=1))
    pixels = np.random.default_rng(3).uniform(-1.0, 1.0, (3, 64, 64)).astype(np.float32)
    ours, theirs = proj.encode(pixels), _hf_reference(proj)(pixels)
    assert ours.shape == (16, 256)
    assert float(np.abs(ours - theirs).max() / np.abs(theirs).max()) < 5e-5


def test_encode_refuses_wrong_pixel_shapes(mmproj_dir: Path) -> None:
    proj = load_projector(_tiny(mmproj_dir))
    with pytest.raises(ValueError, match=r"pixels must be \[3, 64, 64\]"):
        proj.encode(np.zeros((64, 64, 3), np.float32))


# ---------------------------------------------------------------- preprocessing


def test_preprocess_shape_and_normalisation(mmproj_dir: Path) -> None:
    proj = load_projector(_tiny(mmproj_dir))
    img = np.zeros((64, 64, 3), np.uint8)
    img[..., 0], img[..., 1], img[..., 2] = 255, 0, 51
    x = preprocess(img, proj)
    assert x.shape == (3, 64, 64) and x.dtype == np.float32
    # (v / 255 - 0.5) / 0.5, in float32
    assert np.all(x[0] == 1.0) and np.all(x[1] == -1.0)
    want = (np.float32(51) / np.float32(255) - np.float32(0.5)) / np.float32(0.5)
    assert np.all(x[2] == want)


def test_image_at_image_size_passes_through(mmproj_dir: Path) -> None:
    proj = load_projector(_tiny(mmproj_dir))
    img = np.random.default_rng(0).integers(0, 256, (64, 64, 3), dtype=np.uint8)
    assert np.array_equal(fit_to_square(img, 64), img)
    x = preprocess(img, proj)
    assert np.array_equal(np.round((x * 0.5 + 0.5) * 255).astype(np.uint8), img.transpose(2, 0, 1))


@pytest.mark.parametrize("side", [1, 2, 20, 63, 65, 200])
def test_constant_square_image_stays_constant(side: int) -> None:
    img = np.full((side, side, 3), (17, 130, 250), np.uint8)
    out = fit_to_square(img, 64)
    assert out.shape == (64, 64, 3)
    assert np.all(out == np.array([17, 130, 250], np.uint8))


def test_two_by_two_upscale_by_hand() -> None:
    # Pillow's triangle filter at scale 1/2 (llama.cpp's resize_pillow): 1-D weights
    # [1], [3/4, 1/4], [1/4, 3/4], [1] in 22-bit fixed point, each pass rounding half up
    # to uint8: (0, 255) -> 0, 64, 191, 255; then (64, 191) -> 64, 96, 159, 191
    img = np.array([[0, 255], [255, 0]], np.uint8)[:, :, None].repeat(3, axis=2)
    want = np.array([[0, 64, 191, 255],
                     [64, 96, 159, 191],
                     [191, 159, 96, 64],
                     [255, 191, 64, 0]], np.uint8)
    out = fit_to_square(img, 4)
    for c in range(3):
        assert np.array_equal(out[:, :, c], want)


@pytest.mark.parametrize(("src", "dst"), [((50, 70), (33, 46)), ((7, 5), (64, 37)), ((300, 200), (64, 64)),
                                          ((64, 3), (64, 1)), ((1, 9), (5, 9)), ((897, 1201), (896, 669))])
def test_resize_is_pillows_bilinear(src: tuple[int, int], dst: tuple[int, int]) -> None:
    (h, w), (dh, dw) = src, dst
    img = np.random.default_rng(h * 1000 + w).integers(0, 256, (h, w, 3), dtype=np.uint8)
    ours = resize_bilinear_pillow(img, dw, dh)
    theirs = np.asarray(Image.fromarray(img).resize((dw, dh), Image.Resampling.BILINEAR))
    assert np.array_equal(ours, theirs)


def test_non_square_image_is_fitted_and_padded_with_black() -> None:
    img = np.full((50, 70, 3), 200, np.uint8)
    out = fit_to_square(img, 64)
    # scale = min(64/70, 64/50): 70 -> 64, 50 -> ceil(45.71) = 46, centred at row (64 - 46) // 2 = 9
    assert np.all(out[:9] == 0) and np.all(out[9 + 46:] == 0)
    assert np.all(out[9:9 + 46] == 200)
    tall = fit_to_square(np.full((70, 50, 3), 200, np.uint8), 64)
    assert np.all(tall[:, :9] == 0) and np.all(tall[:, 55:] == 0) and np.all(tall[:, 9:55] == 200)


# ---------------------------------------------------------------- decoding


def _encode(img: Image.Image, fmt: str = "PNG", **kw: object) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format=fmt, **kw)
    return buf.getvalue()


def test_decode_png_modes() -> None:
    rng = np.random.default_rng(5)
    rgb = rng.integers(0, 256, (9, 13, 3), dtype=np.uint8)
    assert np.array_equal(decode_image(_encode(Image.fromarray(rgb))), rgb)
    # RGBA: stb_image drops alpha, even where it is 0 (no compositing)
    alpha = rng.integers(0, 256, (9, 13, 1), dtype=np.uint8)
    alpha[0, 0] = 0
    got = decode_image(_encode(Image.fromarray(np.concatenate([rgb, alpha], axis=2), "RGBA")))
    assert np.array_equal(got, rgb)
    # greyscale (and grey + alpha) replicated to three channels
    grey = rng.integers(0, 256, (9, 13), dtype=np.uint8)
    assert np.array_equal(decode_image(_encode(Image.fromarray(grey, "L"))), grey[:, :, None].repeat(3, axis=2))
    la = Image.fromarray(np.stack([grey, grey[::-1]], axis=2), "LA")
    assert np.array_equal(decode_image(_encode(la)), grey[:, :, None].repeat(3, axis=2))
    # palette expanded
    pal = Image.fromarray(rgb).quantize(colors=16)
    want = np.asarray(pal.convert("RGB"))
    assert np.array_equal(decode_image(_encode(pal)), want)
    assert len(np.unique(want.reshape(-1, 3), axis=0)) <= 16
    # 16-bit grey: the high byte, as stb_image's 16 -> 8 bit conversion
    deep = rng.integers(0, 65536, (9, 13), dtype=np.uint16)
    im16 = Image.fromarray(deep)
    assert im16.mode == "I;16"
    got16 = decode_image(_encode(im16))
    assert np.array_equal(got16, (deep >> 8).astype(np.uint8)[:, :, None].repeat(3, axis=2))


def test_decode_jpeg_is_close() -> None:
    smooth = np.linspace(0, 255, 32 * 32 * 3).reshape(32, 32, 3).astype(np.uint8)
    got = decode_image(_encode(Image.fromarray(smooth), "JPEG", quality=95))
    assert got.shape == (32, 32, 3) and got.dtype == np.uint8
    assert np.abs(got.astype(int) - smooth).max() < 16


@pytest.mark.parametrize("data", [b"", b"garbage bytes, not an image", b"\x89PNG\r\n\x1a\n" + b"\0" * 20])
def test_decode_garbage_is_invalid_request(data: bytes) -> None:
    with pytest.raises(InvalidRequest) as exc:
        decode_image(data)
    assert str(exc.value).startswith("failed to load image") and "\n" not in str(exc.value)


def test_decode_truncated_png_is_invalid_request() -> None:
    whole = _encode(Image.fromarray(np.random.default_rng(1).integers(0, 256, (40, 40, 3), dtype=np.uint8)))
    with pytest.raises(InvalidRequest, match="^failed to load image"):
        decode_image(whole[: len(whole) // 2])


def test_decode_refuses_formats_stb_image_cannot_read() -> None:
    img = Image.fromarray(np.zeros((4, 4, 3), np.uint8))
    with pytest.raises(InvalidRequest, match="TIFF images are not supported"):
        decode_image(_encode(img, "TIFF"))


# ---------------------------------------------------------------- llama.cpp itself


@pytest.mark.slow
def test_llamacpp_loads_the_synthetic_mmproj_and_agrees(
        model_path, mmproj_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    """llama-server (xllamacpp) loads tiny-gemma3 with our mmproj and answers a request with
    an image; its image embeddings (dumped by MTMD_DEBUG_EMBEDDINGS) are ours to 3e-3
    (its CPU GELU reads an f16 table; the weights are f32, flash attention off)."""
    xllamacpp = pytest.importorskip("xllamacpp")
    import httpx

    dump = tmp_path / "embd.bin"
    monkeypatch.setenv("MTMD_DEBUG_EMBEDDINGS", str(dump))
    mmproj = _tiny(mmproj_dir, "f32")
    from llamacpp_ref import server_params

    params = server_params(model_path("tiny-gemma3", "Q8_0"), 256)
    params.mmproj.path = str(mmproj)
    params.mmproj_use_gpu = False
    params.flash_attn_type = xllamacpp.llama_flash_attn_type.LLAMA_FLASH_ATTN_TYPE_DISABLED
    server = xllamacpp.Server(params)  # raises if llama.cpp refuses the projector
    img = np.random.default_rng(11).integers(0, 256, (50, 70, 3), dtype=np.uint8)
    url = "data:image/png;base64," + base64.b64encode(_encode(Image.fromarray(img))).decode()
    body = {"messages": [{"role": "user", "content": [{"type": "text", "text": "what is it?"},
                                                      {"type": "image_url", "image_url": {"url": url}}]}],
            "max_tokens": 1, "temperature": 0.0}
    try:
        with httpx.Client(base_url=server.listening_address, timeout=60.0) as client:
            r = client.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
    finally:
        del server
    # the pinned wheel's llama.cpp (October 2026) writes the dump: its absence is a failure
    assert dump.exists(), "llama.cpp wrote no MTMD_DEBUG_EMBEDDINGS dump"
    raw = dump.read_bytes()
    n_tokens, n_embd = np.frombuffer(raw[:8], np.int32)
    theirs = np.frombuffer(raw[8:], np.float32).reshape(n_tokens, n_embd)
    proj = load_projector(mmproj)
    ours = proj.encode(preprocess(decode_image(_encode(Image.fromarray(img))), proj))
    assert ours.shape == theirs.shape == (16, 256)
    assert float(np.abs(ours - theirs).max()) < 3e-3 * float(np.abs(theirs).max())

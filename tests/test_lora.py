"""LoRA adapters (llama-server's --lora / --lora-scaled): greedy continuations agree
with llama.cpp's (xllamacpp with the same adapters and scales) on both backends; a
backend without the deltas fails the same rule; what cannot run is refused in one line,
and the request field / endpoints follow llama-server's where the scales are fixed."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import xllamacpp

from llamacpp_ref import Reference, agree, our_greedy, plain_prompt, server_piece
from trio_llm.engine.reference import NumpyBackend
from trio_llm.errors import ModelLoadError, UnsupportedModelError
from trio_llm.model.gguf import load_gguf
from trio_llm.model.synth import make_model
from trio_llm.model.tokenizer import Tokenizer

N_CTX = 96


def write_adapter(path: Path, model: Path, weights: list[str], *, rank: int = 4, alpha: float = 8.0,
                  seed: int = 0, arch: str | None = None, size: float = 0.3) -> Path:
    """A LoRA adapter GGUF as llama.cpp's convert_lora_to_gguf writes one (F32 tensors)."""
    m = load_gguf(model)
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(path=None, arch=arch or m.config.arch)
    w.add_string("general.type", "adapter")
    w.add_string("adapter.type", "lora")
    w.add_float32("adapter.lora.alpha", alpha)
    for name in weights:
        n_out, n_in = m.tensors[name].shape
        w.add_tensor(name + ".lora_a", (rng.standard_normal((rank, n_in)) * size).astype(np.float32))
        w.add_tensor(name + ".lora_b", (rng.standard_normal((n_out, rank)) * size).astype(np.float32))
    w.write_header_to_file(path)
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


WEIGHTS = ["blk.0.attn_q.weight", "blk.0.attn_v.weight", "blk.1.ffn_down.weight", "blk.1.attn_output.weight"]


def _reference(model: Path, adapters: list[tuple[Path, float]]) -> Reference:
    ref = Reference.__new__(Reference)
    from llamacpp_ref import server_params

    params = server_params(model, N_CTX)
    infos = []
    for path, scale in adapters:
        info = xllamacpp.CommonAdapterLoraInfo()
        info.path, info.scale = str(path), scale
        infos.append(info)
    params.lora_adapters = infos
    import httpx

    ref._server = xllamacpp.Server(params)
    ref._client = httpx.Client(base_url=ref._server.listening_address, timeout=60.0)
    return ref


def _backend(kind: str, model: Any) -> Any:
    if kind == "numpy":
        return NumpyBackend(model, n_ctx=N_CTX, n_seq=1)
    from trio_llm.vulkan.backend import VulkanBackend

    return VulkanBackend(model, n_ctx=N_CTX, n_seq=1)


@pytest.mark.parametrize("kind", ["numpy", pytest.param("vulkan", marks=pytest.mark.vulkan)])
@pytest.mark.parametrize("preset", ["tiny", "tiny-qwen3"])
def test_adapters_agree_with_llamacpp(tmp_path: Path, preset: str, kind: str) -> None:
    model = make_model(preset, "F32", tmp_path / "m.gguf", sharp=True)
    one = write_adapter(tmp_path / "a.gguf", model, WEIGHTS, seed=1)
    two = write_adapter(tmp_path / "b.gguf", model, WEIGHTS[:2], rank=2, alpha=0.0, seed=2)
    adapters = [(one, 0.7), (two, 0.5)]
    ours = load_gguf(model, {"lora": [(str(p), s) for p, s in adapters]})
    assert len(ours.config.lora) == 6 and ours.config.lora[0][3] == pytest.approx(0.7 * 8.0 / 4)
    tok = Tokenizer.from_metadata(ours.metadata)
    prompt = plain_prompt(tok, 14, seed=3)
    ref = _reference(model, adapters)
    try:
        theirs = ref.greedy(prompt, server_piece(tok))
        with_lora = _backend(kind, ours)
        without = _backend(kind, load_gguf(model))
        try:
            v = agree(our_greedy(with_lora, prompt, tok.is_eog), theirs)
            assert v.ok, v
            plain_v = agree(our_greedy(without, prompt, tok.is_eog), theirs)
            assert not plain_v.ok, plain_v  # the deltas matter: without them the rule fails
        finally:
            with_lora.close()
            without.close()
    finally:
        ref.close()


def test_bad_adapters_are_one_line(tmp_path: Path) -> None:
    model = make_model("tiny", "F32", tmp_path / "m.gguf")
    cases = [
        (write_adapter(tmp_path / "arch.gguf", model, WEIGHTS[:1], arch="qwen3"), ModelLoadError, "mismatch"),
        (write_adapter(tmp_path / "emb.gguf", model, ["token_embd.weight"]), UnsupportedModelError, "embedding"),
        (model, ModelLoadError, "general.type"),
    ]
    for path, exc, why in cases:
        with pytest.raises(exc, match=why):
            load_gguf(model, {"lora": [(str(path), 1.0)]})
    m = load_gguf(make_model("tiny-qwen3moe", "Q8_0", tmp_path / "moe.gguf"))
    experts = tmp_path / "experts.gguf"
    w = gguf.GGUFWriter(path=None, arch="qwen3moe")
    w.add_string("general.type", "adapter")
    w.add_string("adapter.type", "lora")
    shape = m.tensors["blk.0.ffn_up_exps.weight"].shape
    w.add_tensor("blk.0.ffn_up_exps.weight.lora_a", np.zeros((shape[0], 2, shape[2]), np.float32))
    w.add_tensor("blk.0.ffn_up_exps.weight.lora_b", np.zeros((shape[0], shape[1], 2), np.float32))
    w.write_header_to_file(experts)
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(UnsupportedModelError, match="experts"):
        load_gguf(tmp_path / "moe.gguf", {"lora": [(str(experts), 1.0)]})


async def test_the_server_flags_endpoints_and_request_field(tmp_path: Path, serve_argv: Any) -> None:
    """--lora-scaled through a real server: its greedy /completion is llama-server's with
    the same adapter; GET /lora-adapters lists it; the same scales (POST, or a request's
    ``lora``) are accepted, other scales are a 400 (they are fixed at start here)."""
    import httpx

    model = make_model("tiny", "F32", tmp_path / "m.gguf", sharp=True)
    adapter = write_adapter(tmp_path / "a.gguf", model, WEIGHTS, seed=1)
    handle = await serve_argv("-m", str(model), "--backend", "numpy", "-c", "256", "--lora-scaled", f"{adapter}:0.7")
    tok = Tokenizer.from_metadata(load_gguf(model).metadata)
    body = {"prompt": plain_prompt(tok, 12, seed=5), "n_predict": 12,
            "temperature": 0, "cache_prompt": False, "return_tokens": True}
    ref = _reference(model, [(adapter, 0.7)])
    try:
        theirs = ref._client.post("/completion", json=body).json()
        their_list = ref._client.get("/lora-adapters").json()
    finally:
        ref.close()
    async with httpx.AsyncClient(base_url=handle.url, timeout=60) as c:
        ours = (await c.post("/completion", json=body)).json()
        same = await c.post("/completion", json={**body, "lora": [{"id": 0, "scale": 0.7}]})
        other = await c.post("/completion", json={**body, "lora": [{"id": 0, "scale": 0.2}]})
        listed = (await c.get("/lora-adapters")).json()
        post_same = await c.post("/lora-adapters", json=[{"id": 0, "scale": 0.7}])
        post_other = await c.post("/lora-adapters", json=[{"id": 0, "scale": 0.0}])
    assert ours["tokens"] == theirs["tokens"]
    assert same.status_code == 200 and same.json()["tokens"] == ours["tokens"]
    assert other.status_code == 400 and "per-request adapter scales" in other.json()["error"]["message"]
    assert listed == [{"id": 0, "path": str(adapter), "scale": 0.7}]
    assert [(e["id"], e["path"], e["scale"]) for e in their_list] == [(0, str(adapter), pytest.approx(0.7))]
    assert post_same.json() == {"success": True} and post_other.status_code == 400


@pytest.mark.parametrize("kind", ["numpy", pytest.param("vulkan", marks=pytest.mark.vulkan)])
def test_adapters_survive_a_release(tmp_path: Path, kind: str) -> None:
    """A release of everything (``--sleep-mode all``) and the restore keep the deltas:
    the numpy backend reloads the file with its adapters, Vulkan restores their segments
    from the shadows."""
    from trio_llm.engine.backend import Level, SeqBatch

    model = make_model("tiny", "F32", tmp_path / "m.gguf", sharp=True)
    adapter = write_adapter(tmp_path / "a.gguf", model, WEIGHTS, seed=1)
    backend = _backend(kind, load_gguf(model, {"lora": [(str(adapter), 0.7)]}))
    plain = _backend(kind, load_gguf(model))
    tokens = np.arange(9, dtype=np.int32) * 37 % 500 + 3
    try:
        before = backend.forward([SeqBatch(0, tokens, 0)])
        assert not np.allclose(before, plain.forward([SeqBatch(0, tokens, 0)]), atol=1e-3)
        backend.release(Level.ALL)
        backend.restore()
        np.testing.assert_allclose(backend.forward([SeqBatch(0, tokens, 0)]), before, rtol=1e-5, atol=1e-5)
    finally:
        backend.close()
        plain.close()

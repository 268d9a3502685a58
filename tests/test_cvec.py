"""Control vectors (llama-server's --control-vector, --control-vector-scaled,
--control-vector-layer-range): greedy continuations agree with llama.cpp's on both
backends, the files are read and summed as llama.cpp's ``common_control_vector_load``,
and bad input is one line.

The reference: xllamacpp takes no control-vector files (only the layer range), so
llama.cpp runs an equivalent model instead. A control vector adds ``d_il`` to layer
``il``'s output, ``x + ffn(x') + d_il``; llama.cpp's llama architecture loads an
optional ``blk.N.ffn_down.bias`` and adds it to the FFN's output before the residual
add (``build_ffn``'s ``down_b``), so a copy of the model whose ``ffn_down.bias`` is
``d_il`` in the layers in range computes the same stream (up to the order of two f32
additions). Our run with the vectors on the base file must equal llama.cpp's on that
copy token for token, and our run without them must not.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest

from gguf_copy import copy_gguf
from llamacpp_ref import Reference, agree, our_greedy, plain_prompt, server_piece
from trio_llm.engine.reference import NumpyBackend
from trio_llm.errors import ModelLoadError
from trio_llm.model.cvec import _layer_index, load_control_vectors
from trio_llm.model.gguf import load_gguf
from trio_llm.model.synth import make_model
from trio_llm.model.tokenizer import Tokenizer

N_CTX = 96
#: a llama of four layers (1 to 3 can carry a vector), peaked logits, f32 weights
PRESET = "demo"


def write_cvec(path: Path, directions: Mapping[str, np.ndarray], *, layer_count: int = 4) -> Path:
    """A control-vector GGUF as llama.cpp's cvector-generator writes one."""
    w = gguf.GGUFWriter(path=None, arch="controlvector")
    w.add_string("controlvector.model_hint", "llama")
    w.add_int32("controlvector.layer_count", layer_count)
    for name, v in directions.items():
        w.add_tensor(name, v)
    w.write_header_to_file(path)
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def with_down_bias(model: Path, out: Path, biases: Mapping[int, np.ndarray]) -> Path:
    """A copy of the f32 ``model`` with ``blk.N.ffn_down.bias`` = ``biases[N]``."""
    for t in gguf.GGUFReader(model).tensors:
        assert t.tensor_type == gguf.GGMLQuantizationType.F32, t.name
    return copy_gguf(model, out, extra={f"blk.{il}.ffn_down.bias": np.asarray(v, np.float32)
                                        for il, v in sorted(biases.items())})


def _vec(seed: int, n: int, size: float) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal(n) * size).astype(np.float32)


#: case -> (files as (name, scale), --control-vector-layer-range); the files are made by
#: ``_files``: "a" names layers 1 to 3, "b" only layers 2 and 3 (and 7, which the model
#: does not have)
CASES: dict[str, tuple[list[tuple[str, float]], tuple[int, int]]] = {
    "one": ([("a", 1.0)], (-1, -1)),
    "two-scaled": ([("a", 0.8), ("b", -0.5)], (-1, -1)),
    "range": ([("a", 1.0), ("b", 1.0)], (2, 3)),
}


def _files(directory: Path, n_embd: int) -> dict[str, Path]:
    return {
        "a": write_cvec(directory / "a.gguf", {f"direction.{il}": _vec(il, n_embd, 0.1) for il in (1, 2, 3)}),
        "b": write_cvec(directory / "b.gguf", {f"direction.{il}": _vec(10 + il, n_embd, 0.1) for il in (2, 3, 7)}),
    }


def _summed(files: Mapping[str, Path], specs: Sequence[tuple[str, float]], rng: tuple[int, int],
            n_layer: int) -> dict[int, np.ndarray]:
    """The expected sum per layer, by hand from the files (what the bias copy carries)."""
    start, end = (rng[0] if rng[0] > 0 else 1), (rng[1] if rng[1] > 0 else n_layer)
    out: dict[int, np.ndarray] = {}
    for name, scale in specs:
        for t in gguf.GGUFReader(files[name]).tensors:
            il = int(t.name.split(".")[1])
            if start <= il <= min(end, n_layer - 1):
                out[il] = out.get(il, 0) + np.asarray(t.data, np.float32) * np.float32(scale)
    return out


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The model, the vector files, and per case our load's overrides and llama.cpp's
    greedy continuation of one prompt on the bias copy (run once for both backends)."""
    d = tmp_path_factory.mktemp("cvec")
    model = make_model(PRESET, "F32", d / "m.gguf", sharp=True)
    m = load_gguf(model)
    files = _files(d, m.config.n_embd)
    tok = Tokenizer.from_metadata(m.metadata)
    prompt = plain_prompt(tok, 14, seed=3)
    cases: dict[str, Any] = {}
    for case, (specs, rng) in CASES.items():
        biases = _summed(files, specs, rng, m.config.n_layer)
        ref = Reference(with_down_bias(model, d / f"bias-{case}.gguf", biases), n_ctx=N_CTX)
        try:
            theirs = ref.greedy(prompt, server_piece(tok))
        finally:
            ref.close()
        over = {"cvec": [(str(files[n]), s) for n, s in specs], "cvec_range": rng}
        cases[case] = dict(over=over, theirs=theirs, biases=biases)
    return dict(model=model, files=files, tok=tok, prompt=prompt, cases=cases)


def _backend(kind: str, model: Any) -> Any:
    if kind == "numpy":
        return NumpyBackend(model, n_ctx=N_CTX, n_seq=1)
    from trio_llm.vulkan.backend import VulkanBackend

    return VulkanBackend(model, n_ctx=N_CTX, n_seq=1)


@pytest.mark.parametrize("kind", ["numpy", pytest.param("vulkan", marks=pytest.mark.vulkan)])
@pytest.mark.parametrize("case", list(CASES))
def test_control_vectors_agree_with_llamacpp(setup: dict[str, Any], case: str, kind: str) -> None:
    c = setup["cases"][case]
    ours = load_gguf(setup["model"], c["over"])
    assert sorted(n for n in ours.tensors if n.startswith("cvec.")) == [f"cvec.{il}" for il in sorted(c["biases"])]
    for il, v in c["biases"].items():
        np.testing.assert_allclose(ours.tensors[f"cvec.{il}"].dequantize(), v, rtol=1e-6)
    is_eog = setup["tok"].is_eog
    with_cvec = _backend(kind, ours)
    without = _backend(kind, load_gguf(setup["model"]))
    try:
        got = our_greedy(with_cvec, setup["prompt"], is_eog)
        plain = our_greedy(without, setup["prompt"], is_eog)
    finally:
        with_cvec.close()
        without.close()
    theirs = c["theirs"]
    v = agree(got, theirs)
    assert v.ok and got[0] == theirs.tokens, (v, got[0], theirs.tokens)
    assert plain[0] != theirs.tokens  # the vectors matter: without them the tokens differ


async def test_the_server_flags(setup: dict[str, Any], tmp_path: Path, serve_argv: Any) -> None:
    """--control-vector-scaled (two files in one flag) and --control-vector-layer-range
    through a real server: its greedy /completion is llama-server's on the bias copy."""
    import httpx

    model, files = setup["model"], setup["files"]
    handle = await serve_argv("-m", model, "--backend", "numpy", "-c", "256",
                              "--control-vector-scaled", f"{files['a']}:0.7,{files['b']}:1.5",
                              "--control-vector-layer-range", "1", "2")
    biases = _summed(files, [("a", 0.7), ("b", 1.5)], (1, 2), load_gguf(model).config.n_layer)
    assert sorted(biases) == [1, 2]
    body = {"prompt": plain_prompt(setup["tok"], 12, seed=5), "n_predict": 16, "temperature": 0,
            "cache_prompt": False, "return_tokens": True}
    ref = Reference(with_down_bias(model, tmp_path / "bias.gguf", biases), n_ctx=256)
    try:
        theirs = ref._client.post("/completion", json=body).json()
    finally:
        ref.close()
    plain = Reference(model, n_ctx=256)
    try:
        without = plain._client.post("/completion", json=body).json()
    finally:
        plain.close()
    async with httpx.AsyncClient(base_url=handle.url, timeout=60) as c:
        ours = (await c.post("/completion", json=body)).json()
    assert ours["tokens"] == theirs["tokens"]
    assert without["tokens"] != theirs["tokens"]


def test_files_are_summed_as_llamacpp(tmp_path: Path) -> None:
    """Scaled and summed within a file (two tensors of one layer: ``stoi`` reads
    ``direction.2.x`` as 2) and across files; layer 0 and layers past the model never
    get one; the range is inclusive, 0 or less meaning the default; zeros add nothing."""
    n = 8
    one = write_cvec(tmp_path / "one.gguf", {"direction.1": np.ones(n, np.float32),
                                             "direction.2": np.full(n, 2.0, np.float32),
                                             "direction.2.x": np.full(n, 3.0, np.float32),
                                             "direction.9": np.ones(n, np.float32)})
    two = write_cvec(tmp_path / "two.gguf", {"direction.+3": np.full(n, 4.0, np.float32),
                                             "direction.1": np.full(n, -4.0, np.float32)})
    specs = [(str(one), 2.0), (str(two), 0.5)]

    def layers(rng: tuple[int, int] = (-1, -1)) -> dict[int, float]:
        got = load_control_vectors(specs, n, 4, rng)
        assert all(v.dtype == np.float32 and v.shape == (n,) for v in got.values())
        return {il: float(v[0]) for il, v in got.items()}

    # layer 1: 2 * 1 + 0.5 * -4 = 0, nothing to add; layer 2: 2 * (2 + 3); layer 3: 0.5 * 4
    assert layers() == {2: 10.0, 3: 2.0}
    assert layers((2, 2)) == layers((0, 2)) == {2: 10.0}
    assert layers((3, 0)) == layers((3, 99)) == {3: 2.0}
    assert layers((3, 2)) == {}
    assert _layer_index("direction. 12abc") == 12 and _layer_index("direction.-1") == -1
    assert _layer_index("direction.x1") == _layer_index("directions.1") == _layer_index("direction") == -1
    assert _layer_index("direction.99999999999") == -1  # stoi's out_of_range


def _bad_files(tmp_path: Path, n_embd: int) -> list[tuple[Path, str]]:
    """Files llama.cpp refuses, each with the words of our one-line refusal."""
    v = np.ones(n_embd, np.float32)
    text = tmp_path / "notes.txt"
    text.write_text("not a gguf\n")
    return [
        (tmp_path / "missing.gguf", "no such file"),
        (text, "not a GGUF file"),
        (write_cvec(tmp_path / "empty.gguf", {}), "no direction tensors"),
        (write_cvec(tmp_path / "name.gguf", {"blk.1.ffn_down.bias": v}), "invalid/unparsable direction tensor"),
        (write_cvec(tmp_path / "zero.gguf", {"direction.0": v}), "invalid (zero) direction"),
        (write_cvec(tmp_path / "f16.gguf", {"direction.1": v.astype(np.float16)}), "non-F32"),
        (write_cvec(tmp_path / "2d.gguf", {"direction.1": np.ones((2, n_embd), np.float32)}), "non-1D"),
        (write_cvec(tmp_path / "sizes.gguf", {"direction.1": v, "direction.2": v[:-1]}), "the ones before it"),
        (write_cvec(tmp_path / "small.gguf", {"direction.1": v[:-8]}), "does not match the model's"),
    ]


def test_bad_files_are_one_line(tmp_path: Path) -> None:
    model = make_model("tiny", "F32", tmp_path / "m.gguf")
    n_embd = load_gguf(model).config.n_embd
    for path, why in _bad_files(tmp_path, n_embd):
        with pytest.raises(ModelLoadError) as info:
            load_gguf(model, {"cvec": [(str(path), 1.0)]})
        assert why in str(info.value) and str(path) in str(info.value), (path, info.value)
        assert "\n" not in str(info.value)
    good = write_cvec(tmp_path / "good.gguf", {"direction.1": np.ones(n_embd, np.float32)})
    other = write_cvec(tmp_path / "other.gguf", {"direction.1": np.ones(n_embd // 2, np.float32)})
    with pytest.raises(ModelLoadError, match="the files before it"):
        load_gguf(model, {"cvec": [(str(good), 1.0), (str(other), 1.0)]})


def _one_error(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err
    errors = [ln for ln in err.splitlines() if "error" in ln]
    assert len(errors) == 1 and "Traceback" not in err, err
    return errors[0]


def test_the_command_line_refuses_bad_input_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A bad file: one line naming it, exit status 1; a malformed SCALE or range: one
    line naming the flag, status 2."""
    from trio_llm.runtime import main

    model = make_model("tiny", "F32", tmp_path / "m.gguf")
    base = ["-m", str(model), "--port", "0", "--backend", "numpy", "--no-warmup"]
    for path, why in _bad_files(tmp_path, load_gguf(model).config.n_embd):
        assert main([*base, "--control-vector", str(path)]) == 1, path
        line = _one_error(capsys)
        assert why in line and str(path) in line, line
    good = write_cvec(tmp_path / "good.gguf", {"direction.1": np.ones(256, np.float32)})
    for args, why in [(["--control-vector-scaled", f"{good}:big"], "--control-vector-scaled: invalid value"),
                      (["--control-vector-scaled", str(good)], "(FNAME:SCALE)"),
                      (["--control-vector-layer-range", "1", "x"], "--control-vector-layer-range: invalid value 'x'"),
                      (["--control-vector-layer-range", "1"], "--control-vector-layer-range: expected 2 values")]:
        assert main([*base, "--control-vector", str(good), *args]) == 2, args
        assert why in _one_error(capsys)


ARCH_PRESETS = ["tiny", "tiny-qwen2", "tiny-qwen3", "tiny-gemma3", "tiny-qwen3moe", "tiny-qwen35", "tiny-qwen35moe",
                "tiny-qwen3next", "tiny-deepseek2"]


def _all_layers(tmp_path: Path, preset: str) -> tuple[Path, dict[str, Any]]:
    model = make_model(preset, "F32", tmp_path / f"{preset}.gguf", sharp=True)
    cfg = load_gguf(model).config
    path = write_cvec(tmp_path / "v.gguf", {f"direction.{il}": _vec(il, cfg.n_embd, 0.5)
                                            for il in range(1, cfg.n_layer)})
    return model, {"cvec": [(str(path), 1.0)]}


@pytest.mark.parametrize("preset", ARCH_PRESETS)
def test_every_architecture_adds_each_layers_vector_to_its_output(tmp_path: Path, preset: str) -> None:
    """In every architecture the vector of layer il is added once, to the value that
    feeds layer il + 1 (or the head): the layer's output."""
    from trio_llm.models import build_graph

    model, over = _all_layers(tmp_path, preset)
    m = load_gguf(model, over)
    g = build_graph(m.config, {n: t.shape for n, t in m.tensors.items()})
    adds = [n for n in g.nodes if n.op == "add" and n.inputs[1].name.startswith("cvec.")]
    assert [(n.layer, n.inputs[1].name) for n in adds] == [(il, f"cvec.{il}") for il in range(1, m.config.n_layer)]
    for n in adds:
        readers = [r for r in g.nodes if n.out in r.inputs]
        assert readers and all(r.layer in (n.layer + 1, -1) for r in readers), (n, readers)


@pytest.mark.vulkan
@pytest.mark.parametrize("preset", ["tiny-gemma3", "tiny-qwen35moe", "tiny-deepseek2"])
def test_vulkan_equals_numpy_with_vectors(tmp_path: Path, preset: str, f32_activations: None) -> None:
    """The Vulkan lowering (fusions around the layer's end included) gives numpy's logits
    with the vectors, in a prefill and a decode step."""
    from trio_llm.engine.backend import SeqBatch

    model, over = _all_layers(tmp_path, preset)
    tokens = np.arange(9, dtype=np.int32) * 37 % 500 + 3
    out = []
    for kind in ("numpy", "vulkan"):
        b = _backend(kind, load_gguf(model, over))
        try:
            out.append((b.forward([SeqBatch(0, tokens, 0)]), b.forward([SeqBatch(0, np.array([5], np.int32), 9)])))
        finally:
            b.close()
    plain = _backend("numpy", load_gguf(model))
    try:
        assert not np.allclose(plain.forward([SeqBatch(0, tokens, 0)]), out[0][0], atol=1e-2)
    finally:
        plain.close()
    for ours, ref in zip(out[1], out[0], strict=True):
        np.testing.assert_allclose(ours, ref, atol=2e-3)


@pytest.mark.parametrize("kind", ["numpy", pytest.param("vulkan", marks=pytest.mark.vulkan)])
def test_vectors_survive_a_release(tmp_path: Path, kind: str) -> None:
    """A release of everything and the restore keep the vectors: numpy reloads the file
    with them, Vulkan restores their segment from its shadow."""
    from trio_llm.engine.backend import Level, SeqBatch

    model, over = _all_layers(tmp_path, "tiny")
    backend = _backend(kind, load_gguf(model, over))
    tokens = np.arange(9, dtype=np.int32) * 37 % 500 + 3
    try:
        before = backend.forward([SeqBatch(0, tokens, 0)])
        backend.release(Level.ALL)
        backend.restore()
        np.testing.assert_allclose(backend.forward([SeqBatch(0, tokens, 0)]), before, rtol=1e-5, atol=1e-5)
    finally:
        backend.close()


def test_the_flags_parse_as_llama_servers() -> None:
    """Comma-separated files, repeats that add up, SCALE after the last colon, a range
    of two values (also as --name=START END); the range alone changes nothing."""
    from trio_llm.runtime import parse_config

    c = parse_config(["--control-vector", "a.gguf,b.gguf", "--control-vector-scaled", "c:/d.gguf:-0.5",
                      "--control-vector", "e.gguf", "--control-vector-layer-range=2", "3"], {})
    assert c.control_vectors == (("a.gguf", 1.0), ("b.gguf", 1.0), ("c:/d.gguf", -0.5), ("e.gguf", 1.0))
    assert c.control_vector_layer_range == (2, 3)
    assert c.model_overrides()["cvec"] == list(c.control_vectors) and c.model_overrides()["cvec_range"] == (2, 3)
    alone = parse_config(["--control-vector-layer-range", "2", "3"], {})
    assert "cvec" not in alone.model_overrides() and "cvec_range" not in alone.model_overrides()

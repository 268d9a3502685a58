"""load_gguf on real files: the tiny presets, and broken files written by the tests."""

from __future__ import annotations

from pathlib import Path

import attrs
import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

from trio_llm.errors import ModelLoadError, UnsupportedModelError
from trio_llm.model.config import ARCH_ROPE, ModelConfig
from trio_llm.model.gguf import expected_shapes, load_gguf
from trio_llm.model.quant import quantize, row_bytes, tensor_bytes


@pytest.mark.parametrize(
    ("preset", "arch", "rope", "qk_norm", "bias", "tied", "theta", "eps", "tokenizer"),
    [
        ("tiny", "llama", "normal", False, False, False, 1e4, 1e-5, "gpt2"),
        ("tiny-qwen3", "qwen3", "neox", True, False, True, 1e6, 1e-6, "gpt2"),
        ("tiny-qwen2", "qwen2", "neox", False, True, False, 1e6, 1e-6, "gpt2"),
        ("tiny-spm", "llama", "normal", False, False, False, 1e4, 1e-5, "llama"),
    ],
)
def test_tiny_presets_load_with_their_config(
    model_path, preset, arch, rope, qk_norm, bias, tied, theta, eps, tokenizer
) -> None:
    model = load_gguf(model_path(preset, "Q8_0"))
    c = model.config
    assert (c.arch, c.rope_mode, c.qk_norm, c.attn_bias, c.tied_embeddings) == (arch, rope, qk_norm, bias, tied)
    assert (c.n_vocab, c.n_embd, c.n_layer, c.n_head, c.n_head_kv, c.head_dim, c.n_ff) == (
        1024, 256, 2, 4, 2, 64, 512,
    )
    assert (c.n_ctx_train, c.rope_theta, c.rms_eps) == (4096, theta, eps)
    assert c.name == f"trio-llm {preset}"
    assert model.metadata["tokenizer.ggml.model"] == tokenizer
    assert len(model.metadata["tokenizer.ggml.tokens"]) == 1024
    assert model.metadata["general.architecture"] == arch
    assert set(model.tensors) == set(expected_shapes(c))
    model.close()


def test_tensors_are_views_of_the_file(tiny_model: Path) -> None:
    model = load_gguf(tiny_model)
    embd = model.tensor("token_embd.weight")
    assert embd.ggml_type == T.Q8_0
    assert embd.shape == (1024, 256)
    assert embd.n_bytes == tensor_bytes(T.Q8_0, (1024, 256)) == embd.raw.size
    assert isinstance(embd.raw, np.memmap)
    assert not embd.raw.flags.writeable
    # the bytes on disk at the tensor's offset are the bytes we hand out
    with tiny_model.open("rb") as f:
        f.seek(embd.offset)
        assert f.read(64) == embd.raw[:64].tobytes()
    w = embd.dequantize()  # [n_vocab, n_embd]
    assert w.dtype == np.float32 and w.shape == (1024, 256)
    assert 0.018 < float(w.std()) < 0.022  # the N(0, 0.02) the generator drew
    norm = model.tensor("blk.0.attn_norm.weight")
    assert norm.ggml_type == T.F32 and norm.shape == (256,)
    assert abs(float(norm.dequantize().mean()) - 1.0) < 0.01
    assert model.weight_bytes() == sum(t.n_bytes for t in model.tensors.values())
    assert model.weight_bytes() < tiny_model.stat().st_size
    with pytest.raises(ModelLoadError, match="no tensor named 'nope'"):
        model.tensor("nope")
    model.close()
    assert model.tensors == {}


# --- broken files -----------------------------------------------------------------

SMALL = ModelConfig(
    arch="llama", name="small", n_vocab=64, n_embd=32, n_layer=1, n_head=2, n_head_kv=1,
    head_dim=16, n_ff=64, n_ctx_train=128, rope_theta=1e4, rms_eps=1e-5, rope_mode="normal",
    qk_norm=False, attn_bias=False, tied_embeddings=False,
)


def _write(
    path: Path,
    cfg: ModelConfig = SMALL,
    *,
    drop_keys: tuple[str, ...] = (),
    drop_tensors: tuple[str, ...] = (),
    shapes: dict[str, tuple[int, ...]] | None = None,
    types: dict[str, T] | None = None,
    override: dict[str, int] | None = None,
) -> Path:
    """A small model written with gguf.GGUFWriter, with the requested defects."""
    a = cfg.arch
    w = gguf.GGUFWriter(path, a)
    w.add_name(cfg.name)
    keys = {
        f"{a}.embedding_length": cfg.n_embd, f"{a}.block_count": cfg.n_layer,
        f"{a}.attention.head_count": cfg.n_head, f"{a}.attention.head_count_kv": cfg.n_head_kv,
        f"{a}.feed_forward_length": cfg.n_ff, f"{a}.context_length": cfg.n_ctx_train,
    }
    keys.update(override or {})
    for key, value in keys.items():
        if key not in drop_keys:
            w.add_uint32(key, value)
    w.add_float32(f"{a}.rope.freq_base", cfg.rope_theta)
    w.add_float32(f"{a}.attention.layer_norm_rms_epsilon", cfg.rms_eps)
    w.add_array("tokenizer.ggml.tokens", [f"t{i}" for i in range(cfg.n_vocab)])
    # an architecture we do not run still gets llama's tensors: only its name matters
    known = cfg if cfg.arch in ARCH_ROPE else attrs.evolve(cfg, arch="llama")
    all_shapes = {**expected_shapes(known), **(shapes or {})}
    for name, shape in all_shapes.items():
        if name in drop_tensors:
            continue
        ggml_type = (types or {}).get(name, T.F32)
        if ggml_type in (T.F32, T.Q8_0):
            data = quantize(np.full(shape, 0.5, dtype=np.float32), ggml_type)
        else:  # a type we do not run: only its byte count matters
            data = np.zeros((*shape[:-1], row_bytes(ggml_type, shape[-1])), dtype=np.uint8)
        w.add_tensor(name, data, raw_dtype=ggml_type)  # uint8 bytes, shape from raw_dtype
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _load_error(path: Path, kind: type[ModelLoadError] = ModelLoadError) -> str:
    with pytest.raises(kind) as info:
        load_gguf(path)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(str(path))
    return message


def test_the_small_writer_makes_a_loadable_model(tmp_path: Path) -> None:
    model = load_gguf(_write(tmp_path / "ok.gguf"))
    assert model.config == SMALL
    assert model.tensor("blk.0.attn_q.weight").shape == (32, 32)


def test_missing_file_and_directory(tmp_path: Path) -> None:
    assert "no such file" in _load_error(tmp_path / "absent.gguf")
    assert "is a directory" in _load_error(tmp_path)


def test_empty_file(tmp_path: Path) -> None:
    path = tmp_path / "empty.gguf"
    path.write_bytes(b"")
    assert "empty file" in _load_error(path)


def test_not_a_gguf(tmp_path: Path) -> None:
    path = tmp_path / "model.safetensors"
    path.write_text('{"__metadata__": {}}')
    assert "not a GGUF file" in _load_error(path)


def test_truncated_header(tmp_path: Path) -> None:
    good = _write(tmp_path / "ok.gguf").read_bytes()
    header_end = load_gguf(tmp_path / "ok.gguf").tensor("token_embd.weight").offset
    path = tmp_path / "cut.gguf"
    for n in range(4, header_end, 13):
        path.write_bytes(good[:n])
        assert "truncated" in _load_error(path), n


def test_corrupt_header_bytes_never_escape_as_other_errors(tmp_path: Path) -> None:
    """Overwrite header bytes one at a time with values that break lengths, counts and
    type ids: each file either still loads or fails with a one-line ModelLoadError."""
    good = _write(tmp_path / "ok.gguf").read_bytes()
    header_end = load_gguf(tmp_path / "ok.gguf").tensor("token_embd.weight").offset
    path = tmp_path / "bad.gguf"
    failures = 0
    for i in range(4, header_end, 5):
        for byte in (0xFF, 0x7F, 0x0D):
            data = bytearray(good)
            data[i] = byte
            path.write_bytes(bytes(data))
            try:
                load_gguf(path)
            except ModelLoadError as exc:
                assert "\n" not in str(exc)
                failures += 1
    assert failures > 0


def test_header_parser_agrees_with_gguf_reader(model_path) -> None:
    """gguf.GGUFReader (llama.cpp's own Python reader) is the independent check."""
    for preset in ("tiny-qwen2", "tiny-spm"):
        path = model_path(preset, "Q4_K_M")
        ours = load_gguf(path)
        reader = gguf.GGUFReader(path)
        for key, field in reader.fields.items():
            if key.startswith("GGUF."):
                continue
            theirs = field.contents()
            if field.types == [gguf.GGUFValueType.FLOAT32]:
                assert ours.metadata[key] == pytest.approx(theirs, rel=1e-7), key
            else:
                assert ours.metadata[key] == theirs, key
        assert len(ours.metadata) == len(reader.fields) - 3  # GGUF.version/tensor_count/kv_count
        assert len(ours.tensors) == len(reader.tensors)
        for rt in reader.tensors:
            t = ours.tensor(rt.name)
            assert t.ggml_type == rt.tensor_type
            assert t.offset == rt.data_offset
            assert t.n_bytes == rt.n_bytes
            assert t.shape == tuple(reversed(rt.shape.tolist()))


def test_truncated_tensor_data(tmp_path: Path) -> None:
    good = _write(tmp_path / "ok.gguf")
    path = tmp_path / "cut.gguf"
    path.write_bytes(good.read_bytes()[:-100])
    assert "truncated: tensor 'output.weight' ends at byte" in _load_error(path)


def test_unknown_gguf_version(tmp_path: Path) -> None:
    data = bytearray(_write(tmp_path / "ok.gguf").read_bytes())
    data[4:8] = (99).to_bytes(4, "little")
    path = tmp_path / "v99.gguf"
    path.write_bytes(bytes(data))
    assert "version 99" in _load_error(path)


def test_unsupported_architecture(tmp_path: Path) -> None:
    path = _write(tmp_path / "gpt2.gguf", attrs.evolve(SMALL, arch="gpt2"))
    message = _load_error(path, UnsupportedModelError)
    assert "architecture 'gpt2' is not supported" in message


def test_unsupported_tensor_type(tmp_path: Path) -> None:
    shapes = {"blk.0.ffn_up.weight": (64, 256)}  # IQ2_XXS rows need 256 values
    path = _write(tmp_path / "iq2.gguf", shapes=shapes, types={"blk.0.ffn_up.weight": T.IQ2_XXS})
    message = _load_error(path, UnsupportedModelError)
    assert "tensor 'blk.0.ffn_up.weight' has type IQ2_XXS" in message


def test_missing_tensor(tmp_path: Path) -> None:
    path = _write(tmp_path / "m.gguf", drop_tensors=("blk.0.ffn_gate.weight",))
    assert "missing tensor 'blk.0.ffn_gate.weight'" in _load_error(path)


def test_wrong_tensor_shape(tmp_path: Path) -> None:
    path = _write(tmp_path / "s.gguf", shapes={"blk.0.attn_k.weight": (32, 32)})
    assert "'blk.0.attn_k.weight' has shape (32, 32), expected (16, 32)" in _load_error(path)


def test_quantized_norm_is_rejected(tmp_path: Path) -> None:
    path = _write(tmp_path / "n.gguf", types={"output_norm.weight": T.Q8_0})
    assert "vector tensor 'output_norm.weight' has type Q8_0" in _load_error(path, UnsupportedModelError)


def test_missing_metadata_key(tmp_path: Path) -> None:
    path = _write(tmp_path / "k.gguf", drop_keys=("llama.block_count",))
    assert "missing metadata key 'llama.block_count'" in _load_error(path)


def test_qwen3_without_qk_norm(tmp_path: Path) -> None:
    path = _write(tmp_path / "q3.gguf", attrs.evolve(SMALL, arch="qwen3", rope_mode="neox"))
    assert "qwen3 has QK-norm" in _load_error(path)


def test_head_counts_must_divide(tmp_path: Path) -> None:
    cfg = attrs.evolve(SMALL, n_head=2, n_head_kv=3)
    path = _write(tmp_path / "h.gguf", cfg)
    assert "not a multiple of head_count_kv 3" in _load_error(path)


def test_corrupt_block_count_fails_fast(tmp_path: Path) -> None:
    path = _write(tmp_path / "b.gguf", override={"llama.block_count": 4_000_000_000})
    assert "block_count 4000000000 needs at least" in _load_error(path)


def test_misaligned_tensor_data(tmp_path: Path) -> None:
    data = bytearray(_write(tmp_path / "ok.gguf").read_bytes())
    name = b"output_norm.weight"
    at = data.index(name) + len(name) + 4 + 8 + 4  # past n_dims, ne[0], type: the offset
    offset = int.from_bytes(data[at : at + 8], "little")
    data[at : at + 8] = (offset + 4).to_bytes(8, "little")
    path = tmp_path / "misaligned.gguf"
    path.write_bytes(bytes(data))
    assert "'output_norm.weight' data is not aligned to 32 bytes" in _load_error(path)

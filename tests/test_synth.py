"""make-model: deterministic bytes, the quant mixes, the CLI, and the default model."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from gguf import GGMLQuantizationType as T

from trio_llm.errors import ModelLoadError
from trio_llm.model import synth
from trio_llm.model.gguf import load_gguf
from trio_llm.model.synth import PRESETS, make_model, plan_tensors, use_more_bits

TRIO_LLM = Path(sys.executable).with_name("trio-llm")


def test_same_seed_same_bytes_other_seed_other_bytes(model_path, tmp_path: Path) -> None:
    first = model_path("tiny", "Q8_0")
    again = make_model("tiny", "Q8_0", tmp_path / "again.gguf", seed=0)
    assert again.read_bytes() == first.read_bytes()
    other = make_model("tiny", "Q8_0", tmp_path / "other.gguf", seed=1)
    assert other.stat().st_size == first.stat().st_size
    assert other.read_bytes() != first.read_bytes()


def test_process_pool_writes_the_same_bytes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunks are seeded by (seed, tensor, chunk): a real two-process pool, receiving
    chunks in whatever order they finish, writes exactly the in-process bytes. Small
    chunks make every matrix span several of them."""
    monkeypatch.setattr(synth, "CHUNK_VALUES", 8192)
    alone = make_model("tiny-qwen2", "Q4_K", tmp_path / "alone.gguf", workers=1)
    pooled = make_model("tiny-qwen2", "Q4_K", tmp_path / "pooled.gguf", workers=2)
    assert pooled.read_bytes() == alone.read_bytes()
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == []


@pytest.mark.parametrize("quant", [
    "F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
    "IQ4_NL", "IQ4_XS",
])
def test_pure_quants_type_every_matrix(model_path, quant: str) -> None:
    """A plain type name, or a mix name with ``pure``: every matrix in that type, and
    the values come back as the N(0, 0.02) they were drawn from."""
    model = load_gguf(model_path("tiny", quant, pure=True))
    for t in model.tensors.values():
        assert t.ggml_type == (T[quant] if len(t.shape) == 2 else T.F32), t.name
    embd = model.tensor("token_embd.weight").dequantize()  # [n_vocab, n_embd]
    lo, hi = (0.017, 0.023) if quant != "Q2_K" else (0.015, 0.025)  # 2-bit codes add 36% noise
    assert lo < float(embd.std()) < hi


def test_use_more_bits_matches_llama_cpp_layers() -> None:
    more = [i for i in range(16) if use_more_bits(i, 16)]
    assert more == [0, 1, 4, 7, 10, 13, 14, 15]
    more = [i for i in range(32) if use_more_bits(i, 32)]
    assert more == [0, 1, 2, 3, 6, 9, 12, 15, 18, 21, 24, 27, 28, 29, 30, 31]


def test_q4_k_m_layout(model_path) -> None:
    # tiny: 2 layers, layer 1 is a "more bits" layer; untied, so output gets Q6_K
    model = load_gguf(model_path("tiny", "Q4_K_M"))
    types = {name: t.ggml_type for name, t in model.tensors.items()}
    assert types["output.weight"] == T.Q6_K
    assert types["token_embd.weight"] == T.Q4_K
    assert types["blk.0.attn_v.weight"] == T.Q4_K
    assert types["blk.0.ffn_down.weight"] == T.Q4_K
    assert types["blk.1.attn_v.weight"] == T.Q6_K
    assert types["blk.1.ffn_down.weight"] == T.Q6_K
    for name in ("attn_q", "attn_k", "attn_output", "ffn_gate", "ffn_up"):
        assert types[f"blk.1.{name}.weight"] == T.Q4_K
    assert types["blk.0.attn_norm.weight"] == T.F32
    assert model.metadata["general.file_type"] == 15  # LLAMA_FTYPE_MOSTLY_Q4_K_M
    # tied: the embedding doubles as the head and gets the head's Q6_K
    tied = load_gguf(model_path("tiny-qwen3", "Q4_K_M"))
    assert tied.tensor("token_embd.weight").ggml_type == T.Q6_K
    assert tied.tensor("blk.0.attn_q_norm.weight").ggml_type == T.F32


def _role_types(quant: str) -> dict[str, dict[int, str]]:
    """llama-8b (32 layers, 4 query heads per KV head) in mix ``quant``: for each
    matrix kind, layer -> type name (the head and embedding under layer -1)."""
    out: dict[str, dict[int, str]] = {}
    for t in plan_tensors(PRESETS["llama-8b"], quant):
        if t.kind == "matrix":
            parts = t.name.split(".")
            role, il = (parts[2], int(parts[1])) if parts[0] == "blk" else (parts[0], -1)
            out.setdefault(role, {})[il] = t.ggml_type.name
    return out


def _layers(types: dict[int, str], name: str) -> list[int]:
    return sorted(i for i, t in types.items() if t == name)


MORE_BITS_32 = [0, 1, 2, 3, 6, 9, 12, 15, 18, 21, 24, 27, 28, 29, 30, 31]


@pytest.mark.parametrize(("quant", "base", "special"), [
    # (mix, bulk type, {kind: {type: layers}}) following llama_tensor_get_type
    ("Q2_K", "Q2_K", {"attn_v": {"Q4_K": list(range(32))}, "ffn_down": {"Q3_K": list(range(32))},
                      "attn_output": {"Q3_K": list(range(32))}}),
    ("Q3_K_S", "Q3_K", {}),
    ("Q3_K_M", "Q3_K", {"attn_v": {"Q5_K": [0, 1], "Q4_K": list(range(2, 32))},
                        "ffn_down": {"Q5_K": [0, 1], "Q4_K": list(range(2, 32))},
                        "attn_output": {"Q4_K": list(range(32))}}),
    ("Q3_K_L", "Q3_K", {k: {"Q5_K": list(range(32))} for k in ("attn_v", "ffn_down", "attn_output")}),
    ("Q4_0", "Q4_0", {}), ("Q4_1", "Q4_1", {}), ("Q5_0", "Q5_0", {}), ("Q5_1", "Q5_1", {}),
    ("Q4_K_S", "Q4_K", {"attn_v": {"Q5_K": [0, 1, 2, 3]}, "ffn_down": {"Q5_K": [0, 1, 2, 3]}}),
    ("Q4_K_M", "Q4_K", {"attn_v": {"Q6_K": MORE_BITS_32}, "ffn_down": {"Q6_K": MORE_BITS_32}}),
    ("Q5_K_S", "Q5_K", {}),
    ("Q5_K_M", "Q5_K", {"attn_v": {"Q6_K": MORE_BITS_32}, "ffn_down": {"Q6_K": MORE_BITS_32}}),
    ("IQ4_NL", "IQ4_NL", {"attn_v": {"Q5_K": list(range(32))}, "ffn_down": {"Q5_K": [0, 1, 2, 3]}}),
    ("IQ4_XS", "IQ4_XS", {"attn_v": {"Q5_K": list(range(32))}, "ffn_down": {"Q5_K": [0, 1, 2, 3]}}),
    ("Q4_K_XL", "Q4_K", {"attn_v": {"Q8_0": [0], "Q6_K": list(range(1, 32))},
                         "attn_output": {"Q5_K": list(range(32))},
                         "ffn_down": {"Q8_0": [0], "Q6_K": MORE_BITS_32[1:],
                                      "Q5_K": [i for i in range(32) if i not in MORE_BITS_32]}}),
])
def test_mixes_type_tensors_as_llama_quantize(quant: str, base: str, special: dict[str, dict[str, list[int]]]) -> None:
    roles = _role_types(quant)
    assert roles["output"] == {-1: "Q6_K"}  # the head always gets Q6_K
    assert roles["token_embd"] == {-1: base}  # untied: the bulk type
    for role, types in roles.items():
        if role in ("output", "token_embd"):
            continue
        want = special.get(role, {})
        for name, layers in want.items():
            assert _layers(types, name) == layers, (quant, role, name)
        rest = [i for i in range(32) if all(i not in ls for ls in want.values())]
        assert _layers(types, base) == rest, (quant, role)


def test_mix_rows_that_do_not_fill_a_block_fall_back_as_llama_quantize() -> None:
    cfg = PRESETS["tiny"].config()
    assert synth.mix_type("blk.0.attn_q.weight", "Q4_K_S", cfg, 288) == T.Q5_0
    assert synth.mix_type("blk.0.attn_q.weight", "IQ4_XS", cfg, 288) == T.IQ4_NL
    assert synth.mix_type("blk.0.attn_q.weight", "Q2_K", cfg, 288) == T.Q4_0
    assert synth.mix_type("output.weight", "Q4_K_M", cfg, 288) == T.Q8_0
    assert synth.mix_type("blk.0.attn_q.weight", "Q4_0", cfg, 100) == T.F16


# llama.cpp's files for these shapes (BENCHMARKS.md). They also hold its tokenizer
# metadata and a rope_freqs tensor, about 2.6 MB that the tensor plan does not.
LLAMA_CPP_BYTES = [
    ("llama-1b", "Q8_0", 1_315_846_560),
    ("llama-1b", "Q4_K_M", 802_458_016),
    ("llama-8b", "Q4_K_M", 4_915_501_952),
    ("llama-8b", "Q8_0", 8_535_538_560),
    ("llama-1b", "F16", 2_474_359_168),
]


@pytest.mark.parametrize(("preset", "quant", "reference"), LLAMA_CPP_BYTES)
def test_big_preset_tensor_bytes_match_llama_cpp(preset: str, quant: str, reference: int) -> None:
    data = sum(t.n_bytes for t in plan_tensors(PRESETS[preset], quant))
    assert 2_500_000 < reference - data < 2_700_000


@pytest.mark.parametrize(("preset", "quant"), [("tiny", "Q8_0"), ("tiny-qwen3", "Q4_K_M")])
def test_planned_size_is_the_written_size(model_path, preset: str, quant: str) -> None:
    assert synth.planned_file_bytes(preset, quant) == model_path(preset, quant).stat().st_size


def test_big_preset_files_land_within_a_few_mb_of_llama_cpp() -> None:
    """Header only (no weights generated): our vocabulary metadata differs from
    llama.cpp's by a few MB at most."""
    planned = synth.planned_file_bytes("llama-1b", "Q4_K_M")
    assert abs(planned - 802_458_016) < 4_000_000


def test_llama3_presets_carry_rope_freqs_like_llama_cpp(tmp_path: Path) -> None:
    """Llama 3.1/3.2 stretch low RoPE frequencies for long context; llama.cpp keeps
    the per-frequency divisors in an F32 ``rope_freqs.weight`` of head_dim/2 values."""
    for preset, factor, n in (("llama-1b", 32.0, 32), ("llama-8b", 8.0, 64)):
        plan = plan_tensors(PRESETS[preset], "Q4_K_M")[0]
        assert (plan.name, plan.shape, plan.ggml_type) == ("rope_freqs.weight", (n,), T.F32)
        values = plan.values
        assert values is not None and values[0] == 1.0 and values[-1] == factor
        assert all(a <= b for a, b in zip(values, values[1:], strict=False))
        assert any(1.0 < v < factor for v in values)  # the smoothly interpolated band
        raw = synth.make_chunk(0, plan, 0, (0, 1))
        assert raw.view("<f4").tolist() == list(values)
    assert all(t.name != "rope_freqs.weight" for t in plan_tensors(PRESETS["tiny"], "Q8_0"))


def test_metadata_has_llama_cpp_keys(tiny_qwen3_model: Path) -> None:
    md = load_gguf(tiny_qwen3_model).metadata
    for key, value in {
        "general.architecture": "qwen3", "general.type": "model", "general.file_type": 7,
        "general.quantization_version": 2, "qwen3.context_length": 4096,
        "qwen3.embedding_length": 256, "qwen3.block_count": 2, "qwen3.feed_forward_length": 512,
        "qwen3.attention.head_count": 4, "qwen3.attention.head_count_kv": 2,
        "qwen3.attention.key_length": 64, "qwen3.attention.value_length": 64,
        "qwen3.rope.freq_base": 1e6, "qwen3.attention.layer_norm_rms_epsilon": 1e-6,
        "qwen3.vocab_size": 1024, "tokenizer.ggml.model": "gpt2",
    }.items():
        assert md[key] == value, key
    assert "<|im_start|>" in md["tokenizer.chat_template"]


def test_cli_writes_a_model_and_reports_progress(tmp_path: Path) -> None:
    out = tmp_path / "cli.gguf"
    proc = subprocess.run(
        [str(TRIO_LLM), "make-model", "--preset", "tiny-spm", "--quant", "Q6_K", "-o", str(out)],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stderr.splitlines()
    assert lines[0].startswith("make-model tiny-spm Q6_K: token_embd:")
    assert any(line.startswith("make-model tiny-spm Q6_K: blk.1:") for line in lines)
    assert f"wrote {out}" in lines[-1]
    model = load_gguf(out)
    assert model.config.name == "trio-llm tiny-spm"
    assert model.tensor("blk.0.ffn_up.weight").ggml_type == T.Q6_K


def test_cli_bad_arguments_exit_2_with_one_line(tmp_path: Path) -> None:
    proc = subprocess.run(
        [str(TRIO_LLM), "make-model", "--preset", "gpt-5", "-o", str(tmp_path / "x.gguf")],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1
    assert "unknown preset 'gpt-5'" in proc.stderr
    assert not (tmp_path / "x.gguf").exists()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--preset", "tiny", "--quant", "IQ2_XXS", "-o", "{d}/a.gguf"], "unknown quant 'IQ2_XXS'"),
        (["--preset", "tiny", "--seed", "-3", "-o", "{d}/a.gguf"], "--seed must be >= 0"),
        (["--preset", "tiny", "--seed", "x", "-o", "{d}/a.gguf"], "invalid int value"),
        (["--preset", "tiny"], "the following arguments are required: -o/--output"),
        (["--preset", "tiny", "-o", "{d}/missing/a.gguf"], "does not exist"),
        (["--preset", "tiny", "-o", "{d}"], "is a directory"),
        (["--preset", "tiny", "--workers", "0", "-o", "{d}/a.gguf"], "--workers must be >= 1"),
    ],
)
def test_main_rejects_bad_arguments(tmp_path: Path, capsys, args: list[str], message: str) -> None:
    argv = [a.format(d=tmp_path) for a in args]
    assert synth.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("trio-llm make-model: error: ")
    assert message in err


def test_default_model_is_made_once_under_a_versioned_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    path = synth.default_model_path()
    assert path.parent == tmp_path / "trio-llm" / "models"
    assert path.name == f"demo-Q8_0-{synth.generator_version()}.gguf"
    stamp = path.stat().st_mtime_ns
    assert synth.default_model_path() == path
    assert path.stat().st_mtime_ns == stamp  # not rewritten
    model = load_gguf(path)
    assert (model.config.n_embd, model.config.n_layer, model.config.n_vocab) == (512, 4, 4096)
    assert model.tensor("blk.3.ffn_down.weight").ggml_type == T.Q8_0


def test_default_model_in_an_unusable_cache_is_a_load_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "trio-llm").write_text("a file where the cache directory should be")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    with pytest.raises(ModelLoadError, match="cannot write the default model"):
        synth.default_model_path()


def test_default_model_survives_two_processes_racing(tmp_path: Path) -> None:
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path)}
    code = "from trio_llm.model.synth import default_model_path; print(default_model_path())"
    procs = [
        subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    outs = [p.communicate(timeout=120)[0].strip() for p in procs]
    assert [p.returncode for p in procs] == [0, 0]
    assert outs[0] == outs[1]
    model = load_gguf(outs[0])
    assert model.config.name == "trio-llm demo"
    leftovers = [p.name for p in (tmp_path / "trio-llm" / "models").iterdir()]
    assert leftovers == [Path(outs[0]).name]


@pytest.mark.reference
def test_transformers_reads_our_files(model_path) -> None:
    """Hugging Face transformers' GGUF loader (an independent reader that maps
    llama.cpp's names and metadata onto its own model classes) accepts the files and
    sees the same weights, biases included."""
    import torch
    from transformers import AutoModelForCausalLM

    for preset in ("tiny", "tiny-qwen2"):
        path = model_path(preset, "Q8_0")
        hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
        ours = load_gguf(path)
        assert hf.config.num_hidden_layers == ours.config.n_layer
        assert hf.config.num_key_value_heads == ours.config.n_head_kv
        layer = hf.model.layers[1]
        for name, tensor in [
            ("token_embd.weight", hf.model.embed_tokens.weight),
            ("blk.1.ffn_down.weight", layer.mlp.down_proj.weight),
            ("blk.1.ffn_norm.weight", layer.post_attention_layernorm.weight),
            ("output.weight", hf.lm_head.weight),
        ]:
            assert (ours.tensor(name).dequantize() == tensor.detach().numpy()).all(), name
        if preset == "tiny-qwen2":
            bias = layer.self_attn.v_proj.bias.detach().numpy()
            assert (ours.tensor("blk.1.attn_v.bias").dequantize() == bias).all()

"""RoPE scaling as llama.cpp runs it: a file's ``rope.scaling.*`` metadata (linear and
YaRN, with its original context and attention factor) and llama-server's --rope-* /
--yarn-* flags over it. Greedy continuations agree with llama.cpp's (``xllamacpp``) on
both backends, by ``llamacpp_ref.agree``; a backend that ignored the scaling fails the
same rule; the architectures that cannot run a scaling refuse it in one line."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from llamacpp_ref import Reference, agree, our_greedy, plain_prompt, server_piece
from trio_llm.engine.reference import NumpyBackend
from trio_llm.errors import UnsupportedModelError
from trio_llm.model.gguf import load_gguf
from trio_llm.model.synth import make_model
from trio_llm.model.tokenizer import Tokenizer

N_CTX = 128
ARCH = {"tiny": "llama", "tiny-qwen3": "qwen3", "tiny-qwen3moe": "qwen3moe"}

#: metadata over the preset's (the architecture's prefix is added), as converters write it
FILE_SCALINGS: dict[str, dict[str, Any]] = {
    # Qwen3's YaRN for 4x its context; an original context inside the prompt, so that
    # both sides of the ramp matter
    "yarn": {"rope.scaling.type": "yarn", "rope.scaling.factor": 4.0, "rope.scaling.original_context_length": 64},
    "linear": {"rope.scaling.type": "linear", "rope.scaling.factor": 2.0},
    "yarn-attn": {"rope.scaling.type": "yarn", "rope.scaling.factor": 8.0, "rope.scaling.attn_factor": 0.8},
    "old-key": {"rope.scale_linear": 4.0},  # the older name of the factor, linear by default
}


def _file(tmp_path: Path, preset: str, scaling: str = "") -> Path:
    md = {f"{ARCH[preset]}.{k}": v for k, v in FILE_SCALINGS.get(scaling, {}).items()}
    return make_model(preset, "F32", tmp_path / f"{preset}-{scaling or 'plain'}.gguf", sharp=True, metadata=md)


def _backend(kind: str, path: Path, overrides: dict[str, Any] | None = None) -> Any:
    model = load_gguf(path, overrides)
    if kind == "numpy":
        return NumpyBackend(model, n_ctx=N_CTX, n_seq=1)
    from trio_llm.vulkan.backend import VulkanBackend

    return VulkanBackend(model, n_ctx=N_CTX, n_seq=1)


def _verdict(theirs: Path, ours: Path, kind: str, *, rope: dict[str, Any] | None = None,
             overrides: dict[str, Any] | None = None, seed: int = 5) -> Any:
    """llama.cpp on ``theirs`` (with ``rope``: CommonParams) against our ``kind`` backend
    on ``ours`` (with ``overrides``), one 80-token prompt (past the YaRN file's original
    context): ``llamacpp_ref.agree``'s verdict."""
    tok = Tokenizer.from_metadata(load_gguf(ours).metadata)
    prompt = plain_prompt(tok, 80, seed)
    ref = Reference(theirs, n_ctx=N_CTX, rope=rope)
    backend = _backend(kind, ours, overrides)
    try:
        return agree(our_greedy(backend, prompt, tok.is_eog), ref.greedy(prompt, server_piece(tok)))
    finally:
        backend.close()
        ref.close()


@pytest.mark.parametrize("kind", ["numpy", pytest.param("vulkan", marks=pytest.mark.vulkan)])
@pytest.mark.parametrize("scaling", list(FILE_SCALINGS))
@pytest.mark.parametrize("preset", list(ARCH))
def test_a_files_rope_scaling_agrees_with_llamacpp(tmp_path: Path, preset: str, scaling: str, kind: str) -> None:
    path = _file(tmp_path, preset, scaling)
    cfg = load_gguf(path).config
    assert cfg.rope_freq_scale < 1.0 and bool(cfg.rope_yarn) == scaling.startswith("yarn")
    v = _verdict(path, path, kind)
    assert v.ok, v


@pytest.mark.parametrize("scaling", ["yarn", "linear"])
def test_ignoring_the_scaling_fails_the_rule(tmp_path: Path, scaling: str) -> None:
    """The rule's power: our numpy backend on the same weights without the scaling
    (the behaviour before it was read) fails against llama.cpp on the scaled file."""
    v = _verdict(_file(tmp_path, "tiny-qwen3", scaling), _file(tmp_path, "tiny-qwen3"), "numpy")
    assert not v.ok, v


#: llama-server's flags (CommonParams names) and what the command line gives load_gguf
FLAG_CASES = [
    ({"rope_scaling_type": "yarn", "rope_freq_scale": 0.25, "yarn_orig_ctx": 48},
     {"rope_scaling": "yarn", "rope_freq_scale": 0.25, "yarn_orig_ctx": 48}),
    ({"rope_freq_base": 5000.0, "rope_freq_scale": 0.5},
     {"rope_freq_base": 5000.0, "rope_freq_scale": 0.5}),
    ({"rope_scaling_type": "yarn", "rope_freq_scale": 0.125, "yarn_beta_fast": 8.0, "yarn_beta_slow": 2.0,
      "yarn_ext_factor": 0.5},
     {"rope_scaling": "yarn", "rope_freq_scale": 0.125, "yarn_beta_fast": 8.0, "yarn_beta_slow": 2.0,
      "yarn_ext_factor": 0.5}),
    ({"rope_scaling_type": "linear", "rope_freq_scale": 0.5, "yarn_attn_factor": 0.7},
     {"rope_scaling": "linear", "rope_freq_scale": 0.5, "yarn_attn_factor": 0.7}),
]


@pytest.mark.parametrize("kind", ["numpy", pytest.param("vulkan", marks=pytest.mark.vulkan)])
@pytest.mark.parametrize(("theirs", "ours"), FLAG_CASES, ids=[str(i) for i in range(len(FLAG_CASES))])
def test_the_rope_flags_agree_with_llamacpp(tmp_path: Path, theirs: dict[str, Any], ours: dict[str, Any],
                                            kind: str) -> None:
    """--rope-scaling / --rope-freq-scale / --rope-freq-base / --yarn-* over a file
    without scaling, against llama.cpp given the same parameters."""
    path = _file(tmp_path, "tiny")
    v = _verdict(path, path, kind, rope=theirs, overrides=ours, seed=9)
    assert v.ok, v


def test_the_flags_reach_the_model(tmp_path: Path) -> None:
    """The command line's names: --rope-scale N is a frequency scale of 1/N (as
    llama-server stores it), the env variables count, and a YaRN rescale reaches the
    longer training context llama.cpp then assumes (original context / scale)."""
    from trio_llm.runtime import parse_config

    path = _file(tmp_path, "tiny")
    config = parse_config(["-m", str(path), "--rope-scaling", "yarn", "--rope-scale", "4", "--yarn-orig-ctx",
                           "1024", "--yarn-beta-fast", "16"], {"LLAMA_ARG_ROPE_FREQ_BASE": "20000"})
    over = config.model_overrides()
    assert over == {"rope_scaling": "yarn", "rope_freq_scale": 0.25, "yarn_orig_ctx": 1024, "yarn_beta_fast": 16.0,
                    "rope_freq_base": 20000.0}
    cfg = load_gguf(path, over).config
    assert (cfg.rope_freq_scale, cfg.rope_theta, cfg.n_ctx_train) == (0.25, 20000.0, 4096)
    assert cfg.rope_yarn[0] == 1.0 and cfg.attn_scale > 0
    assert parse_config(["-m", str(path)], {}).model_overrides() == {}


@pytest.mark.parametrize(("preset", "args", "why"), [
    ("tiny-qwen35", ["--rope-scale", "2"], "RoPE scaling of qwen35 is not supported (partial RoPE)"),
    ("tiny-deepseek2", ["--rope-scaling", "yarn"], "RoPE scaling of deepseek2 is not supported"),
    ("tiny-gemma3", ["--rope-scaling", "yarn"], "RoPE scaling 'yarn' of gemma3 is not supported"),
    ("tiny", ["--rope-scale", "0"], "--rope-scale: invalid value '0'"),
    ("tiny", ["--rope-scaling", "longrope"], "--rope-scaling: invalid value 'longrope'"),
])
def test_what_cannot_run_is_one_line(model_path: Any, preset: str, args: list[str], why: str) -> None:
    """``trio-llm serve`` refuses a scaling its architecture does not run, in one line."""
    r = subprocess.run([sys.executable, "-m", "trio_llm", "serve", "-m", str(model_path(preset, "Q8_0")), "--port",
                        "0", "--backend", "numpy", *args], capture_output=True, text=True, timeout=120)
    # a flag is refused before anything starts; a model's refusal comes from the load,
    # after the listening line (llama-server's /health says "loading" meanwhile)
    lines = [ln for ln in r.stderr.strip().splitlines() if not ln.startswith("trio-llm: listening on ")]
    assert r.returncode != 0 and len(lines) == 1 and why in lines[0], r.stderr


def test_a_files_longrope_is_refused(tmp_path: Path) -> None:
    path = make_model("tiny", "F32", tmp_path / "longrope.gguf", metadata={"llama.rope.scaling.type": "longrope"})
    with pytest.raises(UnsupportedModelError, match="RoPE scaling 'longrope' is not supported"):
        load_gguf(path)

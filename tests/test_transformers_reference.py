"""The numpy reference against Hugging Face transformers on CPU PyTorch.

transformers reads the same GGUF file on its own (its GGUF loader dequantizes with
gguf-py and undoes llama.cpp's Q/K row permutation for llama), so this checks our
tensor mapping, RoPE layouts, QK-norm, biases, GQA and tied heads against an
implementation we did not write. Only the model is loaded, never the tokenizer, so
the synthetic vocabulary plays no part.

One correction: transformers 5.x does not read ``qwen3.attention.key_length`` into
``head_dim`` (it keeps Qwen3Config's default of 128), so the config is taken from the
GGUF through ``AutoConfig`` and only ``head_dim`` is set from the file before the
weights are loaded.
"""

from __future__ import annotations

import os
from pathlib import Path

# no network, ever: set before huggingface_hub reads its settings at import
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402

from trio_llm.engine.backend import SeqBatch  # noqa: E402
from trio_llm.engine.reference import NumpyBackend  # noqa: E402
from trio_llm.model.gguf import load_gguf  # noqa: E402

pytestmark = pytest.mark.reference

N_PROMPT = 32
N_DECODE = 16


def hf_logits(path: Path, head_dim: int, tokens: np.ndarray) -> np.ndarray:
    """transformers' logits for every position of ``tokens``, float32."""
    transformers.logging.set_verbosity_error()
    cfg = transformers.AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
    cfg.head_dim = head_dim
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, config=cfg, dtype=torch.float32
    )
    model.eval()
    with torch.no_grad():
        out = model(torch.tensor(tokens[None].astype(np.int64))).logits[0]  # [n, n_vocab]
    return out.numpy().astype(np.float32)  # type: ignore[no-any-return]


@pytest.mark.parametrize(
    ("preset", "quant"),
    [
        ("tiny", "F32"),  # llama: adjacent-pair RoPE, separate head
        ("tiny-qwen3", "F32"),  # neox RoPE, QK-norm, tied head, head_dim set explicitly
        ("tiny-qwen2", "F32"),  # neox RoPE, q/k/v biases
        ("tiny", "Q8_0"),
        ("tiny", "Q4_K"),
        ("tiny-qwen3", "Q6_K"),
        ("tiny-qwen2", "Q4_0"),
    ],
)
def test_prefill_and_greedy_decode_match_transformers(model_path, preset: str, quant: str) -> None:
    path = model_path(preset, quant)
    model = load_gguf(path)
    cfg = model.config
    # a float32 cache: transformers keeps K and V in float32, and an f16 cache (our
    # default, as llama-server's) alone moves the logits past 1e-4 of their span
    be = NumpyBackend(model, n_ctx=N_PROMPT + N_DECODE, n_seq=1, cache_type_k="f32", cache_type_v="f32")
    prompt = np.random.default_rng(7).integers(0, cfg.n_vocab, N_PROMPT).astype(np.int32)

    # ours: a prefill, then greedy decode one token at a time through the KV cache
    ours = [be.forward_all_logits(prompt)]  # [N_PROMPT, n_vocab]
    seq = list(prompt)
    for step in range(N_DECODE):
        tok = int(np.argmax(ours[-1][-1]))
        seq.append(tok)
        if step < N_DECODE - 1:
            ours.append(be.forward([SeqBatch(0, np.array([tok], np.int32), len(seq) - 1)]))
    generated = seq[N_PROMPT:]
    if not cfg.tied_embeddings:
        # a real decode, not one token repeated (random tied-head models do repeat:
        # the last token's own embedding dominates its logits)
        assert len(set(generated)) > 1
    ours_all = np.concatenate(ours)  # [N_PROMPT + N_DECODE - 1, n_vocab]

    # theirs: one pass over prompt + our generated tokens; position i predicts i + 1
    theirs = hf_logits(Path(path), cfg.head_dim, np.array(seq[:-1]))
    assert theirs.shape == ours_all.shape
    assert [int(t) for t in np.argmax(theirs[N_PROMPT - 1 :], axis=-1)] == generated
    for i, (a, b) in enumerate(zip(ours_all, theirs, strict=True)):
        span = float(b.max() - b.min())
        diff = float(np.abs(a - b).max())
        assert diff <= 1e-4 * span, f"position {i}: max |diff| {diff:.3g} > 1e-4 x {span:.3g}"

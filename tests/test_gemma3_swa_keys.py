"""gemma3's two optional window keys, as llama.cpp's ``load_arch_hparams`` reads them
when the file has windows: ``rope.freq_base_swa`` (the window layers' RoPE base, else
10000) and ``attention.sliding_window_pattern`` (``load_swa_pattern(ml, 6)``). Checked
against llama.cpp itself on a copy of the sharp tiny-gemma3 with both keys changed."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest

from gguf_copy import copy_gguf
from trio_llm.engine.reference import NumpyBackend
from trio_llm.model.gguf import load_gguf
from trio_llm.model.tokenizer import Tokenizer

xllamacpp = pytest.importorskip("xllamacpp")
from llamacpp_ref import Reference, agree, our_greedy, plain_prompt, server_piece  # noqa: E402


def _copy(model: Path, out: Path, md: Mapping[str, tuple[Any, gguf.GGUFValueType]]) -> Path:
    """A copy of ``model`` with the metadata ``md`` (key: (value, type)) set over the file's."""
    return copy_gguf(model, out, kv=md)


def test_the_window_keys_are_read_as_llamacpp_reads_them(model_path, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    base = model_path("tiny-gemma3", "F32", sharp=True)
    md = {"gemma3.rope.freq_base_swa": (100.0, gguf.GGUFValueType.FLOAT32),
          "gemma3.attention.sliding_window_pattern": (3, gguf.GGUFValueType.UINT32)}
    path = _copy(base, tmp_path / "gemma3-keys.gguf", md)
    model = load_gguf(path)
    cfg, before = model.config, load_gguf(base).config
    assert cfg.n_swa > 0 and cfg.rope_theta_swa == 100.0 and before.rope_theta_swa == 10000.0
    assert cfg.swa_layers == tuple(il % 3 < 2 for il in range(cfg.n_layer)) != before.swa_layers
    tok = Tokenizer.from_metadata(model.metadata)
    ref = Reference(path, n_ctx=256)
    ours_backend, plain_backend = NumpyBackend(model, n_ctx=256, n_seq=1), NumpyBackend(load_gguf(base), n_ctx=256,
                                                                                      n_seq=1)
    try:
        moved = False
        for seed in (1, 2):
            prompt = plain_prompt(tok, 40, seed)
            ours = our_greedy(ours_backend, prompt, tok.is_eog)
            v = agree(ours, ref.greedy(prompt, server_piece(tok)))
            assert v.ok, v.why
            plain = our_greedy(plain_backend, prompt, tok.is_eog)
            steps = zip(plain[1], ours[1], strict=False)  # the paths may part and end apart
            moved |= plain[0] != ours[0] or max(float(np.abs(a - b).max()) for a, b in steps) > 0.01
        assert moved  # the keys change the answer: reading them is what made it agree
    finally:
        ref.close()
        ours_backend.close()
        plain_backend.close()

"""llama-server's ``--override-kv KEY=TYPE:VALUE,...``: metadata over the file's, seen by
the hyper-parameters, the tokenizer and the template. The reference is llama.cpp on a
file written with the overridden value (xllamacpp does not expose the flag)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from llamacpp_ref import Reference, agree, our_greedy, plain_prompt, server_piece
from trio_llm.engine.reference import NumpyBackend
from trio_llm.model.gguf import load_gguf
from trio_llm.model.synth import make_model
from trio_llm.model.tokenizer import Tokenizer
from trio_llm.runtime import parse_config
from trio_llm.server.flags import UsageError


def test_the_flag_parses_as_llamacpp_and_repeats_add_up() -> None:
    config = parse_config(["--override-kv", "a.b=int:3,c=str:x y,\"d=str:1,2\"", "--override-kv",
                           "e=bool:false", "--override-kv", "a.b=float:0.5"], {})
    assert config.kv_overrides == {"a.b": 0.5, "c": "x y", "d": "1,2", "e": False}
    assert config.model_overrides() == {"kv": config.kv_overrides}
    for bad, why in [("k=int:x", "invalid value"), ("k=bool:yes", "invalid value"), ("k=list:1", "invalid value"),
                     ("k:int=1", "malformed"), ("=int:1", "malformed"), ("k=str:" + "x" * 128, "127 characters")]:
        with pytest.raises(UsageError, match=f"^--override-kv: .*{why}"):
            parse_config(["--override-kv", bad], {})


def test_an_expert_count_override_runs_as_llamacpp_on_that_file(tmp_path: Path) -> None:
    """The common use: fewer experts a token on a MoE file. Ours with the override on
    the original file agrees with llama.cpp on a file that says the same."""
    original = make_model("tiny-qwen3moe", "F32", tmp_path / "moe.gguf", sharp=True)
    written = make_model("tiny-qwen3moe", "F32", tmp_path / "moe-2.gguf", sharp=True,
                         metadata={"qwen3moe.expert_used_count": 2})
    model = load_gguf(original, {"kv": {"qwen3moe.expert_used_count": 2}})
    assert (model.config.n_expert_used, load_gguf(original).config.n_expert_used) == (2, 4)
    assert model.overrides == {"kv": {"qwen3moe.expert_used_count": 2}}
    tok = Tokenizer.from_metadata(model.metadata)
    prompt = plain_prompt(tok, 20, seed=4)
    ref, backend = Reference(written, n_ctx=64), NumpyBackend(model, n_ctx=64, n_seq=1)
    try:
        ours = our_greedy(backend, prompt, tok.is_eog)
        v = agree(ours, ref.greedy(prompt, server_piece(tok)))
        assert v.ok, v
        # and the release/reload of the numpy backend keeps the override
        from trio_llm.engine.backend import Level

        backend.release(Level.ALL)
        backend.restore()
        assert our_greedy(backend, prompt, tok.is_eog)[0] == ours[0]
    finally:
        backend.close()
        ref.close()


def test_the_tokenizer_sees_an_override_and_a_wrong_type_is_ignored(tiny_model: Path,
                                                                      caplog: pytest.LogCaptureFixture) -> None:
    md = load_gguf(tiny_model).metadata
    assert Tokenizer.from_metadata(md).add_bos
    model = load_gguf(tiny_model, {"kv": {"tokenizer.ggml.add_bos_token": False, "new.key": "v"}})
    assert not Tokenizer.from_metadata(model.metadata).add_bos and model.metadata["new.key"] == "v"
    with caplog.at_level(logging.WARNING):
        ctx = load_gguf(tiny_model, {"kv": {"llama.context_length": 1.5}}).config.n_ctx_train
    assert ctx == md["llama.context_length"]
    assert any("llama.context_length" in r.getMessage() and "ignored" in r.getMessage() for r in caplog.records)

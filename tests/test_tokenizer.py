"""Synthetic vocabularies and the tokenizer built from GGUF metadata.

Every tokenizer here is read back from a real GGUF file written with gguf.GGUFWriter,
and the encodings are checked against transformers' independent GGUF tokenizer loader.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from trio_llm.errors import InvalidRequest, TokenizerError
from trio_llm.model.gguf import load_gguf
from trio_llm.model.tokenizer import Tokenizer
from trio_llm.model.vocab import BYTE, CONTROL, UNUSED, USER_DEFINED, build_vocab
from vocab_files import read_metadata, write_vocab_gguf

FAMILIES = {
    # family: (style, architecture written to general.architecture)
    "llama3": ("gpt2", "llama"),
    "chatml": ("gpt2", "qwen2"),
    "llama2": ("llama", "llama"),
}

ROUND_TRIP = [
    "Hello world!",
    "The river's 12345 café costs 3.50 € — naïve Zürich résumé",
    "emoji 😀🚀👍 and one not in the corpus: 🦙",
    "東京は日本の首都です。 語 Москва",
    "  two leading spaces, trailing tab\t",
    "lines\nand\r\nmore\n\n\nblank lines",
    "def f(x):\n    return x ** 2  # comment",
    "",
    " ",
    "a" * 80,
    "mixed\u00a0nbsp and zero\u200bwidth",
]


@pytest.fixture(scope="module")
def vocab_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("vocab")
    files = {}
    for family, (style, arch) in FAMILIES.items():
        (root / family).mkdir()
        spec = build_vocab(style, 1024, family)  # type: ignore[arg-type]
        files[family] = write_vocab_gguf(root / family / "vocab.gguf", spec, arch)
    return files


@pytest.fixture(scope="module")
def tokenizers_(vocab_files: dict[str, Path]) -> dict[str, Tokenizer]:
    return {f: Tokenizer.from_metadata(read_metadata(p)) for f, p in vocab_files.items()}


# --- vocabularies ----------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_vocab_is_a_consistent_bpe(family: str) -> None:
    style = FAMILIES[family][0]
    spec = build_vocab(style, 1024, family)  # type: ignore[arg-type]
    assert spec.n_vocab == len(spec.token_types) == 1024
    assert len(set(spec.tokens)) == 1024
    if spec.merges is not None:
        # byte-level: 256 byte tokens, then one token per merge, in merge order
        index = {t: i for i, t in enumerate(spec.tokens)}
        for rank, merge in enumerate(spec.merges):
            left, right = merge.split(" ")
            assert index[left] < 256 + rank and index[right] < 256 + rank
            assert spec.tokens[256 + rank] == left + right
    else:
        assert spec.scores is not None and len(spec.scores) == 1024
        assert spec.tokens[:3] == ["<unk>", "<s>", "</s>"]
        assert spec.tokens[3] == "<0x00>" and spec.tokens[258] == "<0xFF>"
        assert spec.token_types[3:259] == [BYTE] * 256


def test_llama3_layout_at_full_size() -> None:
    spec = build_vocab("gpt2", 128256, "llama3")
    assert spec.n_vocab == 128256
    assert spec.tokens[128000] == "<|begin_of_text|>" == spec.tokens[spec.bos_id]
    assert spec.tokens[128001] == "<|end_of_text|>" == spec.tokens[spec.eos_id]
    assert spec.tokens[128009] == "<|eot_id|>" and spec.eot_id == 128009
    assert spec.tokens[128002] == "<|reserved_special_token_0|>"
    assert spec.tokens[128255] == "<|reserved_special_token_247|>"
    assert spec.token_types[128000:] == [CONTROL] * 256
    assert spec.merges is not None and len(spec.merges) == 128000 - 256


def test_qwen_layout_at_full_size() -> None:
    spec = build_vocab("gpt2", 151936, "chatml")
    assert spec.n_vocab == 151936
    assert spec.tokens[151643:151646] == ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    assert spec.eos_id == 151645 and not spec.add_bos
    assert spec.tokens[151667:151669] == ["<think>", "</think>"]
    assert spec.token_types[151667] == USER_DEFINED
    assert spec.tokens[151669] == "[PAD151669]" and spec.token_types[-1] == UNUSED


def test_vocab_is_deterministic_across_processes() -> None:
    """The trainer is multi-threaded Rust; its output must not depend on the process."""
    code = (
        "import hashlib, json; from trio_llm.model.vocab import build_vocab; "
        "s = build_vocab('gpt2', 4096, 'llama3'); l = build_vocab('llama', 2048, 'llama2'); "
        "print(hashlib.sha256(json.dumps([s.tokens, s.merges, l.tokens, l.scores]).encode()).hexdigest())"
    )
    s = build_vocab("gpt2", 4096, "llama3")
    spm = build_vocab("llama", 2048, "llama2")
    here = hashlib.sha256(json.dumps([s.tokens, s.merges, spm.tokens, spm.scores]).encode())
    there = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.strip()
    assert there == here.hexdigest()


def test_unsupported_vocab_combination() -> None:
    with pytest.raises(ValueError, match="no vocabulary"):
        build_vocab("llama", 1024, "llama3")
    with pytest.raises(ValueError, match="too small"):
        build_vocab("gpt2", 280, "llama3")
    with pytest.raises(ValueError, match="more than 282 tokens"):
        build_vocab("gpt2", 282, "chatml")


# --- encode / decode -------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("text", ROUND_TRIP)
def test_round_trip(tokenizers_: dict[str, Tokenizer], family: str, text: str) -> None:
    tok = tokenizers_[family]
    ids = tok.encode(text, add_special=False)
    assert all(0 <= i < tok.n_vocab for i in ids)
    assert tok.decode(ids) == text


def test_common_words_are_single_tokens(tokenizers_: dict[str, Tokenizer]) -> None:
    """The trained merges are real: frequent corpus words do not fall apart into bytes."""
    for family in ("llama3", "chatml"):
        assert len(tokenizers_[family].encode(" the", add_special=False)) == 1
    spm = tokenizers_["llama2"]
    assert [spm.token_text(i) for i in spm.encode("the", add_special=False)] == ["▁the"]


def test_bos_handling(tokenizers_: dict[str, Tokenizer]) -> None:
    llama3, chatml, llama2 = tokenizers_["llama3"], tokenizers_["chatml"], tokenizers_["llama2"]
    assert llama3.add_bos and llama3.bos_id is not None
    assert llama3.encode("hi")[0] == llama3.bos_id
    assert llama3.encode("hi")[1:] == llama3.encode("hi", add_special=False)
    assert llama3.bos_id not in llama3.encode("hi", add_special=False)
    assert not chatml.add_bos and chatml.encode("hi") == chatml.encode("hi", add_special=False)
    assert llama2.encode("") == [1] and llama2.encode("", add_special=False) == []


def test_special_tokens_parsed_or_spelled(tokenizers_: dict[str, Tokenizer]) -> None:
    tok = tokenizers_["llama3"]
    assert tok.eot_id is not None
    text = "<|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|>"
    parsed = tok.encode(text, add_special=False)
    assert parsed[0] == tok.encode("<|start_header_id|>", add_special=False)[0]
    assert parsed[-1] == tok.eot_id
    spelled = tok.encode(text, add_special=False, parse_special=False)
    assert tok.eot_id not in spelled and len(spelled) > len(parsed)
    assert tok.decode(spelled) == text == tok.decode(parsed)
    assert tok.decode(parsed, skip_special=True) == "user\n\nhi"


def test_user_defined_tokens_always_parsed(tokenizers_: dict[str, Tokenizer]) -> None:
    """Qwen's <think> is USER_DEFINED: llama.cpp matches it even without parse_special."""
    tok = tokenizers_["chatml"]
    think = tok.encode("<think>", add_special=False)
    assert len(think) == 1 and tok.token_text(think[0]) == "<think>"
    plain = tok.encode("<think>x<|im_end|>", add_special=False, parse_special=False)
    assert plain[0] == think[0] and tok.eos_id not in plain


def test_spm_byte_fallback(tokenizers_: dict[str, Tokenizer]) -> None:
    tok = tokenizers_["llama2"]
    ids = tok.encode("語", add_special=False)  # not in the corpus, so not in the vocabulary
    assert [tok.token_text(i) for i in ids] == ["▁", "<0xE8>", "<0xAA>", "<0x9E>"]
    assert b"".join(tok.token_to_piece(i) for i in ids) == " 語".encode()
    assert tok.decode(ids) == "語"


def test_spm_space_prefix_follows_llama_cpp(tokenizers_: dict[str, Tokenizer]) -> None:
    """llama.cpp prepends a space to each run of text, also after a special token and
    also when the text already starts with one."""
    tok = tokenizers_["llama2"]
    space = tok.encode(" ", add_special=False)
    assert [tok.token_text(i) for i in space] == ["▁", "▁"]
    after = tok.encode("</s>river", add_special=False)
    assert after == [2] + tok.encode("river", add_special=False)


def test_token_to_piece(tokenizers_: dict[str, Tokenizer]) -> None:
    tok = tokenizers_["llama3"]
    text = "Zürich 😀 🦙"
    ids = tok.encode(text, add_special=False)
    assert b"".join(tok.token_to_piece(i) for i in ids) == text.encode()
    assert tok.token_to_piece(tok.eos_id) == b"<|end_of_text|>"
    assert tok.decode(np.array(ids, dtype=np.int64)) == text  # ids straight from a sampler


def test_eog_ids(tokenizers_: dict[str, Tokenizer]) -> None:
    llama3, chatml = tokenizers_["llama3"], tokenizers_["chatml"]
    eog3 = {llama3.token_text(i) for i in llama3.eog_ids}
    assert eog3 == {"<|end_of_text|>", "<|eot_id|>", "<|eom_id|>"}
    # as llama.cpp: the FIM pad / repository / file-separator tokens end a generation too
    assert {chatml.token_text(i) for i in chatml.eog_ids} == {"<|im_end|>", "<|endoftext|>", "<|fim_pad|>",
                                                              "<|repo_name|>", "<|file_sep|>"}
    assert chatml.is_eog(chatml.eos_id) and not chatml.is_eog(0)
    assert tokenizers_["llama2"].eog_ids == frozenset({2})


def test_lone_surrogate_becomes_replacement(tokenizers_: dict[str, Tokenizer]) -> None:
    tok = tokenizers_["chatml"]
    ids = tok.encode("a\ud800b\ud83d\ude00", add_special=False)
    assert tok.decode(ids) == "a\ufffdb😀"  # a lone half is replaced, a split pair joined


def test_decode_rejects_ids_outside_the_vocabulary(tokenizers_: dict[str, Tokenizer]) -> None:
    with pytest.raises(InvalidRequest, match="outside the vocabulary"):
        tokenizers_["llama3"].decode([5, 1024])
    with pytest.raises(InvalidRequest):
        tokenizers_["llama2"].token_to_piece(-1)


# --- streaming -------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_stream_decoder_holds_partial_characters(
    tokenizers_: dict[str, Tokenizer], family: str
) -> None:
    tok = tokenizers_[family]
    text = "a🦙b語c"  # neither character is in the vocabulary: both split into byte tokens
    ids = tok.encode(text, add_special=False)
    stream = tok.stream_decoder()
    chunks = [stream.feed(i) for i in ids]
    # generated text continues a prompt, so SentencePiece's prefix space stays
    expected = (" " if tok.model == "llama" else "") + text
    assert "".join(chunks) + stream.flush() == expected
    assert all("\ufffd" not in c for c in chunks)
    assert "" in chunks  # some token carried only part of a character and was held back


def test_stream_decoder_pending_and_flush(tokenizers_: dict[str, Tokenizer]) -> None:
    tok = tokenizers_["llama2"]
    ids = tok.encode("🦙", add_special=False)
    assert [tok.token_text(i) for i in ids][1:] == ["<0xF0>", "<0x9F>", "<0xA6>", "<0x99>"]
    stream = tok.stream_decoder()
    assert stream.feed(ids[0]) == " "  # SentencePiece's prefix space: generated text keeps it
    assert [stream.feed(i) for i in ids[1:3]] == ["", ""]
    assert stream.pending == 2
    assert stream.flush() == "\ufffd" and stream.pending == 0


def test_stream_decoder_special_tokens(tokenizers_: dict[str, Tokenizer]) -> None:
    tok = tokenizers_["llama3"]
    assert tok.eot_id is not None
    ids = tok.encode("hi", add_special=False) + [tok.eot_id]
    assert tok.stream_decoder().feed_many(ids) == "hi"
    assert tok.stream_decoder(skip_special=False).feed_many(ids) == "hi<|eot_id|>"


# --- malformed metadata ----------------------------------------------------------------


def _llama3_metadata(vocab_files: dict[str, Path]) -> dict[str, Any]:
    return read_metadata(vocab_files["llama3"])


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"tokenizer.ggml.model": None}, "tokenizer.ggml.model is missing"),
        ({"tokenizer.ggml.model": "bert"}, "'bert' is not supported"),
        ({"tokenizer.ggml.model": 7}, "must be a string"),
        ({"tokenizer.ggml.pre": "mystery"}, "'mystery' is not supported"),
        ({"tokenizer.ggml.tokens": "abc"}, "must be an array"),
        ({"tokenizer.ggml.tokens": []}, "is empty"),
        ({"tokenizer.ggml.tokens": None}, "tokens is missing"),
        ({"tokenizer.ggml.token_type": [1, 1]}, "2 entries for 1024 tokens"),
        ({"tokenizer.ggml.merges": None}, "merges is missing"),
        ({"tokenizer.ggml.merges": ["Ġ"]}, "is not 'left right'"),
        ({"tokenizer.ggml.merges": ["zz qq"]}, "cannot build the BPE model"),
        ({"tokenizer.ggml.eos_token_id": 5000}, "outside the vocabulary of 1024"),
        ({"tokenizer.ggml.eos_token_id": None}, "eos_token_id is missing"),
        ({"tokenizer.ggml.bos_token_id": "1"}, "must be an integer"),
        ({"tokenizer.ggml.add_bos_token": "yes"}, "must be a boolean"),
    ],
)
def test_malformed_metadata(
    vocab_files: dict[str, Path], change: dict[str, Any], message: str
) -> None:
    metadata = _llama3_metadata(vocab_files)
    for key, value in change.items():
        if value is None:
            del metadata[key]
        else:
            metadata[key] = value
    with pytest.raises(TokenizerError, match=message):
        Tokenizer.from_metadata(metadata)


def test_malformed_spm_scores(vocab_files: dict[str, Path]) -> None:
    metadata = read_metadata(vocab_files["llama2"])
    metadata["tokenizer.ggml.scores"] = metadata["tokenizer.ggml.scores"][:-1]
    with pytest.raises(TokenizerError, match="1023 entries for 1024 tokens"):
        Tokenizer.from_metadata(metadata)
    metadata["tokenizer.ggml.scores"] = ["x"] * 1024
    with pytest.raises(TokenizerError, match="array of numbers"):
        Tokenizer.from_metadata(metadata)


# --- the real model files and an independent implementation ---------------------------


def test_tokenizer_from_a_made_model(tiny_spm_model: Path) -> None:
    model = load_gguf(tiny_spm_model)
    try:
        tok = Tokenizer.from_metadata(model.metadata)
    finally:
        model.close()
    assert tok.n_vocab == model.config.n_vocab and tok.model == "llama"
    assert tok.decode(tok.encode("Once upon a time", add_special=False)) == "Once upon a time"


COMPARE = ROUND_TRIP[:4] + [
    "lines\nand\r\nmore\n\n\nblank lines",
    "def f(x):\n    return x ** 2  # comment",
    "Numbers: 1234567 and 3.14159, 2024-03-14.",
    "I'm sure they'll've DON'T WON'T",
    "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|>",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n",
    "[INST] <<SYS>>\nbe brief\n<</SYS>>\n\nhello [/INST]",
]


@pytest.mark.reference
@pytest.mark.parametrize("family", FAMILIES)
def test_same_ids_as_transformers(
    vocab_files: dict[str, Path], tokenizers_: dict[str, Tokenizer], family: str
) -> None:
    """transformers rebuilds a tokenizer from the same GGUF on its own; ids must agree.

    SentencePiece strings avoid a leading space and text right after a special token,
    the two places where transformers departs from llama.cpp (see tokenizer.py).
    """
    from transformers import AutoTokenizer

    path = vocab_files[family]
    reference = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    tok = tokenizers_[family]
    for text in COMPARE:
        if family == "llama2" and "<" in text:
            continue
        assert tok.encode(text) == reference.encode(text), text
        ids = tok.encode(text, add_special=False)
        assert tok.decode(ids) == reference.decode(ids), text

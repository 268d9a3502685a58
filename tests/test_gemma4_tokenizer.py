"""The gemma4 vocabulary (``tokenizer.ggml.model = "gemma4"``) against llama.cpp itself.

One tiny llama carrying a Gemma 4 style vocabulary (``gemma4_vocab``) is served by
llama.cpp (``xllamacpp``, in-process llama-server) and by ours; ``/tokenize`` (with and
without special tokens, with pieces) and ``/detokenize`` must answer exactly the same on
every string, and so must the chat template's prompt and its token count. The file says
``add_bos_token = false``, which llama.cpp overrides for Gemma 4.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import xllamacpp

from conftest import ServeFactory
from gemma4_vocab import BOS_ID, EOS_ID, write_gemma4_llama
from llamacpp_ref import server_params
from trio_llm.errors import TokenizerError
from trio_llm.model.tokenizer import Tokenizer
from vocab_files import read_metadata

TEXTS = [
    "hello world",
    "Hello World! Hello there; the world is wide",
    " leading space",
    "  two leading spaces",
    "trailing space ",
    "trailing spaces   ",
    "several    spaces   inside",
    " ",
    "   ",
    "",
    "\n",
    "\n\n",
    "\n\n\n",
    "\n\n\n\n",
    "\n\n\n\n\n",
    "\n\n\n\n\n\n\n",
    "a\nb\n\nc\n\n\nd\n\n\n\ne\n\n\n\n\nf",
    "\nstarts with a newline",
    "ends with newlines\n\n\n",
    " \n \n\n  \n\n\n   ",
    "\r\n windows\r\n\r\n lines",
    "tabs\tand\t\ttabs \t mixed",
    "def hello(x):\n    return x + 1  # the answer\n",
    "emoji 😀🚀👍 and 🦙",
    "東京は日本の首都です。 東京 日本 語",
    "Москва и мир",
    "naïve café résumé Zürich — déjà vu",
    "I'm sure they'll've done it, isn't it ? Yes , it is .",
    "numbers 12345 and 3.14159",
    "<|turn>user\nhello<turn|>\n<|turn>model\n",
    "<bos><bos>hello<eos>",
    "text<|channel>thought<channel|>more",
    "call<|tool_call>x<tool_call|> <|tool_response>{}<tool_response|>",
    "</s> is plain, <unused0> and <mask> and <unk> and <pad>",
    "<|turn> spaced <turn|> specials ",
    "mixed\u00a0nbsp and zero\u200bwidth",
    "▁ a literal lower one eighth block ▁▁",
]


@pytest.fixture(scope="module")
def gemma4_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_gemma4_llama(tmp_path_factory.mktemp("gemma4") / "tiny-gemma4-vocab.gguf")


@pytest.fixture(scope="module")
def reference(gemma4_file: Path) -> Iterator[httpx.Client]:
    server = xllamacpp.Server(server_params(gemma4_file, 256))  # raises if llama.cpp refuses it
    with httpx.Client(base_url=server.listening_address, timeout=30) as client:
        yield client
    del server


@pytest.fixture(scope="module")
def tok(gemma4_file: Path) -> Tokenizer:
    return Tokenizer.from_metadata(read_metadata(gemma4_file))


def _bodies() -> Iterator[dict[str, Any]]:
    for text in TEXTS:
        for add_special in (False, True):
            for parse_special in (True, False):
                yield {
                    "content": text,
                    "add_special": add_special,
                    "parse_special": parse_special,
                    "with_pieces": True,
                }


def test_tokenizer_kind_bos_and_ends(tok: Tokenizer) -> None:
    assert tok.model == "gemma4"
    assert tok.add_bos and tok.bos_id == BOS_ID  # the file says false; llama.cpp overrides it
    assert tok.encode("hi")[0] == BOS_ID and tok.encode("hi", add_special=False)[0] != BOS_ID
    ends = {tok.token_text(i) for i in tok.eog_ids}
    assert ends == {"<eos>", "<turn|>", "<|tool_response>"} and EOS_ID in tok.eog_ids
    assert tok.is_special(tok.encode("<|tool_response>", add_special=False)[0])


def test_merges_newline_runs_and_bytes(tok: Tokenizer) -> None:
    def texts(s: str) -> list[str]:
        return [tok.token_text(i) for i in tok.encode(s, add_special=False)]

    assert texts("\n\n\n") == ["\n\n\n"]  # no merge makes it: the whole-run lookup does
    assert texts("\n\n\n\n\n") == ["\n\n\n\n", "\n"]
    assert texts(" hello") == ["▁", "hello"]  # nothing prepended to "hello", the space is ▁
    assert texts("hello") == ["hello"]
    assert texts("é") == ["<0xC3>", "<0xA9>"]  # left out of the vocabulary: bytes
    assert tok.decode(tok.encode(" a  b\n\n\nc é 🦙")) == "<bos> a  b\n\n\nc é 🦙"
    assert tok.decode(tok.encode(" a <turn|>"), skip_special=True) == " a "


@pytest.mark.parametrize("pre", [None, "gemma4", "default", "anything"])
def test_pre_tokenizer_name_is_ignored(tmp_path: Path, pre: str | None, tok: Tokenizer) -> None:
    """llama.cpp sets tokenizer_pre "gemma4" whatever the file says; the converter
    writes none."""
    other = Tokenizer.from_metadata(
        read_metadata(write_gemma4_llama(tmp_path / "m.gguf", pre=pre, add_bos=None))
    )
    for text in TEXTS:
        assert other.encode(text) == tok.encode(text)


def test_without_merges_is_a_one_line_error(tmp_path: Path) -> None:
    metadata = read_metadata(write_gemma4_llama(tmp_path / "m.gguf", merges=False))
    with pytest.raises(TokenizerError, match=r"^tokenizer\.ggml\.merges is missing$"):
        Tokenizer.from_metadata(metadata)
    metadata["tokenizer.ggml.merges"] = ["nospace"]
    with pytest.raises(TokenizerError, match="is not 'left right'"):
        Tokenizer.from_metadata(metadata)


def test_tokenize_same_as_llama_cpp(tok: Tokenizer, reference: httpx.Client) -> None:
    """Our tokenizer against llama-server's /tokenize: ids and pieces."""
    for body in _bodies():
        want = reference.post("/tokenize", json=body).json()["tokens"]
        ids = tok.encode(
            body["content"], add_special=body["add_special"], parse_special=body["parse_special"]
        )
        assert ids == [t["id"] for t in want], body
        for t in want:
            piece = t["piece"]
            raw = bytes(piece) if isinstance(piece, list) else piece.encode("utf-8")
            assert tok.token_to_piece(t["id"]) == raw, (body, t)


async def test_server_same_as_llama_cpp(
    gemma4_file: Path, reference: httpx.Client, numpy_server: ServeFactory
) -> None:
    """Our server's /tokenize, /detokenize, /apply-template and a chat's prompt tokens
    against llama-server's, on the same file."""
    h = await numpy_server(gemma4_file)
    async with httpx.AsyncClient(base_url=h.url, timeout=30) as c:
        all_ids: list[int] = []
        for body in _bodies():
            for pieces in (True, False):
                b = dict(body, with_pieces=pieces)
                want = reference.post("/tokenize", json=b).json()
                got = (await c.post("/tokenize", json=b)).json()
                assert got == want, b
            ids = [t["id"] for t in reference.post("/tokenize", json=body).json()["tokens"]]
            all_ids += ids
            want_text = reference.post("/detokenize", json={"tokens": ids}).json()
            assert (await c.post("/detokenize", json={"tokens": ids})).json() == want_text, body
        # every token on its own and all of them together (specials, bytes, unused)
        for ids in [
            [i] for i in range(len(read_metadata(gemma4_file)["tokenizer.ggml.tokens"]))
        ] + [all_ids]:
            want_text = reference.post("/detokenize", json={"tokens": ids}).json()
            assert (await c.post("/detokenize", json={"tokens": ids})).json() == want_text, ids

        messages = [
            {"role": "system", "content": "be brief "},
            {"role": "user", "content": " hello  world\n\n\n"},
        ]
        want_prompt = reference.post("/apply-template", json={"messages": messages}).json()
        assert (await c.post("/apply-template", json={"messages": messages})).json() == want_prompt
        body = {"messages": messages, "max_tokens": 1, "temperature": 0}
        want_usage = reference.post("/v1/chat/completions", json=body).json()["usage"][
            "prompt_tokens"
        ]
        got = (await c.post("/v1/chat/completions", json=body)).json()
        assert got["usage"]["prompt_tokens"] == want_usage
        b = {"content": want_prompt["prompt"], "add_special": True, "with_pieces": True}
        assert (await c.post("/tokenize", json=b)).json() == reference.post(
            "/tokenize", json=b
        ).json()


def test_serve_without_merges_says_so_in_one_line(tmp_path: Path) -> None:
    path = write_gemma4_llama(tmp_path / "m.gguf", merges=False)
    argv = [
        sys.executable,
        "-m",
        "trio_llm",
        "serve",
        "--backend",
        "numpy",
        "--port",
        "0",
        "-m",
        str(path),
    ]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert r.returncode != 0
    assert (
        r.stderr.strip().splitlines()[-1]
        == "trio-llm serve: error: tokenizer.ggml.merges is missing"
    )
    assert "Traceback" not in r.stderr

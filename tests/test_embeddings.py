"""Embeddings and reranking (``--embeddings``, ``--pooling``, ``--reranking``), checked
against llama.cpp itself (``xllamacpp``, the same GGUF): the hidden states of every tiny
preset on both backends, and each pooling, normalization and answer shape through a
real server on loopback, with httpx and the ``openai`` client."""

from __future__ import annotations

import base64
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest

from test_server_flags import Start, client, start  # noqa: F401  (the fixture)
from trio_llm.engine.backend import SeqBatch
from trio_llm.engine.reference import NumpyBackend
from trio_llm.model.gguf import load_gguf
from trio_llm.server import embeddings as EM

xllamacpp = pytest.importorskip("xllamacpp")
from llamacpp_ref import server_params  # noqa: E402  (after the wheel is known to be there)

PRESETS = ["tiny", "tiny-qwen2", "tiny-qwen3", "tiny-spm", "tiny-gemma3", "tiny-qwen3moe", "tiny-qwen35",
           "tiny-qwen35moe"]
TOKENS = [5, 17, 99, 200, 300, 7, 8, 9, 10, 11, 12, 400]  # no BOS: llama-server adds none to token ids
TEXTS = ["I believe the meaning of life is", "This is a test"]
#: F32 weights: llama.cpp's CPU matmuls then keep activations in F32 (with quantized
#: weights it rounds them to 8 bits, which flips a nearly tied expert of the MoE presets;
#: the weight types are test_llamacpp_agreement's business)
QUANT = "F32"
COS = 0.999
QUERY = "what is a cat"
DOCS = ["a cat sat on the mat", "hello world", "the quick brown fox"]


class Llama:
    """One GGUF in llama.cpp with embeddings on, through its in-process llama-server."""

    def __init__(self, path: Path, pooling: str) -> None:
        params = server_params(path, 512)
        params.embedding = True
        params.pooling_type = getattr(xllamacpp.llama_pooling_type, f"LLAMA_POOLING_TYPE_{pooling.upper()}")
        self._server = xllamacpp.Server(params)
        self.http = httpx.Client(base_url=self._server.listening_address, timeout=60)

    def post(self, path: str, body: dict[str, Any]) -> Any:
        r = self.http.post(path, json=body)
        assert r.status_code == 200, r.text
        return r.json()

    def close(self) -> None:
        self.http.close()
        del self._server


@pytest.fixture(scope="module")
def llama(model_path) -> Iterator:  # type: ignore[no-untyped-def]
    """(preset, pooling) -> Llama, one llama.cpp load each."""
    made: dict[tuple[str, str], Llama] = {}

    def get(preset: str, pooling: str) -> Llama:
        if (preset, pooling) not in made:
            made[(preset, pooling)] = Llama(model_path(preset, QUANT), pooling)
        return made[(preset, pooling)]

    yield get
    for ref in made.values():
        ref.close()


@pytest.fixture(scope="module")
def tiny(model_path) -> list[str]:  # type: ignore[no-untyped-def]
    """The flags that serve the file the references load."""
    return ["-m", str(model_path("tiny", QUANT))]


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a, b = np.atleast_2d(a).astype(np.float64), np.atleast_2d(b).astype(np.float64)
    return (a * b).sum(-1) / np.linalg.norm(a, axis=-1) / np.linalg.norm(b, axis=-1)  # type: ignore[no-any-return]


# -- the pure parts ---------------------------------------------------------------------


def test_normalize_is_common_embd_normalize() -> None:
    v = np.array([3.0, -4.0, 0.0], np.float32)
    assert np.allclose(EM.normalize(v, 2), [0.6, -0.8, 0.0])
    assert np.allclose(EM.normalize(v, -1), v)
    assert np.allclose(EM.normalize(v, 0), v * 32760.0 / 4.0)  # int16's range
    assert np.allclose(EM.normalize(v, 1), v / 7.0)
    assert np.allclose(EM.normalize(v, 3), v / (27 + 64) ** (1 / 3))
    assert not EM.normalize(np.zeros(3, np.float32), 2).any()  # a zero vector stays zero


def test_pooling_comes_from_the_flag_then_the_file() -> None:
    md = {"general.architecture": "qwen3", "qwen3.pooling_type": 3}
    assert EM.resolve_pooling("", md) == "last"
    assert EM.resolve_pooling("mean", md) == "mean"
    assert EM.resolve_pooling("", {"general.architecture": "llama"}) == "none"  # llama.cpp's default
    rows = np.arange(6, dtype=np.float32).reshape(3, 2)
    assert EM.pool(rows, "mean").tolist() == [2.0, 3.0]
    assert EM.pool(rows, "cls").tolist() == [0.0, 1.0]
    assert EM.pool(rows, "last").tolist() == [4.0, 5.0]
    assert EM.pool(rows, "none").shape == (3, 2)


# -- the model layer: final-norm hidden states on both backends = llama.cpp's -------------


@pytest.mark.parametrize("backend", ["numpy", "vulkan"])
@pytest.mark.parametrize("preset", PRESETS)
def test_hidden_states_equal_llama_cpp(llama, model_path, preset: str, backend: str) -> None:  # type: ignore[no-untyped-def]
    theirs = np.array(llama(preset, "none").post("/embedding", {"content": TOKENS})[0]["embedding"])  # [n, n_embd]
    model = load_gguf(model_path(preset, QUANT))
    if backend == "numpy":
        be: Any = NumpyBackend(model, n_ctx=64, n_seq=1, output="embd")
    else:
        from trio_llm.vulkan.backend import VulkanBackend

        be = VulkanBackend(model, n_ctx=64, n_seq=1, output="embd")
    try:
        ours = be.forward_rows(SeqBatch(0, np.array(TOKENS, np.int32), 0))  # [n, n_embd]
        last = be.forward([SeqBatch(0, np.array(TOKENS, np.int32), 0)])[0]  # the last token's row
    finally:
        be.close()
    assert ours.shape == theirs.shape == (len(TOKENS), model.config.n_embd)
    assert cosines(ours, theirs).min() > COS
    assert np.allclose(last, ours[-1], atol=1e-5)


# -- through a real server ----------------------------------------------------------------


@pytest.mark.parametrize("pooling", ["mean", "cls", "last"])
async def test_openai_embeddings_equal_llama_cpp(start: Start, llama, tiny, pooling: str) -> None:  # noqa: F811
    theirs = llama("tiny", pooling).post("/v1/embeddings", {"input": TEXTS})
    h = await start(*tiny, "--embeddings", "--pooling", pooling, "-np", "2")
    oai = openai.AsyncOpenAI(base_url=h.url + "/v1", api_key="x")
    r = await oai.embeddings.create(model="m", input=TEXTS)
    await oai.close()
    assert [d.index for d in r.data] == [0, 1] and r.object == "list"
    assert r.usage.prompt_tokens == r.usage.total_tokens == theirs["usage"]["prompt_tokens"]
    for d, t in zip(r.data, theirs["data"], strict=True):
        v = np.array(d.embedding)
        assert v.shape == (256,)  # the model's width
        assert abs(np.linalg.norm(v) - 1.0) < 1e-5  # L2-normalized, as llama-server
        assert cosines(v, np.array(t["embedding"]))[0] > COS


async def test_input_shapes_encodings_and_native_answers(start: Start, llama, tiny) -> None:  # noqa: F811
    h = await start(*tiny, "--embeddings", "--pooling", "mean")
    async with client(h) as c:
        one = (await c.post("/v1/embeddings", json={"input": TEXTS[0]})).json()
        v = np.array(one["data"][0]["embedding"], np.float32)
        b64 = (await c.post("/v1/embeddings", json={"input": TEXTS[0], "encoding_format": "base64"})).json()
        assert b64["data"][0]["encoding_format"] == "base64"
        assert np.array_equal(np.frombuffer(base64.b64decode(b64["data"][0]["embedding"]), "<f4"), v)
        # token ids, a mixed list, several prompts, OpenAI content parts, the native shape
        r = (await c.post("/v1/embeddings", json={"input": [TOKENS, [12, "string", 34], "x"]})).json()
        assert len(r["data"]) == 3
        ids = (await c.post("/v1/embeddings", json={"input": TOKENS})).json()["data"][0]["embedding"]
        theirs = llama("tiny", "mean").post("/v1/embeddings", {"input": TOKENS})["data"][0]["embedding"]
        assert cosines(np.array(ids), np.array(theirs))[0] > COS
        parts = {"content": [{"type": "text", "text": "hello "}, {"type": "text", "text": "world"}]}
        r = (await c.post("/v1/embeddings", json={"input": ["hello world", parts]})).json()
        assert r["data"][0]["embedding"] == r["data"][1]["embedding"]
        native = (await c.post("/embedding", json={"content": TEXTS[0]})).json()
        assert native[0]["index"] == 0 and np.allclose(native[0]["embedding"][0], v)
        raw = (await c.post("/embedding", json={"content": TEXTS[0], "embd_normalize": -1})).json()
        assert np.linalg.norm(raw[0]["embedding"][0]) > 1.5  # not normalized
        for bad in ({"input": []}, {"input": {"content": "string"}}, {"input": [TOKENS[:2], True]},
                    {"input": [10**6]}, {"nothing": 1}, {"input": "x", "encoding_format": "hex"},
                    {"input": {"content": [{"type": "image_url", "image_url": {"url": "data:,"}}]}}):
            r = await c.post("/v1/embeddings", json=bad)
            assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", (bad, r.text)
        assert (await c.post("/v1/embeddings", json={"input": "x " * 600})).status_code == 400  # beyond -c 512
        r = await c.post("/completion", json={"prompt": "x"})  # an embedding server does not generate
        assert r.status_code == 501 and "--embeddings" in r.json()["error"]["message"]


async def test_embedding_prompts_are_counted_in_metrics(start: Start, tiny) -> None:  # noqa: F811
    h = await start(*tiny, "--embeddings", "--pooling", "last", "--metrics", "-np", "2")
    async with client(h) as c:
        r = (await c.post("/v1/embeddings", json={"input": TEXTS})).json()
        text = (await c.get("/metrics")).text
    values = {line.split()[0]: float(line.split()[1]) for line in text.splitlines() if line.startswith("llamacpp:")}
    assert values["llamacpp:prompt_tokens_total"] == r["usage"]["prompt_tokens"]
    assert values["llamacpp:n_decode_total"] >= 1 and values["llamacpp:tokens_predicted_total"] == 0


async def test_pooling_none_gives_every_token_unnormalized(start: Start, llama, tiny) -> None:  # noqa: F811
    h = await start(*tiny, "--embeddings")  # the tiny file has no pooling type: none, as llama.cpp
    theirs = llama("tiny", "none").post("/embedding", {"content": TEXTS[0]})[0]["embedding"]
    async with client(h) as c:
        ours = (await c.post("/embedding", json={"content": TEXTS[0]})).json()[0]["embedding"]
        assert len(ours) == len(theirs) > 2  # one vector per token (BOS included)
        assert cosines(np.array(ours), np.array(theirs)).min() > COS
        r = await c.post("/v1/embeddings", json={"input": "x"})
        assert r.status_code == 400 and "not OAI compatible" in r.json()["error"]["message"]
    oai = openai.AsyncOpenAI(base_url=h.url + "/v1", api_key="x")
    with pytest.raises(openai.BadRequestError):
        await oai.embeddings.create(model="m", input="x")
    await oai.close()


async def test_the_files_pooling_type_is_the_default(start: Start, llama, model_path) -> None:  # noqa: F811
    theirs = llama("tiny-qwen3-embd", "unspecified").post("/v1/embeddings", {"input": TEXTS})  # the file's: last
    h = await start("-m", str(model_path("tiny-qwen3-embd", QUANT)), "--embeddings", "-np", "2")
    async with client(h) as c:
        ours = (await c.post("/v1/embeddings", json={"input": TEXTS})).json()
        one = (await c.post("/v1/embeddings", json={"input": TEXTS[0]})).json()
    for d, t in zip(ours["data"], theirs["data"], strict=True):
        assert cosines(np.array(d["embedding"]), np.array(t["embedding"]))[0] > COS
    last = llama("tiny-qwen3-embd", "last").post("/v1/embeddings", {"input": TEXTS[0]})["data"][0]["embedding"]
    assert cosines(np.array(one["data"][0]["embedding"]), np.array(last))[0] > COS


async def test_without_the_flag_embeddings_and_rerank_are_501(start: Start) -> None:  # noqa: F811
    h = await start()
    async with client(h) as c:
        for path in ("/embedding", "/v1/embeddings", "/rerank", "/v1/rerank"):
            r = await c.post(path, json={"input": "x", "query": "q", "documents": ["d"]})
            assert r.status_code == 501 and r.json()["error"]["type"] == "not_supported_error", path


async def test_rerank_equals_llama_cpp(start: Start, llama, model_path) -> None:  # noqa: F811
    path = model_path("tiny-qwen3-rerank", QUANT)
    theirs = llama("tiny-qwen3-rerank", "rank").post("/rerank", {"query": QUERY, "documents": DOCS})
    h = await start("-m", str(path), "--reranking", "-np", "2", "-c", "1024")
    async with client(h) as c:
        ours = (await c.post("/v1/rerank", json={"query": QUERY, "documents": DOCS})).json()
        assert ours["object"] == "list" and ours["usage"] == theirs["usage"]
        by_index = {e["index"]: e["relevance_score"] for e in theirs["results"]}
        assert sorted(e["index"] for e in ours["results"]) == [0, 1, 2]
        scores = [e["relevance_score"] for e in ours["results"]]
        assert scores == sorted(scores, reverse=True)  # best first
        for e in ours["results"]:
            assert abs(e["relevance_score"] - by_index[e["index"]]) < 5e-3
        # TEI's shape: "texts", a bare list with "score" (and the text when asked)
        tei = (await c.post("/rerank", json={"query": QUERY, "texts": DOCS, "return_text": True, "top_n": 2})).json()
        assert len(tei) == 2 and {"index", "score", "text"} == set(tei[0]) and tei[0]["text"] == DOCS[tei[0]["index"]]
        assert len((await c.post("/reranking", json={"query": QUERY, "documents": DOCS, "top_n": 1})).json()["results"]) == 1
        for bad in ({"documents": DOCS}, {"query": 1, "documents": DOCS}, {"query": QUERY, "documents": []},
                    {"query": QUERY, "documents": [1]}, {"query": QUERY, "documents": DOCS, "top_n": "2"}):
            r = await c.post("/v1/rerank", json=bad)
            assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", bad
        r = await c.post("/v1/embeddings", json={"input": "x"})  # pooling rank computes scores, not vectors
        assert r.status_code == 400 and "rank" in r.json()["error"]["message"]


async def test_rerank_of_a_model_without_a_rank_head_is_400(start: Start, model_path) -> None:  # noqa: F811
    h = await start("--reranking")
    async with client(h) as c:
        r = await c.post("/rerank", json={"query": QUERY, "documents": DOCS})
        assert r.status_code == 400 and "cls.output.weight" in r.json()["error"]["message"]
    # the file's pooling type (rank) is the default, but /rerank needs --reranking, as llama-server's
    h = await start("-m", str(model_path("tiny-qwen3-rerank", QUANT)), "--embeddings")
    async with client(h) as c:
        assert (await c.post("/rerank", json={"query": QUERY, "documents": DOCS})).status_code == 501
        assert (await c.post("/v1/embeddings", json={"input": "x"})).status_code == 400


async def test_vulkan_server_embeddings_equal_llama_cpp(start: Start, llama, tiny) -> None:  # noqa: F811
    theirs = llama("tiny", "mean").post("/v1/embeddings", {"input": TEXTS})
    h = await start(*tiny, "--embeddings", "--pooling", "mean", "--backend", "vulkan")
    async with client(h) as c:
        ours = (await c.post("/v1/embeddings", json={"input": TEXTS})).json()
    for d, t in zip(ours["data"], theirs["data"], strict=True):
        assert cosines(np.array(d["embedding"]), np.array(t["embedding"]))[0] > COS

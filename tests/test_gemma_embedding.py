"""gemma-embedding (EmbeddingGemma, llama.cpp's ``--embd-gemma-default`` architecture),
checked against llama.cpp itself (``xllamacpp``) on the ``tiny-gemma-embd`` preset:
bidirectional attention with a symmetric sliding window (8 positions each side, so the
40-token prompts cross it), mean pooling from the file, and the dense projections
``dense_2``/``dense_3``. Both backends, through ``trio-llm serve --embeddings``; what
llama-server answers to generation on it, and to a prompt beyond one batch; the refusals
of a corrupt file."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from gguf_copy import copy_gguf, uint32s
from test_embeddings import QUANT, cosines
from test_server_flags import client
from trio_llm.engine.backend import SeqBatch
from trio_llm.engine.reference import NumpyBackend, attend
from trio_llm.errors import ModelLoadError
from trio_llm.model.gguf import load_gguf
from trio_llm.models import Meta, build_graph, gemma_embedding

xllamacpp = pytest.importorskip("xllamacpp")
from llamacpp_ref import server_params  # noqa: E402  (after the wheel is known to be there)

PRESET = "tiny-gemma-embd"
TOKENS = list(range(5, 45))  # 40 tokens: past the window of 16 (8 each side) both ways
TEXTS = ["I believe the meaning of life is to be found in the small things of every day",
         "This is a test"]
COS = 0.999
NO_LOGITS = "the current context does not support logits computation. skipping"


class Llama:
    """The file in llama.cpp's in-process llama-server."""

    def __init__(self, path: Path, *, embedding: bool, pooling: str = "", n_ubatch: int = 0) -> None:
        params = server_params(path, 512)
        params.embedding = embedding
        if pooling:
            params.pooling_type = getattr(xllamacpp.llama_pooling_type, f"LLAMA_POOLING_TYPE_{pooling.upper()}")
        if n_ubatch:
            params.n_batch = params.n_ubatch = n_ubatch
        self._server = xllamacpp.Server(params)
        self.http = httpx.Client(base_url=self._server.listening_address, timeout=60)

    def post(self, path: str, body: dict[str, Any]) -> httpx.Response:
        return self.http.post(path, json=body)

    def close(self) -> None:
        self.http.close()
        del self._server


@pytest.fixture(scope="module")
def path(model_path) -> Path:  # type: ignore[no-untyped-def]
    p: Path = model_path(PRESET, QUANT)
    return p


@pytest.fixture(scope="module")
def llama(path: Path) -> Iterator:
    made: dict[tuple[Any, ...], Llama] = {}

    def get(**kw: Any) -> Llama:
        key = tuple(sorted(kw.items()))
        if key not in made:
            made[key] = Llama(path, **kw)
        return made[key]

    yield get
    for ref in made.values():
        ref.close()


def _backend(path: Path, kind: str, n_seq: int = 1) -> Any:
    if kind == "numpy":
        return NumpyBackend(load_gguf(path), n_ctx=64, n_seq=n_seq, output="embd")
    from trio_llm.vulkan.backend import VulkanBackend

    return VulkanBackend(load_gguf(path), n_ctx=64, n_seq=n_seq, output="embd")


# -- the model layer ------------------------------------------------------------------------


def test_the_file_reads_as_llama_cpp_loads_it(path: Path) -> None:
    """The converter's keys: a bidirectional model, five symmetric-window layers to one
    global, the window layers' RoPE base from rope.freq_base_swa, the dense widths, mean
    pooling; the graph ends at the dense projections and has no logits."""
    model = load_gguf(path)
    cfg = model.config
    md = model.metadata
    assert md["general.architecture"] == "gemma-embedding" and md["gemma-embedding.pooling_type"] == 1
    assert md["gemma-embedding.dense_2_feat_in"] == md["gemma-embedding.dense_3_feat_out"] == 256
    assert not cfg.causal_attn and cfg.dense_feat == (1024, 1024)
    assert cfg.swa_layers == (True,) * 5 + (False,) and cfg.rope_theta_swa == 10000.0
    g = build_graph(cfg, {n: t.shape for n, t in model.tensors.items()}, "embd")
    att = [n for n in g.nodes if n.op == "attention"]
    assert [(n.attr("window"), bool(n.attrs.get("symmetric"))) for n in att] == [(9, True)] * 5 + [(0, False)]
    assert g.logits is not None and g.logits.name == "result_embd_pooled" and g.logits.width == 256
    # a graph "for logits" is the same: this model has no output head
    assert build_graph(cfg, {n: t.shape for n, t in model.tensors.items()}, "logits").logits.width == 256  # type: ignore[union-attr]


def test_the_symmetric_window_is_llama_cpps_mask() -> None:
    """``attend`` with a symmetric window of W hides exactly the keys llama.cpp's
    ``is_masked_swa(n_swa, LLAMA_SWA_TYPE_SYMMETRIC)`` hides (|p - j| > n_swa / 2, W =
    n_swa / 2 + 1) in a non-causal entry; a causal one is unchanged by it."""
    rng = np.random.default_rng(0)
    n, hd, n_swa = 24, 8, 10
    q = rng.standard_normal((n, 2, hd)).astype(np.float32)
    k = rng.standard_normal((n, 1, hd)).astype(np.float32)
    v = rng.standard_normal((n, 1, hd)).astype(np.float32)
    p = np.arange(n)
    masked = np.abs(p[:, None] - p[None, :]) > n_swa // 2  # [query, key]
    s = q @ k[:, 0].T[None] / np.sqrt(hd)  # [n, 2, n]: query, head, key
    s = np.where(masked[:, None, :], -np.inf, s)
    w = np.exp(s - s.max(-1, keepdims=True))
    want = (w / w.sum(-1, keepdims=True)) @ v[:, 0]  # [n, 2, hd]
    got = attend(q, k, v, 0, n_swa // 2 + 1, causal=False, symmetric=True)
    assert np.allclose(got, want, atol=1e-5)
    assert np.array_equal(attend(q, k, v, 0, 6, causal=True, symmetric=True), attend(q, k, v, 0, 6))


@pytest.mark.parametrize("backend", ["numpy", "vulkan"])
def test_token_embeddings_equal_llama_cpp(llama, path: Path, backend: str) -> None:  # type: ignore[no-untyped-def]
    """Every token's vector (pooling none: llama.cpp's dense projections over each
    token's final norm) on both backends; the causal and the one-sided-window readings
    would be far off (cosines near 0 on this file)."""
    r = llama(embedding=True, pooling="none").post("/embedding", {"content": TOKENS})
    theirs = np.array(r.json()[0]["embedding"])  # [n, n_embd]
    be = _backend(path, backend, n_seq=2)
    try:
        ours = be.forward_rows(SeqBatch(0, np.array(TOKENS, np.int32), 0, causal=False))  # [n, n_embd]
        causal = be.forward_rows(SeqBatch(0, np.array(TOKENS, np.int32), 0))
        # two prompts in one pass: each its own non-causal entry, their last rows
        last = be.forward([SeqBatch(0, np.array(TOKENS, np.int32), 0, causal=False),
                           SeqBatch(1, np.array(TOKENS[:12], np.int32), 0, causal=False)])
        short = be.forward_rows(SeqBatch(0, np.array(TOKENS[:12], np.int32), 0, causal=False))
    finally:
        be.close()
    assert ours.shape == theirs.shape == (len(TOKENS), 256)
    assert cosines(ours, theirs).min() > COS
    assert cosines(causal, theirs).min() < 0.9
    assert np.allclose(last[0], ours[-1], atol=1e-4) and np.allclose(last[1], short[-1], atol=1e-4)


# -- through trio-llm serve --------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["numpy", "vulkan"])
async def test_served_embeddings_equal_llama_servers(serve_argv, llama, path: Path,  # type: ignore[no-untyped-def]
                                                     backend: str) -> None:
    """``serve --embeddings`` with the file's pooling (mean, then the dense projections,
    normalized): /v1/embeddings and /embedding as llama-server's, token counts too;
    pooling none gives each token's vector unnormalized."""
    ref = llama(embedding=True)
    theirs = ref.post("/v1/embeddings", {"input": TEXTS}).json()
    h = await serve_argv("-m", str(path), "--backend", backend, "-c", "512", "--embeddings", "-np", "2")
    async with client(h) as c:
        ours = (await c.post("/v1/embeddings", json={"input": TEXTS})).json()
        native = (await c.post("/embedding", json={"content": TEXTS[0]})).json()
    assert ours["usage"] == theirs["usage"]
    for d, t in zip(ours["data"], theirs["data"], strict=True):
        v = np.array(d["embedding"])
        assert v.shape == (256,) and abs(np.linalg.norm(v) - 1.0) < 1e-5
        assert cosines(v, np.array(t["embedding"]))[0] > COS
    theirs_native = ref.post("/embedding", {"content": TEXTS[0]}).json()
    assert np.allclose(native[0]["embedding"][0], ours["data"][0]["embedding"], atol=1e-6)
    assert cosines(np.array(native[0]["embedding"][0]), np.array(theirs_native[0]["embedding"][0]))[0] > COS


async def test_pooling_none_through_the_server(serve_argv, llama, path: Path) -> None:  # type: ignore[no-untyped-def]
    theirs = llama(embedding=True, pooling="none").post("/embedding", {"content": TEXTS[0]}).json()[0]["embedding"]
    h = await serve_argv("-m", str(path), "--backend", "numpy", "-c", "512", "--embeddings", "--pooling", "none")
    async with client(h) as c:
        ours = (await c.post("/embedding", json={"content": TEXTS[0]})).json()[0]["embedding"]
    assert len(ours) == len(theirs) > 10
    assert cosines(np.array(ours), np.array(theirs)).min() > COS


@pytest.mark.parametrize("embeddings", [True, False])
async def test_generation_is_llama_servers_500(serve_argv, llama, path: Path, embeddings: bool) -> None:  # type: ignore[no-untyped-def]
    """A model without logits: llama-server answers every generation request with a
    500 (its model has no memory), with --embeddings or without; so do we, and without
    --embeddings the embedding endpoints are its 501."""
    ref = llama(embedding=embeddings)
    flags = ["--embeddings"] if embeddings else []
    h = await serve_argv("-m", str(path), "--backend", "numpy", "-c", "512", *flags)
    async with client(h) as c:
        for route, body in (("/completion", {"prompt": "hello", "n_predict": 3}),
                            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
                            ("/v1/completions", {"prompt": "hello", "stream": True})):
            theirs = ref.post(route, body)
            ours = await c.post(route, json=body)
            assert ours.status_code == theirs.status_code == 500, (route, theirs.text)
            assert ours.json()["error"]["message"] == theirs.json()["error"]["message"] == NO_LOGITS
            assert ours.json()["error"]["type"] == "server_error"
        if not embeddings:
            theirs = ref.post("/embedding", {"content": "hi"})
            ours = await c.post("/embedding", json={"content": "hi"})
            assert ours.status_code == theirs.status_code == 501


async def test_a_prompt_beyond_one_batch_is_llama_servers_500(serve_argv, llama, path: Path) -> None:  # type: ignore[no-untyped-def]
    """A bidirectional prompt runs in one pass: longer than -ub is llama-server's 500
    naming the batch size; one that fits still equals llama.cpp's."""
    ref = llama(embedding=True, n_ubatch=32)
    h = await serve_argv("-m", str(path), "--backend", "numpy", "-c", "512", "--embeddings", "-b", "32", "-ub", "32")
    async with client(h) as c:
        body = {"input": TOKENS}
        theirs, ours = ref.post("/v1/embeddings", body), await c.post("/v1/embeddings", json=body)
        assert ours.status_code == theirs.status_code == 500
        assert ours.json()["error"]["message"] == theirs.json()["error"]["message"]
        assert "input (40 tokens) is too large to process" in ours.json()["error"]["message"]
        body = {"input": TOKENS[:32]}
        theirs, ours = ref.post("/v1/embeddings", body), await c.post("/v1/embeddings", json=body)
        assert ours.status_code == theirs.status_code == 200
        assert cosines(np.array(ours.json()["data"][0]["embedding"]),
                       np.array(theirs.json()["data"][0]["embedding"]))[0] > COS


# -- corrupt and unsupported files ------------------------------------------------------------


def _copy(model: Path, out: Path, md: Mapping[str, Any], drop: tuple[str, ...] = ()) -> Path:
    """A copy of the F32 ``model`` with metadata ``md`` set over the file's (None: removed)."""
    return copy_gguf(model, out, kv=uint32s(md), drop=drop)


def test_bad_metadata_is_one_error_naming_the_key(path: Path) -> None:
    model = load_gguf(path)
    md, arch = model.metadata, "gemma-embedding"
    for key, value, match in (("dense_2_feat_in", 128, "dense_2_feat_in' is 128, expected 256"),
                              ("dense_3_feat_out", 512, "dense_3_feat_out' is 512, expected 256"),
                              ("dense_3_feat_in", 512, "dense_2 gives 1024 values, dense_3 reads 512"),
                              ("attention.sliding_window_pattern", "six", "sliding_window_pattern")):
        with pytest.raises(ModelLoadError, match=match):
            gemma_embedding.hparams(Meta(path, {**md, f"{arch}.{key}": value}, arch), model.tensors)
    missing = {k: v for k, v in md.items() if k != f"{arch}.attention.sliding_window"}
    with pytest.raises(ModelLoadError, match="sliding_window"):
        gemma_embedding.hparams(Meta(path, missing, arch), model.tensors)
    # the file's pattern as llama.cpp's load_swa_pattern reads it
    cfg = gemma_embedding.hparams(Meta(path, {**md, f"{arch}.attention.sliding_window_pattern": 3}, arch),
                                  model.tensors)
    assert cfg.swa_layers == (True, True, False) * 2


@pytest.mark.parametrize(("md", "drop", "message"), [
    ({"gemma-embedding.dense_2_feat_out": 512, "gemma-embedding.dense_3_feat_in": 512}, (),
     "tensor 'dense_2.weight' has shape (1024, 256), expected (512, 256)"),
    ({"gemma-embedding.dense_2_feat_in": 128}, (), "'gemma-embedding.dense_2_feat_in' is 128, expected 256"),
    ({}, ("blk.2.attn_k_norm.weight",), "missing tensor 'blk.2.attn_k_norm.weight'"),
], ids=["dense-shape", "dense-width", "missing-tensor"])
def test_a_corrupt_file_is_one_line_through_serve(path: Path, tmp_path: Path, md: dict[str, Any],
                                                  drop: tuple[str, ...], message: str) -> None:
    """As every architecture's: the loader's one error, and ``trio-llm serve`` exits 1 with
    it as one line."""
    bad = _copy(path, tmp_path / "bad.gguf", md, drop)
    with pytest.raises(ModelLoadError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_gguf(bad)
    r = subprocess.run([sys.executable, "-m", "trio_llm", "serve", "--backend", "numpy", "--port", "0", "-m",
                        str(bad), "--embeddings"], capture_output=True, text=True, timeout=120)
    # the start's log lines ("listening"), then the error: one line, the last
    lines = r.stderr.strip().splitlines()
    errors = [ln for ln in lines if not ln.startswith("trio-llm: ")]
    assert r.returncode == 1 and errors == lines[-1:], r.stderr
    assert errors[0].startswith("trio-llm serve: error: ") and message in errors[0]

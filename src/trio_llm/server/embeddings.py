"""Embeddings and reranking: llama-server's ``--embeddings`` / ``--reranking``.

An embedding server's backend is built with an embedding head (``trio_llm.graph``'s
``Output``): its graph ends at the final-norm hidden states (llama.cpp's ``t_embd``),
or, for pooling ``rank``, at the rank head ``cls.output.weight`` applied to them. What
llama.cpp's ``build_pooling`` does in the graph is done here, on the host, over the
rows the backend returns: ``mean`` (of every token), ``cls`` (the first token),
``last`` (the last), ``none`` (every token, unpooled), ``rank`` (the last token's
scores, softmaxed for qwen3 as llama.cpp does). Pooled vectors are normalized by
``common_embd_normalize`` (``--embd-normalize``, a request's ``embd_normalize``;
euclidean by default); per-token ones are not, as in llama-server.

Why not through the queue and the slots loop: that loop plans passes whose result is
one row of logits per slot and samples them; an embedding request wants every row of
its prompt and no sampling. So an embedding server (llama-server's own flag help:
"restrict to only support embedding use case") runs its prompts through the backend
actor directly, inside the residency gate (a sleeping model wakes, and no release
begins under a pass), and answers its generation endpoints with 501. Each prompt
starts at position 0 of a sequence, within one backend call, so calls from concurrent
requests (serialised by the actor) never see each other's KV cache.

Pure parts (``resolve_pooling``, ``pool``, ``normalize``, ``parse_inputs``,
``rerank_prompt``, the response shapers) are tested without trio; ``Embedder`` is the
thin async shell.
"""

from __future__ import annotations

import base64
import math
from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import numpy as np
import trio

from trio_llm.engine.backend import SeqBatch
from trio_llm.errors import ContextOverflow, InputTooLarge, InvalidRequest

#: llama.cpp's ``enum llama_pooling_type`` values, as GGUF ``<arch>.pooling_type`` stores them
POOLING_NAMES = {0: "none", 1: "mean", 2: "cls", 3: "last", 4: "rank"}
#: the rank head of a causal reranker (Qwen3-Reranker): llama.cpp's ``cls_out``
RANK_HEAD = "cls.output.weight"
#: architectures whose rank scores llama.cpp softmaxes (``build_pooling``: qwen3, qwen3vl)
RANK_SOFTMAX_ARCHS = frozenset({"qwen3", "qwen3vl"})


def model_pooling(metadata: Mapping[str, Any]) -> str:
    """The file's default pooling (``<arch>.pooling_type``), or "" when it has none."""
    arch = metadata.get("general.architecture")
    value = metadata.get(f"{arch}.pooling_type")
    if isinstance(value, int) and not isinstance(value, bool):
        return POOLING_NAMES.get(value, "")
    return ""


def resolve_pooling(flag: str, metadata: Mapping[str, Any]) -> str:
    """``--pooling`` if given, else the model's, else ``none`` (llama.cpp's context
    default for an unspecified pooling)."""
    return flag or model_pooling(metadata) or "none"


def backend_output(embeddings: bool, pooling: str, tensor_names: Sequence[str] | Mapping[str, Any],
                   causal: bool = True) -> str:
    """What the backend's graph computes: logits unless ``--embeddings``; the rank head
    for pooling rank when the file has one (without one the server still starts, with
    hidden states, and ``/rerank`` answers 400 naming the missing head). A model
    without causal attention (an encoder: gemma-embedding) has no logits at all, as in
    llama.cpp, whose graph for it ends at ``t_embd``: its server does not generate."""
    if not causal:
        return "embd"
    if not embeddings:
        return "logits"
    if pooling == "rank" and RANK_HEAD in tensor_names:
        return "rank"
    return "embd"


# -- pooling and normalization (llama.cpp's build_pooling and common_embd_normalize) ----


def pool(rows: np.ndarray, pooling: str) -> np.ndarray:
    """One sequence's rows ``[n, width]`` pooled: ``[width]``, or ``[n, width]`` for none."""
    if pooling == "mean":
        return rows.astype(np.float64).mean(axis=0).astype(np.float32)
    if pooling == "cls":
        return rows[0]
    if pooling in ("last", "rank"):
        return rows[-1]
    return rows


def normalize(v: np.ndarray, embd_norm: int) -> np.ndarray:
    """``common_embd_normalize``: -1 none, 0 max-abs scaled to int16's range, 2
    euclidean, any other p: the p-norm (1: taxicab); a zero vector stays zero."""
    x = v.astype(np.float64)
    if embd_norm == -1:
        s = 1.0
    elif embd_norm == 0:
        s = float(np.abs(x).max(initial=0.0)) / 32760.0
    elif embd_norm == 2:
        s = math.sqrt(float((x * x).sum()))
    else:
        s = float((np.abs(x) ** embd_norm).sum()) ** (1.0 / embd_norm)
    scale = 1.0 / s if s > 0.0 else 0.0
    return (x * scale).astype(np.float32)


def rank_score(scores: np.ndarray, arch: str) -> float:
    """The rerank score of one sequence's rank-head output: its first value, after a
    softmax for the architectures llama.cpp softmaxes (qwen3: p("yes") of yes/no)."""
    x = scores.astype(np.float64)
    if arch in RANK_SOFTMAX_ARCHS:
        e = np.exp(x - x.max())
        x = e / e.sum()
    return float(x[0])


# -- request inputs (llama-server's tokenize_input_subprompt) ---------------------------


def _is_token(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _tokens(value: Any, tok: Any, n_vocab: int, *, add_special: bool) -> list[int]:
    """One prompt: a string, token ids, a list mixing both (only the first string gets
    BOS/EOS), ``{"prompt_string": ...}`` or OpenAI content ``{"content": [{"type":
    "text", "text": ...}]}`` (texts concatenated)."""
    if isinstance(value, dict):
        if "prompt_string" in value:
            if "multimodal_data" in value:
                raise InvalidRequest("Multimodal data provided, but model does not support multimodal requests.")
            return _tokens(value["prompt_string"], tok, n_vocab, add_special=add_special)
        content = value.get("content")
        if not isinstance(content, list):
            raise InvalidRequest("'content' must be an array of content parts")
        texts = []
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind != "text" or not isinstance(part.get("text"), str):
                what = f"content part of type {kind!r}" if isinstance(kind, str) else "a content part without a type"
                raise InvalidRequest(f"{what} is not supported here (text parts only: the model is not multimodal)")
            texts.append(part["text"])
        return _tokens("".join(texts), tok, n_vocab, add_special=add_special)
    if isinstance(value, str):
        return list(tok.encode(value, add_special=add_special, parse_special=True))
    if isinstance(value, list) and value and all(_is_token(t) or isinstance(t, str) for t in value):
        ids: list[int] = []
        first = True
        for part in value:
            if isinstance(part, str):
                ids += tok.encode(part, add_special=add_special and first, parse_special=True)
            else:
                if not 0 <= part < n_vocab:
                    raise InvalidRequest(f"token {part} is outside the vocabulary of {n_vocab}")
                ids.append(int(part))
            first = False
        return ids
    raise InvalidRequest('"input" elements must be a string, a list of tokens, a JSON object containing a '
                         'prompt string, or a list of mixed strings & tokens.')


def parse_inputs(value: Any, tok: Any, n_vocab: int, n_ctx: int) -> list[list[int]]:
    """The prompts of an embedding request's ``input`` (or ``content``): one prompt, or
    a list of several (a list that is not one prompt of token ids and strings)."""
    if isinstance(value, list) and not any(_is_token(v) for v in value):
        if not value:
            raise InvalidRequest('"input" must not be empty')
        prompts = [_tokens(v, tok, n_vocab, add_special=True) for v in value]
    else:
        prompts = [_tokens(value, tok, n_vocab, add_special=True)]
    for ids in prompts:
        if not ids:
            raise InvalidRequest("Input content cannot be empty")
        if len(ids) > n_ctx:
            raise ContextOverflow(len(ids), n_ctx)
    return prompts


def encoding_format(body: Mapping[str, Any]) -> bool:
    """Whether the answer is base64 (``encoding_format``: float, the default, or base64)."""
    fmt = body.get("encoding_format", "float")
    if fmt not in ("float", "base64"):
        raise InvalidRequest("The format to return the embeddings in. Can be either float or base64")
    return fmt == "base64"


def embd_normalize(body: Mapping[str, Any], default: int) -> int:
    value = body.get("embd_normalize", default)
    if not _is_token(value):
        raise InvalidRequest("'embd_normalize' must be an integer")
    return int(value)


# -- answers -------------------------------------------------------------------------


def model_name(body: Mapping[str, Any], default: str) -> str:
    """The answer's ``model``: the request's, as llama-server echoes it, else the server's."""
    model = body.get("model")
    return model if isinstance(model, str) else default


@attrs.frozen
class Embedded:
    """One prompt's answer: its vectors (one when pooled) and its token count."""

    vectors: list[np.ndarray]
    n_tokens: int


def native_response(results: Sequence[Embedded]) -> list[dict[str, Any]]:
    """``/embedding``: ``[{"index", "embedding": [[...], ...]}]``, one entry per prompt."""
    return [{"index": i, "embedding": [v.tolist() for v in r.vectors]} for i, r in enumerate(results)]


def oai_response(results: Sequence[Embedded], *, model: str, use_base64: bool) -> dict[str, Any]:
    """``/v1/embeddings`` in OpenAI's shape (base64: the float32 bytes, as llama-server)."""
    data = []
    for i, r in enumerate(results):
        v = r.vectors[0]
        if use_base64:
            data.append({"embedding": base64.b64encode(v.astype("<f4").tobytes()).decode("ascii"), "index": i,
                         "object": "embedding", "encoding_format": "base64"})
        else:
            data.append({"embedding": v.tolist(), "index": i, "object": "embedding"})
    n = sum(r.n_tokens for r in results)
    return {"model": model, "object": "list", "usage": {"prompt_tokens": n, "total_tokens": n}, "data": data}


# -- reranking (llama-server's /rerank) ---------------------------------------------


@attrs.frozen
class RerankRequest:
    query: str
    documents: tuple[str, ...]
    top_n: int
    tei: bool  # TEI's shape ("texts", a bare list, "score"); else Jina's ("documents", "relevance_score")
    return_text: bool


def parse_rerank(body: Any) -> RerankRequest:
    if not isinstance(body, dict):
        raise InvalidRequest("the request body must be a JSON object")
    tei = "texts" in body
    if "query" not in body:
        raise InvalidRequest('"query" must be provided')
    query = body["query"]
    if not isinstance(query, str):
        raise InvalidRequest('"query" must be a string')
    docs = body.get("documents", body.get("texts", []))
    if not isinstance(docs, list) or not docs or not all(isinstance(d, str) for d in docs):
        raise InvalidRequest('"documents" must be a non-empty string array')
    top_n = body.get("top_n", len(docs))
    if not _is_token(top_n):
        raise InvalidRequest("'top_n' must be an integer")
    return_text = body.get("return_text", False)
    if not isinstance(return_text, bool):
        raise InvalidRequest("'return_text' must be a boolean")
    return RerankRequest(query, tuple(docs), int(top_n), tei, tei and return_text)


def rerank_prompt(tok: Any, metadata: Mapping[str, Any], query: str, doc: str) -> list[int]:
    """llama-server's ``format_prompt_rerank``: the file's ``rerank`` chat template
    with ``{query}`` and ``{document}`` filled in (specials parsed, nothing added), or
    else ``[BOS] query [EOS] [SEP] doc [EOS]`` by the vocabulary's add-token flags."""
    template = metadata.get("tokenizer.chat_template.rerank")
    if isinstance(template, str):
        text = template.replace("{query}", query).replace("{document}", doc)
        return list(tok.encode(text, add_special=False, parse_special=True))
    q = list(tok.encode(query, add_special=False, parse_special=False))
    d = list(tok.encode(doc, add_special=False, parse_special=False))
    sep = metadata.get("tokenizer.ggml.seperator_token_id")
    eos = tok.eos_id if tok.eos_id is not None else sep
    out: list[int] = []
    if tok.add_bos and tok.bos_id is not None:
        out.append(tok.bos_id)
    out += q
    if tok.add_eos and eos is not None:
        out.append(eos)
    if metadata.get("tokenizer.ggml.add_sep_token") and sep is not None:
        out.append(int(sep))
    out += d
    if tok.add_eos and eos is not None:
        out.append(eos)
    return out


def rerank_response(req: RerankRequest, scores: Sequence[float], n_tokens: Sequence[int], *,
                    model: str) -> Any:
    """llama-server's ``format_response_rerank``: sorted by score, best first, the
    first ``top_n``; TEI's shape is the bare list."""
    label = "score" if req.tei else "relevance_score"
    elems: list[dict[str, Any]] = []
    for i, s in enumerate(scores):
        e: dict[str, Any] = {"index": i, label: float(s)}
        if req.return_text:
            e["text"] = req.documents[i]
        elems.append(e)
    elems.sort(key=lambda e: -e[label])
    elems = elems[: max(0, min(req.top_n, len(elems)))]
    if req.tei:
        return elems
    n = sum(n_tokens)
    return {"model": model, "object": "list", "usage": {"prompt_tokens": n, "total_tokens": n}, "results": elems}


# -- the async shell -----------------------------------------------------------------


@attrs.frozen
class EmbedderStatistics:
    n_prompt_tokens: int  # prompt tokens through the model
    t_prompt: float  # seconds of those passes (trio's clock)
    n_decode: int  # forward passes (backend calls)


@attrs.define(eq=False)
class Embedder:
    """Runs embedding and rank passes through the backend actor (see the module
    docstring). ``client`` is a ``BackendClient``, ``gate`` the residency gate."""

    client: Any
    gate: Any
    pooling: str
    output: str  # the backend's graph output: "embd" or "rank"
    arch: str
    n_seq: int
    #: False for a model without causal attention (``ModelConfig.causal_attn``): each
    #: prompt then runs as one non-causal entry of at most ``n_batch`` tokens (as
    #: llama.cpp runs a model without memory: one ubatch)
    causal: bool = True
    n_batch: int = 0
    _active: int = 0
    _tokens: int = 0
    _seconds: float = 0.0
    _passes: int = 0

    def statistics(self) -> EmbedderStatistics:
        return EmbedderStatistics(self._tokens, self._seconds, self._passes)

    @property
    def has_rank_head(self) -> bool:
        return self.output == "rank"

    async def _run(self, fn: Any, what: str, n_tokens: int) -> Any:
        self._active += 1
        if self._active == 1:
            self.gate.set_busy(True)
        try:
            async with self.gate.resident():
                t0 = trio.current_time()
                out = await self.client.call(fn, what)
                self._seconds += trio.current_time() - t0
                self._tokens += n_tokens
                self._passes += 1
                return out
        finally:
            self._active -= 1
            if self._active == 0:
                self.gate.set_busy(False)

    async def embed(self, prompts: Sequence[Sequence[int]], embd_norm: int) -> list[Embedded]:
        """Each prompt's pooled (and normalized) vector, or its per-token vectors for
        pooling none. ``last`` runs up to ``n_seq`` prompts in one pass (their last rows
        are what ``forward`` returns); the others one prompt per pass, every row."""
        pooling = self.pooling
        if not self.causal:
            for p in prompts:
                if len(p) > self.n_batch:
                    raise InputTooLarge(len(p), self.n_batch)
        out: list[Embedded] = []
        if pooling == "last":
            for start in range(0, len(prompts), self.n_seq):
                group = prompts[start : start + self.n_seq]
                batch = [SeqBatch(i, np.asarray(p, np.int32), 0, causal=self.causal) for i, p in enumerate(group)]
                rows = await self._run(lambda b, batch=batch: b.forward(batch), "embed", sum(map(len, group)))
                out += [Embedded([normalize(rows[i], embd_norm)], len(p)) for i, p in enumerate(group)]
            return out
        for p in prompts:
            entry = SeqBatch(0, np.asarray(p, np.int32), 0, causal=self.causal)
            rows = await self._run(lambda b, entry=entry: b.forward_rows(entry), "embed", len(p))
            pooled = pool(rows, pooling)
            if pooling == "none":
                out.append(Embedded([r.copy() for r in pooled], len(p)))
            else:
                out.append(Embedded([normalize(pooled, embd_norm)], len(p)))
        return out

    async def rank(self, prompts: Sequence[Sequence[int]]) -> list[float]:
        """Each prompt's rerank score: the rank head of its last token, ``n_seq`` prompts
        a pass."""
        scores: list[float] = []
        for start in range(0, len(prompts), self.n_seq):
            group = prompts[start : start + self.n_seq]
            batch = [SeqBatch(i, np.asarray(p, np.int32), 0, causal=self.causal) for i, p in enumerate(group)]
            rows = await self._run(lambda b, batch=batch: b.forward(batch), "rank", sum(map(len, group)))
            scores += [rank_score(rows[i], self.arch) for i in range(len(group))]
        return scores

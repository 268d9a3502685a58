"""llama-server's ``return_tokens``: the final answer of /completion, /infill and each
of several completions (``n_cmpl``) carries the generated ids in "tokens" only when the
request asks for them; otherwise the key is there with an empty list. A streamed chunk
carries its token either way, the stream's final event none. Checked against llama.cpp
itself (``xllamacpp``'s in-process llama-server on the same file and requests)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from conftest import ServeFactory

xllamacpp = pytest.importorskip("xllamacpp")
from llamacpp_ref import plain_tokens, server_params  # noqa: E402  (after the wheel is known to be there)

#: -c 2048 -b 1024 as llama.cpp's own infill tests; two slots for n_cmpl 2
ARGV = ("-c", "2048", "-b", "1024", "-np", "2")
INFILL = {
    "input_extra": [{"filename": "llama.h", "text": "LLAMA_API int32_t llama_n_threads();\n"}],
    "input_prefix": "#include <cstdio>\n#include \"llama.h\"\n\nint main() {\n",
    "prompt": "    int n_threads = llama_",
    "input_suffix": "}\n",
}


def _events(text: str) -> list[dict[str, Any]]:
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: ") and line != "data: [DONE]"]


def _requests(prompt: list[int]) -> Iterator[tuple[str, str, dict[str, Any]]]:
    """(label, path, body) of every request both servers answer: each with and
    without return_tokens."""
    base = {"n_predict": 6, "temperature": 0, "cache_prompt": False}
    for asked in ({}, {"return_tokens": False}, {"return_tokens": True}):
        label = f"return_tokens={asked.get('return_tokens', '-')}"
        yield f"completion {label}", "/completion", {"prompt": prompt, **base, **asked}
        yield f"stream {label}", "/completion", {"prompt": prompt, **base, **asked, "stream": True}
        yield f"n_cmpl {label}", "/completion", {"prompt": prompt, **base, **asked, "n_cmpl": 2}
        yield f"infill {label}", "/infill", {**INFILL, **base, **asked}
        yield f"infill stream {label}", "/infill", {**INFILL, **base, **asked, "stream": True}
        yield f"v1 {label}", "/v1/completions", {"prompt": prompt, **base, **asked, "max_tokens": 6}
        yield f"v1 stream {label}", "/v1/completions", {"prompt": prompt, **base, **asked, "max_tokens": 6,
                                                        "stream": True}


def _shape(answer: Any) -> Any:
    """What is compared of an answer: every answer's (or stream event's) key set, its
    "tokens" and counts (of a /v1 one, its choices' key sets and its usage's counts)."""
    if isinstance(answer, list):
        return [_shape(a) for a in answer]
    out: dict[str, Any] = {"keys": sorted(answer)}
    for key in ("tokens", "tokens_predicted", "tokens_evaluated"):
        if key in answer:
            out[key] = answer[key]
    if "usage" in answer:
        out["usage"] = {k: answer["usage"][k] for k in ("prompt_tokens", "completion_tokens")}
    if "choices" in answer:
        out["choices"] = [sorted(c) for c in answer["choices"]]
    return out


def _answer(r: httpx.Response, stream: bool) -> Any:
    assert r.status_code == 200, r.text
    return _events(r.text) if stream else r.json()


async def test_return_tokens_as_llama_server(serve_argv: ServeFactory, sharp_qwen3_model: Path) -> None:
    from trio_llm.model.gguf import load_gguf
    from trio_llm.model.tokenizer import Tokenizer

    tok = Tokenizer.from_metadata(load_gguf(sharp_qwen3_model).metadata)
    prompt = plain_tokens(tok)[:8]
    requests = list(_requests(prompt))
    params = server_params(sharp_qwen3_model, 2048)
    params.n_batch = 1024
    params.n_parallel = 2
    ref = xllamacpp.Server(params)
    try:
        # a fresh connection per request: CI once saw the reference close a kept-alive
        # connection as the next request went out ("Server disconnected without sending a
        # response"), which says nothing about either server's answers
        with httpx.Client(base_url=ref.listening_address, timeout=60,
                          limits=httpx.Limits(max_keepalive_connections=0)) as c:
            theirs = [_answer(c.post(path, json=body), bool(body.get("stream"))) for _, path, body in requests]
    finally:
        del ref
    h = await serve_argv("-m", sharp_qwen3_model, "--backend", "numpy", *ARGV)
    async with httpx.AsyncClient(base_url=h.url, timeout=60) as c:
        ours = [_answer(await c.post(path, json=body), bool(body.get("stream"))) for _, path, body in requests]
    for (label, _, body), mine, their in zip(requests, ours, theirs, strict=True):
        assert _shape(mine) == _shape(their), label
        if body.get("return_tokens") and not body.get("stream") and "v1" not in label:
            # asked for: the ids are there (and equal llama.cpp's, above)
            finals = mine if isinstance(mine, list) else [mine]
            assert all(len(f["tokens"]) == f["tokens_predicted"] > 0 for f in finals), label

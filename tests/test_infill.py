"""``/infill``: llama-server's FIM layout, checked against llama.cpp itself (``xllamacpp``'s
in-process llama-server on the same file) through a real server on loopback."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from test_server_flags import Start, client, start  # noqa: F401  (the fixture)
from trio_llm.model.gguf import load_gguf
from trio_llm.model.tokenizer import Tokenizer
from trio_llm.server import infill as IN

xllamacpp = pytest.importorskip("xllamacpp")
from llamacpp_ref import server_params  # noqa: E402  (after the wheel is known to be there)

BODY: dict[str, Any] = {
    "input_extra": [{"filename": "llama.h", "text": "LLAMA_API int32_t llama_n_threads();\n"}],
    "input_prefix": "#include <cstdio>\n#include \"llama.h\"\n\nint main() {\n",
    "prompt": "    int n_threads = llama_",
    "input_suffix": "}\n",
    "n_predict": 8, "temperature": 0.0, "cache_prompt": False, "return_tokens": True,
}


def llama_infill(path: Path, body: dict[str, Any]) -> dict[str, Any]:
    """llama.cpp's answer (-c 2048 -b 1024 -np 1, as llama.cpp's own infill tests)."""
    params = server_params(path, 2048)
    params.n_batch = 1024
    server = xllamacpp.Server(params)
    try:
        r = httpx.post(server.listening_address + "/infill", json=body, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()  # type: ignore[no-any-return]
    finally:
        del server


def test_fim_tokens_come_from_the_vocabulary(model_path) -> None:  # type: ignore[no-untyped-def]
    qwen = load_gguf(model_path("tiny-qwen3", "Q8_0")).metadata
    fim = IN.fim_tokens(qwen)
    texts = qwen["tokenizer.ggml.tokens"]
    assert [texts[t] for t in (fim.pre, fim.suf, fim.mid, fim.rep, fim.sep)] == [  # type: ignore[index]
        "<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>", "<|repo_name|>", "<|file_sep|>"]
    assert fim.missing() == ""
    assert IN.fim_tokens(dict(qwen, **{"tokenizer.ggml.fim_pre_token_id": 7})).pre == 7  # the metadata id wins
    llama3 = IN.fim_tokens(load_gguf(model_path("tiny", "Q8_0")).metadata)
    assert llama3.missing() == "prefix token is missing. suffix token is missing. middle token is missing. "


def test_spm_order_puts_the_suffix_first(model_path) -> None:  # type: ignore[no-untyped-def]
    md = load_gguf(model_path("tiny-qwen3", "Q8_0")).metadata
    tok, fim = Tokenizer.from_metadata(md), IN.fim_tokens(md)
    kw: dict[str, Any] = dict(n_vocab=tok.n_vocab, n_batch=1024, n_predict=-1, n_ctx=2048)
    psm = IN.infill_prompt(BODY, tok, fim, spm=False, **kw)
    spm = IN.infill_prompt(BODY, tok, fim, spm=True, **kw)
    assert sorted(psm) == sorted(spm) and psm[-1] == spm[-1] == fim.mid
    assert psm.index(fim.pre) < psm.index(fim.suf) and spm.index(fim.suf) < spm.index(fim.pre)


async def test_infill_equals_llama_cpp(start: Start, model_path) -> None:  # noqa: F811
    path = model_path("tiny-qwen3", "Q8_0", sharp=True)
    theirs = llama_infill(path, BODY)
    h = await start("-m", str(path), "-c", "2048", "-b", "1024", "-np", "1")
    async with client(h) as c:
        ours = (await c.post("/infill", json=BODY)).json()
        assert ours["tokens_evaluated"] == theirs["tokens_evaluated"]  # the same FIM prompt
        md = load_gguf(path).metadata
        tok = Tokenizer.from_metadata(md)
        ids = IN.infill_prompt(BODY, tok, IN.fim_tokens(md), n_vocab=tok.n_vocab, n_batch=1024, n_predict=-1,
                               n_ctx=2048, spm=False)
        assert tok.decode(ids) == theirs["prompt"] and len(ids) == theirs["tokens_evaluated"]
        assert ours["tokens"] == theirs["tokens"] and ours["content"] == theirs["content"]
        # streamed like /completion: the same text, a final event with stop
        r = await c.post("/infill", json=dict(BODY, stream=True))
        events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: ")]
        assert events[-1]["stop"] is True
        assert "".join(e["content"] for e in events) == theirs["content"]
        # without input_extra too
        plain = {k: v for k, v in BODY.items() if k != "input_extra"}
        assert (await c.post("/infill", json=plain)).json()["tokens_evaluated"] == \
            llama_infill(path, plain)["tokens_evaluated"]
        for extra in ({}, {"filename": "ok"}, {"filename": 123}, {"filename": 123, "text": "abc"},
                      {"filename": 123, "text": 456}):
            r = await c.post("/infill", json=dict(BODY, input_extra=[extra]))
            assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", extra
        for bad in ({"input_suffix": "x"}, {"input_prefix": "x"}, dict(BODY, prompt=1), dict(BODY, input_extra={})):
            assert (await c.post("/infill", json=bad)).status_code == 400, bad


async def test_infill_without_fim_tokens_is_refused(start: Start) -> None:  # noqa: F811
    h = await start()  # the tiny llama-3 vocabulary has no FIM tokens
    async with client(h) as c:
        r = await c.post("/infill", json=BODY)
        assert r.status_code == 501 and "prefix token is missing" in r.json()["error"]["message"]

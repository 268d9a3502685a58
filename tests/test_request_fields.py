"""llama-server's request fields beyond sampling: ``n_cmpl`` (alias ``n``) on
/completion, ``response_fields``, the code-completion limits ``n_indent`` and
``t_max_predict_ms``, and the refusals of what is not built (``lora``,
``grammar_lazy``) instead of a 200 that ignored them."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from conftest import ServeFactory
from trio_llm.runtime import ServerHandle, parse_config
from trio_llm.server.flags import UsageError
from trio_llm.server.slots import Slot, SlotsEngine
from trio_llm.server.stop import StopScanner
from trio_llm.server.tasks import ServerTask, TaskParams

Start = Callable[..., Awaitable[ServerHandle]]


@pytest.fixture
def start(serve_argv: ServeFactory, tiny_model: Path) -> Start:
    """A numpy server of the tiny model with a 512-position context and more flags."""
    return lambda *argv: serve_argv("-m", tiny_model, "--backend", "numpy", "-c", "512", *argv)


async def test_n_cmpl_and_response_fields(start: Start) -> None:
    h = await start("-np", "2")
    body = {"prompt": "Once upon", "n_predict": 6, "seed": 5, "temperature": 1.0}
    async with httpx.AsyncClient(base_url=h.url, timeout=60) as c:
        two = (await c.post("/completion", json={**body, "n_cmpl": 2})).json()
        alias = (await c.post("/completion", json={**body, "n": 2})).json()
        one = [(await c.post("/completion", json={**body, "seed": s})).json() for s in (5, 6)]
        too_many = await c.post("/completion", json={**body, "n_cmpl": 3})
        picked = (await c.post("/completion", json={**body, "response_fields": [
            "content", "generation_settings/n_predict", "timings/predicted_n", "no/such"]})).json()
    assert isinstance(two, list) and [a["index"] for a in two] == [0, 1]
    # choice i samples with seed + i: each is the single answer of that seed
    assert [a["content"] for a in two] == [a["content"] for a in alias] == [a["content"] for a in one]
    assert too_many.status_code == 400 and "n_cmpl" in too_many.json()["error"]["message"]
    assert set(picked) == {"content", "generation_settings/n_predict", "timings/predicted_n"}
    assert picked["generation_settings/n_predict"] == 6 and picked["content"] == one[0]["content"]


@pytest.mark.parametrize(("field", "value", "needle"), [
    ("lora", [{"id": 0, "scale": 1.0}], "'lora'"), ("grammar_lazy", True, "'grammar_lazy'"),
    ("n_indent", -1, "'n_indent'"), ("response_fields", "content", "'response_fields'")])
async def test_what_is_not_built_is_400(start: Start, field: str, value: Any, needle: str) -> None:
    h = await start()
    async with httpx.AsyncClient(base_url=h.url, timeout=60) as c:
        r = await c.post("/completion", json={"prompt": "hi", "n_predict": 1, field: value})
        ok = await c.post("/completion", json={"prompt": "hi", "n_predict": 1, "lora": []})
    assert r.status_code == 400 and needle in r.json()["error"]["message"], r.text
    assert ok.status_code == 200


async def test_n_indent_cuts_the_line_that_is_not_indented(start: Start) -> None:
    """A grammar writes the lines; the third begins with less than 2 spaces: the answer
    ends before its text, as llama-server's (stop type limit)."""
    h = await start()
    grammar = 'root ::= "def f():\\n" "  return 1\\n" "x = 2\\n" [a-z]*'
    async with httpx.AsyncClient(base_url=h.url, timeout=60) as c:
        r = (await c.post("/completion", json={"prompt": "code", "n_predict": 40, "temperature": 0,
                                               "grammar": grammar, "n_indent": 2})).json()
        free = (await c.post("/completion", json={"prompt": "code", "n_predict": 40, "temperature": 0,
                                                  "grammar": grammar})).json()
    assert free["content"].startswith("def f():\n  return 1\nx = 2\n")
    assert (r["content"], r["stop_type"]) == ("def f():\n  return 1\n", "limit")


def _slot(params: TaskParams) -> Slot:
    slot = Slot(0, 64)
    slot.task = ServerTask(1, (1, 2), params, results=None)  # type: ignore[arg-type]
    slot.scanner = StopScanner(())
    return slot


def test_t_max_predict_ms_ends_at_a_newline_past_the_time() -> None:
    """The time limit counts from the first token, and acts only on a token with a
    newline, as llama-server's (times given, no clock read)."""
    slot = _slot(TaskParams(t_max_predict_ms=100))
    slot.t_prompt_done = 10.0
    limits = SlotsEngine._fim_limits

    def feed(piece: str, now: float) -> bool:
        slot.scanner.feed(piece)
        return limits(None, slot, piece, now)  # type: ignore[arg-type]

    assert not feed("a\n", 10.05)  # a newline, 50 ms in
    assert not feed("bbb", 10.2)  # 200 ms, no newline
    assert feed("c\nd", 10.2)  # a newline past 100 ms
    never = _slot(TaskParams())
    never.t_prompt_done = 0.0
    assert not limits(None, never, "\n", 1e6)  # type: ignore[arg-type]


def test_device_flags() -> None:
    """-dev VulkanN / none and --list-devices, as llama-server names devices."""
    assert parse_config(["-dev", "Vulkan0"], {}).device == "0"
    none = parse_config(["-dev", "none"], {})
    assert (none.device, none.backend) == (None, "numpy")
    for bad, why in ((["-dev", "Vulkan0,Vulkan1"], "name one device"), (["-dev", "CUDA0"], "unknown device"),
                     (["-dev", "none", "--backend", "vulkan"], "-dev none")):
        with pytest.raises(UsageError, match=why):
            parse_config(bad, {})


@pytest.mark.vulkan
def test_list_devices_and_a_chosen_device(tiny_model: Path) -> None:
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "trio_llm", "serve", "--list-devices"], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.startswith("Available devices:\n  Vulkan0: "), r.stdout + r.stderr
    r = subprocess.run([sys.executable, "-m", "trio_llm", "serve", "-m", str(tiny_model), "--port", "0",
                        "--backend", "vulkan", "-dev", "Vulkan9"], capture_output=True, text=True, timeout=120)
    lines = [ln for ln in r.stderr.strip().splitlines() if not ln.startswith("trio-llm: listening on ")]
    assert r.returncode != 0 and len(lines) == 1 and "no Vulkan device with index 9" in lines[0], r.stderr


@pytest.mark.vulkan
async def test_serving_on_the_named_device(start: Start) -> None:
    h = await start("--backend", "vulkan", "-dev", "Vulkan0", "-c", "128")
    async with httpx.AsyncClient(base_url=h.url, timeout=60) as c:
        r = await c.post("/completion", json={"prompt": "hi", "n_predict": 2})
    assert r.status_code == 200 and h.context.config.device == "0"


async def test_api_prefix_and_static_files(start: Start, tmp_path: Path) -> None:
    """--api-prefix serves every route under the prefix (404 outside it); --path serves
    a directory's files before the routes, never a file outside it."""
    site = tmp_path / "site"
    (site / "js").mkdir(parents=True)
    (site / "index.html").write_text("<h1>mine</h1>")
    (site / "js" / "a.js").write_text("let a = 1;")
    (tmp_path / "secret.txt").write_text("no")
    h = await start("--api-prefix", "/llm/", "--path", str(site))
    async with httpx.AsyncClient(base_url=h.url, timeout=60) as c:
        assert (await c.get("/llm/health")).json() == {"status": "ok"}
        assert (await c.post("/llm/completion", json={"prompt": "hi", "n_predict": 1})).status_code == 200
        assert (await c.get("/health")).status_code == 404
        assert (await c.get("/llmx/health")).status_code == 404
        index = await c.get("/llm/")
        assert index.text == "<h1>mine</h1>" and index.headers["content-type"].startswith("text/html")
        js = await c.get("/llm/js/a.js")
        assert js.text == "let a = 1;" and "javascript" in js.headers["content-type"]
        head = await c.head("/llm/js/a.js")
        assert head.status_code == 200 and head.content == b"" and head.headers["content-length"] == "10"
        for sneaky in ("/llm/../secret.txt", "/llm/%2e%2e/secret.txt", "/llm/js/%2e%2e/%2e%2e/secret.txt"):
            assert (await c.get(sneaky)).text != "no"
    with pytest.raises(UsageError, match="static assets path not found"):
        parse_config(["--path", str(tmp_path / "nope")], {})


def test_cache_list_is_llamacpps(tmp_path: Path) -> None:
    """-cl: the hub cache's models as REPO:TAG (first parts, quant-tagged names, no
    sidecars), through the CLI with $LLAMA_CACHE."""
    import os
    import subprocess
    import sys

    def plant(repo: str, *names: str) -> None:
        d = tmp_path / ("models--" + repo.replace("/", "--"))
        (d / "refs").mkdir(parents=True)
        (d / "refs" / "main").write_text("ab" * 20)
        snap = d / "snapshots" / ("ab" * 20)
        for n in names:
            (snap / n).parent.mkdir(parents=True, exist_ok=True)
            (snap / n).write_bytes(b"GGUF")

    plant("unsloth/Qwen3.5-9B-GGUF", "Qwen3.5-9B-Q4_K_M.gguf", "Qwen3.5-9B-UD-Q4_K_XL.gguf", "mmproj-F16.gguf",
          "BF16/Qwen3.5-9B-BF16-00001-of-00002.gguf", "BF16/Qwen3.5-9B-BF16-00002-of-00002.gguf", "README.md")
    plant("ggml-org/gemma-3-4b-it-GGUF", "gemma-3-4b-it-Q8_0.gguf", "gemma-3-4b-it-q8_0.gguf", "notag.gguf")
    r = subprocess.run([sys.executable, "-m", "trio_llm", "serve", "-cl"], capture_output=True, text=True,
                       timeout=60, env={**os.environ, "LLAMA_CACHE": str(tmp_path)})
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == [
        "number of models in cache: 4",
        "   1. ggml-org/gemma-3-4b-it-GGUF:Q8_0",
        "   2. unsloth/Qwen3.5-9B-GGUF:BF16",
        "   3. unsloth/Qwen3.5-9B-GGUF:Q4_K_M",
        "   4. unsloth/Qwen3.5-9B-GGUF:Q4_K_XL",
    ]


async def test_special_writes_control_tokens(start: Start) -> None:
    """-sp: a control token's text is in the answer, the end token's last, as
    llama-server's --special (forced here by a logit bias)."""
    from trio_llm.model.gguf import load_gguf
    from trio_llm.model.tokenizer import Tokenizer

    h = await start("-sp")
    tok = Tokenizer.from_metadata(load_gguf(h.context.config.model).metadata)  # type: ignore[arg-type]
    eog = min(tok.eog_ids)
    body = {"prompt": "hi", "n_predict": 4, "temperature": 0, "logit_bias": [[eog, 100.0]]}
    plain = await start()
    async with httpx.AsyncClient(base_url=h.url, timeout=60) as c:
        r = (await c.post("/completion", json=body)).json()
    async with httpx.AsyncClient(base_url=plain.url, timeout=60) as c:
        p = (await c.post("/completion", json=body)).json()
    assert (r["stop_type"], p["stop_type"]) == ("eos", "eos")
    assert r["content"] == tok.token_to_piece(eog).decode() and p["content"] == ""


async def test_an_end_of_generation_token_counts_as_decoded(start: Start, tiny_model: Path) -> None:
    """llama-server counts the end token in tokens_predicted, timings.predicted_n and
    usage.completion_tokens: the same figures here (xllamacpp, the same request)."""
    from llamacpp_ref import Reference, plain_tokens
    from trio_llm.model.gguf import load_gguf
    from trio_llm.model.tokenizer import Tokenizer

    tok = Tokenizer.from_metadata(load_gguf(tiny_model).metadata)
    first = next(iter(sorted(tok.eog_ids)))
    body = {"prompt": plain_tokens(tok)[:5], "n_predict": 6, "temperature": 0, "cache_prompt": False,
            "logit_bias": [[first, 100.0]]}
    ref = Reference(tiny_model, n_ctx=128)
    try:
        theirs = ref._client.post("/completion", json=body).json()
        theirs_oai = ref._client.post("/v1/completions", json={**body, "max_tokens": 6}).json()
    finally:
        ref.close()
    h = await start()
    async with httpx.AsyncClient(base_url=h.url, timeout=60) as c:
        ours = (await c.post("/completion", json=body)).json()
        ours_oai = (await c.post("/v1/completions", json={**body, "max_tokens": 6})).json()
    assert ours["stop_type"] == theirs["stop_type"] == "eos"
    assert ours["tokens_predicted"] == theirs["tokens_predicted"] == 1
    assert ours["timings"]["predicted_n"] == theirs["timings"]["predicted_n"]
    assert ours_oai["usage"]["completion_tokens"] == theirs_oai["usage"]["completion_tokens"] == 1


async def test_developer_messages_are_system_ones(start: Start) -> None:
    """llama.cpp renders a "developer" message as "system" (every template but GPT-OSS's),
    which OpenAI's newer clients (Codex) send."""
    h = await start()
    async with httpx.AsyncClient(base_url=h.url, timeout=60) as c:
        dev = (await c.post("/apply-template", json={"messages": [{"role": "developer", "content": "Be brief."},
                                                                  {"role": "user", "content": "hi"}]})).json()
        sys_ = (await c.post("/apply-template", json={"messages": [{"role": "system", "content": "Be brief."},
                                                                   {"role": "user", "content": "hi"}]})).json()
    assert dev["prompt"] == sys_["prompt"] and "Be brief." in dev["prompt"]


def test_completion_bash_completes_flags_and_files(tmp_path: Path) -> None:
    import subprocess
    import sys

    script = subprocess.run([sys.executable, "-m", "trio_llm", "serve", "--completion-bash"], capture_output=True,
                            text=True, timeout=60, check=True).stdout
    (tmp_path / "a.gguf").write_bytes(b"")
    (tmp_path / "b.txt").write_bytes(b"")
    (tmp_path / "c.sh").write_text(script)

    def complete(*words: str) -> list[str]:
        cmd = (f"source c.sh; COMP_WORDS=({' '.join(words)}); COMP_CWORD={len(words) - 1}; "
               "_trio_llm_completions; printf '%s\\n' \"${COMPREPLY[@]}\"")
        return subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, cwd=tmp_path,
                              check=True).stdout.split()

    assert set(complete("trio-llm", "--mirostat")) == {"--mirostat", "--mirostat-lr", "--mirostat-ent"}
    assert "--lora-init-without-apply" not in complete("trio-llm", "--lora")  # refused flags are not offered
    assert complete("trio-llm", "-m", "") == ["a.gguf"]

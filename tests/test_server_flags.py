"""llama-server's flags through real servers: the llama-swap command lines of USERS.md
as real processes, and the flags that change what the HTTP API does, in-process."""

from __future__ import annotations

import math
import os
import shlex
import subprocess
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import trio

from conftest import ServeFactory
from serve_procs import wait_ready
from trio_llm.runtime import ServerHandle, backend_takes_cache_types, parse_config
from trio_llm.server.flags import UsageError

SERVE = [sys.executable, "-m", "trio_llm", "serve"]

# -- the llama-swap configuration of USERS.md (Lumpiasty/klaster apps/llama/configs) ------

BASE_ARGS = "--no-warmup --port ${PORT} --mlock --no-mmap"
COMMON_ARGS = "--fit-target 1536 --no-warmup --port ${PORT} --mlock --no-mmap"
QWEN35_THINK = "--temp 1.0 --top-p 0.95 --top-k 20 --min-p 0.00 -ctk q4_0 -ctv q4_0 --presence_penalty 1.5 --reasoning on"
QWEN35_NOTHINK = "--temp 0.7 --top-p 0.80 --top-k 20 --min-p 0.00 -ctk q4_0 -ctv q4_0 --presence_penalty 1.5 --reasoning off"
GEMMA4 = "--temp 1.0 --top-p 0.95 --top-k 64 -ctk q4_0 -ctv q4_0"
MMPROJ = ("--mmproj-url https://huggingface.co/unsloth/Qwen3.5-4B-GGUF/resolve/main/mmproj-F16.gguf "
          "--mmproj /root/.cache/llama.cpp/unsloth_Qwen3.5-4B-GGUF_mmproj-F16.gguf")

#: (name, cmd after "llama-server", the -hf file to plant, how it ends)
USERS_LINES = [
    ("coder-next", "-hf unsloth/Qwen3-Coder-Next-GGUF:Q4_K_M --ctx-size 65536 --predict 8192 --temp 1.0 "
     "--min-p 0.01 --top-p 0.95 --top-k 40 --repeat-penalty 1.0 -ctk q4_0 -ctv q4_0 " + COMMON_ARGS,
     "hub:unsloth/Qwen3-Coder-Next-GGUF:Qwen3-Coder-Next-Q4_K_M.gguf", "starts"),
    ("qwen35-35b-think", "-hf unsloth/Qwen3.5-35B-A3B-GGUF:Q4_K_M --ctx-size 262144 " + QWEN35_THINK + " "
     + COMMON_ARGS, "hub:unsloth/Qwen3.5-35B-A3B-GGUF:Qwen3.5-35B-A3B-Q4_K_M.gguf", "starts"),
    ("qwen35-0.8b-nothink", "-hf unsloth/Qwen3.5-0.8B-GGUF:Q4_K_XL --ctx-size 4096 " + QWEN35_NOTHINK + " "
     + BASE_ARGS, "flat:unsloth/Qwen3.5-0.8B-GGUF:Qwen3.5-0.8B-UD-Q4_K_XL.gguf", "starts"),
    ("gemma4-e4b", "-hf unsloth/gemma-4-E4B-it-GGUF:UD-Q4_K_XL --ctx-size 131072 " + GEMMA4 + " " + COMMON_ARGS,
     "hub:unsloth/gemma-4-E4B-it-GGUF:gemma-4-E4B-it-UD-Q4_K_XL.gguf", "starts"),
    # the USERS.md variant of the 0.8B entry (thinking switched by template kwargs)
    ("qwen35-0.8b-kwargs", "-hf unsloth/Qwen3.5-0.8B-GGUF:Q4_K_XL --ctx-size 4096 --temp 0.7 --top-p 0.8 "
     "--top-k 20 --min-p 0.0 -ctk q8_0 -ctv q8_0 --chat-template-kwargs '{\"enable_thinking\": false}' "
     "--prio 2 --no-mmproj " + BASE_ARGS, "flat:unsloth/Qwen3.5-0.8B-GGUF:Qwen3.5-0.8B-UD-Q4_K_XL.gguf", "starts"),
    ("qwen35-4b-heretic", "-hf mradermacher/Qwen3.5-4B-heretic-GGUF:Q4_K_M " + MMPROJ + " --ctx-size 131072 "
     + QWEN35_THINK + " " + COMMON_ARGS, "hub:mradermacher/Qwen3.5-4B-heretic-GGUF:Qwen3.5-4B-heretic.Q4_K_M.gguf",
     "starts"),  # a qwen35 text model takes no image here: the projector is not fetched
    ("qwen36-mtp", "-hf unsloth/Qwen3.6-35B-A3B-MTP-GGUF:Q4_K_M --ctx-size 262144 " + QWEN35_THINK
     + " --spec-type draft-mtp --spec-draft-n-max 1 --parallel 1 " + COMMON_ARGS,
     "hub:unsloth/Qwen3.6-35B-A3B-MTP-GGUF:Qwen3.6-35B-A3B-MTP-Q4_K_M.gguf",
     "--spec-type draft-mtp: speculative decoding is not implemented"),
]


def plant(cache: Path, spec: str, model: Path) -> None:
    """Put ``model`` where llama.cpp's -hf would have downloaded ``spec``'s file."""
    layout, repo, name = spec.split(":")
    if layout == "flat":
        target = cache / (repo.replace("/", "_") + "_" + name)
    else:
        repo_dir = cache / ("models--" + repo.replace("/", "--"))
        (repo_dir / "refs").mkdir(parents=True, exist_ok=True)
        (repo_dir / "refs" / "main").write_text("0123456789abcdef0123456789abcdef01234567")
        target = repo_dir / "snapshots" / "0123456789abcdef0123456789abcdef01234567" / name
    target.parent.mkdir(parents=True, exist_ok=True)
    if not target.exists():
        target.symlink_to(model)


def expected(outcome: str, args: list[str]) -> str:
    """A line with a quantized KV cache starts once the backends store one."""
    if outcome == "starts" and any(a in ("-ctk", "-ctv") for a in args) and not backend_takes_cache_types():
        return "-ctk q"
    return outcome


@pytest.mark.parametrize(("name", "cmd", "spec", "outcome"), USERS_LINES, ids=[u[0] for u in USERS_LINES])
async def test_users_llama_swap_lines(name: str, cmd: str, spec: str, outcome: str, tiny_qwen3_model: Path,
                                      tmp_path: Path) -> None:
    """Each cmd of the llama-swap configuration, unchanged but for ${PORT} and a tiny
    model planted in a temporary LLAMA_CACHE, starts and answers /health - or, when it
    asks for what is not built, exits 2 with one line saying so."""
    plant(tmp_path, spec, tiny_qwen3_model)
    args = shlex.split(cmd.replace("${PORT}", "0"))
    env = dict(os.environ, LLAMA_CACHE=str(tmp_path))
    want = expected(outcome, args)
    if want != "starts":
        r = subprocess.run([*SERVE, *args], capture_output=True, text=True, timeout=60, env=env)
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 2 and len(lines) == 1 and want in lines[0], r.stderr
        if want != "-ctk q":
            return
        # until the backends store a quantized cache: the rest of the line must start
        args = [("f16" if prev in ("-ctk", "-ctv") else a) for prev, a in zip(["", *args], args, strict=False)]
    proc = await trio.lowlevel.open_process([*SERVE, *args, "--backend", "numpy"], stderr=subprocess.PIPE, env=env)
    try:
        url, log = await wait_ready(proc, 60)
        async with httpx.AsyncClient(base_url=url, timeout=30) as c:
            assert (await c.get("/health")).json() == {"status": "ok"}
            models = (await c.get("/v1/models")).json()
            assert models["data"][0]["id"] == args[1]  # llama-server's name for an -hf model
            props = (await c.get("/props")).json()
            assert props["model_path"].startswith(str(tmp_path))
        if "--prio" in args:
            nice = int(Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()[16])
            assert nice == -10 or any("failed to set process priority" in ln for ln in log)
    finally:
        proc.terminate()
        with trio.fail_after(15):
            await proc.wait()


# -- in-process: flags that change the API ---------------------------------------------------

Start = Callable[..., Awaitable[ServerHandle]]


@pytest.fixture
def start(serve_argv: ServeFactory, tiny_model: Path) -> Start:
    """Factory: a server from a command line (tiny model, numpy, port 0), once loaded."""

    def go(*argv: str) -> Awaitable[ServerHandle]:
        base = ["-m", str(tiny_model), "--backend", "numpy"]
        if "-c" not in argv and "--fit-target" not in argv:
            base += ["-c", "512"]
        return serve_argv(*base, *argv)

    return go


def client(handle: ServerHandle, **kw: Any) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=handle.url, timeout=60, **kw)


async def test_slots_and_props_endpoints_follow_their_flags(start: Start) -> None:
    default = await start()
    async with client(default) as c:
        assert (await c.get("/slots")).status_code == 200
        r = await c.post("/props", json={})
        assert r.status_code == 501 and r.json()["error"]["type"] == "not_supported_error"
        assert "--props" in r.json()["error"]["message"]
    switched = await start("--no-slots", "--props")
    async with client(switched) as c:
        r = await c.get("/slots")
        assert r.status_code == 501 and "--slots" in r.json()["error"]["message"]
        assert (await c.post("/props", json={"x": 1})).json() == {"success": True}


async def test_endpoints_not_built_are_501_not_404(start: Start) -> None:
    h = await start()
    async with client(h) as c:
        for path in ("/embedding", "/v1/embeddings", "/rerank", "/v1/rerank", "/infill"):
            r = await c.post(path, json={"input": "x", "content": "x"})
            assert r.status_code == 501, path
            assert r.json()["error"]["type"] == "not_supported_error"
    oai = openai.AsyncOpenAI(base_url=h.url + "/v1", api_key="x")
    with pytest.raises(openai.APIStatusError) as info:
        await oai.embeddings.create(model="m", input="hello")
    assert info.value.status_code == 501
    await oai.close()


THINKING_TEMPLATE = (
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{%- endfor %}"
    "{%- if enable_thinking is defined and not enable_thinking %}<|im_start|>assistant\n<think>\n\n</think>\n\n"
    "{%- else %}<|im_start|>assistant\n{%- endif %}[effort={{ reasoning_effort | default('none') }}]"
)


async def test_template_kwargs_reach_the_template(start: Start, tmp_path: Path) -> None:
    """--chat-template-file, --chat-template-kwargs, --reasoning and the request's
    chat_template_kwargs: the thinking switch changes the rendered prompt."""
    path = tmp_path / "t.jinja"
    path.write_text(THINKING_TEMPLATE)
    messages = [{"role": "user", "content": "hi"}]
    h = await start("--chat-template-file", str(path), "--chat-template-kwargs", '{"enable_thinking": false}')
    async with client(h) as c:
        off = (await c.post("/apply-template", json={"messages": messages})).json()["prompt"]
        on = (await c.post("/apply-template", json={"messages": messages,
                                                    "chat_template_kwargs": {"enable_thinking": True}})).json()["prompt"]
        assert "<think>\n\n</think>" in off and "<think>" not in on
        bad = await c.post("/apply-template", json={"messages": messages, "chat_template_kwargs": [1]})
        assert bad.status_code == 400 and bad.json()["error"]["type"] == "invalid_request_error"
    oai = openai.AsyncOpenAI(base_url=h.url + "/v1", api_key="x")
    r = await oai.chat.completions.create(model="m", messages=messages, max_tokens=3,  # type: ignore[arg-type]
                                          extra_body={"chat_template_kwargs": {"enable_thinking": True}})
    assert r.choices[0].message.role == "assistant"
    await oai.close()
    h2 = await start("--chat-template-file", str(path), "--reasoning", "off", "--reasoning-effort", "high")
    async with client(h2) as c:
        prompt = (await c.post("/apply-template", json={"messages": messages})).json()["prompt"]
        assert "<think>\n\n</think>" in prompt and prompt.endswith("[effort=high]")


async def test_builtin_template_alias_keys_and_defaults(start: Start) -> None:
    h = await start("--chat-template", "llama3", "-a", "first,second", "--api-key", "k1,k2",
                    "--presence-penalty", "0.5", "--ignore-eos")
    messages = [{"role": "user", "content": " hi "}]
    async with client(h, headers={"Authorization": "Bearer k2"}) as c:
        prompt = (await c.post("/apply-template", json={"messages": messages})).json()["prompt"]
        assert prompt.endswith("<|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|>"
                               "<|start_header_id|>assistant<|end_header_id|>\n\n")
        model = (await c.get("/v1/models")).json()["data"][0]
        assert (model["id"], model["aliases"]) == ("first", ["first", "second"])
        params = (await c.get("/props")).json()["default_generation_settings"]["params"]
        assert (params["presence_penalty"], params["ignore_eos"]) == (0.5, True)
    async with client(h, headers={"Authorization": "Bearer k3"}) as c:
        assert (await c.get("/v1/models")).status_code == 401


@pytest.mark.vulkan
async def test_fit_lowers_the_unset_context_on_the_device(start: Start) -> None:
    """--fit against lavapipe's real free memory: a margin larger than the device
    leaves only --fit-ctx; a context the user set is kept, but -c 0 (the model's) is
    fitted, as llama.cpp fits any context of 0 (common/fit.cpp's n_ctx_auto)."""
    fitted = await start("--backend", "vulkan", "-c", "0", "--fit-target", "999999999", "--fit-ctx", "256")
    assert fitted.context.engine is not None and fitted.context.engine.n_ctx == 256  # -c 0: fitted
    kept = await start("--backend", "vulkan", "-c", "2048", "--fit-target", "999999999", "--fit-ctx", "256")
    assert kept.context.engine is not None and kept.context.engine.n_ctx == 2048  # set: kept
    fitted = await start("--backend", "vulkan", "--fit-target", "999999999", "--fit-ctx", "256", "-np", "2")
    assert fitted.context.engine is not None and fitted.context.engine.n_ctx == 128  # 256 over 2 slots


async def test_cors_origins_hosts_and_tags(start: Start) -> None:
    import socket

    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
    except OSError:
        pytest.skip("this machine has no IPv6 loopback")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    h = await start("--cors-origins", "localhost", "--host", "127.0.0.1,::1", "--port", str(port),
                    "--tags", "chat,small")
    preflight = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "Authorization"}
    async with client(h) as c:
        for origin, allowed in (("http://localhost:8080", True), ("http://[::1]:3000", True),
                                ("http://localhost.evil.com", False), ("http://evil.com", False)):
            r = await c.options("/completions", headers={"Origin": origin, **preflight})
            assert r.status_code == 200
            assert (r.headers.get("access-control-allow-origin") == origin) is allowed, origin
        assert (await c.get("/v1/models")).json()["data"][0]["tags"] == ["chat", "small"]
    async with httpx.AsyncClient(base_url=f"http://[::1]:{port}", timeout=30) as c6:
        assert (await c6.get("/health")).status_code == 200


async def test_generation_prompt_prefill_and_the_date(start: Start, tmp_path: Path) -> None:
    """add_generation_prompt, the assistant prefill of a last assistant message, and
    llama.cpp's date_string / datetime reaching the template."""
    path = tmp_path / "t.jinja"
    path.write_text(
        "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{%- endfor %}"
        "{%- if add_generation_prompt %}<|im_start|>assistant\n{%- if not enable_thinking %}<think>\n\n</think>\n\n"
        "{%- endif %}{%- endif %}[{{ date_string }}|{{ datetime }}|]")
    h = await start("--chat-template-file", str(path))
    user = [{"role": "user", "content": "hi"}]
    async with client(h) as c:
        def prompt(body: dict[str, Any]) -> Any:
            return c.post("/apply-template", json=body)

        with_gen = (await prompt({"messages": user})).json()["prompt"]
        assert "<|im_start|>assistant" in with_gen and "<think>" not in with_gen  # thinking on by default
        import datetime

        today = datetime.date.today()
        assert f"[{today.strftime('%d %b %Y')}|{today.strftime('%b %d %Y')}|" in with_gen
        without = (await prompt({"messages": user, "add_generation_prompt": False})).json()["prompt"]
        assert "<|im_start|>assistant" not in without
        prefill = (await prompt({"messages": [*user, {"role": "assistant", "content": "Sure, the"}]})).json()["prompt"]
        assert prefill.endswith("<|im_start|>assistant\nSure, the")
        two = await prompt({"messages": [*user, {"role": "assistant", "content": "a"},
                                         {"role": "assistant", "content": "b"}]})
        assert two.status_code == 400
        assert (await prompt({"messages": user, "chat_template_kwargs": {"enable_thinking": "no"}})).status_code == 400
        none = (await prompt({"messages": user, "reasoning_effort": "none"})).json()["prompt"]
        assert "<think>\n\n</think>" in none  # reasoning_effort none: thinking off


async def test_ignore_eos_shows_in_generation_settings(start: Start) -> None:
    """llama-server lists the end-of-generation tokens ignore_eos bans (bias null: -inf)."""
    h = await start()
    async with client(h) as c:
        body = {"prompt": "Once", "n_predict": 2, "ignore_eos": True}
        bias = (await c.post("/completion", json=body)).json()["generation_settings"]["logit_bias"]
        assert bias and all(e["bias"] is None for e in bias)
        body["ignore_eos"] = False
        assert (await c.post("/completion", json=body)).json()["generation_settings"]["logit_bias"] == []


async def test_reverse_prompt_and_logit_bias_are_a_requests_defaults(start: Start) -> None:
    """-r and -l, as llama-server: a request without stop words stops on -r's (also one
    whose stop words are all empty), one with its own does not; a request without
    logit_bias gets -l's, one with its own (even an empty one) gets only that."""
    body = {"prompt": "Once upon a time", "n_predict": 12, "temperature": 0, "cache_prompt": False,
            "return_tokens": True}
    plain = await start()
    async with client(plain) as c:
        free = (await c.post("/completion", json=body)).json()
    text, tokens = free["content"], free["tokens"]
    word = text[len(text) // 2:len(text) // 2 + 2]
    assert len(word) == 2 and text.index(word) > 0
    first = tokens[0]
    h = await start("-r", "zzzq", "--reverse-prompt", word, "-l", f"{first}-inf", "-l", "1+0.5")
    assert h.context.config.reverse_prompt == ("zzzq", word)
    assert h.context.config.logit_bias == ((first, -math.inf), (1, 0.5))
    async with client(h) as c:
        biased = (await c.post("/completion", json={**body, "stop": ["zzzz"], "logit_bias": []})).json()
        assert biased["tokens"] == tokens  # its own (empty) bias replaced -l's
        for stop in (None, [""]):
            r = (await c.post("/completion", json={**body, "stop": stop, "logit_bias": []})).json()
            assert (r["stop_type"], r["stopping_word"], r["content"]) == ("word", word, text[:text.index(word)])
        r = (await c.post("/completion", json={**body, "stop": ["zzzz"], "logit_bias": []})).json()
        assert r["content"] == text and r["stop_type"] == "limit"
        r = (await c.post("/completion", json={**body, "stop": ["zzzz"]})).json()
        assert r["tokens"][0] != first  # -l's ban
    for bad in (["-l", "12"], ["-l", "x+1"], ["-l", "5*2"]):
        with pytest.raises(UsageError, match=r"^-l: invalid value"):
            parse_config(bad, {})

"""generate_tokens, the `trio-llm generate` command, and open_backend."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from trio_llm.engine.generate import generate_tokens, main
from trio_llm.engine.loader import open_backend
from trio_llm.engine.reference import NumpyBackend
from trio_llm.engine.sampling import SamplingParams, make_rng
from trio_llm.errors import BackendUnavailable, ContextOverflow, InvalidRequest
from trio_llm.model.gguf import load_gguf
from trio_llm.model.tokenizer import Tokenizer

GREEDY = SamplingParams(temperature=0.0)


def setup(path: Path, n_ctx: int = 64) -> tuple[NumpyBackend, Tokenizer]:
    model = load_gguf(path)
    return NumpyBackend(model, n_ctx=n_ctx, n_seq=1), Tokenizer.from_metadata(model.metadata)


def test_greedy_generation_is_the_argmax_chain(tiny_model: Path) -> None:
    be, tok = setup(tiny_model)
    prompt = tok.encode("The quick brown fox")
    got = generate_tokens(be, tok, prompt, 12, GREEDY, make_rng(0))
    # the same chain by brute force: the whole sequence through one pass per step
    seq = list(prompt)
    for _ in range(12):
        seq.append(int(np.argmax(be.forward_all_logits(seq)[-1])))
    assert got == seq[len(prompt) :]
    assert not any(tok.is_eog(t) for t in got)


def test_seeded_sampling_replays(tiny_model: Path) -> None:
    be, tok = setup(tiny_model)
    prompt = tok.encode("Once upon a time")
    params = SamplingParams(temperature=1.0, seed=5)
    a = generate_tokens(be, tok, prompt, 10, params, make_rng(5))
    b = generate_tokens(be, tok, prompt, 10, params, make_rng(5))
    c = generate_tokens(be, tok, prompt, 10, params, make_rng(6))
    assert a == b and len(a) == 10
    assert a != c


def test_stops_at_end_of_generation(tiny_model: Path) -> None:
    be, tok = setup(tiny_model)
    eog = min(tok.eog_ids)
    streamed: list[int] = []
    params = SamplingParams(temperature=0.0, logit_bias=((eog, 1e9),))
    assert generate_tokens(be, tok, tok.encode("hi"), 10, params, make_rng(0), on_token=streamed.append) == []
    assert streamed == []


def test_stops_when_the_context_is_full(tiny_model: Path) -> None:
    be, tok = setup(tiny_model, n_ctx=12)
    prompt = tok.encode("a b c d e")
    banned = tuple((t, float("-inf")) for t in tok.eog_ids)
    params = SamplingParams(temperature=0.0, logit_bias=banned)
    got = generate_tokens(be, tok, prompt, -1, params, make_rng(0))
    # the last token is sampled from position n_ctx - 1 and never fed back
    assert len(got) == 12 - len(prompt) + 1
    assert generate_tokens(be, tok, prompt, 3, params, make_rng(0)) == got[:3]
    assert generate_tokens(be, tok, prompt, 0, params, make_rng(0)) == []


def test_prompt_errors(tiny_model: Path) -> None:
    be, tok = setup(tiny_model, n_ctx=4)
    with pytest.raises(ContextOverflow):
        generate_tokens(be, tok, list(range(5)), 1, GREEDY, make_rng(0))
    with pytest.raises(InvalidRequest):
        generate_tokens(be, tok, [], 1, GREEDY, make_rng(0))


def test_cli_json_matches_generate_tokens(tiny_qwen3_model: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["-m", str(tiny_qwen3_model), "-p", "Hello world", "-n", "8", "--temp", "0",
               "--json", "--backend", "numpy", "-c", "32"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    be, tok = setup(tiny_qwen3_model, n_ctx=32)
    assert out["prompt_tokens"] == tok.encode("Hello world")
    assert out["tokens"] == generate_tokens(be, tok, out["prompt_tokens"], 8, GREEDY, make_rng(0))
    stream = tok.stream_decoder()
    assert out["text"] == stream.feed_many(out["tokens"]) + stream.flush()


def test_cli_plain_output_streams_prompt_then_text(tiny_model: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = ["-m", str(tiny_model), "-p", "Hello", "-n", "6", "--seed", "1", "--backend", "numpy"]
    assert main(args) == 0
    plain = capsys.readouterr().out
    assert main([*args, "--json"]) == 0
    record = json.loads(capsys.readouterr().out)
    assert plain == "Hello" + record["text"] + "\n"


def test_cli_default_model(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                           capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert main(["-p", "Hi", "-n", "2", "--temp", "0", "--json", "--backend", "numpy", "-c", "16"]) == 0
    assert len(json.loads(capsys.readouterr().out)["tokens"]) == 2
    assert list(tmp_path.rglob("demo-Q8_0-*.gguf"))


@pytest.mark.parametrize(
    ("args", "code", "message"),
    [
        (["-m", "/nonexistent/x.gguf", "-p", "a"], 1, "no such file"),
        (["--no-such-flag"], 2, "unrecognized arguments"),
        (["-n", "-5"], 2, "-n must be >= -1"),
        (["--top-p", "2"], 2, "top_p"),
        (["--backend", "cuda"], 2, "invalid choice"),
    ],
)
def test_cli_errors(args: list[str], code: int, message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(args) == code
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_cli_corrupt_file_is_one_line(tiny_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(tiny_model.read_bytes()[:4000])
    assert main(["-m", str(bad), "--backend", "numpy"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(bad) in err


def test_open_backend_kinds(tiny_model: Path) -> None:
    model = load_gguf(tiny_model)
    be = open_backend("numpy", model, n_ctx=8, n_seq=2)
    assert isinstance(be, NumpyBackend) and (be.n_ctx, be.n_seq) == (8, 2)
    with pytest.raises(InvalidRequest, match="unknown backend"):
        open_backend("cuda", model, n_ctx=8, n_seq=1)


def run_cli(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "trio_llm", *args], capture_output=True, text=True, env=env, timeout=120
    )


def test_auto_falls_back_when_vulkan_has_no_driver(tiny_model: Path, tmp_path: Path) -> None:
    """A real machine state, made real: the Vulkan loader finds no driver manifest."""
    env = dict(os.environ)
    env["VK_DRIVER_FILES"] = env["VK_ICD_FILENAMES"] = str(tmp_path / "no-driver.json")
    src = str(Path(__file__).resolve().parents[1] / "src")
    env["PYTHONPATH"] = src + os.pathsep + env.get("PYTHONPATH", "")
    common = ["generate", "-m", str(tiny_model), "-p", "x", "-n", "3", "--temp", "0", "--json"]
    auto = run_cli(*common, env=env)
    assert auto.returncode == 0, auto.stderr
    assert "using the numpy reference backend" in auto.stderr
    assert len(json.loads(auto.stdout)["tokens"]) == 3
    forced = run_cli(*common, "--backend", "vulkan", env=env)
    assert forced.returncode == 1
    assert forced.stderr.count("\n") == 1 and "Traceback" not in forced.stderr
    assert BackendUnavailable.__name__ not in forced.stderr  # a message, not a type name


def test_ctrl_c_stops_generation_cleanly(tiny_model: Path) -> None:
    """SIGINT mid-generation (after the prompt is echoed) exits 130 without a traceback."""
    import signal

    env = dict(os.environ)
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[1] / "src") + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.Popen(
        [sys.executable, "-m", "trio_llm", "generate", "-m", str(tiny_model), "-p", "go",
         "-n", "-1", "-c", "4096", "--temp", "0", "--backend", "numpy"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
    )
    assert proc.stdout is not None
    assert proc.stdout.read(2) == b"go"  # the prompt echo: generation has started
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130
    assert b"Traceback" not in err

"""llama-server's flag table and parser (trio_llm.server.flags), without a server."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from trio_llm.engine import fit
from trio_llm.model.config import ModelConfig
from trio_llm.model.hf_cache import NotCached, resolve
from trio_llm.runtime import PRIO_NICE, main, parse_config
from trio_llm.server import flags
from trio_llm.server.flags import FLAGS, UsageError, parse

DOCS = Path(__file__).resolve().parents[1] / "docs" / "server.md"


def one_line_exit(args: list[str], capsys: pytest.CaptureFixture[str], code: int = 2) -> str:
    assert main(args) == code
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


def test_short_names_are_never_bundled_or_prefix_matched() -> None:
    c = parse_config(["-ctk", "f16", "-ctv", "f16", "-c", "2048", "-ub", "256", "-fa", "on", "-np", "2"], {})
    assert (c.cache_type_k, c.cache_type_v, c.ctx_size, c.ubatch_size, c.flash_attn, c.parallel) == (
        "f16", "f16", 2048, 256, "on", 2)
    assert c.n_batch == 256  # min(-b 512, -ub 256)
    with pytest.raises(UsageError, match=r"^invalid argument: --ctx$"):
        parse(["--ctx", "5"], {})  # argparse would have taken it for --ctx-size
    with pytest.raises(UsageError, match=r"^invalid argument: -cx$"):
        parse(["-cx"], {})


@pytest.mark.parametrize(
    ("args", "needle"),
    [(["-hf"], "-hf: expected a value"), (["-md", "draft.gguf"], "-md: speculative decoding"),
     (["--samplers", "top_k;bogus"], "--samplers: "), (["--lora-scaled", "a.gguf"], "--lora-scaled: invalid"),
     (["-ctk", "tk"], "-ctk: unsupported cache type 'tk'"), (["-ctk", "iq4_nl"], "-ctk iq4_nl: cache type"),
     (["--spec-type", "draft-mtp"], "--spec-type draft-mtp: speculative"), (["--prio", "7"], "--prio: invalid"),
     (["-fa", "maybe"], "-fa: invalid value 'maybe'"), (["--pooling", "max"], "--pooling: invalid value 'max'"),
     (["--chat-template", "no-such-name"], "--chat-template: 'no-such-name' is neither"),
     (["--chat-template-kwargs", "[1]"], "must be a JSON object"), (["--dry-penalty-last-n", "-1"], "--dry-penalty-last-n: invalid"),
     (["--keep", "x"], "--keep: invalid"), (["--warmup=1"], "takes no value")],
)
def test_a_refusal_is_one_line_naming_the_flag(args: list[str], needle: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert needle in one_line_exit(args, capsys)


def test_every_refused_flag_says_why_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    refused = [f for f in FLAGS if f.kind == "refused"]
    assert len(refused) > 15  # fewer as flags get built (61 on 2026-12-04, 39, then 22 with the presets, on 2026-12-05)
    for flag in refused:
        for name in flag.names:
            err = one_line_exit([name] + (["x"] if flag.value else []), capsys)
            assert err == f"trio-llm serve: error: {name}: {flag.help}"


SAMPLES = ["1", "0", "-1", "auto", "on", "f16", "none", "*", "distribute", "layer", "greedy", "x", "a/b", "{}", "chatml", "weights", "k=int:1", "5+1", "top_k"]


def test_every_accepted_flag_takes_some_value_of_its_kind(tmp_path: Path) -> None:
    """Each works/noop flag parses with at least one plausible value (or as a switch),
    on its own name and on every alias."""
    a_file = tmp_path / "f.txt"
    a_file.write_text('root ::= "a"\n')  # a GBNF grammar, a key, a template
    json_file = tmp_path / "s.json"
    json_file.write_text("{}")
    for flag in FLAGS:
        if flag.kind == "refused" or flag.dest in ("_help", "_version"):
            continue
        for name in flag.names + flag.neg:
            if flag.value is None:
                positive = name in flag.names
                if flag.refuse is not None and flag.refuse(positive):
                    with pytest.raises(UsageError, match=f"^{name}: "):
                        parse([name], {})  # e.g. --no-kv-offload, --context-shift
                else:
                    parse([name], {})
                continue
            for sample in [*SAMPLES, 'root ::= "a"', str(a_file), str(json_file), str(tmp_path)]:
                try:
                    parse([name, *[sample] * flag.n_values], {})
                    break
                except UsageError:
                    continue
            else:
                pytest.fail(f"{name} took none of {SAMPLES}")


def test_environment_variables_and_the_flag_wins() -> None:
    env = {"LLAMA_ARG_CTX_SIZE": "2048", "LLAMA_ARG_ENDPOINT_METRICS": "1", "LLAMA_ARG_NO_ENDPOINT_SLOTS": "1",
           "LLAMA_ARG_TEMPERATURE": "0.3", "LLAMA_ARG_CHAT_TEMPLATE_KWARGS": '{"enable_thinking": false}',
           "LLAMA_API_KEY": "k1", "HF_TOKEN": "hf_x"}
    c = parse_config([], env)
    assert (c.ctx_size, c.metrics, c.endpoint_slots, c.temp, c.api_key) == (2048, True, False, 0.3, "k1")
    assert c.template_kwargs() == {"enable_thinking": False}
    assert "ctx_size" in c.set_by_user
    c = parse_config(["-c", "1024", "--temp", "0.9", "--slots"], env)
    assert (c.ctx_size, c.temp, c.endpoint_slots) == (1024, 0.9, True)
    # a plain switch's variable acts only when truthy; a bad value names the variable
    assert parse_config([], {"LLAMA_ARG_ENDPOINT_METRICS": "0"}).metrics is False
    with pytest.raises(UsageError, match=r"^LLAMA_ARG_CTX_SIZE \(-c/--ctx-size\): invalid value 'big'"):
        parse_config([], {"LLAMA_ARG_CTX_SIZE": "big"})
    assert parse_config([], {"LLAMA_ARG_MMPROJ": "p.gguf"}).mmproj == Path("p.gguf")


def test_llama_cpp_spellings() -> None:
    c = parse_config(["--presence_penalty", "1.5", "--frequency-penalty=0.5", "-a", "m1,m2", "--reasoning", "off",
                      "--reasoning-effort", "low", "-np", "-1", "--kv-unified-per-slot", "512"], {})
    assert (c.presence_penalty, c.frequency_penalty, c.model_ids, c.parallel, c.ctx_size) == (
        1.5, 0.5, ("m1", "m2"), 1, 512)
    assert c.template_kwargs() == {"enable_thinking": False, "reasoning_effort": "low"}
    c = parse_config(["--reasoning", "on", "--chat-template-kwargs", '{"enable_thinking": false, "x": 1}'], {})
    assert c.template_kwargs() == {"enable_thinking": False, "x": 1}  # the explicit kwargs win
    assert parse_config(["--chat-template", "chatml"], {}).chat_template.startswith("{%- for message")
    assert parse_config(["--fit", "off", "-fitt", "1536,2048"], {}).fit_target == 1536


def test_keys_from_flag_and_file(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.write_text("# comment\nk2\n\nk3\n")
    c = parse_config(["--api-key", "k1", "--api-key-file", str(keys)], {})
    assert c.api_keys == {"k1", "k2", "k3"}


def test_help_and_version(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "-ctk, --cache-type-k TYPE" in out and "[refused]" in out
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.startswith("trio-llm ")


def test_docs_table_is_the_flag_table() -> None:
    text = DOCS.read_text()
    start, end = "<!-- flag-table:start -->\n", "\n<!-- flag-table:end -->"
    assert start in text and end in text, "docs/server.md lost its flag-table markers"
    table = text[text.index(start) + len(start):text.index(end)]
    assert table == flags.markdown_table(), "run: python -m trio_llm.server.flags > the table in docs/server.md"


def test_priority_levels_are_llama_cpps() -> None:
    assert PRIO_NICE == {-1: 5, 0: 0, 1: -5, 2: -10, 3: -20}


# -- -hf from the local cache ---------------------------------------------------------------


def plant_hub(cache: Path, repo: str, files: dict[str, bytes], commit: str = "a" * 40) -> Path:
    repo_dir = cache / ("models--" + repo.replace("/", "--"))
    (repo_dir / "refs").mkdir(parents=True)
    (repo_dir / "refs" / "main").write_text(commit)
    snap = repo_dir / "snapshots" / commit
    for name, data in files.items():
        (snap / name).parent.mkdir(parents=True, exist_ok=True)
        (snap / name).write_bytes(data)
    return snap


def test_hf_resolves_the_hub_layout_by_quant_tag(tmp_path: Path) -> None:
    snap = plant_hub(tmp_path, "unsloth/Qwen3.5-0.8B-GGUF", {
        "Qwen3.5-0.8B-Q8_0.gguf": b"q8", "Qwen3.5-0.8B-UD-Q4_K_XL.gguf": b"q4", "mmproj-F16.gguf": b"p",
        "BF16/Qwen3.5-0.8B-BF16-00002-of-00002.gguf": b"2", "BF16/Qwen3.5-0.8B-BF16-00001-of-00002.gguf": b"1"})
    env = {"LLAMA_CACHE": str(tmp_path)}
    assert resolve("unsloth/Qwen3.5-0.8B-GGUF:Q4_K_XL", env=env) == snap / "Qwen3.5-0.8B-UD-Q4_K_XL.gguf"
    assert resolve("unsloth/Qwen3.5-0.8B-GGUF:q4_k_xl", env=env) == snap / "Qwen3.5-0.8B-UD-Q4_K_XL.gguf"
    assert resolve("unsloth/Qwen3.5-0.8B-GGUF", env=env) == snap / "Qwen3.5-0.8B-Q8_0.gguf"  # Q4_K_M, then Q8_0
    assert resolve("unsloth/Qwen3.5-0.8B-GGUF:BF16", env=env) == snap / "BF16/Qwen3.5-0.8B-BF16-00001-of-00002.gguf"
    assert resolve("unsloth/Qwen3.5-0.8B-GGUF", "qwen3.5-0.8b-q8_0.gguf", env) == snap / "Qwen3.5-0.8B-Q8_0.gguf"
    c = parse_config(["-hf", "unsloth/Qwen3.5-0.8B-GGUF:Q4_K_XL"], env)
    assert c.model == snap / "Qwen3.5-0.8B-UD-Q4_K_XL.gguf" and c.model_ids == ("unsloth/Qwen3.5-0.8B-GGUF:Q4_K_XL",)
    # llama-server's -hf takes the repository's projector too, unless --no-mmproj or --mmproj names one
    assert c.mmproj == snap / "mmproj-F16.gguf"
    assert parse_config(["-hf", "unsloth/Qwen3.5-0.8B-GGUF:Q4_K_XL", "--no-mmproj"], env).mmproj is None
    assert parse_config(["-hf", "unsloth/Qwen3.5-0.8B-GGUF", "--mmproj", "own.gguf"], env).mmproj == Path("own.gguf")


def test_hf_resolves_the_flat_layout(tmp_path: Path) -> None:
    (tmp_path / "unsloth_Qwen3.5-4B-GGUF_Qwen3.5-4B-Q4_K_M.gguf").write_bytes(b"m")
    env = {"LLAMA_CACHE": str(tmp_path)}
    assert resolve("unsloth/Qwen3.5-4B-GGUF:Q4_K_M", env=env) == tmp_path / "unsloth_Qwen3.5-4B-GGUF_Qwen3.5-4B-Q4_K_M.gguf"
    home = tmp_path / "home"
    (home / ".cache" / "llama.cpp").mkdir(parents=True)
    (home / ".cache" / "llama.cpp" / "a_b_b-Q8_0.gguf").write_bytes(b"m")
    assert resolve("a/b:Q8_0", env={"HOME": str(home)}) == home / ".cache" / "llama.cpp" / "a_b_b-Q8_0.gguf"
    # $XDG_CACHE_HOME/llama.cpp before ~/.cache/llama.cpp, as llama.cpp's fs_get_cache_directory
    xdg = tmp_path / "xdg"
    (xdg / "llama.cpp").mkdir(parents=True)
    (xdg / "llama.cpp" / "a_b_b-Q8_0.gguf").write_bytes(b"m")
    assert resolve("a/b:Q8_0", env={"HOME": str(home), "XDG_CACHE_HOME": str(xdg)}) == xdg / "llama.cpp" / "a_b_b-Q8_0.gguf"


def test_hf_offline_not_cached_is_one_line_and_exit_1(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(NotCached, match="quant Q4_K_M is not in the local cache"):
        resolve("a/b:Q4_K_M", env={"LLAMA_CACHE": str(tmp_path)})
    monkeypatch.setenv("LLAMA_CACHE", str(tmp_path))
    # --offline: the cache only (online, the repository is downloaded at startup: test_hf_download.py)
    err = one_line_exit(["-hf", "unsloth/Nope-GGUF:Q4_K_M", "--offline"], capsys, code=1)
    assert "unsloth/Nope-GGUF:Q4_K_M" in err and "nothing is downloaded" in err
    assert "invalid HF repo" in one_line_exit(["-hf", "just-a-name"], capsys)


# -- --fit ------------------------------------------------------------------------------------

CFG = ModelConfig(arch="qwen3", name="t", n_vocab=1000, n_embd=64, n_layer=4, n_head=4, n_head_kv=2, head_dim=16,
                  n_ff=128, n_ctx_train=32768, rope_theta=1e6, rms_eps=1e-6, rope_mode="neox", qk_norm=True,
                  attn_bias=False, tied_embeddings=True)


def test_kv_bytes_follow_the_cache_type() -> None:
    f16 = fit.kv_bytes_per_position(CFG, "f16", "f16")
    assert f16 == 4 * 32 * 2 * 2
    assert fit.kv_bytes_per_position(CFG, "q8_0", "q8_0") == int(4 * 32 * 2 * 34 / 32)
    assert fit.kv_bytes_per_position(CFG, "q4_0", "q4_0") < fit.kv_bytes_per_position(CFG, "q8_0", "q8_0") < f16


def test_the_compute_reserve_counts_logits_of_512_tokens_at_most() -> None:
    """Per token of -ub the activations (4 n_embd + 2 n_ff floats); the logits of at most
    LOGIT_ROWS = 512 tokens: a pass reads back each sequence's last row only."""
    act = 4 * (4 * 64 + 2 * 128)
    assert fit.compute_bytes(CFG, 512) == 512 * act + 4 * 512 * 1000  # llama-server's default, as before
    assert fit.compute_bytes(CFG, 64) == 64 * act + 4 * 64 * 1000
    assert fit.compute_bytes(CFG, 4096) == 4096 * act + 4 * 512 * 1000


def test_fit_lowers_an_unset_context_and_keeps_a_set_one() -> None:
    per = fit.kv_bytes_per_position(CFG, "f16", "f16")  # 512 bytes
    need = fit.linear_need(weights=1 << 20, per_position=per, compute=1 << 20)
    common = dict(n_ctx_train=32768, parallel=2, need=need, margin=1 << 20, fit_ctx=1024)
    free = (3 << 20) + per * 10_000
    got = fit.choose_ctx(ctx_size=0, ctx_set=False, free=free, **common)
    assert got.changed and got.fits and got.ctx_size == 9728  # a multiple of 256 x 2 slots
    assert fit.choose_ctx(ctx_size=0, ctx_set=True, free=free, **common).ctx_size == 32768  # kept when set
    kept = fit.choose_ctx(ctx_size=65536, ctx_set=True, free=free, **common)
    assert (kept.ctx_size, kept.fits, kept.changed) == (65536, False, False)
    small = fit.choose_ctx(ctx_size=4096, ctx_set=False, free=free, **common)
    assert (small.ctx_size, small.fits, small.changed) == (4096, True, False)
    floor = fit.choose_ctx(ctx_size=0, ctx_set=False, free=3 << 20, **common)
    assert (floor.ctx_size, floor.fits) == (1024, False)  # never below --fit-ctx


def test_fit_searches_a_projection_that_is_not_a_line() -> None:
    """The plan's projection grows in steps and flattens (a sliding window's cache stops
    growing at its window): the choice is the largest multiple of 256 x slots whose
    projection fits, found in a logarithmic number of projections."""
    asked: list[int] = []

    def need(ctx: int) -> int:  # 1000 bytes a position up to 5000, then 10 a position
        asked.append(ctx)
        return 1_000_000 + 1000 * min(ctx, 5000) + 10 * max(0, ctx - 5000)

    budget = 1_000_000 + 1000 * 5000 + 10 * 20_000 + 5  # fits up to 25,000 positions
    got = fit.choose_ctx(ctx_size=0, ctx_set=False, n_ctx_train=131072, parallel=1, need=need, free=budget + 7,
                         margin=7, fit_ctx=4096)
    assert len(asked) <= 2 + 10  # the whole context, the choice, and a bisection of 512 steps
    assert (got.ctx_size, got.fits, got.changed) == (24832, True, True)  # 97 x 256
    assert got.need == need(24832) and need(24832 + 256) > got.budget


def test_priority_is_set_as_llama_server(tmp_path: Path) -> None:
    """--prio in a child process: nice 5 for -1 (anyone may lower their priority)."""
    import subprocess
    import sys

    code = "from trio_llm.runtime import set_priority; import os; set_priority(-1); print(os.getpriority(os.PRIO_PROCESS, 0))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env=dict(os.environ))
    assert out.stdout.strip() == "5"

"""llama-server's preset flags (``--fim-qwen-7b-default``...): what each sets, checked
against llama.cpp's own parser, and the model each brings, from the loopback hub of
``test_hf_download.py``.

The reference is ``common_params_parse`` of the llama.cpp that xllamacpp is built from
(October 2026), called through ctypes in a child process on the ``common_params`` that
an ``xllamacpp.CommonParams`` holds (it starts 16 bytes into the Python object: no
vtable; ``test_the_reference_reads_back_what_it_parsed`` checks the offset still holds).
llama-server's own flag order then decides, not a reading of ``arg.cpp``: a preset is
a switch whose handler assigns its settings when the parser reaches it.
"""

from __future__ import annotations

import base64
import io
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import gguf
import httpx
import pytest
import trio
from PIL import Image

from test_download import _no_proxy  # noqa: F401  (the fixture)
from test_flags import one_line_exit
from test_hf_download import COMMIT, FAST, Hub, _blob, _repo_dir, _tree, hub  # noqa: F401  (hub: the fixture)
from trio_llm.model.hf_download import fetch
from trio_llm.runtime import fetch_hf, parse_config, serve
from trio_llm.server.flags import FLAGS, parse

#: the presets that work here, and the files of their repositories on the stand-in hub:
#: the preset's -hff where it names one (beside a file its quant tag would not pick),
#: else names as the hub lists them (gpt-oss-120b: a split model; gemma-3: a projector)
PRESETS: dict[str, tuple[str, dict[str, bytes], str]] = {
    "--embd-gemma-default": ("ggml-org/embeddinggemma-300M-qat-q4_0-GGUF", {
        "embeddinggemma-300M-qat-Q4_0.gguf": _blob("eg"), "embeddinggemma-300M-Q8_0.gguf": _blob("eg8")},
        "embeddinggemma-300M-qat-Q4_0.gguf"),
    **{f"--fim-qwen-{s}-default": (f"ggml-org/Qwen2.5-Coder-{s.upper()}-Q8_0-GGUF", {
        f"qwen2.5-coder-{s}-q8_0.gguf": _blob(s), f"qwen2.5-coder-{s}-Q4_K_M.gguf": _blob(s + "q4")},
        f"qwen2.5-coder-{s}-q8_0.gguf") for s in ("1.5b", "3b", "7b")},
    "--fim-qwen-30b-default": ("ggml-org/Qwen3-Coder-30B-A3B-Instruct-Q8_0-GGUF", {
        "qwen3-coder-30b-a3b-instruct-q8_0.gguf": _blob("30b"), "qwen3-coder-30b-a3b-instruct-Q4_K_M.gguf": _blob("x")},
        "qwen3-coder-30b-a3b-instruct-q8_0.gguf"),
    "--gpt-oss-20b-default": ("ggml-org/gpt-oss-20b-GGUF", {"gpt-oss-20b-mxfp4.gguf": _blob("20b"),
                                                             "gpt-oss-20b-Q8_0.gguf": _blob("20b8")},
                              "gpt-oss-20b-mxfp4.gguf"),
    "--gpt-oss-120b-default": ("ggml-org/gpt-oss-120b-GGUF", {
        f"gpt-oss-120b-mxfp4-{i:05d}-of-00003.gguf": _blob(f"120b{i}", 20_000 + i) for i in (1, 2, 3)},
        "gpt-oss-120b-mxfp4-00001-of-00003.gguf"),
    **{f"--vision-gemma-{s}-default": (f"ggml-org/gemma-3-{s}-it-qat-GGUF", {
        f"gemma-3-{s}-it-qat-Q4_0.gguf": _blob(s), f"mmproj-model-f16-{s.upper()}.gguf": _blob(s + "mm")},
        f"gemma-3-{s}-it-qat-Q4_0.gguf") for s in ("4b", "12b")},
}

#: llama.cpp's common_params field of each ServerConfig field a preset sets
FIELDS = {"hf_repo": "p.model.hf_repo or None", "hf_file": "p.model.hf_file or None", "port": "p.port",
          "ctx_size": "p.n_ctx", "batch_size": "p.n_batch", "ubatch_size": "p.n_ubatch",
          "parallel": "p.n_parallel", "cache_reuse": "p.n_cache_reuse", "embeddings": "p.embedding",
          "temp": "p.sampling.temp", "top_p": "p.sampling.top_p", "top_k": "p.sampling.top_k",
          "min_p": "p.sampling.min_p"}

_PARSE = """
import ctypes, json, os, sys, xllamacpp
so = ctypes.CDLL(xllamacpp.xllamacpp.__file__)
parse = so._Z19common_params_parseiPPcR13common_params13llama_examplePFviS0_E
parse.restype = ctypes.c_bool
parse.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p), ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p]
LLAMA_EXAMPLE_SERVER = 12
FIELDS = json.loads(sys.argv[1])
out, servers = [], []
for case in json.loads(sys.argv[2]):
    for k, v in case["env"].items():
        os.environ[k] = v
    p = xllamacpp.CommonParams()
    argv = [b"llama-server", *[a.encode() for a in case["argv"]]]
    ok = parse(len(argv), (ctypes.c_char_p * (len(argv) + 1))(*argv, None), id(p) + 16, LLAMA_EXAMPLE_SERVER, None)
    out.append({"ok": ok, **{k: eval(expr) for k, expr in FIELDS.items()}})
    for k in case["env"]:
        del os.environ[k]
    if case.get("serve"):  # then the server itself: -hf's download before the load
        p.model.path = "/not-used.gguf"  # xllamacpp wants one; llama.cpp's -hf replaces it
        p.warmup, p.verbosity = False, -1
        p.cpuparams.n_threads = p.cpuparams_batch.n_threads = 1
        try:
            # kept until os._exit: a Server dropped at once is shut down while it starts,
            # and that shutdown hung about one start in two on a loaded machine
            servers.append(xllamacpp.Server(p))
        except Exception as exc:
            out[-1]["error"] = str(exc)
print(json.dumps(out), flush=True)
os._exit(0)
"""


def llama_parse(cases: list[dict[str, Any]], tmp: Path, env: dict[str, str] | None = None) -> list[dict[str, Any]]:
    """llama-server's parse of each case (``argv``, ``env``) in one child process, with no
    LLAMA_ARG_* of ours and a config directory of its own (no user config.ini)."""
    pytest.importorskip("xllamacpp")
    base = {k: v for k, v in os.environ.items() if not k.startswith(("LLAMA_ARG_", "HF_TOKEN"))}
    base.update(XDG_CONFIG_HOME=str(tmp / "config"), **(env or {}))
    try:
        r = subprocess.run([sys.executable, "-c", _PARSE, json.dumps(FIELDS), json.dumps(cases)],
                           capture_output=True, text=True, timeout=120, env=base)
    except subprocess.TimeoutExpired as exc:  # seen once, on a loaded machine: say where it stood
        err = exc.stderr.decode(errors="replace") if isinstance(exc.stderr, bytes) else exc.stderr or ""
        pytest.fail(f"llama.cpp's child hung on {cases}: {err[-3000:]}")
    assert r.returncode == 0, r.stderr[-3000:]
    out: list[dict[str, Any]] = json.loads(r.stdout.strip().splitlines()[-1])
    return out


#: command lines whose parse is compared with llama-server's: each preset alone, then
#: the order between a preset and other flags, variables and another preset
LINES: list[tuple[list[str], dict[str, str]]] = [([name], {}) for name in PRESETS] + [
    (["--fim-qwen-7b-default", "-c", "8192", "--port", "9000", "-hf", "a/b", "--cache-reuse", "0"], {}),
    (["-c", "8192", "--port", "9000", "-hff", "x.gguf", "-ub", "64", "-np", "3", "--fim-qwen-7b-default"], {}),
    (["-hff", "x.gguf", "--top-k", "5", "--vision-gemma-4b-default"], {}),  # it names no file: -hff stays
    (["--vision-gemma-12b-default", "-hff", "y.gguf", "-c", "2048"], {}),
    (["--embd-gemma-default", "-np", "4"], {}),  # -c stays 2048 x 32
    (["--gpt-oss-20b-default", "--temp", "0.5", "--embd-gemma-default"], {}),
    (["--embd-gemma-default", "--gpt-oss-120b-default"], {}),  # embeddinggemma's -hff with gpt-oss's repository
    (["--fim-qwen-1.5b-default"], {"LLAMA_ARG_PORT": "9000", "LLAMA_ARG_CTX_SIZE": "1024",
                                   "LLAMA_ARG_HF_FILE": "z.gguf", "LLAMA_ARG_N_PARALLEL": "3"}),
    (["--gpt-oss-120b-default", "--top-p", "0.5"], {"LLAMA_ARG_HF_FILE": "z.gguf", "LLAMA_ARG_TEMPERATURE": "0.2",
                                                   "LLAMA_ARG_HF_REPO": "o/r", "LLAMA_ARG_EMBEDDINGS": "1"}),
]


@pytest.fixture(scope="module")
def theirs(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """llama-server's parse of ``[]`` (its defaults) and of every line of ``LINES``."""
    cases: list[dict[str, Any]] = [{"argv": [], "env": {}}] + [{"argv": argv, "env": env} for argv, env in LINES]
    return llama_parse(cases, tmp_path_factory.mktemp("llama"))


def test_the_reference_reads_back_what_it_parsed(theirs: list[dict[str, Any]]) -> None:
    """The offset of common_params in xllamacpp's object: the parse of a few plain flags
    reads back through xllamacpp's own properties."""
    got = llama_parse([{"argv": ["-c", "1234", "-b", "77", "-ub", "33", "--port", "4321", "--top-k", "7",
                                 "-hf", "a/b:Q8_0", "-hff", "f.gguf"], "env": {}}], Path(os.environ.get("TMPDIR", "/tmp")))
    assert got[0]["ok"] and (got[0]["ctx_size"], got[0]["batch_size"], got[0]["ubatch_size"], got[0]["port"],
                             got[0]["top_k"], got[0]["hf_repo"], got[0]["hf_file"]) == (
        1234, 77, 33, 4321, 7, "a/b:Q8_0", "f.gguf")
    assert theirs[0]["ok"] and theirs[0]["hf_repo"] is None


@pytest.mark.parametrize(("i", "line"), list(enumerate(LINES, 1)),
                         ids=[" ".join([*(f"{k}={v}" for k, v in e.items()), *a]) for a, e in LINES])
def test_each_line_sets_what_llama_server_sets(theirs: list[dict[str, Any]], i: int,
                                               line: tuple[list[str], dict[str, str]]) -> None:
    """What our parser sets is llama-server's value, field for field; what it leaves
    unset, llama-server leaves at its default (the defaults differ: -c, -np, -b...)."""
    argv, env = line
    ours = parse(argv, env).values
    defaults, want = theirs[0], theirs[i]
    assert want["ok"]
    for key in FIELDS:
        if key in ours:
            expected = want[key]
            assert ours[key] == (pytest.approx(expected, rel=1e-6) if isinstance(expected, float) else expected), key
        else:
            assert want[key] == defaults[key], key


def test_the_settings_reach_the_config(tmp_path: Path) -> None:
    env = {"LLAMA_CACHE": str(tmp_path)}  # nothing cached: the download waits for the start
    c = parse_config(["--gpt-oss-20b-default"], env)
    assert (c.hf_repo, c.hf_file, c.model, c.alias) == ("ggml-org/gpt-oss-20b-GGUF", "gpt-oss-20b-mxfp4.gguf", None,
                                                        "ggml-org/gpt-oss-20b-GGUF")
    assert (c.port, c.ubatch_size, c.batch_size, c.parallel, c.ctx_size) == (8013, 2048, 32768, 2, 262144)
    assert (c.temp, c.top_p, c.top_k, c.min_p) == (1.0, 1.0, 0, 0.01)
    assert "ctx_size" in c.set_by_user  # a size: kept by --fit, as llama-server keeps a non-zero -c
    c = parse_config(["-c", "8192", "--fim-qwen-7b-default"], env)
    assert (c.ctx_size, c.cache_reuse, c.port) == (0, 256, 8012)
    assert "ctx_size" not in c.set_by_user  # -c 0 of a preset: --fit may lower it, as llama-server's
    assert "ctx_size" in parse_config(["--fim-qwen-7b-default", "-c", "0"], env).set_by_user  # typed: as before
    c = parse_config(["--embd-gemma-default"], env)
    assert (c.embeddings, c.parallel, c.ctx_size, c.slot_ctx(0)) == (True, 32, 65536, 2048)
    for name in PRESETS:
        parse_config([name], env)  # every preset makes a valid config


# -- the download --------------------------------------------------------------------


@pytest.mark.parametrize("name", list(PRESETS))
def test_each_preset_downloads_its_model_then_offline_needs_no_network(hub: Hub, tmp_path: Path, name: str) -> None:  # noqa: F811  (the fixture)
    repo, files, want = PRESETS[name]
    hub.add(repo, files)
    config = parse_config([name, "--port", "0"])
    assert config.model is None and hub.requests == []  # downloaded at startup
    got = trio.run(trio.to_thread.run_sync, fetch_hf, config)  # what the start does
    snap = _repo_dir(tmp_path / "cache", repo) / "snapshots" / COMMIT
    assert got.model == snap / want and got.model.read_bytes() == files[want]
    projector = [f for f in files if f.startswith("mmproj")]
    assert got.mmproj == (snap / projector[0] if projector else None)
    assert sorted(p.split("/")[-1] for p in hub.downloads() if "/resolve/" in p) == sorted(
        f for f in files if f == want or f in projector or f.startswith("gpt-oss-120b"))
    n = len(hub.requests)
    for extra in ([], ["--offline"]):  # now in the cache: neither asks the network
        cached = parse_config([name, *extra])
        assert (cached.model, cached.mmproj) == (got.model, got.mmproj)
    assert len(hub.requests) == n
    if projector:
        assert parse_config([name, "--no-mmproj"]).mmproj is None


@pytest.mark.parametrize("name", ["--vision-gemma-4b-default", "--gpt-oss-120b-default"])
def test_llama_server_downloads_the_same_files(hub: Hub, tmp_path: Path, name: str) -> None:  # noqa: F811  (the fixture)
    """The presets that name no file: llama-server's own preset and -hf (its download
    comes before its load, which the stand-in files fail) fetch the same files into the
    same cache as ours."""
    repo, files, _want = PRESETS[name]
    hub.add(repo, files)
    env = {"MODEL_ENDPOINT": hub.endpoint, "LLAMA_CACHE": str(tmp_path / "theirs")}
    (out,) = llama_parse([{"argv": [name, "--port", "0"], "env": {}, "serve": True}], tmp_path, env)
    assert out["hf_repo"] == repo and out["hf_file"] is None and "error" in out
    theirs_asked = sorted(p for p in hub.downloads() if "/resolve/" in p)
    assert theirs_asked
    hub.requests.clear()
    c = parse_config([name], {"LLAMA_CACHE": str(tmp_path / "ours")})
    fetch(c.hf_repo or "", c.hf_file, env={"LLAMA_CACHE": str(tmp_path / "ours"), "MODEL_ENDPOINT": hub.endpoint},
          **FAST)
    assert sorted(p for p in hub.downloads() if "/resolve/" in p) == theirs_asked
    assert _tree(tmp_path / "ours") == _tree(tmp_path / "theirs")


def test_llama_server_takes_what_our_preset_downloaded(hub: Hub, tiny_model: Path, tmp_path: Path) -> None:  # noqa: F811  (the fixture)
    """A preset's model that we fetched is llama-server's preset's, offline, no request."""
    repo = PRESETS["--fim-qwen-1.5b-default"][0]
    hub.add(repo, {"qwen2.5-coder-1.5b-q8_0.gguf": tiny_model.read_bytes()})
    config = parse_config(["--fim-qwen-1.5b-default"])
    trio.run(trio.to_thread.run_sync, fetch_hf, config)
    hub.requests.clear()
    (out,) = llama_parse([{"argv": ["--fim-qwen-1.5b-default", "--port", "0", "-c", "256", "--offline"], "env": {},
                           "serve": True}], tmp_path, {"MODEL_ENDPOINT": hub.endpoint,
                                                       "LLAMA_CACHE": str(tmp_path / "cache")})
    assert "error" not in out, out
    assert hub.requests == []


async def test_the_vision_preset_serves_images(hub: Hub, tmp_path: Path) -> None:  # noqa: F811  (the fixture)
    """--vision-gemma-4b-default end to end: a tiny gemma-3 and its projector, under the
    preset's repository's names, downloaded at startup; /props says vision; a later
    --port and -c win over the preset's."""
    from trio_llm.model.gguf import load_gguf
    from trio_llm.model.synth import make_model
    from trio_llm.vision.synth import write_mmproj

    text = make_model("tiny-gemma3", "Q8_0", tmp_path / "t.gguf")
    mmproj = tmp_path / "p.gguf"
    write_mmproj(mmproj, n_embd_text=load_gguf(text).config.n_embd, wtype="f16", seed=3, image_size=64, patch_size=8, n_embd=64, n_ff=128, n_head=4, n_layer=2, n_merge=2)
    repo = PRESETS["--vision-gemma-4b-default"][0]
    hub.add(repo, {"gemma-3-4b-it-qat-Q4_0.gguf": text.read_bytes(), "mmproj-model-f16-4B.gguf": mmproj.read_bytes(),
                   "README.md": b"# gemma\n"})
    config = parse_config(["--vision-gemma-4b-default", "--port", "0", "--backend", "numpy", "--no-warmup",
                           "-c", "512"])
    assert (config.port, config.ctx_size, config.model) == (0, 512, None)
    async with trio.open_nursery() as nursery:
        handle = await nursery.start(serve, config)
        with trio.fail_after(120):
            await handle.context.loaded.wait()
        async with httpx.AsyncClient(base_url=handle.url, timeout=60) as c:
            props = (await c.get("/props")).json()
            image = io.BytesIO()
            Image.new("RGB", (48, 40), (200, 30, 90)).save(image, format="PNG")
            r = await c.post("/completion", json={"prompt": {"prompt_string": f"see {props['media_marker']}",
                                                             "multimodal_data": [base64.b64encode(image.getvalue())
                                                                                 .decode()]}, "n_predict": 2})
        handle.shutdown()
    assert r.status_code == 200, r.text
    snap = _repo_dir(tmp_path / "cache", repo) / "snapshots" / COMMIT
    assert props["model_path"] == str(snap / "gemma-3-4b-it-qat-Q4_0.gguf")
    assert props["modalities"]["vision"] is True
    assert props["default_generation_settings"]["n_ctx"] == 512


# -- one line, and a status ------------------------------------------------------------


def test_an_architecture_not_built_fails_after_the_download_in_one_line(hub: Hub, tmp_path: Path) -> None:  # noqa: F811  (the fixture)
    path = tmp_path / "gpt-oss.gguf"
    w = gguf.GGUFWriter(str(path), "gpt-oss")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    hub.add("ggml-org/gpt-oss-20b-GGUF", {"gpt-oss-20b-mxfp4.gguf": path.read_bytes()})
    r = subprocess.run([sys.executable, "-m", "trio_llm", "serve", "--gpt-oss-20b-default", "--port", "0",
                        "--backend", "numpy", "--no-warmup"], capture_output=True, text=True, timeout=120,
                       env=dict(os.environ))
    # the start's log lines (listening, the download), then the error: one line, the last
    lines = r.stderr.strip().splitlines()
    errors = [ln for ln in lines if not ln.startswith("trio-llm: ")]
    assert r.returncode == 1 and errors == lines[-1:], r.stderr
    assert errors[0].startswith("trio-llm serve: error: ") and "architecture 'gpt-oss' is not supported" in errors[0]
    assert len(hub.downloads()) == 2  # resolve + CDN: it was downloaded first


def test_offline_without_the_model_and_the_speculative_presets(capsys: pytest.CaptureFixture[str],
                                                              monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("LLAMA_CACHE", str(tmp_path))
    err = one_line_exit(["--fim-qwen-3b-default", "--offline"], capsys, code=1)
    assert "ggml-org/Qwen2.5-Coder-3B-Q8_0-GGUF" in err and "nothing is downloaded" in err
    for name in ("--fim-qwen-7b-spec", "--fim-qwen-14b-spec", "--spec-default"):
        assert "speculative decoding is not implemented" in one_line_exit([name], capsys)
    assert {f.names[0] for f in FLAGS if f.preset} == set(PRESETS)

"""Regression tests of issue 17's defects, each through a real server: in-process
(real hypercorn on loopback, the tiny model on numpy) where a crash would surface as
the test's own error, or a real ``trio-llm serve`` process where the defect was an
exit, a signal or a file on disk. Each failed on the code before its fix."""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import trio

import test_server_http
from serve_procs import wait_ready
from test_server_http import Start, client, sse_events
from trio_llm.residency.arbiter import open_arbiter

start = test_server_http.start  # the in-process server fixture, under its own name

SERVE = [sys.executable, "-m", "trio_llm", "serve", "--backend", "numpy", "--port", "0"]


async def _serve(model: Path, *extra: str) -> tuple[trio.Process, httpx.AsyncClient]:
    proc = await trio.lowlevel.open_process([*SERVE, "-m", str(model), *extra], stderr=subprocess.PIPE)
    url, _ = await wait_ready(proc, 60)
    return proc, httpx.AsyncClient(base_url=url, timeout=60)


async def _stop(proc: trio.Process, http: httpx.AsyncClient) -> tuple[int, str]:
    await http.aclose()
    proc.send_signal(signal.SIGTERM)
    assert proc.stderr is not None
    out = b""
    with trio.fail_after(30):
        while chunk := await proc.stderr.receive_some():
            out += chunk
        code = await proc.wait()
    return code, out.decode()


async def _exit(proc: trio.Process, http: httpx.AsyncClient) -> tuple[int, str]:
    """The exit of a server already told to stop."""
    await http.aclose()
    assert proc.stderr is not None
    out = b""
    with trio.fail_after(15):
        while chunk := await proc.stderr.receive_some():
            out += chunk
        code = await proc.wait()
    return code, out.decode()


# -- 1. a failed wake ------------------------------------------------------------------


async def test_a_failed_wake_is_a_500_and_the_next_wake_works(tiny_model: Path, tmp_path: Path) -> None:
    """Level unload reloads the model file on wake; with the file truncated meanwhile
    the wake fails. The waiting request gets a 500 naming the cause (the slots loop
    used to die of the ExceptionGroup and take the process with it); the server
    keeps serving, and once the file is back the next request wakes it."""
    model = tmp_path / "m.gguf"
    shutil.copy(tiny_model, model)
    proc, http = await _serve(model, "--sleep-mode", "unload")
    body = {"prompt": "Hello", "n_predict": 2}
    assert (await http.post("/sleep")).json()["is_sleeping"] is True
    good = model.read_bytes()
    model.write_bytes(good[:1000])
    r = await http.post("/completion", json=body)
    assert r.status_code == 500, r.text
    err = r.json()["error"]
    assert "could not be made resident" in err["message"] and "m.gguf" in err["message"]
    assert (await http.get("/health")).status_code == 200
    r = await http.post("/completion", json=body)  # the file is still broken: fails again
    assert r.status_code == 500
    model.write_bytes(good)
    r = await http.post("/completion", json=body)
    assert r.status_code == 200, r.text
    props = (await http.get("/props")).json()["residency"]
    assert props["state"] == "resident" and props["cycles"]["failures"] == 2
    code, log = await _stop(proc, http)
    assert code == 0 and "Traceback" not in log, log


async def test_a_waiting_wake_survives_inbox_messages(tiny_model: Path, tmp_path: Path) -> None:
    """While a wake waits for another process's token, new requests and cancelled
    ones reach the slots loop. The waker stays registered on want.lock all along:
    one contended take for the whole wait (it used to be cancelled and re-taken at
    every message)."""
    standin = subprocess.Popen(
        [sys.executable, str(Path(__file__).with_name("standin.py")), "--arena", str(tmp_path),
         "--hold", "60", "--until-stdin"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )
    arena = ["--vram-arena", str(tmp_path), "-np", "4", "--no-warmup"]
    assert standin.stdin is not None and standin.stdout is not None
    assert (await trio.to_thread.run_sync(standin.stdout.readline)).strip() == "waiting"
    assert (await trio.to_thread.run_sync(standin.stdout.readline)).strip() == "token"
    proc = await trio.lowlevel.open_process([*SERVE, "-m", str(tiny_model), *arena], stderr=subprocess.PIPE)
    standin.stdin.write("release\n")  # let the server load, then take the token back
    standin.stdin.flush()
    url, _ = await wait_ready(proc, 60)
    http = httpx.AsyncClient(base_url=url, timeout=60)
    standin = subprocess.Popen(
        [sys.executable, str(Path(__file__).with_name("standin.py")), "--arena", str(tmp_path),
         "--hold", "60", "--until-stdin"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )
    assert standin.stdin is not None and standin.stdout is not None
    assert (await trio.to_thread.run_sync(standin.stdout.readline)).strip() == "waiting"
    assert (await trio.to_thread.run_sync(standin.stdout.readline)).strip() == "token"

    async def props() -> dict[str, Any]:
        return (await http.get("/props")).json()["residency"]  # type: ignore[no-any-return]

    results: list[int] = []

    async def ask(prompt: str) -> None:
        r = await http.post("/completion", json={"prompt": prompt, "n_predict": 2})
        results.append(r.status_code)

    async def gone(prompt: str) -> None:
        try:
            await httpx.AsyncClient(base_url=url, timeout=0.3).post(
                "/completion", json={"prompt": prompt, "n_predict": 2})
        except httpx.TimeoutException:
            pass

    async with trio.open_nursery() as nursery:
        nursery.start_soon(ask, "first")
        with trio.fail_after(30):
            while not (await props())["arbiter"]["waiting"]:
                await trio.sleep(0.02)
        before = (await props())["arbiter"]["contended_takes"]
        for i in range(3):
            nursery.start_soon(ask, f"more {i}")
            nursery.start_soon(gone, f"gone {i}")
            await trio.sleep(0.4)
        res = await props()
        assert res["arbiter"]["waiting"] and res["arbiter"]["contended_takes"] == before
        standin.stdin.write("release\n")
        standin.stdin.flush()
    assert results == [200] * 4
    assert await trio.to_thread.run_sync(standin.wait) == 0
    code, log = await _stop(proc, http)
    assert code == 0 and "Traceback" not in log, log


async def test_a_slot_action_waiting_for_a_contended_wake_serves_the_inbox(tiny_model: Path, tmp_path: Path) -> None:
    """Found beyond the eleven: a slot restore (or save) on a cold server waited for
    the wake without serving the slots loop's inbox, so while another process held
    the GPU no cancellation was seen, and a restore whose client had gone still
    overwrote the slot's cache once the token came. Now the wait serves the inbox
    like a generation's: the departed restore is dropped (the slot keeps its cache),
    and a generation and a save posted meanwhile are both answered after the wake."""
    arena, folder = tmp_path / "arena", tmp_path / "slots"
    folder.mkdir()
    proc, http = await _serve(tiny_model, "--vram-arena", str(arena), "-np", "2", "--no-warmup",
                              "--slot-save-path", str(folder))
    short = {"prompt": "Hello", "n_predict": 1, "id_slot": 0}
    longer = {"prompt": "A longer prompt, cached in slot zero", "n_predict": 1, "id_slot": 0}
    assert (await http.post("/completion", json=short)).status_code == 200
    assert (await http.post("/slots/0?action=save", json={"filename": "short.bin"})).status_code == 200
    assert (await http.post("/completion", json=longer)).status_code == 200
    cached = (await http.get("/slots")).json()[0]["n_cached"]
    standin = subprocess.Popen(
        [sys.executable, str(Path(__file__).with_name("standin.py")), "--arena", str(arena),
         "--hold", "60", "--until-stdin"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )
    assert standin.stdin is not None and standin.stdout is not None
    assert (await trio.to_thread.run_sync(standin.stdout.readline)).strip() == "waiting"
    assert (await trio.to_thread.run_sync(standin.stdout.readline)).strip() == "token"

    async def props() -> dict[str, Any]:
        return (await http.get("/props")).json()["residency"]  # type: ignore[no-any-return]

    with trio.fail_after(30):
        while (await props())["token_held"]:
            await trio.sleep(0.02)
    try:
        await httpx.AsyncClient(base_url=str(http.base_url), timeout=1.0).post(
            "/slots/0?action=restore", json={"filename": "short.bin"})
        raise AssertionError("the restore answered while the GPU was held elsewhere")
    except httpx.TimeoutException:
        pass  # its client left while it waited for the wake
    answers: list[int] = []

    async def post(path: str, body: dict[str, Any]) -> None:
        answers.append((await http.post(path, json=body)).status_code)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(post, "/completion", {"prompt": "meanwhile", "n_predict": 2, "id_slot": 1})
        nursery.start_soon(post, "/slots/1?action=save", {"filename": "one.bin"})
        await trio.sleep(0.5)
        standin.stdin.write("release\n")
        standin.stdin.flush()
    assert answers == [200, 200]
    assert (await http.get("/slots")).json()[0]["n_cached"] == cached  # not overwritten
    assert sorted(p.name for p in folder.iterdir()) == ["one.bin", "short.bin"]
    assert await trio.to_thread.run_sync(standin.wait) == 0
    code, log = await _stop(proc, http)
    assert code == 0 and "Traceback" not in log, log


# -- 2, 8, 9, 10. slot files --------------------------------------------------------------


async def test_slot_files_long_names_private_mode_no_symlink_following(start: Start, tmp_path: Path) -> None:
    """A 255-character name saves (its temporary name is our own, short one); a
    256-character one is a 400; the file is 0600 whatever the umask; a symlink
    planted at the name or at the old temporary name is replaced, never written
    through; no temporary is left behind."""
    h = await start(parallel=1, slot_save_path=tmp_path)
    victim = tmp_path.parent / f"{tmp_path.name}-victim"
    victim.write_bytes(b"precious")
    os.symlink(victim, tmp_path / "b.bin.tmp")
    os.symlink(victim, tmp_path / "b.bin")
    async with client(h) as c:
        assert (await c.post("/completion", json={"prompt": "Hello there", "n_predict": 2})).status_code == 200
        for n in (252, 253, 254, 255):
            name = "a" * n
            r = await c.post("/slots/0?action=save", json={"filename": name})
            assert r.status_code == 200, r.text
            assert stat.S_IMODE((tmp_path / name).stat().st_mode) == 0o600
            r = await c.post("/slots/0?action=restore", json={"filename": name})
            assert r.status_code == 200, r.text
        r = await c.post("/slots/0?action=save", json={"filename": "a" * 256})
        assert r.status_code == 400
        r = await c.post("/slots/0?action=save", json={"filename": "b.bin"})
        assert r.status_code == 200, r.text
        assert victim.read_bytes() == b"precious"
        assert stat.S_ISREG((tmp_path / "b.bin").lstat().st_mode)
        assert (await c.get("/health")).status_code == 200
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".slot-")]


async def test_planted_files_are_refused_on_restore_without_wedging(start: Start, tmp_path: Path) -> None:
    """A FIFO, an empty file, a plain ``.npy``, a zip of other members, a symlink, a
    folder: each restore is a 400 at once, and a stream on the other slot goes on
    meanwhile (a FIFO used to block the slots loop, the others to end the process)."""
    h = await start(parallel=2, slot_save_path=tmp_path)
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "empty").write_bytes(b"")
    np.save(tmp_path / "plain.npy", np.zeros(3))
    np.savez(tmp_path / "other.npz", a=np.zeros(3))
    (tmp_path / "dir").mkdir()
    (tmp_path / "real").write_bytes(b"x")
    os.symlink(tmp_path / "real", tmp_path / "link")
    async with client(h) as c:
        long = {"prompt": "Tell me a story", "n_predict": 200, "ignore_eos": True, "stream": True, "id_slot": 0}
        async with c.stream("POST", "/completion", json=long) as r:
            lines = r.aiter_lines()
            assert (await lines.__anext__()).startswith("data: ")
            for name, needle in [("fifo", "not a regular file"), ("empty", "not a slot file"),
                                 ("plain.npy", "not a slot file"), ("other.npz", "not a slot file"),
                                 ("link", "symbolic link"), ("dir", "not a regular file")]:
                with trio.fail_after(5):
                    rr = await c.post("/slots/1?action=restore", json={"filename": name})
                assert rr.status_code == 400 and needle in rr.json()["error"]["message"], (name, rr.text)
            events = [json.loads(ln[6:]) for ln in [ln async for ln in lines] if ln.startswith("data: ")]
        assert events[-1]["stop"] is True and events[-1]["tokens_predicted"] == 200
        assert (await c.get("/health")).status_code == 200


# -- 3, 4, 5. JSON the server cannot parse or echo -----------------------------------------


async def test_deep_json_and_lone_surrogates_are_400s(start: Start) -> None:
    h = await start(parallel=1)
    deep = b"[" * 100_000 + b"]" * 100_000
    deep_prompt = b'{"prompt":' + b'{"a":' * 5000 + b"1" + b"}" * 5000 + b"}"
    ok_depth = b'{"prompt": "hi", "n_predict": 1, "x": ' + b"[" * 60 + b"]" * 60 + b"}"
    async with client(h) as c:
        for path in ("/completion", "/v1/completions", "/v1/chat/completions", "/tokenize", "/apply-template"):
            for raw in (deep, deep_prompt):
                r = await c.post(path, content=raw, headers={"content-type": "application/json"})
                assert r.status_code == 400 and "deeper than" in r.json()["error"]["message"], (path, r.text)
        assert (await c.post("/completion", content=ok_depth)).status_code == 200
        # found beyond the eleven: an integer literal past Python's 4300-digit limit
        # was a 500 ValueError
        for raw in (b'{"prompt": "hi", "n_predict": ' + b"1" * 5000 + b"}",
                    b'{"prompt": [1, 2, ' + b"9" * 5000 + b"]}"):
            r = await c.post("/completion", content=raw)
            assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"], r.text
        for path, raw in [
            ("/apply-template", b'{"messages":[{"role":"user","content":"\\ud800"}]}'),
            ("/apply-template", b'{"messages":[{"role":"\\udfff","content":"x"}]}'),
            ("/completion", b'{"prompt":"hi","n_predict":2,"stop":["\\ud800"]}'),
            ("/completion", b'{"prompt":"hi","n_predict":2,"stop":["\\ud800"],"stream":true}'),
            ("/v1/chat/completions", b'{"messages":[{"role":"user","content":"a\\udc00"}],"stream":true}'),
            ("/tokenize", b'{"content":"\\ud800"}'),
            ("/completion", b'{"prompt":"hi","\\ud800":1}'),
        ]:
            r = await c.post(path, content=raw)
            assert r.status_code == 400, (path, r.text)
            assert "surrogate" in r.json()["error"]["message"]
        # a valid surrogate pair is one character (an emoji), not an error
        r = await c.post("/tokenize", content=b'{"content":"\\ud83d\\ude00"}')
        assert r.status_code == 200 and r.json()["tokens"]
        r = await c.post("/apply-template", content=b'{"messages":[{"role":"user","content":"\\ud83d\\ude00"}]}')
        assert r.status_code == 200 and "\U0001f600" in r.json()["prompt"]
        assert (await c.get("/health")).status_code == 200


# -- 6. a big body ---------------------------------------------------------------------------


@pytest.mark.slow
async def test_health_answers_while_a_5_mb_body_is_tokenized(tiny_model: Path) -> None:
    """Tokenizing (and templating) a 5 MB prompt runs on a worker thread with the GIL
    released: /health keeps answering meanwhile (it stalled 4-7 s). A separate server
    process, so that the probe's clock runs while the server works; answers that are
    small (more tokens than the context), so the test's own client does no big work."""
    proc, http = await _serve(tiny_model)
    words = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota", "kappa"]
    rng = np.random.default_rng(0)
    big = " ".join(rng.choice(words, 5 * 1024 * 1024 // 6).tolist())[: 5 * 1024 * 1024]
    worst: dict[str, float] = {}
    for path, body in [
        # the chat endpoint: template and tokenizer both (/completion and /tokenize
        # take the same worker-thread path for their tokenizing)
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": big}], "max_tokens": 1}),
    ]:
        raw = json.dumps(body).encode()
        done = trio.Event()
        worst[path] = 0.0

        async def big_request(path: str = path, raw: bytes = raw, done: trio.Event = done) -> None:
            r = await http.post(path, content=raw)
            assert r.status_code == 400 and "tokens" in r.text, r.text  # more than the context
            done.set()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(big_request)
            async with httpx.AsyncClient(base_url=str(http.base_url), timeout=30) as probe:
                while not done.is_set():
                    t0 = trio.current_time()
                    assert (await probe.get("/health")).status_code == 200
                    worst[path] = max(worst[path], trio.current_time() - t0)
                    await trio.sleep(0.01)
    # measured: 3-7 s before; after, 0.05-0.4 s on a 2-core machine at load 4 (what
    # remains is the GIL held in C while 3 million token ids become a Python list);
    # the bound leaves room for CI noise and still fails the old code by far
    assert max(worst.values()) < 1.0, worst
    code, log = await _stop(proc, http)
    assert code == 0 and "Traceback" not in log


# -- 7. a stream cut by the shutdown grace -----------------------------------------------------


async def test_a_stream_cut_by_the_shutdown_grace_ends_with_an_error_event(tiny_model: Path) -> None:
    proc, http = await _serve(tiny_model, "--shutdown-timeout", "0.5", "-c", "4096")
    body = {"prompt": "Once upon a time", "n_predict": 3000, "ignore_eos": True, "stream": True}
    async with http.stream("POST", "/completion", json=body) as r:
        lines = r.aiter_lines()
        assert (await lines.__anext__()).startswith("data: ")
        proc.send_signal(signal.SIGTERM)
        rest = [ln async for ln in lines if ln.startswith("data: ")]
    last = json.loads(rest[-1][6:])
    assert last["error"]["code"] == 503 and "grace period" in last["error"]["message"], rest[-3:]
    assert not any('"stop": true' in ln for ln in rest)
    code, log = await _exit(proc, http)
    assert code == 0 and "Traceback" not in log


async def test_an_openai_stream_cut_by_the_grace_ends_with_error_then_done(tiny_model: Path) -> None:
    proc, http = await _serve(tiny_model, "--shutdown-timeout", "0.5", "-c", "4096")
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3000, "stream": True,
            "logit_bias": {}, "ignore_eos": True}
    async with http.stream("POST", "/v1/chat/completions", json=body) as r:
        lines = r.aiter_lines()
        assert (await lines.__anext__()).startswith("data: ")
        proc.send_signal(signal.SIGTERM)
        rest = sse_events("\n".join([ln async for ln in lines]))
    assert rest[-1] == "[DONE]" and rest[-2]["error"]["code"] == 503, rest[-3:]
    code, log = await _exit(proc, http)
    assert code == 0 and "Traceback" not in log


# -- 11. the arena's permissions ----------------------------------------------------------------

NOBODY = 65534


def _python_for_nobody() -> str | None:
    """A Python interpreter another user may run (the venv's may sit under /root)."""
    for candidate in ("/usr/bin/python3", sys.executable):
        try:
            if subprocess.run([candidate, "-c", "0"], user=NOBODY, group=NOBODY, extra_groups=[],
                              capture_output=True, timeout=30).returncode == 0:
                return candidate
        except OSError:
            continue
    return None


async def test_arena_files_are_never_open_to_all_and_never_followed(tmp_path: Path) -> None:
    """A private arena's files are 0600 (a wider file of ours is narrowed), a
    group-writable (shared) arena's 0660; a planted symlink or FIFO makes the arena
    unusable (uncoordinated, with a warning) instead of followed or blocking."""
    private = tmp_path / "private"
    arb = await open_arbiter(private)
    assert arb.active and stat.S_IMODE(private.stat().st_mode) == 0o700
    for name in ("token.lock", "want.lock"):
        assert stat.S_IMODE((private / name).stat().st_mode) == 0o600
    arb.close()
    (private / "token.lock").chmod(0o666)  # as the reference fork creates it (umask 0)
    arb = await open_arbiter(private)
    assert stat.S_IMODE((private / "token.lock").stat().st_mode) == 0o600
    arb.close()

    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o2770)
    arb = await open_arbiter(shared)
    for name in ("token.lock", "want.lock"):
        assert stat.S_IMODE((shared / name).stat().st_mode) == 0o660
    arb.close()

    victim = tmp_path / "victim"
    planted = tmp_path / "planted"
    planted.mkdir()
    os.symlink(victim, planted / "token.lock")
    arb = await open_arbiter(planted)
    assert not arb.active and not victim.exists()
    fifo = tmp_path / "fifo"
    fifo.mkdir()
    os.mkfifo(fifo / "want.lock")
    with trio.fail_after(5):
        arb = await open_arbiter(fifo)
    assert not arb.active


async def test_another_user_cannot_open_a_private_arena_but_a_group_member_can(tmp_path: Path) -> None:
    """Who can disturb whom, for real: as root, run a process as nobody. A private
    arena (even in a directory others may enter) refuses it; a shared arena (a
    setgid directory of nobody's group) lets it take part."""
    if os.geteuid() != 0:
        pytest.skip("needs root, to run a process as another user")
    python = _python_for_nobody()
    if python is None:
        pytest.skip("no Python interpreter that another user may run")
    top = tmp_path / "top"
    top.mkdir()
    for p in (tmp_path, *tmp_path.parents):  # let nobody reach the arenas below (up to pytest's own
        p.chmod(p.stat().st_mode | 0o011)  # base directory: a pytest-xdist worker adds a level)
        if p.name.startswith("pytest-of-"):
            break
    private = top / "private"
    private.mkdir()
    private.chmod(0o755)  # enterable by all, as a /tmp/arena often is
    arb = await open_arbiter(private)
    probe = "import fcntl, os, sys; fd = os.open(sys.argv[1], os.O_RDONLY); fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)"
    r = subprocess.run([python, "-c", probe, str(private / "want.lock")], user=NOBODY, group=NOBODY,
                       extra_groups=[], capture_output=True, text=True, timeout=30)
    assert r.returncode != 0 and "PermissionError" in r.stderr, r.stderr
    assert arb.probe() is False  # nobody could register as a waiter
    arb.close()

    shared = top / "shared"
    shared.mkdir()
    os.chown(shared, 0, NOBODY)
    shared.chmod(0o2770)
    arb = await open_arbiter(shared)
    assert (shared / "token.lock").stat().st_gid == NOBODY  # setgid: the group is the arena's
    member = ("import fcntl, os, sys, time; fd = os.open(sys.argv[1], os.O_RDWR); "
              "fcntl.flock(fd, fcntl.LOCK_SH); print('waiting', flush=True); time.sleep(30)")
    waiter = subprocess.Popen([python, "-c", member, str(shared / "want.lock")], user=NOBODY,
                              group=NOBODY, extra_groups=[], stdout=subprocess.PIPE, text=True)
    try:
        assert waiter.stdout is not None
        assert (await trio.to_thread.run_sync(waiter.stdout.readline)).strip() == "waiting"
        assert arb.probe() is True  # the group member is seen waiting
    finally:
        waiter.kill()
        waiter.wait()
        arb.close()


async def test_a_long_wait_for_the_token_logs_the_holders_pid(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    standin = subprocess.Popen(
        [sys.executable, str(Path(__file__).with_name("standin.py")), "--arena", str(tmp_path),
         "--hold", "60", "--until-stdin"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )
    assert standin.stdin is not None and standin.stdout is not None
    assert (await trio.to_thread.run_sync(standin.stdout.readline)).strip() == "waiting"
    assert (await trio.to_thread.run_sync(standin.stdout.readline)).strip() == "token"
    arb = await open_arbiter(tmp_path, report_after=0.2)
    caplog.set_level(logging.WARNING, "trio_llm.residency.arbiter")
    with trio.move_on_after(10):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(arb.take)
            while not any("waited" in r.getMessage() for r in caplog.records):
                await trio.sleep(0.05)
            nursery.cancel_scope.cancel()
    messages = [r.getMessage() for r in caplog.records if "waited" in r.getMessage()]
    assert len(messages) == 1 and f"pid {standin.pid}" in messages[0] and "standin.py" in messages[0]
    assert not arb.holding
    standin.stdin.close()
    assert await trio.to_thread.run_sync(standin.wait) == 0
    arb.close()

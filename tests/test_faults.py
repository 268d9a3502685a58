"""The fault-injection tier: real processes killed at random, restores that fail
midway at every level, an arena removed under a running server, a full disk under
slot saves. Each fault has its expected behaviour asserted: the survivors' requests
all answered, nobody stranded, a clear error where a request could not be served,
and the server serving afterwards.

Everything here is a real component (``trio-llm serve`` processes, the stand-in of
the reference fork, flock, the file system); the one injected fault that is not a
real mechanism is the restore failing midway (no real device on numpy fails there),
done by wrapping the real numpy backend's restore so that it stops after the
weights came back and before the KV cache did.
"""

from __future__ import annotations

import errno
import os
import random
import resource
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

import test_server_http
from serve_procs import wait_ready
from test_server_http import Start, client
from trio_llm.engine.reference import NumpyBackend
from trio_llm.errors import DeviceOutOfMemory
from trio_llm.residency.arbiter import TOKEN_FILE, open_arbiter

pytestmark = [pytest.mark.faults, pytest.mark.slow]

start = test_server_http.start  # the in-process server fixture, under its own name

SERVE = [sys.executable, "-m", "trio_llm", "serve", "--backend", "numpy", "--port", "0"]
STANDIN = [sys.executable, str(Path(__file__).with_name("standin.py"))]


class Server:
    def __init__(self, proc: trio.Process, url: str) -> None:
        self.proc, self.url = proc, url
        self.http = httpx.AsyncClient(base_url=url, timeout=60)

    async def residency(self) -> dict[str, Any]:
        return (await self.http.get("/props")).json()["residency"]  # type: ignore[no-any-return]

    async def until(self, pred: Any) -> dict[str, Any]:
        with trio.fail_after(30):
            while True:
                res = await self.residency()
                if pred(res):
                    return res
                await trio.sleep(0.05)

    async def stop(self) -> tuple[int, str]:
        await self.http.aclose()
        self.proc.send_signal(signal.SIGTERM)
        assert self.proc.stderr is not None
        out = b""
        with trio.fail_after(30):
            while chunk := await self.proc.stderr.receive_some():
                out += chunk
            code = await self.proc.wait()
        return code, out.decode()


async def serve(model: Path, *extra: str, preexec: Any = None) -> Server:
    proc = await trio.lowlevel.open_process(
        [*SERVE, "-m", str(model), *extra], stderr=subprocess.PIPE, preexec_fn=preexec
    )
    url, _ = await wait_ready(proc, 90)
    return Server(proc, url)


# -- SIGKILL storms ----------------------------------------------------------------------


async def test_random_sigkills_of_holders_and_waiters_under_alternating_load(
    tiny_model: Path, tmp_path: Path
) -> None:
    """Two servers answer alternating requests without pause while, N times, a
    reference-fork stand-in joins the arena and is SIGKILLed at a random moment:
    while it waits (registered on want.lock) or while it holds the token.
    A third trio-llm server is SIGKILLed while it waits for the token at load (or,
    if it got the token between two requests, once loaded), and a fourth while it
    holds the token mid-generation. Every survivor request is answered (0 failed),
    and afterwards nobody is stranded: a fresh process gets the token, and both
    servers serve again."""
    rng = random.Random(17)
    a = await serve(tiny_model, "--vram-arena", str(tmp_path))
    b = await serve(tiny_model, "--vram-arena", str(tmp_path), "--no-warmup")
    answered: list[int] = []
    failures: list[str] = []
    stop_load = trio.Event()

    async def load() -> None:
        i = 0
        while not stop_load.is_set():
            s = (a, b)[i % 2]
            i += 1
            try:
                r = await s.http.post("/completion", json={"prompt": f"request {i}", "n_predict": 3})
                (answered if r.status_code == 200 else failures).append(r.status_code)
            except httpx.HTTPError as exc:
                failures.append(repr(exc))

    killed = {"waiting": 0, "token": 0}
    async with trio.open_nursery() as nursery:
        nursery.start_soon(load)
        for n in range(12):
            victim = subprocess.Popen(
                [*STANDIN, "--arena", str(tmp_path), "--hold", str(rng.uniform(0.05, 0.4))],
                stdout=subprocess.PIPE, text=True,
            )
            assert victim.stdout is not None
            # even rounds: killed while waiting (at a random moment after it
            # registered); odd: killed while holding the token
            want = "waiting" if n % 2 == 0 else "token"
            line = ""
            with trio.fail_after(30):
                while line != want:
                    line = (await trio.to_thread.run_sync(victim.stdout.readline)).strip()
                    assert line, "the stand-in ended early"
            await trio.sleep(rng.uniform(0.0, 0.1))
            victim.kill()
            await trio.to_thread.run_sync(victim.wait)
            killed[want] += 1
            await trio.sleep(rng.uniform(0.0, 0.2))
        # a trio-llm waiter killed while it waits for the token at load (the two
        # servers keep it busy): nothing of it stays registered
        d = await trio.lowlevel.open_process(
            [*SERVE, "-m", str(tiny_model), "--vram-arena", str(tmp_path), "--no-warmup"],
            stderr=subprocess.PIPE,
        )
        assert d.stderr is not None
        seen = b""
        with trio.fail_after(60):
            while b"waiting for the GPU token" not in seen and b"trio-llm: ready" not in seen:
                chunk = await d.stderr.receive_some()
                assert chunk, seen.decode()
                seen += chunk
        d.kill()
        await d.wait()
        killed["server"] = 1
        # a trio-llm holder killed mid-generation: the others go on
        c = await serve(tiny_model, "--vram-arena", str(tmp_path), "--no-warmup")
        long = {"prompt": "a long answer", "n_predict": 2000, "ignore_eos": True}

        async def doomed() -> None:
            try:
                await c.http.post("/completion", json=long)
            except httpx.HTTPError:
                pass

        nursery.start_soon(doomed)
        await c.until(lambda r: r["token_held"])
        c.proc.kill()
        await c.proc.wait()
        await c.http.aclose()
        n_before = len(answered)
        with trio.fail_after(30):
            while len(answered) < n_before + 4:
                await trio.sleep(0.05)
        stop_load.set()
    assert killed == {"waiting": 6, "token": 6, "server": 1}
    assert failures == [] and len(answered) >= 10, (failures, len(answered))
    # nobody stranded: an outsider gets the token (the servers yield once idle)...
    outsider = subprocess.Popen([*STANDIN, "--arena", str(tmp_path), "--hold", "0"], stdout=subprocess.PIPE, text=True)
    assert outsider.stdout is not None
    with trio.fail_after(30):
        assert (await trio.to_thread.run_sync(outsider.stdout.readline)).strip() == "waiting"
        assert (await trio.to_thread.run_sync(outsider.stdout.readline)).strip() == "token"
        assert await trio.to_thread.run_sync(outsider.wait) == 0
    # ...and both servers serve again
    for s in (a, b):
        r = await s.http.post("/completion", json={"prompt": "after", "n_predict": 2})
        assert r.status_code == 200, r.text
    for s in (a, b):
        code, log = await s.stop()
        assert code == 0 and "Traceback" not in log, log


# -- a restore that fails midway ----------------------------------------------------------------


@contextmanager
def restore_fails_midway(error: Exception) -> Iterator[list[int]]:
    """Make the numpy backend's restore stop midway once: the weights are back (a
    reload for level unload), the KV cache is not, and ``error`` is raised, as a
    device running out of memory between the two would."""
    original = NumpyBackend.restore
    calls: list[int] = []

    def failing(self: NumpyBackend) -> None:
        calls.append(1)
        if len(calls) == 1:
            if self._weights is None:
                self._weights = self._reload()
            raise error
        original(self)

    NumpyBackend.restore = failing  # type: ignore[method-assign]
    try:
        yield calls
    finally:
        NumpyBackend.restore = original  # type: ignore[method-assign]


@pytest.mark.parametrize(
    ("level", "error"),
    [("weights", DeviceOutOfMemory("injected: out of device memory for the KV cache")),
     ("all", DeviceOutOfMemory("injected: out of device memory for the KV cache")),
     ("unload", OSError(errno.ENOMEM, "injected: Cannot allocate memory"))],
)
async def test_a_restore_failing_midway_at_every_level(
    start: Start, tmp_path: Path, level: str, error: Exception
) -> None:
    """The request waiting for the wake gets a 500 that names the failure; the token
    goes back (another process may use the GPU); the server keeps serving and the
    next request wakes it for real, answering exactly what it answered before."""
    h = await start(parallel=1, sleep_mode=level, vram_arena=tmp_path / "arena")
    body = {"prompt": "The quick brown fox", "n_predict": 6, "return_tokens": True}
    outsider = await open_arbiter(tmp_path / "arena")
    async with client(h) as c:
        before = (await c.post("/completion", json=body)).json()
        assert (await c.post("/sleep")).status_code == 200
        with restore_fails_midway(error) as calls:
            r = await c.post("/completion", json=body)
            assert r.status_code == 500, r.text
            message = r.json()["error"]["message"]
            assert "could not be made resident" in message and "injected" in message
            res = (await c.get("/props")).json()["residency"]
            assert res["state"] in ("cold", "unloaded") and not res["token_held"]
            outsider.take_nowait()  # the GPU is free for others meanwhile
            outsider.give_back()
            assert (await c.get("/health")).status_code == 200
            again = (await c.post("/completion", json=body)).json()
            assert len(calls) == 2
        assert again["content"] == before["content"] and again["tokens"] == before["tokens"]
        res = (await c.get("/props")).json()["residency"]
        assert res["state"] == "resident" and res["token_held"] and res["cycles"]["failures"] == 1
    outsider.close()


# -- the arena removed under a running server -------------------------------------------------


async def test_an_arena_removed_under_a_running_server(tiny_model: Path, tmp_path: Path) -> None:
    """``rm -rf`` of the arena: the server's locks are now on files nobody else can
    see. It notices at its next probe (idle), yields, re-creates the arena and
    serves on; a server started on the path afterwards coordinates with it (never
    both resident)."""
    arena = tmp_path / "arena"
    a = await serve(tiny_model, "--vram-arena", str(arena))
    assert (await a.http.post("/completion", json={"prompt": "hi", "n_predict": 2})).status_code == 200
    shutil.rmtree(arena)
    await a.until(lambda r: not r["token_held"] and r["state"] == "cold")
    assert (arena / TOKEN_FILE).exists()  # re-created
    assert (await a.http.post("/completion", json={"prompt": "hi", "n_predict": 2})).status_code == 200
    b = await serve(tiny_model, "--vram-arena", str(arena), "--no-warmup")  # A (idle) yields to B's load
    res_a, res_b = await a.residency(), await b.residency()
    assert res_b["token_held"] and not res_a["token_held"]
    for s in (a, b):
        r = await s.http.post("/completion", json={"prompt": "again", "n_predict": 2})
        assert r.status_code == 200
        res_a, res_b = await a.residency(), await b.residency()
        assert not (res_a["token_held"] and res_b["token_held"])
    logs = []
    for s in (a, b):
        code, log = await s.stop()
        assert code == 0 and "Traceback" not in log, log
        logs.append(log)
    assert "were removed or replaced" in logs[0] and "were removed or replaced" not in logs[1]


# -- a full disk under slot saves -------------------------------------------------------------


async def _full_disk_checks(s: Server, folder: Path, expect: str) -> None:
    """A small save fits; a big one fails with a 500 naming the cause; the old file
    of that name is intact, no temporary is left, and the server serves on."""
    small = {"prompt": "Hi", "n_predict": 1, "id_slot": 0}
    r = await s.http.post("/completion", json=small)
    assert r.status_code == 200
    r = await s.http.post("/slots/0?action=save", json={"filename": "s.bin"})
    assert r.status_code == 200, r.text
    saved = (folder / "s.bin").read_bytes()
    big = {"prompt": "many words " * 150, "n_predict": 1, "id_slot": 0}
    assert (await s.http.post("/completion", json=big)).status_code == 200
    r = await s.http.post("/slots/0?action=save", json={"filename": "s.bin"})
    assert r.status_code == 500, r.text
    assert expect in r.json()["error"]["message"] and "s.bin" in r.json()["error"]["message"]
    assert (folder / "s.bin").read_bytes() == saved
    assert sorted(p.name for p in folder.iterdir()) == ["s.bin"]  # no temporary left
    r = await s.http.post("/slots/0?action=restore", json={"filename": "s.bin"})
    assert r.status_code == 200 and r.json()["n_restored"] > 0
    assert (await s.http.post("/completion", json=small)).status_code == 200


def _limit_file_size() -> None:
    # in the server process only: no file it writes may pass 64 KiB (Python ignores
    # SIGXFSZ, so a write past it fails with EFBIG instead of killing the process)
    resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, 64 * 1024))


async def test_a_full_disk_for_slot_saves_rlimit_fsize(tiny_model: Path, tmp_path: Path) -> None:
    """The full disk that needs no privilege: RLIMIT_FSIZE on the server process
    (the kernel refuses the write past the limit, as a full file system does, with
    EFBIG instead of ENOSPC). Runs everywhere, root or not."""
    folder = tmp_path / "slots"
    folder.mkdir()
    s = await serve(tiny_model, "-c", "2048", "--slot-save-path", str(folder), preexec=_limit_file_size)
    await _full_disk_checks(s, folder, "File too large")
    code, log = await s.stop()
    assert code == 0 and "Traceback" not in log, log


@contextmanager
def small_tmpfs(where: Path, size: str) -> Iterator[Path]:
    where.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(where)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({r.stderr.strip() or 'not root'}); the RLIMIT_FSIZE test covers it")
    try:
        yield where
    finally:
        subprocess.run(["umount", str(where)], check=True)


async def test_a_full_disk_for_slot_saves_tmpfs(tiny_model: Path, tmp_path: Path) -> None:
    """A real full file system (ENOSPC): a 64 KiB tmpfs as --slot-save-path (needs
    root, as CI and this machine have; skipped elsewhere)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root; the RLIMIT_FSIZE test covers it")
    with small_tmpfs(tmp_path / "small", "64k") as folder:
        s = await serve(tiny_model, "-c", "2048", "--slot-save-path", str(folder))
        try:
            await _full_disk_checks(s, folder, "No space left on device")
        finally:
            code, log = await s.stop()
        assert code == 0 and "Traceback" not in log, log


# -- co-residency (issue 16): a SIGKILL storm beside two co-residents ---------------------------


async def test_random_sigkills_of_coresidents_and_queued_waiters(tiny_model: Path, tmp_path: Path) -> None:
    """a and b (8.2 MiB each) are co-resident under an 18 MiB budget and answer
    alternating requests without pause. N times another co-resident-capable process
    (the real ``Arbiter``) joins and is SIGKILLed at a random moment: a small one that
    fits beside both (killed while holding), or one of 9 MiB that fits only once the
    least recently used of a and b has yielded (a budget yield, within one short
    request: it is usually holding when killed, its ticket and member file both dead
    then; a SIGKILL while queued is ``test_arena_budget``'s). Every request is
    answered (0 failed); afterwards the ledger holds exactly the live members, and the
    stand-in still gets the whole GPU. Measured here: 10 children, 10 budget yields."""
    from test_arena_budget import CHILD, SRC

    rng = random.Random(16)
    budget = ("--vram-arena", str(tmp_path), "--arena-budget", "18", "-c", "512")
    a = await serve(tiny_model, *budget)
    b = await serve(tiny_model, *budget, "--no-warmup")
    answered: list[int] = []
    failures: list[str] = []
    stop_load = trio.Event()

    async def load() -> None:
        i = 0
        while not stop_load.is_set():
            s = (a, b)[i % 2]
            i += 1
            try:
                r = await s.http.post("/completion", json={"prompt": f"request {i}", "n_predict": 3})
                (answered if r.status_code == 200 else failures).append(r.status_code)
            except httpx.HTTPError as exc:
                failures.append(repr(exc))

    seen: dict[str, int] = {}
    async with trio.open_nursery() as nursery:
        nursery.start_soon(load)
        for n in range(10):
            mib = "1" if n % 2 == 0 else "9"
            child = await trio.lowlevel.open_process(
                [sys.executable, "-c", CHILD, str(tmp_path), mib, "-"],
                stdout=subprocess.PIPE, env={**os.environ, "PYTHONPATH": SRC},
            )
            assert child.stdout is not None
            with trio.fail_after(30):
                line = (await child.stdout.receive_some()).decode().strip()
            seen[f"{mib} MiB {line}"] = seen.get(f"{mib} MiB {line}", 0) + 1
            if n == 1:
                # the first 9 MiB one is killed only once a or b has yielded for it (on a
                # slow or cold machine every random moment below can fall before the
                # yield, and the storm would then never show one): the others at random
                with trio.fail_after(30):
                    while sum([(await s.residency())["cycles"]["budget_yields"] for s in (a, b)]) == 0:
                        await trio.sleep(0.02)
            await trio.sleep(rng.uniform(0.0, 0.3))
            child.send_signal(signal.SIGKILL)
            await child.wait()
            await trio.sleep(rng.uniform(0.0, 0.2))
        n_before = len(answered)
        with trio.fail_after(30):
            while len(answered) < n_before + 4:
                await trio.sleep(0.05)
        stop_load.set()
    # the small ones fit beside both (holding within 50 ms, unless a member that made
    # room for the previous child was rejoining ahead of them: queued a moment)
    assert sum(seen.values()) == 10 and set(seen) <= {f"{m} MiB {w}" for m in (1, 9) for w in ("holding", "queued")}, seen
    assert failures == [] and len(answered) >= 10, (failures, len(answered))
    for s in (a, b):
        r = await s.http.post("/completion", json={"prompt": "after", "n_predict": 2})
        assert r.status_code == 200, r.text
    made_room = sum([(await s.residency())["cycles"]["budget_yields"] for s in (a, b)])
    print("children:", seen, "budget yields of a and b:", made_room)
    assert made_room >= 1  # the 9 MiB ones did make the least recently used yield
    # the ledger: a and b only (the dead members' files removed by whoever read next)
    members = sorted(n for n in os.listdir(tmp_path / "ledger") if n.endswith(".member"))
    assert sorted(n.split("-")[0] for n in members) == sorted(str(s.proc.pid) for s in (a, b)), members
    # nobody stranded: the stand-in (exclusive) gets the token once both yield
    outsider = subprocess.Popen([*STANDIN, "--arena", str(tmp_path), "--hold", "0"], stdout=subprocess.PIPE, text=True)
    assert outsider.stdout is not None
    with trio.fail_after(30):
        assert (await trio.to_thread.run_sync(outsider.stdout.readline)).strip() == "waiting"
        assert (await trio.to_thread.run_sync(outsider.stdout.readline)).strip() == "token"
        assert await trio.to_thread.run_sync(outsider.wait) == 0
    for s in (a, b):
        code, log = await s.stop()
        assert code == 0 and "Traceback" not in log, log

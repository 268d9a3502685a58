"""``trio-llm scenario``: run a scripted contention scenario against real servers.

The runner starts each scenario server as its own ``trio-llm serve`` process (own
session, so one ``killpg`` ends it and anything it spawned) on a free loopback
port, all arena servers sharing one arena directory in a temporary folder. It
talks to them over HTTP only and imports nothing of the server, so it measures
what a client sees. Tasks:

- one poller per server: ``GET /props`` every ``poll_interval_s`` into the record;
- one watcher per process: records its exit and whether we caused it;
- the script: phases of steps (requests, pauses, signals, restarts), bounded by
  the scenario's timeout and request budget;
- one task per request, in their own nursery so the script can wait for some and
  the end of the run can cancel the rest.

Invariant: every process the runner started is gone when ``run_scenario`` returns
or raises (Ctrl-C included): the last cleanup runs shielded, bounded, and ends
with SIGKILL to each process group.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import math
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs
import httpx
import trio

from trio_llm.errors import ScenarioError, TrioLLMError
from trio_llm.scenario import format as fmt
from trio_llm.scenario import record as rec
from trio_llm.scenario.client import ask_plain, ask_stream
from trio_llm.scenario.format import Scenario, ServerSpec, Step
from trio_llm.scenario.servers import ServerSlot, default_model_dir, ensure_model, free_port, tail

#: where shipped scenarios live, for `trio-llm scenario run alternating`
SHIPPED = Path(__file__).resolve().parents[3] / "scenarios"


@attrs.frozen
class Options:
    out: Path
    full: bool = False
    length: int | None = None  # overrides the scenario's short/full length
    backend: str | None = None  # overrides the scenario's backend
    model_dir: Path | None = None  # where synthetic models are kept between runs
    model: str | None = None  # PRESET:QUANT or a GGUF path for every server (H200 runs)
    verbose: bool = True
    #: how the reference answers are made: "distinct" asks one plain server per model each
    #: distinct prompt once (sorted, so shared prefixes follow each other); "replay" gives
    #: each scenario server a plain twin that is sent that server's answered requests in
    #: the order they were sent, so its prompt cache, and so every prefill's batch shape,
    #: is the run's. On a CPU (numpy, lavapipe) both give the same answers; on a GPU a
    #: different prefix split changes the rounding and can flip a near-tie (llama-server
    #: documents the same of cache_prompt), so GPU runs compare with "replay"
    reference: str = "distinct"


class _Bound(Exception):
    """The script hit its request budget; the run stops there and says so."""


@attrs.define(eq=False)
class Runner:
    scenario: Scenario
    options: Options
    record: rec.Record
    length: int
    backend: str
    _arena: Path
    _servers: dict[str, ServerSlot] = attrs.field(factory=dict)
    _t0: float = 0.0
    _bg: trio.Nursery | None = None
    _reqs: trio.Nursery | None = None
    _pending: dict[int, trio.Event] = attrs.field(factory=dict)

    # --- helpers ------------------------------------------------------------------

    def now(self) -> float:
        return trio.current_time() - self._t0

    def say(self, text: str) -> None:
        if self.options.verbose:
            print(f"[{self.now():7.2f}s] {text}", flush=True)

    def check(self, server: str, ok: bool, detail: str) -> None:
        self.record.events.append(rec.Event(self.now(), server, "check", detail, ok=ok))
        if not ok:
            self.say(f"FAILED: {server}: {detail}")

    # --- processes ----------------------------------------------------------------

    async def start_server(self, server: ServerSlot, timeout_s: float) -> None:
        """Start the process and wait until /health answers 200 (a cold server does too)."""
        server.port = free_port()
        await server.new_client()
        server.exited = trio.Event()
        server.exit_cause = None
        server.status = "starting"
        cmd = server.command()
        with server.log_path.open("ab") as log:
            log.write(f"\n=== {datetime.datetime.now().isoformat()} {' '.join(cmd)}\n".encode())
            log.flush()
            env = {k: v for k, v in os.environ.items() if k != "LLAMA_VRAM_ARENA"}
            env["PYTHONUNBUFFERED"] = "1"
            try:
                process = await trio.lowlevel.open_process(
                    cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True, env=env,
                )
            except OSError as exc:
                raise ScenarioError(f"cannot start server {server.spec.name}: {exc}") from exc
        server.process = process
        for info in self.record.servers:
            if info["name"] == server.spec.name:
                info["ports"].append(server.port)
                info["command"] = cmd[1:]
        self.record.events.append(
            rec.Event(self.now(), server.spec.name, "start", f"pid {process.pid} port {server.port}")
        )
        assert self._bg is not None
        self._bg.start_soon(self._watch, server, process)
        self.say(f"{server.spec.name}: started pid {process.pid} on port {server.port}")
        with trio.move_on_after(timeout_s):
            while not server.exited.is_set():
                try:
                    response = await server.http.get(f"{server.url}/health", timeout=2.0)
                    if response.status_code == 200:
                        server.status = "up"
                        self.record.events.append(rec.Event(self.now(), server.spec.name, "healthy"))
                        self.say(f"{server.spec.name}: healthy")
                        return
                except httpx.HTTPError:
                    pass
                await trio.sleep(0.05)
        log_tail = tail(server.log_path)
        if server.exited.is_set():
            raise ScenarioError(
                f"server {server.spec.name} exited with {process.returncode} while starting "
                f"(log: {server.log_path}):\n{log_tail}"
            )
        raise ScenarioError(
            f"server {server.spec.name} not healthy within {timeout_s:g} s "
            f"(log: {server.log_path}):\n{log_tail}"
        )

    async def _watch(self, server: ServerSlot, process: trio.Process) -> None:
        code = await process.wait()
        cause = server.exit_cause or "unexpected"
        self.record.events.append(rec.Event(self.now(), server.spec.name, "exit", code=code, cause=cause))
        if server.process is process:
            server.status = "down"
            server.note_state("down")
        server.exited.set()
        self.say(f"{server.spec.name}: exited with {code} ({cause})")

    def _signal(self, server: ServerSlot, sig: signal.Signals, cause: str = "step") -> None:
        process = server.process
        if process is None or process.returncode is not None:
            return
        self.record.events.append(
            rec.Event(self.now(), server.spec.name, "signal", sig.name, cause=cause)
        )
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            pass

    async def stop_server(
        self, server: ServerSlot, cause: str, within_s: float, *, hang_up: bool = False
    ) -> int | None:
        """SIGTERM (thawing a frozen process so it can act on it) and wait; SIGKILL
        if it has not exited within ``within_s``. Returns the exit code, None if it
        had to be killed.

        With ``hang_up`` the runner first closes its connections to the server, as a
        client that is done with it would. Without it (the ``term`` step) the idle
        keep-alive connections stay open, as a proxy such as llama-swap keeps them,
        and a server that waits for them to close before exiting is caught."""
        if server.status == "down":
            return server.process.returncode if server.process else None
        if hang_up:
            server.quiet = True
            async with server.poll_lock:
                await server.close_client()
        server.exit_cause = cause
        self._signal(server, signal.SIGTERM, cause)
        frozen = server.status == "frozen"
        server.status = "stopping"
        if frozen:
            self._signal(server, signal.SIGCONT, cause)
        with trio.move_on_after(within_s):
            await server.exited.wait()
            assert server.process is not None
            return server.process.returncode
        server.exit_cause = f"{cause} (killed after {within_s:g} s)"
        self._signal(server, signal.SIGKILL, cause)
        with trio.move_on_after(5.0):
            await server.exited.wait()
        return None

    async def kill_all(self) -> None:
        """The last resort: SIGKILL every process group still alive and reap it."""
        for server in self._servers.values():
            process = server.process
            if process is not None and process.returncode is None:
                if server.exit_cause is None:
                    server.exit_cause = "cleanup"
                try:
                    os.killpg(process.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                with trio.move_on_after(5.0):
                    await process.wait()
            await server.close_client()

    # --- observation --------------------------------------------------------------

    async def poll(self, server: ServerSlot) -> None:
        """Observe one server's residency for the whole run (a deliberate poll: the
        server publishes no events, and a client-side view is what we measure)."""
        interval = self.scenario.poll_interval_s
        while True:
            tick = trio.current_time()
            sent = self.now()
            async with server.poll_lock:
                if server.status in ("up", "starting", "stopping") and not server.quiet:
                    try:
                        response = await server.http.get(f"{server.url}/props", timeout=1.0)
                        recv = self.now()
                        if response.status_code == 200:
                            self._note_props(server, sent, recv, response.json())
                        else:
                            self._note(server, sent, recv, "loading")
                    except (httpx.HTTPError, ValueError):
                        label = {"up": "unreachable"}.get(server.status, server.status)
                        self._note(server, sent, self.now(), label)
                else:
                    self._note(server, sent, sent, server.status)
            await trio.sleep_until(tick + interval)

    def _note(self, server: ServerSlot, sent: float, recv: float, state: str, **kw: Any) -> None:
        if self.record.add_poll(server.spec.name, sent, recv, state, **kw):
            server.note_state(state)

    def _note_props(self, server: ServerSlot, sent: float, recv: float, props: Any) -> None:
        if not isinstance(props, dict):
            self._note(server, sent, recv, "unreachable")
            return
        residency = props.get("residency")
        if not isinstance(residency, dict):
            # a server without residency reporting is resident whenever it answers
            self._note(server, sent, recv, "asleep" if props.get("is_sleeping") else "resident")
            return
        # the brief's shape is device_bytes.total; the server also reports
        # device_bytes_total beside a per-kind dict: take whichever is there
        device = residency.get("device_bytes")
        total = residency.get("device_bytes_total")
        if total is None and isinstance(device, dict):
            parts = [v for v in device.values() if isinstance(v, int | float)]
            total = device.get("total", sum(parts) if parts else None)
        self._note(
            server, sent, recv, str(residency.get("state", "resident")),
            level=residency.get("level"),
            device_bytes=int(total) if isinstance(total, int | float) else None,
            token_held=residency.get("token_held"),
        )

    # --- requests -----------------------------------------------------------------

    def launch(self, step: Step, step_name: str, rnd: int, server_name: str, index: int) -> trio.Event:
        """Send one request in the background; returns the event set when it ends."""
        if len(self.record.requests) >= self.scenario.max_requests:
            raise _Bound(f"request budget of {self.scenario.max_requests} reached")
        server = self._servers[server_name]
        prompt = step.prompt.format(round=rnd, server=server_name, i=index)
        r = rec.RequestRecord(
            id=len(self.record.requests),
            step=step_name,
            round=rnd,
            server=server_name,
            model_key=server.spec.model_key,
            arena=server.spec.arena,
            endpoint=step.endpoint,
            prompt=prompt,
            n_predict=step.full_n_predict if self.options.full and step.full_n_predict else step.n_predict,
            stream=step.stream,
            expect_ok=step.expect_ok,
            expect_content=step.expect_content,
            sent=self.now(),
            ignore_eos=step.ignore_eos,
        )
        self.record.requests.append(r)
        done = trio.Event()
        first = trio.Event()
        self._pending[r.id] = done
        assert self._reqs is not None
        timeout = step.timeout_s or self.scenario.request_timeout_s
        self._reqs.start_soon(self._request, server, r, timeout, first, done)
        return first if step.wait == "first_token" else done

    async def _request(
        self, server: ServerSlot, r: rec.RequestRecord, timeout: float, first: trio.Event, done: trio.Event
    ) -> None:
        try:
            with trio.move_on_after(timeout):
                try:
                    if r.stream:
                        await ask_stream(server.http, server.url, r, self.now, first)
                    else:
                        await ask_plain(server.http, server.url, r)
                except httpx.HTTPError as exc:
                    r.outcome, r.error = "error", f"{type(exc).__name__}: {exc}"
                except (ValueError, KeyError, TypeError, IndexError) as exc:
                    r.outcome, r.error = "error", f"bad response: {exc!r}"
                r.done = self.now()
                return
            r.outcome, r.error = "timeout", f"no answer within {timeout:g} s"
        except trio.Cancelled:
            if r.outcome == "pending":
                r.outcome, r.error = "cancelled", "still in flight when the run ended"
            raise
        finally:
            if r.outcome != "ok" and r.outcome != "pending" and self.options.verbose:
                self.say(f"request {r.id} to {r.server}: {r.outcome}: {r.error}")
            first.set()
            done.set()
            self._pending.pop(r.id, None)

    # --- the script -----------------------------------------------------------------

    async def script(self) -> None:
        for pi, phase in enumerate(self.scenario.phases):
            rounds = phase.repeat.resolve(self.length)
            if rounds and self.options.verbose:
                self.say(f"phase {phase.name!r}: {rounds} round(s)")
            for rnd in range(rounds):
                round_start = trio.current_time()
                for si, step in enumerate(phase.steps):
                    if step.at is not None:
                        await trio.sleep_until(round_start + step.at)
                    elif step.delay:
                        await trio.sleep(step.delay)
                    await self.do_step(step, step.id or f"phase[{pi}].step[{si}]", rnd)

    async def do_step(self, step: Step, name: str, rnd: int) -> None:
        action = step.action
        if action == "request":
            assert step.server is not None
            events = [self.launch(step, name, rnd, step.server, i) for i in range(step.parallel)]
            if step.wait != "sent":
                for event in events:
                    await event.wait()
        elif action == "random":
            await self._random(step, name, rnd)
        elif action == "sleep":
            await trio.sleep(step.seconds)
        elif action == "wait_requests":
            with trio.move_on_after(step.timeout_s or float("inf")) as scope:
                for event in list(self._pending.values()):
                    await event.wait()
            if scope.cancelled_caught:
                self.check("-", False, f"{name}: requests still in flight after {step.timeout_s:g} s")
        elif action == "wait_state":
            await self._wait_state(step, name)
        elif action == "fork":
            await self._fork(step, name)
        else:
            await self._fault(step, name)

    async def _fork(self, step: Step, name: str) -> None:
        """The reference fork's stand-in (``scenario/standin.py``: plain flock, no HTTP)
        takes the arena token, holds it ``hold_s`` and exits. Two checks: it got the
        token within ``timeout_s``, and while it held it no arena server was seen with
        resident (every poll wholly inside the hold read cold or unloaded). Runs
        in the request nursery, so ``wait_requests`` and the drain wait for it; the
        step returns once it registered (``wait = "sent"``) or once it is done."""
        assert self._reqs is not None
        key = -1 - sum(1 for e in self.record.events if e.kind == "fork" and e.detail == "start")
        done, registered = trio.Event(), trio.Event()
        self._pending[key] = done
        self.record.events.append(rec.Event(self.now(), "fork", "fork", "start"))
        self.say(f"{name}: fork stand-in")
        self._reqs.start_soon(self._run_fork, step, name, key, done, registered)
        await (registered if step.wait == "sent" else done).wait()

    async def _run_fork(self, step: Step, name: str, key: int, done: trio.Event,
                        registered: trio.Event) -> None:
        bound = step.timeout_s or 30.0
        args = [sys.executable, "-m", "trio_llm.scenario.standin", "--arena", str(self._arena),
                "--hold", f"{step.hold_s:g}", *(["--yield-when-wanted"] if step.yield_when_wanted else [])]
        times: dict[str, float] = {}
        proc = await trio.lowlevel.open_process(args, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                                start_new_session=True)
        try:
            assert proc.stdout is not None
            buf = b""
            with trio.move_on_after(bound + step.hold_s + 10.0):
                while "released" not in times:
                    chunk = await proc.stdout.receive_some()
                    if not chunk:
                        break
                    buf += chunk
                    while b"\n" in buf:
                        line, buf = buf.split(b"\n", 1)
                        word = line.decode(errors="replace").strip()
                        times[word] = self.now()
                        self.record.events.append(rec.Event(self.now(), "fork", "fork", word))
                        if word == "waiting":
                            registered.set()
            waited = times.get("token", math.inf) - times.get("waiting", math.inf)
            self.check("fork", waited <= bound,
                       f"{name}: the stand-in got the token after {waited:.2f} s (bound {bound:g} s)"
                       if "token" in times else f"{name}: the stand-in did not get the token")
            if "token" in times and "released" in times:
                lo, hi = times["token"], times["released"]
                seen = [f"{run.server} {run.state}" for run in self.record.runs
                        if run.state in ("resident", "restoring", "releasing")
                        and self._servers[run.server].spec.arena and run.read_within(lo, hi)]
                self.check("fork", not seen,
                           f"{name}: while the stand-in held the token ({hi - lo:.2f} s) "
                           + (f"{', '.join(sorted(set(seen)))} seen" if seen else "no arena server was resident"))
        finally:
            registered.set()
            if proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
            with trio.CancelScope(shield=True), trio.move_on_after(5.0):
                await proc.wait()
            self._pending.pop(key, None)
            done.set()

    async def _random(self, step: Step, name: str, rnd: int) -> None:
        start = trio.current_time()
        events = []
        arrivals = random_arrivals(step, self.scenario.seed, name, rnd, self.length)
        for i, (offset, target) in enumerate(arrivals):
            await trio.sleep_until(start + offset)
            events.append(self.launch(step, name, rnd, target, i))
        if step.wait != "sent":
            for event in events:
                await event.wait()

    async def _wait_state(self, step: Step, name: str) -> None:
        assert step.server is not None
        server = self._servers[step.server]
        with trio.move_on_after(step.timeout_s or 30.0):
            while server.state != step.state:
                await server.changed.wait()
            self.check(server.spec.name, True, f"{name}: reached state {step.state}")
            return
        self.check(
            server.spec.name, False,
            f"{name}: state {step.state!r} not reached within {step.timeout_s:g} s (last: {server.state})",
        )

    async def _fault(self, step: Step, name: str) -> None:
        assert step.server is not None
        server = self._servers[step.server]
        action = step.action
        self.say(f"{name}: {action} {server.spec.name}")
        if action == "restart":
            if server.status != "down":
                self.check(server.spec.name, False, f"{name}: restart asked while it still runs")
                return
            try:
                await self.start_server(server, step.timeout_s or self.scenario.startup_timeout_s)
                self.check(server.spec.name, True, f"{name}: restarted and healthy")
            except ScenarioError as exc:
                self.check(server.spec.name, False, f"{name}: {exc}")
            return
        if server.status == "down":
            self.check(server.spec.name, False, f"{name}: {action} asked but it is not running")
            return
        if action == "kill":
            server.exit_cause = "kill"
            self._signal(server, signal.SIGKILL)
            with trio.move_on_after(10.0):
                await server.exited.wait()
        elif action == "stop":
            self._signal(server, signal.SIGSTOP)
            server.status = "frozen"
        elif action == "cont":
            self._signal(server, signal.SIGCONT)
            server.status = "up"
        elif action == "term":
            started = trio.current_time()
            state = server.state
            code = await self.stop_server(server, "term", step.within_s, hang_up=step.hang_up)
            took = trio.current_time() - started
            ok = code == step.expect_exit
            conns = "runner hung up first" if step.hang_up else "idle keep-alive connections open"
            self.check(
                server.spec.name, ok,
                f"{name}: SIGTERM while {state} ({conns}) → exit "
                f"{code if code is not None else 'none (killed)'} after {took:.2f} s "
                f"(expected {step.expect_exit} within {step.within_s:g} s)",
            )

    async def drain(self) -> None:
        """After the script: let requests still in flight finish, within their timeouts."""
        for event in list(self._pending.values()):
            await event.wait()

    # --- reference answers ------------------------------------------------------------

    async def references(self, deadline_s: float) -> None:
        """The reference answers, as ``Options.reference`` says."""
        if self.options.reference == "replay":
            await self.replay_references(deadline_s)
        else:
            await self.distinct_references(deadline_s)

    async def replay_references(self, deadline_s: float) -> None:
        """Each scenario server's answered requests, in the order they were sent, to a
        plain twin of it: references by request id."""
        by_server: dict[str, list[rec.RequestRecord]] = {}
        for r in sorted(self.record.requests, key=lambda r: r.sent):
            if r.outcome == "ok":
                by_server.setdefault(r.server, []).append(r)
        for name, reqs in by_server.items():
            asks = [(r.model_key, r.endpoint, r.prompt, r.n_predict, r.ignore_eos, r.id) for r in reqs]
            await self._ask_twin(self._servers[name], asks, deadline_s)

    async def distinct_references(self, deadline_s: float) -> None:
        """Each distinct prompt once, per model, to a plain twin of one of its servers."""
        wanted: dict[str, dict[tuple[str, str, str, int, bool], None]] = {}
        for r in self.record.requests:
            if r.outcome == "ok":
                wanted.setdefault(r.model_key, {})[r.reference_key()] = None
        for model_key, prompts in wanted.items():
            base = next(s for s in list(self._servers.values()) if s.spec.model_key == model_key)
            # sorted, so prompts sharing a prefix follow each other and the single
            # slot's prompt cache does the work it can
            asks = [(*key, None) for key in sorted(prompts, key=lambda k: k[2])]
            await self._ask_twin(base, asks, deadline_s)

    async def _ask_twin(self, base: ServerSlot, asks: Sequence[tuple[str, str, str, int, bool, int | None]],
                        deadline_s: float) -> None:
        """Start a plain twin of ``base`` (no arena, no sleep, one slot), ask it each
        (model key, endpoint, prompt, n_predict, ignore_eos, request id) in order, one at
        a time, into ``record.references``, and stop it."""
        spec = base.spec
        ref = ServerSlot(
            spec=attrs.evolve(spec, name=f"reference-{spec.name}", arena=False,
                              sleep_idle_seconds=None, np=1, args=without_arena_flags(spec.args)),
            model_path=base.model_path, backend=base.backend, arena=self._arena,
            log_path=base.log_path.with_name(f"reference-{spec.name}.log"),
        )
        self._servers[ref.spec.name] = ref
        self.record.servers.append({**_server_info(ref), "reference": True})
        with trio.move_on_after(deadline_s):
            await self.start_server(ref, self.scenario.startup_timeout_s)
            for model_key, endpoint, prompt, n_predict, ignore_eos, request_id in asks:
                probe = rec.RequestRecord(
                    id=-1, step="reference", round=0, server=ref.spec.name,
                    model_key=model_key, arena=False, endpoint=endpoint, prompt=prompt,
                    n_predict=n_predict, stream=False, expect_ok=True, expect_content=None,
                    sent=self.now(), ignore_eos=ignore_eos,
                )
                try:
                    await ask_plain(ref.http, ref.url, probe)
                except (httpx.HTTPError, ValueError, KeyError, TypeError, IndexError) as exc:
                    probe.outcome, probe.error = "error", repr(exc)
                self.record.references.append(
                    rec.Reference(
                        model_key, endpoint, prompt, n_predict,
                        probe.content if probe.outcome == "ok" else None,
                        None if probe.outcome == "ok" else (probe.error or probe.outcome),
                        ignore_eos, request_id,
                    )
                )
        await self.stop_server(ref, "final", self.scenario.stop_timeout_s, hang_up=True)

def random_arrivals(step: Step, seed: int, name: str, rnd: int, length: int) -> list[tuple[float, str]]:
    """The (offset, server) schedule of a ``random`` step: exponential gaps of mean
    ``mean_gap_s`` and a uniformly chosen server each. A string seed is hashed with
    SHA-512 by ``random``, so a schedule depends only on the scenario's seed, the step
    and the round, and every run of a scenario sends the same requests at the same
    offsets."""
    rng = random.Random(f"{seed}/{name}/{rnd}")
    offset, schedule = 0.0, []
    for _ in range(step.count.resolve(length)):
        offset += rng.expovariate(1.0 / step.mean_gap_s)
        schedule.append((offset, rng.choice(step.servers)))
    return schedule


def _server_info(server: ServerSlot) -> dict[str, Any]:
    spec = server.spec
    return {
        "name": spec.name, "model_key": spec.model_key, "model": str(server.model_path),
        "sleep_mode": spec.sleep_mode, "sleep_idle_seconds": spec.sleep_idle_seconds,
        "arena": spec.arena, "np": spec.np, "ctx": spec.ctx, "backend": server.backend,
        "log": str(server.log_path), "command": server.command()[1:], "ports": [],
    }


# --- the run ----------------------------------------------------------------------


def new_record(scenario: Scenario, options: Options) -> rec.Record:
    """The empty record of a run: what will run, at what length, on which backend."""
    length = options.length or (scenario.full_length if options.full else scenario.length)
    timeout = scenario.full_timeout_s if options.full else scenario.timeout_s
    if options.length:
        timeout = max(scenario.timeout_s, scenario.timeout_s * options.length / scenario.length)
    return rec.Record(
        scenario={
            "name": scenario.name, "description": scenario.description,
            "source": str(scenario.source), "full": options.full, "length": length,
            "backend": options.backend or scenario.backend, "seed": scenario.seed,
            "timeout_s": timeout,
            "poll_interval_s": scenario.poll_interval_s,
            "reference": options.reference,
        },
        expect=scenario.expect,
        started_at=datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
    )


async def run_scenario(
    scenario: Scenario, options: Options, record: rec.Record | None = None
) -> rec.Record:
    """Run the scenario, filling ``record`` (a new one if None), and return it. Never
    leaves a process behind; an interrupted run leaves a partial record."""
    if record is None:
        record = new_record(scenario, options)
    length = int(record.scenario["length"])
    backend = str(record.scenario["backend"])
    timeout = float(record.scenario["timeout_s"])
    logs = options.out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    arena = Path(tempfile.mkdtemp(prefix="trio-llm-arena-"))
    runner = Runner(scenario, options, record, length, backend, arena)
    runner._t0 = trio.current_time()
    model_dir = options.model_dir or default_model_dir()
    try:
        async with trio.open_nursery() as bg:
            runner._bg = bg
            try:
                await _run_body(runner, scenario, model_dir, backend, logs, arena, timeout)
            finally:
                bg.cancel_scope.cancel()
    except BaseException as exc:
        record.interrupted = interrupted(exc)
        raise
    finally:
        with trio.CancelScope(shield=True), trio.move_on_after(20.0):
            await runner.kill_all()
        record.duration_s = runner.now()
        shutil.rmtree(arena, ignore_errors=True)
    return record


#: flags that only mean something on an arena, and the number of values each takes
_ARENA_ONLY = {"--arena-budget": 1, "--arena-pin": 0, "--arena-quantum": 1, "--arena-priority": 1}


def without_arena_flags(args: Sequence[str]) -> tuple[str, ...]:
    """A server's flags for the plain reference run (no arena): ``--arena-budget`` and
    ``--arena-pin`` are refused without ``--vram-arena``, the others mean nothing there."""
    out: list[str] = []
    skip = 0
    for arg in args:
        if skip:
            skip -= 1
            continue
        name = arg.split("=", 1)[0]
        if name in _ARENA_ONLY:
            skip = _ARENA_ONLY[name] if "=" not in arg else 0
            continue
        out.append(arg)
    return tuple(out)


def with_model(spec: ServerSpec, model: str | None) -> ServerSpec:
    """``--model``: the same scenario on another model (``llama-1b:Q8_0`` on the H200)."""
    if model is None:
        return spec
    if model.endswith(".gguf"):
        return attrs.evolve(spec, model=Path(model).resolve())
    preset, _, quant = model.partition(":")
    return attrs.evolve(spec, model=None, preset=preset, quant=quant or spec.quant)


async def _run_body(
    runner: Runner, scenario: Scenario, model_dir: Path, backend: str, logs: Path,
    arena: Path, timeout: float,
) -> None:
    record = runner.record
    try:
        for spec in scenario.servers:
            spec = with_model(spec, runner.options.model)
            model = await ensure_model(spec, model_dir)
            server = ServerSlot(spec, model, spec.backend or backend, arena, logs / f"{spec.name}.log")
            runner._servers[spec.name] = server
            record.servers.append(_server_info(server))
        assert runner._bg is not None
        for server in list(runner._servers.values()):
            runner._bg.start_soon(runner.poll, server)
        # one at a time: each takes the arena token before it uploads, so starting
        # them in order makes the last one listed the resident one, every run
        for server in list(runner._servers.values()):
            await runner.start_server(server, scenario.startup_timeout_s)
        async with trio.open_nursery() as reqs:
            runner._reqs = reqs
            with trio.move_on_after(timeout) as scope:
                try:
                    await runner.script()
                except _Bound as exc:
                    record.notes.append(f"script stopped early: {exc}")
                await runner.drain()
            if scope.cancelled_caught:
                record.timed_out = True
                record.notes.append(f"the script did not finish within {timeout:g} s")
            reqs.cancel_scope.cancel()
        async with trio.open_nursery() as stops:
            for server in runner._servers.values():
                stops.start_soon(
                    functools.partial(
                        runner.stop_server, server, "final", scenario.stop_timeout_s, hang_up=True
                    )
                )
        if scenario.expect.answers_match_reference:
            runner.say("reference run")
            await runner.references(max(60.0, scenario.startup_timeout_s * 2))
    except ScenarioError as exc:
        record.notes.append(str(exc))
        runner.say(f"ERROR: {exc}")


def interrupted(exc: BaseException) -> bool:
    """Ctrl-C, possibly wrapped in the exception groups of the nurseries it crossed."""
    if isinstance(exc, BaseExceptionGroup):
        return exc.subgroup(KeyboardInterrupt) is not None
    return isinstance(exc, KeyboardInterrupt)


# --- command line -------------------------------------------------------------------


def resolve(name: str) -> Path:
    """A scenario file, or the name of a shipped one (``alternating``)."""
    path = Path(name)
    if path.is_file():
        return path
    for base in (Path.cwd() / "scenarios", SHIPPED):
        candidate = base / f"{name}.toml"
        if candidate.is_file():
            return candidate
    shipped = sorted(p.stem for p in SHIPPED.glob("*.toml")) if SHIPPED.is_dir() else []
    raise ScenarioError(
        f"{name}: no such file, nor a shipped scenario ({', '.join(shipped) or 'none found'})"
    )


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="trio-llm scenario", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run a scenario and write report.json, report.md, timeline.png")
    run.add_argument("file", help="a scenario .toml, or the name of a shipped one")
    run.add_argument("--out", type=Path, help="report folder (default: out/scenarios/NAME)")
    run.add_argument("--full", action="store_true", help="the full length instead of the short CI one")
    run.add_argument("--length", type=int, help="an explicit length (rounds, requests...)")
    run.add_argument("--backend", choices=fmt.BACKENDS, help="override the scenario's backend")
    run.add_argument("--model-dir", type=Path, help="where synthetic models are made and kept")
    run.add_argument("--model", help="run every server on this model: PRESET:QUANT or a .gguf file")
    run.add_argument("--reference", choices=("distinct", "replay"), default="distinct",
                     help="reference answers: each distinct prompt once per model (default), or each server's "
                          "requests replayed in order on a plain twin (the same prompt-cache history: GPU runs)")
    run.add_argument("-q", "--quiet", action="store_true", help="only the summary")
    check = sub.add_parser("check", help="validate scenario files")
    check.add_argument("files", nargs="+")
    report = sub.add_parser("report", help="re-render a report from its report.json")
    report.add_argument("dir", type=Path)
    sub.add_parser("list", help="list the shipped scenarios")
    return parser


def main(argv: Sequence[str]) -> int:
    args = _parser().parse_args(list(argv))
    from trio_llm.scenario.report import write as write_report

    try:
        if args.command == "list":
            for path in sorted(SHIPPED.glob("*.toml")):
                s = fmt.load(path)
                print(f"{s.name:<16} {s.description.split('. ')[0].rstrip('.')}.")
            return 0
        if args.command == "check":
            for name in args.files:
                s = fmt.load(resolve(name))
                print(f"{s.source}: ok ({len(s.servers)} servers, {len(s.phases)} phases)")
            return 0
        if args.command == "report":
            summary = write_report(rec.load(args.dir / "report.json"), args.dir)
            print(summary.text)
            return 0 if summary.passed else 1
        scenario = fmt.load(resolve(args.file))
        if args.length is not None and args.length < 1:
            raise ScenarioError("--length must be at least 1")
        out = args.out or Path("out") / "scenarios" / scenario.name
        options = Options(
            out=out, full=args.full, length=args.length, backend=args.backend,
            model_dir=args.model_dir, model=args.model, verbose=not args.quiet, reference=args.reference,
        )
        record = new_record(scenario, options)
        try:
            trio.run(run_scenario, scenario, options, record)
        except BaseException as exc:
            if not interrupted(exc):
                raise
            write_report(record, out)
            print(f"interrupted: every server process was stopped; partial report in {out}",
                  file=sys.stderr)
            return 130
        summary = write_report(record, out)
        print(summary.text)
        return 0 if summary.passed else 1
    except TrioLLMError as exc:
        print(f"trio-llm scenario: {exc}", file=sys.stderr)
        return 2

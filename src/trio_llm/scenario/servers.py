"""The scenario's view of one server: its flags, its current process, its last state.

Model files for synthetic presets are made here too (``make-model`` in a child
process, so the runner's event loop never blocks on numpy work).
"""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path

import attrs
import httpx
import trio

from trio_llm.errors import ScenarioError
from trio_llm.scenario.format import ServerSpec


@attrs.define(eq=False)
class ServerSlot:
    """One scenario server and the process currently running it (restarts replace it)."""

    spec: ServerSpec
    model_path: Path
    backend: str
    arena: Path
    log_path: Path
    port: int = 0
    process: trio.Process | None = None
    #: starting, up (answering), frozen (SIGSTOP), stopping (SIGTERM sent), down (exited)
    status: str = "down"
    #: why we expect the current process to exit, recorded with its exit code
    exit_cause: str | None = None
    exited: trio.Event = attrs.field(factory=trio.Event)
    changed: trio.Event = attrs.field(factory=trio.Event)
    state: str = "down"  # the latest residency state polled
    #: the runner has hung up on this process: no more polls
    quiet: bool = False
    #: held by a poll in flight, so hanging up never closes a pool under it
    poll_lock: trio.Lock = attrs.field(factory=trio.Lock)
    #: one connection pool per process, so hanging up on one server leaves the others
    _http: httpx.AsyncClient | None = None

    @property
    def http(self) -> httpx.AsyncClient:
        assert self._http is not None, "the server has not been started"
        return self._http

    async def new_client(self) -> None:
        await self.close_client()
        self.quiet = False
        self._http = httpx.AsyncClient(
            limits=httpx.Limits(max_connections=200, max_keepalive_connections=50)
        )

    async def close_client(self) -> None:
        if self._http is not None:
            client, self._http = self._http, None
            with trio.CancelScope(shield=True):
                await client.aclose()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        spec = self.spec
        cmd = [sys.executable, "-m", "trio_llm", "serve", "-m", str(self.model_path)]
        cmd += ["--host", "127.0.0.1", "--port", str(self.port)]
        cmd += ["-np", str(spec.np), "-c", str(spec.ctx), "--backend", self.backend]
        if spec.arena:
            cmd += ["--vram-arena", str(self.arena), "--sleep-mode", spec.sleep_mode]
        if spec.sleep_idle_seconds is not None:
            if not spec.arena:
                cmd += ["--sleep-mode", spec.sleep_mode]
            cmd += ["--sleep-idle-seconds", f"{spec.sleep_idle_seconds:g}"]
        return cmd + list(spec.args)

    def note_state(self, state: str) -> None:
        self.state = state
        self.changed.set()
        self.changed = trio.Event()


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def default_model_dir() -> Path:
    import platformdirs

    from trio_llm import __version__

    return Path(platformdirs.user_cache_dir("trio-llm")) / f"scenario-models-{__version__}"


async def ensure_model(spec: ServerSpec, model_dir: Path) -> Path:
    """The GGUF for a server: its file, or a synthetic preset made once and kept.
    Written under a temporary name and renamed, so a concurrent run never reads half a file."""
    if spec.model is not None:
        if not spec.model.is_file():
            raise ScenarioError(f"server {spec.name}: model file {spec.model} does not exist")
        return spec.model
    path = model_dir / f"{spec.preset}-{spec.quant}.gguf"
    if path.is_file():
        return path
    await trio.Path(model_dir).mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
    cmd = [sys.executable, "-m", "trio_llm", "make-model", "--preset", spec.preset,
           "--quant", spec.quant, "-o", str(partial), "-q"]
    result = await trio.run_process(cmd, check=False, capture_stdout=True, capture_stderr=True)
    if result.returncode != 0 or not partial.is_file():
        partial.unlink(missing_ok=True)
        err = result.stderr.decode(errors="replace").strip().splitlines()[-3:]
        raise ScenarioError(
            f"server {spec.name}: make-model --preset {spec.preset} --quant {spec.quant} "
            f"failed: {' / '.join(err) or result.returncode}"
        )
    partial.replace(path)
    return path

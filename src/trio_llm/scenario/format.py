"""Scenario files: TOML parsed with ``tomllib`` into frozen attrs values, validated once.

A scenario names the servers to start, a script of phases (each repeated a number
of times) whose steps send requests or inject faults, and the expectations checked
at the end. ``docs/scenarios.md`` is the reference for every key; this module is the
single place that decides what a valid file is, so the runner never meets a bad
value. Every error names the file and the key path (``phase[1].step[0].server``)
and, for a misspelt key, the closest valid one.

Validation is hand-written rather than done with a schema library: the checks that
matter here are cross-references (a step names a server, an expectation names a
step id, a prompt may only use known placeholders) that a schema cannot state, and
the project has no schema dependency to spend on the rest.
"""

from __future__ import annotations

import difflib
import re
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NoReturn

import attrs

from trio_llm.errors import ScenarioError

#: what a step may do
ACTIONS = (
    "request",  # send one or more HTTP requests to one server
    "random",  # requests at random times (fixed seed) spread over several servers
    "sleep",  # pause the script
    "wait_state",  # wait until a server's /props residency state is the given one
    "wait_requests",  # wait until the requests still in flight have finished
    "kill",  # SIGKILL
    "stop",  # SIGSTOP (freeze)
    "cont",  # SIGCONT (thaw)
    "term",  # SIGTERM, then expect an exit code within a bound
    "restart",  # start a server again after it exited
    "fork",  # the reference fork's stand-in takes the token (plain flock, no HTTP)
)
#: residency states a server reports in /props
STATES = ("resident", "releasing", "cold", "restoring", "unloaded")
SLEEP_MODES = ("unload", "weights", "all")
BACKENDS = ("numpy", "vulkan", "auto")
ENDPOINTS = ("completion", "chat")
#: how long a request step blocks the script
WAITS = ("done", "first_token", "sent")
#: placeholders a prompt may use
PLACEHOLDERS = ("round", "server", "i")

_COUNT_RE = re.compile(r"^\s*(?:(\d+)\s*\*\s*)?length\s*(?:([+-])\s*(\d+))?\s*$")


@attrs.frozen
class Count:
    """A repeat or request count: a constant, or ``k*length+c`` so that one file
    describes both the short CI run and the full one."""

    per_length: int = 0
    offset: int = 1

    def resolve(self, length: int) -> int:
        return max(0, self.per_length * length + self.offset)

    def __str__(self) -> str:
        if not self.per_length:
            return str(self.offset)
        head = "length" if self.per_length == 1 else f"{self.per_length}*length"
        return head if not self.offset else f"{head}{self.offset:+d}"


@attrs.frozen
class ServerSpec:
    name: str
    preset: str
    quant: str
    model: Path | None  # an existing GGUF file instead of a synthetic preset
    np: int
    ctx: int
    sleep_mode: str
    sleep_idle_seconds: float | None
    arena: bool  # join the scenario's arena (False: a plain, always-resident server)
    backend: str | None  # None: the scenario's (or the command line's) backend
    args: tuple[str, ...]  # extra `trio-llm serve` flags, passed as given

    @property
    def model_key(self) -> str:
        """What identifies the weights: answers are compared between equal keys."""
        return str(self.model) if self.model is not None else f"{self.preset}-{self.quant}"


@attrs.frozen
class Step:
    action: str
    id: str | None = None
    server: str | None = None
    delay: float = 0.0  # seconds after the previous step returned
    at: float | None = None  # seconds after the start of the current round
    # request / random
    prompt: str = ""
    n_predict: int = 16
    #: n_predict of a `--full` run (default: n_predict): a holder's stream that must
    #: outlast the full run's waiters on any device, where the short run's would end
    #: after a few of them on a fast GPU
    full_n_predict: int | None = None
    stream: bool = False
    ignore_eos: bool = False  # generate exactly n_predict tokens (a holder kept busy)
    endpoint: str = "completion"
    parallel: int = 1
    wait: str = "done"
    expect_ok: bool = True
    expect_content: str | None = None
    timeout_s: float | None = None  # per request, or for wait_state/wait_requests
    # random
    servers: tuple[str, ...] = ()
    count: Count = Count()
    mean_gap_s: float = 0.5
    # sleep
    seconds: float = 0.0
    # wait_state
    state: str = "cold"
    # term
    expect_exit: int = 0
    within_s: float = 10.0
    hang_up: bool = False  # term: close the runner's idle connections first
    # fork
    hold_s: float = 0.5  # how long the stand-in holds the token
    yield_when_wanted: bool = False  # it yields early to a waiter, as a resident fork does


@attrs.frozen
class Phase:
    name: str
    repeat: Count
    steps: tuple[Step, ...]


@attrs.frozen
class ServedAfter:
    """The ``waiter`` step's request is served only after ``holder``'s finished, and
    within ``max_gap_s`` of it (pairs taken round by round)."""

    waiter: str
    holder: str
    max_gap_s: float


@attrs.frozen
class StayResident:
    """Co-residency: ``servers`` read ``resident`` at every poll sent while the requests
    of ``steps`` ran (round by round: from the first sent to the last finished)."""

    servers: tuple[str, ...]
    steps: tuple[str, ...]


@attrs.frozen
class Expectations:
    all_answered: bool = True
    stranded: int = 0
    answers_match_reference: bool = False
    min_handoffs: Count | None = None
    max_handoff_s: float | None = None
    max_wait_s: float | None = None
    no_preemption_mid_decode: bool = False
    clean_exit: bool = True
    faults_as_expected: bool = True
    served_after: tuple[ServedAfter, ...] = ()
    none_before_restore: tuple[str, ...] = ()
    stay_resident: tuple[StayResident, ...] = ()


@attrs.frozen
class Scenario:
    name: str
    description: str
    source: Path
    length: int  # the short (CI) length
    full_length: int  # the length of `--full`
    seed: int
    backend: str
    timeout_s: float  # bound on the whole script, short run
    full_timeout_s: float
    max_requests: int
    poll_interval_s: float
    request_timeout_s: float
    startup_timeout_s: float
    stop_timeout_s: float
    servers: tuple[ServerSpec, ...]
    phases: tuple[Phase, ...]
    expect: Expectations

    def server(self, name: str) -> ServerSpec:
        for spec in self.servers:
            if spec.name == name:
                return spec
        raise KeyError(name)

    def steps_by_id(self) -> dict[str, Step]:
        return {s.id: s for p in self.phases for s in p.steps if s.id is not None}


def parse_count(value: object) -> Count | None:
    """An integer ≥ 0 or ``'length'``, ``'K*length'``, ``'K*length±C'``; None if neither."""
    if isinstance(value, int) and not isinstance(value, bool):
        return Count(0, value) if value >= 0 else None
    if isinstance(value, str):
        match = _COUNT_RE.match(value)
        if match:
            k = int(match.group(1) or 1)
            c = int(match.group(3) or 0) * (-1 if match.group(2) == "-" else 1)
            return Count(k, c)
        if value.strip().isdigit():
            return Count(0, int(value))
    return None


# --- reading ----------------------------------------------------------------------


class _Table:
    """A TOML table being read: typed getters that name the key path on error, and a
    final check that no key was left unread (a misspelt key is an error, not a no-op)."""

    def __init__(self, source: Path, where: str, data: Any) -> None:
        self.source = source
        self.where = where
        if not isinstance(data, Mapping):
            self.fail(f"expected a table, got {_kind(data)}")
        self.data: Mapping[str, Any] = data
        self.read: set[str] = set()

    def fail(self, problem: str, key: str | None = None) -> NoReturn:
        place = self.where if key is None else (f"{self.where}.{key}" if self.where else key)
        raise ScenarioError(f"{self.source}: {place or '(top level)'}: {problem}")

    def has(self, key: str) -> bool:
        return key in self.data

    def raw(self, key: str) -> Any:
        self.read.add(key)
        return self.data.get(key)

    def str_(self, key: str, default: str | None = None, *, choices: tuple[str, ...] = ()) -> str:
        value = self.raw(key)
        if value is None:
            if default is None:
                self.fail("is required", key)
            return default
        if not isinstance(value, str):
            self.fail(f"expected a string, got {_kind(value)}", key)
        if choices and value not in choices:
            self.fail(f"{value!r} is not one of {', '.join(choices)}", key)
        return value

    def opt_str(self, key: str) -> str | None:
        return self.str_(key) if self.has(key) else self.raw(key)

    def int_(self, key: str, default: int, *, minimum: int | None = None) -> int:
        value = self.raw(key)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, int):
            self.fail(f"expected an integer, got {_kind(value)}", key)
        if minimum is not None and value < minimum:
            self.fail(f"must be at least {minimum}, got {value}", key)
        return value

    def float_(self, key: str, default: float, *, positive: bool = False) -> float:
        value = self.opt_float(key, positive=positive)
        return default if value is None else value

    def opt_float(self, key: str, *, positive: bool = False) -> float | None:
        value = self.raw(key)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int | float):
            self.fail(f"expected a number of seconds, got {_kind(value)}", key)
        if value < 0 or (positive and value == 0):
            self.fail(f"must be {'positive' if positive else 'zero or more'}, got {value}", key)
        return float(value)

    def bool_(self, key: str, default: bool) -> bool:
        value = self.raw(key)
        if value is None:
            return default
        if not isinstance(value, bool):
            self.fail(f"expected true or false, got {_kind(value)}", key)
        return value

    def str_list(self, key: str) -> tuple[str, ...]:
        value = self.raw(key)
        if value is None:
            return ()
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            self.fail("expected a list of strings", key)
        return tuple(value)

    def count(self, key: str, default: Count | None) -> Count | None:
        value = self.raw(key)
        if value is None:
            return default
        count = parse_count(value)
        if count is not None:
            return count
        self.fail(
            f"expected an integer or 'length', 'K*length', 'K*length+C', got {value!r}", key
        )

    def tables(self, key: str) -> list[Any]:
        value = self.raw(key)
        if value is None:
            return []
        if not isinstance(value, list):
            self.fail(f"expected an array of tables ([[{key}]]), got {_kind(value)}", key)
        return value

    def done(self) -> None:
        for key in self.data:
            if key not in self.read:
                close = difflib.get_close_matches(key, list(self.read), n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                self.fail(f"unknown key{hint}", key)


def _kind(value: object) -> str:
    return {dict: "a table", list: "a list", str: "a string", bool: "a boolean"}.get(
        type(value), type(value).__name__
    )


def load(path: str | Path) -> Scenario:
    """Read and validate a scenario file. Raises ScenarioError with the place of the problem."""
    source = Path(path)
    try:
        text = source.read_text(encoding="utf-8")
    except OSError as exc:
        raise ScenarioError(f"{source}: cannot read: {exc.strerror or exc}") from exc
    return loads(text, source)


def loads(text: str, source: str | Path = "<scenario>") -> Scenario:
    source = Path(source)
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ScenarioError(f"{source}: not valid TOML: {exc}") from exc
    top = _Table(source, "", data)
    head = _Table(source, "scenario", top.raw("scenario") or {})
    name = head.str_("name", source.stem)
    description = head.str_("description", "")
    length = head.int_("length", 1, minimum=1)
    full_length = head.int_("full_length", length, minimum=1)
    timeout_s = head.float_("timeout_s", 120.0, positive=True)
    scenario_kw: dict[str, Any] = dict(
        name=name,
        description=description,
        source=source,
        length=length,
        full_length=full_length,
        seed=head.int_("seed", 0),
        backend=head.str_("backend", "auto", choices=BACKENDS),
        timeout_s=timeout_s,
        full_timeout_s=head.float_("full_timeout_s", timeout_s * full_length / length, positive=True),
        max_requests=head.int_("max_requests", 1000, minimum=1),
        poll_interval_s=head.float_("poll_interval_s", 0.02, positive=True),
        request_timeout_s=head.float_("request_timeout_s", 60.0, positive=True),
        startup_timeout_s=head.float_("startup_timeout_s", 60.0, positive=True),
        stop_timeout_s=head.float_("stop_timeout_s", 10.0, positive=True),
    )
    head.done()

    defaults = _Table(source, "defaults", top.raw("defaults") or {})
    servers = _read_servers(top, defaults, source)
    defaults.done()
    names = tuple(s.name for s in servers)
    phases = tuple(
        _read_phase(_Table(source, f"phase[{i}]", t), i, names)
        for i, t in enumerate(top.tables("phase"))
    )
    if not phases or not any(p.steps for p in phases):
        top.fail("no steps: add [[phase]] tables with [[phase.step]] entries")
    ids = _check_ids(top, phases)
    expect = _read_expect(_Table(source, "expect", top.raw("expect") or {}), ids, names)
    if expect.no_preemption_mid_decode and not any(s.stream for p in phases for s in p.steps):
        top.fail(
            "expect.no_preemption_mid_decode needs a streaming request step to watch "
            "(a plain answer shows no decode window)"
        )
    top.done()
    return Scenario(servers=servers, phases=phases, expect=expect, **scenario_kw)


def _read_servers(top: _Table, defaults: _Table, source: Path) -> tuple[ServerSpec, ...]:
    base: dict[str, Any] = dict(
        preset=defaults.str_("preset", "tiny"),
        quant=defaults.str_("quant", "Q8_0"),
        np=defaults.int_("np", 1, minimum=1),
        ctx=defaults.int_("ctx", 512, minimum=16),
        sleep_mode=defaults.str_("sleep_mode", "all", choices=SLEEP_MODES),
        sleep_idle_seconds=defaults.opt_float("sleep_idle_seconds", positive=True),
        arena=defaults.bool_("arena", True),
        args=defaults.str_list("args"),
    )
    servers: list[ServerSpec] = []
    for i, raw in enumerate(top.tables("server")):
        t = _Table(source, f"server[{i}]", raw)
        name = t.str_("name")
        if not re.fullmatch(r"[A-Za-z0-9_-]+", name):
            t.fail(f"{name!r}: use letters, digits, '-' and '_' only", "name")
        if name in (s.name for s in servers):
            t.fail(f"duplicate server name {name!r}", "name")
        model = t.opt_str("model")
        if model is not None and (t.has("preset") or t.has("quant")):
            t.fail("give either model (a GGUF file) or preset/quant, not both", "model")
        model_path = None
        if model is not None:
            model_path = Path(model)
            if not model_path.is_absolute():
                model_path = (source.parent / model_path).resolve()
        idle = t.opt_float("sleep_idle_seconds", positive=True)
        servers.append(
            ServerSpec(
                name=name,
                preset=t.str_("preset", base["preset"]),
                quant=t.str_("quant", base["quant"]),
                model=model_path,
                np=t.int_("np", base["np"], minimum=1),
                ctx=t.int_("ctx", base["ctx"], minimum=16),
                sleep_mode=t.str_("sleep_mode", base["sleep_mode"], choices=SLEEP_MODES),
                sleep_idle_seconds=idle if t.has("sleep_idle_seconds") else base["sleep_idle_seconds"],
                arena=t.bool_("arena", base["arena"]),
                backend=t.opt_str("backend"),
                args=t.str_list("args") or base["args"],
            )
        )
        if servers[-1].backend not in (None, *BACKENDS):
            t.fail(f"{servers[-1].backend!r} is not one of {', '.join(BACKENDS)}", "backend")
        t.done()
    if not servers:
        top.fail("no servers: add at least one [[server]] table with a name")
    return tuple(servers)


def _read_phase(t: _Table, index: int, servers: tuple[str, ...]) -> Phase:
    name = t.str_("name", f"phase {index}")
    repeat = t.count("repeat", Count(0, 1))
    assert repeat is not None
    steps = tuple(
        _read_step(_Table(t.source, f"{t.where}.step[{j}]", raw), servers)
        for j, raw in enumerate(t.tables("step"))
    )
    t.done()
    return Phase(name=name, repeat=repeat, steps=steps)


def _read_step(t: _Table, servers: tuple[str, ...]) -> Step:
    action = t.str_("action", "request", choices=ACTIONS)
    kw: dict[str, Any] = {"action": action, "id": t.opt_str("id")}
    kw["delay"] = t.float_("delay", 0.0)
    kw["at"] = t.opt_float("at")
    if kw["at"] is not None and t.has("delay"):
        t.fail("give either at (seconds into the round) or delay, not both", "at")

    def server() -> str:
        name = t.str_("server")
        if name not in servers:
            close = difflib.get_close_matches(name, servers, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            t.fail(f"unknown server {name!r}{hint}; servers: {', '.join(servers)}", "server")
        return name

    if action in ("request", "random"):
        if action == "request":
            kw["server"] = server()
            kw["parallel"] = t.int_("parallel", 1, minimum=1)
        else:
            kw["servers"] = t.str_list("servers")
            if not kw["servers"]:
                t.fail("is required: the servers the random requests go to", "servers")
            for name in kw["servers"]:
                if name not in servers:
                    t.fail(f"unknown server {name!r}; servers: {', '.join(servers)}", "servers")
            kw["count"] = t.count("count", Count(0, 1))
            kw["mean_gap_s"] = t.float_("mean_gap_s", 0.5, positive=True)
        kw["prompt"] = t.str_("prompt")
        try:
            kw["prompt"].format(**{p: 0 for p in PLACEHOLDERS})
        except (KeyError, IndexError, ValueError) as exc:
            t.fail(
                f"bad placeholder {exc}: a prompt may use {{{'}, {'.join(PLACEHOLDERS)}}} "
                "(write {{ and }} for literal braces)",
                "prompt",
            )
        kw["n_predict"] = t.int_("n_predict", 16, minimum=1)
        kw["full_n_predict"] = t.int_("full_n_predict", kw["n_predict"], minimum=1)
        kw["stream"] = t.bool_("stream", False)
        kw["ignore_eos"] = t.bool_("ignore_eos", False)
        kw["endpoint"] = t.str_("endpoint", "completion", choices=ENDPOINTS)
        kw["wait"] = t.str_("wait", "done", choices=WAITS)
        kw["expect_ok"] = t.bool_("expect_ok", True)
        kw["expect_content"] = t.opt_str("expect_content")
        kw["timeout_s"] = t.opt_float("timeout_s", positive=True)
        if kw["wait"] == "first_token" and not kw["stream"]:
            t.fail("wait = 'first_token' needs stream = true (a plain answer has no first token)", "wait")
    elif action == "sleep":
        kw["seconds"] = t.float_("seconds", 0.0)
        if not t.has("seconds"):
            t.fail("is required", "seconds")
    elif action == "wait_state":
        kw["server"] = server()
        kw["state"] = t.str_("state", choices=STATES)
        kw["timeout_s"] = t.float_("timeout_s", 30.0, positive=True)
    elif action == "wait_requests":
        kw["timeout_s"] = t.opt_float("timeout_s", positive=True)
    elif action == "fork":
        kw["hold_s"] = t.float_("hold_s", 0.5, positive=True)
        kw["yield_when_wanted"] = t.bool_("yield_when_wanted", False)
        kw["timeout_s"] = t.float_("timeout_s", 30.0, positive=True)
        kw["wait"] = t.str_("wait", "done", choices=("done", "sent"))
    else:
        kw["server"] = server()
        if action == "term":
            kw["expect_exit"] = t.int_("expect_exit", 0)
            kw["within_s"] = t.float_("within_s", 10.0, positive=True)
            kw["hang_up"] = t.bool_("hang_up", False)
        elif action == "restart":
            kw["timeout_s"] = t.opt_float("timeout_s", positive=True)
    t.done()
    return Step(**kw)


def _check_ids(top: _Table, phases: tuple[Phase, ...]) -> dict[str, Step]:
    ids: dict[str, Step] = {}
    for i, phase in enumerate(phases):
        for j, step in enumerate(phase.steps):
            if step.id is None:
                continue
            if step.id in ids:
                top.fail(f"duplicate step id {step.id!r}", f"phase[{i}].step[{j}].id")
            ids[step.id] = step
    return ids


def _read_expect(t: _Table, ids: dict[str, Step], servers: tuple[str, ...] = ()) -> Expectations:
    def request_id(value: object, key: str) -> str:
        if not isinstance(value, str) or value not in ids:
            known = ", ".join(sorted(ids)) or "none"
            t.fail(f"{value!r} is not the id of a step (ids: {known})", key)
        if ids[value].action not in ("request", "random"):
            t.fail(f"step {value!r} sends no requests", key)
        return value

    served_after: list[ServedAfter] = []
    for k, raw in enumerate(t.tables("served_after")):
        s = _Table(t.source, f"expect.served_after[{k}]", raw)
        served_after.append(
            ServedAfter(
                waiter=request_id(s.str_("waiter"), f"served_after[{k}].waiter"),
                holder=request_id(s.str_("holder"), f"served_after[{k}].holder"),
                max_gap_s=s.float_("max_gap_s", 5.0, positive=True),
            )
        )
        s.done()
    before = tuple(request_id(v, "none_before_restore") for v in t.str_list("none_before_restore"))
    stay: list[StayResident] = []
    for k, raw in enumerate(t.tables("stay_resident")):
        s = _Table(t.source, f"expect.stay_resident[{k}]", raw)
        names = s.str_list("servers")
        if not names:
            s.fail("is required: the servers that must stay resident", "servers")
        for name in names:
            if name not in servers:
                s.fail(f"unknown server {name!r}; servers: {', '.join(servers)}", "servers")
        steps = tuple(request_id(v, f"stay_resident[{k}].steps") for v in s.str_list("steps"))
        if not steps:
            s.fail("is required: the steps during which they stay resident", "steps")
        stay.append(StayResident(names, steps))
        s.done()
    expect = Expectations(
        all_answered=t.bool_("all_answered", True),
        stranded=t.int_("stranded", 0, minimum=0),
        answers_match_reference=t.bool_("answers_match_reference", False),
        min_handoffs=t.count("min_handoffs", None),
        max_handoff_s=t.opt_float("max_handoff_s", positive=True),
        max_wait_s=t.opt_float("max_wait_s", positive=True),
        no_preemption_mid_decode=t.bool_("no_preemption_mid_decode", False),
        clean_exit=t.bool_("clean_exit", True),
        faults_as_expected=t.bool_("faults_as_expected", True),
        served_after=tuple(served_after),
        none_before_restore=before,
        stay_resident=tuple(stay),
    )
    t.done()
    return expect

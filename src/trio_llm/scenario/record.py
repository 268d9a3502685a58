"""What a scenario run recorded: the plain data the report is computed from.

The runner fills a ``Record`` while it runs; ``report.py`` derives every figure and
every pass/fail from it alone, so a report can be re-rendered from ``report.json``
(``trio-llm scenario report DIR``) and tested from a hand-written event list.

Times are seconds since the run started (trio's clock). A residency observation is
a poll of ``GET /props``: the server read its state at some instant between the
poll's ``sent`` and ``recv``, which is all a client can know; ``StateRun`` groups
consecutive polls that read the same thing and keeps each poll's interval so that
checks such as "never cold while decoding" can be exact about that uncertainty.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import attrs

from trio_llm.errors import ScenarioError
from trio_llm.scenario.format import Count, Expectations, ServedAfter, StayResident, parse_count

#: states the server reports that mean "not resident"
NOT_RESIDENT = ("cold", "releasing", "restoring", "unloaded")
#: states the runner itself assigns when it cannot ask the server
RUNNER_STATES = ("starting", "loading", "frozen", "stopping", "down", "unreachable")


@attrs.define
class RequestRecord:
    """One HTTP request and its fate. ``first_token`` is the receipt of the first
    streamed content (None for a plain answer); ``penultimate`` that of the
    second-to-last content chunk, the last instant at which the server was surely
    still decoding this request."""

    id: int
    step: str
    round: int
    server: str
    model_key: str
    arena: bool
    endpoint: str
    prompt: str
    n_predict: int
    stream: bool
    expect_ok: bool
    expect_content: str | None
    sent: float
    ignore_eos: bool = False
    first_token: float | None = None
    penultimate: float | None = None
    done: float | None = None
    status: int | None = None
    outcome: str = "pending"  # ok | http_error | error | timeout | cancelled | pending
    error: str | None = None
    content: str = ""
    n_tokens: int = 0
    timings: dict[str, Any] | None = None

    def reference_key(self) -> tuple[str, str, str, int, bool]:
        """What makes two greedy answers comparable."""
        return (self.model_key, self.endpoint, self.prompt, self.n_predict, self.ignore_eos)

    @property
    def answered_at(self) -> float | None:
        """When the answer started to arrive: the first token, or the whole answer."""
        return self.first_token if self.first_token is not None else self.done


@attrs.define
class StateRun:
    """Consecutive polls of one server that read the same residency."""

    server: str
    state: str
    level: str | None
    device_bytes: int | None
    token_held: bool | None
    polls: list[tuple[float, float]] = attrs.field(factory=list)  # (sent, recv)

    @property
    def start(self) -> float:
        return self.polls[0][1]

    @property
    def end(self) -> float:
        return self.polls[-1][1]

    def key(self) -> tuple[Any, ...]:
        return (self.state, self.level, self.device_bytes, self.token_held)

    def read_within(self, lo: float, hi: float) -> tuple[float, float] | None:
        """The first poll of this run that surely read the server's state inside [lo, hi]."""
        return next(((s, r) for s, r in self.polls if s >= lo and r <= hi), None)


@attrs.define
class Event:
    """A process or fault event: start, healthy, signal, exit, or a check of a fault
    step (``ok`` set) such as "SIGTERM → exit 0 within 5 s"."""

    t: float
    server: str
    kind: str  # start | healthy | signal | exit | check
    detail: str = ""
    code: int | None = None
    ok: bool | None = None
    cause: str | None = None  # for exit: kill | term | final | unexpected


@attrs.define
class Reference:
    model_key: str
    endpoint: str
    prompt: str
    n_predict: int
    content: str | None
    error: str | None = None
    ignore_eos: bool = False
    #: the scenario request this answers (``--reference replay``); None: any request
    #: of the same key (``distinct``)
    request_id: int | None = None

    def key(self) -> tuple[str, str, str, int, bool]:
        return (self.model_key, self.endpoint, self.prompt, self.n_predict, self.ignore_eos)


@attrs.define
class Record:
    scenario: dict[str, Any]  # name, description, source, full, length, backend, seed, poll_interval_s
    expect: Expectations
    servers: list[dict[str, Any]] = attrs.field(factory=list)
    requests: list[RequestRecord] = attrs.field(factory=list)
    runs: list[StateRun] = attrs.field(factory=list)
    events: list[Event] = attrs.field(factory=list)
    references: list[Reference] = attrs.field(factory=list)
    notes: list[str] = attrs.field(factory=list)  # what went wrong in the runner itself
    started_at: str = ""
    duration_s: float = 0.0
    timed_out: bool = False
    interrupted: bool = False

    def add_poll(
        self,
        server: str,
        sent: float,
        recv: float,
        state: str,
        level: str | None = None,
        device_bytes: int | None = None,
        token_held: bool | None = None,
    ) -> bool:
        """Append one observation; returns True when it differs from the previous one.

        Times are kept to 0.1 ms. A state the runner knows without asking (down,
        frozen: ``sent == recv``) keeps only its first and latest observation, since
        the polls in between carry no information."""
        sent, recv = round(sent, 4), round(recv, 4)
        last = next((r for r in reversed(self.runs) if r.server == server), None)
        run = StateRun(server, state, level, device_bytes, token_held)
        if last is not None and last.key() == run.key():
            if sent == recv and len(last.polls) >= 2 and last.polls[-1][0] == last.polls[-1][1]:
                last.polls[-1] = (sent, recv)
            else:
                last.polls.append((sent, recv))
            return False
        run.polls.append((sent, recv))
        self.runs.append(run)
        return True


# --- JSON -------------------------------------------------------------------------


def to_json(record: Record) -> dict[str, Any]:
    data = attrs.asdict(record, recurse=True)
    data["expect"] = _expect_to_json(record.expect)
    return data


def _expect_to_json(expect: Expectations) -> dict[str, Any]:
    data = attrs.asdict(expect, recurse=True)
    if expect.min_handoffs is not None:
        data["min_handoffs"] = str(expect.min_handoffs)
    return data


def from_json(data: dict[str, Any]) -> Record:
    """Rebuild a Record from ``report.json``. Raises ScenarioError on a foreign file."""
    try:
        expect_raw = dict(data["expect"])
        min_handoffs = expect_raw.pop("min_handoffs", None)
        expect = Expectations(
            served_after=tuple(ServedAfter(**s) for s in expect_raw.pop("served_after", ())),
            none_before_restore=tuple(expect_raw.pop("none_before_restore", ())),
            stay_resident=tuple(StayResident(tuple(s["servers"]), tuple(s["steps"]))
                                for s in expect_raw.pop("stay_resident", ())),
            min_handoffs=_parse_count(min_handoffs),
            **expect_raw,
        )
        return Record(
            scenario=data["scenario"],
            expect=expect,
            servers=list(data["servers"]),
            requests=[RequestRecord(**r) for r in data["requests"]],
            runs=[
                StateRun(**{**r, "polls": [tuple(p) for p in r["polls"]]}) for r in data["runs"]
            ],
            events=[Event(**e) for e in data["events"]],
            references=[Reference(**r) for r in data.get("references", [])],
            notes=list(data.get("notes", [])),
            started_at=data.get("started_at", ""),
            duration_s=float(data.get("duration_s", 0.0)),
            timed_out=bool(data.get("timed_out", False)),
            interrupted=bool(data.get("interrupted", False)),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise ScenarioError(f"not a scenario record: {exc!r}") from exc


def _parse_count(text: object) -> Count | None:
    if text is None:
        return None
    count = parse_count(text)
    if count is None:
        raise ValueError(f"bad min_handoffs {text!r}")
    return count


def load(path: Path) -> Record:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ScenarioError(f"{path}: cannot read a scenario record: {exc}") from exc
    return from_json(data)

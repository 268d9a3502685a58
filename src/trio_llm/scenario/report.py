"""Figures, pass/fail and the three report files of a scenario run.

Everything here is a pure function of a ``Record`` (``analyse``), plus the writers
of ``report.json``, ``report.md`` and ``timeline.png``. Definitions, as in
``docs/scenarios.md``:

- *state at t*: what the latest poll of ``/props`` received by t said;
- *hand-off*: a request sent to an arena server that was cold while another arena
  server was resident; its latency runs from sending to the first token (to the
  whole answer for a non-streamed request);
- *wait*: sending → first token (or answer), for every answered request;
- *stranded*: a request that should have been answered and got nothing at all
  (timed out, or still in flight when the run ended).
"""

from __future__ import annotations

import bisect
import json
import statistics
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import attrs

from trio_llm.errors import TrioLLMError
from trio_llm.scenario import record as rec
from trio_llm.scenario.record import NOT_RESIDENT, Record, RequestRecord

#: a hand-off starts from one of these (restoring means someone already woke it)
COLD = ("cold", "releasing", "unloaded")
STATE_COLOURS = {
    "resident": "#2e9d4f",
    "restoring": "#f39c12",
    "releasing": "#f7dc6f",
    "cold": "#5d8fc9",
    "unloaded": "#9aa7b8",
    "loading": "#d7bde2",
    "starting": "#e8e8e8",
    "frozen": "#8e44ad",
    "unreachable": "#f1948a",
    "stopping": "#f5cba7",
    "asleep": "#5d8fc9",
    "down": "#ffffff",
}


@attrs.frozen
class Check:
    name: str
    passed: bool
    detail: str
    #: the requests that broke it, marked on the timeline
    requests: tuple[int, ...] = ()


@attrs.frozen
class Handoff:
    request: int
    server: str
    from_server: str
    sent: float
    latency_s: float | None  # None: never answered


@attrs.frozen
class ServerFigures:
    name: str
    requests: int
    answered: int
    handoffs: int
    median_wait_s: float | None
    max_wait_s: float | None
    max_device_bytes: int | None
    cold_device_bytes: int | None  # the least held while cold
    exits: tuple[str, ...]


@attrs.frozen
class Analysis:
    checks: tuple[Check, ...]
    handoffs: tuple[Handoff, ...]
    servers: tuple[ServerFigures, ...]
    figures: dict[str, Any]

    @property
    def passed(self) -> bool:
        return all(c.passed for c in self.checks)


@attrs.frozen
class Summary:
    passed: bool
    text: str


# --- state lookup -----------------------------------------------------------------


class _States:
    """Per-server polls in order, to answer "what did we see around t"."""

    def __init__(self, runs: Iterable[rec.StateRun]) -> None:
        polls: dict[str, list[tuple[float, float, rec.StateRun]]] = {}
        for run in runs:
            for sent, recv in run.polls:
                polls.setdefault(run.server, []).append((sent, recv, run))
        self._polls = {k: sorted(v, key=lambda p: (p[1], p[0])) for k, v in polls.items()}
        self._recv = {k: [p[1] for p in v] for k, v in self._polls.items()}
        self._sent = {k: [p[0] for p in v] for k, v in self._polls.items()}

    def at(self, server: str, t: float) -> rec.StateRun | None:
        """The run of the latest poll received by t."""
        i = bisect.bisect_right(self._recv.get(server, []), t) - 1
        return self._polls[server][i][2] if i >= 0 else None

    def around(self, server: str, t: float, until: float | None) -> list[rec.StateRun]:
        """The latest poll received by t, and the first one sent after t (if received
        by ``until``). A poll is up to one interval stale, so an event at t is judged
        on both sides of it: a server seen resident just before a request but cold
        just after it (and before its answer) was cold when it arrived."""
        seen = []
        before = self.at(server, t)
        if before is not None:
            seen.append(before)
        sent = self._sent.get(server, [])
        i = bisect.bisect_left(sent, t)
        if i < len(sent):
            _, recv, run = self._polls[server][i]
            if until is None or recv <= until:
                seen.append(run)
        return seen


    def sent_between(self, server: str, t0: float, t1: float) -> list[rec.StateRun]:
        """The runs of the polls sent within [t0, t1]."""
        sent = self._sent.get(server, [])
        lo, hi = bisect.bisect_left(sent, t0), bisect.bisect_right(sent, t1)
        return [self._polls[server][i][2] for i in range(lo, hi)]


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    if len(ordered) == 1:
        return ordered[0]
    pos = q * (len(ordered) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def _wait(r: RequestRecord) -> float | None:
    return None if r.answered_at is None or r.outcome != "ok" else r.answered_at - r.sent


def _fmt_s(value: float | None) -> str:
    return "–" if value is None else f"{value:.3f} s"


def _fmt_mib(value: int | None) -> str:
    return "–" if value is None else f"{value / 2**20:.1f} MiB"


def _few(items: list[str], n: int = 3) -> str:
    more = f" (+{len(items) - n} more)" if len(items) > n else ""
    return "; ".join(items[:n]) + more


# --- analysis ---------------------------------------------------------------------


def find_handoffs(record: Record, states: _States) -> list[Handoff]:
    """Requests that arrived at a cold arena server while another held the token:
    polled as resident (or releasing/restoring, which also need the token), or in the
    middle of streaming an answer, which only a resident server can do (this catches
    a holder frozen before a poll saw it resident), or having answered a request since
    which no poll saw it cold: a server that answered holds the token until it yields,
    and a hand-off of a few milliseconds (numpy, no post-wake grace) can wake, answer
    and stay resident between two polls of the 20 ms interval."""
    arena = {s["name"] for s in record.servers if s.get("arena")}
    # a co-resident (--arena-budget) stays resident while another streams: for it only
    # a poll that saw it cold is evidence of a hand-off
    shared = {s["name"] for s in record.servers
              if any(str(a).split("=", 1)[0] == "--arena-budget" for a in s.get("command", []))}
    holding = ("resident", "releasing", "restoring")
    streaming: dict[str, list[tuple[float, float]]] = {}
    for q in record.requests:
        if q.first_token is not None and q.done is not None:
            streaming.setdefault(q.server, []).append((q.first_token, q.done))
    found = []
    for r in record.requests:
        if r.server not in arena:
            continue
        until = r.answered_at
        if not (any(run.state in COLD for run in states.around(r.server, r.sent, until))
                or (r.server not in shared and _displaced(r.server, r.sent, arena, streaming))):
            continue
        holder = next(
            (
                other for other in sorted(arena - {r.server})
                if any(
                    run.state in holding or run.token_held
                    for run in states.around(other, r.sent, until)
                )
                or any(lo <= r.sent <= hi for lo, hi in streaming.get(other, []))
                or _held_since_answer(other, r.sent, streaming, states)
            ),
            None,
        )
        if holder is None:
            continue
        latency = None if r.outcome != "ok" or r.answered_at is None else r.answered_at - r.sent
        found.append(Handoff(r.id, r.server, holder, r.sent, latency))
    return found


def _displaced(server: str, t: float, arena: set[str], streaming: dict[str, list[tuple[float, float]]]) -> bool:
    """Another arena server streamed an answer after ``server``'s last one and before t:
    only a resident server streams, so ``server`` had yielded the token (a release and a
    restore can both fall between two polls)."""
    mine = [hi for _, hi in streaming.get(server, []) if hi <= t]
    last = max(mine) if mine else float("-inf")
    return any(last < lo <= t for other in arena - {server} for lo, _ in streaming.get(other, []))


def _held_since_answer(server: str, t: float, streaming: dict[str, list[tuple[float, float]]],
                       states: _States) -> bool:
    done = [hi for _, hi in streaming.get(server, []) if hi <= t]
    if not done:
        return False
    return not any(run.state in ("cold", "unloaded") for run in states.sent_between(server, max(done), t))


def analyse(record: Record) -> Analysis:
    states = _States(record.runs)
    handoffs = find_handoffs(record, states)
    latencies = [h.latency_s for h in handoffs if h.latency_s is not None]
    requests = record.requests
    expect = record.expect
    checks: list[Check] = []

    problems = [n.splitlines()[0] for n in record.notes if n.strip()]
    if record.interrupted:
        problems.append("interrupted")
    checks.append(Check("the run completed", not problems, _few(problems) or "script ran to its end"))

    if expect.all_answered:
        bad, ids = [], []
        for r in requests:
            if r.expect_ok and r.outcome != "ok":
                bad.append(f"#{r.id} {r.server}: {r.outcome} ({r.error})")
            elif not r.expect_ok and r.outcome == "ok":
                bad.append(f"#{r.id} {r.server}: answered though the step expected a failure")
            elif r.outcome == "ok" and r.expect_content is not None and r.content != r.expect_content:
                bad.append(f"#{r.id} {r.server}: content {r.content[:40]!r} ≠ {r.expect_content[:40]!r}")
            else:
                continue
            ids.append(r.id)
        expected_ok = sum(r.expect_ok for r in requests)
        checks.append(Check(
            "every request answered as expected", not bad and bool(requests),
            _few(bad) or f"{expected_ok} answered, {len(requests) - expected_ok} failed as planned",
            tuple(ids),
        ))

    stranded = [r for r in requests if r.expect_ok and r.outcome in ("timeout", "cancelled", "pending")]
    checks.append(Check(
        f"stranded ≤ {expect.stranded}", len(stranded) <= expect.stranded,
        f"{len(stranded)} stranded" + (": " + _few([f"#{r.id} {r.server}" for r in stranded]) if stranded else ""),
        tuple(r.id for r in stranded),
    ))

    if expect.answers_match_reference:
        refs = {x.key(): x for x in record.references if x.request_id is None}
        by_id = {x.request_id: x for x in record.references if x.request_id is not None}
        bad, ids, compared = [], [], 0
        for r in requests:
            if r.outcome != "ok":
                continue
            ref = by_id.get(r.id) if by_id else refs.get(r.reference_key())
            if ref is None or ref.content is None:
                bad.append(f"#{r.id}: no reference answer ({ref.error if ref else 'not asked'})")
            elif ref.content != r.content:
                bad.append(f"#{r.id} {r.server}: {r.content[:30]!r} ≠ reference {ref.content[:30]!r}")
                ids.append(r.id)
            else:
                compared += 1
        checks.append(Check(
            "answers equal the reference run's", not bad and compared > 0,
            _few(bad) or (f"{compared} answers equal, each against its replay" if by_id
                          else f"{compared} answers equal, {len(refs)} distinct prompts"), tuple(ids),
        ))

    if expect.min_handoffs is not None:
        need = expect.min_handoffs.resolve(int(record.scenario.get("length", 1)))
        checks.append(Check(f"at least {need} hand-offs", len(handoffs) >= need, f"{len(handoffs)} hand-offs"))

    if expect.max_handoff_s is not None:
        unanswered = [h for h in handoffs if h.latency_s is None]
        worst = max(latencies, default=None)
        checks.append(Check(
            f"hand-off ≤ {expect.max_handoff_s:g} s",
            bool(handoffs) and not unanswered and worst is not None and worst <= expect.max_handoff_s,
            "no hand-off observed" if not handoffs else
            f"max {_fmt_s(worst)}" + (f", {len(unanswered)} never answered" if unanswered else ""),
        ))

    waits = [w for r in requests if (w := _wait(r)) is not None]
    if expect.max_wait_s is not None:
        worst = max(waits, default=None)
        checks.append(Check(
            f"every wait ≤ {expect.max_wait_s:g} s",
            worst is not None and worst <= expect.max_wait_s, f"max wait {_fmt_s(worst)}",
        ))

    if expect.no_preemption_mid_decode:
        checks.append(_check_no_preemption(record))

    if expect.clean_exit:
        exits = [e for e in record.events if e.kind == "exit"]
        bad = [
            f"{e.server}: exit {e.code} ({e.cause})" for e in exits
            if e.cause == "unexpected" or (e.cause == "final" and e.code != 0)
            or (e.cause or "").endswith("s)")
        ]
        checks.append(Check(
            "servers exit 0 when stopped, and only when told", not bad,
            _few(bad) or f"{sum(e.cause == 'final' for e in exits)} stopped with exit 0",
        ))

    fault_checks = [e for e in record.events if e.kind == "check"]
    if expect.faults_as_expected and fault_checks:
        bad = [f"{e.server}: {e.detail}" for e in fault_checks if not e.ok]
        checks.append(Check(
            "fault steps behaved as expected", not bad,
            _few(bad, 2) or _few([e.detail for e in fault_checks], 2),
        ))

    by_step: dict[str, list[RequestRecord]] = {}
    for r in requests:
        by_step.setdefault(r.step, []).append(r)
    for pair in expect.served_after:
        checks.append(_check_served_after(pair, by_step))
    for step in expect.none_before_restore:
        checks.append(_check_none_before_restore(step, by_step.get(step, []), states, record))
    for stay in expect.stay_resident:
        checks.append(_check_stay_resident(stay, by_step, states))



    servers = tuple(_server_figures(record, info["name"], handoffs) for info in record.servers)
    figures: dict[str, Any] = {
        "requests": len(requests),
        "answered": sum(r.outcome == "ok" for r in requests),
        "stranded": len(stranded),
        "handoffs": len(handoffs),
        "handoff_median_s": statistics.median(latencies) if latencies else None,
        "handoff_p95_s": _quantile(latencies, 0.95) if latencies else None,
        "handoff_max_s": max(latencies) if latencies else None,
        "wait_median_s": statistics.median(waits) if waits else None,
        "wait_max_s": max(waits) if waits else None,
        "duration_s": record.duration_s,
    }
    return Analysis(tuple(checks), tuple(handoffs), servers, figures)


def _check_no_preemption(record: Record) -> Check:
    """A streaming request's server must read as resident from its first token to its
    second-to-last one (after that the server may legitimately be finishing)."""
    watched, bad, ids = 0, [], []
    for r in record.requests:
        if not (r.stream and r.arena and r.outcome == "ok" and r.first_token is not None):
            continue
        if r.penultimate is None or r.penultimate <= r.first_token:
            continue
        watched += 1
        for run in record.runs:
            if run.server != r.server or run.state not in NOT_RESIDENT:
                continue
            poll = run.read_within(r.first_token, r.penultimate)
            if poll is not None:
                bad.append(
                    f"#{r.id} {r.server}: read {run.state} at {poll[0]:.3f}–{poll[1]:.3f} s, after "
                    f"its first token ({r.first_token:.3f} s), before its last ({r.penultimate:.3f} s)"
                )
                ids.append(r.id)
                break
    return Check(
        "no release in the middle of a decode", watched > 0 and not bad,
        _few(bad) or (f"{watched} streams watched, none released mid-decode" if watched
                      else "no streamed answer of several tokens to watch"),
        tuple(ids),
    )


def _check_served_after(pair: Any, by_step: dict[str, list[RequestRecord]]) -> Check:
    name = f"{pair.waiter} served after {pair.holder}, within {pair.max_gap_s:g} s"
    holders = {r.round: r for r in by_step.get(pair.holder, [])}
    bad, ids, seen = [], [], 0
    for w in by_step.get(pair.waiter, []):
        h = holders.get(w.round)
        if h is None or h.done is None or h.outcome != "ok":
            bad.append(f"round {w.round}: the holder's request did not finish")
            continue
        if w.answered_at is None or w.outcome != "ok":
            bad.append(f"round {w.round}: the waiter was not served ({w.outcome})")
            continue
        seen += 1
        holder_busy_until = h.penultimate if h.penultimate is not None else h.sent
        if w.answered_at < holder_busy_until:
            bad.append(f"round {w.round}: waiter answered at {w.answered_at:.3f} s while the holder decoded")
            ids.append(w.id)
        elif w.answered_at - h.done > pair.max_gap_s:
            bad.append(f"round {w.round}: waiter answered {w.answered_at - h.done:.3f} s after the holder")
            ids.append(w.id)
    gaps = [
        w.answered_at - holders[w.round].done  # type: ignore[operator]
        for w in by_step.get(pair.waiter, [])
        if w.answered_at is not None and w.round in holders and holders[w.round].done is not None
    ]
    return Check(
        name, seen > 0 and not bad,
        _few(bad) or f"{seen} round(s); gap after the holder finished: max {_fmt_s(max(gaps, default=None))}",
        tuple(ids),
    )


def _check_stay_resident(stay: Any, by_step: dict[str, list[RequestRecord]], states: _States) -> Check:
    """Co-residency: round by round, from the first request of ``stay.steps`` sent to
    the last one finished, every poll of ``stay.servers`` sent in that window read
    ``resident`` (a swap between co-residents would show as cold or releasing), and
    each server was polled in some window (a fast round can fall between two polls,
    so not necessarily in every one)."""
    name = f"{', '.join(stay.servers)} stay resident through {', '.join(stay.steps)}"
    rounds: dict[int, list[RequestRecord]] = {}
    for step in stay.steps:
        for r in by_step.get(step, []):
            rounds.setdefault(r.round, []).append(r)
    if not rounds:
        return Check(name, False, "the steps sent no request")
    bad, polls = [], 0
    seen: dict[str, int] = dict.fromkeys(stay.servers, 0)
    for rnd, reqs in sorted(rounds.items()):
        lo = min(r.sent for r in reqs)
        hi = max((r.done if r.done is not None else r.sent) for r in reqs)
        for server in stay.servers:
            runs = states.sent_between(server, lo, hi)
            polls += len(runs)
            seen[server] += len(runs)
            off = sorted({run.state for run in runs if run.state != "resident"})
            if off:
                bad.append(f"round {rnd}: {server} seen {'/'.join(off)} in [{lo:.2f}, {hi:.2f}] s")
    bad += [f"{server} never polled while the steps ran" for server, n in seen.items() if not n]
    detail = f"{len(rounds)} round(s), {polls} polls, all resident"
    return Check(name, not bad, _few(bad) or detail)


def _check_none_before_restore(
    step: str, requests: list[RequestRecord], states: _States, record: Record
) -> Check:
    """A burst sent to a cold server: nothing answered before it was restored. The
    evidence of a violation is a poll *sent after* some request of the burst got its
    first token, yet reading the server as not resident while the burst was still
    being served. Each round's burst is judged on its own."""
    name = f"{step}: nothing served before the restore"
    if not requests:
        return Check(name, False, "the step sent no request")
    rounds: dict[int, list[RequestRecord]] = {}
    for r in requests:
        rounds.setdefault(r.round, []).append(r)
    bad, details = [], []
    for rnd, burst in sorted(rounds.items()):
        server = burst[0].server
        sent = min(r.sent for r in burst)
        answered = [r.answered_at for r in burst if r.answered_at is not None and r.outcome == "ok"]
        if not answered:
            bad.append(f"round {rnd}: no request of the burst was answered")
            continue
        lo = min(answered)
        seen = states.around(server, sent, lo)
        if not any(run.state in COLD for run in seen):
            states_seen = "/".join(run.state for run in seen) or "unobserved"
            bad.append(f"round {rnd}: {server} was {states_seen} when the burst was sent (no wake tested)")
            continue
        hi = max((r.done for r in burst if r.done is not None), default=lo)
        late = next(
            (
                run for run in record.runs
                if run.server == server and run.state in NOT_RESIDENT and run.read_within(lo, hi)
            ),
            None,
        )
        if late is not None:
            bad.append(f"round {rnd}: {server} read {late.state} after an answer arrived at {lo:.3f} s")
            continue
        resident = next(
            (run.start for run in record.runs
             if run.server == server and run.state == "resident" and run.start >= sent),
            None,
        )
        details.append(
            f"round {rnd}: {len(answered)}/{len(burst)} answered, {server} seen resident at "
            f"{_fmt_s(resident)}, first answer at {lo:.3f} s"
        )
    return Check(name, not bad, _few(bad) or _few(details, 2))


def _server_figures(record: Record, name: str, handoffs: list[Handoff]) -> ServerFigures:
    mine = [r for r in record.requests if r.server == name]
    waits = [w for r in mine if (w := _wait(r)) is not None]
    runs = [r for r in record.runs if r.server == name]
    resident = [r.device_bytes for r in runs if r.device_bytes is not None]
    cold = [r.device_bytes for r in runs if r.state == "cold" and r.device_bytes is not None]
    exits = tuple(
        f"{e.code} ({e.cause})" for e in record.events if e.kind == "exit" and e.server == name
    )
    return ServerFigures(
        name=name,
        requests=len(mine),
        answered=sum(r.outcome == "ok" for r in mine),
        handoffs=sum(h.server == name for h in handoffs),
        median_wait_s=statistics.median(waits) if waits else None,
        max_wait_s=max(waits) if waits else None,
        max_device_bytes=max(resident) if resident else None,
        cold_device_bytes=min(cold) if cold else None,
        exits=exits,
    )


# --- writers ----------------------------------------------------------------------


def markdown(record: Record, analysis: Analysis, png: str | None = "timeline.png") -> str:
    sc = record.scenario
    f = analysis.figures
    scenario_servers = [s for s in record.servers if not s.get("reference")]
    verdict = "PASS" if analysis.passed else "FAIL"
    run_kind = "full" if sc.get("full") else "short"
    lines = [
        f"# Scenario `{sc.get('name')}`: {verdict}",
        "",
        str(sc.get("description", "")).strip(),
        "",
        f"{run_kind} run (length {sc.get('length')}) · backend `{sc.get('backend')}` · "
        f"{record.duration_s:.1f} s · {len(scenario_servers)} server(s) · started {record.started_at}",
        "",
        "## Summary",
        "",
        "| figure | value |",
        "| --- | ---: |",
        f"| requests answered / sent | {f['answered']} / {f['requests']} |",
        f"| stranded | {f['stranded']} |",
        f"| hand-offs | {f['handoffs']} |",
        f"| hand-off latency median | {_fmt_s(f['handoff_median_s'])} |",
        f"| hand-off latency p95 | {_fmt_s(f['handoff_p95_s'])} |",
        f"| hand-off latency max | {_fmt_s(f['handoff_max_s'])} |",
        f"| wait median / max | {_fmt_s(f['wait_median_s'])} / {_fmt_s(f['wait_max_s'])} |",
        "",
        "## Expectations",
        "",
        "| expectation | result | detail |",
        "| --- | --- | --- |",
    ]
    for c in analysis.checks:
        detail = c.detail.replace("|", "\\|").replace("\n", " ")
        lines.append(f"| {c.name} | {'pass' if c.passed else '**FAIL**'} | {detail} |")
    lines += [
        "",
        "## Servers",
        "",
        "| server | model | sleep mode | requests (answered) | hand-offs | median wait | max wait "
        "| device memory resident / cold | exits |",
        "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    infos = {s["name"]: s for s in record.servers}
    for s in analysis.servers:
        info = infos.get(s.name, {})
        if info.get("reference"):
            continue
        mode = info.get("sleep_mode", "") if info.get("arena") else "(no arena)"
        lines.append(
            f"| {s.name} | {info.get('model_key', '')} | {mode} | {s.requests} ({s.answered}) "
            f"| {s.handoffs} | {_fmt_s(s.median_wait_s)} | {_fmt_s(s.max_wait_s)} "
            f"| {_fmt_mib(s.max_device_bytes)} / {_fmt_mib(s.cold_device_bytes)} "
            f"| {', '.join(s.exits) or '–'} |"
        )
    # the runner's own final stops are not faults: only what the script did
    faults = [
        e for e in record.events
        if e.kind == "check" or (e.kind == "signal" and e.cause in (None, "step", "term"))
    ]
    if faults:
        lines += ["", "## Faults and checks", "", "| t | server | event |", "| ---: | --- | --- |"]
        for e in faults:
            what = e.detail if e.kind == "signal" else f"{'ok' if e.ok else 'FAILED'}: {e.detail}"
            lines.append(f"| {e.t:.2f} s | {e.server} | {what.replace('|', '/')} |")
    if record.references:
        answered = sum(ref.content is not None for ref in record.references)
        if any(ref.request_id is not None for ref in record.references):
            what = (f"Reference run (replay): {answered}/{len(record.references)} requests answered again, each "
                    "server's in the order they were sent, by a plain twin of it (no arena, one slot) after the "
                    "scenario.")
        else:
            what = (f"Reference run: {answered}/{len(record.references)} distinct prompts answered by a "
                    "plain server (no arena, one slot) on the same model after the scenario.")
        lines += ["", what]
    if record.notes:
        lines += ["", "## Runner notes", ""] + [f"- {n.splitlines()[0]}" for n in record.notes]
    if png:
        lines += ["", "## Timeline", "", f"![timeline]({png})"]
    lines += [
        "",
        "Definitions: a *hand-off* is a request sent to a cold arena server while another "
        "held the GPU, timed from sending to its first token (to the whole answer when not "
        "streamed); states come from polling `/props` every "
        f"{record.scenario.get('poll_interval_s', 0.02):g} s.",
        "",
    ]
    return "\n".join(lines)


def timeline(record: Record, path: Path, flagged: Iterable[int] = ()) -> None:
    """Residency lanes with requests on top, and device memory per server below.
    ``flagged`` requests (those that broke a check) are drawn in red."""
    try:
        import matplotlib
    except ImportError:
        raise TrioLLMError(
            "the scenario report's timeline needs matplotlib: pip install 'trio-llm[scenario]'"
        ) from None

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    # the reference server runs after the scenario, unobserved: it has no lane
    names = [s["name"] for s in record.servers if not s.get("reference")]
    forks = [e for e in record.events if e.kind == "fork"]
    if forks:
        names.append("fork")  # the reference fork's stand-in (a ``fork`` step)
    n = max(1, len(names))
    shown = set(names)
    end = max(
        [0.0]
        + [r.end for r in record.runs if r.server in shown and r.state != "down"]
        + [r.done or r.sent for r in record.requests if r.server in shown]
        + [e.t for e in record.events if e.server in shown]
    )
    fig, (lanes, memory) = plt.subplots(
        2, 1, sharex=True, figsize=(13, 1.1 * n + 3.4),
        gridspec_kw={"height_ratios": [1.1 * n, 2.0]}, constrained_layout=True,
    )
    ypos = {name: n - 1 - i for i, name in enumerate(names)}
    runs_by: dict[str, list[rec.StateRun]] = {}
    for run in record.runs:
        runs_by.setdefault(run.server, []).append(run)
    used_states: set[str] = set()
    for name, runs in runs_by.items():
        if name not in ypos:
            continue
        y = ypos[name]
        for i, run in enumerate(runs):
            stop = runs[i + 1].start if i + 1 < len(runs) else max(run.end, end)
            if run.state == "down":
                continue
            used_states.add(run.state)
            lanes.broken_barh(
                [(run.start, max(stop - run.start, 1e-3))], (y - 0.4, 0.8),
                facecolors=STATE_COLOURS.get(run.state, "#cccccc"), edgecolor="none",
            )
    # requests: waiting as a thin grey line, answering as a thick black one
    marked = set(flagged)
    for name in names:
        mine = sorted((r for r in record.requests if r.server == name), key=lambda r: r.sent)
        rows: list[float] = []
        for r in mine:
            finish = r.done if r.done is not None else end
            row = next((k for k, busy in enumerate(rows) if busy <= r.sent), None)
            if row is None:
                row = len(rows) if len(rows) < 6 else len(rows) - 1
                if row == len(rows):
                    rows.append(finish)
            rows[row] = finish
            yr = ypos[name] - 0.3 + 0.6 * (row + 0.5) / 6
            answered = r.answered_at if r.answered_at is not None else finish
            lanes.plot([r.sent, answered], [yr, yr], color="#555555", lw=0.8, solid_capstyle="butt")
            if r.outcome == "ok":
                ink = "#c0392b" if r.id in marked else "black"
                lanes.plot([answered, max(finish, answered + 1e-3)], [yr, yr], color=ink,
                           lw=2.2, solid_capstyle="butt")
                lanes.plot([answered], [yr], marker="|", color=ink, ms=7)
            else:
                lanes.plot([finish], [yr], marker="x", color="#c0392b", ms=6, mew=1.6)
    # the stand-in: waiting as a thin grey line, holding the token as a thick purple one
    since: dict[str, float] = {}
    for e in forks:
        y = ypos["fork"]
        if e.detail in ("waiting", "token"):
            if e.detail == "token" and "waiting" in since:
                lanes.plot([since.pop("waiting"), e.t], [y, y], color="#555555", lw=0.8)
            since[e.detail] = e.t
        elif e.detail == "released" and "token" in since:
            t0 = since.pop("token")
            lanes.broken_barh([(t0, max(e.t - t0, 1e-3))], (y - 0.4, 0.8), facecolors="#8e44ad", edgecolor="none")
    for e in record.events:
        if e.server not in ypos or e.kind not in ("signal", "exit"):
            continue
        y = ypos[e.server]
        label = e.detail.removeprefix("SIG") if e.kind == "signal" else f"exit {e.code}"
        colour = "#c0392b" if e.kind == "signal" else "#333333"
        lanes.vlines(e.t, y - 0.45, y + 0.45, colors=colour, lw=1.4)
        # signals above the lane, exits below it, so a kill and its exit stay legible
        if e.kind == "signal":
            lanes.text(e.t, y + 0.47, label, fontsize=7, color=colour, ha="center", va="bottom")
        else:
            lanes.text(e.t, y - 0.47, f" {label}", fontsize=7, color=colour, ha="left", va="top")
    lanes.set_yticks([ypos[n_] for n_ in names], names)
    lanes.set_ylim(-0.7, n - 0.25)
    lanes.set_title(
        f"{record.scenario.get('name')}: residency per server (polled), requests "
        "(grey: waiting, black: answering, red: broke a check, x: failed)", fontsize=10, loc="left",
    )
    handles = [Patch(color=STATE_COLOURS.get(s, "#ccc"), label=s) for s in STATE_COLOURS if s in used_states]
    if handles:
        lanes.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False)
    for i, name in enumerate(names):
        points = [(run.start, run.device_bytes) for run in runs_by.get(name, []) if run.device_bytes is not None]
        if not points:
            continue
        xs = [p[0] for p in points] + [end]
        ys = [p[1] / 2**20 for p in points]
        ys.append(ys[-1])
        memory.step(xs, ys, where="post", label=name, color=f"C{i}", lw=1.5)
    memory.set_ylabel("device MiB")
    memory.set_xlabel("seconds since the run started")
    memory.set_xlim(0, end * 1.01 if end > 0 else 1)
    memory.grid(alpha=0.3)
    if memory.get_legend_handles_labels()[0]:
        memory.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False)
    else:
        memory.text(0.5, 0.5, "no device memory reported", transform=memory.transAxes, ha="center")
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write(record: Record, out: Path) -> Summary:
    """Write report.json, report.md and timeline.png into ``out``; return the verdict."""
    out.mkdir(parents=True, exist_ok=True)
    analysis = analyse(record)
    data = rec.to_json(record)
    # the derived figures too, so tools can read them without re-running the analysis
    data["analysis"] = {**attrs.asdict(analysis), "passed": analysis.passed}
    (out / "report.json").write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
    flagged = {i for c in analysis.checks if not c.passed for i in c.requests}
    timeline(record, out / "timeline.png", flagged)
    (out / "report.md").write_text(markdown(record, analysis), encoding="utf-8")
    f = analysis.figures
    lines = [
        f"{record.scenario.get('name')}: {'PASS' if analysis.passed else 'FAIL'} "
        f"({f['answered']}/{f['requests']} answered, {f['stranded']} stranded, "
        f"{f['handoffs']} hand-offs, median {_fmt_s(f['handoff_median_s'])}, "
        f"p95 {_fmt_s(f['handoff_p95_s'])})"
    ]
    lines += [f"  {'ok  ' if c.passed else 'FAIL'} {c.name}: {c.detail}" for c in analysis.checks]
    lines.append(f"  report: {out / 'report.md'}")
    return Summary(analysis.passed, "\n".join(lines))

"""Reports computed from a recorded event list: figures, pass/fail, and real files."""

from __future__ import annotations

import json
from pathlib import Path

import attrs

from trio_llm.scenario import record as rec
from trio_llm.scenario import report
from trio_llm.scenario.format import Count, Expectations, ServedAfter
from trio_llm.scenario.record import Event, Record, RequestRecord

MIB = 2**20


def _server(name: str) -> dict[str, object]:
    return {"name": name, "model_key": "tiny-Q8_0", "arena": True, "sleep_mode": "all",
            "np": 1, "ctx": 512, "backend": "numpy", "ports": [1]}


def _req(i: int, server: str, sent: float, first: float | None, done: float | None,
         *, step: str = "s", rnd: int = 0, content: str = "abc", outcome: str = "ok",
         expect_ok: bool = True, penultimate: float | None = None) -> RequestRecord:
    return RequestRecord(
        id=i, step=step, round=rnd, server=server, model_key="tiny-Q8_0", arena=True,
        endpoint="completion", prompt=f"p{i % 2}", n_predict=8, stream=first is not None,
        expect_ok=expect_ok, expect_content=None, sent=sent, first_token=first,
        penultimate=penultimate if penultimate is not None else (None if done is None or first is None else done - 0.05),
        done=done, status=200 if outcome == "ok" else None, outcome=outcome,
        content=content if outcome == "ok" else "", n_tokens=8,
    )


def _poll_span(record: Record, server: str, state: str, start: float, stop: float,
               device: int, step: float = 0.02) -> None:
    t = start
    while t < stop - 1e-9:
        record.add_poll(server, t, t + 0.005, state, level="all", device_bytes=device,
                        token_held=state == "resident")
        t += step


def alternating_record() -> Record:
    """a holds until 1.1, b until 2.35, a until 3.0, then b: three hand-offs, all answered."""
    r = Record(
        scenario={"name": "demo", "description": "A hand-made run.", "full": False,
                  "length": 1, "backend": "numpy", "poll_interval_s": 0.02},
        expect=Expectations(
            stranded=0, answers_match_reference=True, min_handoffs=Count(2, 0),
            max_handoff_s=1.0, no_preemption_mid_decode=True,
            served_after=(ServedAfter("ask-b", "ask-a", 0.6),),
        ),
        servers=[_server("a"), _server("b")],
        duration_s=3.3,
        started_at="2026-11-29T21:00:00+00:00",
    )
    _poll_span(r, "a", "resident", 0.0, 1.1, 40 * MIB)
    _poll_span(r, "a", "cold", 1.1, 2.3, 1 * MIB)
    _poll_span(r, "a", "restoring", 2.3, 2.4, 20 * MIB)
    _poll_span(r, "a", "resident", 2.4, 3.0, 40 * MIB)
    _poll_span(r, "a", "cold", 3.0, 3.3, 1 * MIB)
    _poll_span(r, "b", "cold", 0.0, 1.2, 1 * MIB)
    _poll_span(r, "b", "restoring", 1.2, 1.3, 20 * MIB)
    _poll_span(r, "b", "resident", 1.3, 2.35, 40 * MIB)
    _poll_span(r, "b", "cold", 2.35, 3.0, 1 * MIB)
    _poll_span(r, "b", "restoring", 3.0, 3.05, 20 * MIB)
    _poll_span(r, "b", "resident", 3.05, 3.3, 40 * MIB)
    r.requests = [
        _req(0, "a", 0.10, 0.15, 0.90, step="ask-a"),  # a already resident: no hand-off
        _req(1, "b", 1.00, 1.40, 1.80, step="ask-b"),  # hand-off of 0.40 s
        _req(2, "a", 2.00, 2.60, 3.00, step="ask-a", rnd=1),  # hand-off of 0.60 s
        _req(3, "b", 2.50, 3.10, 3.20, step="ask-b", rnd=1),  # hand-off of 0.60 s
    ]
    r.events = [
        Event(0.0, "a", "start", "pid 1"), Event(0.0, "b", "start", "pid 2"),
        Event(3.25, "a", "exit", code=0, cause="final"),
        Event(3.25, "b", "exit", code=0, cause="final"),
    ]
    r.references = [
        rec.Reference("tiny-Q8_0", "completion", "p0", 8, "abc"),
        rec.Reference("tiny-Q8_0", "completion", "p1", 8, "abc"),
    ]
    return r


def _check(analysis: report.Analysis, prefix: str) -> report.Check:
    return next(c for c in analysis.checks if c.name.startswith(prefix))


def test_handoffs_and_figures() -> None:
    analysis = report.analyse(alternating_record())
    assert [(h.request, h.server, h.from_server) for h in analysis.handoffs] == [
        (1, "b", "a"), (2, "a", "b"), (3, "b", "a"),
    ]
    latencies = [round(h.latency_s or 0, 6) for h in analysis.handoffs]
    assert latencies == [0.4, 0.6, 0.6]
    f = analysis.figures
    assert (f["requests"], f["answered"], f["stranded"], f["handoffs"]) == (4, 4, 0, 3)
    assert round(f["handoff_median_s"], 6) == 0.6 and round(f["handoff_max_s"], 6) == 0.6
    a, b = analysis.servers
    assert (a.name, a.requests, a.handoffs, a.max_device_bytes, a.cold_device_bytes) == (
        "a", 2, 1, 40 * MIB, 1 * MIB,
    )
    assert round(b.max_wait_s or 0, 6) == 0.6  # request 3 waited from 2.5 to 3.1
    assert analysis.passed, [c for c in analysis.checks if not c.passed]


def test_failures_are_found() -> None:
    r = alternating_record()
    # b reads cold while request 1 is mid-decode, request 3 is stranded, a reference differs
    r.add_poll("b", 1.5, 1.505, "cold", level="all", device_bytes=MIB, token_held=False)
    r.requests[3] = _req(3, "b", 2.05, None, None, step="ask-b", rnd=1, outcome="timeout")
    r.references[1] = rec.Reference("tiny-Q8_0", "completion", "p1", 8, "xyz")
    r.events.append(Event(3.25, "a", "exit", code=1, cause="unexpected"))
    analysis = report.analyse(r)
    assert not analysis.passed
    assert not _check(analysis, "no release in the middle").passed
    preempted = _check(analysis, "no release in the middle")
    assert preempted.requests == (1,)
    assert preempted.detail == (
        "#1 b: read cold at 1.500–1.505 s, after its first token (1.400 s), before its last (1.750 s)"
    )
    assert _check(analysis, "stranded").detail.startswith("1 stranded")
    assert not _check(analysis, "every request answered").passed
    assert "reference" in _check(analysis, "answers equal").detail
    assert "a: exit 1 (unexpected)" in _check(analysis, "servers exit 0").detail
    assert not _check(analysis, "ask-b served after ask-a").passed


def test_none_before_restore() -> None:
    r = alternating_record()
    r.expect = attrs.evolve(r.expect, none_before_restore=("ask-b",))
    assert _check(report.analyse(r), "ask-b: nothing served").passed
    # a poll sent after request 1's first token (1.40) reads b as still restoring
    r.add_poll("b", 1.45, 1.46, "restoring", level="all", device_bytes=MIB, token_held=True)
    check = _check(report.analyse(r), "ask-b: nothing served")
    assert not check.passed and "read restoring" in check.detail


def test_write_report_files(tmp_path: Path) -> None:
    summary = report.write(alternating_record(), tmp_path)
    assert summary.passed and summary.text.startswith("demo: PASS")
    png = (tmp_path / "timeline.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    md = (tmp_path / "report.md").read_text()
    assert "# Scenario `demo`: PASS" in md and "![timeline](timeline.png)" in md
    assert "| hand-off latency median | 0.600 s |" in md
    data = json.loads((tmp_path / "report.json").read_text())
    assert data["analysis"]["passed"] is True and data["analysis"]["figures"]["handoffs"] == 3
    # the report can be re-rendered from its own JSON, with the same verdict and figures
    again = rec.load(tmp_path / "report.json")
    assert report.analyse(again).figures == report.analyse(alternating_record()).figures
    assert again.expect == alternating_record().expect


def test_report_of_an_empty_failed_run(tmp_path: Path) -> None:
    r = Record(scenario={"name": "broken", "length": 1}, expect=Expectations(),
               servers=[_server("a")], notes=["server a exited with 1 while starting"])
    summary = report.write(r, tmp_path)
    assert not summary.passed
    assert "server a exited with 1 while starting" in summary.text
    assert (tmp_path / "timeline.png").stat().st_size > 0


def test_a_frozen_streaming_holder_still_counts_as_holding() -> None:
    """a is frozen right after its first token, before any poll saw it resident: b's
    request is still a hand-off, because only a resident server streams an answer."""
    r = Record(scenario={"name": "frozen", "length": 1}, expect=Expectations(),
               servers=[_server("a"), _server("b")], duration_s=4.0)
    _poll_span(r, "a", "cold", 0.0, 1.0, MIB)
    r.add_poll("a", 1.0, 1.0, "frozen")
    r.add_poll("a", 3.0, 3.0, "frozen")
    _poll_span(r, "a", "resident", 3.0, 4.0, 40 * MIB)
    _poll_span(r, "b", "resident", 0.0, 0.95, 40 * MIB)
    _poll_span(r, "b", "cold", 0.95, 3.2, MIB)
    _poll_span(r, "b", "resident", 3.2, 4.0, 40 * MIB)
    r.requests = [_req(0, "a", 0.9, 0.98, 3.1), _req(1, "b", 1.05, 3.3, 3.5)]
    handoffs = report.analyse(r).handoffs
    assert [(h.request, h.server, h.from_server) for h in handoffs] == [(0, "a", "b"), (1, "b", "a")]


def test_a_hand_off_between_two_polls_still_counts() -> None:
    """Hand-offs of a few milliseconds (numpy, no post-wake grace): b wakes, answers and
    stays resident between two polls, so no poll sees b resident nor a cold around a's
    next request; a's request is still a hand-off (b answered after a's last answer, and
    no poll saw b cold since). A server polled cold since its answer does not count."""
    r = Record(scenario={"name": "fast", "length": 1}, expect=Expectations(),
               servers=[_server("a"), _server("b")], duration_s=1.0)
    _poll_span(r, "a", "resident", 0.0, 1.0, 40 * MIB)  # every poll of a says resident
    _poll_span(r, "b", "cold", 0.0, 1.0, MIB)  # every poll of b says cold
    r.requests = [_req(0, "a", 0.10, 0.12, 0.20), _req(1, "b", 0.30, 0.305, 0.31),
                  _req(2, "a", 0.315, 0.33, 0.40)]
    found = [(h.request, h.server, h.from_server) for h in report.analyse(r).handoffs]
    assert found == [(1, "b", "a"), (2, "a", "b")]
    # the same run where b is polled cold between its answer and a's request: no holder
    r2 = attrs.evolve(r)
    r2.requests = [_req(0, "a", 0.10, 0.12, 0.20), _req(1, "b", 0.30, 0.305, 0.31),
                   _req(2, "a", 0.50, 0.52, 0.60)]
    found2 = [(h.request, h.server) for h in report.analyse(r2).handoffs]
    assert found2 == [(1, "b")]


def test_stay_resident_and_the_fork_lane(tmp_path: Path) -> None:
    """Co-residents: the check passes when every poll in the steps' windows reads
    resident, and names the round and state when one does not; a co-resident that
    streams beside another is no hand-off (no cold poll); the fork step's events get a
    lane, and the JSON round trip keeps the expectation."""
    from trio_llm.scenario.format import StayResident

    def make(b_dips: bool) -> Record:
        r = Record(
            scenario={"name": "co", "description": "Co-residents.", "full": False, "length": 1,
                      "backend": "numpy", "poll_interval_s": 0.02},
            expect=Expectations(stay_resident=(StayResident(("a", "b"), ("ask-a", "ask-b")),)),
            servers=[{**_server(n), "command": ["serve", "--arena-budget", "18"]} for n in ("a", "b")],
            duration_s=2.0, started_at="2026-12-01T12:00:00+00:00",
        )
        _poll_span(r, "a", "resident", 0.0, 2.0, 8 * MIB)
        if b_dips:
            _poll_span(r, "b", "resident", 0.0, 1.2, 8 * MIB)
            _poll_span(r, "b", "cold", 1.2, 1.3, 1 * MIB)
            _poll_span(r, "b", "resident", 1.3, 2.0, 8 * MIB)
        else:
            _poll_span(r, "b", "resident", 0.0, 2.0, 8 * MIB)
        r.requests = [
            _req(0, "a", 0.10, 0.12, 0.50, step="ask-a"), _req(1, "b", 0.50, 0.52, 0.90, step="ask-b"),
            _req(2, "a", 1.00, 1.02, 1.40, step="ask-a", rnd=1),
            _req(3, "b", 1.40, 1.42, 1.80, step="ask-b", rnd=1),
        ]
        r.events = [Event(1.85, "fork", "fork", "start"), Event(1.9, "fork", "fork", "waiting"),
                    Event(1.91, "fork", "fork", "token"), Event(1.99, "fork", "fork", "released")]
        return r

    good = report.analyse(make(False))
    check = _check(good, "a, b stay resident")
    assert check.passed and "2 round(s)" in check.detail
    assert good.handoffs == ()  # b answered after a streamed: no hand-off between co-residents
    bad = _check(report.analyse(make(True)), "a, b stay resident")
    assert not bad.passed and "round 1: b seen cold" in bad.detail
    record = make(True)
    report.write(record, tmp_path)
    again = rec.from_json(json.loads((tmp_path / "report.json").read_text()))
    assert again.expect.stay_resident == record.expect.stay_resident
    assert (tmp_path / "timeline.png").stat().st_size > 0


def test_replayed_references_are_matched_by_request() -> None:
    """``--reference replay``: each answer against the replay of that very request, not
    against another request of the same prompt (their prompt-cache histories differ)."""
    r = alternating_record()
    r.references = [rec.Reference(q.model_key, q.endpoint, q.prompt, q.n_predict, q.content, request_id=q.id)
                    for q in r.requests]
    check = _check(report.analyse(r), "answers equal")
    assert check.passed and "each against its replay" in check.detail
    # a second request of prompt p1 whose replay differs: flagged, although another
    # request of the same prompt (and so a distinct-prompt reference) would match it
    same_prompt = [q for q in r.requests if q.prompt == "p1"]
    assert len(same_prompt) >= 2
    victim = same_prompt[-1]
    r.references = [attrs.evolve(x, content="xyz") if x.request_id == victim.id else x for x in r.references]
    check = _check(report.analyse(r), "answers equal")
    assert not check.passed and check.requests == (victim.id,)
    assert f"#{victim.id}" in check.detail
    # a request with no replay (the twin did not get to it) is a failure, not a skip
    r.references = [x for x in r.references if x.request_id != victim.id]
    check = _check(report.analyse(r), "answers equal")
    assert not check.passed and "no reference answer" in check.detail

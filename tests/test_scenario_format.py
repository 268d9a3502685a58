"""Scenario files: the shipped ones parse, bad ones fail with a located, clear error."""

from __future__ import annotations

from pathlib import Path

import pytest

from trio_llm.errors import ScenarioError
from trio_llm.scenario import format as fmt
from trio_llm.scenario.format import Count
from trio_llm.scenario.runner import main

SHIPPED = sorted((Path(__file__).resolve().parents[1] / "scenarios").glob("*.toml"))

GOOD = """
[scenario]
name = "t"
length = 2
full_length = 10

[defaults]
sleep_mode = "weights"

[[server]]
name = "a"

[[server]]
name = "b"
sleep_mode = "all"
sleep_idle_seconds = 2.5

[[phase]]
repeat = "2*length-1"
  [[phase.step]]
  id = "ask-a"
  server = "a"
  prompt = "hello {round} from {server}"
  stream = true
  wait = "first_token"

  [[phase.step]]
  action = "kill"
  server = "b"
  delay = 0.5

[expect]
min_handoffs = "length"
served_after = [{ waiter = "ask-a", holder = "ask-a", max_gap_s = 2 }]
"""


def test_shipped_scenarios_parse() -> None:
    names = {p.stem for p in SHIPPED}
    assert {
        "alternating", "three-way", "long-holder", "waiter-killed", "holder-killed",
        "frozen-holder", "cold-stop", "burst-on-wake", "no-idle-sleep", "coresident", "pinned", "fork-joins",
    } <= names
    for path in SHIPPED:
        scenario = fmt.load(path)
        assert scenario.name == path.stem
        assert scenario.full_length >= scenario.length
        assert scenario.description


def test_good_file_values() -> None:
    s = fmt.loads(GOOD, "t.toml")
    assert [x.name for x in s.servers] == ["a", "b"]
    assert s.servers[0].sleep_mode == "weights" and s.servers[0].sleep_idle_seconds is None
    assert s.servers[1].sleep_mode == "all" and s.servers[1].sleep_idle_seconds == 2.5
    phase = s.phases[0]
    assert phase.repeat == Count(2, -1)
    assert phase.repeat.resolve(s.length) == 3 and phase.repeat.resolve(s.full_length) == 19
    ask, kill = phase.steps
    assert (ask.action, ask.server, ask.stream, ask.wait) == ("request", "a", True, "first_token")
    assert (kill.action, kill.delay) == ("kill", 0.5)
    assert s.expect.min_handoffs is not None and s.expect.min_handoffs.resolve(10) == 10
    assert s.expect.served_after[0].max_gap_s == 2.0


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[[server]\nname='a'", "not valid TOML"),
        ("[[server]]\nname='a'\n[[phase]]\n[[phase.step]]\nserver='a'\nprompt='x'\nn_predct=3",
         "phase[0].step[0].n_predct: unknown key (did you mean 'n_predict'?)"),
        ("[[server]]\nname='a'\n[[phase]]\n[[phase.step]]\nserver='aa'\nprompt='x'",
         "phase[0].step[0].server: unknown server 'aa' (did you mean 'a'?)"),
        ("[[server]]\nname='a'\n[[phase]]\n[[phase.step]]\nserver='a'",
         "phase[0].step[0].prompt: is required"),
        ("[[server]]\nname='a'\n[[phase]]\n[[phase.step]]\nserver='a'\nprompt='{who}'",
         "phase[0].step[0].prompt: bad placeholder 'who'"),
        ("[[server]]\nname='a'\n[[phase]]\n[[phase.step]]\nserver='a'\nprompt='x'\nn_predict='many'",
         "n_predict: expected an integer, got a string"),
        ("[[server]]\nname='a'\n[[phase]]\n[[phase.step]]\nserver='a'\nprompt='x'\nwait='first_token'",
         "wait = 'first_token' needs stream = true"),
        ("[[server]]\nname='a'\n[[phase]]\n[[phase.step]]\naction='explode'\nserver='a'",
         "action: 'explode' is not one of request, random"),
        ("[[server]]\nname='a'\n[[phase]]\n[[phase.step]]\naction='sleep'\nseconds=1\nat=2\ndelay=1",
         "give either at"),
        ("[[server]]\nname='a'\nmodel='x.gguf'\npreset='tiny'\n[[phase]]\n[[phase.step]]\naction='sleep'\nseconds=1",
         "server[0].model: give either model"),
        ("[[server]]\nname='a'\nsleep_mode='deep'\n[[phase]]\n[[phase.step]]\naction='sleep'\nseconds=1",
         "server[0].sleep_mode: 'deep' is not one of unload, weights, all"),
        ("[[server]]\nname='a'\n[[server]]\nname='a'", "server[1].name: duplicate server name 'a'"),
        ("[[phase]]\n[[phase.step]]\naction='sleep'\nseconds=1", "no servers"),
        ("[[server]]\nname='a'", "no steps"),
        ("[[server]]\nname='a'\n[[phase]]\nrepeat='lots'\n[[phase.step]]\naction='sleep'\nseconds=1",
         "phase[0].repeat: expected an integer or 'length'"),
        ("[[server]]\nname='a'\n[[phase]]\n[[phase.step]]\naction='sleep'\nseconds=-1",
         "seconds: must be zero or more"),
        ("[[server]]\nname='a'\n[[phase]]\n[[phase.step]]\nid='x'\naction='sleep'\nseconds=1\n"
         "[[phase.step]]\nid='x'\naction='sleep'\nseconds=1", "duplicate step id 'x'"),
        ("[[server]]\nname='a'\n[[phase]]\n[[phase.step]]\naction='sleep'\nseconds=1\n[expect]\n"
         "none_before_restore=['burst']", "expect.none_before_restore: 'burst' is not the id of a step"),
        ("[[server]]\nname='a'\n[[phase]]\n[[phase.step]]\nid='z'\naction='sleep'\nseconds=1\n[expect]\n"
         "served_after=[{waiter='z', holder='z'}]", "step 'z' sends no requests"),
        ("[[server]]\nname='a'\n[[phase]]\n[[phase.step]]\nserver='a'\nprompt='x'\n[expect]\n"
         "no_preemption_mid_decode=true", "needs a streaming request step"),
        ("[[server]]\nname='a'\n[[phase]]\n[[phase.step]]\naction='wait_state'\nserver='a'\nstate='asleep'",
         "state: 'asleep' is not one of resident"),
        ("[[server]]\nname='a'\n[[phase]]\n[[phase.step]]\naction='random'\nprompt='x'",
         "servers: is required"),
        ("[scenario]\nlenght=3\n[[server]]\nname='a'", "scenario.lenght: unknown key (did you mean 'length'?)"),
        ("[[server]]\nname='a b'", "server[0].name: 'a b': use letters"),
        ("[[server]]\nname='a'\n[[phase]]\n[[phase.step]]\nid='q'\nserver='a'\nprompt='x'\n[expect]\n"
         "stay_resident=[{servers=['z'], steps=['q']}]", "expect.stay_resident[0].servers: unknown server 'z'"),
        ("[[server]]\nname='a'\n[[phase]]\n[[phase.step]]\nid='q'\nserver='a'\nprompt='x'\n[expect]\n"
         "stay_resident=[{servers=['a']}]", "expect.stay_resident[0].steps: is required"),
        ("[[server]]\nname='a'\n[[phase]]\n[[phase.step]]\naction='fork'\nhold_s=0", "hold_s: must be"),
        ("[[server]]\nname='a'\n[[phase]]\n[[phase.step]]\naction='fork'\nwait='first_token'",
         "wait: 'first_token' is not one of done, sent"),
    ],
)
def test_bad_files_name_the_place(text: str, message: str) -> None:
    with pytest.raises(ScenarioError) as info:
        fmt.loads(text, "bad.toml")
    assert str(info.value).startswith("bad.toml: ")
    assert message in str(info.value)


def test_counts() -> None:
    assert fmt.parse_count(3) == Count(0, 3)
    assert fmt.parse_count("length") == Count(1, 0)
    assert fmt.parse_count("3 * length + 2") == Count(3, 2)
    assert fmt.parse_count("length-1").resolve(1) == 0  # type: ignore[union-attr]
    assert fmt.parse_count(-1) is None and fmt.parse_count(True) is None
    assert str(Count(2, -1)) == "2*length-1" and str(Count(0, 4)) == "4"


def test_cli_reports_bad_file_without_traceback(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("[[server]]\nname='a'\n[[phase]]\n[[phase.step]]\nserver='b'\nprompt='x'\n")
    assert main(["check", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "phase[0].step[0].server: unknown server 'b'" in err
    assert "Traceback" not in err
    assert main(["run", str(tmp_path / "missing.toml")]) == 2
    assert "no such file, nor a shipped scenario" in capsys.readouterr().err


def test_cli_check_and_list_shipped(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check", *map(str, SHIPPED)]) == 0
    assert main(["list"]) == 0
    listed = capsys.readouterr().out
    assert "alternating" in listed and "cold-stop" in listed


def test_random_arrivals_repeat_with_the_seed() -> None:
    from trio_llm.scenario.runner import random_arrivals

    scenario = fmt.load(next(p for p in SHIPPED if p.stem == "three-way"))
    step = scenario.phases[0].steps[0]
    first = random_arrivals(step, scenario.seed, "arrivals", 0, 200)
    assert first == random_arrivals(step, scenario.seed, "arrivals", 0, 200)
    assert first != random_arrivals(step, scenario.seed + 1, "arrivals", 0, 200)
    assert len(first) == 200 and {s for _, s in first} == {"a", "b", "c"}
    offsets = [t for t, _ in first]
    assert offsets == sorted(offsets)
    # exponential gaps: the mean over 200 draws is near mean_gap_s
    assert 0.6 * step.mean_gap_s < offsets[-1] / 200 < 1.4 * step.mean_gap_s


def test_model_override_applies_to_every_server(tmp_path):
    from trio_llm.scenario.runner import with_model

    scenario = fmt.load(next(p for p in SHIPPED if p.stem == "alternating"))
    specs = [with_model(s, "llama-1b:Q4_K_M") for s in scenario.servers]
    assert [(s.preset, s.quant, s.model) for s in specs] == [("llama-1b", "Q4_K_M", None)] * 2
    assert len({s.model_key for s in specs}) == 1
    file = tmp_path / "m.gguf"
    assert with_model(scenario.servers[0], str(file)).model == file.resolve()
    assert with_model(scenario.servers[0], None) == scenario.servers[0]


def test_full_n_predict_defaults_to_n_predict() -> None:
    """A step's ``full_n_predict`` is its n_predict for ``--full`` runs; unset, the same
    as n_predict. quantum.toml's stream is longer in the full run, so that it outlasts the
    full run's 20 waiters on a fast GPU (the H200's 3,000-token stream ended after 7)."""
    s = fmt.load(Path(__file__).resolve().parents[1] / "scenarios" / "quantum.toml")
    stream = s.phases[0].steps[0]
    waiter = s.phases[1].steps[0]
    assert (stream.n_predict, stream.full_n_predict) == (3000, 14000)
    assert (waiter.n_predict, waiter.full_n_predict) == (8, 8)
    assert s.servers[0].ctx > 14000 + 16
    with pytest.raises(ScenarioError, match="full_n_predict"):
        fmt.loads(GOOD.replace('  stream = true\n', '  full_n_predict = 0\n  stream = true\n', 1), "bad.toml")

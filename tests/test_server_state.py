"""Pure state transitions of the server, tested without trio or a model:
slot choice, dispatch/deferral/cancel, batch planning, stop strings, request parsing."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import trio

from trio_llm.config import ServerConfig
from trio_llm.engine.sampling import DEFAULT_SEED
from trio_llm.errors import ConfigError, ContextOverflow, InvalidRequest, TrioLLMError
from trio_llm.model.gguf import load_gguf
from trio_llm.model.tokenizer import Tokenizer
from trio_llm.server import params as P
from trio_llm.server.queue import (
    Assign,
    CancelSlot,
    IdleSlot,
    QueueState,
    SlotReleased,
    cancel,
    common_prefix,
    dispatch,
    release,
    select_slot,
)
from trio_llm.server.slots import Work, plan_batch
from trio_llm.server.stop import StopScanner, find_stop, partial_stop_len
from trio_llm.server.tasks import ServerTask, TaskParams, TaskResult, Timings


def task(id_task: int, prompt: tuple[int, ...] = (1, 2, 3), id_slot: int = -1) -> ServerTask:
    send, _ = trio.open_memory_channel[TaskResult](1)
    return ServerTask(id_task, prompt, TaskParams(id_slot=id_slot), send)


# -- slot choice ---------------------------------------------------------------------


def test_common_prefix() -> None:
    assert common_prefix([1, 2, 3], [1, 2, 4]) == 2
    assert common_prefix([], [1]) == 0
    assert common_prefix([1, 2], [1, 2, 3]) == 2


def test_select_slot_prefers_longest_prefix_then_least_recently_used() -> None:
    idle = {
        0: IdleSlot((1, 2, 9), last_used=5),
        1: IdleSlot((1, 2, 3, 4), last_used=9),
        2: IdleSlot((), last_used=1),
    }
    assert select_slot(idle, (1, 2, 3, 4, 5)) == 1
    assert select_slot(idle, (7, 7)) == 2  # no match anywhere: the least recently used
    assert select_slot(idle, (1, 2, 7, 7, 7, 7)) == 2  # a short shared prefix does not count
    assert select_slot(idle, (1, 2, 7, 7, 7, 7), similarity=0.3) == 0  # tie: older one
    assert select_slot({}, (1,)) is None


def test_select_slot_honours_a_pinned_slot() -> None:
    idle = {0: IdleSlot((), 0), 2: IdleSlot((1, 2, 3), 1)}
    assert select_slot(idle, (1, 2, 3), want=0) == 0
    assert select_slot(idle, (1, 2, 3), want=1) is None  # busy: wait for it


# -- dispatch, deferral, cancel, release --------------------------------------------------


def test_dispatch_assigns_in_arrival_order_and_defers_the_rest() -> None:
    state = QueueState.initial(2)
    for i in range(1, 5):
        state.pending.append(task(i))
    out = dispatch(state)
    assert [(a.task.id_task, a.id_slot) for a in out] == [(1, 0), (2, 1)]
    assert [t.id_task for t in state.deferred] == [3, 4]
    assert state.active == {1: 0, 2: 1}
    assert state.deferrals == 2
    assert dispatch(state) == []  # still no slot: nothing moves, nothing is counted twice
    assert state.deferrals == 2

    release(state, SlotReleased(1, 2, (1, 2, 3)))
    state.pending.append(task(5))
    out = dispatch(state)
    assert [(a.task.id_task, a.id_slot) for a in out] == [(3, 1)]  # the oldest waiter first
    assert [t.id_task for t in state.deferred] == [4, 5]
    assert state.active == {1: 0, 3: 1}


def test_a_task_pinned_to_a_busy_slot_lets_later_tasks_pass() -> None:
    state = QueueState.initial(2)
    state.pending.extend([task(1, id_slot=0), task(2, id_slot=0), task(3)])
    out = dispatch(state)
    assert [(a.task.id_task, a.id_slot) for a in out] == [(1, 0), (3, 1)]
    assert [t.id_task for t in state.deferred] == [2]


def test_cancel_of_waiting_active_and_finished_tasks() -> None:
    state = QueueState.initial(1)
    state.pending.extend([task(1), task(2), task(3)])
    dispatch(state)
    waiting = cancel(state, 2)
    assert isinstance(waiting, ServerTask) and waiting.id_task == 2
    assert [t.id_task for t in state.deferred] == [3]
    assert cancel(state, 1) == CancelSlot(1, 0)
    assert state.active == {}
    assert cancel(state, 1) is None  # already cancelled: nothing to do
    assert cancel(state, 99) is None


def test_release_after_cancel_frees_the_slot_for_the_next_waiter() -> None:
    state = QueueState.initial(1)
    state.pending.extend([task(1), task(2)])
    dispatch(state)
    cancel(state, 1)
    assert dispatch(state) == []  # the slot is not idle until the slots loop says so
    release(state, SlotReleased(0, 1, (1, 2)))
    assert [a.task.id_task for a in dispatch(state)] == [2]


def test_a_task_is_work_until_its_slot_lets_go_even_when_cancelled() -> None:
    """``has_tasks`` is what the queue reports to the residency gate as busy: a
    cancelled task still runs in its slot until the slots loop says it let go."""
    state = QueueState.initial(1)
    assert not state.has_tasks()
    state.pending.extend([task(1), task(2)])
    assert state.has_tasks()
    dispatch(state)
    assert cancel(state, 2) is not None  # dropped while waiting
    assert cancel(state, 1) == CancelSlot(1, 0)
    assert state.active == {} and state.has_tasks()  # told to stop, still in slot 0
    assert cancel(state, 1) is None  # a second cancel sends nothing more
    release(state, SlotReleased(0, 1, (1, 2)))
    assert not state.has_tasks()


def test_dispatch_repairs_the_state_when_it_fails() -> None:
    class Boom(Exception):
        pass

    class BadPrompt(tuple):  # type: ignore[type-arg]
        def __len__(self) -> int:
            raise Boom

    state = QueueState.initial(1)
    state.pending.extend([task(1), task(2, BadPrompt((1,))), task(3)])
    state.idle[1] = IdleSlot((5,), 0)  # two idle slots, so task 2 is compared
    with pytest.raises(Boom):
        dispatch(state)
    assert [t.id_task for t in state.deferred] == [2, 3]  # nothing lost, order kept
    assert list(state.active) == [1]


def test_release_orders_slots_by_recency() -> None:
    state = QueueState.initial(2)
    state.pending.extend([task(1), task(2)])
    dispatch(state)
    release(state, SlotReleased(1, 2, (4,)))
    release(state, SlotReleased(0, 1, (5,)))
    assert state.idle[1].last_used < state.idle[0].last_used
    assert select_slot(state.idle, (9,)) == 1


# -- batch planning -------------------------------------------------------------------------


def test_plan_batch_puts_decodes_first_and_chunks_prompts() -> None:
    wants = [
        Work(0, tuple(range(10)), 0, False),
        Work(1, (7,), 33, True),
        Work(2, tuple(range(10)), 4, False),
    ]
    plan = plan_batch(wants, n_batch=8)
    assert plan == [Work(1, (7,), 33, True), Work(0, tuple(range(7)), 0, False)]
    plan = plan_batch(wants, n_batch=16)
    assert plan[2] == Work(2, tuple(range(5)), 4, False)
    assert sum(len(w.tokens) for w in plan) == 16


def test_plan_batch_always_moves_a_prompt_forward() -> None:
    wants = [Work(i, (1,), 5, True) for i in range(4)] + [Work(4, (1, 2, 3), 0, False)]
    plan = plan_batch(wants, n_batch=2)
    assert [w.id_slot for w in plan] == [0, 1, 2, 3, 4]
    assert plan[-1].tokens == (1,)


# -- stop strings ---------------------------------------------------------------------------


def test_find_and_partial_stop() -> None:
    assert find_stop("hello world", ["wor", "lo"], 0) == (3, "lo")
    assert find_stop("hello", ["x"], 0) is None
    assert partial_stop_len("hello wo", ["world"]) == 2
    assert partial_stop_len("hello", ["world"]) == 0
    assert partial_stop_len("ab", ["abc", "b"]) == 2


def test_stop_scanner_holds_back_a_possible_stop_and_cuts_at_it() -> None:
    s = StopScanner(("</end>",))
    assert s.feed("Hello </") == "Hello "
    assert s.feed("e") == ""
    assert s.feed("nd> trailing") == ""
    assert s.stopping_word == "</end>"
    assert s.text == "Hello "


def test_stop_scanner_releases_held_text_that_was_not_a_stop() -> None:
    s = StopScanner(("STOP",))
    assert s.feed("a ST") == "a "
    assert s.feed("AY") == "STAY"
    assert s.feed(" S") == " "
    assert s.flush() == "S"
    assert s.text == "a STAY S" and s.stopping_word == ""


def test_timings_json() -> None:
    t = Timings(prompt_n=10, prompt_ms=20.0, cache_n=3, predicted_n=5, predicted_ms=8.0).to_json()
    assert t["prompt_per_second"] == 500.0
    # llama-server's rate: over the 4 decode steps after the first token, which is free
    assert t["predicted_per_token_ms"] == 2.0 and t["predicted_per_second"] == 500.0
    one = Timings(0, 0.0, 0, 1, 3.0).to_json()
    assert one["predicted_per_second"] == 0.0 and one["predicted_per_token_ms"] == 0.0
    assert Timings(0, 0.0, 0, 0, 0.0).to_json()["predicted_per_second"] == 0.0


# -- request parsing -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def tok(tiny_model: Path) -> Tokenizer:
    """The real tokenizer of the tiny model (llama3-style BPE, BOS added)."""
    return Tokenizer.from_metadata(load_gguf(tiny_model).metadata)


LIMITS = P.Limits(n_ctx=32, n_vocab=1024, n_slots=2, defaults=ServerConfig())


def test_parse_completion_defaults_and_values(tok: Tokenizer) -> None:
    body = {"prompt": "abc", "n_predict": 5, "temperature": 0, "stop": "x", "seed": 7}
    req = P.parse_completion(body, tok, LIMITS)
    assert list(req.prompt) == tok.encode("abc") and req.prompt[0] == tok.bos_id
    assert req.params.n_predict == 5 and req.params.stop == ("x",)
    assert req.params.sampling.temperature == 0.0 and req.params.sampling.seed == 7
    req = P.parse_completion({"prompt": [5, 6, "ab"], "seed": -1}, tok, LIMITS)
    # no BOS inside a mixed list
    assert list(req.prompt) == [5, 6, *tok.encode("ab", add_special=False)]
    assert req.params.sampling.seed == DEFAULT_SEED
    assert req.params.n_predict == -1


def test_logit_bias_by_text_biases_each_of_its_tokens(tok: Tokenizer) -> None:
    """llama-server's ``[" Hello", -100]`` (and an OpenAI key that is not a number)."""
    ids = tok.encode(" the cat", add_special=False, parse_special=False)
    for bias in ([[" the cat", -100]], {" the cat": -100}):
        req = P.parse_completion({"prompt": "a", "logit_bias": bias}, tok, LIMITS)
        assert req.params.sampling.logit_bias == tuple((t, -100.0) for t in ids)


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ([1, 2], "JSON object"),
        ({}, "'prompt' is required"),
        ({"prompt": 5}, "'prompt'"),
        ({"prompt": []}, "non-empty"),
        ({"prompt": [1, 5000]}, "outside the vocabulary"),
        ({"prompt": ["a", "b", "c"]}, "3 prompts need as many slots"),
        ({"prompt": ["a", "b"], "id_slot": 0}, "several prompts"),
        ({"prompt": "a", "n_predict": "3"}, "'n_predict' must be an integer"),
        ({"prompt": "a", "n_predict": -5}, "'n_predict' must be between"),
        ({"prompt": "a", "temperature": -1}, "'temperature'"),
        ({"prompt": "a", "top_p": 2}, "'top_p'"),
        ({"prompt": "a", "stream": "yes"}, "'stream' must be a boolean"),
        ({"prompt": "a", "stop": [1]}, "'stop'"),
        ({"prompt": "a", "n_probs": 1000}, "'n_probs'"),
        ({"prompt": "a", "id_slot": 2}, "'id_slot'"),
        ({"prompt": "a", "logit_bias": [[None, 1]]}, "not a token id"),
        ({"prompt": "a", "logit_bias": [[1.5, 1]]}, "not a token id"),
        ({"prompt": "a", "logit_bias": [[5000, 1]]}, "outside the vocabulary"),
        ({"prompt": "a", "seed": 1.5}, "'seed' must be an integer"),
        ({"prompt": "a", "top_k": True}, "'top_k' must be an integer"),
    ],
)
def test_parse_completion_rejects_bad_input(body: object, needle: str, tok: Tokenizer) -> None:
    with pytest.raises(InvalidRequest, match=needle):
        P.parse_completion(body, tok, LIMITS)


def test_a_prompt_longer_than_the_context_names_the_limit(tok: Tokenizer) -> None:
    with pytest.raises(ContextOverflow) as info:
        P.parse_completion({"prompt": list(range(40))}, tok, LIMITS)
    assert info.value.n_ctx == 32 and "32" in str(info.value)


def test_parse_oai_and_chat_options(tok: Tokenizer) -> None:
    enc = tok
    req = P.parse_oai_completion({"prompt": "hi", "max_tokens": 3, "logprobs": 2, "stream": True,
                                  "stream_options": {"include_usage": True}}, enc, LIMITS)
    assert req.params.n_predict == 3 and req.n_logprobs == 2 and req.params.sampling.n_probs == 2
    assert req.include_usage and req.params.stream
    # n: up to the slots (2 here), each choice its own seed when one is fixed
    req = P.parse_oai_completion({"prompt": "hi", "n": 2, "seed": 7}, enc, LIMITS)
    assert req.n == 2 and [c.sampling.seed for _, c in req.choices()] == [7, 8]
    random = P.parse_chat({"messages": [], "n": 2}, enc, LIMITS, "r")
    assert [c.sampling.seed for _, c in random.choices()] == [DEFAULT_SEED] * 2  # drawn per task
    pinned = P.parse_oai_completion({"prompt": "hi", "n": 2, "id_slot": 1}, enc, LIMITS)
    assert [c.id_slot for _, c in pinned.choices()] == [1, 1]  # both in slot 1, in turn
    for bad in ({"n": 3}, {"n": 0}, {"n": "2"}):
        with pytest.raises(InvalidRequest, match="'n'"):
            P.parse_oai_completion({"prompt": "hi", **bad}, enc, LIMITS)
    req = P.parse_chat({"messages": [{"role": "user", "content": "x"}], "logprobs": True}, enc, LIMITS, "rendered")
    assert req.logprobs and req.params.sampling.n_probs == 1
    with pytest.raises(InvalidRequest, match="top_logprobs"):
        P.parse_chat({"top_logprobs": 2}, enc, LIMITS, "r")
    with pytest.raises(InvalidRequest, match="'messages'"):
        P.messages_of({"messages": []})


def test_ignore_eos_bans_the_end_of_generation_tokens(tok: Tokenizer) -> None:
    req = P.parse_completion({"prompt": "a", "ignore_eos": True, "logit_bias": {"5": False}}, tok, LIMITS)
    assert set(req.params.sampling.logit_bias) == {(5, -math.inf)} | {(t, -math.inf) for t in tok.eog_ids}


def test_encode_prompt_drops_a_doubled_bos(tok: Tokenizer) -> None:
    # a chat template writes its own <|begin_of_text|>; the tokenizer adds another
    assert tok.encode("<|begin_of_text|>hi")[:2] == [tok.bos_id, tok.bos_id]
    assert P.encode_prompt(tok, "<|begin_of_text|>hi") == tok.encode("hi")


# -- config -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "flag"),
    [
        ({"port": 70000}, "--port"),
        ({"parallel": 0}, "-np"),
        ({"ctx_size": -1}, "-c"),
        ({"batch_size": 0}, "-b"),
        ({"top_p": 1.5}, "--top-p"),
        ({"sleep_idle_seconds": -3}, "--sleep-idle-seconds"),
        ({"api_key": ""}, "--api-key"),
    ],
)
def test_config_rejects_bad_values(kwargs: dict[str, object], flag: str) -> None:
    with pytest.raises(ConfigError, match=flag):
        ServerConfig(**kwargs)  # type: ignore[arg-type]


def test_slot_ctx_splits_the_context_over_slots() -> None:
    assert ServerConfig(ctx_size=4096, parallel=4).slot_ctx(100) == 1024
    assert ServerConfig(ctx_size=0, parallel=2).slot_ctx(512) == 256


def test_assign_is_a_value() -> None:
    t = task(1)
    assert Assign(t, 0) == Assign(t, 0)


def test_a_slot_file_is_checked_against_the_model(tmp_path: Path) -> None:
    """slot_file round-trips tokens and cache; another model's shape, a slot too small
    for it, and tokens outside the vocabulary are refused with a clear message."""
    import numpy as np

    from trio_llm.model.synth import PRESETS
    from trio_llm.server import slot_file

    cfg, other = PRESETS["tiny"].config(), PRESETS["tiny-qwen3"].config()
    kv = np.random.default_rng(0).standard_normal((cfg.n_layer, 2, 5, cfg.n_head_kv * cfg.head_dim)).astype(np.float32)
    path = tmp_path / "s.bin"
    assert slot_file.save(path, cfg, [1, 2, 3, 4, 5], kv) == path.stat().st_size
    tokens, back, _ = slot_file.load(path, cfg, n_ctx=16)
    assert tokens == [1, 2, 3, 4, 5] and np.array_equal(back, kv)
    with pytest.raises(InvalidRequest, match="another model"):
        slot_file.load(path, other, n_ctx=16)
    with pytest.raises(InvalidRequest, match="holds 5 tokens"):
        slot_file.load(path, cfg, n_ctx=5)
    slot_file.save(path, cfg, [1, 2, 3, 4, cfg.n_vocab], kv)
    with pytest.raises(InvalidRequest, match="outside the vocabulary"):
        slot_file.load(path, cfg, n_ctx=16)
    # a folder that is not there is the server's problem (a 500), not the request's
    with pytest.raises(TrioLLMError, match="cannot write") as failed:
        slot_file.save(tmp_path / "no-such-dir" / "s.bin", cfg, [1], kv[:, :, :1])
    assert not isinstance(failed.value, InvalidRequest)


def test_a_hybrid_slot_file_carries_the_recurrent_state_of_its_shape(tmp_path: Path) -> None:
    """A gated delta-net model's file holds the state beside the cache; its shape names
    the recurrent layers, so a hybrid of other delta-net heads is another model, and a
    state of the wrong length (or not finite) is refused."""
    import attrs
    import numpy as np

    from trio_llm.model.synth import PRESETS
    from trio_llm.server import slot_file

    cfg = PRESETS["tiny-qwen35"].config()
    n_state = slot_file.state_size(cfg)
    assert n_state == 3 * (3 * (2 * 2 * 64 + 4 * 64) + 4 * 64 * 64)  # 3 layers: conv state and 4 heads of 64 x 64
    kv = np.zeros((cfg.n_layer, 2, 3, cfg.kv_dim), np.float32)
    state = np.random.default_rng(1).standard_normal(n_state).astype(np.float32)
    path = tmp_path / "h.bin"
    slot_file.save(path, cfg, [1, 2, 3], kv, state)
    tokens, _, back = slot_file.load(path, cfg, n_ctx=16)
    assert tokens == [1, 2, 3] and np.array_equal(back, state)
    with pytest.raises(InvalidRequest, match="another model"):
        slot_file.load(path, attrs.evolve(cfg, ssm_n_v_heads=2), n_ctx=16)
    slot_file.save(path, cfg, [1, 2, 3], kv, state[:-1])
    with pytest.raises(InvalidRequest, match="recurrent state of the wrong shape"):
        slot_file.load(path, cfg, n_ctx=16)
    state[5] = np.nan
    slot_file.save(path, cfg, [1, 2, 3], kv, state)
    with pytest.raises(InvalidRequest, match="recurrent state of the wrong shape"):
        slot_file.load(path, cfg, n_ctx=16)

"""Residency: the pure state machine without trio, then the actor shell on the real
numpy backend (tiny model)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import trio
import trio.testing

from trio_llm.engine.actor import BackendActor
from trio_llm.engine.backend import Level
from trio_llm.engine.reference import NumpyBackend
from trio_llm.errors import ModelLoadError
from trio_llm.model.gguf import load_gguf
from trio_llm.residency.residency import (
    InvalidTransition,
    Residency,
    ResidencyState,
    State,
    begin_release,
    begin_restore,
    end_release,
    end_restore,
    interrupted,
    needs_release,
    release_failed,
    resolve_level,
    restore_failed,
)

RESIDENT = ResidencyState()


def test_a_full_cycle_per_level() -> None:
    for level, cold in ((Level.WEIGHTS, State.COLD), (Level.ALL, State.COLD),
                        (Level.UNLOAD, State.UNLOADED)):
        s = begin_release(RESIDENT, level)
        assert s == ResidencyState(State.RELEASING, level)
        s = end_release(s)
        assert s == ResidencyState(cold, level)
        s = begin_restore(s)
        assert s == ResidencyState(State.RESTORING, level)
        assert end_restore(s) == RESIDENT


def test_escalation_and_no_ops() -> None:
    cold_w = ResidencyState(State.COLD, Level.WEIGHTS)
    assert needs_release(RESIDENT, Level.WEIGHTS)
    assert needs_release(cold_w, Level.ALL)
    assert not needs_release(cold_w, Level.WEIGHTS)
    assert not needs_release(ResidencyState(State.UNLOADED, Level.UNLOAD), Level.ALL)
    assert begin_release(cold_w, Level.UNLOAD) == ResidencyState(State.RELEASING, Level.UNLOAD)
    with pytest.raises(InvalidTransition):
        begin_release(cold_w, Level.WEIGHTS)


def test_invalid_transitions_raise() -> None:
    releasing = ResidencyState(State.RELEASING, Level.ALL)
    restoring = ResidencyState(State.RESTORING, Level.ALL)
    for bad in (
        lambda: begin_restore(RESIDENT),
        lambda: begin_restore(releasing),
        lambda: end_release(RESIDENT),
        lambda: end_restore(releasing),
        lambda: begin_release(restoring, Level.ALL),
    ):
        with pytest.raises(InvalidTransition):
            bad()


def test_repairs_never_claim_cold_too_early() -> None:
    # a failed release keeps the state it came from: device memory may still be held
    assert release_failed(RESIDENT) == RESIDENT
    cold_w = ResidencyState(State.COLD, Level.WEIGHTS)
    assert release_failed(cold_w) == cold_w
    # a failed restore goes back to released at its level
    assert restore_failed(ResidencyState(State.RESTORING, Level.UNLOAD)) == ResidencyState(
        State.UNLOADED, Level.UNLOAD
    )
    # cancellation mid-transition: maybe resident, so the token is kept
    assert interrupted(ResidencyState(State.RELEASING, Level.ALL)) == RESIDENT


def test_resolve_level() -> None:
    assert resolve_level("all", env={}) is Level.ALL
    assert resolve_level(None, env={}) is Level.WEIGHTS
    env = {"LLAMA_SLEEP_VRAM_ONLY": "1"}
    assert resolve_level(None, env=env) is Level.WEIGHTS
    env["LLAMA_SLEEP_EVICT_KV"] = "1"
    assert resolve_level(None, env=env) is Level.ALL
    assert resolve_level("unload", env=env) is Level.UNLOAD
    assert resolve_level(None, env={"LLAMA_SLEEP_VRAM_ONLY": "0", "LLAMA_SLEEP_EVICT_KV": "1"}) is (
        Level.WEIGHTS
    )
    with pytest.raises(ValueError):
        resolve_level("deep", env={})


async def _with_residency(path: Path, body):  # type: ignore[no-untyped-def]
    gg = load_gguf(path)
    backend = NumpyBackend(gg, n_ctx=32, n_seq=2)
    gg.close()
    actor = BackendActor(backend)
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(actor.run)
            res = Residency(actor.client())
            await nursery.start(res.run)
            await body(res, backend)
            nursery.cancel_scope.cancel()
    finally:
        backend.close()


async def test_actor_moves_bytes_and_counts(tiny_model: Path) -> None:
    async def body(res: Residency, backend: NumpyBackend) -> None:
        full = res.memory
        assert full["weights"] > 0 and full["kv_cache"] > 0
        await res.release(Level.WEIGHTS)
        stats = res.statistics()
        assert (stats.state, stats.level, stats.releases) == (State.COLD, Level.WEIGHTS, 1)
        assert stats.last_bytes_moved == full["weights"]
        assert res.memory == backend.memory()  # cached after the transition
        await res.release(Level.WEIGHTS)  # no-op
        assert res.statistics().releases == 1
        await res.release(Level.ALL)  # escalates: the KV cache goes too
        assert res.memory["kv_cache"] == 0 and res.statistics().releases == 2
        assert res.statistics().last_bytes_moved == full["kv_cache"]
        await res.restore()
        assert res.state is State.RESIDENT and res.memory == full
        assert res.statistics().last_bytes_moved == sum(full.values())
        await res.restore()  # no-op
        assert res.statistics().restores == 1

    await _with_residency(tiny_model, body)


async def test_actor_finishes_a_transition_whose_caller_left(tiny_model: Path) -> None:
    async def body(res: Residency, backend: NumpyBackend) -> None:
        with trio.CancelScope() as scope:
            scope.cancel()
            await res.release(Level.ALL)  # cancelled before it was even sent
        assert res.state is State.RESIDENT
        async with trio.open_nursery() as nursery:
            nursery.start_soon(res.release, Level.ALL)
            await res.wait_for(lambda s: s is State.RELEASING)
            nursery.cancel_scope.cancel()  # the caller goes away mid-release
        assert await res.wait_for(lambda s: s is State.COLD, trio.current_time() + 30)
        assert backend.level is Level.ALL

    await _with_residency(tiny_model, body)


async def test_failed_restore_is_repaired_and_raised(tiny_model: Path, tmp_path: Path) -> None:
    copy = tmp_path / "m.gguf"
    shutil.copy(tiny_model, copy)

    async def body(res: Residency, backend: NumpyBackend) -> None:
        await res.release(Level.UNLOAD)
        assert res.state is State.UNLOADED and sum(res.memory.values()) == 0
        copy.write_bytes(b"gone")
        with pytest.raises(ModelLoadError):
            await res.restore()
        assert res.state is State.UNLOADED and res.statistics().failures == 1
        shutil.copy(tiny_model, copy)
        await res.restore()
        assert res.state is State.RESIDENT

    await _with_residency(copy, body)


@pytest.mark.parametrize(
    ("flags", "env", "expected"),
    [
        ({"sleep_idle_seconds": 30.0}, {}, ("weights", 30.0)),
        ({"sleep_idle_seconds": 5.0, "sleep_mode": "unload"}, {}, ("unload", 5.0)),
        ({"sleep_idle_seconds": 60.0}, {"LLAMA_SLEEP_VRAM_ONLY": "1"}, ("weights", 60.0)),
        ({"vram_arena": "arena"}, {"LLAMA_SLEEP_VRAM_ONLY": "1", "LLAMA_SLEEP_EVICT_KV": "1"},
         ("all", None)),
        # neither idle sleep nor arena: still a controller, for POST /sleep
        ({}, {"LLAMA_SLEEP_VRAM_ONLY": "1"}, ("weights", None)),
    ],
)
async def test_runtime_builds_the_gate_from_flags_and_env(
    tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    flags: dict[str, object], env: dict[str, str], expected: tuple[str, float | None],
) -> None:
    from trio_llm.config import ServerConfig
    from trio_llm.residency.arbiter import open_arbiter
    from trio_llm.runtime import build_gate

    for name in ("LLAMA_SLEEP_VRAM_ONLY", "LLAMA_SLEEP_EVICT_KV"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    if "vram_arena" in flags:
        flags = flags | {"vram_arena": tmp_path / "arena"}
    config = ServerConfig(**flags)  # type: ignore[arg-type]
    arbiter = await open_arbiter(config.vram_arena)
    await arbiter.take()
    gg = load_gguf(tiny_model)
    backend = NumpyBackend(gg, n_ctx=16, n_seq=1)
    gg.close()
    actor = BackendActor(backend)
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(actor.run)
            gate = await build_gate(config, actor.client(), nursery, arbiter)
            props = gate.props()
            assert (props["sleep_mode"], props["sleep_idle_seconds"]) == expected
            assert props["arbiter"]["active"] is ("vram_arena" in flags)
            assert props["state"] == "resident" and props["token_held"]
            nursery.cancel_scope.cancel()
    finally:
        backend.close()
        arbiter.close()

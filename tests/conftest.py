"""Shared fixtures: synthetic model files, made once per test session, and servers.

``model_path(preset, quant)`` writes ``trio-llm make-model``'s output for that preset
into a session temporary directory the first time a key is asked for and returns the
cached path after that. The tiny presets take a fraction of a second each.
``serve_config(config)`` / ``serve_argv(*argv)`` start a real ``trio-llm serve``
in-process (HTTP on a loopback port) from a config or a command line, wait for its
model, and shut it down after the test.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from trio_llm.model.synth import make_model

ModelPathFactory = Callable[..., Path]
ServeFactory = Callable[..., Awaitable[Any]]  # -> trio_llm.runtime.ServerHandle


@pytest.fixture
async def serve_config(nursery: Any) -> AsyncIterator[ServeFactory]:
    """Factory: a server from a ``ServerConfig``, once its model is loaded; each one is
    shut down gracefully when the test ends."""
    import trio

    from trio_llm.runtime import serve

    running: list[tuple[Any, trio.Event]] = []

    async def run(config: Any, done: trio.Event, *, task_status: Any) -> None:
        try:
            await serve(config, task_status=task_status)
        finally:
            done.set()

    async def go(config: Any, load_timeout: float = 60) -> Any:
        done = trio.Event()
        handle = await nursery.start(run, config, done)
        with trio.fail_after(load_timeout):
            await handle.context.loaded.wait()
        running.append((handle, done))
        return handle

    yield go
    for handle, done in running:
        handle.shutdown()
        with trio.fail_after(10):
            await done.wait()


@pytest.fixture
def serve_argv(serve_config: ServeFactory) -> ServeFactory:
    """Factory: a server from a command line plus ``--port 0 --no-warmup``."""
    from trio_llm.runtime import parse_config

    return lambda *argv: serve_config(parse_config(["--port", "0", "--no-warmup", *map(str, argv)], {}))


@pytest.fixture
def numpy_server(serve_argv: ServeFactory) -> ServeFactory:
    """Factory: ``numpy_server(path, *flags)``, a numpy server of ``path`` with a
    256-position context (llama.cpp's smallest, so a reference sees the same one)."""
    return lambda path, *argv: serve_argv("-m", path, "--backend", "numpy", "-c", "256", *argv)


@pytest.fixture(scope="session")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> ModelPathFactory:
    """Factory: ``model_path("tiny", "Q8_0", seed=0, pure=False, sharp=False) -> Path``
    of a synthetic GGUF (``pure``: every matrix the mix's base type; ``sharp``: peaked
    attention and logits, see ``synth.plan_tensors``)."""
    directory = tmp_path_factory.mktemp("models")
    made: dict[tuple[str, str, int, bool, bool], Path] = {}

    def get(preset: str = "tiny", quant: str = "Q8_0", seed: int = 0, pure: bool = False,
            sharp: bool = False) -> Path:
        key = (preset, quant, seed, pure, sharp)
        if key not in made:
            name = f"{preset}-{quant}{'-pure' if pure else ''}{'-sharp' if sharp else ''}-s{seed}.gguf"
            made[key] = make_model(preset, quant, directory / name, seed=seed, pure=pure, sharp=sharp)
        return made[key]

    return get


@pytest.fixture(scope="session")
def tiny_model(model_path: ModelPathFactory) -> Path:
    """The ``tiny`` llama preset in Q8_0 (gpt2-style vocab, llama3 chat template)."""
    return model_path("tiny", "Q8_0")


@pytest.fixture(scope="session")
def sharp_qwen3_model(model_path: ModelPathFactory) -> Path:
    """``tiny-qwen3`` in F32 with peaked attention and logits: greedy paths without
    near-ties, so token-for-token comparisons with llama.cpp hold."""
    return model_path("tiny-qwen3", "F32", sharp=True)


@pytest.fixture(scope="session")
def tiny_qwen3_model(model_path: ModelPathFactory) -> Path:
    """``tiny-qwen3`` in Q8_0: QK-norm, neox RoPE, tied embeddings, ChatML."""
    return model_path("tiny-qwen3", "Q8_0")


@pytest.fixture(scope="session")
def tiny_qwen2_model(model_path: ModelPathFactory) -> Path:
    """``tiny-qwen2`` in Q8_0: q/k/v biases, neox RoPE, ChatML."""
    return model_path("tiny-qwen2", "Q8_0")


@pytest.fixture(scope="session")
def tiny_spm_model(model_path: ModelPathFactory) -> Path:
    """``tiny-spm`` in Q8_0: a SentencePiece (llama2-style) vocabulary."""
    return model_path("tiny-spm", "Q8_0")


@pytest.fixture
def f32_activations(monkeypatch: pytest.MonkeyPatch) -> None:
    """Decode matvecs on f32 activations (TRIO_LLM_MATVEC_Q8=0), for the tests that hold
    the Vulkan backend to numpy's logits at f32 tolerances: by default batched decode
    steps (2 to 8 columns) read int8 activations, as llama.cpp's MMVQ does, which moves
    the logits of the tiny models by up to a few percent; test_vulkan_mvq8.py holds that
    path to numpy within its bound, and the llama.cpp agreement tests run the default."""
    monkeypatch.setenv("TRIO_LLM_MATVEC_Q8", "0")


#: test files whose checks include wall-clock figures of real processes (hand-off and
#: wait times under the arena's quantum, scenario timelines, kills mid-flight): ``make
#: test`` runs them alone, after the rest has run on every core (pytest-xdist), so the
#: other half of the suite does not load the machine under their timings
SERIAL_FILES = frozenset({"test_scenarios_ci.py", "test_faults.py", "test_arena_servers.py", "test_arena_quantum.py",
                          "test_arbiter_servers.py", "test_server_residency.py", "test_scenario_runner.py"})


@pytest.hookimpl(tryfirst=True)  # before -m deselects by marker
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.path.name in SERIAL_FILES:
            item.add_marker(pytest.mark.serial)

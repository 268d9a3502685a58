"""The on-disk pipeline cache: saved after compiles, read back by the next process's
KernelCache, and harmless when the file is corrupt. Real lavapipe, real files."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from trio_llm.vulkan.device import shared_device
from trio_llm.vulkan.kernels import KernelCache, default_cache_path

pytestmark = pytest.mark.vulkan



def _compile_one(cache: KernelCache) -> None:
    cache.get("rms_norm", n_bindings=4, n_push=6, local_size=64)


def test_saved_cache_is_read_back(tmp_path: Path) -> None:
    device = shared_device()
    path = tmp_path / "pipelines" / "dev.bin"
    first = KernelCache(device, cache_path=path)
    assert first.loaded_bytes == 0 and not first.dirty
    _compile_one(first)
    assert first.dirty
    first.save()
    assert not first.dirty and path.is_file()
    size = path.stat().st_size
    assert size >= 32  # at least the Vulkan pipeline-cache header
    second = KernelCache(device, cache_path=path)
    assert second.loaded_bytes == size
    _compile_one(second)  # compiles through the loaded cache
    second.close()
    first.close()


def test_corrupt_file_starts_an_empty_cache(tmp_path: Path) -> None:
    device = shared_device()
    path = tmp_path / "dev.bin"
    path.write_bytes(b"\x00garbage" * 100)
    cache = KernelCache(device, cache_path=path)
    _compile_one(cache)  # works whatever the driver made of the file
    cache.close()  # saves a valid cache over the garbage
    assert path.read_bytes()[:8] != b"\x00garbage"


def test_switched_off_by_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    device = shared_device()
    monkeypatch.setenv("TRIO_LLM_PIPELINE_CACHE", "0")
    assert default_cache_path(device) is None
    monkeypatch.setenv("TRIO_LLM_PIPELINE_CACHE", "1")
    path = default_cache_path(device)
    assert path is not None and path.suffix == ".bin" and path.parent.name == "pipelines"


def test_a_second_process_finds_the_first_ones_cache(tmp_path: Path) -> None:
    """Two real processes: the first compiles and exits (atexit saves), the second
    starts with the bytes the first wrote."""
    script = (
        "import sys; from pathlib import Path\n"
        "from trio_llm.vulkan.device import shared_device\n"
        "from trio_llm.vulkan.kernels import KernelCache\n"
        "c = KernelCache(shared_device(), cache_path=Path(sys.argv[1]))\n"
        "print(c.loaded_bytes)\n"
        "c.get('rms_norm', n_bindings=4, n_push=6, local_size=64)\n"
        "c.close()\n"
    )
    path = tmp_path / "dev.bin"
    runs = [
        subprocess.run([sys.executable, "-c", script, str(path)], capture_output=True, text=True, timeout=120)
        for _ in range(2)
    ]
    assert [r.returncode for r in runs] == [0, 0], [r.stderr for r in runs]
    assert int(runs[0].stdout) == 0
    assert int(runs[1].stdout) == path.stat().st_size > 0

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


def test_a_save_keeps_what_another_process_saved_meanwhile(tmp_path: Path) -> None:
    """Two caches opened on the same (empty) file, as two servers of an arena starting
    together: each compiles its own pipeline and saves; the second save merges the
    first one's pipeline in instead of writing over it, so the file ends with both
    (larger than either alone)."""
    device = shared_device()
    alone_a, alone_b, both = tmp_path / "a.bin", tmp_path / "b.bin", tmp_path / "both.bin"

    def rms(c: KernelCache) -> None:
        _compile_one(c)

    def add(c: KernelCache) -> None:
        c.get("add", n_bindings=4, n_push=3, local_size=64)

    for path, jobs in ((alone_a, [rms]), (alone_b, [add])):
        c = KernelCache(device, cache_path=path)
        for job in jobs:
            job(c)
        c.close()
    first = KernelCache(device, cache_path=both)
    second = KernelCache(device, cache_path=both)  # read the file before the first saved
    rms(first)
    add(second)
    first.save()
    second.save()
    first.close()
    second.close()
    size_a, size_b, size = alone_a.stat().st_size, alone_b.stat().st_size, both.stat().st_size
    if max(size_a, size_b) <= 32:
        pytest.skip(f"{device.name} keeps no compute pipelines in a VkPipelineCache (its data is the 32-byte "
                    "header alone), so there is nothing to merge here")
    assert size > max(size_a, size_b), (size_a, size_b, size)


def test_a_file_the_driver_refuses_at_save_is_replaced(tmp_path: Path) -> None:
    """Garbage written over the file between this cache's load and its save (another
    writer gone wrong): the merge skips it and the save still writes a valid cache."""
    device = shared_device()
    path = tmp_path / "dev.bin"
    cache = KernelCache(device, cache_path=path)
    _compile_one(cache)
    path.write_bytes(b"\x00garbage" * 100)
    cache.save()
    cache.close()
    assert path.read_bytes()[:8] != b"\x00garbage"
    assert KernelCache(device, cache_path=path).loaded_bytes == path.stat().st_size

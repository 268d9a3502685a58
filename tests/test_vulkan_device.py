"""Device choice, the shader cache and compile-shaders, on the real driver and the
wheels' compiler (glslangValidator + spirv-opt)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from trio_llm.errors import BackendUnavailable, ShaderCompileError
from trio_llm.vulkan import shaders
from trio_llm.vulkan.device import choose, open_device, shared_device

pytestmark = pytest.mark.vulkan

DISCRETE, INTEGRATED, VIRTUAL, CPU = 2, 1, 3, 4


def test_choose_prefers_discrete_then_integrated_then_cpu() -> None:
    devs = [(0, "llvmpipe", CPU), (1, "Intel UHD", INTEGRATED), (2, "NVIDIA H200", DISCRETE)]
    assert choose(devs, None) == 2
    assert choose(devs[:2], None) == 1
    assert choose([(0, "llvmpipe", CPU), (1, "virgl", VIRTUAL)], None) == 1
    assert choose([(0, "llvmpipe", CPU)], None) == 0


def test_choose_by_index_or_name_substring() -> None:
    devs = [(0, "llvmpipe (LLVM 15)", CPU), (1, "AMD Radeon RX 580", DISCRETE)]
    assert choose(devs, "0") == 0
    assert choose(devs, "rx 580") == 1
    assert choose(devs, "LLVMPIPE") == 0
    with pytest.raises(BackendUnavailable, match="index 7"):
        choose(devs, "7")
    with pytest.raises(BackendUnavailable, match="no Vulkan device matches"):
        choose(devs, "geforce")
    with pytest.raises(BackendUnavailable):
        choose([], None)


def test_selector_env_and_device_info(monkeypatch: pytest.MonkeyPatch) -> None:
    device = shared_device()
    info = device.info()
    assert info["name"] and info["type"] in ("cpu", "discrete", "integrated", "virtual", "other")
    assert device.limits.max_storage_buffer_range > 0 and device.limits.subgroup_size > 0
    # select the same device by a piece of its name, through the environment
    monkeypatch.setenv("TRIO_LLM_VK_DEVICE", device.name.split()[0])
    other = open_device()
    try:
        assert other.name == device.name
    finally:
        other.close()
    monkeypatch.setenv("TRIO_LLM_VK_DEVICE", "no-such-gpu-anywhere")
    with pytest.raises(BackendUnavailable):
        open_device()


@pytest.fixture
def shader_tree(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    src = tmp_path / "shaders"
    shutil.copytree(shaders.shader_dir(), src, ignore=shutil.ignore_patterns("build"))
    monkeypatch.setenv("TRIO_LLM_SHADER_DIR", str(src))
    monkeypatch.setenv("TRIO_LLM_SHADER_CACHE", str(tmp_path / "cache"))
    return src


def test_cache_rebuilds_when_an_include_changes(shader_tree: Path) -> None:
    defines = shaders.qtype_defines("Q8_0")
    key = shaders.cache_key("matvec", defines)
    first = shaders.spirv("matvec", defines)
    assert first[:4] == b"\x03\x02\x23\x07"  # the SPIR-V magic, little endian
    assert (shaders.cache_dir() / f"matvec-{key}.spv").exists()
    assert shaders.spirv("matvec", defines) == first  # served from the cache
    # an edit to a shared include changes the key of every shader that includes it
    quant = shader_tree / "quant.glsl"
    quant.write_text(quant.read_text() + "\n// edited\n")
    assert shaders.cache_key("matvec", defines) != key
    assert shaders.cache_key("swiglu") == shaders.cache_key("swiglu")
    shaders.spirv("matvec", defines)
    assert len(list(shaders.cache_dir().glob("matvec-*.spv"))) == 2
    # defines are part of the key too
    assert shaders.cache_key("matvec", shaders.qtype_defines("Q4_K")) != shaders.cache_key("matvec", defines)


def test_compiler_is_the_wheels_not_glslc(shader_tree: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No system compiler is needed: with an empty PATH (no glslc, no glslangValidator
    anywhere) a plain shader and the cooperative-matrix one still compile, without debug
    information (-g0: no source file names in the SPIR-V)."""
    monkeypatch.setenv("PATH", "")
    code = shaders.spirv("swiglu")
    assert code[:4] == b"\x03\x02\x23\x07"
    assert b"swiglu.comp" not in code
    cm = shaders.spirv("matmul_cm", shaders.coopmat_defines("Q8_0", 32))
    assert cm[:4] == b"\x03\x02\x23\x07"


def test_broken_shader_raises_typed_error(shader_tree: Path) -> None:
    (shader_tree / "swiglu.comp").write_text("#version 450\nvoid main() { this is not glsl }\n")
    with pytest.raises(ShaderCompileError, match="swiglu"):
        shaders.spirv("swiglu")
    assert not list(shaders.cache_dir().glob("swiglu-*"))  # no half-written file left


def test_compile_shaders_command(shader_tree: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert shaders.main([]) == 0
    # the NV cooperative-matrix-2 kernels join where their compiler (slangpy) is installed
    n = len(list(shaders.all_variants())) + (len(list(shaders.nv2_variants())) if shaders.nv2_compiler() else 0)
    assert f"{n} shader variants ready" in capsys.readouterr().out
    assert len(list(shaders.cache_dir().glob("*.spv"))) == n
    # --prune: a stale variant (an older source's key) and a test's extra one go, the set stays
    stale = shaders.cache_dir() / "add-00000000000000000000.spv"
    stale.write_bytes(b"old")
    extra = shaders.spirv("swiglu", {"GELU": 1, "UNUSED": 7})
    assert extra and len(list(shaders.cache_dir().glob("*.spv"))) == n + 2
    assert shaders.main(["--prune"]) == 0
    assert f"{n} shader variants ready in {shaders.cache_dir()} (2 others deleted)" in capsys.readouterr().out
    assert not stale.exists() and len(list(shaders.cache_dir().glob("*.spv"))) == n
    (shader_tree / "add.comp").write_text("#version 450\nbroken\n")
    assert shaders.main(["-q"]) == 1


def test_no_driver_is_backend_unavailable(tmp_path: Path) -> None:
    """A loader that finds no driver gives BackendUnavailable, not a crash (in a real
    process whose loader is pointed at a driver manifest that does not exist)."""
    import os
    import subprocess
    import sys

    code = (
        "from trio_llm.errors import BackendUnavailable\n"
        "from trio_llm.vulkan.device import open_device\n"
        "try:\n"
        "    open_device()\n"
        "except BackendUnavailable as exc:\n"
        "    print('unavailable:', exc)\n"
    )
    env = dict(os.environ, VK_DRIVER_FILES=str(tmp_path / "none.json"), VK_ICD_FILENAMES=str(tmp_path / "none.json"))
    env.pop("TRIO_LLM_VK_DEVICE", None)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("unavailable:"), (out.stdout, out.stderr)

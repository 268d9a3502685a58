"""matmul_nv2.comp: the dense prefill product on VK_NV_cooperative_matrix2.

Everywhere slangpy's glslang is installed: every prebuilt variant (``shaders.nv2_variants``)
compiles and passes ``spirv-val``, and ``Ops``' choice of kernel and tile (pure Python,
on a stand-in device). On a GPU with the extension (``Device.nv_coopmat2_decode``): the
op against numpy for every weight type, on every tile, over edges that are whole tiles in
no dimension (rows, live tokens, n_in), with the live count below the cap, y written at
an offset into wider rows, x rows wider than n_in, plain and added into a residual.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import pytest

from test_nv2_compiler import needs_compiler, validate_spirv
from test_vulkan_ops import QTYPES, Env, make_weights, open_env, x16_setup
from trio_llm.errors import ConfigError
from trio_llm.vulkan import shaders
from trio_llm.vulkan.ops import NV2_DEFAULT_QTYPES, NV2_MIN_GROUPS, NV2_QTYPES, Ops, nv2_tile

NEEDS_NV2 = "needs VK_NV_cooperative_matrix2 (lavapipe has none)"

env = pytest.fixture(scope="module", name="env")(open_env)


# -- everywhere: the SPIR-V and the choice -------------------------------------------------


def test_nv2_variants_cover_every_type_and_tile() -> None:
    got = {(d["BM"], d["BN"], d["BK"], next(k for k in d if k.startswith("QTYPE_")), "X_F16" in d)
           for n, d in shaders.nv2_variants() if n == "matmul_nv2"}
    assert got == ({(bm, bn, bk, f"QTYPE_{q}", False) for bm, bn in shaders.NV2_TILES for bk in (32, 64)
                    for q in shaders.QTYPES}
                   | {(bm, bn, shaders.NV2_BK, f"QTYPE_{q}", True) for bm, bn in shaders.NV2_TILES for q in shaders.QTYPES})
    assert set(NV2_QTYPES) == set(shaders.QTYPES)


@needs_compiler
@pytest.mark.parametrize("variant", [d for n, d in shaders.nv2_variants() if n == "matmul_nv2"],
                         ids=lambda d: "-".join(f"{v}" if k != next(iter(d)) else k[6:] for k, v in d.items()))
def test_matmul_nv2_variant_compiles_and_validates(variant: dict[str, object], tmp_path: Path) -> None:
    """Each variant through the project's compile path (slangpy's glslang, spirv-opt),
    then ``spirv-val`` for Vulkan 1.3; its SPIR-V declares what device.py enables for it
    (tensor addressing, block loads, PhysicalStorageBufferAddresses); F16 weights on
    f16 activations (X_F16) have no decode function, so no block loads and no buffer
    pointers either."""
    caps = validate_spirv(shaders.spirv("matmul_nv2", variant), tmp_path)
    assert {"CooperativeMatrixTensorAddressingNV", "TensorAddressingNV"} <= caps
    decodes = not ("QTYPE_F16" in variant and "X_F16" in variant)
    assert ({"CooperativeMatrixBlockLoadsNV", "PhysicalStorageBufferAddresses"} <= caps) == decodes


def test_nv2_tile_choice() -> None:
    """The largest tile with its ``NV2_MIN_GROUPS`` work groups: llama-1b's and llama-8b's
    products at 512 and 2048 tokens, and tiny products on the smallest."""
    assert nv2_tile(2048, 512) == (64, 64)  # 32 / 64 groups on the larger ones
    assert nv2_tile(8192, 512) == (128, 256)  # 128
    assert nv2_tile(4096, 512) == (128, 128)  # 128 (128x256: 64)
    assert nv2_tile(14336, 512) == (128, 256)
    assert nv2_tile(1024, 512) == (64, 64)
    for rows in (512, 1024, 2048, 4096, 8192, 14336):
        assert nv2_tile(rows, 2048) == ((128, 256) if rows >= 2048 else (128, 128) if rows >= 1024 else (64, 64))
    assert nv2_tile(100, 16) == (64, 64)
    assert nv2_tile(4096, 512, most=64) == (128, 256)
    assert nv2_tile(4096, 512, tiles=((128, 128), (64, 64))) == (128, 128)
    assert nv2_tile(2048, 512, tiles=((64, 64),)) == (64, 64)
    assert set(NV2_MIN_GROUPS) == set(shaders.NV2_TILES)


@attrs.define
class _Dev:
    """What ``Ops.nv2_plan`` and ``Ops.matmul`` read of a device."""

    nv_coopmat2: bool = True
    nv_coopmat2_decode: bool = True
    nv_coopmat2_max_wg: int = 256
    name: str = "stand-in"


@attrs.define
class _Kernels:
    device: _Dev
    got: list[tuple[str, dict[str, Any]]] = attrs.field(factory=list)

    def get(self, name: str, **kw: Any) -> Any:
        self.got.append((name, kw))
        return name


def test_a_refused_nv2_pipeline_falls_back_to_cm2(caplog: pytest.LogCaptureFixture) -> None:
    """A driver that lists the extension but refuses matmul_nv2's pipeline: the product
    runs on matmul_cm2, and so does every later one (no second attempt); an out-of-memory
    error is not taken for a refusal."""
    from trio_llm.errors import BackendError, DeviceOutOfMemory

    class Refusing(_Kernels):
        error: Exception = BackendError("create pipeline matmul_nv2: VkErrorUnknown")

        def get(self, name: str, **kw: Any) -> Any:
            if name == "matmul_nv2":
                raise self.error
            return super().get(name, **kw)

    k = Refusing(_Dev())
    ops = Ops(k, subgroup=32, coopmat=True, matmul_nv2=True, matmul_nv2_tile=None, matmul_nv2_bk=64,
              matmul_nv2_min_groups=None, matmul_cm2_variant=None,
              matmul_nv2_types=NV2_DEFAULT_QTYPES)  # type: ignore[arg-type]
    kw: dict[str, Any] = dict(n_in=2048, n_rows=8192, x_stride=2048, y_stride=8192, cap=512)
    with caplog.at_level("WARNING"):
        d = ops.matmul("Q8_0", None, None, None, None, **kw)  # type: ignore[arg-type]
    assert d.kernel == "matmul_cm2" and not ops.matmul_nv2
    assert "matmul_nv2 unavailable" in caplog.text
    assert ops.matmul("Q8_0", None, None, None, None, **kw).kernel == "matmul_cm2"  # type: ignore[arg-type]
    oom = Refusing(_Dev())
    oom.error = DeviceOutOfMemory("create pipeline matmul_nv2: VkErrorOutOfDeviceMemory")
    with pytest.raises(DeviceOutOfMemory):
        attrs.evolve(ops, kernels=oom, matmul_nv2=True).matmul("Q8_0", None, None, None, None,  # type: ignore[arg-type]
                                                               **kw)


def test_nv2_plan_needs_the_variant_prebuilt_or_a_compiler(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Without slangpy (no compiler) matmul_nv2 runs only where its variant was prebuilt;
    else the product goes to matmul_cm2 instead of failing to compile."""
    k = _Kernels(_Dev())
    ops = Ops(k, subgroup=32, coopmat=True, matmul_nv2=True, matmul_nv2_tile=None, matmul_nv2_bk=64,
              matmul_nv2_min_groups=None, matmul_cm2_variant=None,
              matmul_nv2_types=NV2_DEFAULT_QTYPES)  # type: ignore[arg-type]
    monkeypatch.setattr(shaders, "nv2_compiler", lambda: None)
    monkeypatch.setenv("TRIO_LLM_SHADER_CACHE", str(tmp_path))
    monkeypatch.setattr(shaders, "PACKAGED_SHADERS", tmp_path / "none")
    assert ops.nv2_plan("Q8_0", 8192, 512) is None
    d = ops.matmul("Q8_0", None, None, None, None, n_in=2048, n_rows=8192, x_stride=2048,  # type: ignore[arg-type]
                   y_stride=8192, cap=512)
    assert d.kernel == "matmul_cm2"
    defines = shaders.nv2_defines("Q8_0", 128, 256, 64)
    (tmp_path / f"matmul_nv2-{shaders.cache_key('matmul_nv2', defines)}.spv").write_bytes(b"prebuilt")
    assert ops.nv2_plan("Q8_0", 8192, 512) == (128, 256, 64)


def test_nv2_plan_and_matmul_choice() -> None:
    """matmul_nv2 first where the device has it (and cooperative matrices are on), for
    every weight type; matmul_cm2 elsewhere, as before."""
    k = _Kernels(_Dev())
    ops = Ops(k, subgroup=32, coopmat=True, matmul_nv2=True, matmul_nv2_tile=None, matmul_nv2_bk=64,
              matmul_nv2_min_groups=None, matmul_cm2_variant=None,
              matmul_nv2_types=NV2_DEFAULT_QTYPES)  # type: ignore[arg-type]
    # by default the types with cheap decodes; the K-quants and IQ4_XS stay on matmul_cm2
    for q in shaders.QTYPES:
        assert (ops.nv2_plan(q, 8192, 512) is not None) == (q in NV2_DEFAULT_QTYPES)
    ops = attrs.evolve(ops, matmul_nv2_types=NV2_QTYPES)  # TRIO_LLM_MATMUL_NV2=all
    assert ops.nv2_plan("Q4_K", 4096, 512) == (128, 128, 64)
    for q in shaders.QTYPES:
        assert ops.nv2_plan(q, 8192, 512) == (128, 256, 64)
    d = ops.matmul("Q8_0", None, None, None, None, n_in=2048, n_rows=8192, x_stride=2048,  # type: ignore[arg-type]
                   y_stride=8192, cap=512, add=True)
    assert d.kernel == "matmul_nv2" and d.groups == (64, 2, 1)
    assert d.push == (2048, 8192, 2048, 8192, 0, 0, 1)
    assert k.got[-1][1]["local_size"] == 256 and k.got[-1][1]["defines"] == shaders.nv2_defines("Q8_0", 128, 256)
    d = ops.matmul("Q6_K", None, None, None, None, n_in=2048, n_rows=2048, x_stride=2048,  # type: ignore[arg-type]
                   y_stride=2048, cap=512)
    assert d.kernel == "matmul_nv2" and d.groups == (32, 8, 1) and k.got[-1][1]["local_size"] == 128
    # y rows narrower than y_off + n_rows: matmul_cm2's
    assert ops.nv2_plan("Q8_0", 2048, 512, y_off=8, y_stride=2048) is None
    assert ops.nv2_plan("Q8_0", 2048, 512, y_off=8, y_stride=2056) is not None
    d = ops.matmul("Q8_0", None, None, None, None, n_in=2048, n_rows=2048, x_stride=2048,  # type: ignore[arg-type]
                   y_stride=2048, y_off=8, cap=512)
    assert d.kernel == "matmul_cm2"
    # off: the flag, no cooperative matrices, the device lacking a part, cm3 or emulation asked for
    assert attrs.evolve(ops, matmul_nv2=False).nv2_plan("Q8_0", 2048, 512) is None
    assert attrs.evolve(ops, coopmat=False).nv2_plan("Q8_0", 2048, 512) is None
    assert attrs.evolve(ops, matmul_cm2_variant=shaders.cm3_variant("v")).nv2_plan("Q8_0", 2048, 512) is None
    assert attrs.evolve(ops, matmul_cm2_emulate=32).nv2_plan("Q8_0", 2048, 512) is None
    for dev in (_Dev(nv_coopmat2=False), _Dev(nv_coopmat2_decode=False), _Dev(nv_coopmat2_max_wg=64)):
        assert attrs.evolve(ops, kernels=_Kernels(dev)).nv2_plan("Q8_0", 8192, 512) is None
    # a device whose workgroup-scope matrices stop at 128 lanes: 64x64 only
    small = attrs.evolve(ops, kernels=_Kernels(_Dev(nv_coopmat2_max_wg=128)))
    assert small.nv2_plan("Q8_0", 8192, 2048) == (64, 64, 64)
    with pytest.raises(ConfigError, match="TRIO_LLM_NV2_TILE"):
        attrs.evolve(small, matmul_nv2_tile=(128, 128)).nv2_plan("Q8_0", 8192, 2048)
    # forced tile, K step and min groups
    assert attrs.evolve(ops, matmul_nv2_tile=(64, 64), matmul_nv2_bk=32).nv2_plan("Q8_0", 8192, 2048) == (64, 64, 32)
    assert attrs.evolve(ops, matmul_nv2_min_groups=1).nv2_plan("Q8_0", 128, 16) == (128, 256, 64)


def test_nv2_env(monkeypatch: pytest.MonkeyPatch) -> None:
    k = _Kernels(_Dev())
    monkeypatch.setenv("TRIO_LLM_MATMUL_NV2", "0")
    monkeypatch.setenv("TRIO_LLM_NV2_TILE", "128x128")
    monkeypatch.setenv("TRIO_LLM_NV2_BK", "32")
    monkeypatch.setenv("TRIO_LLM_NV2_MIN_GROUPS", "64")
    ops = Ops(k)  # type: ignore[arg-type]
    assert not ops.matmul_nv2 and ops.matmul_nv2_tile == (128, 128) and ops.matmul_nv2_bk == 32
    assert ops.matmul_nv2_min_groups == 64
    monkeypatch.delenv("TRIO_LLM_MATMUL_NV2")
    monkeypatch.delenv("TRIO_LLM_NV2_TILE")
    monkeypatch.delenv("TRIO_LLM_NV2_BK")
    ops = Ops(k)  # type: ignore[arg-type]
    assert ops.matmul_nv2 and ops.matmul_nv2_tile is None and ops.matmul_nv2_bk == shaders.NV2_BK
    assert ops.matmul_nv2_types == NV2_DEFAULT_QTYPES
    monkeypatch.setenv("TRIO_LLM_MATMUL_NV2", "all")
    assert Ops(k).matmul_nv2_types == NV2_QTYPES  # type: ignore[arg-type]
    monkeypatch.setenv("TRIO_LLM_MATMUL_NV2", "Q4_K,Q6_K")
    assert Ops(k).matmul_nv2_types == ("Q4_K", "Q6_K")  # type: ignore[arg-type]
    monkeypatch.setenv("TRIO_LLM_MATMUL_NV2", "Q9")
    with pytest.raises(ConfigError, match="TRIO_LLM_MATMUL_NV2"):
        Ops(k)  # type: ignore[arg-type]
    monkeypatch.delenv("TRIO_LLM_MATMUL_NV2")
    monkeypatch.setenv("TRIO_LLM_NV2_TILE", "128x64")
    with pytest.raises(ConfigError, match="TRIO_LLM_NV2_TILE"):
        Ops(k)  # type: ignore[arg-type]


def test_nv2_follows_the_device(env: Env) -> None:
    """matmul_nv2 where the device has the extension with its decode functions (and
    cooperative matrices), never elsewhere (lavapipe), whatever is asked."""
    dev = env.device
    ops = attrs.evolve(env.ops, coopmat=dev.coopmat, matmul_nv2=True)
    has = dev.coopmat and dev.nv_coopmat2 and dev.nv_coopmat2_decode
    assert (ops.nv2_plan("Q8_0", 8192, 512) is not None) == has


# -- on a GPU with the extension ------------------------------------------------------------


@pytest.fixture(scope="module")
def nv2(env: Env) -> Iterator[Ops]:
    if not (env.device.nv_coopmat2 and env.device.nv_coopmat2_decode and env.device.coopmat):
        pytest.skip(NEEDS_NV2)
    # (no compiler needed: compile-shaders prebuilds every variant these tests ask for)
    yield attrs.evolve(env.ops, coopmat=True, matmul_nv2=True, matmul_nv2_types=NV2_QTYPES, matmul_cm2_variant=None,
                       matmul_cm2_emulate=0)


def _nv2_case(env: Env, ops: Ops, qtype: str, *, rows: int, cols: int, ntok: int, cap: int,
              x_pad: int = 8, y_pad: int = 20, y_off: int = 12, seed: int = 5, x16: bool = False) -> None:
    """``ops.matmul`` (which must run matmul_nv2) against numpy on f16-rounded weights and
    activations: x rows of ``cols + x_pad`` floats (x_stride), y rows of ``rows + y_pad``
    with the product in columns [y_off, y_off + rows); plain into a y of ``cap`` rows
    (every other value, the rows past the live tokens included, must stay untouched)
    and added into a residual (mode 1: the same, plus the residual; the rest untouched).
    ``x16``: the X_F16 variant on ``to_f16``'s copy of x (``Ops.matmul_x16``), the same bounds."""
    raw, ref = make_weights(qtype, rows, cols, seed=seed)
    rng = np.random.default_rng(seed + 1)
    xs = cols + x_pad
    x = rng.standard_normal((ntok, xs)).astype(np.float32)
    x[:, cols:] = np.nan  # past n_in: never read
    ys = rows + y_pad
    resid = rng.standard_normal((cap, ys)).astype(np.float32)
    # the tokens past the live count: NaN in x (never read), 7 in y (never written)
    xfull = np.full((cap, xs), np.nan, np.float32)
    xfull[:ntok] = x
    w, xv = env.put(raw), env.put(xfull)
    y = env.put(np.full(cap * ys, 7.0, np.float32))
    y2 = env.put(resid)
    st = env.step(list(range(ntok)))
    args: dict[str, Any] = {"n_in": cols, "n_rows": rows, "x_stride": xs, "y_stride": ys, "y_off": y_off, "cap": cap}
    ops, pre = x16_setup(env, ops, qtype, xv, st, args) if x16 else (ops, [])
    d = ops.matmul(qtype, w, xv, y, st, **args)
    assert d.kernel.name == "matmul_nv2"
    assert (d.views[1] is args["xh"]) if x16 else (d.views[1] is xv)
    env.run([*pre, d, ops.matmul(qtype, w, xv, y2, st, **args, add=True)])
    f16 = np.float16
    xin = x[:, :cols]
    want = xin.astype(f16).astype(np.float64) @ ref.astype(f16).astype(np.float64).T
    scale = np.abs(want).max()
    got = env.get(y).reshape(cap, ys)
    np.testing.assert_allclose(got[:ntok, y_off : y_off + rows], want, atol=2e-5 * scale, rtol=0)
    outside = np.ones((cap, ys), bool)
    outside[:ntok, y_off : y_off + rows] = False
    assert np.all(got[outside] == 7.0), "matmul_nv2 wrote outside its rows / live tokens"
    got2 = env.get(y2).reshape(cap, ys)
    np.testing.assert_allclose(got2[:ntok, y_off : y_off + rows], want + resid[:ntok, y_off : y_off + rows],
                               atol=2e-5 * scale, rtol=0)
    assert np.array_equal(got2[outside], resid[outside]), "matmul_nv2 (mode 1) wrote outside"
    # and within f16's rounding of the exact product
    np.testing.assert_allclose(got[:ntok, y_off : y_off + rows], xin @ ref.T, atol=5e-3 * scale, rtol=0)


TILE_IDS = [f"{bm}x{bn}" for bm, bn in shaders.NV2_TILES]


#: every weight type on 128x128, the benchmark files' types (and F16) on the other tiles
#: too (each variant is a pipeline the driver takes seconds to build)
TYPE_TILES = [(q, (128, 128)) for q in QTYPES] + [(q, t) for q in ("Q8_0", "Q4_K", "Q6_K", "F16")
                                                   for t in shaders.NV2_TILES if t != (128, 128)]


@pytest.mark.parametrize(("qtype", "tile"), TYPE_TILES, ids=[f"{q}-{t[0]}x{t[1]}" for q, t in TYPE_TILES])
def test_matmul_nv2_types_and_edges(env: Env, nv2: Ops, qtype: str, tile: tuple[int, int]) -> None:
    """Every weight type (on 128x128; the main ones on every tile): 200 rows and 150 live tokens of a 320-token cap
    (whole tiles in neither; the token tiles past 150 return at once), 512 inputs (K
    steps of 64: the interior tiles take the unclamped loads, the edge ones the clamped)."""
    ops = attrs.evolve(nv2, matmul_nv2_tile=tile)
    _nv2_case(env, ops, qtype, rows=200, cols=512, ntok=150, cap=320)


#: n_in not a multiple of the K step (every load clamped along K; Q8_0's rows then start
#: two bytes off a 4-byte word), K steps of 32, and the legacy 32-blocks at odd counts
EDGE_K = [("Q8_0", 160, 64), ("Q8_0", 96, 64), ("Q8_0", 160, 32), ("Q4_0", 288, 64), ("IQ4_NL", 224, 64),
          ("Q5_1", 96, 32), ("F16", 200 - 8, 64), ("F32", 96, 64), ("Q4_K", 768, 32), ("Q6_K", 256, 32)]


#: ... each on the tiles in turn
EDGE_K_TILES = [(q, c, b, shaders.NV2_TILES[i % len(shaders.NV2_TILES)]) for i, (q, c, b) in enumerate(EDGE_K)]


@pytest.mark.parametrize(("qtype", "cols", "bk", "tile"), EDGE_K_TILES,
                         ids=[f"{q}-{c}-k{b}-{t[0]}x{t[1]}" for q, c, b, t in EDGE_K_TILES])
def test_matmul_nv2_ragged_k(env: Env, nv2: Ops, qtype: str, cols: int, bk: int, tile: tuple[int, int]) -> None:
    """n_in not a multiple of the K step (every load clamped along K)."""
    ops = attrs.evolve(nv2, matmul_nv2_tile=tile, matmul_nv2_bk=bk)
    _nv2_case(env, ops, qtype, rows=136, cols=cols, ntok=70, cap=130, x_pad=4, y_off=3, y_pad=5)


@pytest.mark.parametrize("tile", shaders.NV2_TILES, ids=TILE_IDS)
@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_K", "Q6_K", "F16"])
def test_matmul_nv2_whole_tiles(env: Env, nv2: Ops, qtype: str, tile: tuple[int, int]) -> None:
    """Rows, live tokens and n_in whole tiles of every size (every work group on the
    unclamped loads), x and y rows exactly n_in and n_rows wide, y_off 0."""
    ops = attrs.evolve(nv2, matmul_nv2_tile=tile)
    _nv2_case(env, ops, qtype, rows=256, cols=512, ntok=256, cap=256, x_pad=0, y_pad=0, y_off=0)


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_K", "Q6_K"])
def test_matmul_nv2_small_batch(env: Env, nv2: Ops, qtype: str) -> None:
    """A prefill bucket barely past the matvecs: 9 live tokens of 16, 40 rows (the
    tile ``nv2_tile`` picks: 64x64), one K step."""
    _nv2_case(env, nv2, qtype, rows=40, cols=256, ntok=9, cap=16, y_off=1, y_pad=3)


@pytest.mark.parametrize(("qtype", "rows", "cols", "ntok"), [("Q8_0", 2048, 2048, 512), ("Q4_K", 1024, 4096, 512),
                                                             ("Q6_K", 4096, 1024, 300)])
def test_matmul_nv2_model_shapes(env: Env, nv2: Ops, qtype: str, rows: int, cols: int, ntok: int) -> None:
    """Products of a real model's size on the tile the backend picks (many K steps, many
    work groups), within the same bounds."""
    _nv2_case(env, nv2, qtype, rows=rows, cols=cols, ntok=ntok, cap=512, x_pad=0, y_pad=0, y_off=0, seed=9)


#: matmul_nv2 on f16 activations (TRIO_LLM_MATMUL_X16): the main types on every tile, ragged
#: edges, n_in not a multiple of the K step, and a model's shape
X16_CASES = ([(q, t, dict(rows=200, cols=512, ntok=150, cap=320)) for q in ("Q8_0", "F16", "Q4_K")
              for t in shaders.NV2_TILES]
             + [("Q6_K", (128, 128), dict(rows=136, cols=768, ntok=70, cap=130, x_pad=4, y_off=3, y_pad=5)),
                ("Q8_0", (64, 64), dict(rows=136, cols=160, ntok=70, cap=130, x_pad=4, y_off=3, y_pad=5)),
                ("F16", (128, 256), dict(rows=256, cols=512, ntok=256, cap=256, x_pad=0, y_pad=0, y_off=0)),
                ("Q8_0", None, dict(rows=2048, cols=2048, ntok=512, cap=512, x_pad=0, y_pad=0, y_off=0, seed=9))])


@pytest.mark.parametrize(("qtype", "tile", "shape"), X16_CASES,
                         ids=[f"{q}-{t[0]}x{t[1]}-{s['cols']}" if t else f"{q}-auto-{s['cols']}" for q, t, s in X16_CASES])
def test_matmul_matmul_x16(env: Env, nv2: Ops, qtype: str, tile: tuple[int, int] | None, shape: dict[str, int]) -> None:
    """The X_F16 variant reads to_f16's copy of the live rows (NaN past them: never read)
    and gives the f32-activation product's results within the same bounds."""
    ops = attrs.evolve(nv2, matmul_nv2_tile=tile)
    _nv2_case(env, ops, qtype, **shape, x16=True)  # type: ignore[arg-type]


def test_to_f16_equals_numpy(env: Env) -> None:
    """Everywhere (lavapipe too): the live rows of x, ``x_stride`` floats apart, as f16
    rows n_in apart (numpy's rounding, within 1 ulp), nothing past the live rows written."""
    rng = np.random.default_rng(3)
    cap, live, n, xs = 24, 17, 96, 104
    x = (rng.standard_normal((cap, xs)) * 40).astype(np.float32)
    x[:, n:] = np.nan
    xh = env.put(np.full(cap * n // 2, 0x7E007E00, np.uint32))
    env.run([env.ops.to_f16(env.put(x), xh, env.step(list(range(live))), n_in=n, x_stride=xs, cap=cap)])
    got = env.get(xh, np.uint32).view(np.float16).reshape(cap, n)
    np.testing.assert_array_max_ulp(got[:live], x[:live, :n].astype(np.float16), maxulp=1)
    assert (env.get(xh, np.uint32).reshape(cap, n // 2)[live:] == 0x7E007E00).all()


@needs_compiler
def test_x16_plan_and_choice() -> None:
    """``x16_plan`` holds only where ``matmul_x16`` is on and matmul_nv2 or matmul_cm2's
    own form runs the product; there ``matmul`` given ``xh`` takes the X_F16 variant and
    binds xh in x's place, and every other product (or one without ``xh``) reads x."""
    k = _Kernels(_Dev())
    ops = Ops(k, subgroup=32, coopmat=True, matmul_nv2=True, matmul_nv2_tile=None, matmul_nv2_bk=64,
              matmul_nv2_min_groups=None, matmul_cm2_variant=None, matmul_x16=False,
              matmul_nv2_types=NV2_DEFAULT_QTYPES)  # type: ignore[arg-type]
    kw: dict[str, Any] = dict(n_in=2048, n_rows=8192, x_stride=2048, y_stride=8192, cap=512)
    assert ops.nv2_plan("Q8_0", 8192, 512) is not None and not ops.x16_plan("Q8_0", 8192, 512)
    assert ops.matmul("Q8_0", "w", "x", "y", "st", **kw, xh="xh").views[1] == "x"  # type: ignore[arg-type]
    on = attrs.evolve(ops, matmul_x16=True)
    assert on.x16_plan("Q8_0", 8192, 512)
    d = on.matmul("Q8_0", "w", "x", "y", "st", **kw, xh="xh")  # type: ignore[arg-type]
    assert d.kernel == "matmul_nv2" and d.views == ("w", "xh", "y", "st")
    assert k.got[-1][1]["defines"] == shaders.nv2_defines("Q8_0", 128, 256, x16=True)
    assert on.matmul("Q8_0", "w", "x", "y", "st", **kw).views[1] == "x"  # type: ignore[arg-type]
    # a type matmul_nv2 does not take by default: matmul_cm2's X_F16 form
    assert on.x16_plan("Q4_K", 8192, 512)
    d = on.matmul("Q4_K", "w", "x", "y", "st", **kw, xh="xh")  # type: ignore[arg-type]
    assert d.kernel == "matmul_cm2" and d.views[1] == "xh" and k.got[-1][1]["defines"]["X_F16"] == 1
    assert attrs.evolve(on, matmul_nv2=False).x16_plan("Q8_0", 8192, 512)  # on matmul_cm2
    # neither kernel, or a matmul_cm3 variant: x itself
    off = attrs.evolve(on, matmul_nv2=False, matmul_cm2=False)
    assert not off.x16_plan("Q4_K", 8192, 512)
    assert off.matmul("Q4_K", "w", "x", "y", "st", **kw, xh="xh").views[1] == "x"  # type: ignore[arg-type]
    assert not attrs.evolve(on, matmul_cm2_variant=shaders.cm3_variant("v")).x16_plan("Q4_K", 8192, 512)


def test_matmul_nv2_is_the_default(env: Env, nv2: Ops, monkeypatch: pytest.MonkeyPatch) -> None:
    """With cooperative matrices on (as the backend builds Ops), the dense products take
    matmul_nv2; TRIO_LLM_MATMUL_NV2=0 (``matmul_nv2=False``) gives matmul_cm2 back."""
    monkeypatch.delenv("TRIO_LLM_MATMUL_NV2", raising=False)
    base = Ops(env.ops.kernels, subgroup=env.ops.subgroup, coopmat=True)
    a = {"n_in": 512, "n_rows": 256, "x_stride": 512, "y_stride": 256, "cap": 64}
    w, xv, y, st = env.zeros(256 * 512, np.uint16), env.zeros(64 * 512), env.zeros(64 * 256), env.step([0] * 64)
    assert base.matmul("F16", w, xv, y, st, **a).kernel.name == "matmul_nv2"
    assert attrs.evolve(base, matmul_nv2=False).matmul("F16", w, xv, y, st, **a).kernel.name == "matmul_cm2"


def test_prefill_on_f16_activations_through_the_backend(env: Env, nv2: Ops, model_path,  # type: ignore[no-untyped-def]
                                                        monkeypatch: pytest.MonkeyPatch, f32_activations: None) -> None:
    """TRIO_LLM_MATMUL_X16=1 through the backend: the 32-token bucket converts each distinct
    product input once (to_f16) and its matmul_nv2 products read that copy; prefills of a
    Q8_0 file (plain, and with its Q8_0 decoded to f16 rows first: TRIO_LLM_MATMUL_DEQUANT)
    against numpy's logits within the f16 rounding."""
    from test_vulkan_model import F32_KV, _prefill_within_f16
    from trio_llm.engine.reference import NumpyBackend
    from trio_llm.graph import OUTPUTS
    from trio_llm.model.gguf import load_gguf
    from trio_llm.vulkan.backend import VulkanBackend
    from trio_llm.vulkan.graph import Dispatch

    monkeypatch.setenv("TRIO_LLM_MATMUL_X16", "1")
    monkeypatch.setenv("TRIO_LLM_MATMUL_DEQUANT_MIN", "16")
    model = load_gguf(model_path("tiny-qwen3", "Q8_0"))
    for dequant in ("0", "Q8_0"):
        monkeypatch.setenv("TRIO_LLM_MATMUL_DEQUANT", dequant)
        ref = NumpyBackend(model, n_ctx=64, n_seq=2, **F32_KV)
        vk = VulkanBackend(model, n_ctx=64, n_seq=2, **F32_KV)
        try:
            ops = [op for op in vk.lowered(32) if isinstance(op, Dispatch)]
            conv = [op for op in ops if op.kernel.name == "to_f16"]
            inputs = {n.inputs[0].id for n in vk._ir.nodes if n.op == "linear" and n.inputs[0].shape[0] != OUTPUTS}
            assert 0 < len(conv) <= len(inputs)
            xh = vk._act.bufs["xh"]
            mm = [op for op in ops if op.kernel.name == "matmul_nv2"]
            assert mm and all(op.views[1].buffer is xh for op in mm)
            _prefill_within_f16(vk, ref, "to_f16", (), [])
        finally:
            vk.close()
            ref.close()


def test_x16_lowering_on_emulated_cm2(model_path, monkeypatch: pytest.MonkeyPatch,  # type: ignore[no-untyped-def]
                                     f32_activations: None) -> None:
    """Everywhere (lavapipe too), through the backend with TRIO_LLM_MATMUL_X16=1 and every
    dense product on matmul_cm2 (emulated; the xh scratch made, which x16_scratch does
    only where cooperative matrices are on): the 32-token bucket converts each distinct
    token-row product input once, each matmul_cm2 reads that copy, the decode buckets
    convert nothing, and prefills give numpy's logits within the f16 rounding."""
    from test_vulkan_model import F32_KV, _prefill_within_f16
    from trio_llm.engine.reference import NumpyBackend
    from trio_llm.graph import OUTPUTS
    from trio_llm.model.gguf import load_gguf
    from trio_llm.vulkan import backend as vkbackend
    from trio_llm.vulkan.backend import VulkanBackend
    from trio_llm.vulkan.graph import Dispatch

    def scratch(graph: Any, ops: Ops, cap: int) -> dict[str, tuple[int, str, str]]:
        n = max(int(nd.inputs[1].shape[1]) for nd in graph.nodes if nd.op == "linear")
        return {"xh": (2 * cap * n, "compute", "device")}

    monkeypatch.setattr(vkbackend, "x16_scratch", scratch)
    monkeypatch.setenv("TRIO_LLM_MATMUL_X16", "1")
    model = load_gguf(model_path("tiny-qwen3", "Q4_K_M"))
    ref = NumpyBackend(model, n_ctx=64, n_seq=2, **F32_KV)
    vk = VulkanBackend(model, n_ctx=64, n_seq=2, **F32_KV)
    vk._ops.matmul_cm2_emulate = 32
    try:
        ops = [op for op in vk.lowered(32) if isinstance(op, Dispatch)]
        conv = [op for op in ops if op.kernel.name == "to_f16"]
        inputs = [nd.inputs[0] for nd in vk._ir.nodes if nd.op == "linear" and nd.inputs[0].shape[0] != OUTPUTS]
        assert len(conv) == len({t.id for t in inputs}) and len(inputs) > len(conv)
        xh = vk._act.bufs["xh"]
        mm = [op for op in ops if op.kernel.name == "matmul_cm2"]
        assert len(mm) >= len(inputs) and all(op.views[1].buffer is xh for op in mm)
        for bucket in (1, 8):
            assert not any(isinstance(op, Dispatch) and op.kernel.name == "to_f16" for op in vk.lowered(bucket))
        _prefill_within_f16(vk, ref, "to_f16", ("matmul",), [])
    finally:
        vk.close()
        ref.close()

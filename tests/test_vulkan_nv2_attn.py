"""attn_prefill_nv2.comp (prefill attention on VK_NV_cooperative_matrix2: workgroup-scope
matrices, row reductions and per-element functions on the accumulators, tensor-addressed
loads of an f16 cache) against numpy, and where ``Ops`` chooses it.

Everywhere slangpy's glslang is installed: every prebuilt variant compiles and passes
``spirv-val --target-env vulkan1.3``, and ``Ops.prefill_nv2_plan`` (pure Python, on a
stand-in device) chooses as documented. On a device with ``nv_coopmat2`` (NVIDIA; lavapipe
has none, so these skip here: ``bash bench/h200.sh nv2attn`` runs them): the op held to
numpy over f16-rounded q, K and V as attn_prefill_cm2's tests hold it (2e-3 of V's
largest value), for head dims 64/128/256, GQA 1/2/4/8, every cache type, its three forms
(K and V staged with and without the register prefetch, tensor-addressed from an f16
cache), several tiles, token counts off the tile, prefixes, several sequences in a tile,
windows over ring caches (with the tensor layout's wrap), key splits with the combine,
cache rows past the live keys holding NaN, and the tiny model's prefill through the
backend against attn_prefill_cm2's.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import attrs
import numpy as np
import pytest

from test_nv2_compiler import needs_compiler, validate_spirv
from test_vulkan_attn_prefill import batch, run_prefill
from test_vulkan_model import F32_KV, _prefill_within_f16
from test_vulkan_ops import Env, open_env
from trio_llm.engine.backend import SeqBatch
from trio_llm.engine.reference import NumpyBackend
from trio_llm.errors import ConfigError
from trio_llm.model.gguf import load_gguf
from trio_llm.model.kvtypes import KV_TYPES
from trio_llm.vulkan import ops as ops_module
from trio_llm.vulkan import shaders
from trio_llm.vulkan.backend import VulkanBackend
from trio_llm.vulkan.memory import View
from trio_llm.vulkan.ops import (
    PREFILL_NV2_FORMS,
    Nv2AttnPlan,
    Ops,
    heads_per_group,
    prefill_nv2_default,
    prefill_nv2_shared,
)
from trio_llm.vulkan.shaders import attn_variant

NO_NV2 = "needs VK_NV_cooperative_matrix2 (lavapipe has none)"
TYPES = list(KV_TYPES)


# --- everywhere: the variants compile and validate; the plan -------------------------

def attn_variants() -> list[dict[str, object]]:
    return [d for name, d in shaders.nv2_variants() if name == "attn_prefill_nv2"]


@needs_compiler
@pytest.mark.parametrize("defines", attn_variants(), ids=lambda d: "-".join(f"{k}{v}" for k, v in d.items()))
def test_variants_compile_and_validate(defines: dict[str, object], tmp_path: Path) -> None:
    """Each variant ``compile-shaders`` prebuilds (every cache type, and the f16 cache's
    tensor-addressed form) compiles and is valid SPIR-V for Vulkan 1.3."""
    assert "CooperativeMatrixReductionsNV" in validate_spirv(shaders.spirv("attn_prefill_nv2", defines), tmp_path)


def test_prebuilt_set() -> None:
    """Every cache type with itself, and NV2_DIRECT only for f16."""
    got = attn_variants()
    assert len(got) == len(shaders.KV_CODES) + 1
    assert {"K_TYPE": 1, "V_TYPE": 1, "NV2_DIRECT": 1} in got
    assert all(d.get("K_TYPE", 0) == d.get("V_TYPE", 0) for d in got)


def stand_in(nv2: bool = True, max_wg: int = 1024, shared: int = 49152) -> Ops:
    """Ops on a stand-in device (what the plan reads of it), cooperative matrices on."""
    dev = SimpleNamespace(nv_coopmat2=nv2, nv_coopmat2_max_wg=max_wg if nv2 else 0,
                          limits=SimpleNamespace(max_shared_memory=shared), name="stand-in")
    return Ops(SimpleNamespace(device=dev), coopmat=True, prefill_nv2=True,  # type: ignore[arg-type]
               prefill_nv2_tile=None, prefill_nv2_form="pf", prefill_cm2_variant=None)


def test_a_refused_pipeline_falls_back_to_the_khr_kernels(monkeypatch: pytest.MonkeyPatch,
                                                           caplog: pytest.LogCaptureFixture) -> None:
    """A driver that lists the extension but refuses attn_prefill_nv2's pipeline: that
    prefill runs on attn_prefill_cm2 (a warning), and later ones do not try again."""
    from trio_llm.errors import BackendError

    monkeypatch.setattr(ops_module, "_nv2_attn_ready", lambda *_: True)
    asked: list[str] = []

    def get(name: str, **kw: object) -> str:
        asked.append(name)
        if name == "attn_prefill_nv2":
            raise BackendError("create pipeline attn_prefill_nv2: VkErrorUnknown")
        return name

    ops = stand_in()
    ops.kernels.get = get  # type: ignore[attr-defined]
    kw: dict[str, object] = dict(n_head=32, n_head_kv=8, head_dim=64, n_ctx=4096, q_stride=2048, o_stride=2048,
                                 cap=512, k_type="f16", v_type="f16")
    with caplog.at_level("WARNING"):
        d = ops.attention_prefill(None, None, None, None, None, **kw)  # type: ignore[arg-type]
    assert d.kernel == "attn_prefill_cm2" and not ops.prefill_nv2
    assert "attn_prefill_nv2 unavailable" in caplog.text
    asked.clear()
    assert ops.attention_prefill(None, None, None, None, None, **kw).kernel == "attn_prefill_cm2"  # type: ignore[arg-type]
    assert "attn_prefill_nv2" not in asked


def test_plan(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where attn_prefill_nv2 runs: enabled (``prefill_nv2``, ``coopmat``, the device's
    ``nv_coopmat2``), no other kernel asked for explicitly, power-of-two head groups, head
    dims 64/128/256, lanes within the device's workgroup-scope limit, shared memory within
    its limit; the tile forced or the default; "direct" only for f16 K and V (every
    variant taken as prebuilt: ``nv2_ready`` is the device's side)."""
    monkeypatch.setattr(ops_module, "_nv2_attn_ready", lambda *_: True)
    ops = stand_in()
    assert ops.prefill_nv2_plan(32, 8, 64) == Nv2AttnPlan(64, 32, 128, pf=True, direct=False)
    assert ops.prefill_nv2_plan(32, 8, 128) == Nv2AttnPlan(64, 32, 128, pf=True, direct=False)
    assert ops.prefill_nv2_plan(8, 4, 256) == Nv2AttnPlan(64, 32, 256, pf=True, direct=False)
    assert [prefill_nv2_default(hd) for hd in (64, 128, 256)] == [(64, 32, 128), (64, 32, 128), (64, 32, 256)]
    assert stand_in(nv2=False).prefill_nv2_plan(32, 8, 64) is None  # no NV cooperative matrices 2
    assert attrs.evolve(ops, coopmat=False).prefill_nv2_plan(32, 8, 64) is None
    assert attrs.evolve(ops, prefill_nv2=False).prefill_nv2_plan(32, 8, 64) is None  # TRIO_LLM_PREFILL_NV2=0
    assert attrs.evolve(ops, prefill_cm2_emulate=32).prefill_nv2_plan(32, 8, 64) is None
    assert attrs.evolve(ops, prefill_cm_emulate=True).prefill_nv2_plan(32, 8, 64) is None
    assert attrs.evolve(ops, prefill_cm2_variant=attn_variant("v")).prefill_nv2_plan(32, 8, 64) is None
    assert ops.prefill_nv2_plan(12, 2, 64) is None  # a head group of 6
    assert ops.prefill_nv2_plan(32, 8, 64) is not None and ops.prefill_nv2_plan(32, 2, 64) is not None  # 4, 16 -> 8
    for hd in (80, 96, 112, 192, 272):
        assert ops.prefill_nv2_plan(8, 2, hd) is None
    assert stand_in(max_wg=128).prefill_nv2_plan(8, 4, 256) is None  # 256 lanes asked for
    assert stand_in(max_wg=128).prefill_nv2_plan(8, 4, 128) is not None
    assert stand_in(shared=16384).prefill_nv2_plan(8, 4, 128) is None  # 18,688 bytes (32 keys)
    assert prefill_nv2_shared(128, 64, 64) == 36096 and prefill_nv2_shared(64, 64, 64) == 19712
    assert prefill_nv2_shared(256, 64, 32) == 35072 and prefill_nv2_shared(128, 64, 64, direct=True) == 1280
    forced = attrs.evolve(ops, prefill_nv2_tile=(128, 32, 256))
    assert forced.prefill_nv2_plan(8, 2, 64) == Nv2AttnPlan(128, 32, 256, pf=True, direct=False)
    for form in PREFILL_NV2_FORMS:
        f = attrs.evolve(ops, prefill_nv2_form=form)
        assert f.prefill_nv2_plan(8, 2, 64) == Nv2AttnPlan(64, 32, 128, pf=form != "staged", direct=form == "direct")
        assert not f.prefill_nv2_plan(8, 2, 64, "q8_0", "q8_0").direct  # type: ignore[union-attr]
        assert not f.prefill_nv2_plan(8, 2, 64, "f16", "q8_0").direct  # type: ignore[union-attr]
    mma = attrs.evolve(ops, prefill_nv2_form="direct+mma")
    assert mma.prefill_nv2_plan(8, 2, 64) == Nv2AttnPlan(64, 32, 128, pf=True, direct=True, mma_sum=True)
    assert mma.prefill_nv2_plan(8, 2, 64, "q8_0", "q8_0") == Nv2AttnPlan(64, 32, 128, pf=True, direct=False,
                                                                          mma_sum=True)
    lazy = attrs.evolve(ops, prefill_nv2_form="pf+lsum").prefill_nv2_plan(8, 2, 64)
    assert lazy == Nv2AttnPlan(64, 32, 128, pf=True, direct=False, lazy_sum=True) and lazy.rsum_mode == 2
    assert mma.prefill_nv2_plan(8, 2, 64).rsum_mode == 1 and ops.prefill_nv2_plan(8, 2, 64).rsum_mode == 0  # type: ignore[union-attr]
    with pytest.raises(ValueError):
        attrs.evolve(ops, prefill_nv2_form="pf+fast")


def test_env_knobs(monkeypatch: pytest.MonkeyPatch) -> None:
    """TRIO_LLM_PREFILL_NV2 (on by default since its GPU tests passed on the H200; =0
    off), TRIO_LLM_PREFILL_NV2_TILE, ..._FORM (default pf+mma, the fastest there)."""
    for var in ("TRIO_LLM_PREFILL_NV2", "TRIO_LLM_PREFILL_NV2_TILE", "TRIO_LLM_PREFILL_NV2_FORM"):
        monkeypatch.delenv(var, raising=False)
    kernels = SimpleNamespace(device=None)
    assert Ops(kernels).prefill_nv2 and Ops(kernels).prefill_nv2_tile is None  # type: ignore[arg-type]
    assert Ops(kernels).prefill_nv2_form == "pf+mma"  # type: ignore[arg-type]
    monkeypatch.setenv("TRIO_LLM_PREFILL_NV2", "1")
    assert Ops(kernels).prefill_nv2  # type: ignore[arg-type]
    monkeypatch.setenv("TRIO_LLM_PREFILL_NV2", "0")
    monkeypatch.setenv("TRIO_LLM_PREFILL_NV2_TILE", "128x32x256")
    monkeypatch.setenv("TRIO_LLM_PREFILL_NV2_FORM", "direct")
    o = Ops(kernels)  # type: ignore[arg-type]
    assert not o.prefill_nv2 and o.prefill_nv2_tile == (128, 32, 256) and o.prefill_nv2_form == "direct"
    monkeypatch.setenv("TRIO_LLM_PREFILL_NV2_FORM", "staged+mma")
    assert Ops(kernels).prefill_nv2_form == "staged+mma"  # type: ignore[arg-type]
    for bad in ("64x64", "64x48x128", "64x64x100"):
        monkeypatch.setenv("TRIO_LLM_PREFILL_NV2_TILE", bad)
        with pytest.raises(ConfigError, match="TRIO_LLM_PREFILL_NV2_TILE"):
            Ops(kernels)  # type: ignore[arg-type]
    monkeypatch.setenv("TRIO_LLM_PREFILL_NV2_TILE", "")
    monkeypatch.setenv("TRIO_LLM_PREFILL_NV2_FORM", "fast")
    with pytest.raises(ConfigError, match="TRIO_LLM_PREFILL_NV2_FORM"):
        Ops(kernels)  # type: ignore[arg-type]


# --- on a device with VK_NV_cooperative_matrix2 --------------------------------------

env = pytest.fixture(scope="module", name="env")(open_env)


@pytest.fixture(name="nv2")
def nv2_fixture(env: Env) -> Ops:
    if not env.device.nv_coopmat2:
        pytest.skip(NO_NV2)
    return attrs.evolve(env.ops, coopmat=True, prefill_nv2=True, prefill_nv2_tile=None, prefill_nv2_form="pf",
                        prefill_cm2_variant=None)


def check(env: Env, ops: Ops, *, hd: int, n_head: int, n_kv: int, pos: list[int], seq: list[int], n_ctx: int,
          k_type: str = "f16", v_type: str | None = None, n_swa: int = 0, scale: float | None = None,
          seed: int = 0, cap: int | None = None, n_split: int = 1, nan_past: bool = False) -> None:
    """attn_prefill_nv2 (asserted to be the kernel chosen) against numpy over f16-rounded
    q * scale, K and V. ``nan_past``: each sequence's cache rows past its last position
    hold NaN (f16 caches: what a fresh allocation may hold), which no output may see."""
    n_seq = max(seq) + 1

    def nan_rows(kc: View, vc: View) -> None:
        assert k_type == (v_type or k_type) == "f16"
        last = {s: max(p for p, t in zip(pos, seq, strict=True) if t == s) for s in set(seq)}
        for view in (kc, vc):
            assert view.buffer.array is not None
            rows = view.buffer.array[view.offset: view.offset + view.size].view(np.uint16)
            rows = rows.reshape(n_seq, n_ctx, n_kv * hd)
            for sq, p in last.items():
                if p + 1 < n_ctx:
                    rows[sq, p + 1:] = 0x7E00  # f16 NaN

    r = run_prefill(env, ops, hd=hd, n_head=n_head, n_kv=n_kv, pos=pos, seq=seq, n_ctx=n_ctx, k_type=k_type,
                    v_type=v_type, n_swa=n_swa, scale=scale, seed=seed, cap=cap, n_split=n_split,
                    caches=nan_rows if nan_past else None)
    assert r.kernel == "attn_prefill_nv2"
    r.assert_f16_products(pos, seq, n_kv, n_swa)


def rows_of(ops: Ops, n_head: int, n_kv: int, hd: int) -> tuple[int, int]:
    """(heads per work group, tokens per work group) of the plan."""
    plan = ops.prefill_nv2_plan(n_head, n_kv, hd)
    assert plan is not None
    g = heads_per_group(n_head, n_kv)
    return g, plan.rows // g


@pytest.mark.parametrize("hd", [64, 128, 256])
@pytest.mark.parametrize("gqa", [1, 2, 4, 8])
def test_head_dims_and_gqa(env: Env, nv2: Ops, hd: int, gqa: int) -> None:
    """From position 0 (diagonal tiles only), after a prefix of 70 (whole visible tiles
    first), a 2-token sequence; no token count a multiple of the tile."""
    n_kv = 1 if hd == 256 else 2
    _, bq = rows_of(nv2, gqa * n_kv, n_kv, hd)
    pos, seq = batch((0, 0, 2 * bq + 3), (1, 70, bq + 5), (2, 7, 2))
    check(env, nv2, hd=hd, n_head=gqa * n_kv, n_kv=n_kv, pos=pos, seq=seq, n_ctx=200, seed=hd + gqa)


@pytest.mark.parametrize("name", TYPES)
def test_every_kv_type(env: Env, nv2: Ops, name: str) -> None:
    """41 tokens after a prefix of 37 and a second sequence from 0, in each cache type
    (their decoding is kv_read.glsl's, staged into shared memory)."""
    pos, seq = batch((0, 37, 41), (1, 0, 9))
    check(env, nv2, hd=64, n_head=4, n_kv=2, pos=pos, seq=seq, n_ctx=96, k_type=name, seed=TYPES.index(name))


def test_mixed_types_fall_back_or_run(env: Env, nv2: Ops) -> None:
    """K and V of different types: not prebuilt, so without the compiler (the H200's
    image) the plan falls back to attn_prefill_cm2; with it, they compile and run."""
    ready = shaders.nv2_compiler() is not None
    assert (nv2.prefill_nv2_plan(4, 2, 64, "q8_0", "f16") is not None) == ready
    if ready:
        pos, seq = batch((0, 20, 30))
        check(env, nv2, hd=64, n_head=4, n_kv=2, pos=pos, seq=seq, n_ctx=64, k_type="q8_0", v_type="f16", seed=9)


@pytest.mark.parametrize("form", [*PREFILL_NV2_FORMS, "pf+mma", "direct+mma", "pf+lsum", "direct+lsum"])
@pytest.mark.parametrize("hd", [64, 128, 256])
def test_forms(env: Env, nv2: Ops, form: str, hd: int) -> None:
    """Each form (register prefetch, staged at each tile's start, tensor-addressed from
    the f16 cache; the rows' sums by a product with ones, or per column and added up at
    the end) with prefixes, three sequences and a partial last key tile."""
    ops = attrs.evolve(nv2, prefill_nv2_form=form)
    plan = ops.prefill_nv2_plan(8, 2, hd)
    assert plan is not None and plan.direct == form.startswith("direct") and plan.pf == (form != "staged")
    assert plan.mma_sum == form.endswith("+mma") and plan.lazy_sum == form.endswith("+lsum")
    pos, seq = batch((0, 0, 70), (1, 130, 21), (2, 65, 3))
    check(env, ops, hd=hd, n_head=8, n_kv=2, pos=pos, seq=seq, n_ctx=256, seed=hd + len(form))


#: (rows, keys, lanes) the H200 sweep times (bench/h200.sh nv2attn)
TILES = [(64, 64, 128), (64, 32, 128), (128, 64, 256), (128, 32, 256), (64, 64, 256), (32, 64, 128)]


@pytest.mark.parametrize("tile", TILES, ids=lambda t: "x".join(map(str, t)))
def test_tiles(env: Env, nv2: Ops, tile: tuple[int, int, int]) -> None:
    """Each tile of the sweep (rows per work group, keys per tile, lanes): head_dim 64
    with GQA 4 in the prefetch form, 128 with GQA 8 in the tensor-addressed one."""
    if tile[2] > env.device.nv_coopmat2_max_wg:
        pytest.skip(f"{tile[2]} lanes: the device takes workgroup-scope matrices up to {env.device.nv_coopmat2_max_wg}")
    for form, hd, gqa in (("pf", 64, 4), ("direct", 128, 8)):
        ops = attrs.evolve(nv2, prefill_nv2_tile=tile, prefill_nv2_form=form)
        pos, seq = batch((0, 33, 150), (1, 0, 20))
        check(env, ops, hd=hd, n_head=gqa * 2, n_kv=2, pos=pos, seq=seq, n_ctx=256, seed=tile[0] + hd)


@pytest.mark.parametrize("form", ["pf", "direct"])
def test_tiles_straddle_sequences(env: Env, nv2: Ops, form: str) -> None:
    """Five short sequences out of position order in one tile (a pass each), a cap
    larger than the batch."""
    ops = attrs.evolve(nv2, prefill_nv2_form=form)
    pos, seq = batch((2, 5, 3), (0, 0, 7), (4, 50, 11), (1, 33, 1), (3, 90, 6))
    check(env, ops, hd=64, n_head=8, n_kv=2, pos=pos, seq=seq, n_ctx=100, seed=3, cap=64)


@pytest.mark.parametrize("form", ["pf", "direct"])
def test_sliding_window_ring(env: Env, nv2: Ops, form: str) -> None:
    """gemma3's sliding-window layers: a window of 40 over a ring of 70 rows, positions
    far past the ring's size (key tiles that wrap around its end: the tensor layout's
    Repeat in the direct form), a batch from 0 beside it, gemma3's scale; q8_0 too
    (staged); a window wider than the positions (the causal mask)."""
    ops = attrs.evolve(nv2, prefill_nv2_form=form)
    pos, seq = batch((0, 200, 30), (1, 0, 45))
    for t in ("f16", "q8_0"):
        check(env, ops, hd=256, n_head=4, n_kv=1, pos=pos, seq=seq, n_ctx=70, n_swa=40, k_type=t,
              scale=1.0 / np.sqrt(160.0), seed=4)
    pos, seq = batch((0, 130, 40))
    check(env, ops, hd=64, n_head=4, n_kv=2, pos=pos, seq=seq, n_ctx=72, n_swa=33, seed=5)
    pos, seq = batch((0, 0, 40))
    check(env, ops, hd=128, n_head=2, n_kv=1, pos=pos, seq=seq, n_ctx=64, n_swa=512, seed=6)


@pytest.mark.parametrize("n_split", [2, 3, 5])
@pytest.mark.parametrize("form", ["pf", "direct", "pf+lsum"])
def test_split(env: Env, nv2: Ops, n_split: int, form: str) -> None:
    """Keys split over work groups and added up by attn_combine: a long prefix (splits
    of several tiles, the last one short), a short sequence (splits with no keys at all),
    a window over a ring; head dims 64 and 128."""
    ops = attrs.evolve(nv2, prefill_nv2_form=form)
    pos, seq = batch((0, 150, 37), (1, 0, 5), (2, 60, 20))
    check(env, ops, hd=64, n_head=8, n_kv=2, pos=pos, seq=seq, n_ctx=200, seed=n_split, n_split=n_split)
    pos, seq = batch((0, 200, 30), (1, 0, 45))
    check(env, ops, hd=128, n_head=8, n_kv=2, pos=pos, seq=seq, n_ctx=70, n_swa=40, seed=n_split, n_split=n_split)
    pos, seq = batch((0, 300, 70))
    check(env, ops, hd=128, n_head=16, n_kv=2, pos=pos, seq=seq, n_ctx=400, seed=n_split, n_split=n_split)


@pytest.mark.parametrize("form", PREFILL_NV2_FORMS)
def test_rows_past_the_keys_hold_nan(env: Env, nv2: Ops, form: str) -> None:
    """Cache rows past each sequence's last position hold NaN (an f16 cache fresh from
    the allocator may): the last key tile reads them (the direct form) or stops before
    them (staged), and none reaches an output; a split too."""
    ops = attrs.evolve(nv2, prefill_nv2_form=form)
    pos, seq = batch((0, 0, 45), (1, 20, 30))
    check(env, ops, hd=128, n_head=8, n_kv=2, pos=pos, seq=seq, n_ctx=256, seed=11, nan_past=True)
    check(env, ops, hd=64, n_head=8, n_kv=2, pos=pos, seq=seq, n_ctx=256, seed=12, nan_past=True, n_split=2)


@pytest.mark.parametrize(("hd", "gqa"), [(64, 4), (128, 4), (256, 2)])
def test_long_prompt(env: Env, nv2: Ops, hd: int, gqa: int) -> None:
    """A 512-token chunk after a prefix of 1,500 (mostly whole visible tiles), unsplit
    and in 4 splits: the bulk of a real prefill."""
    pos, seq = batch((0, 1500, 512))
    for n_split in (1, 4):
        check(env, nv2, hd=hd, n_head=2 * gqa, n_kv=2, pos=pos, seq=seq, n_ctx=2048, seed=hd, n_split=n_split)


def _own_matmuls(ops: Ops) -> Ops:
    """``ops`` with the dense products off matmul_nv2 where it exists (the other NV
    kernel: its own tests hold it; a failure here should be this kernel's)."""
    return attrs.evolve(ops, matmul_nv2=False) if hasattr(ops, "matmul_nv2") else ops


@pytest.mark.usefixtures("f32_activations")
def test_prefill_against_numpy(env: Env, model_path) -> None:  # type: ignore[no-untyped-def]
    """The tiny model's prefills through the backend (f32 cache): the 32-token bucket's
    graph runs attn_prefill_nv2 and no other prefill attention kernel; two sequences in
    one 17-token batch, a 40-token one after a cached prefix of 12, then a decode step:
    numpy's logits within the f16 rounding (test_vulkan_model.py's bound). On f32
    activations, as that file's: the output head of two rows is a 2-column matvec, whose
    int8 activations (the default) moved the logits by 6.5e-3 on the H200 (2026-12-05)."""
    if not env.device.nv_coopmat2:
        pytest.skip(NO_NV2)
    model = load_gguf(model_path("tiny", "Q8_0"))
    ref = NumpyBackend(model, n_ctx=64, n_seq=2, **F32_KV)
    vk = VulkanBackend(model, n_ctx=64, n_seq=2, **F32_KV)
    try:
        vk._ops = attrs.evolve(_own_matmuls(vk._ops), prefill_nv2=True)  # off by default (TRIO_LLM_PREFILL_NV2)
        _prefill_within_f16(vk, ref, "attn_prefill_nv2",
                            ("attn_prefill", "attn_prefill_cm", "attn_prefill_cm2", "attn_prefill_cm3"),
                            [[SeqBatch(0, np.array([7], np.int32), 52)]])
    finally:
        vk.close()
        ref.close()


def test_prefill_through_the_backend(env: Env, model_path) -> None:  # type: ignore[no-untyped-def]
    """The tiny model's 600-token prompt (f16 cache, then q8_0) through the backend with
    attn_prefill_nv2 gives attn_prefill_cm2's logits within f16 rounding, and the graph
    did record it."""
    if not env.device.nv_coopmat2:
        pytest.skip(NO_NV2)
    model = load_gguf(model_path("tiny", "F16"))
    cfg = model.config
    prompt = np.random.default_rng(5).integers(0, cfg.n_vocab, 600).astype(np.int32)
    for ctype in ("f16", "q8_0"):
        got = []
        for on in (True, False):
            vk = VulkanBackend(model, n_ctx=2048, n_seq=1, cache_type_k=ctype, cache_type_v=ctype)
            try:
                vk._ops = attrs.evolve(_own_matmuls(vk._ops), prefill_nv2=on)
                assert (vk._ops.prefill_nv2_plan(cfg.n_head, cfg.n_head_kv, cfg.head_dim, ctype, ctype)
                        is not None) == on
                got.append(vk.forward([SeqBatch(0, prompt, 0)])[0])
            finally:
                vk.close()
        np.testing.assert_allclose(got[0], got[1], atol=2e-3 * np.abs(got[1]).max(), rtol=0)

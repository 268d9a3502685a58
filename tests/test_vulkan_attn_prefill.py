"""Prefill attention, tiled (``attention_prefill``, attn_prefill.comp), against numpy on
the device: every KV cache type, head dims 64/128/256, GQA ratios 1/2/4/8, token counts
that are not multiples of the tile, a prefix already in the cache (queries from
position p0 > 0: chunked prefill, prompt-cache reuse), several sequences in one batch
(tiles that straddle them), sliding windows over a ring cache, a softmax scale of the
model's own (gemma3). The positions are chosen so that each case has fully visible key
tiles (the mask skipped), diagonal tiles and, with windows, tiles before the window.

Each case runs on every path: ``scalar`` (attn_prefill.comp, f32, within 3e-5 of the
float64 reference) and ``coopmat`` / ``coopmat-staged`` (attn_prefill_cm.comp on
cooperative matrices, the output in accumulators or staged per block: q,
K, V and the softmax weights in f16, so it is held to numpy over f16-rounded q, K and
V within 2e-3), which needs a device with 16x16x16 f16 cooperative matrices and is
skipped where there are none (lavapipe); ``bash bench/h200.sh verify`` runs it. So is
``coopmat2`` (attn_prefill_cm2.comp, each subgroup owning 16 query rows, opt-in with
TRIO_LLM_PREFILL_CM2=1). Both coopmat kernels also run here in their emulated forms
(CM_EMULATE: the products by plain lanes, everything else as on a GPU), the second one
for emulated subgroups of 32 and 64 lanes and 16, 32 and 64 keys per tile. The
``coopmat3*`` rows run attn_prefill_cm3.comp (TRIO_LLM_PREFILL_CM2_VARIANT's variants) on
a GPU; ``test_cm3_*`` its emulated form here. ``test_latent_*``: the LATENT form for a
latent cache (deepseek2's MLA: K rows of 576 or 288, V the first 512 or 256 values of
each), on the scalar kernel on every device, its tiles, refusals and prebuilt variants.
``test_noncausal_*``: the NONCAUSAL form (gemma3's image rows: a row sees up to its
step's STEP_VIS, the window's low bound still its own position) against numpy and, on
the same inputs, far from the causal kernel's output wherever a row sees past itself."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs
import numpy as np
import pytest

from test_vulkan_kv import _typed_cache, attention_inputs
from test_vulkan_ops import Env, open_env
from trio_llm.engine.backend import SeqBatch
from trio_llm.engine.reference import attend
from trio_llm.errors import ConfigError
from trio_llm.model.gguf import load_gguf
from trio_llm.model.kvtypes import KV_TYPES
from trio_llm.vulkan import shaders
from trio_llm.vulkan.backend import VulkanBackend
from trio_llm.vulkan.graph import Barrier, Op
from trio_llm.vulkan.memory import View
from trio_llm.vulkan.ops import (
    PREFILL_CM2_KEYS,
    Ops,
    attention_part_floats,
    fill_step,
    prefill_cm2_prefer,
    prefill_cm2_shared,
    prefill_cm3_choose,
    prefill_cm3_shared,
    prefill_latent_pack,
    prefill_shared,
    prefill_tile,
)
from trio_llm.vulkan.shaders import ATTN_SWEEP, AttnVariant, attn_variant

pytestmark = pytest.mark.vulkan

TYPES = list(KV_TYPES)


env = pytest.fixture(scope="module", name="env")(open_env)


#: the ops fixture's attn_prefill_cm3 rows (on a GPU only): variants of the H200 sweep
CM3_FIXTURE = {"coopmat3": "v", "coopmat3-db-k64": "v+db+k64", "coopmat3-rb2-db-lr": "v+rb2+db+lr",
               "coopmat3-db-lr-pr": "v+db+lr+pr"}


@pytest.fixture(params=["scalar", "coopmat", "coopmat-staged", "coopmat2", *CM3_FIXTURE])
def ops(request: pytest.FixtureRequest, env: Env) -> Ops:
    if request.param == "scalar":
        return env.ops
    if not env.device.coopmat:
        pytest.skip(f"{env.device.name} reports no 16x16x16 f16 cooperative matrices (lavapipe has none)")
    cm3 = request.param in CM3_FIXTURE
    # prefill_nv2 off: these rows test the KHR kernels (attn_prefill_nv2 has its own file)
    return attrs.evolve(env.ops, coopmat=True, prefill_cm=True, prefill_cm_stage=request.param == "coopmat-staged",
                        prefill_nv2=False, prefill_cm2=request.param == "coopmat2" or cm3,
                        prefill_cm2_variant=attn_variant(CM3_FIXTURE[request.param]) if cm3 else None)


def np_attention(q, k, v, pos, seq, n_head_kv, n_swa, scale, hi=None):  # type: ignore[no-untyped-def]
    """q [ntok, n_head, hd]; k, v [n_seq, n_ctx, n_head_kv, hd (v: up to hd)], position p at row
    p % n_ctx; token t sees positions [pos - n_swa + 1, pos] (all of [0, pos] without
    a window), in float64; ``hi``: up to hi[t] instead of pos (STEP_VIS: the rows of a
    non-causal entry), the window's low bound still from pos."""
    ntok, n_head, hd = q.shape
    n_ctx = k.shape[1]
    g = n_head // n_head_kv
    hi = pos if hi is None else hi
    out = np.zeros((ntok, n_head, v.shape[-1]))  # V as wide as K, or narrower (a latent cache's)
    for t in range(ntok):
        lo = max(0, pos[t] - n_swa + 1) if n_swa else 0
        assert hi[t] - lo < n_ctx  # the ring holds every position the row sees
        r = np.arange(lo, hi[t] + 1) % n_ctx
        for h in range(n_head):
            kk = k[seq[t], r, h // g].astype(np.float64)
            vv = v[seq[t], r, h // g].astype(np.float64)
            s = kk @ q[t, h].astype(np.float64) * scale
            p = np.exp(s - s.max())
            out[t, h] = p @ vv / p.sum()
    return out


def batch(*runs: tuple[int, int, int]) -> tuple[list[int], list[int]]:
    """Positions and sequence ids of runs (seq, p0, n): tokens p0..p0+n-1 of seq."""
    pos = [p for _, p0, n in runs for p in range(p0, p0 + n)]
    seq = [s for s, _, n in runs for _ in range(n)]
    return pos, seq


@attrs.frozen
class PrefillRun:
    """What ``run_prefill`` ran and what to hold it to."""

    kernel: str  # the prefill attention kernel Ops chose
    got: np.ndarray  # [ntok, n_head, hd]
    q: np.ndarray
    kh: np.ndarray  # the caches as numpy reads them
    vh: np.ndarray
    scale: float

    def assert_f16_products(self, pos: list[int], seq: list[int], n_kv: int, n_swa: int) -> None:
        """The output against numpy over f16-rounded q * scale, K and V (the products of
        the cooperative-matrix kernels), within 2e-3 of V's largest value."""
        f16 = np.float16
        want = np_attention((self.q * np.float32(self.scale)).astype(f16), self.kh.astype(f16),
                            self.vh.astype(f16), pos, seq, n_kv, n_swa, 1.0)
        np.testing.assert_allclose(self.got, want, atol=2e-3 * np.abs(self.vh).max(), rtol=0)


def run_prefill(env: Env, ops: Ops, *, hd: int, n_head: int, n_kv: int, pos: list[int], seq: list[int], n_ctx: int,
                k_type: str = "f16", v_type: str | None = None, n_swa: int = 0, scale: float | None = None,
                seed: int = 0, cap: int | None = None, emulate: tuple[int, int] | None = None, n_split: int = 1,
                caches: Callable[[View, View], None] | None = None, vis: list[int] | None = None,
                symmetric: bool = False) -> PrefillRun:
    """``ops.attention_prefill`` (then ``attention_combine`` where split) over random q and
    caches (``attention_inputs``; ``caches`` may write into the K and V views first), the
    output and the partials starting as NaN; ``vis``: its NONCAUSAL form, each token's
    highest visible position in the step buffer (``fill_step``'s ``vis``, as the backend
    writes it); ``symmetric``: that form's SYMMETRIC variant (gemma-embedding's window)."""
    v_type = k_type if v_type is None else v_type
    ntok, n_seq = len(pos), max(seq) + 1
    q, kc, kh, vc, vh = attention_inputs(env, ntok=ntok, n_seq=n_seq, n_ctx=n_ctx, n_head=n_head, n_kv=n_kv,
                                         hd=hd, k_type=k_type, v_type=v_type, seed=seed)
    if caches is not None:
        caches(kc, vc)
    qv, o = env.put(q), env.put(np.full(q.size, np.nan, np.float32))
    st = env.step([0] * ntok, pos, seq)
    if vis is not None:
        assert st.buffer.array is not None
        fill_step(st.buffer.array.view(np.uint32), np.zeros(ntok, np.uint32), np.asarray(pos, np.uint32),
                  np.asarray(seq, np.uint32), np.zeros(0, np.uint32), np.asarray(vis, np.uint32))
    s = 1.0 / np.sqrt(hd) if scale is None else scale
    cap = cap or ntok
    part = env.put(np.full(attention_part_floats(cap, n_head, hd, n_split), np.nan, np.float32))
    run: list[Op] = [ops.attention_prefill(
        qv, kc, vc, o, st, n_head=n_head, n_head_kv=n_kv, head_dim=hd, n_ctx=n_ctx, q_stride=n_head * hd,
        o_stride=n_head * hd, cap=cap, scale=s, k_type=k_type, v_type=v_type, n_swa=n_swa,
        emulate_cm=emulate, part=part, n_split=n_split, min_tiles=1, noncausal=vis is not None,
        symmetric=symmetric)]
    if n_split > 1:
        run += [Barrier(), ops.attention_combine(part, o, st, n_head=n_head, head_dim=hd, n_split=n_split,
                                                 o_stride=n_head * hd, cap=cap)]
    env.run(run)
    return PrefillRun(run[0].kernel.name, env.get(o).reshape(q.shape), q, kh, vh, float(s))  # type: ignore[union-attr]


def check(env: Env, ops: Ops, *, hd: int, n_head: int, n_kv: int, pos: list[int], seq: list[int], n_ctx: int,
          k_type: str = "f16", v_type: str | None = None, n_swa: int = 0, scale: float | None = None,
          seed: int = 0, cap: int | None = None, emulate: tuple[int, int] | None = None,
          n_split: int = 1) -> None:
    r = run_prefill(env, ops, hd=hd, n_head=n_head, n_kv=n_kv, pos=pos, seq=seq, n_ctx=n_ctx, k_type=k_type,
                    v_type=v_type, n_swa=n_swa, scale=scale, seed=seed, cap=cap, emulate=emulate, n_split=n_split)
    q, kh, vh, s, got = r.q, r.kh, r.vh, r.scale, r.got
    cm2 = ops.prefill_cm2_emulate > 0 or ops.prefill_cm2_ok(n_head, n_kv, hd)
    # attn_prefill_cm3 in place of cm2 where a variant is set (TRIO_LLM_PREFILL_CM2_VARIANT)
    cm3 = (ops.prefill_cm2_emulate > 0 or ops.coopmat) and ops.prefill_cm3_plan(
        n_head, n_kv, hd, rows=emulate[0] * emulate[1] if emulate else 0) is not None
    name = r.kernel
    assert name == ("attn_prefill_cm3" if cm3 else "attn_prefill_cm2") if cm2 or cm3 else name not in (
        "attn_prefill_cm2", "attn_prefill_cm3")
    cm2 = cm2 or cm3
    if emulate or cm2 or (ops.coopmat and ops.prefill_cm_ok(n_head, n_kv, hd)):
        r.assert_f16_products(pos, seq, n_kv, n_swa)
    else:
        want = np_attention(q, kh, vh, pos, seq, n_kv, n_swa, s)
        np.testing.assert_allclose(got, want, atol=3e-5 * np.abs(vh).max(), rtol=0)


@pytest.mark.parametrize("name", TYPES)
def test_every_kv_type(env: Env, ops: Ops, name: str) -> None:
    """41 tokens after a prefix of 37 (tiles of 16 tokens: the last one partial), and a
    second sequence from position 0 in the same batch."""
    pos, seq = batch((0, 37, 41), (1, 0, 9))
    check(env, ops, hd=64, n_head=4, n_kv=2, pos=pos, seq=seq, n_ctx=96, k_type=name, seed=TYPES.index(name))


def test_mixed_k_and_v_types(env: Env, ops: Ops) -> None:
    pos, seq = batch((0, 20, 30))
    check(env, ops, hd=64, n_head=4, n_kv=2, pos=pos, seq=seq, n_ctx=64, k_type="q8_0", v_type="f16", seed=9)
    check(env, ops, hd=64, n_head=4, n_kv=2, pos=pos, seq=seq, n_ctx=64, k_type="f16", v_type="q4_0", seed=10)


@pytest.mark.parametrize("hd", [64, 128, 256])
@pytest.mark.parametrize("gqa", [1, 2, 4, 8])
def test_head_dims_and_gqa(env: Env, ops: Ops, hd: int, gqa: int) -> None:
    """From position 0 (causal tiles only) and after a prefix of 70 (whole visible
    tiles first); the token count is never a multiple of the tile."""
    n_kv = 1 if hd == 256 else 2
    g, bq = prefill_tile(gqa * n_kv, n_kv, hd, coopmat=ops.coopmat)
    assert g * bq <= 64 and gqa % g == 0
    pos, seq = batch((0, 0, 2 * bq + 3), (1, 70, bq + 5))
    check(env, ops, hd=hd, n_head=gqa * n_kv, n_kv=n_kv, pos=pos, seq=seq, n_ctx=160, seed=hd + gqa)


@pytest.mark.parametrize("gqa", [3, 6, 16])
def test_other_gqa_ratios(env: Env, ops: Ops, gqa: int) -> None:
    """Head groups of 3 and 6 (30-row tiles: the scalar kernel on every device, the
    cooperative-matrix one needs a power of two), and a ratio of 16 (two head groups of
    8 per KV head)."""
    assert ops.prefill_cm_ok(gqa * 2, 2, 64) == (ops.coopmat and ops.prefill_cm and gqa == 16)
    pos, seq = batch((0, 0, 23), (1, 40, 12))
    check(env, ops, hd=64, n_head=gqa * 2, n_kv=2, pos=pos, seq=seq, n_ctx=64, seed=gqa)


def test_tiles_straddle_sequences(env: Env, ops: Ops) -> None:
    """Five short sequences in one batch (several in each work group's tile), out of
    position order, with a cap larger than the batch."""
    pos, seq = batch((2, 5, 3), (0, 0, 7), (4, 50, 11), (1, 33, 1), (3, 90, 6))
    check(env, ops, hd=64, n_head=8, n_kv=2, pos=pos, seq=seq, n_ctx=100, seed=3, cap=64)


def test_sliding_window_ring(env: Env, ops: Ops) -> None:
    """gemma3's sliding-window layers: a window of 40 over a ring of window + chunk rows
    (70), positions far past the ring's size, a batch from position 0 beside it, and
    gemma3's scale (1/sqrt(n_embd / n_head), not 1/sqrt(head_dim)); q8_0 too."""
    pos, seq = batch((0, 200, 30), (1, 0, 45))
    for t in ("f16", "q8_0"):
        check(env, ops, hd=256, n_head=4, n_kv=1, pos=pos, seq=seq, n_ctx=70, n_swa=40, k_type=t,
              scale=1.0 / np.sqrt(160.0), seed=4)
    pos, seq = batch((0, 130, 40))
    check(env, ops, hd=64, n_head=4, n_kv=2, pos=pos, seq=seq, n_ctx=72, n_swa=33, seed=5)


def test_window_wider_than_the_positions(env: Env, ops: Ops) -> None:
    """A window longer than the sequence so far is the causal mask."""
    pos, seq = batch((0, 0, 40))
    check(env, ops, hd=64, n_head=2, n_kv=1, pos=pos, seq=seq, n_ctx=64, n_swa=512, seed=6)


@pytest.mark.parametrize("hd", [64, 128])
@pytest.mark.parametrize("tile", [(1, 32), (2, 16), (4, 8), (8, 4)])
def test_coopmat_kernel_emulated(env: Env, hd: int, tile: tuple[int, int]) -> None:
    """attn_prefill_cm.comp with its two products done by plain lanes (CM_EMULATE) on a
    32-row tile: everything but the cooperative-matrix calls themselves, checked on any
    device (on lavapipe the real ones cannot run); f16 q, K, V and P as the real one."""
    g, bq = tile
    pos, seq = batch((0, 0, 2 * bq + 3), (1, 70, bq + 5), (2, 7, 2))
    check(env, env.ops, hd=hd, n_head=8, n_kv=8 // g, pos=pos, seq=seq, n_ctx=160, seed=hd + g, emulate=tile)


@pytest.mark.parametrize("name", ["f32", "f16", "q8_0", "q5_1"])
def test_coopmat_kernel_emulated_types_and_windows(env: Env, name: str) -> None:
    """Its K and V tile loads in a float, a half, a scaled and a scaled-with-minimum
    type (the decoding itself is kv_read.glsl's, tested with every type above), a
    prefix, two sequences, a window over a ring, gemma3's scale."""
    pos, seq = batch((0, 37, 41), (1, 0, 9))
    check(env, env.ops, hd=64, n_head=4, n_kv=2, pos=pos, seq=seq, n_ctx=96, k_type=name, seed=TYPES.index(name),
          emulate=(2, 16))
    pos, seq = batch((0, 200, 30), (1, 0, 45))
    check(env, env.ops, hd=64, n_head=4, n_kv=1, pos=pos, seq=seq, n_ctx=70, n_swa=40, k_type=name,
          scale=1.0 / np.sqrt(160.0), seed=4, emulate=(4, 8))


@pytest.mark.parametrize("rows", [16, 32])
def test_other_row_tiles(env: Env, ops: Ops, rows: int) -> None:
    """The tile sizes bench/prefill.py compares (``prefill_rows``, ``prefill_rows_cm``)."""
    ops = attrs.evolve(ops, prefill_rows=rows, prefill_rows_cm=rows)
    pos, seq = batch((0, 33, 45), (1, 0, 20))
    for hd, gqa in ((64, 4), (128, 8)):
        check(env, ops, hd=hd, n_head=gqa * 2, n_kv=2, pos=pos, seq=seq, n_ctx=96, seed=rows + hd)


@pytest.mark.parametrize("n_split", [2, 3, 5])
def test_coopmat_kernel_emulated_split(env: Env, n_split: int) -> None:
    """Keys split over work groups (the grid's z) and added up by attn_combine: a long
    prefix (splits of several tiles, the last one short), a short sequence (splits with
    no keys at all) and a window over a ring in one batch each."""
    pos, seq = batch((0, 150, 37), (1, 0, 5), (2, 60, 20))
    check(env, env.ops, hd=64, n_head=8, n_kv=2, pos=pos, seq=seq, n_ctx=200, seed=n_split, emulate=(4, 8),
          n_split=n_split)
    pos, seq = batch((0, 200, 30), (1, 0, 45))
    check(env, env.ops, hd=128, n_head=4, n_kv=2, pos=pos, seq=seq, n_ctx=70, n_swa=40, seed=n_split,
          emulate=(2, 16), n_split=n_split)


@pytest.mark.parametrize("n_split", [2, 4])
def test_split(env: Env, ops: Ops, n_split: int) -> None:
    """The same on the scalar and the cooperative-matrix kernels."""
    pos, seq = batch((0, 150, 37), (1, 0, 5), (2, 60, 20))
    check(env, ops, hd=64, n_head=8, n_kv=2, pos=pos, seq=seq, n_ctx=200, seed=n_split, n_split=n_split)
    pos, seq = batch((0, 300, 70))
    check(env, ops, hd=128, n_head=16, n_kv=2, pos=pos, seq=seq, n_ctx=400, seed=n_split, n_split=n_split)


def test_split_prefill_through_the_backend(env: Env, model_path) -> None:  # type: ignore[no-untyped-def]
    """The lowering of a split prefill (the KV cache's partials, the barrier, the
    combine, every layer reusing them): a 9000-token prompt at n_ctx 16384 (two splits)
    gives the logits of the same backend with the split turned off."""
    if not env.device.coopmat:
        pytest.skip(f"{env.device.name} reports no 16x16x16 f16 cooperative matrices (lavapipe has none)")
    model = load_gguf(model_path("tiny", "F16"))
    prompt = np.random.default_rng(0).integers(0, model.config.n_vocab, 9000).astype(np.int32)
    got = []
    for most in (4, 1):
        vk = VulkanBackend(model, n_ctx=16384, n_seq=1)
        try:
            # before any graph is recorded; the coopmat kernel is opt-in (TRIO_LLM_PREFILL_CM)
            vk._ops = attrs.evolve(vk._ops, prefill_split_most=most, prefill_cm=True)
            cfg = model.config
            assert vk._ops.prefill_splits(16384, cfg.n_head, cfg.n_head_kv, cfg.head_dim) == (2 if most == 4 else 1)
            got.append(vk.forward([SeqBatch(0, prompt, 0)])[0])
        finally:
            vk.close()
    # f16 tiles summed in another order over 9000 keys and every layer: the H200 put
    # them 3.5e-4 of the largest logit apart (both equal numpy within the op tests' bounds)
    np.testing.assert_allclose(got[0], got[1], atol=1e-3 * np.abs(got[1]).max(), rtol=0)


def test_emulated_split_prefill_through_the_backend(env: Env, model_path) -> None:  # type: ignore[no-untyped-def]
    """The same lowering on any device, with the cooperative-matrix kernel emulated
    (``prefill_cm_emulate``, 32-row tiles) and on the scalar kernel: 600 tokens at n_ctx
    16384 (two splits of the record, both used) equal the unsplit emulated kernel's
    logits and the split scalar kernel's, within the f16 rounding of q, K, V and P (a
    split rounds its weights against its own running max); the same split on
    attn_prefill_cm2 emulated (``prefill_cm2_emulate``, 32-row tiles of 64 keys)."""
    model = load_gguf(model_path("tiny", "F16"))
    cfg = model.config
    prompt = np.random.default_rng(1).integers(0, cfg.n_vocab, 600).astype(np.int32)
    got = []
    for emulate, most, cm2 in ((True, 4, 0), (True, 1, 0), (False, 4, 0), (False, 4, 32)):
        vk = VulkanBackend(model, n_ctx=16384, n_seq=1, cache_type_k="f32", cache_type_v="f32")
        try:
            vk._ops = attrs.evolve(vk._ops, prefill_split_most=most, prefill_cm_emulate=emulate, prefill_rows_cm=32,
                                   prefill_cm2=bool(cm2), prefill_cm2_emulate=cm2, prefill_cm2_keys=64)
            assert vk._ops.prefill_splits(16384, cfg.n_head, cfg.n_head_kv, cfg.head_dim) == (2 if most == 4 else 1)
            assert vk._ops.prefill_cm2_plan(cfg.n_head, cfg.n_head_kv, cfg.head_dim) == ((32, 64) if cm2 else None)
            got.append(vk.forward([SeqBatch(0, prompt, 0)])[0])
        finally:
            vk.close()
    scale = np.abs(got[2]).max()
    np.testing.assert_allclose(got[0], got[1], atol=1e-3 * scale, rtol=0)
    np.testing.assert_allclose(got[0], got[2], atol=3e-3 * scale, rtol=0)
    np.testing.assert_allclose(got[3], got[2], atol=3e-3 * scale, rtol=0)
    assert np.abs(got[0] - got[2]).max() > 0  # the emulated kernel ran (f16), not the scalar one
    assert np.abs(got[3] - got[2]).max() > 0 and np.abs(got[3] - got[0]).max() > 0


def cm2_ops(env: Env, sub: int, keys: int = 0) -> Ops:
    """attn_prefill_cm2.comp emulated for subgroups of ``sub`` lanes (``keys`` per tile,
    0: ``prefill_cm2_prefer``'s where they fit the device's shared memory, else the most
    that do)."""
    return attrs.evolve(env.ops, prefill_cm2_emulate=sub, prefill_cm2_keys=keys)


#: (head_dim, GQA ratio, emulated subgroup): every head dim and every ratio with both
#: subgroup sizes, not every product (the suite's time on two cores; head_dim 256 with
#: GQA 4 is in test_cm2_emulated_sequences_and_windows)
CM2_SHAPES = [(64, 1, 32), (64, 4, 64), (64, 8, 32), (128, 1, 64), (128, 4, 32), (128, 8, 64), (256, 8, 64)]


@pytest.mark.parametrize(("hd", "gqa", "sub"), CM2_SHAPES)
def test_cm2_emulated_head_dims_and_gqa(env: Env, hd: int, gqa: int, sub: int) -> None:
    """attn_prefill_cm2.comp emulated on its default 64-row tile (32 for head_dim 256;
    its default keys per tile: 32 for head_dim 64, 16 above): GQA
    1/4/8 (a head group of 1, 4 and 8 of the 16 rows of each subgroup), tokens from 0
    (diagonal tiles, where some subgroups' rows see none of a tile's keys and skip
    it), after a prefix of 70 (whole visible tiles first), a 2-token sequence; no
    count a multiple of the tile."""
    n_kv = 1 if hd == 256 else 2
    ops = cm2_ops(env, sub)
    g, bq = prefill_tile(gqa * n_kv, n_kv, hd, coopmat=True)
    assert ops.prefill_cm2_plan(gqa * n_kv, n_kv, hd) is not None
    pos, seq = batch((0, 0, 2 * bq + 3), (1, 70, bq + 5), (2, 7, 2))
    check(env, ops, hd=hd, n_head=gqa * n_kv, n_kv=n_kv, pos=pos, seq=seq, n_ctx=160, seed=hd + gqa,
          emulate=(g, bq))


@pytest.mark.parametrize("tile", [(4, 4, 16, 32), (2, 16, 32, 64), (8, 4, 64, 32), (1, 16, 64, 64),
                                  (4, 16, 16, 64)])
def test_cm2_emulated_keys_and_rows(env: Env, tile: tuple[int, int, int, int]) -> None:
    """Each key tile size (16, 32, 64: 64 is the H200's for head_dim 64) on tiles of 16,
    32 and 64 rows (1, 2 and 4 subgroups) of 32- and 64-lane subgroups, with a prefix
    and a second sequence."""
    g, bq, keys, sub = tile
    pos, seq = batch((0, 37, 41), (1, 0, 9), (2, 130, 3))
    check(env, cm2_ops(env, sub, keys), hd=64, n_head=8, n_kv=8 // g, pos=pos, seq=seq, n_ctx=160,
          seed=keys + g, emulate=(g, bq))


@pytest.mark.parametrize(("name", "sub"), [("f32", 32), ("f16", 64), ("q8_0", 32), ("q4_1", 64), ("q5_0", 32)])
def test_cm2_emulated_types_and_windows(env: Env, name: str, sub: int) -> None:
    """Its K and V tile loads in a float, a half and scaled types (with a minimum,
    with a fifth bit), a prefix, two sequences, a window over a ring with gemma3's
    scale, and K and V of different types."""
    ops = cm2_ops(env, sub)
    pos, seq = batch((0, 37, 41), (1, 0, 9))
    check(env, ops, hd=64, n_head=4, n_kv=2, pos=pos, seq=seq, n_ctx=96, k_type=name, seed=TYPES.index(name),
          emulate=(2, 32))
    pos, seq = batch((0, 200, 30), (1, 0, 45))
    check(env, ops, hd=64, n_head=4, n_kv=1, pos=pos, seq=seq, n_ctx=70, n_swa=40, k_type=name,
          v_type="f16" if name == "q8_0" else None, scale=1.0 / np.sqrt(160.0), seed=4, emulate=(4, 16))


@pytest.mark.parametrize("sub", [32, 64])
def test_cm2_emulated_sequences_and_windows(env: Env, sub: int) -> None:
    """Five short sequences out of position order in one tile (a pass each), a cap
    larger than the batch; windows over a ring at head_dim 128 and 256 (q8_0), one
    wider than the positions (the causal mask)."""
    ops = cm2_ops(env, sub)
    pos, seq = batch((2, 5, 3), (0, 0, 7), (4, 50, 11), (1, 33, 1), (3, 90, 6))
    check(env, ops, hd=64, n_head=8, n_kv=2, pos=pos, seq=seq, n_ctx=100, seed=3, cap=64, emulate=(4, 16))
    pos, seq = batch((0, 200, 30), (1, 0, 45))
    check(env, ops, hd=128, n_head=4, n_kv=2, pos=pos, seq=seq, n_ctx=70, n_swa=40, seed=5, emulate=(2, 32))
    check(env, ops, hd=256, n_head=4, n_kv=1, pos=pos, seq=seq, n_ctx=70, n_swa=40, k_type="q8_0",
          scale=1.0 / np.sqrt(160.0), seed=6, emulate=(4, 16))
    pos, seq = batch((0, 0, 40))
    check(env, ops, hd=64, n_head=2, n_kv=1, pos=pos, seq=seq, n_ctx=64, n_swa=512, seed=7, emulate=(2, 32))


@pytest.mark.parametrize(("n_split", "sub"), [(2, 32), (3, 64), (5, 32)])
def test_cm2_emulated_split(env: Env, n_split: int, sub: int) -> None:
    """Keys split over work groups and added up by attn_combine: a long prefix, a short
    sequence (splits with no keys at all) and a window over a ring, 64 keys per tile
    (head_dim 64, 32 rows) and 32 (head_dim 128, 64 rows)."""
    pos, seq = batch((0, 150, 37), (1, 0, 5), (2, 60, 20))
    check(env, cm2_ops(env, sub, 64), hd=64, n_head=8, n_kv=2, pos=pos, seq=seq, n_ctx=200, seed=n_split,
          emulate=(4, 8), n_split=n_split)
    pos, seq = batch((0, 200, 30), (1, 0, 45))
    check(env, cm2_ops(env, sub), hd=128, n_head=8, n_kv=2, pos=pos, seq=seq, n_ctx=70, n_swa=40, seed=n_split,
          emulate=(4, 16), n_split=n_split)


def test_cm2_plan(env: Env) -> None:
    """Where attn_prefill_cm2 runs: off unless enabled (``prefill_cm2`` on a device
    with cooperative matrices, or emulated), power-of-two head groups, head dims that
    are multiples of 16 up to 256, rows of 16 / 32 / 64, and the keys per tile the
    device's shared memory holds (the budget of ``prefill_cm2_shared``; the H200
    reports 48 KiB: 64 keys for head_dim 64, 32 for 128 and 256)."""
    assert attrs.evolve(env.ops, coopmat=False).prefill_cm2_plan(8, 2, 64) is None  # no cooperative matrices
    on = attrs.evolve(env.ops, coopmat=env.device.coopmat, prefill_cm2=True)
    assert on.prefill_cm2_ok(8, 2, 64) == env.device.coopmat
    assert not attrs.evolve(on, prefill_cm2=False).prefill_cm2_ok(8, 2, 64)  # TRIO_LLM_PREFILL_CM2=0
    assert Ops(env.ops.kernels, subgroup=env.ops.subgroup).prefill_cm2  # on by default
    # not above head_dim 128 unless its keys are forced (attn_prefill_cm was faster at 256)
    hw = attrs.evolve(env.ops, coopmat=True, prefill_cm2=True, subgroup=32)
    assert hw.prefill_cm2_plan(8, 2, 128) is not None and hw.prefill_cm2_plan(8, 2, 256) is None
    assert attrs.evolve(hw, prefill_cm2_keys=16).prefill_cm2_plan(8, 2, 256) == (32, 16)
    ops = cm2_ops(env, 64)
    limit = env.device.limits.max_shared_memory
    for hd in (64, 128, 256):
        for rows in (16, 32, 64):
            plan = ops.prefill_cm2_plan(8, 2, hd, rows=rows)
            fit = [k for k in PREFILL_CM2_KEYS if prefill_cm2_shared(hd, rows, k) <= limit]
            # the preferred (fewer) keys where they fit, else the most that do
            want = prefill_cm2_prefer(hd) if prefill_cm2_prefer(hd) in fit else fit[0] if fit else 0
            assert plan == ((64, want) if fit else None)
    assert ops.prefill_cm2_plan(6, 2, 64) is None and ops.prefill_cm2_plan(8, 2, 80) is not None
    assert ops.prefill_cm2_plan(8, 2, 272) is None and ops.prefill_cm2_plan(8, 2, 64, rows=128) is None
    assert [max((k for k in PREFILL_CM2_KEYS if prefill_cm2_shared(hd, 64, k) <= 49152), default=0)
            for hd in (64, 128, 256)] == [64, 32, 32]
    assert attrs.evolve(ops, prefill_cm2_keys=64).prefill_cm2_plan(8, 2, 256) is None


def test_bad_shapes_are_refused(env: Env) -> None:
    v = env.zeros(64)
    for hd, typ in ((40, "f16"), (48, "q8_0")):
        with pytest.raises((AssertionError, ValueError)):
            env.ops.attention_prefill(v, v, v, v, v, n_head=2, n_head_kv=1, head_dim=hd, n_ctx=4, q_stride=2 * hd,
                                      o_stride=2 * hd, cap=16, k_type=typ, v_type=typ)


def cm3_ops(env: Env, sub: int, spec: str) -> Ops:
    """attn_prefill_cm3.comp emulated for subgroups of ``sub`` lanes in variant ``spec``."""
    return attrs.evolve(env.ops, prefill_cm2_emulate=sub, prefill_cm2_variant=attn_variant(spec))


#: (variant, emulated subgroup, head_dim, tile of (heads, tokens), the window's cache
#: type, with the split check); each distinct type and tile is a lavapipe pipeline of
#: its own (about 20 s to compile cold on two cores), so most windows are f16
CM3_CASES = [("v", 32, 64, (4, 8), "q8_0", True), ("v+db+lr", 64, 128, (4, 8), "f16", False),
             ("v+rb2+db+lr", 32, 64, (2, 32), "f16", True), ("v+rb2", 64, 128, (1, 32), "f16", False),
             ("v+k16", 32, 256, (2, 8), "f16", False)]


@pytest.mark.parametrize(("spec", "sub", "hd", "tile", "quant", "split"), CM3_CASES)
def test_cm3_emulated_variants(env: Env, spec: str, sub: int, hd: int, tile: tuple[int, int], quant: str,
                               split: bool) -> None:
    """Each attn_prefill_cm3 form (row blocks of 16 or 32 per subgroup, one or two K/V
    buffers, 16 / 32 keys per tile; Q in registers, or from shared memory with QSH at
    2 x 128 and 256; the lazy rescale), emulated: the layout search and the element-wise softmax for
    subgroups of 32 and 64, tokens from 0 (diagonal tiles, subgroups that skip), a
    prefix, a 2-token sequence, GQA 1, 2 and 4 (not for head_dim 256); a window over a
    ring with gemma3's scale (in q8_0 in the first: the converting K/V loads; their
    decoding is kv_read.glsl's, every type tested above); 3 key splits in two of them."""
    ops = cm3_ops(env, sub, spec)
    v = attn_variant(spec)
    assert v is not None
    g, bq = tile
    n_kv = 8 // g if hd < 256 else 1
    n_head = n_kv * g
    assert ops.prefill_cm3_plan(n_head, n_kv, hd, rows=g * bq) is not None
    if hd < 256:  # (lavapipe takes a minute over head_dim 256's emulated products: its window alone)
        pos, seq = batch((0, 0, 2 * bq + 3), (1, 70, bq + 5), (2, 7, 2))
        check(env, ops, hd=hd, n_head=n_head, n_kv=n_kv, pos=pos, seq=seq, n_ctx=160, seed=hd + sub, emulate=(g, bq))
    pos, seq = batch((0, 200, 30), (1, 0, 45))
    check(env, ops, hd=hd, n_head=n_head, n_kv=n_kv, pos=pos, seq=seq, n_ctx=70, n_swa=40,
          k_type=quant, scale=1.0 / np.sqrt(160.0), seed=4, emulate=(g, bq))
    pos, seq = batch((0, 150, 37), (1, 0, 5), (2, 60, 20))
    if split:
        check(env, ops, hd=hd, n_head=n_head, n_kv=n_kv, pos=pos, seq=seq, n_ctx=200, seed=sub, emulate=(g, bq),
              n_split=3)


def test_cm3_emulated_sequences(env: Env) -> None:
    """Five short sequences out of position order in one tile (a pass each), a cap
    larger than the batch (the pipeline of the first case above)."""
    pos, seq = batch((2, 5, 3), (0, 0, 7), (4, 50, 11), (1, 33, 1), (3, 90, 6))
    check(env, cm3_ops(env, 32, "v"), hd=64, n_head=8, n_kv=2, pos=pos, seq=seq, n_ctx=100, seed=3, cap=64,
          emulate=(4, 8))


def test_cm3_variant_specs_and_plan(env: Env) -> None:
    """``TRIO_LLM_PREFILL_CM2_VARIANT``'s spellings, and where attn_prefill_cm3 runs:
    only with a variant set, as attn_prefill_cm2 would (enabled, power-of-two head
    groups, head dims up to 256 here too), rows a multiple of 16 * RB, its keys per
    tile within the device's shared memory (the H200's 48 KiB takes every sweep
    variant on the default tiles of llama-1b, llama-8b and gemma3-4b)."""
    assert attn_variant("") is None and attn_variant("cm2") is None
    assert attn_variant("v+rb2+db+k64") == AttnVariant(2, True, 64)
    assert attn_variant("v+k16+lr") == AttnVariant(1, False, 16, True) and AttnVariant(lr=True).name == "v+lr"
    assert attn_variant("v+pr+rb2") == AttnVariant(2, pr=True) and AttnVariant(2, pr=True).name == "v+rb2+pr"
    assert [attn_variant(s).name for s in ATTN_SWEEP] == list(ATTN_SWEEP)  # type: ignore[union-attr]
    for bad in ("w", "v+rb3", "v+db+db", "v+k64+k32"):
        with pytest.raises(ValueError):
            attn_variant(bad)
    with pytest.MonkeyPatch.context() as mp:  # the knob's bad spelling is one ConfigError line
        mp.setenv("TRIO_LLM_PREFILL_CM2_VARIANT", "v+fast")
        with pytest.raises(ConfigError, match="TRIO_LLM_PREFILL_CM2_VARIANT='v\\+fast'"):
            Ops(env.ops.kernels, subgroup=env.ops.subgroup)
        mp.setenv("TRIO_LLM_PREFILL_CM2_VARIANT", "v+db")
        assert Ops(env.ops.kernels, subgroup=env.ops.subgroup).prefill_cm2_variant == AttnVariant(db=True)
    hw = attrs.evolve(env.ops, coopmat=True, prefill_cm2=True, subgroup=32, prefill_cm2_variant=attn_variant("v"))
    assert attrs.evolve(hw, prefill_cm2_variant=None).prefill_cm3_plan(8, 2, 64) is None
    assert attrs.evolve(hw, prefill_cm2=False).prefill_cm3_plan(8, 2, 64) is None
    assert attrs.evolve(hw, coopmat=False).prefill_cm3_plan(8, 2, 64) is None
    assert hw.prefill_cm3_plan(6, 2, 64) is None and hw.prefill_cm3_plan(8, 2, 272) is None
    rb2 = attrs.evolve(hw, prefill_cm2_variant=attn_variant("v+rb2"))
    assert rb2.prefill_cm3_plan(8, 2, 64, rows=16) is None  # rows below one subgroup's 32
    # the H200's 48 KiB: (keys, rows, QSH) per head_dim 64 / 128 / 256 (None: cm2 / cm runs)
    h200 = {"v": [(32, 64, False), (32, 64, False), (16, 32, True)],
            "v+db": [(32, 64, False), (32, 64, False), (16, 16, True)],
            "v+k64": [(64, 64, False), (64, 64, False), None],
            "v+db+k64": [(64, 64, False), None, None],
            "v+rb2": [(32, 128, False), (32, 64, True), (16, 32, True)],
            "v+rb2+db": [(32, 128, False), (16, 64, True), None]}
    for spec in ("v", "v+db", "v+rb2+db"):  # the lazy rescale and P in registers take no memory
        h200[f"{spec}+lr"] = h200[spec]
    for spec in ("v+db", "v+rb2+db"):
        h200[f"{spec}+lr+pr"] = h200[spec]
    assert set(h200) == set(ATTN_SWEEP)
    for spec, want in h200.items():
        v = attn_variant(spec)
        assert v is not None
        assert [prefill_cm3_choose(hd, v, 49152) for hd in (64, 128, 256)] == want, spec
        for hd in (64, 128, 256):  # the method takes the device's limit (lavapipe's here)
            got = prefill_cm3_choose(hd, v, env.device.limits.max_shared_memory)
            assert attrs.evolve(hw, prefill_cm2_variant=v).prefill_cm3_plan(8, 2, hd) == (
                None if got is None else (32, *got))
    assert prefill_cm3_choose(64, AttnVariant(2), 49152, rows=48) is None  # not whole subgroups
    assert prefill_cm3_choose(64, AttnVariant(1), 49152, rows=16) == (32, 16, False)
    assert prefill_cm3_shared(64, 64, 32, AttnVariant(), False) == 16128


# -- a latent cache (deepseek2's MLA): attn_prefill.comp's LATENT form


class _Limited:
    """The env's kernels on a device that reports ``shared`` bytes of shared memory (the
    pipelines are the real ones: a tile chosen for less than lavapipe's 32 KiB runs)."""

    def __init__(self, env: Env, shared: int) -> None:
        self._k = env.ops.kernels
        dev = env.device
        limits = attrs.evolve(dev.limits, max_shared_memory=shared)
        self.device = type("Dev", (), {"limits": limits, "__getattr__": lambda _s, n: getattr(dev, n)})()

    def __getattr__(self, name: str) -> object:
        return getattr(self._k, name)


def limited(env: Env, shared: int, **kw: object) -> Ops:
    return attrs.evolve(env.ops, kernels=_Limited(env, shared), **kw)  # type: ignore[arg-type]


def check_latent(env: Env, ops: Ops, *, hd: int, dv: int, n_head: int, name: str, pos: list[int], seq: list[int],
                 n_ctx: int, seed: int, n_swa: int = 0, n_split: int = 1) -> None:
    """``attention_prefill`` with ``v_dim`` = dv over one K cache of ``hd``-wide rows of
    type ``name`` bound as K and V: the first dv values of each output head against
    numpy over the roundtrip'd cache (V = each row's first dv values), the rest of each
    head untouched (NaN, as the output and the partials start); ``n_split`` > 1: the
    keys split over work groups, then ``attention_combine``."""
    ntok, n_seq = len(pos), max(seq) + 1
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((ntok, n_head, hd)).astype(np.float32)
    kc, kh = _typed_cache(env, rng.standard_normal((n_seq, n_ctx, 1, hd)).astype(np.float32), name)
    qv, o = env.put(q), env.put(np.full(q.size, np.nan, np.float32))
    st = env.step([0] * ntok, pos, seq)
    part = env.put(np.full(attention_part_floats(ntok, n_head, hd, n_split), np.nan, np.float32))
    op = ops.attention_prefill(qv, kc, kc, o, st, n_head=n_head, n_head_kv=1, head_dim=hd, n_ctx=n_ctx,
                               q_stride=n_head * hd, o_stride=n_head * hd, cap=ntok, scale=0.07, k_type=name,
                               v_type=name, n_swa=n_swa, v_dim=dv, part=part, n_split=n_split, min_tiles=1)
    assert op.kernel.name == "attn_prefill"
    run: list[Op] = [op]
    if n_split > 1:
        run += [Barrier(), ops.attention_combine(part, o, st, n_head=n_head, head_dim=hd, n_split=n_split,
                                                 o_stride=n_head * hd, cap=ntok)]
    env.run(run)
    got = env.get(o).reshape(q.shape)
    want = np_attention(q, kh, kh[..., :dv], pos, seq, 1, n_swa, 0.07)
    np.testing.assert_allclose(got[..., :dv], want, atol=3e-5 * np.abs(kh).max(), rtol=0)
    assert np.isnan(got[..., dv:]).all()


@pytest.mark.parametrize(("hd", "dv", "n_head", "name"), [
    (576, 512, 20, "f16"),  # GLM-4.7-Flash: 20 heads, one KV head, 4 x 3 tiles on lavapipe
    (576, 512, 20, "q8_0"),
    (576, 512, 16, "q4_0"),
    (576, 512, 20, "f32"),
    (288, 256, 4, "f32"),  # tiny-deepseek2's row: 4 x 4 tiles, two row groups of phase C
    (288, 256, 4, "q8_0"),
])
def test_latent_prefill(env: Env, hd: int, dv: int, n_head: int, name: str) -> None:
    """41 tokens after 37 cached positions (a second chunk: whole visible key tiles,
    then diagonal ones) beside a second sequence's first 23 in one batch, neither a
    multiple of the tile's tokens; then 70 tokens from position 150 of a 230-row cache."""
    tile = env.ops.prefill_latent_tile(n_head, 1, hd, dv)
    assert tile is not None and all(n % tile[1] for n in (41, 23, 70))
    pos, seq = batch((0, 37, 41), (1, 0, 23))
    check_latent(env, env.ops, hd=hd, dv=dv, n_head=n_head, name=name, pos=pos, seq=seq, n_ctx=96, seed=hd + n_head)
    pos, seq = batch((0, 150, 70))
    check_latent(env, env.ops, hd=hd, dv=dv, n_head=n_head, name=name, pos=pos, seq=seq, n_ctx=230, seed=7)


def test_latent_prefill_on_smaller_tiles(env: Env) -> None:
    """The tiles less shared memory (or ``prefill_rows``) leaves: GLM's row on 16 KiB
    (4 heads x 1 token) and 8 rows (4 x 2), five sequences across tiles, a window over a
    ring."""
    small = limited(env, 16384)
    assert small.prefill_latent_tile(20, 1, 576, 512) == (4, 1)
    eight = attrs.evolve(env.ops, prefill_rows=8)
    assert eight.prefill_latent_tile(20, 1, 576, 512) == (4, 2)
    pos, seq = batch((2, 5, 3), (0, 0, 7), (4, 50, 11), (1, 33, 1), (3, 90, 6))
    for ops in (small, eight):
        check_latent(env, ops, hd=576, dv=512, n_head=20, name="f16", pos=pos, seq=seq, n_ctx=100, seed=3)
    pos, seq = batch((0, 200, 30), (1, 0, 45))
    check_latent(env, eight, hd=288, dv=256, n_head=4, name="q8_0", pos=pos, seq=seq, n_ctx=70, n_swa=40, seed=4)


@pytest.mark.parametrize("n_split", [2, 3])
def test_latent_prefill_split(env: Env, n_split: int) -> None:
    """Keys split over the grid's z (the kernel allows it; the lowering does not ask):
    each split's partials cover the DV dims, and attn_combine's sums of those are the
    attention; a long prefix, a short sequence (splits with no keys) in one batch."""
    pos, seq = batch((0, 150, 37), (1, 0, 5))
    check_latent(env, env.ops, hd=576, dv=512, n_head=20, name="q8_0", pos=pos, seq=seq, n_ctx=200, seed=n_split,
                 n_split=n_split)


def test_latent_prefill_tile_and_refusals(env: Env) -> None:
    """``prefill_latent_tile``: the most rows of ``PREFILL_LATENT_ROWS`` the device's
    shared memory takes, head groups filling them; None (the caller takes attention.comp)
    where nothing fits or the shape is not the kernel's."""
    assert prefill_latent_pack(20, 1, 16) == (4, 4) and prefill_latent_pack(20, 1, 12) == (4, 3)
    assert prefill_latent_pack(4, 1, 16) == (4, 4) and prefill_latent_pack(6, 1, 16) == (2, 8)
    assert prefill_shared(576, 12, 3) == 29304 <= env.device.limits.max_shared_memory
    want = {8192: None, 16384: (4, 1), 24576: (4, 2), 32768: (4, 3), 49152: (4, 4), 65536: (4, 4)}
    assert {b: limited(env, b).prefill_latent_tile(20, 1, 576, 512) for b in want} == want
    assert limited(env, 32768).prefill_latent_tile(4, 1, 288, 256) == (4, 4)
    ops = limited(env, 1 << 16)
    for hd, dv in ((592, 512), (576, 516), (576, 514), (576, 0), (280, 256), (256, 288)):
        assert ops.prefill_latent_tile(20, 1, hd, dv) is None, (hd, dv)
    assert attrs.evolve(ops, subgroup=2).prefill_latent_tile(20, 1, 576, 512) is None
    v = env.zeros(64)
    with pytest.raises(AssertionError):  # nothing fits: the caller must not ask
        limited(env, 8192).attention_prefill(v, v, v, v, v, n_head=20, n_head_kv=1, head_dim=576, n_ctx=4,
                                             q_stride=20 * 576, o_stride=20 * 576, cap=16, v_dim=512)


def spy_kernels(env: Env) -> tuple[Any, list[tuple[str, dict[str, object]]]]:
    """Kernels that note every (shader, defines) asked of them, and that list."""
    asked: list[tuple[str, dict[str, object]]] = []

    class Spy:
        device = env.device

        def __getattr__(self, name: str) -> object:
            return getattr(env.ops.kernels, name)

        def get(self, name: str, **kw: object) -> object:
            asked.append((name, dict(kw.get("defines") or {})))  # type: ignore[call-overload]
            return env.ops.kernels.get(name, **kw)  # type: ignore[arg-type]

    return Spy(), asked


def test_the_latent_prefill_variants_are_prebuilt(env: Env) -> None:
    """Every cache type's LATENT attn_prefill, as attention_prefill asks for it, is in
    ``all_variants`` (``trio-llm compile-shaders``: the GPU machine compiles nothing)."""
    spy, asked = spy_kernels(env)
    ops = attrs.evolve(env.ops, kernels=spy)
    prebuilt = {(n, shaders.cache_key(n, d)) for n, d in shaders.all_variants()}
    v = env.zeros(1 << 16)
    for name in TYPES:
        ops.attention_prefill(v, v, v, v, v, n_head=4, n_head_kv=1, head_dim=576, n_ctx=8, q_stride=2304,
                              o_stride=2304, cap=16, k_type=name, v_type=name, v_dim=512)
    assert len(asked) == len(TYPES) and all(n == "attn_prefill" and d.get("LATENT") == 1 for n, d in asked)
    assert all((n, shaders.cache_key(n, d)) in prebuilt for n, d in asked), asked


# -- non-causal entries (gemma3's image rows): attn_prefill.comp's NONCAUSAL form


def visible(*runs: tuple[int, int, int, bool]) -> tuple[list[int], list[int], list[int]]:
    """``batch``'s positions and sequence ids of runs (seq, p0, n, causal), and each
    token's highest visible position (STEP_VIS, as the backend fills it): its own in a
    causal run, the run's last (p0 + n - 1) in a non-causal one."""
    pos, seq = batch(*((s, p0, n) for s, p0, n, _ in runs))
    vis = [p if causal else p0 + n - 1 for _, p0, n, causal in runs for p in range(p0, p0 + n)]
    return pos, seq, vis


def check_noncausal(env: Env, *, hd: int, n_head: int, n_kv: int, runs: list[tuple[int, int, int, bool]],
                    n_ctx: int, k_type: str = "f16", n_swa: int = 0, scale: float | None = None,
                    seed: int = 0) -> PrefillRun:
    """The NONCAUSAL form (the scalar kernel on every device) against numpy within the
    scalar kernel's 3e-5 of V's largest value, then the causal kernel on the same inputs:
    every row that sees past its own position is more than 20 times that bound away from
    it (one more key than its causal row's among a hundred: 64 times at least here; the
    largest gaps are thousands of times), every other row within it, so a kernel that
    ignored STEP_VIS would fail."""
    pos, seq, vis = visible(*runs)
    kw = dict(hd=hd, n_head=n_head, n_kv=n_kv, pos=pos, seq=seq, n_ctx=n_ctx, k_type=k_type, n_swa=n_swa,
              scale=scale, seed=seed)
    r = run_prefill(env, env.ops, vis=vis, **kw)  # type: ignore[arg-type]
    assert r.kernel == "attn_prefill"
    tol = 3e-5 * np.abs(r.vh).max()
    want = np_attention(r.q, r.kh, r.vh, pos, seq, n_kv, n_swa, r.scale, hi=vis)
    np.testing.assert_allclose(r.got, want, atol=tol, rtol=0)
    causal = run_prefill(env, env.ops, **kw)  # type: ignore[arg-type]
    gap = np.abs(r.got - causal.got).max(axis=(1, 2))  # [ntok]
    more = np.array(vis) > np.array(pos)
    assert more.any() and gap[more].min() > 20 * tol and gap.max() > 1000 * tol, gap[more] / tol
    assert (gap[~more] <= tol).all()
    return r


@pytest.mark.parametrize("name", TYPES)
def test_noncausal_entry_alone(env: Env, name: str) -> None:
    """A step of one non-causal entry (an image's 41 rows, not a multiple of the tile's
    8 tokens) from position 0, then one after 37 positions already in the cache (whole
    visible key tiles first), in every KV cache type."""
    for p0 in (0, 37):
        check_noncausal(env, hd=64, n_head=4, n_kv=2, runs=[(0, p0, 41, False)], n_ctx=96, k_type=name,
                        seed=TYPES.index(name) + p0)


@pytest.mark.parametrize("hd", [64, 128, 256])
@pytest.mark.parametrize("gqa", [1, 2, 4])
def test_noncausal_head_dims_and_gqa(env: Env, gqa: int, hd: int) -> None:
    """Two non-causal entries of two sequences in one step: from position 0 and after a
    prefix of 70, neither a multiple of the tile (which straddles them), on each head
    dim and GQA ratio (head groups of 1, 2 and 4 rows per token)."""
    n_kv = 1 if hd == 256 else 2
    g, bq = prefill_tile(gqa * n_kv, n_kv, hd)
    assert g == gqa
    check_noncausal(env, hd=hd, n_head=gqa * n_kv, n_kv=n_kv, runs=[(0, 0, 2 * bq + 3, False), (1, 70, bq + 5, False)],
                    n_ctx=160, seed=hd + gqa)


@pytest.mark.parametrize("name", ["f16", "q8_0"])
def test_noncausal_sliding_window(env: Env, name: str) -> None:
    """gemma3's sliding-window layers (window 16, its scale, head_dim 256): an image's 45
    rows from position 0 each see all the later ones (the first row keys up to 44
    positions after it) while the window still hides the keys 16 or more before it
    (numpy's mask, which the window-less attention misses by far; the numpy backend's
    ``attend(causal=False)`` agrees); then over a ring of 70 rows, an image from position
    200 beside one from 0, and a window of 33 over a ring of 72 (the first row's keys
    fill it exactly)."""
    scale = 1.0 / np.sqrt(160.0)
    r = check_noncausal(env, hd=256, n_head=4, n_kv=1, runs=[(0, 0, 45, False)], n_ctx=64, k_type=name, n_swa=16,
                        scale=scale, seed=11)
    pos, seq, vis = visible((0, 0, 45, False))
    tol = 3e-5 * np.abs(r.vh).max()
    wide = np_attention(r.q, r.kh, r.vh, pos, seq, 1, 0, r.scale, hi=vis)
    assert np.abs(r.got - wide).max(axis=(1, 2))[16:].min() > 100 * tol  # rows 16.. lose keys to the window
    nb = attend(r.q, r.kh[0, :45], r.vh[0, :45], 0, window=16, scale=r.scale, causal=False)
    np.testing.assert_allclose(nb, np_attention(r.q, r.kh, r.vh, pos, seq, 1, 16, r.scale, hi=vis), atol=1e-5, rtol=0)
    check_noncausal(env, hd=256, n_head=4, n_kv=1, runs=[(0, 200, 45, False), (1, 0, 30, False)], n_ctx=70,
                    k_type=name, n_swa=20, scale=scale, seed=12)
    check_noncausal(env, hd=64, n_head=4, n_kv=2, runs=[(0, 130, 40, False)], n_ctx=72, k_type=name, n_swa=33,
                    seed=13)


@pytest.mark.parametrize("name", ["f16", "q8_0"])
def test_noncausal_symmetric_window(env: Env, name: str) -> None:
    """gemma-embedding's symmetric window (SYMMETRIC): a non-causal row at p sees the keys
    within ``n_swa - 1`` on both sides (llama.cpp's |p - j| <= n_swa_file / 2, here n_swa
    9 for a file's 16), two prompts of one step from position 0; numpy's mask (hi clamped
    to p + n_swa - 1) and the numpy backend's ``attend(symmetric=True)`` agree, and the
    one-sided window misses by far the rows that lose later keys to it."""
    runs = ((0, 0, 45, False), (1, 0, 30, False))
    pos, seq, vis = visible(*runs)
    n_swa = 9
    hi = [min(v, p + n_swa - 1) for v, p in zip(vis, pos, strict=True)]
    r = run_prefill(env, env.ops, hd=64, n_head=4, n_kv=2, pos=pos, seq=seq, n_ctx=64, k_type=name, n_swa=n_swa,
                    vis=vis, symmetric=True, seed=31)
    tol = 3e-5 * np.abs(r.vh).max()
    want = np_attention(r.q, r.kh, r.vh, pos, seq, 2, n_swa, r.scale, hi=hi)
    np.testing.assert_allclose(r.got, want, atol=tol, rtol=0)
    nb = attend(r.q[:45], r.kh[0, :45], r.vh[0, :45], 0, window=n_swa, scale=r.scale, causal=False, symmetric=True)
    np.testing.assert_allclose(nb, want[:45], atol=1e-5, rtol=0)
    one_sided = np_attention(r.q, r.kh, r.vh, pos, seq, 2, n_swa, r.scale, hi=vis)
    loses = np.array(hi) < np.array(vis)
    assert loses.any() and np.abs(r.got - one_sided).max(axis=(1, 2))[loses].min() > 100 * tol


def test_noncausal_beside_causal(env: Env) -> None:
    """Each row its own mask in one step: a text entry of one sequence (causal) beside an
    image of another and a third sequence's text; then one sequence's text, image and
    text in a row (the image's rows see its last but not the text after it, the text
    after it all of the image), with a window over a ring, in q8_0."""
    check_noncausal(env, hd=128, n_head=4, n_kv=2,
                    runs=[(0, 30, 20, True), (1, 10, 37, False), (2, 0, 9, True)], n_ctx=96, seed=21)
    check_noncausal(env, hd=64, n_head=8, n_kv=2,
                    runs=[(0, 50, 9, True), (0, 59, 30, False), (0, 89, 5, True), (1, 3, 17, False)], n_ctx=80,
                    k_type="q8_0", n_swa=24, seed=22)


def test_noncausal_kernel_choice(env: Env) -> None:
    """``noncausal`` takes attn_prefill.comp's NONCAUSAL form, unsplit, on the scalar
    tile, whatever cooperative-matrix kernels the device would otherwise take (prebuilt
    for every cache type); it refuses a split, an emulated tile and a latent cache."""
    spy, asked = spy_kernels(env)
    hw = attrs.evolve(env.ops, kernels=spy, coopmat=True, prefill_cm=True, prefill_cm2=True,  # type: ignore[arg-type]
                      prefill_nv2=True, subgroup=32, prefill_cm2_variant=attn_variant("v"))
    v = env.zeros(64)
    kw = dict(n_head=8, n_head_kv=2, head_dim=64, n_ctx=64, q_stride=512, o_stride=512, cap=64, noncausal=True)
    d = hw.attention_prefill(v, v, v, v, v, k_type="q8_0", v_type="q8_0", **kw)  # type: ignore[arg-type]
    g, bq = prefill_tile(8, 2, 64)
    assert d.kernel.name == "attn_prefill" and d.groups == (64 // bq, 8 // g, 1)  # type: ignore[union-attr]
    assert asked[-1][1].get("NONCAUSAL") == 1
    prebuilt = {(n, shaders.cache_key(n, dd)) for n, dd in shaders.all_variants()}
    for name in TYPES:
        hw.attention_prefill(v, v, v, v, v, k_type=name, v_type=name, **kw)  # type: ignore[arg-type]
        assert (asked[-1][0], shaders.cache_key(*asked[-1])) in prebuilt, name
    for bad in ({"n_split": 2, "part": v}, {"emulate_cm": (4, 8)}, {"v_dim": 32}):
        with pytest.raises(AssertionError):
            hw.attention_prefill(v, v, v, v, v, **kw, **bad)  # type: ignore[arg-type]

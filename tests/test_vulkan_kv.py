"""The KV cache in every cache type on the device, at the op level: each writer (rope's
cache write, the V write, matvec's ROPE_OUT epilogue) stores the bytes kvtypes'
quantize_rows gives for the values it computed, and both attention kernels (prefill
``attention``, decode ``attention_decode`` with its split sequence) read any type and
match numpy attention over the roundtrip'd cache: causal and sliding-window, GQA,
head dims 64/128/256, lengths that are not multiples of the tile, several splits."""

from __future__ import annotations

import numpy as np
import pytest

from test_vulkan_ops import Env, make_weights, np_rope, open_env
from trio_llm.errors import BackendError
from trio_llm.model.kvtypes import KV_TYPES, dequantize_rows, kv_type, quantize_rows, roundtrip
from trio_llm.vulkan import shaders
from trio_llm.vulkan.graph import Barrier, Copy
from trio_llm.vulkan.kvcache import KVCache, LayerKV
from trio_llm.vulkan.memory import View, allocate_and_copy
from trio_llm.vulkan.ops import (
    ROPE_NEOX,
    ROPE_NONE,
    ROPE_NORMAL,
    Ops,
    attention_counters,
    attention_part_floats,
    decode_splits,
    heads_per_group,
)

pytestmark = pytest.mark.vulkan

TYPES = list(KV_TYPES)


env = pytest.fixture(scope="module", name="env")(open_env)


def _cache_rows(env: Env, view: View, n_rows: int, row_bytes: int) -> np.ndarray:
    return env.get(view, np.uint8)[: n_rows * row_bytes].reshape(n_rows, row_bytes)


def _zero_min_canonical(raw: np.ndarray, name: str) -> np.ndarray:
    """q4_1 / q5_1 rows with a block minimum of -0 (f16 0x8000) stored as +0: the two
    decode to the same values, and which zero a block of zeros keeps is not defined
    (llama.cpp's loop keeps the first; numpy's min, which gguf.quants uses, either; a
    rotated zero's sign follows cos and sin, which an NVIDIA and a CPU compiler may
    contract differently). Every other byte is compared as it is."""
    if name not in ("q4_1", "q5_1"):
        return raw
    out = raw.copy()
    blk = kv_type(name).row_bytes(32)
    m = out.reshape(*out.shape[:-1], -1, blk)[..., 2:4]  # (d, m) f16 header: m's two bytes
    neg0 = (m[..., 0] == 0) & (m[..., 1] == 0x80)
    m[..., 1][neg0] = 0
    return out


@pytest.mark.parametrize("name", TYPES)
def test_rope_cache_write_stores_the_type(env: Env, name: str) -> None:
    """rope.comp into a typed cache (normal, neox, and mode none: the V write) stores
    exactly quantize_rows of what it writes into an f32 cache; rows it does not own
    stay untouched, and position p lands in row p % n_ctx."""
    rng = np.random.default_rng(1)
    ntok, heads, hd, n_ctx, n_seq = 5, 2, 64, 40, 2
    kvd = heads * hd
    x = (rng.standard_normal((ntok, heads, hd)) * 3).astype(np.float32)
    x[1, 0, :32] = 0.0  # an all-zero block
    pos = np.array([0, 7, 39, 45, 3])  # 45: the ring wraps to row 5
    seq = np.array([0, 0, 1, 1, 1])
    rows = seq * n_ctx + pos % n_ctx
    t = kv_type(name)
    rb = t.row_bytes(kvd)
    xv, fv = env.put(x), env.put(np.linspace(1.0, 3.0, hd // 2).astype(np.float32))
    st = env.step([0] * ntok, pos, seq)
    kw = {"n_heads": heads, "head_dim": hd, "x_stride": kvd, "theta": 10000.0, "cap": 8,
          "to_cache": True, "n_ctx": n_ctx, "kv_dim": kvd}
    ops, typed, plain = [], [], []
    for mode in (ROPE_NORMAL, ROPE_NEOX, ROPE_NONE):
        c32 = env.zeros(n_seq * n_ctx * kvd)
        ct = env.put(np.full(n_seq * n_ctx * rb, 0xAB, np.uint8))
        ops += [env.ops.rope(xv, c32, fv, st, mode=mode, **kw),
                env.ops.rope(xv, ct, fv, st, mode=mode, kv_type=name, **kw)]
        plain.append(c32)
        typed.append(ct)
    env.run(ops)
    for mode, c32, ct in zip((ROPE_NORMAL, ROPE_NEOX, ROPE_NONE), plain, typed, strict=True):
        f32 = env.get(c32).reshape(n_seq * n_ctx, kvd)[rows]
        if mode == ROPE_NONE:
            np.testing.assert_array_equal(f32, x.reshape(ntok, kvd))
        got = _cache_rows(env, ct, n_seq * n_ctx, rb)
        np.testing.assert_array_equal(_zero_min_canonical(got[rows], name),
                                      _zero_min_canonical(quantize_rows(f32, name), name))
        others = np.setdiff1d(np.arange(n_seq * n_ctx), rows)
        assert (got[others] == 0xAB).all()


@pytest.mark.parametrize("name", TYPES)
def test_matvec_rope_cache_write_stores_the_type(env: Env, name: str) -> None:
    """ROPE_OUT into a typed cache (k rotated, v plain): the bytes are quantize_rows of
    the f32 variant's values; a quantized type's variant runs 32 rows per work group."""
    rng = np.random.default_rng(2)
    ntok, heads, hd, cols, n_ctx, n_seq = 3, 2, 64, 256, 24, 2
    rows = heads * hd
    raw, ref = make_weights("Q8_0", rows, cols, seed=3)
    x = rng.standard_normal((ntok, cols)).astype(np.float32)
    pos, seq = np.array([0, 23, 30]), np.array([0, 1, 1])
    cache_rows = seq * n_ctx + pos % n_ctx
    rb = kv_type(name).row_bytes(rows)
    w, xv, fv = env.put(raw), env.put(x), env.put(np.linspace(1.0, 2.0, hd // 2).astype(np.float32))
    st = env.step([0] * ntok, pos, seq)
    kw = {"n_in": cols, "n_rows": rows, "x_stride": cols, "y_stride": rows, "head_dim": hd,
          "theta": 10000.0, "to_cache": True, "n_ctx": n_ctx}
    k32, v32 = env.zeros(n_seq * n_ctx * rows), env.zeros(n_seq * n_ctx * rows)
    kt, vt = (env.put(np.zeros(n_seq * n_ctx * rb, np.uint8)) for _ in range(2))
    env.run([
        env.ops.matvec_rope("Q8_0", w, xv, k32, st, fv, rope=True, **kw),
        env.ops.matvec_rope("Q8_0", w, xv, v32, st, fv, rope=False, **kw),
        env.ops.matvec_rope("Q8_0", w, xv, kt, st, fv, rope=True, kv_type=name, **kw),
        env.ops.matvec_rope("Q8_0", w, xv, vt, st, fv, rope=False, kv_type=name, **kw),
    ])
    k = env.get(k32).reshape(-1, rows)[cache_rows]
    v = env.get(v32).reshape(-1, rows)[cache_rows]
    plain = x @ ref.T  # [ntok, rows]
    want_k = np_rope(plain.reshape(ntok, heads, hd), pos, 10000.0, ROPE_NORMAL,
                     np.linspace(1.0, 2.0, hd // 2).astype(np.float32)).reshape(ntok, rows)
    np.testing.assert_allclose(k, want_k, atol=1e-4 * np.abs(plain).max(), rtol=0)
    np.testing.assert_allclose(v, plain, atol=1e-4 * np.abs(plain).max(), rtol=0)
    got_k = _cache_rows(env, kt, n_seq * n_ctx, rb)
    got_v = _cache_rows(env, vt, n_seq * n_ctx, rb)
    np.testing.assert_array_equal(got_k[cache_rows], quantize_rows(k, name))
    np.testing.assert_array_equal(got_v[cache_rows], quantize_rows(v, name))
    others = np.setdiff1d(np.arange(n_seq * n_ctx), cache_rows)
    assert not got_k[others].any() and not got_v[others].any()


def np_attention(q, k, v, pos, seq, n_head_kv, n_swa=0):  # type: ignore[no-untyped-def]
    """q [ntok, n_head, hd]; k, v [n_seq, n_ctx, n_head_kv, hd (v: up to hd)] with position p at row
    p % n_ctx; keys [pos - n_swa + 1, pos] (all of [0, pos] when n_swa is 0)."""
    ntok, n_head, hd = q.shape
    n_ctx = k.shape[1]
    g = n_head // n_head_kv
    out = np.zeros((ntok, n_head, v.shape[-1]))  # V as wide as K, or narrower (a latent cache's)
    for t in range(ntok):
        lo = max(0, pos[t] - n_swa + 1) if n_swa else 0
        r = np.arange(lo, pos[t] + 1) % n_ctx
        for h in range(n_head):
            kk = k[seq[t], r, h // g].astype(np.float64)
            vv = v[seq[t], r, h // g].astype(np.float64)
            s = kk @ q[t, h] / np.sqrt(hd)
            p = np.exp(s - s.max())
            out[t, h] = p @ vv / p.sum()
    return out


def _typed_cache(env: Env, x: np.ndarray, name: str) -> tuple[View, np.ndarray]:
    """A cache [n_seq, n_ctx, n_kv, hd] uploaded in type ``name``, and what it holds."""
    n_seq, n_ctx, n_kv, hd = x.shape
    raw = quantize_rows(x.reshape(n_seq * n_ctx, n_kv * hd), name)
    held = dequantize_rows(raw, name, n_kv * hd).reshape(x.shape)
    np.testing.assert_array_equal(held, roundtrip(x.reshape(-1, n_kv * hd), name).reshape(x.shape))
    return env.put(raw), held


def attention_inputs(env: Env, *, ntok: int, n_seq: int, n_ctx: int, n_head: int, n_kv: int, hd: int,
                     k_type: str, v_type: str, seed: int) -> tuple[np.ndarray, View, np.ndarray, View, np.ndarray]:
    """Random queries [ntok, n_head, hd] and K / V caches [n_seq, n_ctx, n_kv, hd] (V
    twice as wide), the caches uploaded in their types: (q, K view, K held, V view, V
    held), the same draws for the same seed in every attention test."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((ntok, n_head, hd)).astype(np.float32)
    kx = rng.standard_normal((n_seq, n_ctx, n_kv, hd)).astype(np.float32)
    vx = (rng.standard_normal((n_seq, n_ctx, n_kv, hd)) * 2).astype(np.float32)
    kc, kh = _typed_cache(env, kx, k_type)
    vc, vh = _typed_cache(env, vx, v_type)
    return q, kc, kh, vc, vh


def _run_attention(env: Env, ops: Ops, *, hd: int, n_head: int, n_kv: int, pos: list[int],
                   seq: list[int], n_ctx: int, k_type: str, v_type: str, n_swa: int = 0,
                   decode: bool = True, n_split: int = 8, min_chunk: int | None = None,
                   seed: int = 0) -> None:
    ntok, n_seq = len(pos), max(seq) + 1
    q, kc, kh, vc, vh = attention_inputs(env, ntok=ntok, n_seq=n_seq, n_ctx=n_ctx, n_head=n_head, n_kv=n_kv,
                                         hd=hd, k_type=k_type, v_type=v_type, seed=seed)
    qv, o = env.put(q), env.zeros(q.size)
    st = env.step([0] * ntok, pos, seq)
    cap = 8
    kw = {"n_head": n_head, "n_head_kv": n_kv, "head_dim": hd, "n_ctx": n_ctx, "q_stride": n_head * hd,
          "o_stride": n_head * hd, "cap": cap, "k_type": k_type, "v_type": v_type, "n_swa": n_swa}
    if decode:
        part = env.zeros(attention_part_floats(cap, n_head, hd, n_split))
        counters = env.zeros(attention_counters(cap, n_head, n_kv), np.uint32)
        op = ops.attention_decode(qv, kc, vc, o, part, counters, st, n_split=n_split, min_chunk=min_chunk, **kw)
        # twice: the second dispatch finds the counters the first one left at zero
        env.run([op, Barrier(), op])
        assert not env.get(counters, np.uint32).any()
    else:
        env.run([ops.attention(qv, kc, vc, o, st, **kw)])
    want = np_attention(q, kh, vh, np.array(pos), np.array(seq), n_kv, n_swa)
    np.testing.assert_allclose(env.get(o).reshape(q.shape), want, atol=3e-5 * np.abs(vh).max(), rtol=0)


# positions: the first key alone, tile edges (63/64, 127/128), several tiles and splits
POS = [0, 63, 64, 127, 128, 290, 5, 200]
SEQ = [0, 0, 0, 0, 0, 0, 1, 1]


@pytest.mark.parametrize("name", TYPES)
def test_decode_attention_reads_every_type(env: Env, name: str) -> None:
    """Split over up to 8 work groups of 64-key tiles (min_chunk 64): position 290 is
    five splits of 64 and one of 35 keys."""
    ops = Ops(env.ops.kernels, subgroup=env.ops.subgroup, decode_wg=64)
    _run_attention(env, ops, hd=128, n_head=8, n_kv=2, pos=POS, seq=SEQ, n_ctx=300,
                   k_type=name, v_type=name, min_chunk=64, seed=TYPES.index(name))


@pytest.mark.parametrize("name", TYPES)
def test_prefill_attention_reads_every_type(env: Env, name: str) -> None:
    _run_attention(env, env.ops, hd=64, n_head=4, n_kv=2, pos=POS, seq=SEQ, n_ctx=300,
                   k_type=name, v_type=name, decode=False, seed=10 + TYPES.index(name))


@pytest.mark.parametrize("hd", [64, 128, 256])
@pytest.mark.parametrize("gqa", [1, 4, 8])
def test_decode_attention_head_dims_and_gqa(env: Env, hd: int, gqa: int) -> None:
    """The default f16 cache, the default tile (decode_wg 128, min_chunk 128) and a
    context of 700: positions past 128 split, 699 into six."""
    n_kv = 2
    _run_attention(env, env.ops, hd=hd, n_head=gqa * n_kv, n_kv=n_kv, pos=[0, 255, 256, 699, 400],
                   seq=[0, 0, 0, 0, 1], n_ctx=700, k_type="f16", v_type="f16",
                   n_split=decode_splits(700), seed=hd + gqa)


def test_decode_attention_large_gqa_and_mixed_types(env: Env) -> None:
    """GQA 16 runs two work groups of 8 heads per KV head; K q8_0 with V f16 and the
    reverse (llama-server takes -ctk and -ctv apart)."""
    assert heads_per_group(16, 1) == 8 and heads_per_group(12, 2) == 6 and heads_per_group(5, 1) == 5
    _run_attention(env, env.ops, hd=64, n_head=16, n_kv=1, pos=[3, 300], seq=[0, 0], n_ctx=310,
                   k_type="q8_0", v_type="f16", min_chunk=128, seed=40)
    _run_attention(env, env.ops, hd=64, n_head=4, n_kv=2, pos=[3, 300], seq=[0, 0], n_ctx=310,
                   k_type="f16", v_type="q4_0", min_chunk=128, decode=False, seed=41)


@pytest.mark.parametrize("decode", [True, False])
@pytest.mark.parametrize("name", ["f16", "q8_0"])
def test_sliding_window_and_ring_cache(env: Env, decode: bool, name: str) -> None:
    """A window of 100 (gemma-3's sliding layers), and a ring: a cache of 160 rows
    for positions up to 500 (position p in row p % 160) still holds the window."""
    kw = {"hd": 64, "n_head": 4, "n_kv": 1, "k_type": name, "v_type": name, "decode": decode,
          "n_split": 4, "min_chunk": 128}
    _run_attention(env, env.ops, pos=[0, 50, 99, 100, 299], seq=[0] * 5, n_ctx=300, n_swa=100, seed=50, **kw)
    _run_attention(env, env.ops, pos=[150, 159, 160, 420, 500], seq=[0] * 5, n_ctx=160, n_swa=100, seed=51, **kw)


@pytest.mark.parametrize(("hd", "dv", "n_head", "name", "wg"), [
    (576, 512, 20, "f16", 128),  # GLM-4.7-Flash: 20 heads (work groups of 5), one KV head
    (576, 512, 16, "q8_0", 128),
    (288, 256, 4, "f32", 64),  # tiny-deepseek2's row, 64-key tiles: two key groups of 64 lanes
    (288, 256, 4, "q4_0", 128),
])
def test_decode_attention_of_a_latent_cache(env: Env, hd: int, dv: int, n_head: int, name: str, wg: int) -> None:
    """attn_decode.comp's LATENT form (MLA): K rows of ``hd`` values, V the first ``dv``
    of each row from the same cache, one KV head, split over up to 8 work groups at
    depths on and off the tile (positions 0, 63, 64, 127, 128, 290, 700): against numpy
    over the roundtrip'd cache. Only the first dv values of each output head are written
    (the rest keep their fill); twice, so the counters come back zero."""
    ops = Ops(env.ops.kernels, subgroup=env.ops.subgroup, decode_wg=wg)
    assert ops.decode_latent_ok(n_head, 1, hd, dv) and not ops.decode_latent_ok(n_head, 1, 580, dv)
    pos, seq, n_ctx, n_split, cap = [0, 63, 64, 127, 128, 290, 700, 5], [0, 0, 0, 0, 0, 0, 0, 1], 710, 8, 8
    rng = np.random.default_rng(hd + n_head + wg)
    q = rng.standard_normal((len(pos), n_head, hd)).astype(np.float32)
    kc, kh = _typed_cache(env, rng.standard_normal((2, n_ctx, 1, hd)).astype(np.float32), name)
    qv = env.put(q)
    o = env.put(np.full(q.size, 7.0, np.float32))
    st = env.step([0] * len(pos), pos, seq)
    part = env.zeros(attention_part_floats(cap, n_head, hd, n_split))
    counters = env.zeros(attention_counters(cap, n_head, 1), np.uint32)
    op = ops.attention_decode(qv, kc, kc, o, part, counters, st, n_head=n_head, n_head_kv=1, head_dim=hd,
                              n_ctx=n_ctx, q_stride=n_head * hd, o_stride=n_head * hd, cap=cap, k_type=name,
                              v_type=name, n_split=n_split, min_chunk=wg, scale=0.07, v_dim=dv)
    env.run([op, Barrier(), op])
    assert not env.get(counters, np.uint32).any()
    got = env.get(o).reshape(q.shape)
    want = np_attention(q * (0.07 * np.sqrt(hd)), kh, kh[..., :dv], np.array(pos), np.array(seq), 1)
    np.testing.assert_allclose(got[..., :dv], want, atol=3e-5 * np.abs(kh).max(), rtol=0)
    assert (got[..., dv:] == 7.0).all()


def test_the_latent_decode_variants_are_prebuilt(env: Env) -> None:
    """Every cache type's LATENT attn_decode, as attention_decode asks for it, is in
    ``all_variants`` (``trio-llm compile-shaders``: the GPU machine compiles nothing)."""
    asked: list[tuple[str, dict[str, object]]] = []

    class Spy:
        def __getattr__(self, name: str) -> object:
            return getattr(env.ops.kernels, name)

        def get(self, name: str, **kw: object) -> object:
            asked.append((name, dict(kw.get("defines") or {})))  # type: ignore[call-overload]
            return env.ops.kernels.get(name, **kw)  # type: ignore[arg-type]

    ops = Ops(Spy(), subgroup=env.ops.subgroup)  # type: ignore[arg-type]
    prebuilt = {(n, shaders.cache_key(n, d)) for n, d in shaders.all_variants()}
    v = env.zeros(1 << 16)
    for name in TYPES:
        ops.attention_decode(v, v, v, v, v, v, v, n_head=4, n_head_kv=1, head_dim=576, n_ctx=8, q_stride=2304,
                             o_stride=2304, cap=1, n_split=1, k_type=name, v_type=name, v_dim=512)
    assert len(asked) == len(TYPES) and all(d.get("LATENT") == 1 for _, d in asked)
    assert all((n, shaders.cache_key(n, d)) in prebuilt for n, d in asked), asked


def test_decode_attention_equals_prefill_attention(env: Env) -> None:
    """The two kernels agree with each other on the same inputs (f16), including a
    single split (no partials) and many."""
    rng = np.random.default_rng(60)
    hd, n_head, n_kv, n_ctx = 128, 8, 2, 1000
    pos, seq = [0, 100, 999, 513], [0, 0, 0, 1]
    q = rng.standard_normal((4, n_head, hd)).astype(np.float32)
    kc, _ = _typed_cache(env, rng.standard_normal((2, n_ctx, n_kv, hd)).astype(np.float32), "f16")
    vc, _ = _typed_cache(env, rng.standard_normal((2, n_ctx, n_kv, hd)).astype(np.float32), "f16")
    qv, o1, o2 = env.put(q), env.zeros(q.size), env.zeros(q.size)
    st = env.step([0] * 4, pos, seq)
    n_split = decode_splits(n_ctx)
    kw = {"n_head": n_head, "n_head_kv": n_kv, "head_dim": hd, "n_ctx": n_ctx, "q_stride": n_head * hd,
          "o_stride": n_head * hd, "cap": 4, "k_type": "f16", "v_type": "f16"}
    part = env.zeros(attention_part_floats(4, n_head, hd, n_split))
    counters = env.zeros(attention_counters(4, n_head, n_kv), np.uint32)
    env.run([
        env.ops.attention(qv, kc, vc, o1, st, **kw),
        env.ops.attention_decode(qv, kc, vc, o2, part, counters, st, n_split=n_split, **kw),
    ])
    np.testing.assert_allclose(env.get(o2), env.get(o1), atol=2e-5, rtol=0)


def test_bad_shapes_are_refused(env: Env) -> None:
    v = env.zeros(64)
    with pytest.raises(ValueError, match="K cache type q8_0 needs head_dim a multiple of 32, not 48"):
        env.ops.attention(v, v, v, v, v, n_head=2, n_head_kv=1, head_dim=48, n_ctx=4, q_stride=96,
                          o_stride=96, cap=1, k_type="q8_0")
    with pytest.raises(ValueError, match="unsupported KV cache type 'q4_k'"):
        env.ops.attention(v, v, v, v, v, n_head=2, n_head_kv=1, head_dim=64, n_ctx=4, q_stride=128,
                          o_stride=128, cap=1, v_type="q4_k")
    assert decode_splits(100) == 1 and decode_splits(32768) == 64 and decode_splits(1000) == 8


def test_kv_cache_rows_and_release_carry_raw_bytes(env: Env) -> None:
    """KVCache per layer in its types: raw rows written and read back unchanged, a
    release to host and restore (level ``all``) brings back the same bytes, and the
    attention's counters come back zero-filled; the buffers are sized by type."""
    n_layer, n_seq, n_ctx, kvd = 2, 2, 16, 128
    kv = KVCache.uniform(env.alloc, n_layer, n_seq=n_seq, n_ctx=n_ctx, kv_dim=kvd, k_type="q8_0",
                         v_type="q4_1", part_floats=100, n_counters=12)
    assert kv.bytes_per_token == n_layer * (136 + 80)
    assert kv.total_bytes == n_seq * n_ctx * kv.bytes_per_token
    kv.allocate()
    try:
        assert [b.size for b in kv.k] == [n_seq * n_ctx * 136] * 2 and kv.v[0].size == n_seq * n_ctx * 80
        assert set(kv.roles()) == {("k", 0), ("v", 0), ("k", 1), ("v", 1), ("kvw", "part"), ("kvw", "counters")}
        rng = np.random.default_rng(70)
        rows = [(quantize_rows(rng.standard_normal((9, kvd)), "q8_0"),
                 quantize_rows(rng.standard_normal((9, kvd)), "q4_1")) for _ in range(n_layer)]
        other = [(np.full((n_ctx, 136), 5, np.uint8), np.full((n_ctx, 80), 6, np.uint8))] * n_layer
        kv.write_rows(0, other)
        kv.write_rows(1, rows)
        back = kv.read_rows(1, 9)
        for (k0, v0), (k1, v1) in zip(rows, back, strict=True):
            np.testing.assert_array_equal(k0, k1)
            np.testing.assert_array_equal(v0, v1)
        for k0, v0 in kv.read_rows(0, n_ctx):  # the other sequence untouched
            assert (k0 == 5).all() and (v0 == 6).all()
        kv.to_host()
        assert not kv.on_device and kv.saved
        allocate_and_copy(env.alloc, kv.restore_jobs())
        kv.restored()
        for (k0, v0), (k1, v1) in zip(rows, kv.read_rows(1, 9), strict=True):
            np.testing.assert_array_equal(k0, k1)
            np.testing.assert_array_equal(v0, v1)
        assert kv.part is not None
        seen = env.put(np.full(12, 7, np.uint32))
        env.run([Copy(kv.counter_view(), seen)])
        assert not env.get(seen, np.uint32).any()
        with pytest.raises(BackendError, match=r"expected \(9, 136\)"):
            kv.write_rows(0, [(r[1], r[1]) for r in rows])
        with pytest.raises(BackendError, match="17 positions from 0 do not fit a cache of 16 rows"):
            kv.read_rows(0, 17)
        # a ring: positions 12..21 of a 16-row sequence are rows 12..15 then 0..5
        ring = [(quantize_rows(rng.standard_normal((10, kvd)), "q8_0"),
                 quantize_rows(rng.standard_normal((10, kvd)), "q4_1")) for _ in range(n_layer)]
        kv.write_rows(1, ring, start=12)
        whole_seq = kv.read_rows(1, 16)
        for (k0, v0), (k1, v1), (kr, vr) in zip(ring, whole_seq, kv.read_rows(1, 10, start=12), strict=True):
            np.testing.assert_array_equal(k1[12:], k0[:4])
            np.testing.assert_array_equal(k1[:6], k0[4:])
            np.testing.assert_array_equal(v1[12:], v0[:4])
            np.testing.assert_array_equal(kr, k0)
            np.testing.assert_array_equal(vr, v0)
    finally:
        kv.free_device()
        kv.free_host()


def test_a_latent_layer_has_no_v_buffer(env: Env) -> None:
    """A latent layer (``v_is_k``, MLA) beside an ordinary one: K only in every count
    (its V rows are 0 bytes), no V buffer or role, its V view is K's buffer; a release
    to host copies K alone and the restore brings the same bytes back; its slot rows
    carry an empty V."""
    n_seq, n_ctx, kvd = 2, 32, 64  # buffers of whole 256-byte units: their sizes are exact
    lat = LayerKV(n_seq, n_ctx, kvd, "q8_0", "f16", v_is_k=True)
    plain = LayerKV(n_seq, n_ctx, kvd, "q8_0", "f16")
    kv = KVCache(env.alloc, [lat, plain])
    assert (lat.v_row_bytes, lat.v_bytes) == (0, 0) and plain.v_row_bytes == 128
    assert kv.bytes_per_token == 68 + (68 + 128)
    assert kv.total_bytes == n_seq * n_ctx * kv.bytes_per_token
    kv.allocate()
    try:
        assert kv.v[0] is None and kv.v[1] is not None
        assert set(kv.roles()) == {("k", 0), ("k", 1), ("v", 1)}
        assert kv.v_view(0).buffer is kv.k[0]
        rng = np.random.default_rng(71)
        rows = [(quantize_rows(rng.standard_normal((5, kvd)), "q8_0"), np.zeros((5, 0), np.uint8)),
                (quantize_rows(rng.standard_normal((5, kvd)), "q8_0"),
                 quantize_rows(rng.standard_normal((5, kvd)), "f16"))]
        kv.write_rows(1, rows)
        kv.to_host()
        assert [b.size for b in kv.host] == [lat.k_bytes, plain.k_bytes, plain.v_bytes]
        allocate_and_copy(env.alloc, kv.restore_jobs())
        kv.restored()
        assert kv.v[0] is None and [b.size for b in kv.k] == [lat.k_bytes, plain.k_bytes]
        back = kv.read_rows(1, 5)
        assert back[0][1].shape == (5, 0)
        for (k0, v0), (k1, v1) in zip(rows, back, strict=True):
            np.testing.assert_array_equal(k0, k1)
            np.testing.assert_array_equal(v0, v1)
    finally:
        kv.free_device()
        kv.free_host()


@pytest.mark.parametrize("name", TYPES)
def test_written_cache_read_by_both_attentions(env: Env, name: str) -> None:
    """End to end at the op level: a prefill chunk's K (rotated, neox) and V go into a
    typed cache through rope.comp, a decode token's through matvec's ROPE_OUT (k rotated
    in llama's pairs, v plain), then both attention kernels read the cache; each
    equals numpy attention over roundtrip(what was written)."""
    rng = np.random.default_rng(80 + TYPES.index(name))
    heads, n_head, hd, cols, n_ctx = 2, 8, 64, 128, 80
    kvd = heads * hd
    n_pre = 70  # positions 0..69 from the "prefill", 70 from the "decode"
    kx = rng.standard_normal((n_pre, heads, hd)).astype(np.float32)
    vx = rng.standard_normal((n_pre, heads, hd)).astype(np.float32)
    raw_k, ref_k = make_weights("Q8_0", kvd, cols, seed=81)
    raw_v, ref_v = make_weights("Q8_0", kvd, cols, seed=82)
    x = rng.standard_normal((1, cols)).astype(np.float32)
    q = rng.standard_normal((1, n_head, hd)).astype(np.float32)
    factors = np.ones(hd // 2, np.float32)
    rb = kv_type(name).row_bytes(kvd)
    kc, vc = env.put(np.zeros(n_ctx * rb, np.uint8)), env.put(np.zeros(n_ctx * rb, np.uint8))
    fv = env.put(factors)
    st_pre = env.step([0] * n_pre, np.arange(n_pre), [0] * n_pre)
    st_dec = env.step([0], [n_pre], [0])
    kw = {"n_heads": heads, "head_dim": hd, "x_stride": kvd, "theta": 10000.0, "cap": 128,
          "to_cache": True, "n_ctx": n_ctx, "kv_dim": kvd, "kv_type": name}
    mkw = {"n_in": cols, "n_rows": kvd, "x_stride": cols, "y_stride": kvd, "head_dim": hd,
           "theta": 10000.0, "to_cache": True, "n_ctx": n_ctx, "kv_type": name}
    env.run([
        env.ops.rope(env.put(kx), kc, fv, st_pre, mode=ROPE_NEOX, **kw),
        env.ops.rope(env.put(vx), vc, fv, st_pre, mode=ROPE_NONE, **kw),
    ])
    xv, qv = env.put(x), env.put(q)
    o1, o2 = env.zeros(q.size), env.zeros(q.size)
    part = env.zeros(attention_part_floats(1, n_head, hd, 4))
    counters = env.zeros(attention_counters(1, n_head, heads), np.uint32)
    # tiles of 32 keys, splits of at least 64: the 71 keys are two splits
    dops = Ops(env.ops.kernels, subgroup=env.ops.subgroup, decode_wg=max(32, env.ops.subgroup))
    akw = {"n_head": n_head, "n_head_kv": heads, "head_dim": hd, "n_ctx": n_ctx, "q_stride": n_head * hd,
           "o_stride": n_head * hd, "cap": 1, "k_type": name, "v_type": name}
    env.run([
        env.ops.matvec_rope("Q8_0", env.put(raw_k), xv, kc, st_dec, fv, rope=True, **mkw),
        env.ops.matvec_rope("Q8_0", env.put(raw_v), xv, vc, st_dec, fv, rope=False, **mkw),
        Barrier(),
        env.ops.attention(qv, kc, vc, o1, st_dec, **akw),
        dops.attention_decode(qv, kc, vc, o2, part, counters, st_dec, n_split=4, **akw),
    ])
    k_all = np.concatenate([np_rope(kx, np.arange(n_pre), 10000.0, ROPE_NEOX, factors),
                            np_rope((x @ ref_k.T).reshape(1, heads, hd), np.array([n_pre]), 10000.0,
                                    ROPE_NORMAL, factors)])  # [71, heads, hd]
    v_all = np.concatenate([vx, (x @ ref_v.T).reshape(1, heads, hd)])
    kh = roundtrip(k_all.reshape(-1, kvd), name).reshape(1, -1, heads, hd)
    vh = roundtrip(v_all.reshape(-1, kvd), name).reshape(1, -1, heads, hd)
    want = np_attention(q, kh, vh, np.array([n_pre]), np.array([0]), heads)
    # the device's K/V floats differ from numpy's in the last bits, which can move a
    # value across a quantization step: a looser bound for the 4- and 5-bit types
    tol = 3e-4 if kv_type(name).block == 1 or name == "q8_0" else 3e-2
    np.testing.assert_allclose(env.get(o1).reshape(q.shape), want, atol=tol, rtol=0)
    np.testing.assert_allclose(env.get(o2).reshape(q.shape), want, atol=tol, rtol=0)
    assert not env.get(counters, np.uint32).any()


@pytest.mark.parametrize("name", ["q4_0", "q4_1", "q8_0"])
@pytest.mark.parametrize(("hd", "heads", "block"), [(512, 2, 512), (512, 2, 64), (256, 2, 256), (128, 4, 128)])
def test_rotated_cache_write_stores_numpys_bytes(env: Env, hd: int, heads: int, block: int, name: str) -> None:
    """The writers of a rotated cache as the lowering chains them (hadamard.comp in place,
    then rope.comp mode none into the typed cache): K in blocks of the head (512:
    gemma4's full layers, 256 its sliding ones), V in blocks of 64. The rotation is
    numpy's to the bit and the stored blocks are quantize_rows of numpy's rotation byte
    for byte, so a whole-model gap at a 4-bit cache is not the writers' (these draws
    hold no quotient 1 / d within a rounding error of a float midpoint, where kv_div's
    one-step correction can land an ulp off and flip a level: a q5_0 draw of these
    shapes does, one byte in 21120)."""
    from trio_llm.model.kvtypes import hadamard

    rng = np.random.default_rng(hd + block)
    ntok, n_ctx = 30, 32
    kvd = heads * hd
    x = rng.standard_normal((ntok, kvd)).astype(np.float32)
    x[:, ::37] *= 6  # outliers, as the rotation is for
    rb = kv_type(name).row_bytes(kvd)
    xv, ct = env.put(x), env.put(np.full(n_ctx * rb, 0xAB, np.uint8))
    st = env.step([0] * ntok, np.arange(ntok))
    env.run([env.ops.hadamard(xv, xv, st, width=kvd, stride=kvd, block=block, cap=32), Barrier(),
             env.ops.rope(xv, ct, env.put(np.ones(hd // 2, np.float32)), st, n_heads=heads, head_dim=hd,
                          x_stride=kvd, mode=ROPE_NONE, theta=10000.0, cap=32, to_cache=True, n_ctx=n_ctx,
                          kv_dim=kvd, kv_type=name)])
    rot = hadamard(x, block)
    np.testing.assert_array_equal(env.get(xv).reshape(-1, kvd)[:ntok], rot)
    got = _cache_rows(env, ct, n_ctx, rb)
    np.testing.assert_array_equal(got[:ntok], quantize_rows(rot, name))
    assert (got[ntok:] == 0xAB).all()

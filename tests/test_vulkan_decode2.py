"""attention_decode's coalesced form (attn_decode2.comp, ``Ops.decode_attn2``) on the
device against numpy attention over the roundtrip'd cache and against the current
kernel (attn_decode.comp) on the same inputs and buffers' contract: every KV type,
head dims 64/96/128/256, GQA 1/4/8/16, lengths across tile, iteration and split edges,
sliding windows, ring caches, several sequences in one step, and the row-group shapes
(lanes per row, rows in flight) that a 32-lane GPU takes but lavapipe's 8-lane
subgroups would not choose by themselves."""

from __future__ import annotations

import numpy as np
import pytest

from test_vulkan_kv import TYPES, attention_inputs, np_attention
from test_vulkan_ops import Env, open_env
from trio_llm.vulkan.device import SUBGROUP_SHUFFLE
from trio_llm.vulkan.graph import Barrier
from trio_llm.vulkan.ops import (
    Ops,
    attention_counters,
    attention_part_floats,
    decode2_lanes,
    decode2_shared,
    decode_splits,
)

pytestmark = pytest.mark.vulkan


env = pytest.fixture(scope="module", name="env")(open_env)


def _ops(env: Env, *, new: bool, wg: int = 128, lanes: int = 0, rows: int = 4) -> Ops:
    return Ops(env.ops.kernels, subgroup=env.ops.subgroup, decode_wg=max(wg, env.ops.subgroup),
               decode_attn2=new, decode2_lanes=lanes, decode2_rows=rows)


def _both(env: Env, *, hd: int, n_head: int, n_kv: int, pos: list[int], seq: list[int], n_ctx: int,
          k_type: str, v_type: str, n_swa: int = 0, n_split: int = 8, min_chunk: int | None = None,
          wg: int = 128, lanes: int = 0, rows: int = 4, seed: int = 0) -> None:
    """Both kernels on one cache and query (each dispatched twice, the second finding
    the counters the first left at zero): the new one equals numpy within the current
    kernel's bound and the current kernel within f32 rounding."""
    ntok, n_seq = len(pos), max(seq) + 1
    q, kc, kh, vc, vh = attention_inputs(env, ntok=ntok, n_seq=n_seq, n_ctx=n_ctx, n_head=n_head, n_kv=n_kv,
                                         hd=hd, k_type=k_type, v_type=v_type, seed=seed)
    qv, o_new, o_old = env.put(q), env.zeros(q.size), env.zeros(q.size)
    st = env.step([0] * ntok, pos, seq)
    cap = 8
    kw = {"n_head": n_head, "n_head_kv": n_kv, "head_dim": hd, "n_ctx": n_ctx, "q_stride": n_head * hd,
          "o_stride": n_head * hd, "cap": cap, "k_type": k_type, "v_type": v_type, "n_swa": n_swa,
          "n_split": n_split, "min_chunk": min_chunk}
    new, old = _ops(env, new=True, wg=wg, lanes=lanes, rows=rows), _ops(env, new=False, wg=wg)
    assert new.decode2_ok(n_head, n_kv, hd)
    bufs = [(env.zeros(attention_part_floats(cap, n_head, hd, n_split)),
             env.zeros(attention_counters(cap, n_head, n_kv), np.uint32)) for _ in range(2)]
    d_new = new.attention_decode(qv, kc, vc, o_new, *bufs[0], st, **kw)  # type: ignore[arg-type]
    d_old = old.attention_decode(qv, kc, vc, o_old, *bufs[1], st, **kw)  # type: ignore[arg-type]
    assert d_new.kernel.name == "attn_decode2" and d_old.kernel.name == "attn_decode"
    assert d_new.groups == d_old.groups
    env.run([d_new, d_old, Barrier(), d_new, d_old])
    for _, counters in bufs:
        assert not env.get(counters, np.uint32).any()
    want = np_attention(q, kh, vh, np.array(pos), np.array(seq), n_kv, n_swa)
    got = env.get(o_new).reshape(q.shape)
    scale = np.abs(vh).max()
    np.testing.assert_allclose(got, want, atol=3e-5 * scale, rtol=0)
    np.testing.assert_allclose(got, env.get(o_old).reshape(q.shape), atol=2e-5 * scale, rtol=0)


# positions: the first key alone, tile edges (63/64, 127/128), several tiles and splits
POS = [0, 63, 64, 127, 128, 290, 5, 200]
SEQ = [0, 0, 0, 0, 0, 0, 1, 1]


@pytest.mark.parametrize("name", TYPES)
def test_decode2_reads_every_type(env: Env, name: str) -> None:
    """Splits of 64-key chunks on 64-lane groups: position 290 is five splits of 64 and
    one of 35 keys; then the default 128-lane group and chunk."""
    i = TYPES.index(name)
    _both(env, hd=128, n_head=8, n_kv=2, pos=POS, seq=SEQ, n_ctx=300, k_type=name, v_type=name,
          wg=64, min_chunk=64, seed=100 + i)
    _both(env, hd=64, n_head=4, n_kv=1, pos=POS, seq=SEQ, n_ctx=300, k_type=name, v_type=name,
          n_split=decode_splits(300), seed=120 + i)


@pytest.mark.parametrize("hd", [64, 128, 256])
@pytest.mark.parametrize("gqa", [1, 4, 8, 16])
def test_decode2_head_dims_and_gqa(env: Env, hd: int, gqa: int) -> None:
    """f16, the default tile and a context of 700: positions past 128 split, 699 into
    six; GQA 16 is two work groups of 8 heads per KV head."""
    _both(env, hd=hd, n_head=gqa * 2, n_kv=2, pos=[0, 255, 256, 699, 400], seq=[0, 0, 0, 0, 1],
          n_ctx=700, k_type="f16", v_type="f16", n_split=decode_splits(700), seed=hd + gqa)


@pytest.mark.parametrize(("name", "lanes", "rows"), [("f16", 1, 1), ("f16", 2, 3), ("q8_0", 2, 3), ("f16", 4, 8),
                                                    ("q8_0", 4, 1), ("f32", 8, 2)])
def test_decode2_row_group_shapes(env: Env, name: str, lanes: int, rows: int) -> None:
    """Lanes per row from 1 (a whole 64-value row per lane, eight pieces) to 8 and 1 to 8
    rows in flight, an odd count among them; iterations of 128 / lanes * rows keys end
    mid-split."""
    _both(env, hd=64, n_head=8, n_kv=2, pos=[30, 127, 128, 333, 511], seq=[0, 0, 0, 1, 1], n_ctx=520,
          k_type=name, v_type=name, n_split=decode_splits(520), lanes=lanes, rows=rows, seed=lanes * 10 + rows)


def test_decode2_odd_head_dims_and_mixed_types(env: Env) -> None:
    """head_dim 96 (12 pieces: 4 lanes of 3) and 80 (2 lanes of 5); K q8_0 with V f16
    and K f16 with V q4_0 (llama-server takes -ctk and -ctv apart)."""
    assert decode2_lanes(96, 32) == 4 and decode2_lanes(80, 32) == 2 and decode2_lanes(256, 32) == 32
    _both(env, hd=96, n_head=6, n_kv=2, pos=[5, 300], seq=[0, 1], n_ctx=310, k_type="f16", v_type="f16", seed=60)
    _both(env, hd=80, n_head=2, n_kv=1, pos=[5, 300], seq=[0, 0], n_ctx=310, k_type="bf16", v_type="bf16", seed=61)
    _both(env, hd=64, n_head=16, n_kv=1, pos=[3, 300], seq=[0, 0], n_ctx=310, k_type="q8_0", v_type="f16",
          min_chunk=128, seed=62)
    _both(env, hd=128, n_head=4, n_kv=2, pos=[3, 300], seq=[0, 0], n_ctx=310, k_type="f16", v_type="q4_0",
          min_chunk=128, seed=63)


@pytest.mark.parametrize("name", ["f16", "q8_0"])
def test_decode2_sliding_window_and_ring_cache(env: Env, name: str) -> None:
    """A window of 100 (gemma-3's sliding layers), and a ring: a cache of 160 rows for
    positions up to 500 (position p in row p % 160) still holds the window."""
    kw = {"hd": 64, "n_head": 4, "n_kv": 1, "k_type": name, "v_type": name, "n_split": 4, "min_chunk": 128}
    _both(env, pos=[0, 50, 99, 100, 299], seq=[0] * 5, n_ctx=300, n_swa=100, seed=70, **kw)  # type: ignore[arg-type]
    _both(env, pos=[150, 159, 160, 420, 500], seq=[0] * 5, n_ctx=160, n_swa=100, seed=71, **kw)  # type: ignore[arg-type]


def test_decode2_deep_many_splits(env: Env) -> None:
    """9000 keys over 64 splits of 256 (36 live) and one of a second sequence at 4000."""
    _both(env, hd=64, n_head=4, n_kv=1, pos=[8999, 4000], seq=[0, 1], n_ctx=9000, k_type="f16", v_type="f16",
          n_split=decode_splits(9000), seed=80)


def test_decode2_selection(env: Env, monkeypatch: pytest.MonkeyPatch) -> None:
    """On by default, off with TRIO_LLM_ATTN_DECODE2=0; where it cannot run (a head_dim
    that is not a multiple of 8, lanes wider than the subgroup) the current kernel does."""
    k = env.ops.kernels
    monkeypatch.delenv("TRIO_LLM_ATTN_DECODE2", raising=False)
    assert Ops(k).decode_attn2
    monkeypatch.setenv("TRIO_LLM_ATTN_DECODE2", "0")
    assert not Ops(k).decode_attn2
    monkeypatch.setenv("TRIO_LLM_ATTN_DECODE2", "1")
    assert Ops(k).decode_attn2
    assert env.device.limits.has_subgroup(SUBGROUP_SHUFFLE)
    sg = env.ops.subgroup
    on = _ops(env, new=True)
    assert on.decode2_ok(8, 2, 64) and not on.decode2_ok(8, 2, 36)
    assert not _ops(env, new=True, lanes=2 * sg).decode2_ok(8, 2, 16 * sg)
    assert decode2_shared(128, 8, 8, 64, sg) <= env.device.limits.max_shared_memory
    v = env.zeros(4096)
    kw = {"n_head": 2, "n_head_kv": 1, "n_ctx": 4, "cap": 1, "n_split": 1}
    assert on.attention_decode(v, v, v, v, v, v, v, head_dim=36, q_stride=72, o_stride=72,
                               **kw).kernel.name == "attn_decode"
    assert on.attention_decode(v, v, v, v, v, v, v, head_dim=64, q_stride=128, o_stride=128,
                               **kw).kernel.name == "attn_decode2"


@pytest.mark.usefixtures("f32_activations")
@pytest.mark.parametrize("preset", ["tiny-qwen3", "tiny-gemma3"])
def test_decode2_through_the_backend(model_path, monkeypatch: pytest.MonkeyPatch, preset: str) -> None:  # type: ignore[no-untyped-def]
    """With TRIO_LLM_ATTN_DECODE2=0 (attn_decode.comp: the default's fallback where
    ``decode2_ok`` fails; test_vulkan_model.py's checks run the default, attn_decode2)
    the backend's decode steps (two sequences per step,
    64 greedy tokens; tiny-gemma3's sliding layers on rings of 24 rows, chunks of 8)
    follow numpy's greedy path and logits, as test_vulkan_model.py's checks of the
    default kernel do."""
    from test_vulkan_model import F32_KV, N_CTX, assert_follows_numpy
    from trio_llm.engine.reference import NumpyBackend
    from trio_llm.model.gguf import load_gguf
    from trio_llm.vulkan.backend import VulkanBackend

    monkeypatch.setenv("TRIO_LLM_ATTN_DECODE2", "0")
    model = load_gguf(model_path(preset, "Q8_0"))
    ref = NumpyBackend(model, n_ctx=N_CTX, n_seq=2, max_chunk=8, **F32_KV)
    vk = VulkanBackend(model, n_ctx=N_CTX, n_seq=2, max_chunk=8, **F32_KV)
    try:
        assert not vk._ops.decode_attn2
        assert_follows_numpy(vk, ref)
        # the decode buckets' graphs run the old kernel (the kernel cache is shared with
        # other backends of the process, so the lowering is what says which one runs)
        from trio_llm.vulkan.graph import Dispatch

        for bucket in (1, 2):
            names = {op.kernel.name for op in vk.lowered(bucket) if isinstance(op, Dispatch)}
            assert "attn_decode" in names and "attn_decode2" not in names, names
    finally:
        vk.close()
        ref.close()

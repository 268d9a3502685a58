"""Attention over 512-wide heads (gemma4's full-attention layers; its sliding-window
layers are 256) on every kernel the backend can choose, against numpy on lavapipe:
decode attention at depth (attn_decode.comp's WIDE form, and attn_decode2.comp where its
shared memory fits: 64-lane work groups on lavapipe's 8-lane subgroups) with its splits
and combine, the scalar tiled prefill (attn_prefill.comp on the rows
``Ops.prefill_wide_rows`` fits in the device's shared memory: 8 on lavapipe's 32 KiB),
causal and non-causal, split and combined, every KV cache type, GQA 1/2/4/8 (and 3),
sliding windows over a ring, token counts off the tile; 256 beside it. The
cooperative-matrix prefill kernels stop at 256: ``test_wide_heads_take_the_scalar_prefill``
checks the choice on a device that reports cooperative matrices (faked: lavapipe has
none), by the head size and the device's shared memory, never its name."""

from __future__ import annotations

from typing import Any

import attrs
import pytest

from test_vulkan_attn_prefill import check, check_noncausal, run_prefill, spy_kernels
from test_vulkan_kv import _run_attention
from test_vulkan_ops import Env, open_env
from trio_llm.model.kvtypes import KV_TYPES
from trio_llm.vulkan.ops import (
    ATTN_MAX_HEAD,
    PREFILL_CM_MAX_HEAD,
    Ops,
    decode_splits,
    prefill_shared,
)

pytestmark = pytest.mark.vulkan

TYPES = list(KV_TYPES)

env = pytest.fixture(scope="module", name="env")(open_env)


def decode_ops(env: Env, coalesced: bool) -> Ops:
    """attn_decode.comp (decode_attn2 off), or attn_decode2.comp on 64-lane work groups
    (128 lanes of 8-lane subgroups would need 32 KiB for the subgroups' sums at 512)."""
    ops = attrs.evolve(env.ops, decode_attn2=coalesced, decode_wg=64 if coalesced else 128)
    assert ops.decode2_ok(8, 2, 512) == coalesced
    return ops


# positions: the first key alone, tile edges (63/64, 127/128), several tiles and splits
POS = [0, 63, 64, 127, 128, 290, 5, 200]
SEQ = [0, 0, 0, 0, 0, 0, 1, 1]


@pytest.mark.parametrize("coalesced", [False, True])
@pytest.mark.parametrize("name", TYPES)
def test_decode_every_type(env: Env, name: str, coalesced: bool) -> None:
    """head_dim 512, 8 heads over 2 KV heads, split over up to 8 work groups of 64-key
    chunks (290: five of 64 and one of 35) and combined by the last."""
    _run_attention(env, decode_ops(env, coalesced), hd=512, n_head=8, n_kv=2, pos=POS, seq=SEQ, n_ctx=300,
                   k_type=name, v_type=name, min_chunk=128 if not coalesced else 64, seed=TYPES.index(name))


@pytest.mark.parametrize("coalesced", [False, True])
@pytest.mark.parametrize(("hd", "gqa"), [(512, 1), (512, 4), (512, 8), (512, 3), (256, 4)])
def test_decode_head_dims_and_gqa(env: Env, hd: int, gqa: int, coalesced: bool) -> None:
    """The default split (``decode_splits(700)``), f16 and a mixed q8_0 / q4_0 cache."""
    ops = decode_ops(env, coalesced)
    n_kv = 2
    for kt, vt in (("f16", "f16"), ("q8_0", "q4_0")):
        _run_attention(env, ops, hd=hd, n_head=gqa * n_kv, n_kv=n_kv, pos=[0, 255, 256, 699, 400],
                       seq=[0, 0, 0, 0, 1], n_ctx=700, k_type=kt, v_type=vt, n_split=decode_splits(700),
                       seed=hd + gqa)


@pytest.mark.parametrize("coalesced", [False, True])
def test_decode_window_and_ring(env: Env, coalesced: bool) -> None:
    """A window of 100 over a cache of 300 rows, and over a ring of 160 rows holding
    positions up to 500."""
    kw: dict[str, Any] = {"hd": 512, "n_head": 4, "n_kv": 1, "k_type": "q5_1", "v_type": "f16", "n_split": 4,
                          "min_chunk": 64 if coalesced else 128}
    ops = decode_ops(env, coalesced)
    _run_attention(env, ops, pos=[0, 50, 99, 100, 299], seq=[0] * 5, n_ctx=300, n_swa=100, seed=50, **kw)
    _run_attention(env, ops, pos=[150, 159, 160, 420, 500], seq=[0] * 5, n_ctx=160, n_swa=100, seed=51, **kw)


def test_the_plain_attention_kernel(env: Env) -> None:
    """``attention`` (the fallback where no tiled kernel fits) at 512: three rounds of
    four dims per lane of its 64."""
    _run_attention(env, env.ops, hd=512, n_head=8, n_kv=2, pos=POS, seq=SEQ, n_ctx=300, k_type="q4_0",
                   v_type="q8_0", decode=False, seed=70)


@pytest.mark.parametrize("name", TYPES)
def test_prefill_every_type(env: Env, name: str) -> None:
    """41 tokens after a prefix of 37 of one sequence and 9 of a second from 0, on the
    scalar kernel's 8-row tiles (2 tokens of 4 heads)."""
    assert env.ops.prefill_wide_rows(512) == 8 and env.ops.prefill_scalar_tile(8, 2, 512) == (4, 2)
    pos = [*range(37, 78), *range(9)]
    seq = [0] * 41 + [1] * 9
    r = run_prefill(env, env.ops, hd=512, n_head=8, n_kv=2, pos=pos, seq=seq, n_ctx=96, k_type=name,
                    seed=TYPES.index(name))
    assert r.kernel == "attn_prefill"
    check(env, env.ops, hd=512, n_head=8, n_kv=2, pos=pos, seq=seq, n_ctx=96, k_type=name,
          seed=TYPES.index(name))


@pytest.mark.parametrize(("hd", "gqa"), [(512, 1), (512, 2), (512, 4), (512, 8), (512, 3), (256, 4)])
def test_prefill_head_dims_and_gqa(env: Env, hd: int, gqa: int) -> None:
    """45 tokens from position 20 and 13 of a second sequence, the model's own scale (1.0,
    gemma4's), a q8_0 K with an f16 V."""
    pos = [*range(20, 65), *range(13)]
    seq = [0] * 45 + [1] * 13
    check(env, env.ops, hd=hd, n_head=gqa * 2, n_kv=2, pos=pos, seq=seq, n_ctx=80, k_type="q8_0", v_type="f16",
          scale=1.0 / hd, seed=hd + gqa)


def test_prefill_window_ring_and_split(env: Env) -> None:
    """A window of 16 over a ring of 48 rows (positions 40-99), and the keys of a deep
    prefix split over 3 work groups, then attn_combine."""
    pos = list(range(40, 100))
    check(env, env.ops, hd=512, n_head=4, n_kv=1, pos=pos, seq=[0] * 60, n_ctx=48, n_swa=16, k_type="q4_1",
          seed=80)
    pos = list(range(300, 333))
    check(env, env.ops, hd=512, n_head=8, n_kv=2, pos=pos, seq=[0] * 33, n_ctx=340, k_type="q5_0", n_split=3, seed=81)


def test_prefill_noncausal(env: Env) -> None:
    """The NONCAUSAL form at 512: an entry of 19 rows seeing one another after a causal
    prefix of 30."""
    check_noncausal(env, hd=512, n_head=4, n_kv=2, runs=[(0, 0, 30, True), (0, 30, 19, False)], n_ctx=64,
                    seed=90)


class _Kernels:
    """The env's kernels on a device that reports other properties: cooperative
    matrices (KHR and NVIDIA's), subgroups of 32 and ``shared`` bytes of shared memory."""

    def __init__(self, env: Env, shared: int) -> None:
        self._k = env.ops.kernels
        dev = env.device
        limits = attrs.evolve(dev.limits, max_shared_memory=shared, subgroup_size=32)
        self.device = type("Dev", (), {"limits": limits, "coopmat": True, "nv_coopmat2": True,
                                       "nv_coopmat2_max_wg": 256,
                                       "__getattr__": lambda _s, n: getattr(dev, n)})()

    def __getattr__(self, name: str) -> object:
        return getattr(self._k, name)


@pytest.mark.parametrize("shared", [32768, 49152, 65536])
def test_wide_heads_take_the_scalar_prefill(env: Env, shared: int) -> None:
    """On a device with cooperative matrices (32-lane subgroups, with and without
    NVIDIA's cooperative_matrix2, at 32, 48 and 64 KiB of shared memory) a 256-wide head
    may take a cooperative-matrix kernel; a 512-wide one takes none of them
    (``prefill_cm_head_ok``), whatever the variant asked for, and the scalar kernel's
    tile is the most rows of 16, 8, 4 that fit the reported shared memory."""
    ops = attrs.evolve(env.ops, kernels=_Kernels(env, shared), subgroup=32, coopmat=True,  # type: ignore[arg-type]
                       prefill_cm=True, prefill_cm2=True, prefill_nv2=True)
    assert PREFILL_CM_MAX_HEAD == 256 and ATTN_MAX_HEAD == 512
    assert ops.prefill_cm_head_ok(256) and not ops.prefill_cm_head_ok(512)
    assert ops.prefill_cm_ok(8, 2, 256) == (shared >= 49152)  # attn_prefill_cm's ~45 KiB at 256
    for o in (ops, attrs.evolve(ops, prefill_cm2_keys=32), attrs.evolve(ops, prefill_cm2_emulate=32)):
        assert not o.prefill_cm_ok(8, 2, 512)
        assert o.prefill_cm2_plan(8, 2, 512) is None
        assert o.prefill_nv2_plan(8, 2, 512) is None
        assert o.prefill_ok(512)
    from trio_llm.vulkan.shaders import attn_variant
    assert attrs.evolve(ops, prefill_cm2_variant=attn_variant("v")).prefill_cm3_plan(8, 2, 512) is None
    rows = ops.prefill_wide_rows(512)
    assert rows == (16 if shared >= 49152 else 8)
    assert prefill_shared(512, rows, rows) <= shared < prefill_shared(512, 2 * rows, 2 * rows) or rows == 16
    assert ops.prefill_scalar_tile(8, 2, 512) == (4, rows // 4)
    assert ops.prefill_scalar_tile(16, 1, 512) == (8, rows // 8)  # heads_per_group's most, 8
    spy, asked = spy_kernels(env)
    spy.device = ops.kernels.device
    v = env.zeros(1 << 16)
    attrs.evolve(ops, kernels=spy).attention_prefill(v, v, v, v, v, n_head=8, n_head_kv=2, head_dim=512, n_ctx=8,
                                                     q_stride=4096, o_stride=4096, cap=16, k_type="q4_0",
                                                     v_type="q4_0")
    assert [n for n, _ in asked] == ["attn_prefill"]
    # a device whose shared memory holds no tile (under 4 rows' queries): no tiled prefill
    small = attrs.evolve(ops, kernels=_Kernels(env, 8192))  # type: ignore[arg-type]
    assert small.prefill_wide_rows(512) == 0 and not small.prefill_ok(512)
    assert attrs.evolve(ops, kernels=_Kernels(env, 16384)).prefill_wide_rows(512) == 4  # type: ignore[arg-type]

"""The ops: one function per kernel that turns shapes and views into a ``Dispatch``.

These hold the grid arithmetic and the push-constant order of each shader, so the
model graph (``forward.py``) and the op tests speak in shapes, never in work groups.
``cap`` arguments are the most tokens (or rows) a recorded graph can see; the live
count comes from the step buffer at run time and the extra work groups return at once.
"""

from __future__ import annotations

import functools
import logging
import math
import os
from typing import Any

import attrs
import numpy as np
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T

from trio_llm.errors import (
    BackendError,
    ConfigError,
    DeviceLost,
    DeviceOutOfMemory,
)
from trio_llm.model.kvtypes import KVType, kv_type
from trio_llm.vulkan.device import SUBGROUP_SHUFFLE
from trio_llm.vulkan.graph import Dispatch
from trio_llm.vulkan.kernels import Kernel, KernelCache
from trio_llm.vulkan.memory import View
from trio_llm.vulkan.shaders import (
    CM2_TILES,
    CM3_TILES,
    FULL_UNROLL,
    GATE_UP,
    NORM_IN,
    NV2_BK,
    NV2_LANES,
    NV2_TILES,
    Q8_MATVEC,
    QTYPES,
    ROPE_OUT,
    STEP_CAP,
    AttnVariant,
    Cm3Variant,
    attn_cm3_defines,
    attn_variant,
    cm2_defines,
    cm2_layout,
    cm3_defines,
    cm3_layout,
    cm3_shared,
    cm3_variant,
    coopmat_defines,
    kv_defines,
    matvec_defines,
    moe_coopmat_defines,
    nv2_defines,
    nv2_ready,
    qtype_defines,
)

log = logging.getLogger(__name__)

#: the step buffer: [n_tokens, n_out, cap, 0] then tokens, positions, seq ids, output
#: rows and each token's highest visible position (``STEP_VIS``: read only by the
#: graphs of steps with a non-causal entry), ``cap`` entries each (``cap``: the
#: backend's largest bucket)
STEP_HEADER = 4
STEP_ARRAYS = 5


def step_words(cap: int) -> int:
    """uint32 words of a step buffer whose arrays hold ``cap`` entries."""
    return STEP_HEADER + STEP_ARRAYS * cap


STEP_WORDS = step_words(STEP_CAP)
STEP_BYTES = 4 * STEP_WORDS

COUNT_TOKENS = 0
COUNT_OUT = 1

ROPE_NONE = 0
ROPE_NORMAL = 1
ROPE_NEOX = 2

#: bytes per block and values per block of the weight types the kernels read
BLOCK_BYTES = {q: (GGML_QUANT_SIZES[T[q]][1], GGML_QUANT_SIZES[T[q]][0]) for q in QTYPES}


def _kv(name: str) -> KVType:
    return kv_type(name)


def row_bytes(qtype: str, n: int) -> int:
    size, qk = BLOCK_BYTES[qtype]
    return n // qk * size


def fill_step(
    words: np.ndarray,
    tokens: np.ndarray,
    pos: np.ndarray,
    seq: np.ndarray,
    out_rows: np.ndarray,
    vis: np.ndarray | None = None,
) -> None:
    """Write one step's values into the step buffer's uint32 view; its arrays hold as
    many entries as the view has room for (the header says how many: the kernels
    read ``cap`` from it). ``vis``: each token's highest visible position, for a step
    with a non-causal entry (left as it is otherwise: no kernel of other steps reads it)."""
    cap = (len(words) - STEP_HEADER) // STEP_ARRAYS
    n = len(tokens)
    assert n <= cap and len(out_rows) <= cap
    words[0] = n
    words[1] = len(out_rows)
    words[2] = cap
    h = STEP_HEADER
    words[h : h + n] = tokens
    words[h + cap : h + cap + n] = pos
    words[h + 2 * cap : h + 2 * cap + n] = seq
    words[h + 3 * cap : h + 3 * cap + len(out_rows)] = out_rows
    if vis is not None:
        words[h + 4 * cap : h + 4 * cap + n] = vis


#: matmul_cm2: the fewest work groups each tile must give to be chosen over the next
#: smaller one: the 128x128 tile one per SM of a 132-SM H200 (a wave), the smaller ones
#: two. The H200 timed it (2026-12-01, pp512 through the backend): one bound of 256 for
#: every tile gave llama-1b 31,658 tok/s and llama-8b 3,986 (its 4096-row products on
#: 128x64); 128 for every tile 30,088 and 4,384 (llama-1b's 2048-row products then on
#: 128x64). TRIO_LLM_CM2_MIN_GROUPS sets one bound for all, for timing
CM2_MIN_GROUPS = {(128, 128): 128, (128, 64): 256, (64, 64): 256}


def cm2_tile(n_rows: int, cap: int, most: int | None = None) -> tuple[int, int]:
    """matmul_cm2's tile of (rows, tokens) for an ``n_rows`` x ``cap`` product: the
    largest of ``CM2_TILES`` that still gives its ``CM2_MIN_GROUPS`` work groups (or
    ``most`` for every tile; bigger tiles read each weight and activation fewer times
    and feed more products per fragment, but a grid smaller than the GPU leaves SMs
    idle), else the smallest. At 512 tokens: llama-1b's 2048-row projections 64x64
    (256 groups), its 8192-row FFN 128x128 (256); llama-8b's 4096-row projections
    128x128 (128), its 14336-row FFN 128x128 (448)."""
    for bm, bn in CM2_TILES:
        if math.ceil(n_rows / bm) * math.ceil(cap / bn) >= (most or CM2_MIN_GROUPS[bm, bn]):
            return bm, bn
    return CM2_TILES[-1]


def _tile_env(var: str, known: tuple[tuple[int, int], ...]) -> tuple[int, int] | None:
    """A forced matmul tile from ``var`` ("128x64"; empty or unset: None), one of ``known``."""
    v = os.environ.get(var, "")
    if not v:
        return None
    tiles = {f"{bm}x{bn}": (bm, bn) for bm, bn in known}
    if v not in tiles:
        raise ConfigError(f"{var}={v!r}: expected one of {', '.join(tiles)}")
    return tiles[v]


def cm2_tile_env() -> tuple[int, int] | None:
    """``TRIO_LLM_CM2_TILE`` ("128x64"; empty: ``cm2_tile`` chooses), for timing the
    tiles one by one on a GPU; the 256 tiles of ``CM3_TILES`` too (matmul_cm3's sweep)."""
    return _tile_env("TRIO_LLM_CM2_TILE", CM3_TILES)


#: matmul_nv2: the fewest work groups each tile must give to be chosen over the next
#: smaller one (about one per SM of a 132-SM H200: a workgroup-scope tile of 128 rows
#: holds most of an SM); a guess until the H200 times the tiles (TRIO_LLM_NV2_TILE,
#: bench/h200.sh nv2mm). TRIO_LLM_NV2_MIN_GROUPS sets one bound for all
NV2_MIN_GROUPS = {(128, 256): 128, (128, 128): 128, (64, 64): 1}
#: the weight types matmul_nv2.comp decodes (every type of quant.glsl; F16 loads as is)
NV2_QTYPES = QTYPES
#: ... and those it takes by default (TRIO_LLM_MATMUL_NV2=1; "all": every one of
#: NV2_QTYPES). The H200 (2026-12-04, bench/h200.sh nv2mm, op level at 512 tokens, one
#: layer's products): llama-1b Q8_0 3.60 -> 3.34 ms against matmul_cm2 (whole pp512 GPU
#: time 16.5 -> 14.2 ms), but llama-8b Q4_K 10.5 -> 13.0 ms and Q6_K 4.7 -> 6.3 ms (its
#: whole pp512 118 -> 157 ms): the K-quants' per-value decode (the sub-block scale worked
#: out again for every value) costs more than the driver's pipelining gains, at 2048
#: tokens less so. So the K-quants and IQ4_XS keep matmul_cm2; the other 32-blocks and
#: the float types (cheap decodes, as Q8_0's; not timed yet) take matmul_nv2
NV2_DEFAULT_QTYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "IQ4_NL")


def nv2_types_env() -> tuple[str, ...]:
    """``TRIO_LLM_MATMUL_NV2``: "0" none, "1" (default) ``NV2_DEFAULT_QTYPES``, "all"
    ``NV2_QTYPES``, or a comma list of types."""
    v = os.environ.get("TRIO_LLM_MATMUL_NV2", "1")
    if v in ("0", "1", "all", ""):
        return {"0": (), "all": NV2_QTYPES}.get(v, NV2_DEFAULT_QTYPES)
    types = tuple(t.strip() for t in v.split(","))
    bad = [t for t in types if t not in NV2_QTYPES]
    if bad:
        raise ConfigError(f"TRIO_LLM_MATMUL_NV2={v!r}: not 0, 1, all or weight types ({', '.join(bad)})")
    return types


#: the weight types ``TRIO_LLM_MATMUL_DEQUANT=1`` decodes to f16 before a prefill product:
#: the K-quants and IQ4_XS (super-blocks of 256 with per-sub-block scales)
DEQUANT_DEFAULT_QTYPES = ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS")


def dequant_types_env() -> frozenset[str]:
    """``TRIO_LLM_MATMUL_DEQUANT``: "0" or unset none, "1" ``DEQUANT_DEFAULT_QTYPES``, or a
    comma list of weight types (``Ops.matmul_dequant``)."""
    v = os.environ.get("TRIO_LLM_MATMUL_DEQUANT", "0").strip()
    if v in ("0", ""):
        return frozenset()
    if v == "1":
        return frozenset(DEQUANT_DEFAULT_QTYPES)
    types = frozenset(t.strip() for t in v.split(","))
    bad = sorted(t for t in types if t not in QTYPES or t == "F16")
    if bad:
        raise ConfigError(f"TRIO_LLM_MATMUL_DEQUANT={v!r}: not 0, 1 or weight types other than F16 "
                          f"({', '.join(bad)})")
    return types


def nv2_tile(n_rows: int, cap: int, tiles: tuple[tuple[int, int], ...] = NV2_TILES,
             most: int | None = None) -> tuple[int, int]:
    """matmul_nv2's tile of (rows, tokens) for an ``n_rows`` x ``cap`` product: the largest
    of ``tiles`` (``NV2_TILES`` that the device takes) that still gives its
    ``NV2_MIN_GROUPS`` work groups (or ``most`` for every tile), else the smallest. At 512
    tokens: llama-1b's 2048-row projections 64x64 (256 groups), its 8192-row FFN 128x256
    (128); llama-8b's 4096-row projections 128x128 (128), its 14336-row FFN 128x256 (224);
    at 2048 tokens every one of them 128x256."""
    for bm, bn in tiles:
        if math.ceil(n_rows / bm) * math.ceil(cap / bn) >= (most or NV2_MIN_GROUPS[bm, bn]):
            return bm, bn
    return tiles[-1]


def nv2_tile_env() -> tuple[int, int] | None:
    """``TRIO_LLM_NV2_TILE`` ("128x128"; empty: ``nv2_tile`` chooses), for timing the tiles."""
    return _tile_env("TRIO_LLM_NV2_TILE", NV2_TILES)


def cm2_variant_env() -> Cm3Variant | None:
    """``TRIO_LLM_CM2_VARIANT``: empty or "cm2" keeps matmul_cm2.comp; "v", "v+db+direct"
    (etc., ``shaders.cm3_variant``) puts every dense prefill product on that form of
    matmul_cm3.comp, for the H200's A/B (bench/h200.sh cm2sweep)."""
    spec = os.environ.get("TRIO_LLM_CM2_VARIANT", "")
    try:
        return cm3_variant(spec)
    except ValueError as exc:
        raise ConfigError(f"TRIO_LLM_CM2_VARIANT={spec!r}: {exc}") from None


#: the fusion kinds ``TRIO_LLM_HYBRID_OFF`` may name (forward.py's ``Fusion.kind``,
#: less ``into_reader``, which is the older fusions' and always on)
HYBRID_KINDS = ("conv_split", "delta_gate", "delta_conv", "glu_in", "moe_out", "moe_down_out", "qk_rope", "attn_gate")


def hybrid_off_env() -> frozenset[str]:
    """``TRIO_LLM_HYBRID_OFF``'s fusion kinds; an unknown name is a one-line error."""
    names = frozenset(n.strip() for n in os.environ.get("TRIO_LLM_HYBRID_OFF", "").split(",") if n.strip())
    unknown = sorted(names - set(HYBRID_KINDS))
    if unknown:
        raise ConfigError(f"TRIO_LLM_HYBRID_OFF={','.join(unknown)}: expected kinds among {', '.join(HYBRID_KINDS)}")
    return names


def decode_splits(n_ctx: int, min_chunk: int = 128, most: int = 64) -> int:
    """The grid of ``attention_decode`` for a cache of ``n_ctx`` positions per
    sequence: enough work groups that a full sequence is cut into chunks of about
    ``min_chunk`` keys, at most ``most``. Fixed when the graph is recorded; each step
    uses as many of them as its depth needs (attn_decode.comp)."""
    return max(1, min(most, math.ceil(n_ctx / min_chunk)))


def heads_per_group(n_head: int, n_head_kv: int, most: int = 8) -> int:
    """Query heads one ``attention_decode`` work group serves: the largest divisor of
    the GQA ratio up to ``most`` (they share the K and V rows it loads)."""
    g = n_head // n_head_kv
    return max(d for d in range(1, min(g, most) + 1) if g % d == 0)


def decode2_lanes(head_dim: int, subgroup: int) -> int:
    """Lanes that read one K / V row together in attn_decode2.comp: the largest power of
    two up to the subgroup size that divides head_dim / 8 (each lane takes pieces of 8
    values), so head_dim / 8 lanes (a 16-byte piece each in f16) wherever the subgroup
    is that wide: 8, 16 and 32 lanes for head dims 64, 128 and 256 on 32-lane subgroups."""
    pieces = head_dim // 8
    lanes = 1
    while lanes * 2 <= subgroup and pieces % (lanes * 2) == 0:
        lanes *= 2
    return lanes


def decode2_shared(wg: int, gw: int, lanes: int, head_dim: int, subgroup: int) -> int:
    """Bytes of shared memory attn_decode2.comp declares (its arrays, in order, then
    decode_combine.glsl's and reduce.glsl's)."""
    red_rows = min(gw, subgroup // lanes) * (wg // subgroup)
    return 4 * 2 * gw * (wg // lanes) + 4 * 2 * gw + 16 * red_rows * head_dim // 4 + 4 * 256 + 4 + 4 * 64


def prefill_rows(head_dim: int, coopmat: bool = False) -> int:
    """Query rows (tokens x heads) of one ``attention_prefill`` work group by default."""
    return (64 if head_dim <= 128 else 32) if coopmat else (32 if head_dim <= 128 else 16)


def prefill_tile(n_head: int, n_head_kv: int, head_dim: int, coopmat: bool = False,
                 rows: int = 0) -> tuple[int, int]:
    """(query heads, tokens) of one ``attention_prefill`` work group: the heads are
    ``heads_per_group`` of the GQA ratio (they share every K/V row the group loads),
    the tokens fill 32 query rows (16 for head_dim 256, keeping the f32 queries in 16
    KiB of shared memory); on cooperative matrices 64 rows (32 for head_dim 256) in
    f16."""
    rows = rows or prefill_rows(head_dim, coopmat)
    g = heads_per_group(n_head, n_head_kv, most=8)
    return g, rows // g


def prefill_shared(head_dim: int, rows: int, tokens: int) -> int:
    """Bytes of shared memory attn_prefill.comp declares (its arrays, in order: the rows'
    f32 queries, a tile's 32 scores per row, the rows' sums and rescales, the tokens'
    positions and sequences)."""
    return 4 * rows * head_dim + 4 * rows * 32 + 8 * rows + 8 * tokens


#: the widest head the cooperative-matrix prefill kernels (attn_prefill_cm, _cm2, _cm3)
#: take: a layer with wider heads (gemma4's 512-wide full-attention layers) prefills
#: through the scalar attn_prefill.comp on every device (``Ops.prefill_cm_head_ok``)
PREFILL_CM_MAX_HEAD = 256

#: the widest head of a plain (not latent) attention layer the tiled kernels take:
#: attn_prefill.comp and attn_decode.comp give a head one row group of head_dim / 4
#: lanes, at most their 128
ATTN_MAX_HEAD = 512

#: query rows per work group attn_prefill.comp tries for heads wider than 256, the most
#: first (``Ops.prefill_scalar_tile``): 16 as for 256 where the f32 queries fit (64 KiB,
#: 35,072 bytes at head_dim 512), 8 in lavapipe's 32 KiB (17,536 bytes), 4 in 16 KiB
PREFILL_WIDE_ROWS = (16, 8, 4)

#: query rows per work group attn_prefill.comp's LATENT form tries, the most first
#: (``Ops.prefill_latent_tile``): 16 as for any head_dim above 128; 12 fits GLM's 576-wide
#: rows in 32 KiB of shared memory (lavapipe's limit, 29,304 bytes), 8 in 16 KiB
PREFILL_LATENT_ROWS = (16, 12, 8, 4)


def prefill_latent_pack(n_head: int, n_head_kv: int, rows: int) -> tuple[int, int]:
    """(query heads, tokens) of a LATENT attn_prefill work group of at most ``rows``
    query rows: the head group (a divisor of the GQA ratio up to 8) that fills the most
    rows, the larger of equals (the more heads share each K row it loads): 4 heads x 4
    tokens for GLM's 20 heads and 16 rows, where ``prefill_tile``'s 5 x 3 fills 15."""
    ratio = n_head // n_head_kv
    best = max((d * (rows // d), d) for d in range(1, min(ratio, rows, 8) + 1) if ratio % d == 0)
    return best[1], rows // best[1]


def prefill_cm_shared(head_dim: int, subgroup: int, rows: int) -> int:
    """Bytes of shared memory attn_prefill_cm.comp declares (its arrays, in order)."""
    nsg = 128 // subgroup
    return (2 * rows * (head_dim + 8) + 2 * 32 * (head_dim + 8) + 4 * max(rows * 36, 256 * nsg) + 2 * rows * 40
            + 4 * max(256 * nsg, 16 * rows) + 8 * rows + 12 * rows)


def prefill_cm2_shared(head_dim: int, rows: int, keys: int) -> int:
    """Bytes of shared memory attn_prefill_cm2.comp declares (its arrays, in order: the
    K and V tiles in f16, the subgroups' S slices in f32 and P slices in f16, then the
    tokens' positions, sequences and flags, counted for one head per work group, the
    most tokens): with 64 rows 45,824 for head_dim 64 and 64 keys, 32,512 for 128 and 32
    keys (62,208 with 64), 48,896 for 256 and 32 keys; with 32 rows 48,512 for 128 and 64
    keys, 41,344 for 256 and 32."""
    return 2 * 2 * keys * (head_dim + 8) + 4 * rows * (keys + 4) + 2 * rows * (keys + 8) + 12 * rows


#: keys per tile attn_prefill_cm2.comp takes, the most first (``Ops.prefill_cm2_plan``)
PREFILL_CM2_KEYS = (64, 32, 16)


#: the largest head_dim attn_prefill_cm2 takes by default: gemma3-4b's 256 ran its 8k
#: prompt's attention in 2.62 s on the H200 (2026-12-01) where attn_prefill_cm took 1.13
#: (16 query rows per subgroup keep a 256-wide output in registers); forcing its keys
#: (``prefill_cm2_keys``) or emulating it takes it anyway, for timing and tests
PREFILL_CM2_MAX_HEAD = 128


def prefill_cm2_prefer(head_dim: int) -> int:
    """attn_prefill_cm2's keys per tile by default: fewer than fit, as the H200 timed
    them (2026-12-01, 8k prompt): head_dim 64 at 32 keys 0.17 s against 0.30 s at 64,
    head_dim 128 at 16 keys 0.63 s against 1.13 s at 32: the smaller K/V tiles leave room
    for more work groups per SM, and a query row's softmax is latency-bound, not its
    products."""
    return 32 if head_dim <= 64 else 16


def prefill_cm3_shared(head_dim: int, rows: int, keys: int, v: AttnVariant, qsh: bool, subgroup: int = 32,
                       emulate: bool = False) -> int:
    """Bytes of shared memory attn_prefill_cm3.comp declares (its arrays, in order: the
    K and V tiles in f16, once or twice (DB), the P slices in f16, the Q tile with QSH,
    the layout block, the tokens' positions, sequences and flags counted for the most
    tokens, and under CM_EMULATE the shuffles' floats). No S slices: with 64 rows 16,128
    for head_dim 64 and 32 keys (47,872 with 64 keys and DB), 24,320 for 128 and 32 keys."""
    lanes = rows // (16 * v.rb) * subgroup
    return ((2 if v.db else 1) * 2 * 2 * keys * (head_dim + 8) + 2 * rows * (keys + 8)
            + (2 * rows * (head_dim + 8) if qsh else 0) + 4 * 256 + 12 * rows + (4 * lanes if emulate else 0))


def prefill_cm3_prefer(head_dim: int) -> int:
    """attn_prefill_cm3's keys per tile unless forced: 32 up to head_dim 128, 16 above.
    Its shared memory is about half of attn_prefill_cm2's (no S slices), and the per-tile
    row reductions are amortised over more keys, so the "+k64" variants are the A/B."""
    return 32 if head_dim <= 128 else 16


def prefill_cm3_plan_rows(head_dim: int, v: AttnVariant) -> int:
    """attn_prefill_cm3's query rows per work group by default: 4 subgroups of 16 * RB
    rows (2 for head_dim 256, whose K/V tiles take most of the shared memory)."""
    return 16 * v.rb * (4 if head_dim <= 128 else 2)


def prefill_cm3_choose(head_dim: int, v: AttnVariant, limit: int, subgroup: int = 32, emulate: bool = False,
                       rows: int = 0, keys: int = 0) -> tuple[int, int, bool] | None:
    """(keys per tile, rows per work group, QSH) of attn_prefill_cm3 in form ``v`` within
    ``limit`` bytes of shared memory: the rows given, else ``prefill_cm3_plan_rows``' and
    then halves of it down to one subgroup (a Q tile in shared memory or two K/V buffers
    take room); the keys the variant forces, else ``keys``, else
    ``prefill_cm3_prefer``'s and then fewer of ``PREFILL_CM2_KEYS``. QSH where RB *
    head_dim > 128 (the Q fragments and output accumulators would not fit in registers).
    None where nothing fits or the rows are not a multiple of 16 * RB (at most 1024 lanes)."""
    block = 16 * v.rb
    if rows:
        row_opts = [rows]
    else:
        row_opts = []
        r = prefill_cm3_plan_rows(head_dim, v)
        while r >= block:
            row_opts.append(r)
            r //= 2
    forced = v.keys or keys
    prefer = prefill_cm3_prefer(head_dim)
    qsh = v.rb * head_dim > 128
    for r in row_opts:
        if r % block or r // block * subgroup > 1024:
            return None
        for k in [forced] if forced else [k for k in PREFILL_CM2_KEYS if k <= prefer]:
            if prefill_cm3_shared(head_dim, r, k, v, qsh, subgroup, emulate) <= limit:
                return k, r, qsh
    return None


def attn_variant_env() -> AttnVariant | None:
    """``TRIO_LLM_PREFILL_CM2_VARIANT``: empty or "cm2" keeps attn_prefill_cm2.comp;
    "v", "v+rb2+db", "v+k64" (etc., ``shaders.attn_variant``) puts prefill attention on
    attn_prefill_cm3.comp in that form where ``Ops.prefill_cm3_plan`` allows (bench/h200.sh
    attnsweep)."""
    spec = os.environ.get("TRIO_LLM_PREFILL_CM2_VARIANT", "")
    try:
        return attn_variant(spec)
    except ValueError as exc:
        raise ConfigError(f"TRIO_LLM_PREFILL_CM2_VARIANT={spec!r}: {exc}") from None


#: attn_prefill_nv2.comp's forms (``TRIO_LLM_PREFILL_NV2_FORM``): "pf" stages K and V
#: through shared memory with the next tile loaded into registers during this one,
#: "staged" the same without the registers (each tile loaded at its start), "direct"
#: reads f16 caches by tensor-addressed loads (other cache types stay "pf"); each may
#: end in "+mma": the rows' sums of P by a product with ones instead of a row reduction
PREFILL_NV2_FORMS = ("pf", "staged", "direct")
#: the form by default: the register prefetch with the rows' sums on the tensor cores; on
#: the H200 (2026-12-05, llama-1b's 16 layers at 32k, op level) 0.92 s against 1.10 for
#: "pf", 1.05 for "pf+lsum" and 1.61 for "direct" (bench/results/h200-session11/)
PREFILL_NV2_FORM_DEFAULT = "pf+mma"
#: the head dims attn_prefill_nv2 takes (its workgroup-scope matrices are R x head_dim)
PREFILL_NV2_HEADS = (64, 128, 256)


@attrs.frozen
class Nv2AttnPlan:
    """attn_prefill_nv2's choice for one shape: query rows per work group, keys per
    tile, lanes, and the form (PF: the next tile's K and V in registers; direct: K and V
    by tensor-addressed loads from an f16 cache)."""

    rows: int
    keys: int
    lanes: int
    pf: bool
    direct: bool
    mma_sum: bool = False
    #: "+lsum": the rows' sums kept per column (L = L e + P, element-wise) and added up
    #: once at the end: no reduction (nor product with ones) per key tile
    lazy_sum: bool = False

    @property
    def rsum_mode(self) -> int:
        """Specialization constant 7 (RSUM_MMA): 0 a row reduction per tile, 1 a product
        with ones, 2 per-column sums added up at the end."""
        return 2 if self.lazy_sum else int(self.mma_sum)


def prefill_nv2_shared(head_dim: int, rows: int, keys: int, direct: bool = False) -> int:
    """Bytes of shared memory attn_prefill_nv2.comp declares (its arrays, in order: the
    K and V tiles in f16 with rows of head_dim + 8 unless direct, each row's visible key
    range, the tokens' positions, sequences and flags counted for one head per work
    group); the driver's own staging of workgroup-scope matrices comes on top. 64 rows:
    36,096 bytes for head_dim 128 and 64 keys, 19,712 for 64 and 64, 35,072 for 256 and 32."""
    return (0 if direct else 2 * 2 * keys * (head_dim + 8)) + 8 * rows + 12 * rows


def prefill_nv2_default(head_dim: int) -> tuple[int, int, int]:
    """attn_prefill_nv2's (rows, keys per tile, lanes) unless forced: 64 query rows and
    32 keys on 4 warps up to head_dim 128; 32 keys on 8 warps at 256 (its R x 256
    output and Q would not fit 4 warps' registers). On the H200 (2026-12-04, llama-1b's
    16 layers at 32k in f16, op level) 64x32x128 took 1.39 s, 64x64x128 2.15 s (2.12
    with the sums on the tensor cores), 64x64x256 1.73, 128x64x256 2.07 (1.997 direct),
    128x32x256 2.21, and attn_prefill_cm2 2.64; head_dim 128 and 256 are not timed."""
    return (64, 32, 128) if head_dim <= 128 else (64, 32, 256)


def prefill_nv2_tile_env() -> tuple[int, int, int] | None:
    """``TRIO_LLM_PREFILL_NV2_TILE``: "ROWSxKEYSxLANES" (e.g. "64x64x128"; empty: the
    plan's), for timing the tiles on a GPU."""
    v = os.environ.get("TRIO_LLM_PREFILL_NV2_TILE", "")
    if not v:
        return None
    try:
        r, k, w = (int(x) for x in v.lower().split("x"))
    except ValueError:
        raise ConfigError(f"TRIO_LLM_PREFILL_NV2_TILE={v!r}: expected ROWSxKEYSxLANES, e.g. 64x64x128") from None
    if r not in (32, 64, 128) or k not in (32, 64) or w % 32 or not 32 <= w <= 1024:
        raise ConfigError(f"TRIO_LLM_PREFILL_NV2_TILE={v!r}: rows 32/64/128, keys 32/64, lanes a multiple of 32")
    return r, k, w


def nv2_attn_defines(k_code: int, v_code: int, direct: bool = False) -> dict[str, object]:
    """attn_prefill_nv2.comp's defines: the cache types, NV2_DIRECT for the f16 form."""
    return {**kv_defines(K_TYPE=k_code, V_TYPE=v_code), **({"NV2_DIRECT": 1} if direct else {})}


@functools.lru_cache(maxsize=64)
def _nv2_attn_ready(k_code: int, v_code: int, direct: bool) -> bool:
    return nv2_ready("attn_prefill_nv2", nv2_attn_defines(k_code, v_code, direct))


def nv2_form_ok(form: str) -> bool:
    """Whether ``form`` is one of ``PREFILL_NV2_FORMS``, optionally with "+mma" or "+lsum"."""
    base, _, extra = form.partition("+")
    return base in PREFILL_NV2_FORMS and extra in ("", "mma", "lsum")


def _nv2_form_check(form: str) -> None:
    if not nv2_form_ok(form):
        raise ValueError(f"attn_prefill_nv2 form {form!r}: one of {', '.join(PREFILL_NV2_FORMS)}, optionally +mma or +lsum")


def prefill_nv2_form_env() -> str:
    v = os.environ.get("TRIO_LLM_PREFILL_NV2_FORM", "") or PREFILL_NV2_FORM_DEFAULT
    if not nv2_form_ok(v):
        raise ConfigError(f"TRIO_LLM_PREFILL_NV2_FORM={v!r}: expected one of {', '.join(PREFILL_NV2_FORMS)}, "
                          "optionally with +mma or +lsum")
    return v


#: attention_prefill's splits: a bucket of b tokens splits its keys over at most
#: SPLIT_TOKENS / b work groups (4 for a 512-token chunk, 1 from 2048 tokens on)
SPLIT_TOKENS = 2048


def attention_part_floats(cap: int, n_head: int, head_dim: int, n_split: int) -> int:
    """float32 values of the partials buffer ``attention_decode`` needs for ``cap``
    tokens: per (token, head, split) head_dim outputs plus the running max and sum."""
    return cap * n_head * n_split * (head_dim + 2)


def attention_counters(cap: int, n_head: int, n_head_kv: int) -> int:
    """uint32 counters ``attention_decode`` needs for ``cap`` tokens (zero-filled once;
    every dispatch leaves them zero)."""
    return cap * n_head // heads_per_group(n_head, n_head_kv)


def _check_head(t: KVType, head_dim: int, what: str) -> None:
    if head_dim % t.block:
        raise ValueError(f"{what} cache type {t.name} needs head_dim a multiple of {t.block}, not {head_dim}")


def env_int(name: str, default: int) -> int:
    """An integer setting from the environment (unset or empty: ``default``); anything
    else than an integer is a ConfigError, one line, not a traceback."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(f"{name}={raw!r}: not an integer") from None


#: the matvec column counts unrolled by default (``Ops.matvec_unroll``): 8, which
#: removed the 8-column forms' local memory on the H200 (2026-12-05)
UNROLL_DEFAULT = frozenset({8})


def _unroll_env() -> frozenset[int]:
    """TRIO_LLM_MATVEC_UNROLL's column counts (``Ops.matvec_unroll``): unset or empty
    ``UNROLL_DEFAULT``, ``0`` none."""
    raw = os.environ.get("TRIO_LLM_MATVEC_UNROLL", "").strip()
    if not raw:
        return UNROLL_DEFAULT
    if raw == "0":
        return frozenset()
    try:
        counts = frozenset(int(x) for x in raw.split(",") if x.strip())
    except ValueError:
        raise ConfigError(f"TRIO_LLM_MATVEC_UNROLL={raw!r}: a comma list of column counts (1, 2, 4, 8)") from None
    if not counts <= {1, 2, 4, 8}:
        raise ConfigError(f"TRIO_LLM_MATVEC_UNROLL={raw!r}: column counts are 1, 2, 4 and 8")
    return counts


def grid(n: int, limit: int = 65535) -> tuple[int, int, int]:
    """Work groups for ``n`` flat groups, folded into y past the x limit."""
    n = max(1, n)
    x = min(n, limit)
    return (x, math.ceil(n / x), 1)


@attrs.define(eq=False)
class Ops:
    kernels: KernelCache
    subgroup: int = 32  # the device's subgroup size
    matvec_rows: int = 4  # subgroups per matvec work group
    matvec_rs: int = 2  # rows per matvec subgroup
    #: rows per subgroup of the plain matvec at 8 columns (TRIO_LLM_MATVEC_RS8; default
    #: ``matvec_rs``). On the H200 its 8-column F32, and Q4_K / Q6_K int8-activation forms
    #: (MAXC x RS = 16 accumulators a lane) report 64 bytes of local memory a thread, and the
    #: driver keeps that memory for the device's life: a released qwen35-0.8b 26 MiB more
    #: (docs/benchmarks.md, 2026-12-04). 1 halves the accumulators; not yet measured there
    #: (bench/h200.sh localmem)
    matvec_rs8: int = attrs.field(factory=lambda: env_int("TRIO_LLM_MATVEC_RS8", 0))
    #: column counts whose matvecs (every form) are compiled with the column count and
    #: rows per subgroup fixed and every loop over them unrolled before the driver sees
    #: them (TRIO_LLM_MATVEC_UNROLL, a comma list such as ``8`` or ``1,2,4,8``, ``0`` for
    #: none; default 8). The cause of those 64 bytes: with both as specialization
    #: constants the driver unrolled the column loop or not as it liked, and where it did
    #: not, the 16 accumulators were an array indexed at run time. On the H200
    #: (2026-12-05, bench/h200.sh localmem) every pipeline of qwen35-0.8b was then at the
    #: floor, a released one kept 27 MiB instead of 49, and batched decode's graphs took
    #: the same time (within 1 %)
    matvec_unroll: frozenset[int] = attrs.field(factory=lambda: _unroll_env())
    #: an 8-column bucket's matvecs as two 4-column dispatches (``col_split``; COL0 = 4
    #: for the second, its views 4 columns on), so no 8-column pipeline exists: the
    #: fallback for issue 12's local memory if neither ``matvec_unroll`` nor
    #: ``matvec_rs8`` removes it (TRIO_LLM_MATVEC_SPLIT8=1; each weight read twice at 5 to 8
    #: live columns). Not yet measured on the H200
    matvec_split8: bool = attrs.field(factory=lambda: os.environ.get("TRIO_LLM_MATVEC_SPLIT8", "0") == "1")
    #: weight types whose prefill products (``matmul_dequant_min`` tokens or more) first
    #: decode the weights to f16 rows in a scratch buffer (``dequant_f16``), then multiply
    #: those as F16 (TRIO_LLM_MATMUL_DEQUANT, ``dequant_types_env``; default none: on the
    #: H200 matmul_nv2's in-load decode made the K-quants slower than matmul_cm2, and
    #: this is the other way to give them its F16 path, not yet measured there)
    matmul_dequant: frozenset[str] = attrs.field(factory=dequant_types_env)
    #: the prefill products read f16 activations made once per product input by
    #: ``to_f16`` (the X_F16 variants of matmul_nv2 and matmul_cm2; TRIO_LLM_MATMUL_X16=1),
    #: as llama.cpp's coopmat2 products do, instead of converting x in every row tile's
    #: loads. Off until measured on the H200
    matmul_x16: bool = attrs.field(factory=lambda: os.environ.get("TRIO_LLM_MATMUL_X16", "0") == "1")
    matmul_dequant_min: int = attrs.field(
        factory=lambda: env_int("TRIO_LLM_MATMUL_DEQUANT_MIN", 128))
    norm_wg: int = 64
    attn_wg: int = 64
    decode_wg: int = 128  # attention_decode: keys per tile (a multiple of the subgroup)
    rows_wg: int = 64
    elem_wg: int = 256
    #: prefill matmuls on cooperative matrices (the device reports and enabled them)
    coopmat: bool = False
    #: query rows per attention_prefill work group, scalar (16 or 32) and on cooperative
    #: matrices (16, 32 or 64); 0: prefill_rows' choice (bench/prefill.py tries others)
    prefill_rows: int = 0
    prefill_rows_cm: int = 0
    #: the coopmat kernel's CM_STAGE form (the output in plain registers, each P V block
    #: staged through shared memory) instead of the output in accumulators
    prefill_cm_stage: bool = False
    #: most work groups sharing a query tile's keys (``prefill_splits``); 1: no split
    prefill_split_most: int = 4
    #: the cooperative-matrix form of attention_prefill where the device has them (the
    #: scalar tiled kernel elsewhere); TRIO_LLM_PREFILL_CM=0 turns it off. Passed
    #: `bench/h200.sh verify` on the H200 (2026-12-01), where it took llama-1b's 8k
    #: prefill through the backend from 1.59 s to 0.85 s
    prefill_cm: bool = attrs.field(factory=lambda: os.environ.get("TRIO_LLM_PREFILL_CM", "1") != "0")
    #: delta_net.comp's split-lane form (DP): this many adjacent lanes of a subgroup per
    #: state column (2, 4 or 8), each holding d / DP of its values in registers, the head
    #: dim a compile-time constant (DU); a work group of DP * d lanes per head instead of d. TRIO_LLM_DELTA_SPLIT=2/4/8; 0: off.
    #: 4 by default since the H200's A/B of 2026-12-01 (bench/results/h200-session8/):
    #: qwen35-0.8b Q4_K_M pp512 / tg128 15,379 / 359 -> 18,533 / 431 tok/s (DP 2: 19,002 /
    #: 428, 8: 18,278 / 431), qwen35-9b 3,783 / 140 -> 4,034 / 156. By default it
    #: applies where it fits (``delta_split_auto``: the device's shuffles, the subgroup,
    #: the head dim) and the plain form runs elsewhere; set by hand, it must fit.
    delta_split: int = attrs.field(factory=lambda: env_int("TRIO_LLM_DELTA_SPLIT", 4),
                                   validator=attrs.validators.in_((0, 2, 4, 8)))
    delta_split_auto: bool = attrs.field(factory=lambda: "TRIO_LLM_DELTA_SPLIT" not in os.environ)
    #: prefill buckets' expert products grouped by expert and tiled (moe_group +
    #: moe_matmul); TRIO_LLM_MOE_MATMUL=0 keeps moe_matvec per (token, expert) pair,
    #: the A/B of bench/decode.py's MoE prefill
    moe_grouped: bool = attrs.field(factory=lambda: os.environ.get("TRIO_LLM_MOE_MATMUL", "1") != "0")
    #: ... from a bucket whose pairs average at least this many per expert (bucket * k
    #: >= this * n_expert): below it most of a 32-pair tile is padding, and a matvec per
    #: pair reads little more than the tiles would. 8: qwen3-30b-a3b from 128 tokens,
    #: qwen35-35b-a3b from 256, the tiny presets from 32. On lavapipe the crossover is
    #: about 16 (docs/vulkan.md); on a GPU it is a guess until the H200's
    #: bench/decode.py --moe-prefill-sizes gives it (TRIO_LLM_MOE_MIN sets it)
    moe_grouped_min: int = attrs.field(factory=lambda: env_int("TRIO_LLM_MOE_MIN", 8))
    #: the cooperative-matrix form of moe_matmul where the device has them;
    #: TRIO_LLM_MOE_CM=0 turns it off (passed `bench/h200.sh verify` on the H200,
    #: 2026-12-01; lavapipe runs it only emulated)
    moe_cm: bool = attrs.field(factory=lambda: os.environ.get("TRIO_LLM_MOE_CM", "1") != "0")
    #: the dense prefill matmuls on matmul_cm2.comp (larger tiles, 2x2..4x4 blocks per
    #: subgroup, register prefetch) instead of matmul_cm.comp where the device has
    #: cooperative matrices; TRIO_LLM_MATMUL_CM2=0 keeps matmul_cm. On by default since
    #: the H200 run of 2026-12-01 evening (bench/results/h200-session6/): its tests pass
    #: there on the real cooperative matrices, and a whole pp512 of llama-1b Q8_0 went
    #: from 15,311 to 30,677 tok/s, llama-8b Q4_K_M from 2,118 to 3,982
    matmul_cm2: bool = attrs.field(factory=lambda: os.environ.get("TRIO_LLM_MATMUL_CM2", "1") != "0")
    #: matmul_cm2's tile (rows, tokens) for every matmul; None: ``cm2_tile`` chooses
    matmul_cm2_tile: tuple[int, int] | None = attrs.field(factory=cm2_tile_env)
    #: ``cm2_tile``'s fewest work groups for every tile (TRIO_LLM_CM2_MIN_GROUPS, for timing
    #: the choice); None: ``CM2_MIN_GROUPS``' per tile
    matmul_cm2_min_groups: int | None = attrs.field(
        factory=lambda: env_int("TRIO_LLM_CM2_MIN_GROUPS", 0) or None)
    #: the products on matmul_cm3.comp in this form instead of matmul_cm2.comp (None;
    #: TRIO_LLM_CM2_VARIANT, ``cm2_variant_env``), where matmul_cm2 would run
    matmul_cm2_variant: Cm3Variant | None = attrs.field(factory=cm2_variant_env)
    #: tests only: matmul_cm2 with its products emulated (CM_EMULATE) for subgroups of
    #: this size (32 or 64; 0: off), on any device
    matmul_cm2_emulate: int = 0
    #: the dense prefill matmuls on matmul_nv2.comp (VK_NV_cooperative_matrix2:
    #: workgroup-scope matrices, tensor-addressed loads that decode the weights) ahead of
    #: matmul_cm2, where ``nv2_plan`` allows it: cooperative matrices on (``coopmat``),
    #: the device's NV extension with block loads and bufferDeviceAddress
    #: (``Device.nv_coopmat2_decode``), no ``matmul_cm2_variant`` or emulation asked for.
    #: TRIO_LLM_MATMUL_NV2=0 keeps matmul_cm2. On the H200 (2026-12-04) about 60 of its GPU
    #: cases (every type on every tile) ran without a failure before a time limit
    matmul_nv2: bool = attrs.field(factory=lambda: os.environ.get("TRIO_LLM_MATMUL_NV2", "1") != "0")
    #: the weight types it takes (``nv2_types_env``: ``NV2_DEFAULT_QTYPES`` by default,
    #: TRIO_LLM_MATMUL_NV2=all every type it decodes); the others stay on matmul_cm2
    matmul_nv2_types: tuple[str, ...] = attrs.field(factory=nv2_types_env)
    #: its tile (rows, tokens) for every product; None: ``nv2_tile`` chooses
    matmul_nv2_tile: tuple[int, int] | None = attrs.field(factory=nv2_tile_env)
    #: its K per step (32 or 64; TRIO_LLM_NV2_BK)
    matmul_nv2_bk: int = attrs.field(factory=lambda: env_int("TRIO_LLM_NV2_BK", NV2_BK),
                                      validator=attrs.validators.in_((32, 64)))
    #: ``nv2_tile``'s fewest work groups for every tile (TRIO_LLM_NV2_MIN_GROUPS); None: per tile
    matmul_nv2_min_groups: int | None = attrs.field(
        factory=lambda: env_int("TRIO_LLM_NV2_MIN_GROUPS", 0) or None)
    #: decode buckets' RMSNorms folded into the matvecs that read them (matvec.comp's
    #: NORM_IN; forward.py's ``find_norm_fusions``): two dispatch stages fewer per layer,
    #: but one load of the norm weight beside each x load. Off unless
    #: TRIO_LLM_FUSE_NORM=1 until the H200 A/B (bench/h200.sh tune) shows it pays: the
    #: earlier form of this fusion (X_NORM, which also summed x^2 in a pass of its own)
    #: made llama-8b Q4_K_M decode 14 % slower there (bench/results/h200-fusion/)
    fuse_norm: bool = attrs.field(factory=lambda: os.environ.get("TRIO_LLM_FUSE_NORM", "0") == "1")
    #: ``attention_decode`` in its coalesced form (attn_decode2.comp: the lanes of a row
    #: group split each K / V row, several rows in flight per lane) where ``decode2_ok``;
    #: TRIO_LLM_ATTN_DECODE2=0 keeps attn_decode.comp. On by default since the H200 run of
    #: 2026-12-01 evening (its tests pass there; bench/attn_depth.py, all layers, ms per
    #: token): llama-1b f16 at 32k 1.47 -> 0.86, at 128 keys 0.27 -> 0.14; llama-8b f16 at
    #: 16k 2.70 -> 1.99 (1.70 with 2 rows), q8_0 3.03 -> 1.81
    decode_attn2: bool = attrs.field(factory=lambda: os.environ.get("TRIO_LLM_ATTN_DECODE2", "1") != "0")
    #: attn_decode2: K (and V) rows in flight per lane
    decode2_rows: int = 4
    #: attn_decode2: lanes per row (a power of two dividing head_dim / 8, at most the
    #: subgroup); 0: ``decode2_lanes``' choice
    decode2_lanes: int = 0
    #: tests only: moe_matmul's cooperative-matrix kernel with its products emulated
    #: (CM_EMULATE) in every lowering, so lavapipe runs that path end to end
    moe_cm_emulate: bool = False
    #: tests only: the cooperative-matrix path with its products emulated (CM_EMULATE),
    #: so a device without cooperative matrices runs all of that path's lowering
    prefill_cm_emulate: bool = False
    #: attn_prefill_cm2.comp (each subgroup owns 16 query rows and does its own S, softmax
    #: and P V: two work-group barriers per key tile instead of four) in place of
    #: attn_prefill_cm.comp where ``prefill_cm2_plan`` allows it, on devices with
    #: cooperative matrices; TRIO_LLM_PREFILL_CM2=0 turns it off. The H200 (2026-12-01,
    #: bench/prefill.py, 8k prompt, all heads of a layer): llama-1b's attention 0.33 s
    #: (attn_prefill_cm) -> 0.17 s with 32 keys per tile, llama-8b's 1.13 s -> 0.63 s with
    #: 16 (``PREFILL_CM2_PREFER``); lavapipe only runs it emulated
    prefill_cm2: bool = attrs.field(factory=lambda: os.environ.get("TRIO_LLM_PREFILL_CM2", "1") != "0")
    #: its keys per tile (16, 32 or 64); 0: ``PREFILL_CM2_PREFER``'s where its shared
    #: memory fits the device's reported limit, else the most of ``PREFILL_CM2_KEYS`` that fit
    prefill_cm2_keys: int = attrs.field(factory=lambda: env_int("TRIO_LLM_PREFILL_CM2_KEYS", 0))
    #: tests only: attn_prefill_cm2 with its products emulated (CM_EMULATE) for subgroups
    #: of this size (32 or 64; 0: off) on any device, taking precedence over the rest
    prefill_cm2_emulate: int = 0
    #: attn_prefill_cm3.comp in this form in place of attn_prefill_cm2 (None: cm2;
    #: TRIO_LLM_PREFILL_CM2_VARIANT, ``attn_variant_env``), wherever attn_prefill_cm2 could
    #: run (any head_dim up to 256: the knob is explicit), emulated with
    #: ``prefill_cm2_emulate``
    prefill_cm2_variant: AttnVariant | None = attrs.field(factory=attn_variant_env)
    #: attn_prefill_nv2.comp (VK_NV_cooperative_matrix2: the work group's query rows as
    #: workgroup-scope matrices, the softmax on the accumulators by row reductions and
    #: per-element functions) ahead of every other prefill attention kernel, where
    #: ``prefill_nv2_plan`` allows it: cooperative matrices on (``coopmat``) and the
    #: device's ``nv_coopmat2``. On by default (TRIO_LLM_PREFILL_NV2=0 turns it off): on the
    #: H200 (2026-12-05, bench/h200.sh nv2gate) its GPU tests passed, head dims, GQA ratios,
    #: every cache type, several sequences in a tile, windows over rings, splits, long
    #: prompts and the model through the backend; llama-1b's 16 layers at 32k took 0.92 s
    #: in its default form against attn_prefill_cm2's 2.56 (op level)
    prefill_nv2: bool = attrs.field(factory=lambda: os.environ.get("TRIO_LLM_PREFILL_NV2", "1") == "1")
    #: its (rows, keys per tile, lanes) for every shape; None: ``prefill_nv2_default``
    prefill_nv2_tile: tuple[int, int, int] | None = attrs.field(factory=prefill_nv2_tile_env)
    #: its form (``PREFILL_NV2_FORMS``; TRIO_LLM_PREFILL_NV2_FORM)
    prefill_nv2_form: str = attrs.field(factory=prefill_nv2_form_env,
                                        validator=lambda _i, _a, v: _nv2_form_check(v))
    #: decode buckets' matvecs of ``Q8_MATVEC`` weights on int8 activations (llama.cpp's
    #: q8_1 "MMVQ": quantize_q8.comp once per input, matvec.comp's X_Q8 form), for
    #: buckets of at least ``matvec_q8_min`` columns (the quantize is a dispatch stage
    #: of its own, which a one-column step cannot afford: the H200 timed one column alike
    #: both ways). TRIO_LLM_MATVEC_Q8=0 turns it off. The H200 (2026-12-01, bench/decode.py
    #: --batch-sizes, graph alone): llama-8b Q4_K_M at 2 / 4 / 8 sequences 7.58 / 11.53 /
    #: 21.78 ms per step on f32 activations, 4.48 / 6.08 / 9.59 ms on int8; llama-1b Q8_0
    #: 2.07 / 2.83 / 4.63 -> 2.01 / 2.57 / 4.08 ms
    matvec_q8: bool = attrs.field(factory=lambda: os.environ.get("TRIO_LLM_MATVEC_Q8", "1") != "0")
    matvec_q8_min: int = attrs.field(factory=lambda: env_int("TRIO_LLM_MATVEC_Q8_MIN", 2))
    #: X_Q8 multiplies with dotPacked4x8EXT (INT_DOT) where the device reports integer
    #: dot products (None: ask the device); False: the plain int math (tests)
    int_dot: bool | None = None
    #: the hybrid and MoE fusions (forward.py's ``fusion_groups``): qwen35's conv with
    #: its split and L2 norms in one dispatch, the delta rule with the gated RMSNorm
    #: after it, the experts' SwiGLU in their down product, the experts' combine with
    #: the shared expert's gate and the residual add; and the emission's level
    #: scheduler (each dispatch at the first barrier level its hazards allow, not
    #: after the previous node's). Off by default (TRIO_LLM_HYBRID_FUSE=1 turns it on)
    #: after the H200's first A/B (2026-12-01 late, bench/results/h200-session7/call5):
    #: qwen35-0.8b Q8_0 decode 350 -> 412 tok/s, but its pp512 16,669 -> 11,252, the
    #: compute buffers 75 -> 672 MiB (plan_buffers never freed the values a group kept
    #: alive past their last reader: fixed, 92 MiB), and three of test_vulkan_hybfuse.py's
    #: fused-against-unfused forwards 0.6 % of the logits' scale apart on the GPU where
    #: lavapipe's are bit-identical (not yet explained)
    hybrid_fuse: bool = attrs.field(factory=lambda: os.environ.get("TRIO_LLM_HYBRID_FUSE", "0") == "1")
    #: fusion kinds left unfused while the rest are on (``TRIO_LLM_HYBRID_OFF``, names
    #: separated by commas, e.g. "moe_down_out,attn_gate"): the H200's A/B of one kind
    hybrid_off: frozenset[str] = attrs.field(factory=lambda: hybrid_off_env())

    def q8_ok(self, qtype: str, bucket: int) -> bool:
        """Whether a decode bucket's product of ``qtype`` weights reads int8 activations."""
        return self.matvec_q8 and qtype in Q8_MATVEC and self.matvec_q8_min <= bucket <= 8

    def col_split(self, maxc: int, *, x_stride: int, y_stride: int, x8: bool,
                  to_cache: bool = False) -> tuple[tuple[int, int], ...]:
        """The (first column, columns) of each dispatch a matvec of ``maxc`` columns
        lowers to: ((0, 4), (4, 4)) for 8 with ``matvec_split8`` where the second
        dispatch's views (x, y unless the product writes the KV cache, the int8 scales)
        start on the device's storage offset alignment, else ((0, maxc),)."""
        if not (self.matvec_split8 and maxc == 8):
            return ((0, maxc),)
        offs = [4 * x_stride * (1 if x8 else 4)] + ([] if to_cache else [16 * y_stride]) + ([x_stride] if x8 else [])
        align = self.kernels.device.limits.min_storage_offset_alignment
        if any(o % align for o in offs):
            return ((0, maxc),)
        return ((0, 4), (4, 4))

    def _columns(self, col0: int, x: View, y: View, xd: View | None, *, x_stride: int, y_stride: int,
                 to_cache: bool = False) -> tuple[View, View, View | None]:
        """x, y and the int8 scales of a dispatch that starts at column ``col0``
        (``col_split``): each bound ``col0`` columns on (y not where it is the cache)."""
        if not col0:
            return x, y, xd

        def on(v: View, n: int) -> View:
            return v.sub(n, v.size - n)

        x = on(x, col0 * x_stride * (1 if xd is not None else 4))
        if not to_cache:
            y = on(y, col0 * y_stride * 4)
        if xd is not None:
            xd = on(xd, col0 * x_stride // 32 * 8)
        return x, y, xd

    def _unrolled(self, maxc: int, rs: int) -> dict[str, object]:
        """The FULL_UNROLL defines of a matvec at ``maxc`` columns (``matvec_unroll``)."""
        if maxc not in self.matvec_unroll:
            return {}
        return {"FIXED_MAXC": f"{maxc}u", "FIXED_RS": f"{rs}u", FULL_UNROLL: 1}

    def _q8_in(self, xd: View | None, norm: View | None) -> tuple[dict[str, object], tuple[View, ...]]:
        """The X_Q8 part of a matvec variant: (defines, the scales' binding), empty for
        f32 activations."""
        if xd is None:
            return {}, ()
        assert norm is None, "X_Q8 takes the activations already normalized and quantized"
        dot = self.kernels.device.int_dot if self.int_dot is None else self.int_dot
        return {"X_Q8": 1, **({"INT_DOT": 1} if dot else {})}, (xd,)

    def quantize_q8(
        self, x: View, q: View, ds: View, step: View, *, n_in: int, x_stride: int, cap: int,
        count_sel: int = COUNT_TOKENS, norm: View | None = None, eps: float = 0.0,
    ) -> Dispatch:
        """The live columns of x [cap, n_in] (f32, ``x_stride`` floats apart) as q8_1
        blocks (quantize_q8.comp): int8 values into ``q`` (``n_in`` bytes per column),
        (d, s) per block of 32 into ``ds``; with ``norm`` (an f32 weight of ``n_in``)
        those of RMSNorm(x) * norm, a work group per column (rms_norm's widths)."""
        assert n_in % 32 == 0 and x_stride % 4 == 0
        if norm is None:
            wg = self.elem_wg
            k = self.kernels.get("quantize_q8", n_bindings=4, n_push=4, local_size=wg)
            return Dispatch(k, (x, q, ds, step), (n_in, x_stride, count_sel, cap),
                            grid(math.ceil(cap * n_in // 32 / wg)))
        wg = self.norm_wg if n_in < 1024 else 4 * self.norm_wg
        k = self.kernels.get("quantize_q8", n_bindings=5, n_push=5, local_size=wg, defines=dict(NORM_IN))
        return Dispatch(k, (x, q, ds, step, norm), (n_in, x_stride, count_sel, cap, float(eps)), grid(cap))

    def matvec(
        self, qtype: str, w: View, x: View, y: View, step: View, *, n_in: int, n_rows: int,
        x_stride: int, y_stride: int, y_off: int = 0, count_sel: int = COUNT_TOKENS,
        add: bool = False, maxc: int = 8, norm: View | None = None, eps: float = 0.0,
        xd: View | None = None, col0: int = 0,
    ) -> Dispatch:
        """y[c, y_off + r] (+)= W[r] . x[c] for the live columns c (at most ``maxc``);
        with ``norm`` (an f32 weight of ``n_in``) the product reads x[c]'s RMSNorm
        times that weight instead of x[c] (``_norm_in``); with ``xd`` x is
        ``quantize_q8``'s int8 values and ``xd`` their scales (X_Q8). ``col0``: the
        step's columns from ``col0`` on (``col_split``)."""
        assert n_in % 8 == 0 and x_stride % 4 == 0
        nr, rs = self.matvec_rows, self.matvec_rs
        if maxc == 8 and self.matvec_rs8:
            rs = self.matvec_rs8
        x, y, xd = self._columns(col0, x, y, xd, x_stride=x_stride, y_stride=y_stride)
        nd, nv, npush = _norm_in(norm, eps)
        qd, qv = self._q8_in(xd, norm)
        k = self.kernels.get(
            "matvec", n_bindings=4 + len(nv) + len(qv), n_push=7 + len(npush), local_size=nr * self.subgroup,
            defines={**matvec_defines(qtype), **nd, **qd, **self._unrolled(maxc, rs)},
            spec={1: maxc, 2: nr, 3: rs, **({4: col0} if col0 else {})},
        )
        push = (n_in, n_rows, x_stride, y_stride, y_off, count_sel, int(add), *npush)
        return Dispatch(k, (w, x, y, step, *nv, *qv), push, grid(math.ceil(n_rows / (nr * rs))))

    def matvec_rope(
        self, qtype: str, w: View, x: View, y: View, step: View, factors: View, *, n_in: int,
        n_rows: int, x_stride: int, y_stride: int, head_dim: int, rope: bool, theta: float,
        to_cache: bool = False, n_ctx: int = 0, y_off: int = 0, maxc: int = 8,
        kv_type: str = "f32", norm: View | None = None, eps: float = 0.0, xd: View | None = None,
        col0: int = 0,
    ) -> Dispatch:
        """``matvec`` of a q, k or v projection that finishes rope.comp's work itself:
        the output rows rotated in llama's adjacent pairs (``rope``) at each token's
        position, written in place or (``to_cache``) into the KV cache row of (sequence,
        position % ``n_ctx``) whose width is ``n_rows``, stored as ``kv_type``
        (model/kvtypes.py). A quantized type runs 32 rows per work group (one block)."""
        assert n_in % 8 == 0 and x_stride % 4 == 0 and n_rows % 2 == 0 and y_off % 2 == 0
        nr, rs = self.matvec_rows, self.matvec_rs
        assert rs % 2 == 0, "a rope pair must be two rows of one subgroup"
        t = _kv(kv_type if to_cache else "f32")
        if t.quantized:
            assert 32 % rs == 0 and n_rows % 32 == 0 and y_off % 32 == 0 and maxc <= 8
            _check_head(t, head_dim, "the")
            nr = 32 // rs
        x, y, xd = self._columns(col0, x, y, xd, x_stride=x_stride, y_stride=y_stride, to_cache=to_cache)
        nd, nv, npush = _norm_in(norm, eps)
        qd, qv = self._q8_in(xd, norm)
        k = self.kernels.get(
            "matvec", n_bindings=5 + len(nv) + len(qv), n_push=13 + len(npush), local_size=nr * self.subgroup,
            defines={**matvec_defines(qtype), **ROPE_OUT, **kv_defines(KV_TYPE=t), **nd, **qd,
                     **self._unrolled(maxc, rs)},
            spec={1: maxc, 2: nr, 3: rs, **({4: col0} if col0 else {})},
        )
        push = (n_in, n_rows, x_stride, y_stride, y_off, COUNT_TOKENS, 0,
                head_dim, int(rope), int(to_cache), n_ctx, n_rows, float(math.log2(theta)), *npush)
        return Dispatch(k, (w, x, y, step, factors, *nv, *qv), push, grid(math.ceil(n_rows / (nr * rs))))

    def matvec_gate_up(
        self, qtype: str, w: View, x: View, y: View, step: View, *, n_in: int, n_rows: int,
        row_a: int, row_b: int, x_stride: int, y_stride: int, maxc: int = 8,
        norm: View | None = None, eps: float = 0.0, xd: View | None = None, col0: int = 0,
    ) -> Dispatch:
        """y[c, i] = silu(G[i] . x[c]) * (U[i] . x[c]) for i < ``n_rows``, where G's rows
        start at row ``row_a`` of ``w`` and U's at ``row_b`` (both in the one view)."""
        assert n_in % 8 == 0 and x_stride % 4 == 0
        nr = self.matvec_rows
        x, y, xd = self._columns(col0, x, y, xd, x_stride=x_stride, y_stride=y_stride)
        nd, nv, npush = _norm_in(norm, eps)
        qd, qv = self._q8_in(xd, norm)
        k = self.kernels.get(
            "matvec", n_bindings=4 + len(nv) + len(qv), n_push=9 + len(npush), local_size=nr * self.subgroup,
            defines={**matvec_defines(qtype), **GATE_UP, **nd, **qd, **self._unrolled(maxc, 2)},
            spec={1: maxc, 2: nr, 3: 2, **({4: col0} if col0 else {})},
        )
        push = (n_in, n_rows, x_stride, y_stride, 0, COUNT_TOKENS, 0, row_a, row_b, *npush)
        return Dispatch(k, (w, x, y, step, *nv, *qv), push, grid(math.ceil(n_rows / nr)))

    def cm3_tile(self, n_rows: int, cap: int, sub: int, v: Cm3Variant) -> tuple[int, int]:
        """matmul_cm3's tile when none is forced: ``cm2_tile``'s rule (per-tile fewest
        work groups, ``matmul_cm2_min_groups`` for all) among the tiles of ``CM2_TILES``
        that variant ``v`` has a layout for and whose shared memory fits the device
        (raises ConfigError when none does)."""
        limit = self.kernels.device.limits.max_shared_memory
        emu = bool(self.matmul_cm2_emulate)
        fits = []
        for t in CM2_TILES:
            try:
                if cm3_shared(*t, sub, v, emulate=emu) <= limit:
                    fits.append(t)
            except ValueError:
                pass
        if not fits:
            raise ConfigError(f"matmul_cm3 {v.name}: no tile of {CM2_TILES} fits {limit} bytes of shared memory")
        for bm, bn in fits:
            most = self.matmul_cm2_min_groups or CM2_MIN_GROUPS[bm, bn]
            if math.ceil(n_rows / bm) * math.ceil(cap / bn) >= most:
                return bm, bn
        return fits[-1]

    def nv2_plan(self, qtype: str, n_rows: int, cap: int, *, y_off: int = 0,
                 y_stride: int | None = None) -> tuple[int, int, int] | None:
        """matmul_nv2's (BM, BN, BK) for this product, or None where it does not run: not
        enabled (``matmul_nv2`` and ``coopmat``, a device with ``nv_coopmat2_decode``,
        neither ``matmul_cm2_variant`` nor ``matmul_cm2_emulate`` set), a weight type not
        in ``matmul_nv2_types``, y's rows narrower than ``y_off + n_rows`` (its store's tensor
        layout needs them whole), no tile whose lanes the device's workgroup-scope
        matrices take (``Device.nv_coopmat2_max_wg``), or a variant neither prebuilt nor
        compilable here (``shaders.nv2_ready``: slangpy not installed)."""
        dev = self.kernels.device
        if not (self.matmul_nv2 and self.coopmat and dev.nv_coopmat2 and dev.nv_coopmat2_decode):
            return None
        if self.matmul_cm2_variant is not None or self.matmul_cm2_emulate or qtype not in self.matmul_nv2_types:
            return None
        if y_stride is not None and y_off + n_rows > y_stride:
            return None
        tiles = tuple(t for t in NV2_TILES if NV2_LANES[t] <= dev.nv_coopmat2_max_wg)
        if not tiles:
            return None
        forced = self.matmul_nv2_tile
        if forced is not None and forced not in tiles:
            raise ConfigError(f"TRIO_LLM_NV2_TILE={forced[0]}x{forced[1]}: {NV2_LANES[forced]} lanes, "
                              f"{dev.name} takes workgroup-scope matrices up to {dev.nv_coopmat2_max_wg}")
        bm, bn = forced or nv2_tile(n_rows, cap, tiles, self.matmul_nv2_min_groups)
        if not nv2_ready("matmul_nv2", nv2_defines(qtype, bm, bn, self.matmul_nv2_bk)):
            return None  # neither prebuilt nor compilable here (no slangpy): matmul_cm2
        return bm, bn, self.matmul_nv2_bk

    def _nv2_kernel(self, name: str, instead: str, **get: Any) -> Kernel | None:
        """The pipeline of an NV cooperative-matrix-2 kernel (``name``: matmul_nv2 or
        attn_prefill_nv2), or None where the driver lists the extension but refuses it
        (only the H200 has run these): that kernel is turned off for this and every later
        dispatch (``instead`` runs), with a warning. Running out of memory, or losing the
        device, is not a refusal and raises."""
        try:
            return self.kernels.get(name, **get)
        except (DeviceOutOfMemory, DeviceLost):
            raise
        except BackendError as exc:  # ShaderCompileError among them
            log.warning("%s unavailable (%s): %s run instead", name, exc, instead)
            if name == "matmul_nv2":
                self.matmul_nv2 = False
            else:
                self.prefill_nv2 = False
            return None

    def x16_plan(self, qtype: str, n_rows: int, cap: int, *, y_off: int = 0, y_stride: int | None = None) -> bool:
        """Whether this product reads f16 activations (``matmul_x16``), so that its input
        is worth a ``to_f16``: on matmul_nv2 (its X_F16 variant prebuilt or compilable
        here) or on matmul_cm2's own form (not a matmul_cm3 variant); the other kernels
        read x."""
        if not self.matmul_x16:
            return False
        plan = self.nv2_plan(qtype, n_rows, cap, y_off=y_off, y_stride=y_stride)
        if plan is not None:
            return nv2_ready("matmul_nv2", nv2_defines(qtype, *plan, x16=True))
        return self._cm2_sub() in (32, 64) and self.matmul_cm2_variant is None

    def _cm2_sub(self) -> int:
        """The subgroup size matmul_cm2 is laid out for here (emulated or real); 0 where
        it does not run."""
        return self.matmul_cm2_emulate or (self.subgroup if self.coopmat and self.matmul_cm2 else 0)

    def to_f16(self, x: View, xh: View, step: View, *, n_in: int, x_stride: int, cap: int,
               count_sel: int = COUNT_TOKENS) -> Dispatch:
        """xh = the live rows of x (f32, ``x_stride`` floats apart) as f16 rows ``n_in``
        apart (to_f16.comp): the products' activations with ``matmul_x16``."""
        assert n_in % 8 == 0 and x_stride % 4 == 0 and xh.size >= 2 * cap * n_in
        k = self.kernels.get("to_f16", n_bindings=3, n_push=3, local_size=self.elem_wg)
        return Dispatch(k, (x, xh, step), (n_in, x_stride, count_sel), grid(math.ceil(cap * n_in // 8 / self.elem_wg)))

    def matmul(
        self, qtype: str, w: View, x: View, y: View, step: View, *, n_in: int, n_rows: int,
        x_stride: int, y_stride: int, cap: int, y_off: int = 0,
        count_sel: int = COUNT_TOKENS, add: bool = False, xh: View | None = None,
    ) -> Dispatch:
        """The tiled form of ``matvec`` for many tokens (prefill); on cooperative
        matrices (f16 tiles, f32 accumulators) where the device has them: matmul_nv2 where
        ``nv2_plan`` allows it (NVIDIA's cooperative_matrix2), else matmul_cm2
        when enabled (``matmul_cm2``, subgroups of 32 or 64; matmul_cm3 in the form
        ``matmul_cm2_variant`` where one is set), else matmul_cm. ``xh``: the live rows
        of x as ``to_f16`` made them, which matmul_nv2 and matmul_cm2 read instead of x
        where ``x16_plan`` holds (every other kernel reads x)."""
        assert n_in % 32 == 0 and x_stride % 4 == 0
        assert self.matmul_cm2_emulate in (0, 32, 64)
        push = (n_in, n_rows, x_stride, y_stride, y_off, count_sel, int(add))
        nv2 = self.nv2_plan(qtype, n_rows, cap, y_off=y_off, y_stride=y_stride)
        if nv2 is not None:
            bm, bn, bk = nv2
            x16 = xh is not None and self.x16_plan(qtype, n_rows, cap, y_off=y_off, y_stride=y_stride)
            k = self._nv2_kernel("matmul_nv2", "matmul_cm2", n_bindings=4, n_push=7,
                                 local_size=NV2_LANES[bm, bn], defines=nv2_defines(qtype, bm, bn, bk, x16=x16))
            if k is not None:
                xin = xh if x16 and xh is not None else x
                return Dispatch(k, (w, xin, y, step), push, (math.ceil(n_rows / bm), math.ceil(cap / bn), 1))
        sub = self._cm2_sub()
        if sub in (32, 64):
            v = self.matmul_cm2_variant
            emu = bool(self.matmul_cm2_emulate)
            if v is not None:
                if n_in % v.bk:  # K-tiles of 64 need n_in a multiple of 64: that product on 32
                    v = v._replace(bk=32)
                if v.wide and qtype == "Q8_0" and n_in % 64:  # its 32-bit reads need 4-byte rows
                    v = v._replace(wide=False)
                bm, bn = self.matmul_cm2_tile or self.cm3_tile(n_rows, cap, sub, v)
                try:
                    need = cm3_shared(bm, bn, sub, v, emulate=emu)
                except ValueError as exc:
                    raise ConfigError(str(exc)) from None
                limit = self.kernels.device.limits.max_shared_memory
                if need > limit:
                    raise ConfigError(f"matmul_cm3 {v.name} on a {bm}x{bn} tile needs {need} bytes of shared "
                                      f"memory, {self.kernels.device.name} has {limit}")
                _, _, lanes = cm3_layout(bm, bn, sub, v)
                k = self.kernels.get("matmul_cm3", n_bindings=4, n_push=7, local_size=lanes,
                                     defines=cm3_defines(qtype, sub, bm, bn, v, emulate=emu))
            else:
                bm, bn = self.matmul_cm2_tile or cm2_tile(n_rows, cap, self.matmul_cm2_min_groups)
                _, _, lanes = cm2_layout(bm, bn, sub)
                if xh is not None and self.matmul_x16:
                    k = self.kernels.get("matmul_cm2", n_bindings=4, n_push=7, local_size=lanes,
                                         defines=cm2_defines(qtype, sub, bm, bn, emulate=emu, x16=True))
                    return Dispatch(k, (w, xh, y, step), push, (math.ceil(n_rows / bm), math.ceil(cap / bn), 1))
                k = self.kernels.get("matmul_cm2", n_bindings=4, n_push=7, local_size=lanes,
                                     defines=cm2_defines(qtype, sub, bm, bn, emulate=emu))
            return Dispatch(k, (w, x, y, step), push, (math.ceil(n_rows / bm), math.ceil(cap / bn), 1))
        if self.coopmat:
            k = self.kernels.get("matmul_cm", n_bindings=4, n_push=7, local_size=256,
                                 defines=coopmat_defines(qtype, self.subgroup))
        else:
            k = self.kernels.get("matmul", n_bindings=4, n_push=7, local_size=256, defines=qtype_defines(qtype))
        return Dispatch(k, (w, x, y, step), push, (math.ceil(n_rows / 64), math.ceil(cap / 64), 1))

    def dequant_f16(self, qtype: str, w: View, y: View, *, n_in: int, n_rows: int) -> Dispatch:
        """y = the ``n_rows`` x ``n_in`` weight rows of ``w`` as f16 (dequant_f16.comp),
        for a prefill product that reads them as F16 (``matmul_dequant``)."""
        assert n_in % 8 == 0 and y.size >= 2 * n_rows * n_in
        k = self.kernels.get("dequant_f16", n_bindings=2, n_push=2, local_size=self.elem_wg,
                             defines=qtype_defines(qtype))
        return Dispatch(k, (w, y), (n_in, n_rows), grid(math.ceil(n_rows * n_in // 8 / self.elem_wg)))

    def dequants_any(self, cap: int) -> bool:
        """Whether some weight type's prefill products of ``cap`` tokens would."""
        return bool(self.matmul_dequant) and cap > 8 and cap >= self.matmul_dequant_min

    def dequants(self, qtype: str, cap: int) -> bool:
        """Whether a prefill product of ``cap`` tokens on ``qtype`` goes through
        ``dequant_f16`` (``matmul_dequant``)."""
        return qtype in self.matmul_dequant and self.dequants_any(cap)

    def get_rows(
        self, qtype: str, w: View, y: View, step: View, *, n_in: int, y_stride: int, cap: int,
        row0: int = 0, row1: int = 0xFFFFFFFF, id_sel: int = COUNT_TOKENS,
    ) -> Dispatch:
        k = self.kernels.get("get_rows", n_bindings=3, n_push=5, local_size=self.rows_wg, defines=qtype_defines(qtype))
        return Dispatch(k, (w, y, step), (n_in, row0, row1, y_stride, id_sel), grid(cap))

    def rms_norm(
        self, x: View, w: View, y: View, step: View, *, n: int, x_stride: int, y_stride: int,
        eps: float, cap: int, rows_per_tok: int = 1, count_sel: int = COUNT_TOKENS,
    ) -> Dispatch:
        # a row is one work group, on the critical path of every layer: wide groups
        # keep its latency down (few loads per lane before the reduction)
        wg = self.norm_wg if n < 1024 else 4 * self.norm_wg
        k = self.kernels.get("rms_norm", n_bindings=4, n_push=6, local_size=wg)
        push = (n, rows_per_tok, x_stride, y_stride, count_sel, float(eps))
        return Dispatch(k, (x, w, y, step), push, grid(cap * rows_per_tok))

    def rope(
        self, x: View, y: View, factors: View, step: View, *, n_heads: int, head_dim: int, x_stride: int,
        mode: int, theta: float, cap: int, to_cache: bool = False, n_ctx: int = 0, kv_dim: int = 0,
        kv_type: str = "f32",
    ) -> Dispatch:
        """RoPE in place, or (``to_cache``) into the cache row of (sequence, position %
        ``n_ctx``) stored as ``kv_type``; mode ``ROPE_NONE`` with ``to_cache`` is the V
        write. A quantized type runs a thread per block of 32 values, not per pair."""
        t = _kv(kv_type if to_cache else "f32")
        k = self.kernels.get("rope", n_bindings=4, n_push=8, local_size=self.elem_wg,
                             defines=kv_defines(KV_TYPE=t))
        push = (n_heads, head_dim, x_stride, mode, int(to_cache), n_ctx, kv_dim, float(math.log2(theta)))
        if t.quantized:
            _check_head(t, head_dim, "the")
            threads = n_heads * head_dim // 32
        else:
            threads = n_heads * head_dim // 2
        return Dispatch(k, (x, y, factors, step), push, (math.ceil(threads / self.elem_wg), cap, 1))

    def attention(
        self, q: View, k_cache: View, v_cache: View, o: View, step: View, *, n_head: int,
        n_head_kv: int, head_dim: int, n_ctx: int, q_stride: int, o_stride: int, cap: int,
        scale: float | None = None, k_type: str = "f32", v_type: str = "f32", n_swa: int = 0,
    ) -> Dispatch:
        """One work group per (query head, token) over the token's visible keys
        (causal; with ``n_swa`` > 0 only the last ``n_swa`` positions): the prefill
        form. Caches of ``k_type`` / ``v_type``, position p at row p % ``n_ctx``."""
        # above 4 * attn_wg (MLA's latent rows) each lane owns up to three groups of four dims
        assert (head_dim <= 4 * self.attn_wg or self.attn_wg >= 64) and head_dim <= 768 and head_dim % 4 == 0
        kt, vt = _kv(k_type), _kv(v_type)
        _check_head(kt, head_dim, "K")
        _check_head(vt, head_dim, "V")
        k = self.kernels.get("attention", n_bindings=5, n_push=9, local_size=self.attn_wg,
                             defines=kv_defines(K_TYPE=kt, V_TYPE=vt))
        kv_dim = n_head_kv * head_dim
        s = 1.0 / math.sqrt(head_dim) if scale is None else scale
        push = (n_head, n_head_kv, head_dim, n_ctx, kv_dim, q_stride, o_stride, float(s), n_swa)
        return Dispatch(k, (q, k_cache, v_cache, o, step), push, (n_head, cap, 1))

    def qk_norm_rope(
        self, x: View, y: View, factors: View, step: View, w: View, *, n_heads: int, head_dim: int,
        x_stride: int, x_head: int, x_off: int, mode: int, n_rot: int, theta: float, eps: float, cap: int,
        to_cache: bool = False, n_ctx: int = 0, kv_dim: int = 0, kv_type: str = "f32",
    ) -> Dispatch:
        """Per (head, token): the head's RMSNorm (weight ``w`` [head_dim]), its RoPE
        (``n_rot`` < head_dim: the first n_rot values in half-split pairs, as
        ``rope_partial``), stored as the value ``y`` [T, n_heads * head_dim] or
        (``to_cache``) into the KV cache as ``rope`` stores it (qk_norm_rope.comp);
        head h of token t is read from x[t * x_stride + h * x_head + x_off]."""
        assert head_dim <= 512 and n_rot % 2 == 0 and 0 < n_rot <= head_dim and mode in (ROPE_NORMAL, ROPE_NEOX)
        t = _kv(kv_type if to_cache else "f32")
        if t.quantized:
            _check_head(t, head_dim, "the")
        k = self.kernels.get("qk_norm_rope", n_bindings=5, n_push=11, local_size=self.norm_wg,
                             defines=kv_defines(KV_TYPE=t))
        push = (head_dim, x_stride, x_head, x_off, mode, n_rot, int(to_cache), n_ctx, kv_dim, float(eps),
                float(math.log2(theta)))
        return Dispatch(k, (x, y, factors, step, w), push, (n_heads, cap, 1))

    def glu(
        self, g: View, u: View, y: View, step: View, *, n: int, stride: int, cap: int,
        act: str = "silu", count_sel: int = COUNT_TOKENS,
    ) -> Dispatch:
        """y = act(g) * u: SwiGLU (silu) or GeGLU (gelu, tanh form)."""
        by_act: dict[str, dict[str, object]] = {"gelu": {"GELU": 1}, "sigmoid": {"SIGMOID": 1}}
        defines = by_act.get(act)
        k = self.kernels.get("swiglu", n_bindings=4, n_push=3, local_size=self.elem_wg, defines=defines)
        return Dispatch(k, (g, u, y, step), (n, stride, count_sel), (math.ceil(n / self.elem_wg), cap, 1))

    def attention_decode(
        self, q: View, k_cache: View, v_cache: View, o: View, part: View, counters: View,
        step: View, *, n_head: int, n_head_kv: int, head_dim: int, n_ctx: int, q_stride: int,
        o_stride: int, cap: int, n_split: int, scale: float | None = None, k_type: str = "f32",
        v_type: str = "f32", n_swa: int = 0, min_chunk: int | None = None,
        gate: tuple[View, int, int, int] | None = None, v_dim: int = 0,
    ) -> Dispatch:
        """``attention`` for few tokens at any depth (flash-decoding, attn_decode.comp):
        each (token, KV head) split over up to ``n_split`` work groups (``decode_splits``)
        that share the K/V loads among the query heads of the KV head, combined by the
        last to finish. ``part`` holds ``attention_part_floats(cap, n_head, head_dim,
        n_split)`` floats and ``counters`` ``attention_counters(cap, n_head, n_head_kv)``
        zeroed uint32 (both reused by every layer). ``min_chunk`` (default one
        tile) is the fewest keys a split takes: a sequence that short is one work group
        that writes its output itself.

        With ``decode_attn2`` (TRIO_LLM_ATTN_DECODE2=1) and where ``decode2_ok`` holds
        it runs attn_decode2.comp, the coalesced form, with the same buffers and the
        same results to f32 rounding; attn_decode.comp otherwise. ``gate`` = (g,
        g_stride, g_head, g_off): each output value divided by 1 + exp(-g) of its
        (token, head, value) (qwen35's sigmoid output gate, OUT_GATE).

        ``v_dim`` > 0: a latent cache (MLA, ``v_is_k``; ``decode_latent_ok``): the values
        are the first ``v_dim`` of each K row (``v_cache`` is ``k_cache``, one type), K
        rows of up to 576; only those ``v_dim`` dims of each output head are written
        (attn_decode.comp's LATENT)."""
        wg = self.decode_wg
        coalesced = not v_dim and self.decode_attn2 and self.decode2_ok(n_head, n_head_kv, head_dim)
        if v_dim:
            assert self.decode_latent_ok(n_head, n_head_kv, head_dim, v_dim) and gate is None
            assert v_cache == k_cache and v_type == k_type
        else:  # attn_decode.comp: a lane owns four dims of a head (a key group of head_dim / 4)
            assert head_dim <= ATTN_MAX_HEAD and (coalesced or head_dim <= 4 * wg)
        assert head_dim % 4 == 0 and n_head % n_head_kv == 0
        assert wg % self.subgroup == 0
        kt, vt = _kv(k_type), _kv(v_type)
        _check_head(kt, head_dim, "K")
        _check_head(vt, head_dim, "V")
        # one tile per split by default: on the H200 (bench/attn_depth.py, llama-8b at
        # 640 keys) 1.16 ms per token for all layers against 1.79 ms with two tiles
        chunk = wg if min_chunk is None else min_chunk
        assert chunk % wg == 0 and chunk > 0 and 1 <= n_split <= 256
        gw = heads_per_group(n_head, n_head_kv)
        assert part.size >= 4 * attention_part_floats(cap, n_head, head_dim, n_split)
        assert counters.size >= 4 * attention_counters(cap, n_head, n_head_kv)
        defines = kv_defines(K_TYPE=kt, V_TYPE=vt)
        nb, npush = 7, 12
        if gate is not None:
            defines["OUT_GATE"] = 1
            nb, npush = 8, 15
        if v_dim:
            k = self.kernels.get("attn_decode", n_bindings=nb, n_push=npush, local_size=wg,
                                 defines={**defines, "LATENT": 1}, spec={1: gw, 2: v_dim})
        elif coalesced:
            lanes = self.decode2_lanes or decode2_lanes(head_dim, self.subgroup)
            k = self.kernels.get("attn_decode2", n_bindings=nb, n_push=npush, local_size=wg, defines=defines,
                                 spec={1: gw, 2: lanes, 3: head_dim // (8 * lanes), 4: self.decode2_rows,
                                       5: self.subgroup})
        else:  # WIDE: the queries' shared array sized for heads of up to 512
            k = self.kernels.get("attn_decode", n_bindings=nb, n_push=npush, local_size=wg,
                                 defines={**defines, "WIDE": 1} if head_dim > 256 else defines, spec={1: gw})
        s = 1.0 / math.sqrt(head_dim) if scale is None else scale
        ml_off = cap * n_head * n_split * head_dim
        push: tuple[int | float, ...] = (n_head, n_head_kv, head_dim, n_ctx, n_head_kv * head_dim, q_stride,
                                         o_stride, float(s), n_swa, n_split, chunk, ml_off)
        views: tuple[View, ...] = (q, k_cache, v_cache, o, part, counters, step)
        if gate is not None:
            views += (gate[0],)
            push += gate[1:]
        return Dispatch(k, views, push, (n_split, n_head // gw, cap))

    def decode_latent_ok(self, n_head: int, n_head_kv: int, head_dim: int, v_dim: int) -> bool:
        """Whether ``attention_decode`` takes a latent cache (``v_dim`` > 0) here: K rows
        up to 576 values, values a multiple of 4 up to four per lane, and the shared
        memory of attn_decode.comp's LATENT form (its arrays, then decode_combine.glsl's
        and reduce.glsl's) within the device's limit."""
        wg, gw = self.decode_wg, heads_per_group(n_head, n_head_kv)
        shared = 16 * gw * 144 + 4 * gw * wg + 12 * gw + 16 * wg + 4 * 256 + 4 + 4 * 64
        return (0 < v_dim <= min(head_dim, 4 * wg) and v_dim % 4 == 0 and head_dim <= 576 and head_dim % 4 == 0
                and shared <= self.kernels.device.limits.max_shared_memory)

    def decode2_ok(self, n_head: int, n_head_kv: int, head_dim: int) -> bool:
        """Whether ``attention_decode`` can take its coalesced form here: the device
        reports subgroup shuffles for compute (the row groups' butterflies), head_dim a
        multiple of 8 up to 512, lanes per row within the subgroup and dividing it, and
        the shared memory (the device's reported limits)."""
        lim = self.kernels.device.limits
        lanes = self.decode2_lanes or decode2_lanes(head_dim, self.subgroup)
        gw = heads_per_group(n_head, n_head_kv)
        return (lim.has_subgroup(SUBGROUP_SHUFFLE) and head_dim % 8 == 0 and head_dim <= ATTN_MAX_HEAD
                and lanes & (lanes - 1) == 0 and self.subgroup % lanes == 0 and (head_dim // 8) % lanes == 0
                and self.decode_wg % self.subgroup == 0 and self.decode2_rows >= 1
                and decode2_shared(self.decode_wg, gw, lanes, head_dim, self.subgroup) <= lim.max_shared_memory)

    def prefill_ok(self, head_dim: int) -> bool:
        """Whether ``attention_prefill`` runs here for ``head_dim``: a multiple of 16 up
        to 512, subgroups of at least 4 lanes (its quarter-row shuffles) and the shared
        memory its tile needs (the device's reported limits, not its name; above 256 the
        fewest rows of ``PREFILL_WIDE_ROWS``, ``prefill_wide_rows``)."""
        if head_dim % 16 or head_dim > ATTN_MAX_HEAD or self.subgroup < 4:
            return False
        if head_dim > 256:
            return self.prefill_wide_rows(head_dim) > 0
        rows = self.prefill_rows or prefill_rows(head_dim)
        return 4 * rows * (head_dim + 32 + 2) + 8 * 32 <= self.kernels.device.limits.max_shared_memory

    def prefill_wide_rows(self, head_dim: int) -> int:
        """Query rows of an attn_prefill.comp work group for a head wider than 256: the
        most of ``PREFILL_WIDE_ROWS`` (or ``prefill_rows``, where set) whose shared memory
        (``prefill_shared``, as many tokens as rows at most) fits the device's reported
        limit; 0 where none does."""
        limit = self.kernels.device.limits.max_shared_memory
        for rows in (self.prefill_rows,) if self.prefill_rows else PREFILL_WIDE_ROWS:
            if prefill_shared(head_dim, rows, rows) <= limit:
                return rows
        return 0

    def prefill_scalar_tile(self, n_head: int, n_head_kv: int, head_dim: int) -> tuple[int, int]:
        """(query heads, tokens) of an attn_prefill.comp work group (not LATENT):
        ``prefill_tile`` up to head_dim 256; above, ``prefill_wide_rows`` rows packed as
        ``prefill_latent_pack`` packs them (a head group that divides the GQA ratio and
        fits the rows, so fewer rows than heads per group still make a tile)."""
        if head_dim <= 256:
            return prefill_tile(n_head, n_head_kv, head_dim, rows=self.prefill_rows)
        rows = self.prefill_wide_rows(head_dim)
        assert rows, f"no attn_prefill tile fits head_dim {head_dim} here"
        return prefill_latent_pack(n_head, n_head_kv, rows)

    def prefill_cm_head_ok(self, head_dim: int) -> bool:
        """Whether the cooperative-matrix prefill kernels take heads of ``head_dim`` (a
        multiple of 16 up to ``PREFILL_CM_MAX_HEAD``); a wider layer takes the scalar
        attn_prefill.comp whatever the device has. A property of the kernels, not of the
        device: ``prefill_cm_ok``, ``prefill_cm2_plan`` and ``prefill_cm3_plan`` ask it."""
        return head_dim % 16 == 0 and head_dim <= PREFILL_CM_MAX_HEAD

    def prefill_latent_tile(self, n_head: int, n_head_kv: int, head_dim: int, v_dim: int) -> tuple[int, int] | None:
        """(query heads, tokens) of ``attention_prefill``'s latent form (``v_dim`` > 0,
        attn_prefill.comp's LATENT) here, or None where it does not run (the caller takes
        ``attention``): head_dim a multiple of 16 up to 576, ``v_dim`` a multiple of 4 up
        to head_dim and 512 (four values per lane of its 128), subgroups of at least 4
        lanes, and no tile of ``PREFILL_LATENT_ROWS`` (or ``prefill_rows``, where set)
        whose shared memory (``prefill_shared``) fits the device's reported limit."""
        if (head_dim % 16 or head_dim > 576 or v_dim <= 0 or v_dim % 4 or v_dim > min(head_dim, 512)
                or self.subgroup < 4 or n_head % n_head_kv):
            return None
        limit = self.kernels.device.limits.max_shared_memory
        for rows in (self.prefill_rows,) if self.prefill_rows else PREFILL_LATENT_ROWS:
            g, bq = prefill_latent_pack(n_head, n_head_kv, rows)
            if g * bq <= 32 and prefill_shared(head_dim, g * bq, bq) <= limit:
                return g, bq
        return None

    def prefill_cm_ok(self, n_head: int, n_head_kv: int, head_dim: int) -> bool:
        """Whether ``attention_prefill`` takes its cooperative-matrix form here: the
        device has them (``coopmat``) and it is enabled (``prefill_cm``), subgroups of 32 or 64, a power-of-two head group
        (the rows are a multiple of 16 dividing the work group) and the shared memory
        (the device's reported limit)."""
        g = heads_per_group(n_head, n_head_kv)
        hw = self.prefill_cm_emulate or self.prefill_cm and self.coopmat and self.subgroup in (32, 64)
        sub = 32 if self.prefill_cm_emulate else self.subgroup
        return (hw and g & (g - 1) == 0 and self.prefill_cm_head_ok(head_dim)
                and prefill_cm_shared(head_dim, sub, self.prefill_rows_cm or prefill_rows(head_dim, True))
                <= self.kernels.device.limits.max_shared_memory)

    def prefill_cm2_plan(self, n_head: int, n_head_kv: int, head_dim: int, rows: int = 0) -> tuple[int, int] | None:
        """(subgroup size, keys per tile) of attn_prefill_cm2.comp for ``rows`` query rows
        per work group (0: ``prefill_rows_cm`` or ``prefill_rows``' choice), or None
        where it does not run: not enabled (``prefill_cm2`` on a device with cooperative
        matrices and subgroups of 32 or 64, or ``prefill_cm2_emulate``), a head group
        that is not a power of two, head_dim not a multiple of 16 or above 256, rows
        other than 16, 32 or 64 (16 per subgroup), or no key tile whose shared memory
        (``prefill_cm2_shared``) fits the device's reported limit."""
        emu = self.prefill_cm2_emulate
        hw = emu in (32, 64) or (self.prefill_cm2 and self.coopmat and self.subgroup in (32, 64))
        g = heads_per_group(n_head, n_head_kv)
        rows = rows or self.prefill_rows_cm or prefill_rows(head_dim, True)
        if not hw or g & (g - 1) or not self.prefill_cm_head_ok(head_dim) or rows not in (16, 32, 64):
            return None
        if head_dim > PREFILL_CM2_MAX_HEAD and not emu and not self.prefill_cm2_keys:
            return None  # attn_prefill_cm's (the H200's timing, ``PREFILL_CM2_MAX_HEAD``)
        limit = self.kernels.device.limits.max_shared_memory
        fits = [b for b in PREFILL_CM2_KEYS if prefill_cm2_shared(head_dim, rows, b) <= limit]
        prefer = prefill_cm2_prefer(head_dim)
        keys = self.prefill_cm2_keys or (prefer if prefer in fits else fits[0] if fits else 0)
        if keys not in fits:
            return None
        return (emu or self.subgroup), keys

    def prefill_cm3_plan(self, n_head: int, n_head_kv: int, head_dim: int,
                         rows: int = 0) -> tuple[int, int, int, bool] | None:
        """(subgroup size, keys per tile, rows per work group, QSH) of attn_prefill_cm3.comp
        in the form ``prefill_cm2_variant``, or None where it does not run: no variant
        set, not enabled as attn_prefill_cm2 (``prefill_cm2`` on a device with cooperative
        matrices and subgroups of 32 or 64, or ``prefill_cm2_emulate``), a head group not
        a power of two, head_dim not a multiple of 16 or above 256, or nothing
        ``prefill_cm3_choose`` finds within the device's shared memory (``rows``, else
        ``prefill_rows_cm``, else its own; the variant's keys, else ``prefill_cm2_keys``,
        else its own)."""
        v = self.prefill_cm2_variant
        emu = self.prefill_cm2_emulate
        hw = emu in (32, 64) or (self.prefill_cm2 and self.coopmat and self.subgroup in (32, 64))
        g = heads_per_group(n_head, n_head_kv)
        if v is None or not hw or g & (g - 1) or not self.prefill_cm_head_ok(head_dim):
            return None
        sub = emu or self.subgroup
        got = prefill_cm3_choose(head_dim, v, self.kernels.device.limits.max_shared_memory, sub, bool(emu),
                                 rows or self.prefill_rows_cm, self.prefill_cm2_keys)
        return None if got is None else (sub, *got)
        qsh = v.rb * head_dim > 128
        limit = self.kernels.device.limits.max_shared_memory
        forced = v.keys or self.prefill_cm2_keys
        prefer = prefill_cm3_prefer(head_dim)
        for keys in [forced] if forced else [k for k in PREFILL_CM2_KEYS if k <= prefer]:
            if prefill_cm3_shared(head_dim, rows, keys, v, qsh, sub, bool(emu)) <= limit:
                return sub, keys, rows, qsh
        return None

    def prefill_nv2_plan(self, n_head: int, n_head_kv: int, head_dim: int, k_type: str = "f16",
                         v_type: str = "f16") -> Nv2AttnPlan | None:
        """attn_prefill_nv2.comp's plan (``Nv2AttnPlan``) for this shape and cache, or None
        where it does not run: not enabled (``prefill_nv2`` with ``coopmat`` on a device
        with ``nv_coopmat2``), an explicit other kernel asked for (a
        ``prefill_cm2_variant``, an emulated one), a head group that is not a power of
        two, a head_dim not in ``PREFILL_NV2_HEADS``, more lanes than the device's
        workgroup-scope matrices take (``nv_coopmat2_max_wg``), or more shared memory
        (``prefill_nv2_shared``) than its reported limit. The tile is
        ``prefill_nv2_tile``, else ``prefill_nv2_default``'s; the form
        ``prefill_nv2_form`` ("direct" only for f16 K and V; "pf" otherwise)."""
        dev = self.kernels.device
        if not (self.prefill_nv2 and self.coopmat and dev.nv_coopmat2):
            return None
        if self.prefill_cm2_variant is not None or self.prefill_cm2_emulate or self.prefill_cm_emulate:
            return None
        g = heads_per_group(n_head, n_head_kv)
        if g & (g - 1) or head_dim not in PREFILL_NV2_HEADS:
            return None
        rows, keys, lanes = self.prefill_nv2_tile or prefill_nv2_default(head_dim)
        if rows % g or lanes > dev.nv_coopmat2_max_wg or lanes % 32:
            return None
        form, _, extra = self.prefill_nv2_form.partition("+")
        direct = form == "direct" and k_type == "f16" and v_type == "f16"
        if prefill_nv2_shared(head_dim, rows, keys, direct) > dev.limits.max_shared_memory:
            return None
        if not _nv2_attn_ready(_kv(k_type).code, _kv(v_type).code, direct):
            return None  # neither prebuilt nor a compiler here (mixed K / V types without slangpy)
        return Nv2AttnPlan(rows, keys, lanes, pf=form != "staged", direct=direct, mma_sum=extra == "mma",
                           lazy_sum=extra == "lsum")

    def prefill_cm2_ok(self, n_head: int, n_head_kv: int, head_dim: int) -> bool:
        """Whether ``attention_prefill`` takes attn_prefill_cm2.comp (``prefill_cm2_plan``)."""
        return self.prefill_cm2_plan(n_head, n_head_kv, head_dim) is not None

    def attention_prefill(
        self, q: View, k_cache: View, v_cache: View, o: View, step: View, *, n_head: int,
        n_head_kv: int, head_dim: int, n_ctx: int, q_stride: int, o_stride: int, cap: int,
        scale: float | None = None, k_type: str = "f32", v_type: str = "f32", n_swa: int = 0,
        emulate_cm: tuple[int, int] | None = None, part: View | None = None, n_split: int = 1,
        min_tiles: int = 8, v_dim: int = 0, noncausal: bool = False, symmetric: bool = False,
    ) -> Dispatch:
        """``attention`` for many tokens (prefill, attn_prefill.comp): a work group per
        tile of consecutive tokens and group of query heads of one KV head
        (``prefill_tile``), key tiles staged once for all of its rows, online softmax,
        masked tiles skipped and fully visible ones run without the mask. Same
        arguments and results as ``attention``; on cooperative matrices
        (attn_prefill_cm.comp: f16 Q, K, P and V, f32 scores and sums) where
        ``prefill_cm_ok``. ``emulate_cm`` = (heads, tokens) is for tests: the
        cooperative-matrix kernel with its two products done by plain lanes (CM_EMULATE),
        on that tile, so that a device without them checks the rest of it (with
        ``prefill_cm2_emulate`` set: attn_prefill_cm2.comp's emulated form on it).
        attn_prefill_cm2.comp takes the place of attn_prefill_cm.comp where
        ``prefill_cm2_plan`` allows (same arguments, grid, partials and results), and
        attn_prefill_nv2.comp (NVIDIA's cooperative_matrix2) the place of all of them
        where ``prefill_nv2_plan`` allows (likewise).

        ``n_split`` > 1 (``prefill_splits``) splits
        each query tile's keys over that many work groups (at least ``min_tiles`` tiles
        of 32 each), which write partials to ``part`` (``attention_part_floats(cap,
        n_head, head_dim, n_split)`` floats) for ``attention_combine`` to add up into
        ``o`` after a barrier.

        ``v_dim`` > 0: a latent cache (MLA, ``v_is_k``; ``prefill_latent_tile``): the
        values are the first ``v_dim`` of each K row (``v_cache`` is ``k_cache``, one
        type), K rows of up to 576; attn_prefill.comp's LATENT form on every device (the
        cooperative-matrix kernels take head dims up to 256), on the tile
        ``prefill_latent_tile`` chooses; only those ``v_dim`` dims of each output head
        (and of each partial) are written.

        ``noncausal``: each token sees up to the step's ``STEP_VIS`` of it instead of its
        own position (a step with a non-causal entry): attn_prefill.comp's NONCAUSAL form,
        unsplit, on every device (the cooperative-matrix kernels stay causal). With
        ``symmetric`` (its SYMMETRIC form) the window also hides keys ``n_swa`` or more
        positions after a row (gemma-embedding's symmetric window)."""
        if noncausal:
            assert not v_dim and emulate_cm is None and n_split == 1 and self.prefill_ok(head_dim)
            kt, vt = _kv(k_type), _kv(v_type)
            _check_head(kt, head_dim, "K")
            _check_head(vt, head_dim, "V")
            g, bq = self.prefill_scalar_tile(n_head, n_head_kv, head_dim)
            s = 1.0 / math.sqrt(head_dim) if scale is None else scale
            nk = self.kernels.get("attn_prefill", n_bindings=6, n_push=12, local_size=128,
                                  defines={**kv_defines(K_TYPE=kt, V_TYPE=vt), "NONCAUSAL": 1,
                                           **({"SYMMETRIC": 1} if symmetric else {})},
                                  spec={1: g, 2: bq, 3: head_dim})
            push = (n_head, n_head_kv, head_dim, n_ctx, n_head_kv * head_dim, q_stride, o_stride, float(s), n_swa)
            return Dispatch(nk, (q, k_cache, v_cache, o, step, o), (*push, 1, min_tiles, 0),
                            (math.ceil(cap / bq), n_head // g, 1))
        latent = self.prefill_latent_tile(n_head, n_head_kv, head_dim, v_dim) if v_dim else None
        if v_dim:
            assert latent is not None and emulate_cm is None
            assert v_cache == k_cache and v_type == k_type
        else:  # the cooperative-matrix kernels up to PREFILL_CM_MAX_HEAD, the scalar one to 512
            assert head_dim <= ATTN_MAX_HEAD and (emulate_cm is None or self.prefill_cm_head_ok(head_dim))
        assert head_dim % 16 == 0 and n_head % n_head_kv == 0
        kt, vt = _kv(k_type), _kv(v_type)
        _check_head(kt, head_dim, "K")
        _check_head(vt, head_dim, "V")
        s = 1.0 / math.sqrt(head_dim) if scale is None else scale
        push = (n_head, n_head_kv, head_dim, n_ctx, n_head_kv * head_dim, q_stride, o_stride, float(s), n_swa)
        ml_off = cap * n_head * n_split * head_dim
        assert n_split == 1 or (part is not None
                                and part.size >= 4 * attention_part_floats(cap, n_head, head_dim, n_split))
        if latent is not None:
            g, bq = latent
            lk = self.kernels.get("attn_prefill", n_bindings=6, n_push=12, local_size=128,
                                  defines={**kv_defines(K_TYPE=kt, V_TYPE=vt), "LATENT": 1},
                                  spec={1: g, 2: bq, 3: head_dim, 4: v_dim})
            return Dispatch(lk, (q, k_cache, v_cache, o, step, o if part is None else part),
                            (*push, n_split, min_tiles, ml_off), (math.ceil(cap / bq), n_head // g, n_split))
        nv2 = self.prefill_nv2_plan(n_head, n_head_kv, head_dim, kt.name, vt.name) if emulate_cm is None else None
        if nv2 is not None:
            g = heads_per_group(n_head, n_head_kv)
            k = self._nv2_kernel("attn_prefill_nv2", "the KHR kernels", n_bindings=6, n_push=12,
                                 local_size=nv2.lanes, defines=nv2_attn_defines(kt.code, vt.code, nv2.direct),
                                 spec={1: g, 2: nv2.rows // g, 3: head_dim, 5: nv2.keys, 6: int(nv2.pf),
                                       7: nv2.rsum_mode})
            if k is not None:
                return Dispatch(k, (q, k_cache, v_cache, o, step, o if part is None else part),
                                (*push, n_split, min_tiles, ml_off),
                                (math.ceil(cap / (nv2.rows // g)), n_head // g, n_split))
        v3 = self.prefill_cm2_variant
        if v3 is not None and (emulate_cm is None or self.prefill_cm2_emulate):
            plan3 = self.prefill_cm3_plan(n_head, n_head_kv, head_dim,
                                          rows=emulate_cm[0] * emulate_cm[1] if emulate_cm else 0)
            if plan3 is not None:
                sub, keys, rows, qsh = plan3
                if emulate_cm is not None:
                    g, bq = emulate_cm
                    assert (n_head // n_head_kv) % g == 0
                else:
                    g, bq = prefill_tile(n_head, n_head_kv, head_dim, coopmat=True, rows=rows)
                k = self.kernels.get("attn_prefill_cm3", n_bindings=6, n_push=12,
                                     local_size=g * bq // (16 * v3.rb) * sub,
                                     defines=attn_cm3_defines(kt.code, vt.code, sub, v3, qsh,
                                                              bool(self.prefill_cm2_emulate)),
                                     spec={1: g, 2: bq, 3: head_dim, 5: keys})
                return Dispatch(k, (q, k_cache, v_cache, o, step, o if part is None else part),
                                (*push, n_split, min_tiles, ml_off), (math.ceil(cap / bq), n_head // g, n_split))
        if emulate_cm is None or self.prefill_cm2_emulate:
            plan = self.prefill_cm2_plan(n_head, n_head_kv, head_dim,
                                         rows=emulate_cm[0] * emulate_cm[1] if emulate_cm else 0)
            assert plan is not None or emulate_cm is None, "attn_prefill_cm2 cannot take this emulated tile"
            if plan is not None:
                sub, keys = plan
                if emulate_cm is not None:
                    g, bq = emulate_cm
                    assert (n_head // n_head_kv) % g == 0
                else:
                    g, bq = prefill_tile(n_head, n_head_kv, head_dim, coopmat=True, rows=self.prefill_rows_cm)
                k = self.kernels.get("attn_prefill_cm2", n_bindings=6, n_push=12, local_size=g * bq // 16 * sub,
                                     defines={**kv_defines(K_TYPE=kt, V_TYPE=vt),
                                              **({"CM_EMULATE": 1} if self.prefill_cm2_emulate else {})},
                                     spec={1: g, 2: bq, 3: head_dim, 4: sub, 5: keys})
                return Dispatch(k, (q, k_cache, v_cache, o, step, o if part is None else part),
                                (*push, n_split, min_tiles, ml_off), (math.ceil(cap / bq), n_head // g, n_split))
        cm = self.prefill_cm_ok(n_head, n_head_kv, head_dim)
        g, bq = (prefill_tile(n_head, n_head_kv, head_dim, coopmat=True, rows=self.prefill_rows_cm) if cm
                 else self.prefill_scalar_tile(n_head, n_head_kv, head_dim))
        if cm and self.prefill_cm_emulate and emulate_cm is None:
            emulate_cm = (g, bq)
        if emulate_cm is not None or cm:
            if emulate_cm is not None:
                g, bq = emulate_cm
                assert (g * bq) % 16 == 0 and 128 % (g * bq) == 0 and (n_head // n_head_kv) % g == 0
                defines: dict[str, object] = {"CM_EMULATE": 1}
                sub = 32
            else:
                defines = {"CM_STAGE": 1} if self.prefill_cm_stage else {}
                sub = self.subgroup
            k = self.kernels.get("attn_prefill_cm", n_bindings=6, n_push=12, local_size=128,
                                 defines={**kv_defines(K_TYPE=kt, V_TYPE=vt), **defines},
                                 spec={1: g, 2: bq, 3: head_dim, 4: sub})
            return Dispatch(k, (q, k_cache, v_cache, o, step, o if part is None else part),
                            (*push, n_split, min_tiles, ml_off), (math.ceil(cap / bq), n_head // g, n_split))
        k = self.kernels.get("attn_prefill", n_bindings=6, n_push=12, local_size=128,
                             defines=kv_defines(K_TYPE=kt, V_TYPE=vt), spec={1: g, 2: bq, 3: head_dim})
        return Dispatch(k, (q, k_cache, v_cache, o, step, o if part is None else part),
                        (*push, n_split, min_tiles, ml_off), (math.ceil(cap / bq), n_head // g, n_split))

    def prefill_splits(self, n_ctx: int, n_head: int, n_head_kv: int, head_dim: int, window: int = 0,
                       bucket: int = STEP_CAP) -> int:
        """How many work groups share a query tile's keys in ``attention_prefill``: 1
        for sliding windows (few keys per tile), else one per 8k positions of context
        up to ``prefill_split_most`` (fixed at record time; a shallow step uses fewer,
        the kernel's ``min_tiles``), and no more than a bucket of ``bucket`` tokens
        needs to give as many work groups as ``SPLIT_TOKENS`` tokens unsplit: the split
        was tuned on 512-token chunks (4 at 32k), and a larger physical batch (-ub) has
        the query tiles to fill the device by itself."""
        if window or not self.prefill_ok(head_dim):
            return 1
        return max(1, min(self.prefill_split_most, n_ctx // 8192, SPLIT_TOKENS // max(1, bucket)))

    def prefill_part_floats(self, n_ctx: int, n_head: int, n_head_kv: int, head_dim: int, cap: int) -> int:
        """float32 values of the partials the prefill buckets up to ``cap`` tokens need
        (the largest bucket x its splits; 0 when none splits)."""
        most = 0
        b = 16
        while b <= cap:
            if (n := self.prefill_splits(n_ctx, n_head, n_head_kv, head_dim, bucket=b)) > 1:
                most = max(most, attention_part_floats(b, n_head, head_dim, n))
            b *= 2
        return most

    def attention_combine(
        self, part: View, o: View, step: View, *, n_head: int, head_dim: int, n_split: int, o_stride: int,
        cap: int,
    ) -> Dispatch:
        """o of every live (token, head) from the ``n_split`` partials a split
        ``attention_prefill`` wrote (attn_combine.comp)."""
        k = self.kernels.get("attn_combine", n_bindings=3, n_push=5, local_size=64)
        ml_off = cap * n_head * n_split * head_dim
        return Dispatch(k, (part, o, step), (n_head, head_dim, n_split, o_stride, ml_off), (n_head, cap, 1))

    def swiglu(
        self, g: View, u: View, y: View, step: View, *, n: int, stride: int, cap: int,
        count_sel: int = COUNT_TOKENS,
    ) -> Dispatch:
        return self.glu(g, u, y, step, n=n, stride=stride, cap=cap, count_sel=count_sel)

    def hadamard(
        self, x: View, y: View, step: View, *, width: int, stride: int, block: int, cap: int,
        count_sel: int = COUNT_TOKENS,
    ) -> Dispatch:
        """y = x rotated by the normalised Walsh-Hadamard matrix in blocks of ``block``
        (a power of two up to 512, two values per lane) along each live row
        (hadamard.comp)."""
        assert block & (block - 1) == 0 and 2 <= block <= 512 and width % block == 0
        k = self.kernels.get("hadamard", n_bindings=3, n_push=4, local_size=256)
        return Dispatch(k, (x, y, step), (width, stride, block, count_sel), (width // block, cap, 1))

    def scale(
        self, x: View, y: View, step: View, *, n: int, stride: int, cap: int, scale: float,
        count_sel: int = COUNT_TOKENS, softcap: bool = False,
    ) -> Dispatch:
        """y = x * scale over the live rows; ``softcap``: y = scale * tanh(x / scale)."""
        k = self.kernels.get("scale", n_bindings=3, n_push=4, local_size=self.elem_wg,
                             defines={"SOFTCAP": 1} if softcap else None)
        return Dispatch(k, (x, y, step), (n, stride, count_sel, float(scale)), (math.ceil(n / self.elem_wg), cap, 1))

    def add(
        self, a: View, b: View, y: View, step: View, *, n: int, stride: int, cap: int,
        bcast: bool = False, count_sel: int = COUNT_TOKENS,
    ) -> Dispatch:
        k = self.kernels.get("add", n_bindings=4, n_push=4, local_size=self.elem_wg)
        return Dispatch(k, (a, b, y, step), (n, stride, int(bcast), count_sel), (math.ceil(n / self.elem_wg), cap, 1))

    def argmax(
        self, x: View, r: View, step: View, *, n: int, stride: int, cap: int, count_sel: int = COUNT_OUT,
    ) -> Dispatch:
        k = self.kernels.get("argmax", n_bindings=3, n_push=3, local_size=self.norm_wg)
        return Dispatch(k, (x, r, step), (n, stride, count_sel), grid(cap))

    def sample(
        self, x: View, params: View, ids: View, step: View, *, n: int, stride: int, j: int, rows_cap: int,
        feed: bool, cap: int,
    ) -> Dispatch:
        """One token per live output row by the device chain (sample.comp): ids[j, row];
        with ``feed`` the id becomes the row's next input token at the next position."""
        k = self.kernels.get("sample", n_bindings=4, n_push=5, local_size=256)
        return Dispatch(k, (x, params, ids, step), (n, stride, j, rows_cap, int(feed)), grid(cap))

    def transpose(self, src: View, dst: View, *, rows: int, cols: int) -> Dispatch:
        k = self.kernels.get("transpose", n_bindings=2, n_push=2, local_size=256)
        return Dispatch(k, (src, dst), (rows, cols), (math.ceil(cols / 32), math.ceil(rows / 32), 1))

    # -- mixture of experts ------------------------------------------------------------

    def moe_topk(
        self, logits: View, routes: View, step: View, *, n_expert: int, k: int, x_stride: int,
        y_stride: int, cap: int, norm: bool, scale: float, sigmoid: bool = False, bias: View | None = None,
    ) -> Dispatch:
        """Each live token's routing row (k expert ids, then k weights) from its router
        logits: softmax (or ``sigmoid``), top-k (by the probabilities plus ``bias``
        [n_expert] when given), renormalised (``norm``), times ``scale``."""
        assert n_expert <= 512 and k <= 64 and (bias is None or sigmoid)
        defines: dict[str, object] = {"SIGMOID": 1} if sigmoid else {}
        views: tuple[View, ...] = (logits, routes, step)
        if bias is not None:
            defines["BIAS"] = 1
            views += (bias,)
        kern = self.kernels.get("moe_topk", n_bindings=len(views), n_push=6, local_size=self.norm_wg,
                                defines=defines)
        push = (n_expert, k, x_stride, y_stride, int(norm), float(scale))
        return Dispatch(kern, views, push, grid(cap))

    def moe_matvec(
        self, qtype: str, w: View, x: View, y: View, step: View, routes: View, *, n_in: int, n_rows: int,
        x_stride: int, x_pair: int, y_stride: int, k: int, cap: int, up: View | None = None,
        combine: tuple[View | None, tuple[View, View, View, int] | None] | None = None, r_stride: int | None = None,
    ) -> Dispatch:
        """y[c, j, :] = W[id(c, j)] . x[c] (``x_pair`` 0) or . x[c, j] for the live tokens
        c and their k chosen experts j; ``w`` is the whole 3-D expert tensor. With ``up``
        (laid out as x) the input is silu(x) * up, made as it is loaded (GLU_IN: the
        experts' SwiGLU before their down product). With ``combine`` = (res, shexp) a
        work group per token sums its experts' rows with their routing weights into
        y[c, :] and adds what ``moe_combine`` would (the gated shared expert (xs, h, g,
        n_in), the residual res; either may be None): COMBINE."""
        assert n_in % 8 == 0 and x_stride % 4 == 0 and x_pair % 4 == 0
        nr, rs = self.matvec_rows, self.matvec_rs
        defines = dict(qtype_defines(qtype))
        views: tuple[View, ...] = (w, x, y, step, routes)
        # r_stride 0: one routing row for every token (head_linear's fixed heads)
        push: tuple[int, ...] = (n_in, n_rows, x_stride, x_pair, y_stride, k, 2 * k if r_stride is None else r_stride)
        if up is not None:
            defines["GLU_IN"] = 1
            views += (up,)
        pairs = cap * k
        if combine is not None:
            res, shexp = combine
            defines["COMBINE"] = 1
            pairs = cap
            if res is not None:
                defines["RESID"] = 1
                views += (res,)
            if shexp is not None:
                defines["SHEXP"] = 1
                views += shexp[:3]
                push += (shexp[3],)
        kern = self.kernels.get(
            "moe_matvec", n_bindings=len(views), n_push=len(push), local_size=nr * self.subgroup,
            defines=defines, spec={2: nr, 3: rs},
        )
        return Dispatch(kern, views, push, (math.ceil(n_rows / (nr * rs)), 1, pairs))

    def moe_group(
        self, routes: View, moe_map: View, step: View, *, n_expert: int, k: int, cap: int,
    ) -> Dispatch:
        """The chunk's (token, expert) pairs grouped by expert into ``moe_map``
        (``moe_map_words(n_expert, k, cap)`` uint32): per-expert counts, their scan,
        the tile table and the permutation (moe_group.comp), all on the device, for
        the ``moe_matmul`` dispatches that follow it (after a barrier)."""
        assert n_expert <= 512 and cap * k < 65536
        kern = self.kernels.get("moe_group", n_bindings=3, n_push=4, local_size=256)
        assert moe_map.size >= 4 * moe_map_words(n_expert, k, cap)
        return Dispatch(kern, (routes, moe_map, step), (n_expert, k, 2 * k, moe_tiles_off(k, cap)), (1, 1, 1))

    def moe_matmul(
        self, qtype: str, w: View, x: View, y: View, step: View, moe_map: View, *, n_in: int, n_rows: int,
        x_stride: int, x_pair: int, y_stride: int, k: int, n_expert: int, cap: int, emulate_cm: bool = False,
    ) -> Dispatch:
        """``moe_matvec``'s products for a prefill chunk, tiled per expert over the
        pairs ``moe_group`` gave it (moe_matmul.comp): each expert's weight tile is read
        once per 32 of its tokens. Same arguments and result as ``moe_matvec``, with the
        map in place of the routing. On cooperative matrices (moe_matmul_cm.comp, f16
        tiles, f32 accumulators) where ``moe_cm_ok``; ``emulate_cm`` (tests) runs that
        kernel with its products done by plain lanes."""
        assert n_in % 32 == 0 and x_stride % 4 == 0 and x_pair % 4 == 0
        if emulate_cm or self.moe_cm_emulate:
            kern = self.kernels.get("moe_matmul_cm", n_bindings=5, n_push=7, local_size=256,
                                    defines={**qtype_defines(qtype), "CM_EMULATE": 1})
        elif self.moe_cm_ok():
            kern = self.kernels.get("moe_matmul_cm", n_bindings=5, n_push=7, local_size=256,
                                    defines=moe_coopmat_defines(qtype, self.subgroup))
        else:
            kern = self.kernels.get("moe_matmul", n_bindings=5, n_push=7, local_size=256,
                                    defines=qtype_defines(qtype))
        push = (n_in, n_rows, x_stride, x_pair, y_stride, k, moe_tiles_off(k, cap))
        return Dispatch(kern, (w, x, y, step, moe_map), push,
                        (math.ceil(n_rows / MOE_BM), moe_max_tiles(n_expert, k, cap), 1))

    def moe_cm_ok(self) -> bool:
        """Whether ``moe_matmul`` takes its cooperative-matrix form: enabled
        (``moe_cm``), the device has them (``coopmat``), subgroups of 32 or 64."""
        return self.moe_cm and self.coopmat and self.subgroup in (32, 64)

    def moe_combine(
        self, x: View, routes: View, y: View, step: View, *, n: int, k: int, y_stride: int, cap: int,
        res: View | None = None, shexp: tuple[View, View, View, int] | None = None,
    ) -> Dispatch:
        """y[c] = sum_j weight(c, j) x[c, j] over the live tokens; with ``shexp`` = (xs,
        h, g, n_in) plus xs[c] * sigmoid(h[c] . g) (the gated shared expert), with
        ``res`` that added to res[c] (the residual stream; y may be its buffer)."""
        defines: dict[str, object] = {}
        views: tuple[View, ...] = (x, routes, y, step)
        push: tuple[int, ...] = (n, k, k * n, 2 * k, y_stride)
        if res is not None:
            defines["RESID"] = 1
            views += (res,)
        wg = self.elem_wg
        if shexp is not None:
            defines["SHEXP"] = 1
            views += shexp[:3]
            push += (shexp[3],)
            wg = self.norm_wg  # gate_rows' work group: its dot product, summed in its order
        kern = self.kernels.get("moe_combine", n_bindings=len(views), n_push=len(push), local_size=wg,
                                defines=defines or None)
        return Dispatch(kern, views, push, (math.ceil(n / wg), cap, 1))

    # -- gated delta-net (qwen35) -----------------------------------------------------

    def take(
        self, x: View, y: View, step: View, *, group: int, start: int, n: int, n_out: int, x_stride: int,
        y_stride: int, cap: int,
    ) -> Dispatch:
        """y[t, g * n + i] = x[t, g * group + start + i] over the live rows."""
        kern = self.kernels.get("take", n_bindings=3, n_push=6, local_size=self.elem_wg)
        push = (group, start, n, n_out, x_stride, y_stride)
        return Dispatch(kern, (x, y, step), push, (math.ceil(n_out / self.elem_wg), cap, 1))

    def concat(self, a: View, b: View, y: View, step: View, *, na: int, nb: int, n_out: int, a_stride: int,
               b_stride: int, y_stride: int, cap: int) -> Dispatch:
        """y[t, g * (na + nb) + i] = a[t, g * na + i] (i < na), else b[t, g * nb + i - na]."""
        kern = self.kernels.get("concat", n_bindings=4, n_push=6, local_size=self.elem_wg)
        push = (na, nb, n_out, a_stride, b_stride, y_stride)
        return Dispatch(kern, (a, b, y, step), push, (math.ceil(n_out / self.elem_wg), cap, 1))

    def l2_norm(self, x: View, y: View, step: View, *, n: int, rows_per_tok: int, eps: float, cap: int) -> Dispatch:
        """Every n values of each live row divided by their norm (at least eps)."""
        kern = self.kernels.get("l2_norm", n_bindings=3, n_push=3, local_size=self.norm_wg)
        return Dispatch(kern, (x, y, step), (n, rows_per_tok, float(eps)), grid(cap * rows_per_tok))

    def gate_rows(self, x: View, h: View, w: View, y: View, step: View, *, n: int, n_in: int, cap: int) -> Dispatch:
        """y[t] = x[t] * sigmoid(h[t] . w) over the live rows."""
        kern = self.kernels.get("gate_rows", n_bindings=5, n_push=2, local_size=self.norm_wg)
        return Dispatch(kern, (x, h, w, y, step), (n, n_in), grid(cap))

    def rope_partial(
        self, x: View, step: View, *, n_heads: int, head_dim: int, n_rot: int, x_stride: int, theta: float,
        cap: int,
    ) -> Dispatch:
        """In place: the first n_rot values of each head rotated (half-split pairs)."""
        kern = self.kernels.get("rope_partial", n_bindings=2, n_push=5, local_size=self.elem_wg)
        push = (n_heads, head_dim, n_rot, x_stride, float(math.log2(theta)))
        return Dispatch(kern, (x, step), push, (math.ceil(n_heads * n_rot // 2 / self.elem_wg), cap, 1))

    def ssm_conv(
        self, x: View, w: View, y: View, state: View, step: View, *, c: int, k: int, cap: int, phase: int,
    ) -> Dispatch:
        """Phase 0: y = silu(causal conv of x over the sequence, with its conv state);
        phase 1 (after a barrier): the state moved on to each sequence's last k - 1 inputs."""
        kern = self.kernels.get("ssm_conv", n_bindings=5, n_push=2, local_size=self.elem_wg,
                                defines={"PHASE": phase})
        return Dispatch(kern, (x, w, y, state, step), (c, k), (math.ceil(c / self.elem_wg), cap, 1))

    def ssm_conv_split(
        self, x: View, w: View, y0: View, y1: View, y2: View, state: View, step: View, *, c: int, k: int,
        d: int, e1: int, e2: int, norm: int, eps: float, cap: int,
    ) -> Dispatch:
        """``ssm_conv``'s phase 0 with its output split into the column ranges [0, e1),
        [e1, e2), [e2, c) written to ``y0``, ``y1``, ``y2``, the heads of ``d`` values of
        range p L2-normalised where bit p of ``norm`` is set (qwen35's q and k): the
        chain conv -> take -> l2_norm in one dispatch (ssm_conv_split.comp). The state
        still moves on in ``ssm_conv`` phase 1."""
        assert c % d == 0 and e1 % d == 0 and e2 % d == 0 and 0 < e1 < e2 < c
        wg = self.norm_wg  # l2_norm's work group: the same sums in the same order
        kern = self.kernels.get("ssm_conv_split", n_bindings=7, n_push=7, local_size=wg,
                                spec={1: math.ceil(d / wg)})
        return Dispatch(kern, (x, w, y0, y1, y2, state, step), (c, k, d, e1, e2, norm, float(eps)),
                        (c // d, cap, 1))

    def delta_net(
        self, q: View, k: View, v: View, alpha: View, beta: View, dt: View, a: View, o: View, state: View,
        step: View, *, n_k: int, n_v: int, d: int, cap: int, gate: tuple[View, View, float] | None = None,
        conv: tuple[int, int, float] | None = None, k_grouped: bool = False,
    ) -> Dispatch:
        """The gated delta rule over each sequence's run of tokens (``Graph.delta_net``).
        ``gate`` = (z, w, eps): each output head then RMS-normed with the weight ``w``
        [d] and multiplied by silu(z) (z laid out as o): qwen35's ``rms_norm`` and
        ``glu`` after the rule, done by the same work group (GATED_NORM). ``conv`` =
        (C, d_conv, eps): q, k and v are then the conv's input qkv [T, C], its weight
        and its state, and the rule makes its q, k, v channels as ``ssm_conv`` phase 0
        and the L2 norms of q and k would (CONV; the state moves on in phase 1). With
        ``delta_split`` (DP) each form runs split-lane: DP * d lanes per head.
        ``k_grouped``: v head h reads k head h / (n_v / n_k) (qwen3next's grouped
        heads), not ggml's tiled h % n_k (specialization constant KH_DIV)."""
        defines: dict[str, object] = {}
        push: tuple[int | float, ...] = (n_k, n_v)
        views: tuple[View, ...] = (q, k, v, alpha, beta, dt, a, o, state, step)
        if gate is not None:
            defines["GATED_NORM"] = 1
            views += gate[:2]
            push += (float(gate[2]),)
        if conv is not None:
            defines["CONV"] = 1
            push += (conv[0], conv[1], float(conv[2]))
        lanes = d
        dp = self.delta_split
        misfit = self._delta_split_misfit(dp, d, state) if dp else None
        if misfit is not None:
            # the default where the split-lane form does not fit: the plain form; set by hand, it must
            assert self.delta_split_auto, misfit
            dp = 0
        if dp:
            defines["DU"], defines["DP"] = d, dp  # delta_net.comp's split-lane form
            lanes = dp * d
        # the norms' sums as rms_norm.comp and l2_norm.comp make them with norm_wg lanes
        spec = {1: min(self.norm_wg, d)} if defines.keys() - {"DU", "DP"} else {}
        if k_grouped:
            spec[9] = n_v // n_k
        kern = self.kernels.get("delta_net", n_bindings=len(views), n_push=len(push), local_size=lanes,
                                defines=defines or None, spec=spec or None)
        return Dispatch(kern, views, push, (n_v, cap, 1))

    def _delta_split_misfit(self, dp: int, d: int, state: View) -> str | None:
        """Why delta_net.comp's split-lane form cannot run here, or None: a column's DP
        lanes in one subgroup (its shuffles); its d / DP values as vec4s (the state read
        as vec4s: 16-byte aligned); DP * d lanes within the 1024 invocations NVIDIA and
        lavapipe allow a work group."""
        if not self.kernels.device.limits.has_subgroup(SUBGROUP_SHUFFLE):
            return "delta_split needs subgroup shuffles"
        if self.subgroup % dp:
            return f"delta_split {dp} does not divide the subgroup ({self.subgroup})"
        if d % (4 * dp) or dp * d > 1024:
            return f"delta_split {dp} with head dim {d}"
        if state.offset % 16:
            return f"delta_split: state offset {state.offset} is not 16-byte aligned"
        return None

    def delta_prep(
        self, q: View, k: View, alpha: View, beta: View, dt: View, a: View, tm: View, pm: View, gc: View,
        step: View, *, n_k: int, n_v: int, d: int, cap: int, runs: int, k_grouped: bool = False,
    ) -> Dispatch:
        """The chunked prefill form's state-free part, every chunk at once: the chunks'
        cumulative log decays, their triangular solves and in-chunk attention
        (``delta_prep.comp``; ``tm``/``pm`` [cap, n_v, DELTA_CHUNK], ``gc`` [cap, n_v]).
        ``runs``: the most sequences in a step; with ``cap`` tokens they make at most
        cap / DELTA_CHUNK + 2 runs + 1 chunks (a run's chunks end at multiples of the chunk)."""
        kern = self.kernels.get("delta_prep", n_bindings=10, n_push=3, local_size=DELTA_CHUNK,
                                spec={9: n_v // n_k} if k_grouped else None)
        chunks = min(cap, cap // DELTA_CHUNK + 2 * runs + 1)
        return Dispatch(kern, (q, k, alpha, beta, dt, a, tm, pm, gc, step), (n_k, n_v, d), (n_v, chunks, 1))

    def delta_chunk(
        self, q: View, k: View, v: View, beta: View, tm: View, pm: View, gc: View, o: View, state: View,
        step: View, *, n_k: int, n_v: int, d: int, cap: int, runs: int, k_grouped: bool = False,
    ) -> Dispatch:
        """The chunked prefill form's walk over each run's chunks with the state
        (``delta_chunk.comp``): a work group per (v head, ``cols`` state columns, run)."""
        cols = delta_cols(d)
        kern = self.kernels.get("delta_chunk", n_bindings=10, n_push=2, local_size=DELTA_LANES,
                                spec={1: d, 2: cols, **({9: n_v // n_k} if k_grouped else {})})
        return Dispatch(kern, (q, k, v, beta, tm, pm, gc, o, state, step), (n_k, n_v),
                        (n_v * (d // cols), min(cap, runs), 1))


#: rows and pairs of a moe_matmul tile (BM, BN in moe_matmul.comp and moe_group.comp)
MOE_BM = 64
MOE_BN = 32
#: words before the permutation in the map (its first holds the live tile count)
MOE_PERM_OFF = 4


def _norm_in(norm: View | None, eps: float) -> tuple[dict[str, object], tuple[View, ...], tuple[float, ...]]:
    """The NORM_IN part of a matvec variant: (defines, the extra binding, the extra push
    word), all empty without a norm. y = (W . (g * x)) / sqrt(mean(x^2) + eps), which
    is rms_norm.comp's x / sqrt(mean(x^2) + eps) * g then the product, up to rounding."""
    if norm is None:
        return {}, (), ()
    return dict(NORM_IN), (norm,), (float(eps),)


def moe_max_tiles(n_expert: int, k: int, cap: int) -> int:
    """The most tiles of ``MOE_BN`` pairs ``cap`` tokens' ``cap * k`` pairs can make:
    one expert has at most ``cap`` of them (a token picks it once), and the tiles of
    all experts add up to at most one partial tile per expert used beyond the full ones."""
    pairs = cap * k
    return min(n_expert * math.ceil(cap / MOE_BN), math.ceil(pairs / MOE_BN) + min(n_expert, pairs))


def moe_tiles_off(k: int, cap: int) -> int:
    return MOE_PERM_OFF + cap * k


def moe_map_words(n_expert: int, k: int, cap: int) -> int:
    """uint32 words of ``moe_group``'s map: the header, the permutation, the tiles."""
    return moe_tiles_off(k, cap) + 2 * moe_max_tiles(n_expert, k, cap)


#: tokens per chunk of the delta rule's prefill form (``DC`` in delta_prep/delta_chunk.comp)
DELTA_CHUNK = 64
#: lanes of a delta_chunk work group
DELTA_LANES = 128


def delta_cols(d: int) -> int:
    """State columns per delta_chunk work group: 16 (a head of 128 is 8 work groups),
    fewer for heads that 16 does not divide."""
    return math.gcd(d, 16)

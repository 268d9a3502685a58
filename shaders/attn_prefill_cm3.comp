#version 450
// attn_prefill_cm2.comp with the scores kept in accumulators: the same bindings, push
// constants, grid, masks, passes per sequence, key splits and cache reads, so
// Ops.attention_prefill runs either (TRIO_LLM_PREFILL_CM2_VARIANT picks this one).
// A work group of NSG subgroups owns R = 16 * RB * NSG query rows (row r: token r / G,
// head r % G), subgroup i rows [16 RB i, 16 RB (i + 1)), RB row blocks of 16 each, and
// walks key tiles of BC (16, 32 or 64) keys. Per key tile:
//   1. the K and V tiles go from registers (loaded during the previous tile) to shared
//      memory in f16, 8 bytes (an f16vec4) per store, the next tile's loads are issued; a
//      work-group barrier (with DB the tiles alternate between two buffers and this is
//      the only one per tile; without it a second barrier ends the tile);
//   2. each subgroup, alone: S = Q K^T for its rows into RB * BC / 16 accumulators (Q
//      kept in registers as RB * HD / 16 A fragments, or with QSH read from a shared Q
//      tile for every product: head dims whose fragments would not fit); the online
//      softmax on the accumulators' own elements: each element's row and column come
//      from the layout the kernel reads once at its start (an accumulator loaded from
//      a 16x16 block holding r * 16 + c), a row's max is taken over the elements of
//      this lane that share its row (element index xor masks) and then over the lanes
//      that hold it (lane xor masks, subgroup shuffles) - both sets of masks found at
//      the start too; P goes to the subgroup's own f16 slice by coopMatStore (the one
//      trip through shared memory KHR cooperative matrices need: an accumulator cannot
//      become an A operand) and back as A fragments; the output accumulators are
//      scaled element by element by their rows' rescales and P V is added. No S or
//      rescale block in shared memory, no row reduction through it.
// The running max and sum are kept per element (each element of a row holds the same
// max; the sums are partial, per column, reduced over the row once at the end); a
// row's rescale is one exp per row (the orbit's representative), broadcast in the lane.
// PREG: where the kernel finds that an f16 A fragment holds the same elements in the same
// order as an accumulator (read from a block at the start, like the layout), P goes to the
// A fragments by component copies, without the slice or its subgroup barriers.
// LR (lazy rescale, as FlashAttention-4): the max the weights are taken against moves
// only when some row of the subgroup's block grew by more than LR_T, so most tiles
// skip the output accumulators' rescale. The
// output is written from the accumulators' elements straight to o (or partial[]).
// A layout this scheme cannot reduce (a row's elements not closed under the found xor
// masks, or a component count other than 256 / SG) makes every output NaN, loudly,
// rather than wrong: the tests catch it on such a device.
//
// CM_EMULATE (tests only): the products by plain lanes into "accumulators" of EPL
// floats per lane, element e of lane l being element l + SG * e of the block (the
// layout the start reads from its block), subgroups of SG consecutive lanes, their
// shuffles and votes through shared memory with work-group barriers, so lavapipe
// checks everything else (the layout search, the element-wise softmax, masks,
// windows, passes, splits, tiles, buffers).
#ifndef CM_EMULATE
#extension GL_KHR_cooperative_matrix : require
#extension GL_KHR_memory_scope_semantics : require
#endif
#extension GL_EXT_shader_explicit_arithmetic_types_float16 : require
#extension GL_KHR_shader_subgroup_shuffle : require
#extension GL_KHR_shader_subgroup_vote : require
#include "common.glsl"

#ifndef K_TYPE
#define K_TYPE 0
#endif
#ifndef V_TYPE
#define V_TYPE 0
#endif
#ifndef SG
#define SG 32u  // subgroup size (32 or 64), a define: it sizes the per-lane arrays
#endif
#ifndef RB
#define RB 1u   // row blocks of 16 per subgroup (1 or 2)
#endif
#ifndef DB
#define DB 0
#endif
#ifndef QSH
#define QSH 0
#endif
#ifndef PREG
#define PREG 0  // P from the accumulators to A fragments in registers where the layouts agree
#endif
#ifndef LR
#define LR 0    // lazy rescale: the output accumulators rescaled only when a row's max grows by more than LR_T
#endif
const float LR_T = 8.0;
#define EPL (256u / SG)  // elements of a 16x16 block per lane

layout(binding = 0, std430) readonly buffer Q { float q[]; };
layout(binding = 1, std430) readonly buffer K { vec4 kc4[]; };
layout(binding = 1, std430) readonly buffer K2 { uvec2 kc2[]; };
layout(binding = 1, std430) readonly buffer K16 { uint16_t kc16[]; };
layout(binding = 2, std430) readonly buffer V { vec4 vc4[]; };
layout(binding = 2, std430) readonly buffer V2 { uvec2 vc2[]; };
layout(binding = 2, std430) readonly buffer V16 { uint16_t vc16[]; };
layout(binding = 3, std430) writeonly buffer O { float o[]; };
DECLARE_STEP(4)
// with n_split > 1: [cap, n_head, n_split, head_dim] unnormalised outputs, then
// [cap, n_head, n_split, 2] (m, l) from ml_off on (attn_combine.comp adds them up)
layout(binding = 5, std430) writeonly buffer P { float partial[]; };

layout(push_constant) uniform Push {
    uint n_head;
    uint n_head_kv;
    uint head_dim;  // = HD
    uint n_ctx;
    uint kv_dim;
    uint q_stride;
    uint o_stride;
    float scale;
    uint n_swa;      // sliding window (0: none)
    uint n_split;    // the grid's z: work groups sharing each tile of queries' keys
    uint min_tiles;  // fewest key tiles a split takes
    uint ml_off;     // where (m, l) start in partial[]
} pc;

layout(constant_id = 1) const uint G = 4;    // query heads per work group (of one KV head)
layout(constant_id = 2) const uint BQ = 16;  // tokens per work group
layout(constant_id = 3) const uint HD = 64;  // head_dim, a multiple of 16
layout(constant_id = 5) const uint BC = 32;  // keys per tile (16, 32 or 64)
const uint R = G * BQ;          // query rows, 16 * RB per subgroup
const uint NSG = WG / SG;       // subgroups
const uint KS4 = (HD + 8u) / 4u;  // K/V row stride in f16vec4 (rows 16-byte aligned, no bank conflicts)
const uint PS = BC + 8u;        // P row stride in f16
const uint QS = HD + 8u;        // Q row stride in f16 (QSH)
const uint NQ = HD / 16u;       // Q fragments, output blocks per row block
const uint NB = BC / 16u;       // S blocks, P fragments per row block
const uint TILE4 = BC * KS4;    // one K (or V) tile in f16vec4
const uint NL4 = BC * HD / 4u;  // loads of four values per K (or V) tile
const uint NLD = (NL4 + WG - 1u) / WG;  // ... per lane
const float MASKED = -1.0e30;
const float SEEN = -1.0e29;     // scores above this are visible ones

#include "kv.glsl"

#define KVR_T K_TYPE
#define KVR_W(i) uint(kc16[i])
#define KVR_F4(i) kc4[i]
#define KVR_U2(i) kc2[i]
#define KVR_LOAD4 k_load4
#include "kv_read.glsl"
#undef KVR_T
#undef KVR_W
#undef KVR_F4
#undef KVR_U2
#undef KVR_LOAD4
#define KVR_T V_TYPE
#define KVR_W(i) uint(vc16[i])
#define KVR_F4(i) vc4[i]
#define KVR_U2(i) vc2[i]
#define KVR_LOAD4 v_load4
#include "kv_read.glsl"

#if DB
#define NBUF 2u
#else
#define NBUF 1u
#endif
shared f16vec4 kvs[NBUF * 2u * TILE4];  // per buffer: the K tile [key][dim], then the V tile [key][dim]
shared float16_t ps[R * PS];          // P [row][key], the subgroups' slices; first Q, 16 dims at a time
#if QSH
shared float16_t qs[R * QS];          // Q [row][dim], scaled, f16
#endif
shared float lay[256];                // r * 16 + c: the accumulators' layout, read once
shared uint tpos[BQ];
shared uint tseq[BQ];
shared bool tdone[BQ];

#ifdef CM_EMULATE
#define SG_ID (gl_LocalInvocationID.x / SG)
#define SG_LANE (gl_LocalInvocationID.x % SG)
#define SG_SYNC() barrier()
#define UNROLL  // (lavapipe compiles the emulated form faster with its loops rolled)
shared float xs[WG];
// the subgroup's shuffle and vote, through shared memory (every lane reaches them)
float xshuf(float v, uint m) {
    xs[gl_LocalInvocationID.x] = v;
    barrier();
    float r = xs[gl_LocalInvocationID.x ^ m];
    barrier();
    return r;
}
bool sg_all(bool b) {
    xs[gl_LocalInvocationID.x] = b ? 1.0 : 0.0;
    barrier();
    float mn = 1.0;
    for (uint i = 0; i < SG; i++) {
        mn = min(mn, xs[SG_ID * SG + i]);
    }
    barrier();
    return mn > 0.5;
}
#else
#define SG_ID gl_SubgroupID
#define SG_LANE gl_SubgroupInvocationID
#define SG_SYNC() subgroupMemoryBarrierShared(); subgroupBarrier()
#define UNROLL [[unroll]]
#define ACC coopmat<float, gl_ScopeSubgroup, 16, 16, gl_MatrixUseAccumulator>
#define ACCH coopmat<float16_t, gl_ScopeSubgroup, 16, 16, gl_MatrixUseAccumulator>
#define MATA coopmat<float16_t, gl_ScopeSubgroup, 16, 16, gl_MatrixUseA>
#define MATB coopmat<float16_t, gl_ScopeSubgroup, 16, 16, gl_MatrixUseB>
float xshuf(float v, uint m) {
    return subgroupShuffleXor(v, m);
}
bool sg_all(bool b) {
    return subgroupAll(b);
}
#endif

// the representative's value (e & xe == 0) to the other elements of its orbit in the
// lane (element masks in ascending order: each step's sources are already set)
void orbit_bcast(inout float v[EPL], uint xe) {
    UNROLL for (uint j = 1u; j < EPL; j <<= 1) {
        if ((xe & j) != 0u) {
            UNROLL for (uint e = 0; e < EPL; e++) {
                if ((e & j) != 0u) {
                    v[e] = v[e ^ j];
                }
            }
        }
    }
}

// a row's max (or sum) into every element of the lane that holds it: first over the
// lane's elements of that row (element masks xe: the representatives, e & xe == 0,
// gather their orbit), then over the lanes holding it (lane masks xm), then back to
// the orbit. xe and xm are uniform, so are the branches around the shuffles.
void row_reduce(inout float v[EPL], uint xe, uint xm, bool sum) {
    UNROLL for (uint j = 1u; j < EPL; j <<= 1) {
        if ((xe & j) != 0u) {
            UNROLL for (uint e = 0; e < EPL; e++) {
                if ((e & j) == 0u) {
                    v[e] = sum ? v[e] + v[e ^ j] : max(v[e], v[e ^ j]);
                }
            }
        }
    }
    UNROLL for (uint m = 1u; m < SG; m <<= 1) {
        if ((xm & m) != 0u) {
            UNROLL for (uint e = 0; e < EPL; e++) {
                if ((e & xe) == 0u) {
                    float w = xshuf(v[e], m);
                    v[e] = sum ? v[e] + w : max(v[e], w);
                }
            }
        }
    }
    orbit_bcast(v, xe);
}

uint ring_row(uint p) {
    if (p >= pc.n_ctx) {
        p = p % pc.n_ctx;
    }
    return p;
}

uint lo_of(uint p) {
    return pc.n_swa > 0u && p + 1u > pc.n_swa ? p + 1u - pc.n_swa : 0u;
}

// row r's query (token t0 + r / G, head h0 + r % G) at dim d, scaled, in f16 (zero for
// rows past the live tokens), as attn_prefill_cm.comp rounds it
float16_t q_at(uint r, uint d, uint t0, uint nlive, uint h0) {
    uint tk = r / G;
    return tk < nlive ? float16_t(q[(t0 + tk) * pc.q_stride + (h0 + r % G) * HD + d] * pc.scale) : float16_t(0.0);
}

// four values of a K / V row in f16 (f16 caches' bits as they are)
f16vec4 k_raw4(uint row_w, uint d) {
    if (K_TYPE == KV_F16) {
        uvec2 u = kc2[(row_w + d) >> 2];
        return f16vec4(unpackFloat2x16(u.x), unpackFloat2x16(u.y));
    }
    return f16vec4(k_load4(row_w, d));
}
f16vec4 v_raw4(uint row_w, uint d) {
    if (V_TYPE == KV_F16) {
        uvec2 u = vc2[(row_w + d) >> 2];
        return f16vec4(unpackFloat2x16(u.x), unpackFloat2x16(u.y));
    }
    return f16vec4(v_load4(row_w, d));
}

#ifdef CM_EMULATE
// element (key c, dim d) of a staged K or V tile at f16vec4 offset base
float kv_at(uint base, uint c, uint d) {
    return float(kvs[base + c * KS4 + d / 4u][d % 4u]);
}
#endif

void main() {
    uint tid = gl_LocalInvocationID.x;
    uint t0 = gl_WorkGroupID.x * BQ;
    uint ntok = step.n_tokens;
    if (t0 >= ntok) {
        return;
    }
    uint nlive = min(BQ, ntok - t0);
    uint per_kv = pc.n_head / G / pc.n_head_kv;
    uint hgrp = gl_WorkGroupID.y;
    uint kvh = hgrp / per_kv;
    uint h0 = hgrp * G;
    uint sg = SG_ID;
    uint lane = SG_LANE;
    uint r0 = sg * 16u * RB;  // the subgroup's first row
    for (uint i = tid; i < BQ; i += WG) {
        tpos[i] = i < nlive ? STEP_POS(t0 + i) : 0u;
        tseq[i] = i < nlive ? STEP_SEQ(t0 + i) : 0xFFFFFFFFu;
        tdone[i] = i >= nlive;
    }
    for (uint i = tid; i < 256u; i += WG) {
        lay[i] = float(i);
    }
#if QSH
    for (uint i = tid; i < R * HD; i += WG) {
        qs[(i / HD) * QS + i % HD] = q_at(i / HD, i % HD, t0, nlive, h0);
    }
#endif
    barrier();

    // the accumulators' layout: element e of this lane is (rowE[e], colE[e]) of a block
    uint rowE[EPL];
    uint colE[EPL];
    bool good = true;
#ifdef CM_EMULATE
    for (uint e = 0; e < EPL; e++) {
        uint v = uint(lay[lane + SG * e]);
        rowE[e] = v / 16u;
        colE[e] = v % 16u;
    }
#else
    {
        ACC li;
        coopMatLoad(li, lay, 0, 16u, gl_CooperativeMatrixLayoutRowMajor);
        good = li.length() == int(EPL);
        [[unroll]] for (uint e = 0; e < EPL; e++) {
            uint v = uint(li[e]);
            rowE[e] = v / 16u;
            colE[e] = v % 16u;
        }
    }
#endif
    // the lane xor masks that keep every element's row, the element ones likewise; a
    // row's 16 elements must be one orbit of both
    uint xm = 0u;
    UNROLL for (uint m = 1u; m < SG; m <<= 1) {
        bool same = true;
        UNROLL for (uint e = 0; e < EPL; e++) {
            same = same && uint(xshuf(float(rowE[e]), m)) == rowE[e];
        }
        if (sg_all(same)) {
            xm |= m;
        }
    }
    uint xe = 0u;
    UNROLL for (uint j = 1u; j < EPL; j <<= 1) {
        bool same = true;
        UNROLL for (uint e = 0; e < EPL; e++) {
            same = same && rowE[e ^ j] == rowE[e];
        }
        if (sg_all(same)) {
            xe |= j;
        }
    }
    good = sg_all(good && bitCount(xm) + bitCount(xe) == 4);
    // PREG: whether an f16 A fragment holds the accumulator's elements in the same order
    // (NVIDIA's m16n8k16 fragments do), read from a block of r * 16 + c in f16 (exact)
    // staged in the P slices; then P goes from the accumulators to A fragments in
    // registers. Elsewhere (and emulated: its products read P from shared memory) the
    // round trip through the P slice stays.
    bool preg = false;
#if PREG && !defined(CM_EMULATE)
    for (uint i = tid; i < 256u; i += WG) {
        ps[i] = float16_t(float(i));
    }
    barrier();
    {
        MATA la;
        coopMatLoad(la, ps, 0, 16u, gl_CooperativeMatrixLayoutRowMajor);
        bool same = la.length() == int(EPL);
        [[unroll]] for (uint e = 0; e < EPL; e++) {
            same = same && uint(float(la[e])) == rowE[e] * 16u + colE[e];
        }
        preg = sg_all(same);
    }
    barrier();
#endif

#ifndef CM_EMULATE
#if !QSH
    // the subgroup's rows of Q as RB * NQ A fragments, through its P slice
    MATA qf[RB * NQ];
    [[unroll]] for (uint b = 0; b < RB; b++) {
        [[unroll]] for (uint c = 0; c < NQ; c++) {
            [[unroll]] for (uint e = 0; e < EPL; e++) {
                uint idx = lane + SG * e;
                uint r = r0 + 16u * b + idx / 16u;
                ps[r * PS + idx % 16u] = q_at(r, c * 16u + idx % 16u, t0, nlive, h0);
            }
            SG_SYNC();
            coopMatLoad(qf[b * NQ + c], ps, (r0 + 16u * b) * PS, PS, gl_CooperativeMatrixLayoutRowMajor);
            SG_SYNC();
        }
    }
#endif
    ACC oc[RB * NQ];
    [[unroll]] for (uint j = 0; j < RB * NQ; j++) {
        oc[j] = ACC(0.0);
    }
    ACC sacc[RB * NB];
#else
    float oc[RB * NQ][EPL];
    for (uint j = 0; j < RB * NQ; j++) {
        for (uint e = 0; e < EPL; e++) {
            oc[j][e] = 0.0;
        }
    }
    float sacc[RB * NB][EPL];
#endif

    uint k_row = kv_row_words(K_TYPE, pc.kv_dim);
    uint v_row = kv_row_words(V_TYPE, pc.kv_dim);
    uint k_head = kvh * kv_row_words(K_TYPE, HD);
    uint v_head = kvh * kv_row_words(V_TYPE, HD);

    float m_run[RB * EPL];  // the running max of each element's row
    float l_run[RB * EPL];  // the running sum of its column's share of its row
    UNROLL for (uint i = 0; i < RB * EPL; i++) {
        m_run[i] = MASKED;
        l_run[i] = 0.0;
    }
    f16vec4 kpre[NLD];  // the next tile's K and V, on their way to shared memory
    f16vec4 vpre[NLD];
    uint buf = 0u;

    while (true) {
        uint first = BQ;
        for (uint i = 0; i < BQ; i++) {
            if (!tdone[i]) {
                first = i;
                break;
            }
        }
        if (first == BQ) {
            break;
        }
        uint s = tseq[first];
        uint pmin = 0xFFFFFFFFu;
        uint pmax = 0u;
        uint lomin = 0xFFFFFFFFu;
        uint lomax = 0u;
        bool one_seq = nlive == BQ;
        for (uint i = 0; i < BQ; i++) {
            if (tseq[i] == s) {
                uint p = tpos[i];
                pmin = min(pmin, p);
                pmax = max(pmax, p);
                lomin = min(lomin, lo_of(p));
                lomax = max(lomax, lo_of(p));
            } else {
                one_seq = false;
            }
        }
        // the positions this subgroup's rows see in this pass: a tile outside
        // [slomin, spmax] has no key for any of them
        uint spmax = 0u;
        uint slomin = 0xFFFFFFFFu;
        for (uint i = r0 / G; i <= (r0 + 16u * RB - 1u) / G && i < BQ; i++) {
            if (tseq[i] == s) {
                spmax = max(spmax, tpos[i]);
                slomin = min(slomin, lo_of(tpos[i]));
            }
        }
        uint base = s * pc.n_ctx;
        // this split's key tiles [kb0, kb1) of the pass's [lomin, pmax]: chunks of at
        // least min_tiles, so a short range is one split and the others get none
        uint ntl = (pmax - lomin) / BC + 1u;
        uint per = max(pc.min_tiles, (ntl + pc.n_split - 1u) / pc.n_split);
        uint kb0 = lomin + min(ntl, gl_WorkGroupID.z * per) * BC;
        uint kb1 = min(pmax + 1u, lomin + min(ntl, (gl_WorkGroupID.z + 1u) * per) * BC);
        // the first tile's K and V in registers (then each tile loads the next one's)
        UNROLL for (uint n = 0; n < NLD; n++) {
            uint i = tid + WG * n;
            uint c = i / (HD / 4u);
            uint d = 4u * (i % (HD / 4u));
            bool ld = i < NL4 && kb0 + c < kb1;
            kpre[n] = ld ? k_raw4((base + ring_row(kb0 + c)) * k_row + k_head, d) : f16vec4(0.0);
            vpre[n] = ld ? v_raw4((base + ring_row(kb0 + c)) * v_row + v_head, d) : f16vec4(0.0);
        }
        for (uint k0 = kb0; k0 < kb1; k0 += BC) {
            uint kn = min(BC, kb1 - k0);
            bool full = one_seq && k0 + BC - 1u <= pmin && k0 >= lomax;
            bool act = slomin <= k0 + kn - 1u && k0 <= spmax;  // uniform in the subgroup
            uint kt = buf * 2u * TILE4;  // this tile's K, then V at kt + TILE4

            // 1. the K and V tiles into shared memory; the next tile's into registers
            uint k1 = k0 + BC;
            uint kn1 = k1 < kb1 ? min(BC, kb1 - k1) : 0u;
            UNROLL for (uint n = 0; n < NLD; n++) {
                uint i = tid + WG * n;
                uint c = i / (HD / 4u);
                uint d4 = i % (HD / 4u);
                if (i < NL4) {
                    kvs[kt + c * KS4 + d4] = kpre[n];
                    kvs[kt + TILE4 + c * KS4 + d4] = vpre[n];
                    if (kn1 > 0u) {
                        bool ld = c < kn1;
                        kpre[n] = ld ? k_raw4((base + ring_row(k1 + c)) * k_row + k_head, 4u * d4) : f16vec4(0.0);
                        vpre[n] = ld ? v_raw4((base + ring_row(k1 + c)) * v_row + v_head, 4u * d4) : f16vec4(0.0);
                    }
                }
            }
            barrier();

#ifdef CM_EMULATE
            bool run = true;  // every lane reaches the emulated shuffles' barriers
#else
            bool run = act;
#endif
            if (run) {
                // 2a. S = Q K^T for the subgroup's rows, in accumulators
#ifdef CM_EMULATE
                for (uint b = 0; b < RB; b++) {
                    for (uint nb = 0; nb < NB; nb++) {
                        for (uint e = 0; e < EPL; e++) {
                            float a = MASKED;
                            if (act) {
                                uint r = r0 + 16u * b + rowE[e];
                                uint kc = nb * 16u + colE[e];
                                a = 0.0;
                                for (uint d = 0; d < HD; d++) {
#if QSH
                                    a += float(qs[r * QS + d]) * kv_at(kt, kc, d);
#else
                                    a += float(q_at(r, d, t0, nlive, h0)) * kv_at(kt, kc, d);
#endif
                                }
                            }
                            sacc[b * NB + nb][e] = a;
                        }
                    }
                }
#else
                [[unroll]] for (uint i = 0; i < RB * NB; i++) {
                    sacc[i] = ACC(0.0);
                }
                [[unroll]] for (uint c = 0; c < NQ; c++) {
#if QSH
                    MATA qa[RB];
                    [[unroll]] for (uint b = 0; b < RB; b++) {
                        coopMatLoad(qa[b], qs, (r0 + 16u * b) * QS + c * 16u, QS, gl_CooperativeMatrixLayoutRowMajor);
                    }
#endif
                    [[unroll]] for (uint nb = 0; nb < NB; nb++) {
                        MATB mb;
                        coopMatLoad(mb, kvs, kt + nb * 16u * KS4 + c * 4u, KS4, gl_CooperativeMatrixLayoutColumnMajor);
                        [[unroll]] for (uint b = 0; b < RB; b++) {
#if QSH
                            sacc[b * NB + nb] = coopMatMulAdd(qa[b], mb, sacc[b * NB + nb]);
#else
                            sacc[b * NB + nb] = coopMatMulAdd(qf[b * NQ + c], mb, sacc[b * NB + nb]);
#endif
                        }
                    }
                }
#endif
                // 2b. the online softmax on the elements, row block by row block
                UNROLL for (uint b = 0; b < RB; b++) {
                    float mx[EPL];
                    UNROLL for (uint e = 0; e < EPL; e++) {
                        mx[e] = MASKED;
                        if (!full) {
                            // the element's row in this pass (read here, on the few tiles
                            // that need the mask, not held in registers): a row not in the
                            // pass sees nothing
                            uint tk = (r0 + 16u * b + rowE[e]) / G;
                            bool in_pass = tk < nlive && tseq[tk] == s;
                            uint p = in_pass ? tpos[tk] : 0u;
                            uint lo = in_pass ? lo_of(p) : 0xFFFFFFFFu;
                            UNROLL for (uint nb = 0; nb < NB; nb++) {
                                uint kk = nb * 16u + colE[e];
                                uint kp = k0 + kk;
                                bool vis = kk < kn && kp <= p && kp >= lo;
                                sacc[b * NB + nb][e] = vis ? sacc[b * NB + nb][e] : MASKED;
                            }
                        }
                        UNROLL for (uint nb = 0; nb < NB; nb++) {
                            mx[e] = max(mx[e], sacc[b * NB + nb][e]);
                        }
                    }
                    row_reduce(mx, xe, xm, false);
                    bool rescale = true;
#if LR
                    // the max the weights are taken against stays unless some row's grew by
                    // more than LR_T (weights then up to e^LR_T: f16 holds them, the sums
                    // are f32): most tiles skip the rescale of the output accumulators
                    bool grow = false;
                    UNROLL for (uint e = 0; e < EPL; e++) {
                        grow = grow || mx[e] > m_run[b * EPL + e] + LR_T;
                    }
                    rescale = !sg_all(!grow);
#endif
                    if (rescale) {
                        // the rescale once per row (the orbit's representatives), then to
                        // the other elements of the lane that hold the row
                        float corr[EPL];
                        UNROLL for (uint e = 0; e < EPL; e++) {
                            float m_old = m_run[b * EPL + e];
                            float m_new = max(m_old, mx[e]);
                            corr[e] = 1.0;
                            if ((e & xe) == 0u) {
                                corr[e] = exp(m_old - m_new);
                            }
                            m_run[b * EPL + e] = m_new;
                        }
                        orbit_bcast(corr, xe);
                        UNROLL for (uint e = 0; e < EPL; e++) {
                            l_run[b * EPL + e] *= corr[e];
                            UNROLL for (uint j = 0; j < NQ; j++) {
                                oc[b * NQ + j][e] *= corr[e];
                            }
                        }
                    }
                    UNROLL for (uint e = 0; e < EPL; e++) {
                        float sum = 0.0;
                        UNROLL for (uint nb = 0; nb < NB; nb++) {
                            float sv = sacc[b * NB + nb][e];
                            float w = sv > SEEN ? exp(sv - m_run[b * EPL + e]) : 0.0;
                            sacc[b * NB + nb][e] = w;
                            sum += w;
                        }
                        l_run[b * EPL + e] += sum;
                    }
                }
                // 2c. P to the subgroup's slice in f16, back as A fragments; o += P V
                if (!preg) {
                    SG_SYNC();  // the last tile's P fragments are read
                }
#ifdef CM_EMULATE
                for (uint b = 0; b < RB; b++) {
                    for (uint nb = 0; nb < NB; nb++) {
                        for (uint e = 0; e < EPL; e++) {
                            ps[(r0 + 16u * b + rowE[e]) * PS + nb * 16u + colE[e]] = float16_t(sacc[b * NB + nb][e]);
                        }
                    }
                }
                SG_SYNC();
                if (act) {
                    for (uint b = 0; b < RB; b++) {
                        for (uint j = 0; j < NQ; j++) {
                            for (uint e = 0; e < EPL; e++) {
                                uint r = r0 + 16u * b + rowE[e];
                                float a = oc[b * NQ + j][e];
                                for (uint kk = 0; kk < BC; kk++) {
                                    a += float(ps[r * PS + kk]) * kv_at(kt + TILE4, kk, j * 16u + colE[e]);
                                }
                                oc[b * NQ + j][e] = a;
                            }
                        }
                    }
                }
#else
                if (!preg) {
                    [[unroll]] for (uint i = 0; i < RB * NB; i++) {
                        ACCH ph = ACCH(sacc[i]);
                        coopMatStore(ph, ps, (r0 + 16u * (i / NB)) * PS + (i % NB) * 16u, PS,
                                     gl_CooperativeMatrixLayoutRowMajor);
                    }
                    SG_SYNC();
                }
                [[unroll]] for (uint kk = 0; kk < NB; kk++) {
                    MATA pa[RB];
                    [[unroll]] for (uint b = 0; b < RB; b++) {
#if PREG
                        if (preg) {  // the A fragment's elements are the accumulator's: no round trip
                            pa[b] = MATA(0.0);
                            [[unroll]] for (uint e = 0; e < EPL; e++) {
                                pa[b][e] = float16_t(sacc[b * NB + kk][e]);
                            }
                        } else
#endif
                        coopMatLoad(pa[b], ps, (r0 + 16u * b) * PS + kk * 16u, PS, gl_CooperativeMatrixLayoutRowMajor);
                    }
                    [[unroll]] for (uint j = 0; j < NQ; j++) {
                        MATB mb;
                        coopMatLoad(mb, kvs, kt + TILE4 + kk * 16u * KS4 + j * 4u, KS4,
                                    gl_CooperativeMatrixLayoutRowMajor);
                        [[unroll]] for (uint b = 0; b < RB; b++) {
                            oc[b * NQ + j] = coopMatMulAdd(pa[b], mb, oc[b * NQ + j]);
                        }
                    }
                }
#endif
            }
#if DB
            buf ^= 1u;  // the next tile into the other buffer: no second barrier
#else
            barrier();  // 3. every subgroup is done with this K and V before the next tile's
#endif
        }
        // this pass's tokens are done (every lane has read tdone above)
        barrier();
        for (uint i = tid; i < BQ; i += WG) {
            if (tseq[i] == s) {
                tdone[i] = true;
            }
        }
        barrier();
    }

    // the rows' sums from the columns' shares, then o / l (or the partials and (m, l))
    bool split = pc.n_split > 1u;
    UNROLL for (uint b = 0; b < RB; b++) {
        float lr[EPL];
        UNROLL for (uint e = 0; e < EPL; e++) {
            lr[e] = l_run[b * EPL + e];
        }
        row_reduce(lr, xe, xm, true);
        UNROLL for (uint e = 0; e < EPL; e++) {
            uint r = r0 + 16u * b + rowE[e];
            uint tk = r / G;
            if (tk >= nlive) {
                continue;
            }
            uint hh = h0 + r % G;
            float inv = good ? (split ? 1.0 : 1.0 / lr[e]) : uintBitsToFloat(0x7FC00000u);
            if (split && colE[e] == 0u) {
                uint mb = pc.ml_off + (((t0 + tk) * pc.n_head + hh) * pc.n_split + gl_WorkGroupID.z) * 2u;
                partial[mb] = m_run[b * EPL + e];
                partial[mb + 1u] = good ? lr[e] : uintBitsToFloat(0x7FC00000u);
            }
            UNROLL for (uint j = 0; j < NQ; j++) {
                float v = oc[b * NQ + j][e] * inv;
                uint d = j * 16u + colE[e];
                if (split) {
                    partial[(((t0 + tk) * pc.n_head + hh) * pc.n_split + gl_WorkGroupID.z) * HD + d] = v;
                } else {
                    o[(t0 + tk) * pc.o_stride + hh * HD + d] = v;
                }
            }
        }
    }
}

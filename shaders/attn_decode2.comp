#version 450
// Decode attention at depth, the coalesced form of attn_decode.comp: the same grid
// (n_split, head groups, tokens), the same split of the visible keys per step, the
// same partials, (m, l) and counter combine (decode_combine.glsl), so Ops and the
// lowering swap one for the other. What differs is how a work group reads the cache.
//
// attn_decode.comp has each lane score a key of its own, loading the whole K row by
// itself: one load instruction of a subgroup touches 32 rows. Here a row is read by
// LPR lanes together (a row group), each lane taking 8 values (16 bytes of an f16
// row) of every 8 * LPR: head_dim = 8 * LPR * CH. A subgroup so reads whole rows,
// gl_SubgroupSize / LPR of them per load instruction, and each lane has R rows of K
// and the same R rows of V in flight at once (V's loads do not wait for the scores).
//
// Each row group runs its own online softmax over its keys (b + i * NRG + rg for the
// i-th of R rows of the iteration at key b): the partial dots of a row are summed over
// its LPR lanes by a subgroupShuffleXor butterfly, which leaves the same sum, bit for
// bit, in every lane of the group, so every lane keeps the same running max m and sum
// l per head and rescales its own slice of the output without talking to the others.
// There is no barrier in the key loop. At the end the row groups' (m, l) meet in
// shared memory, each lane rescales its accumulation to the work group's max, the row
// groups of a subgroup are added by shuffles and the subgroups through shared memory.
//
// Needs GL_KHR_shader_subgroup_shuffle (Ops.decode2_ok checks the device's report) and
// lanes of a row group within one subgroup (LPR <= the subgroup size, a power of two).
// Visible keys, windows, rings and the KV types: as attn_decode.comp.
#extension GL_KHR_shader_subgroup_shuffle : require
#include "common.glsl"

#ifndef K_TYPE
#define K_TYPE 0
#endif
#ifndef V_TYPE
#define V_TYPE 0
#endif

layout(binding = 0, std430) readonly buffer Q { float q[]; };
layout(binding = 1, std430) readonly buffer K { vec4 kc4[]; };
layout(binding = 1, std430) readonly buffer K2 { uvec2 kc2[]; };
layout(binding = 1, std430) readonly buffer K4 { uvec4 kcu4[]; };
layout(binding = 1, std430) readonly buffer K16 { uint16_t kc16[]; };
layout(binding = 2, std430) readonly buffer V { vec4 vc4[]; };
layout(binding = 2, std430) readonly buffer V2 { uvec2 vc2[]; };
layout(binding = 2, std430) readonly buffer V4 { uvec4 vcu4[]; };
layout(binding = 2, std430) readonly buffer V16 { uint16_t vc16[]; };
layout(binding = 3, std430) writeonly buffer O { float o[]; };
// [cap, n_head, n_split, head_dim] partial outputs, then [cap, n_head, n_split, 2] (m, l)
layout(binding = 4, std430) coherent buffer P { float part[]; };
// [cap, n_head / GW] counters of finished splits, 0 between dispatches
layout(binding = 5, std430) coherent buffer C { uint counter[]; };
DECLARE_STEP(6)
#ifdef OUT_GATE
// qwen35's output gate: o = attention / (1 + exp(-g)), g of head h at
// og[t * g_stride + h * g_head + g_off] (its interleave with q), as swiglu.comp's SIGMOID
layout(binding = 7, std430) readonly buffer Og { float og[]; };
#endif

layout(push_constant) uniform Push {
    uint n_head;
    uint n_head_kv;
    uint head_dim;   // 8 * LPR * CH
    uint n_ctx;
    uint kv_dim;
    uint q_stride;
    uint o_stride;
    float scale;
    uint n_swa;      // sliding window (0: none)
    uint n_split;    // the grid's x: most work groups per (token, head group)
    uint min_chunk;  // fewest keys per split (a multiple of WG)
    uint ml_off;     // where (m, l) start in part[]
#ifdef OUT_GATE
    uint g_stride;
    uint g_head;
    uint g_off;
#endif
} pc;

#ifdef OUT_GATE
#define O_VAL(t, h, d, v) ((v) / (1.0 + exp(-og[(t) * pc.g_stride + (h) * pc.g_head + pc.g_off + (d)])))
#else
#define O_VAL(t, h, d, v) (v)
#endif

layout(constant_id = 1) const uint GW = 4;   // query heads per work group
layout(constant_id = 2) const uint LPR = 8;  // lanes per K / V row (a power of two)
layout(constant_id = 3) const uint CH = 1;   // pieces of 8 values per lane and row
layout(constant_id = 4) const uint R = 4;    // rows in flight per lane
layout(constant_id = 5) const uint SG = 32;  // the subgroup size Ops expects
const uint NRG = WG / LPR;                   // row groups per work group
const uint P8 = 2u * CH;                     // vec4s per lane and row
// rows of red[]: heads per pass (a row group each, up to a subgroup's) times subgroups
const uint RED_ROWS = (GW < SG / LPR ? GW : SG / LPR) * (WG / SG);

#include "reduce.glsl"
#include "kv.glsl"
#include "decode_combine.glsl"

#define KVR_T K_TYPE
#define KVR_W(i) uint(kc16[i])
#define KVR_F4(i) kc4[i]
#define KVR_U2(i) kc2[i]
#define KVR_U4(i) kcu4[i]
#define KVR_LOAD4 k_load4
#define KVR_LOAD8 k_load8
#include "kv_read.glsl"
#include "kv_read8.glsl"
#undef KVR_T
#undef KVR_W
#undef KVR_F4
#undef KVR_U2
#undef KVR_U4
#undef KVR_LOAD4
#undef KVR_LOAD8
#define KVR_T V_TYPE
#define KVR_W(i) uint(vc16[i])
#define KVR_F4(i) vc4[i]
#define KVR_U2(i) vc2[i]
#define KVR_U4(i) vcu4[i]
#define KVR_LOAD4 v_load4
#define KVR_LOAD8 v_load8
#include "kv_read.glsl"
#include "kv_read8.glsl"

shared float grp_m[GW * NRG];  // each row group's running max and sum, per head
shared float grp_l[GW * NRG];
shared float wg_m[GW];         // the work group's, after the merge
shared float wg_l[GW];
shared vec4 red[RED_ROWS * 2u * LPR * CH];  // the subgroups' sums of some heads' outputs

// the row of position p: p itself unless the cache is a ring that has wrapped
uint ring_row(uint p) {
    if (p >= pc.n_ctx) {
        p = p % pc.n_ctx;
    }
    return p;
}

void main() {
    uint split = gl_WorkGroupID.x;
    uint t = gl_WorkGroupID.z;
    if (t >= step.n_tokens) {
        return;
    }
    uint groups = pc.n_head / GW;         // head groups
    uint per_kv = groups / pc.n_head_kv;  // head groups per KV head
    uint hgrp = gl_WorkGroupID.y;
    uint kvh = hgrp / per_kv;
    uint h0 = hgrp * GW;  // first query head
    uint hd = pc.head_dim;
    uint tid = gl_LocalInvocationID.x;
    // this lane's row group and its place in it, from the subgroup built-ins (the
    // butterflies below need the LPR lanes of a row group in one subgroup)
    uint sg_rows = gl_SubgroupSize / LPR;
    uint rs = gl_SubgroupInvocationID / LPR;  // row group within the subgroup
    uint rg = gl_SubgroupID * sg_rows + rs;
    uint li = gl_SubgroupInvocationID % LPR;

    uint hi = STEP_POS(t) + 1u;  // visible keys: [lo, hi)
    uint lo = pc.n_swa > 0u && hi > pc.n_swa ? hi - pc.n_swa : 0u;
    uint n = hi - lo;
    uint per = (n + pc.n_split - 1u) / pc.n_split;
    uint chunk = max(pc.min_chunk, (per + WG - 1u) / WG * WG);
    uint n_live = (n + chunk - 1u) / chunk;
    if (split >= n_live) {
        return;
    }
    uint k0 = lo + split * chunk;
    uint k1 = min(hi, k0 + chunk);

    // this lane's pieces of the GW queries: values 8 (li + c LPR) .. + 8 of each head
    vec4 qr[GW * P8];
    [[unroll]] for (uint g = 0; g < GW; g++) {
        [[unroll]] for (uint c = 0; c < CH; c++) {
            uint qb = t * pc.q_stride + (h0 + g) * hd + 8u * (li + c * LPR);
            qr[g * P8 + 2u * c] = vec4(q[qb], q[qb + 1u], q[qb + 2u], q[qb + 3u]) * pc.scale;
            qr[g * P8 + 2u * c + 1u] = vec4(q[qb + 4u], q[qb + 5u], q[qb + 6u], q[qb + 7u]) * pc.scale;
        }
    }
    float m[GW];
    float l[GW];
    vec4 acc[GW * P8];
    [[unroll]] for (uint g = 0; g < GW; g++) {
        m[g] = -1.0e30;
        l[g] = 0.0;
        [[unroll]] for (uint c = 0; c < P8; c++) {
            acc[g * P8 + c] = vec4(0.0);
        }
    }

    uint base = STEP_SEQ(t) * pc.n_ctx;
    uint k_row = kv_row_words(K_TYPE, pc.kv_dim);
    uint v_row = kv_row_words(V_TYPE, pc.kv_dim);
    uint k_head = kvh * kv_row_words(K_TYPE, hd);
    uint v_head = kvh * kv_row_words(V_TYPE, hd);

    for (uint b = k0; b < k1; b += NRG * R) {
        // R rows of K and of V in flight; a key past the split reads the split's last
        // row (cached) and weighs 0
        vec4 kx[R * P8];
        vec4 vx[R * P8];
        bool ok[R];
        [[unroll]] for (uint i = 0; i < R; i++) {
            uint j = b + i * NRG + rg;
            ok[i] = j < k1;
            uint row = base + ring_row(min(j, k1 - 1u));
            uint kb = row * k_row + k_head;
            uint vb = row * v_row + v_head;
            [[unroll]] for (uint c = 0; c < CH; c++) {
                uint e = 8u * (li + c * LPR);
                k_load8(kb, e, kx[i * P8 + 2u * c], kx[i * P8 + 2u * c + 1u]);
                v_load8(vb, e, vx[i * P8 + 2u * c], vx[i * P8 + 2u * c + 1u]);
            }
        }
        float s[R * GW];
        [[unroll]] for (uint i = 0; i < R; i++) {
            [[unroll]] for (uint g = 0; g < GW; g++) {
                float d = 0.0;
                [[unroll]] for (uint c = 0; c < P8; c++) {
                    d += dot(qr[g * P8 + c], kx[i * P8 + c]);
                }
                s[i * GW + g] = d;
            }
        }
        // each row's score summed over its LPR lanes: the same value in all of them
        [[unroll]] for (uint x = LPR / 2u; x > 0u; x >>= 1u) {
            [[unroll]] for (uint k = 0; k < R * GW; k++) {
                s[k] += subgroupShuffleXor(s[k], x);
            }
        }
        // the row group's online softmax, per head
        [[unroll]] for (uint g = 0; g < GW; g++) {
            float mx = m[g];
            [[unroll]] for (uint i = 0; i < R; i++) {
                mx = ok[i] ? max(mx, s[i * GW + g]) : mx;
            }
            float corr = exp(m[g] - mx);
            float psum = 0.0;
            [[unroll]] for (uint c = 0; c < P8; c++) {
                acc[g * P8 + c] *= corr;
            }
            [[unroll]] for (uint i = 0; i < R; i++) {
                float p = ok[i] ? exp(s[i * GW + g] - mx) : 0.0;
                psum += p;
                [[unroll]] for (uint c = 0; c < P8; c++) {
                    acc[g * P8 + c] += p * vx[i * P8 + c];
                }
            }
            l[g] = l[g] * corr + psum;
            m[g] = mx;
        }
    }

    // the row groups' (m, l) merged: the work group's max M and sum L per head, and
    // each lane's accumulation rescaled to M (a row group without keys weighs 0)
    if (li == 0u) {
        [[unroll]] for (uint g = 0; g < GW; g++) {
            grp_m[g * NRG + rg] = m[g];
            grp_l[g * NRG + rg] = l[g];
        }
    }
    barrier();
    [[unroll]] for (uint g = 0; g < GW; g++) {
        float M = -1.0e30;
        for (uint r = 0; r < NRG; r++) {
            M = max(M, grp_m[g * NRG + r]);
        }
        float L = 0.0;
        for (uint r = 0; r < NRG; r++) {
            L += grp_l[g * NRG + r] * exp(grp_m[g * NRG + r] - M);
        }
        float w = exp(m[g] - M);
        [[unroll]] for (uint c = 0; c < P8; c++) {
            acc[g * P8 + c] *= w;
        }
        if (tid == 0u) {
            wg_m[g] = M;
            wg_l[g] = L;
        }
    }
    // the row groups of a subgroup added up (a butterfly: every lane holds the sums)
    for (uint x = LPR; x < gl_SubgroupSize; x <<= 1u) {
        [[unroll]] for (uint k = 0; k < GW * P8; k++) {
            acc[k] += subgroupShuffleXor(acc[k], x);
        }
    }
    // then the subgroups through shared memory, hp heads at a time: row group rs of
    // each subgroup writes head g0 + rs
    uint hd4 = hd / 4u;
    uint nsg = gl_NumSubgroups;
    uint hp = max(1u, min(min(GW, sg_rows), RED_ROWS / nsg));  // heads per pass
    uint pstride = pc.n_split * hd;  // floats between heads in part[]
    for (uint g0 = 0; g0 < GW; g0 += hp) {
        [[unroll]] for (uint g = 0; g < GW; g++) {
            if (g >= g0 && g - g0 == rs) {
                [[unroll]] for (uint c = 0; c < CH; c++) {
                    uint at = (rs * nsg + gl_SubgroupID) * hd4 + 2u * (li + c * LPR);
                    red[at] = acc[g * P8 + 2u * c];
                    red[at + 1u] = acc[g * P8 + 2u * c + 1u];
                }
            }
        }
        barrier();
        uint nh = min(hp, GW - g0);
        for (uint i = tid; i < nh * hd4; i += WG) {
            uint gi = i / hd4;
            uint d4 = i % hd4;
            vec4 sum = vec4(0.0);
            for (uint sg = 0; sg < nsg; sg++) {
                sum += red[(gi * nsg + sg) * hd4 + d4];
            }
            uint h = h0 + g0 + gi;
            if (n_live == 1u) {
                sum /= wg_l[g0 + gi];
                uint ob = t * pc.o_stride + h * hd + 4u * d4;
                o[ob] = O_VAL(t, h, 4u * d4, sum.x);
                o[ob + 1u] = O_VAL(t, h, 4u * d4 + 1u, sum.y);
                o[ob + 2u] = O_VAL(t, h, 4u * d4 + 2u, sum.z);
                o[ob + 3u] = O_VAL(t, h, 4u * d4 + 3u, sum.w);
            } else {
                uint pb = (t * pc.n_head + h) * pstride + split * hd + 4u * d4;
                part[pb] = sum.x;
                part[pb + 1u] = sum.y;
                part[pb + 2u] = sum.z;
                part[pb + 3u] = sum.w;
            }
        }
        barrier();
    }
    if (n_live == 1u) {
        return;
    }
    if (tid < GW) {
        uint mb = pc.ml_off + ((t * pc.n_head + h0 + tid) * pc.n_split + split) * 2u;
        part[mb] = wg_m[tid];
        part[mb + 1u] = wg_l[tid];
    }
    decode_combine(t, hgrp, h0, n_live);
}

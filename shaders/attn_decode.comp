#version 450
// Decode attention at depth (flash-decoding): the visible keys of one (token, KV head)
// are split over up to n_split work groups, each of which serves the GW query heads
// of that KV head that it is given (so K and V are read once for all of them, not
// once per query head), with an online softmax over tiles of WG keys. Each writes
// its unnormalised partial output with its running max m and sum l; the last of them
// to finish (an atomic count per (token, head group)) combines the partials:
//   M = max_s m_s,  L = sum_s l_s exp(m_s - M),  o = sum_s acc_s exp(m_s - M) / L.
// So a decode step has no extra dispatch stage, and a short sequence (one split) is a
// single work group that writes its output directly, touching neither the partials
// nor the counter.
//
// The split is chosen per step from the step buffer, not at record time: a token
// with n visible keys uses chunks of max(min_chunk, ceil(n / n_split) rounded up to
// WG) keys, so ceil(n / chunk) <= n_split work groups; the others return at once.
// n_split (the grid) is fixed when the graph is recorded, from the context length.
//
// Visible keys: positions [pos - n_swa + 1, pos] with a sliding window (n_swa > 0),
// [0, pos] otherwise; position p of a sequence is at row p % n_ctx of its rows. K
// and V are read in their cache types K_TYPE / V_TYPE (kv.glsl).
//
// Per tile: every lane scores one key for the GW heads (a K row is loaded once), the
// subgroups then take a head each for the max and the sum, and the value loop splits
// the work group into key groups of head_dim / 4 lanes, a lane owning four output
// dimensions of every head (V rows loaded once), as attention.comp does.
//
// The count and the last split's combine are decode_combine.glsl's (shared with
// attn_decode2.comp, the coalesced form).
//
// LATENT (multi-head latent attention, llama.cpp's absorbed MLA): K rows of up to 576
// values (kv_lora_rank + n_rot) and V the first DV of each (a specialization constant,
// DV / 4 <= WG), bound as the same cache: the value loop, the partials and the output
// cover DV dims of each head (whose stride in o and part stays head_dim); an output
// head's values past DV are not written. Without LATENT the source the compiler sees
// is the plain kernel's, token for token (VD4 / COMBINE_DV expand to hd4 / hd).
//
// WIDE: heads of up to 512 values (gemma4's full-attention layers), the queries'
// shared array sized for them; head_dim / 4 <= WG, so the value loop has one key group
// of head_dim / 4 lanes or more. Without it the source is the plain kernel's.
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
layout(binding = 1, std430) readonly buffer K16 { uint16_t kc16[]; };
layout(binding = 2, std430) readonly buffer V { vec4 vc4[]; };
layout(binding = 2, std430) readonly buffer V2 { uvec2 vc2[]; };
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
    uint head_dim;
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

layout(constant_id = 1) const uint GW = 4;  // query heads per work group
#ifdef LATENT
layout(constant_id = 2) const uint DV = 512;  // value dims: the first DV of each K row
#define VD4 (DV / 4u)
#define COMBINE_DV DV
#else
#define VD4 hd4
#endif

#include "reduce.glsl"
#include "kv.glsl"
#include "decode_combine.glsl"

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

#ifdef LATENT
const uint MAX_HD4 = 144;  // head_dim <= 576
#elif defined(WIDE)
const uint MAX_HD4 = 128;  // head_dim <= 512 (gemma4's full-attention layers; hd4 <= WG)
#else
const uint MAX_HD4 = 64;  // head_dim <= 256
#endif

shared vec4 qs[GW * MAX_HD4];
shared float sc[GW * WG];  // a tile's scores, then its softmax weights
shared float run_m[GW];
shared float run_l[GW];
shared float run_c[GW];    // the tile's rescale of the earlier accumulation
shared vec4 red[WG];       // key groups' partial outputs

// the row of position p: p itself unless the cache is a ring that has wrapped (no
// division on the common path)
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
    uint groups = pc.n_head / GW;       // head groups
    uint per_kv = groups / pc.n_head_kv;  // head groups per KV head
    uint hgrp = gl_WorkGroupID.y;
    uint kvh = hgrp / per_kv;
    uint h0 = hgrp * GW;  // first query head
    uint hd = pc.head_dim;
    uint hd4 = hd / 4u;
    uint tid = gl_LocalInvocationID.x;

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

    for (uint i = tid; i < GW * hd4; i += WG) {
        uint g = i / hd4;
        uint d = i % hd4;
        uint qb = t * pc.q_stride + (h0 + g) * hd + 4u * d;
        qs[g * MAX_HD4 + d] = vec4(q[qb], q[qb + 1u], q[qb + 2u], q[qb + 3u]) * pc.scale;
    }
    if (tid < GW) {
        run_m[tid] = -1.0e30;
        run_l[tid] = 0.0;
    }
    barrier();

    uint base = STEP_SEQ(t) * pc.n_ctx;
    uint k_row = kv_row_words(K_TYPE, pc.kv_dim);
    uint v_row = kv_row_words(V_TYPE, pc.kv_dim);
    uint k_head = kvh * kv_row_words(K_TYPE, hd);
    uint v_head = kvh * kv_row_words(V_TYPE, hd);
    uint kg_n = max(1u, WG / VD4);  // key groups of the value loop
    uint kg = tid / VD4;
    uint d4 = tid % VD4;
    bool vlane = kg < kg_n;

    vec4 acc[GW];
    [[unroll]] for (uint g = 0; g < GW; g++) {
        acc[g] = vec4(0.0);
    }
    for (uint b0 = k0; b0 < k1; b0 += WG) {
        uint j = b0 + tid;
        float s[GW];
        [[unroll]] for (uint g = 0; g < GW; g++) {
            s[g] = -1.0e30;
        }
        if (j < k1) {
            uint kb = (base + ring_row(j)) * k_row + k_head;
            vec4 dv[GW];
            [[unroll]] for (uint g = 0; g < GW; g++) {
                dv[g] = vec4(0.0);
            }
            // eight loads in flight, then their products
            for (uint d0 = 0; d0 < hd4; d0 += 8u) {
                vec4 kv[8];
                [[unroll]] for (uint i = 0; i < 8u; i++) {
                    kv[i] = d0 + i < hd4 ? k_load4(kb, 4u * (d0 + i)) : vec4(0.0);
                }
                [[unroll]] for (uint i = 0; i < 8u; i++) {
                    if (d0 + i < hd4) {
                        [[unroll]] for (uint g = 0; g < GW; g++) {
                            dv[g] += qs[g * MAX_HD4 + d0 + i] * kv[i];
                        }
                    }
                }
            }
            [[unroll]] for (uint g = 0; g < GW; g++) {
                s[g] = dv[g].x + dv[g].y + dv[g].z + dv[g].w;
            }
        }
        [[unroll]] for (uint g = 0; g < GW; g++) {
            sc[g * WG + tid] = s[g];
        }
        barrier();
        uint nvalid = min(WG, k1 - b0);
        // a subgroup per head: the tile's max, the weights, their sum
        for (uint g = gl_SubgroupID; g < GW; g += gl_NumSubgroups) {
            float mx = -1.0e30;
            for (uint i = gl_SubgroupInvocationID; i < WG; i += gl_SubgroupSize) {
                mx = max(mx, sc[g * WG + i]);
            }
            float mn = max(run_m[g], subgroupMax(mx));
            float sum = 0.0;
            for (uint i = gl_SubgroupInvocationID; i < WG; i += gl_SubgroupSize) {
                float p = i < nvalid ? exp(sc[g * WG + i] - mn) : 0.0;
                sc[g * WG + i] = p;
                sum += p;
            }
            sum = subgroupAdd(sum);
            if (subgroupElect()) {
                float c = exp(run_m[g] - mn);
                run_c[g] = c;
                run_l[g] = run_l[g] * c + sum;
                run_m[g] = mn;
            }
        }
        barrier();
        if (vlane) {
            [[unroll]] for (uint g = 0; g < GW; g++) {
                acc[g] *= run_c[g];
            }
            // keys kg, kg + kg_n, ... of the tile, four loads in flight
            for (uint j0 = kg; j0 < nvalid; j0 += 4u * kg_n) {
                vec4 vv[4];
                [[unroll]] for (uint i = 0; i < 4u; i++) {
                    uint jj = j0 + i * kg_n;
                    vv[i] = jj < nvalid ? v_load4((base + ring_row(b0 + jj)) * v_row + v_head, 4u * d4) : vec4(0.0);
                }
                [[unroll]] for (uint i = 0; i < 4u; i++) {
                    uint jj = j0 + i * kg_n;
                    if (jj < nvalid) {
                        [[unroll]] for (uint g = 0; g < GW; g++) {
                            acc[g] += sc[g * WG + jj] * vv[i];
                        }
                    }
                }
            }
        }
        barrier();
    }

    // add up the key groups; one split writes the output, several their partials
    uint pstride = pc.n_split * hd;  // floats between heads in part[]
    [[unroll]] for (uint g = 0; g < GW; g++) {
        red[tid] = vlane ? acc[g] : vec4(0.0);
        barrier();
        if (tid < VD4) {
            vec4 sum = vec4(0.0);
            for (uint k = 0; k < kg_n; k++) {
                sum += red[k * VD4 + tid];
            }
            uint h = h0 + g;
            if (n_live == 1u) {
                sum /= run_l[g];
                uint ob = t * pc.o_stride + h * hd + 4u * tid;
                o[ob] = O_VAL(t, h, 4u * tid, sum.x);
                o[ob + 1u] = O_VAL(t, h, 4u * tid + 1u, sum.y);
                o[ob + 2u] = O_VAL(t, h, 4u * tid + 2u, sum.z);
                o[ob + 3u] = O_VAL(t, h, 4u * tid + 3u, sum.w);
            } else {
                uint pb = (t * pc.n_head + h) * pstride + split * hd + 4u * tid;
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
        part[mb] = run_m[tid];
        part[mb + 1u] = run_l[tid];
    }
    decode_combine(t, hgrp, h0, n_live);
}

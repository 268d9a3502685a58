#version 450
// Prefill attention, tiled (flash attention): a work group owns BQ consecutive tokens
// of the batch and the G query heads of one KV head that it serves (ROWS = BQ * G query
// rows), so every K and V row it loads is used by all of them. It walks the keys of
// its tokens' sequence in tiles of BC positions with an online softmax (running max m,
// sum l, the output rescaled when m grows); scores never leave the work group.
//
// Masks: a token at position p sees positions [lo(p), p], lo(p) = p - n_swa + 1 with a
// sliding window (n_swa > 0), else 0. Key tiles outside [min lo, max p] of the tile's
// tokens are never visited (fully masked); a tile whose every (row, key) is visible
// (all rows live and of one sequence, the tile's last key <= the smallest position and
// its first >= the largest lo) runs without evaluating the mask at all (llama.cpp's
// mask_opt), so only the tiles on the diagonal (and a window's edge) pay for it.
// Tokens of several sequences in one tile (continuous batching) are served one
// sequence at a time: the rows of the other sequences see nothing in that pass.
// With n_split > 1 each pass's key tiles are split over the grid's z, each split
// writing its rows' unnormalised output and (m, l) for attn_combine.comp.
//
// K and V are read in their cache types K_TYPE / V_TYPE (kv.glsl, dequantized to f32
// here); position p of a sequence is at row p % n_ctx of its rows (a ring for a
// sliding-window cache). Scores are f32: this is the scalar path for devices without
// cooperative matrices (attn_prefill_cm.comp is the other).
//
// Phases per tile, WG = 4 * BC lanes: (A) lane (key c, quarter qq) dots its key with
// every row over the dims 4j + qq and the four quarters add up by subgroup shuffles
// (adjacent lanes); (B) four lanes per row take the tile's max, the weights and their
// sum; (C) lane (row group, four dims) accumulates P V for its rows, V read once per
// lane and key.
//
// LATENT (multi-head latent attention, llama.cpp's absorbed MLA): K rows of up to 576
// values (kv_lora_rank + n_rot; HD a multiple of 16) and V the first DV of each
// (specialization constant 4, DV / 4 <= WG), bound as the same cache in one type:
// phase C and the output cover DV dims of each head (whose stride in o and partial
// stays HD); an output head's values past DV are not written. Without LATENT the
// source the compiler sees is the plain kernel's, token for token (VD4 expands to HD4).
//
// NONCAUSAL (a step with a non-causal entry: gemma3's image rows): a token sees
// [lo(p), STEP_VIS(t)] instead of [lo(p), p], its highest visible position read from the
// step buffer (its own position for causal rows, its entry's last for the rows of a
// non-causal entry); the key tiles run to the tile's highest visible position, and a tile
// is fully visible below the smallest. Without it the source is the plain kernel's.
// With SYMMETRIC too (gemma-embedding's symmetric window) a token's highest visible
// position is also at most p + n_swa - 1, so the window hides keys on both sides.
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
layout(constant_id = 2) const uint BQ = 8;   // tokens per work group
layout(constant_id = 3) const uint HD = 64;  // head_dim
const uint ROWS = G * BQ;                    // query rows, at most WG / 4
const uint BC = 32;                          // keys per tile; WG = 4 * BC
const uint HD4 = HD / 4u;
#ifdef LATENT
layout(constant_id = 4) const uint DV = 512;  // value dims: the first DV of each K row
#define VD4 (DV / 4u)
#else
#define VD4 HD4
#endif
const uint NRG = WG / VD4;                   // row groups of phase C
const uint RPT = (ROWS + NRG - 1u) / NRG;    // rows per lane in phase C
const float MASKED = -1.0e30;

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

shared vec4 qs[ROWS * HD4];  // the rows' queries, scaled; row r = token r / G, head r % G
shared float sp[ROWS * BC];  // a tile's scores, then its softmax weights
shared float row_l[ROWS];    // the rows' softmax sums, for the end
shared float row_c[ROWS];    // the tile's rescale of the earlier accumulation
shared uint tpos[BQ];
shared uint tseq[BQ];
#ifdef NONCAUSAL
shared uint tvis[BQ];
#endif

uint ring_row(uint p) {
    if (p >= pc.n_ctx) {
        p = p % pc.n_ctx;
    }
    return p;
}

uint lo_of(uint p) {
    return pc.n_swa > 0u && p + 1u > pc.n_swa ? p + 1u - pc.n_swa : 0u;
}

void main() {
    uint tid = gl_LocalInvocationID.x;
    uint t0 = gl_WorkGroupID.x * BQ;
    uint ntok = step.n_tokens;
    if (t0 >= ntok) {
        return;
    }
    uint nlive = min(BQ, ntok - t0);
    uint per_kv = pc.n_head / G / pc.n_head_kv;  // head groups per KV head
    uint hgrp = gl_WorkGroupID.y;
    uint kvh = hgrp / per_kv;
    uint h0 = hgrp * G;
    if (tid < BQ) {
        tpos[tid] = tid < nlive ? STEP_POS(t0 + tid) : 0u;
        tseq[tid] = tid < nlive ? STEP_SEQ(t0 + tid) : 0xFFFFFFFFu;
#ifdef NONCAUSAL
        tvis[tid] = tid < nlive ? STEP_VIS(t0 + tid) : 0u;
#ifdef SYMMETRIC
        if (tid < nlive && pc.n_swa > 0u) {
            tvis[tid] = min(tvis[tid], tpos[tid] + pc.n_swa - 1u);
        }
#endif
#endif
    }
    for (uint i = tid; i < ROWS * HD4; i += WG) {
        uint r = i / HD4;
        uint d = i % HD4;
        uint tk = r / G;
        vec4 v = vec4(0.0);
        if (tk < nlive) {
            uint qb = (t0 + tk) * pc.q_stride + (h0 + r % G) * HD + 4u * d;
            v = vec4(q[qb], q[qb + 1u], q[qb + 2u], q[qb + 3u]) * pc.scale;
        }
        qs[i] = v;
    }
    barrier();

    uint k_row = kv_row_words(K_TYPE, pc.kv_dim);
    uint v_row = kv_row_words(V_TYPE, pc.kv_dim);
    uint k_head = kvh * kv_row_words(K_TYPE, HD);
    uint v_head = kvh * kv_row_words(V_TYPE, HD);

    // phase A: key c, quarter qq; phase B: row rb, quarter qq; phase C: row group rg, dims d4
    uint c = tid >> 2;
    uint qq = tid & 3u;
    uint rb = tid >> 2;
    uint d4 = tid % VD4;
    uint rg = tid / VD4;
    bool clane = rg < NRG;
    // the running max and sum of row rb, the same in its four lanes
    float m_run = MASKED;
    float l_run = 0.0;

    vec4 acc[RPT];
    [[unroll]] for (uint i = 0; i < RPT; i++) {
        acc[i] = vec4(0.0);
    }
    uint live_mask = nlive >= 32u ? 0xFFFFFFFFu : (1u << nlive) - 1u;
    uint done = 0u;
    // one pass per sequence among the tile's tokens (almost always one); every value
    // that steers the loops is read from shared memory, so control flow is uniform
    while (done != live_mask) {
        uint first = findLSB(live_mask & ~done);
        uint s = tseq[first];
        uint cur = 0u;
        uint pmin = 0xFFFFFFFFu;
        uint pmax = 0u;
        uint lomin = 0xFFFFFFFFu;
        uint lomax = 0u;
        for (uint i = first; i < nlive; i++) {
            if (tseq[i] == s) {
                uint p = tpos[i];
                cur |= 1u << i;
#ifdef NONCAUSAL
                // pmin / pmax: the lowest and highest of the rows' highest visible positions
                pmin = min(pmin, tvis[i]);
                pmax = max(pmax, tvis[i]);
#else
                pmin = min(pmin, p);
                pmax = max(pmax, p);
#endif
                lomin = min(lomin, lo_of(p));
                lomax = max(lomax, lo_of(p));
            }
        }
        bool one_seq = cur == live_mask && nlive == BQ;
        uint base = s * pc.n_ctx;
        // this split's key tiles [kb0, kb1) of [lomin, pmax] (as attn_prefill_cm.comp)
        uint ntl = (pmax - lomin) / BC + 1u;
        uint per = max(pc.min_tiles, (ntl + pc.n_split - 1u) / pc.n_split);
        uint kb0 = lomin + min(ntl, gl_WorkGroupID.z * per) * BC;
        uint kb1 = min(pmax + 1u, lomin + min(ntl, (gl_WorkGroupID.z + 1u) * per) * BC);
        for (uint k0 = kb0; k0 < kb1; k0 += BC) {
            uint kn = min(BC, kb1 - k0);
            bool full = one_seq && k0 + BC - 1u <= pmin && k0 >= lomax;

            // (A) scores of key c against every row, a quarter of the dims per lane
            float sc[ROWS];
            [[unroll]] for (uint r = 0; r < ROWS; r++) {
                sc[r] = 0.0;
            }
            if (c < kn) {
                uint kb = (base + ring_row(k0 + c)) * k_row + k_head;
                for (uint j = 0; j < HD4 / 4u; j++) {
                    uint d = 4u * j + qq;
                    vec4 kv = k_load4(kb, 4u * d);
                    [[unroll]] for (uint r = 0; r < ROWS; r++) {
                        sc[r] += dot(qs[r * HD4 + d], kv);
                    }
                }
            }
            [[unroll]] for (uint r = 0; r < ROWS; r++) {
                sc[r] += subgroupShuffleXor(sc[r], 1u);
                sc[r] += subgroupShuffleXor(sc[r], 2u);
            }
            [[unroll]] for (uint r = 0; r < ROWS; r++) {
                if ((r & 3u) == qq) {
                    sp[r * BC + c] = sc[r];
                }
            }
            barrier();

            // (B) the online softmax of row rb, eight keys per lane
            float mx = MASKED;
            float sv[BC / 4u];
            bool vis[BC / 4u];
            uint tk = rb / G;
            bool row_in = rb < ROWS && tk < nlive && (cur & (1u << tk)) != 0u;
            uint p = row_in ? tpos[tk] : 0u;
            uint lo = lo_of(p);
#ifdef NONCAUSAL
            uint hi = row_in ? tvis[tk] : 0u;
#else
#define hi p
#endif
            [[unroll]] for (uint i = 0; i < BC / 4u; i++) {
                uint kk = qq * (BC / 4u) + i;
                uint kp = k0 + kk;
                vis[i] = row_in && (full || (kk < kn && kp <= hi && kp >= lo));
                sv[i] = vis[i] ? sp[rb * BC + kk] : MASKED;
                mx = max(mx, sv[i]);
            }
#ifndef NONCAUSAL
#undef hi
#endif
            mx = max(mx, subgroupShuffleXor(mx, 1u));
            mx = max(mx, subgroupShuffleXor(mx, 2u));
            float m_new = max(m_run, mx);
            float sum = 0.0;
            [[unroll]] for (uint i = 0; i < BC / 4u; i++) {
                float w = vis[i] ? exp(sv[i] - m_new) : 0.0;
                if (rb < ROWS) {
                    sp[rb * BC + qq * (BC / 4u) + i] = w;
                }
                sum += w;
            }
            sum += subgroupShuffleXor(sum, 1u);
            sum += subgroupShuffleXor(sum, 2u);
            float corr = exp(m_run - m_new);
            l_run = l_run * corr + sum;
            m_run = m_new;
            if (rb < ROWS && qq == 0u) {
                row_c[rb] = corr;
            }
            barrier();

            // (C) acc += P V for this lane's rows and dims
            [[unroll]] for (uint i = 0; i < RPT; i++) {
                uint r = rg + NRG * i;
                if (r < ROWS) {
                    acc[i] *= row_c[r];
                }
            }
            for (uint kk = 0; clane && kk < kn; kk++) {
                vec4 vv = v_load4((base + ring_row(k0 + kk)) * v_row + v_head, 4u * d4);
                [[unroll]] for (uint i = 0; i < RPT; i++) {
                    uint r = rg + NRG * i;
                    if (r < ROWS) {
                        acc[i] += sp[r * BC + kk] * vv;
                    }
                }
            }
            barrier();
        }
        done |= cur;
    }
    bool split = pc.n_split > 1u;  // partials out, unnormalised, with (m, l)
    if (rb < ROWS && qq == 0u) {
        row_l[rb] = split ? 1.0 : l_run;
        if (split && rb / G < nlive) {
            uint mb = pc.ml_off + (((t0 + rb / G) * pc.n_head + h0 + rb % G) * pc.n_split + gl_WorkGroupID.z) * 2u;
            partial[mb] = m_run;
            partial[mb + 1u] = l_run;
        }
    }
    barrier();

    [[unroll]] for (uint i = 0; i < RPT; i++) {
        uint r = rg + NRG * i;
        uint tk = r / G;
        if (clane && r < ROWS && tk < nlive) {
            vec4 v = acc[i] / row_l[r];
            if (split) {
                uint pb = (((t0 + tk) * pc.n_head + h0 + r % G) * pc.n_split + gl_WorkGroupID.z) * HD + 4u * d4;
                partial[pb] = v.x;
                partial[pb + 1u] = v.y;
                partial[pb + 2u] = v.z;
                partial[pb + 3u] = v.w;
            } else {
                uint ob = (t0 + tk) * pc.o_stride + (h0 + r % G) * HD + 4u * d4;
                o[ob] = v.x;
                o[ob + 1u] = v.y;
                o[ob + 2u] = v.z;
                o[ob + 3u] = v.w;
            }
        }
    }
}

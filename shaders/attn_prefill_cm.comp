#version 450
// attn_prefill.comp on cooperative matrices (VK_KHR_cooperative_matrix, 16x16x16 f16 x
// f16 -> f32 at subgroup scope): the same tiling, masks, passes per sequence and cache
// reads, with Q K^T and P V as matrix products. A work group of WG lanes (SG-lane
// subgroups) owns R = BQ * G query rows (a multiple of 16) and walks key tiles of BC = 32:
//   1. the K tile is dequantized to f16 in shared memory (zeros past the live keys),
//      loaded during the previous tile (and V during this one's products);
//   2. S = Q K^T on cooperative matrices (Q in f16, scaled first, as llama.cpp's GPU
//      flash attention converts it), stored to shared memory in f32;
//   3. WG / R lanes per row take the online softmax in f32 and write P in f16, while
//      the V tile replaces the K tile;
//   4. o = o * corr + P V with the output in accumulators, scaled per row by an
//      accumulator of the rows' rescales (a component-wise product); with CM_STAGE the
//      output stays in plain registers instead and each P V block goes through the
//      subgroup's staging slice of shared memory (one more write and read per block).
// Fully masked key tiles are never visited; fully visible ones skip the mask.
// With n_split > 1 the key tiles of each pass are split over the grid's z (more work
// groups at depth, where one per query tile leaves the GPU half idle): each writes its
// rows' unnormalised output and (m, l) to partial[], which attn_combine.comp adds up.
//
// CM_EMULATE (tests only): the two products computed by plain lanes from the same shared
// arrays, into the same 16x16 blocks, with "subgroups" of SG consecutive lanes and work-
// group barriers for theirs, so a device without cooperative matrices (lavapipe) checks
// every other part of this kernel (tiles, masks, passes, softmax, staging, ownership).
#ifndef CM_EMULATE
#extension GL_KHR_cooperative_matrix : require
#extension GL_KHR_memory_scope_semantics : require
#ifndef CM_STAGE
#define O_IN_ACC 1
#endif
#endif
#extension GL_EXT_shader_explicit_arithmetic_types_float16 : require
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
layout(constant_id = 2) const uint BQ = 16;  // tokens per work group
layout(constant_id = 3) const uint HD = 64;  // head_dim, a multiple of 16
layout(constant_id = 4) const uint SG = 32;  // subgroup size (32 or 64)
const uint R = G * BQ;          // query rows, a multiple of 16 dividing WG
const uint BC = 32;             // keys per tile
const uint NSG = WG / SG;       // subgroups
const uint LPR = WG / R;        // softmax lanes per row
const uint KPL = BC / LPR;      // keys per softmax lane
const uint QS = HD + 8u;        // f16 row strides (16-byte aligned rows, fewer bank conflicts)
const uint KS = HD + 8u;
const uint PS = BC + 8u;
const uint SS = BC + 4u;        // f32 score row stride
const uint NTS = (R / 16u) * (BC / 16u);  // 16x16 blocks of S
const uint NTO = (R / 16u) * (HD / 16u);  // 16x16 blocks of the output
const uint OT = (NTO + NSG - 1u) / NSG;   // output blocks per subgroup
const uint EPL = 256u / SG;               // elements of a block per lane
const uint NLD = BC * HD / 4u / WG;       // K (or V) loads of four values per lane and tile
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

shared float16_t qs[R * QS];    // [row][dim], matrix A of S
shared float16_t kvs[BC * KS];  // the K tile [key][dim] (B of S, column-major), then V (B of P V, row-major)
const uint SS_N = R * SS > NSG * 256u ? R * SS : NSG * 256u;  // it stages the output too
shared float ss[SS_N];          // S [row][key]
shared float16_t ps[R * PS];    // P [row][key], matrix A of P V
#ifdef O_IN_ACC
shared float cb[R * 16u];       // the rows' rescales (then 1 / their sums), 16 columns of each
#define stage ss                // the scores' array stages the final output blocks
#else
shared float stage[NSG * 256u]; // each subgroup's 16x16 block of P V
#endif
shared float row_c[R];          // the tile's rescale per row
shared float row_l[R];
shared uint tpos[BQ];
shared uint tseq[BQ];
shared bool tdone[BQ];

#ifdef CM_EMULATE
#define SG_ID (gl_LocalInvocationID.x / SG)
#define SG_LANE (gl_LocalInvocationID.x % SG)
#define SG_SYNC() barrier()
#else
#define SG_ID gl_SubgroupID
#define SG_LANE gl_SubgroupInvocationID
#define SG_SYNC() subgroupMemoryBarrierShared(); subgroupBarrier()
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
    uint per_kv = pc.n_head / G / pc.n_head_kv;
    uint hgrp = gl_WorkGroupID.y;
    uint kvh = hgrp / per_kv;
    uint h0 = hgrp * G;
    uint sg = SG_ID;
    uint lane = SG_LANE;
    for (uint i = tid; i < BQ; i += WG) {
        tpos[i] = i < nlive ? STEP_POS(t0 + i) : 0u;
        tseq[i] = i < nlive ? STEP_SEQ(t0 + i) : 0xFFFFFFFFu;
        tdone[i] = i >= nlive;
    }
    for (uint i = tid; i < R * (HD / 4u); i += WG) {
        uint r = i / (HD / 4u);
        uint d = 4u * (i % (HD / 4u));
        uint tk = r / G;
        vec4 v = vec4(0.0);
        if (tk < nlive) {
            uint qb = (t0 + tk) * pc.q_stride + (h0 + r % G) * HD + d;
            v = vec4(q[qb], q[qb + 1u], q[qb + 2u], q[qb + 3u]) * pc.scale;
        }
        qs[r * QS + d] = float16_t(v.x);
        qs[r * QS + d + 1u] = float16_t(v.y);
        qs[r * QS + d + 2u] = float16_t(v.z);
        qs[r * QS + d + 3u] = float16_t(v.w);
    }
    barrier();

    uint k_row = kv_row_words(K_TYPE, pc.kv_dim);
    uint v_row = kv_row_words(V_TYPE, pc.kv_dim);
    uint k_head = kvh * kv_row_words(K_TYPE, HD);
    uint v_head = kvh * kv_row_words(V_TYPE, HD);

    uint rb = tid / LPR;  // softmax row of this lane
    uint part = tid % LPR;
    float m_run = MASKED;
    float l_run = 0.0;
#ifdef O_IN_ACC
    coopmat<float, gl_ScopeSubgroup, 16, 16, gl_MatrixUseAccumulator> oc[OT];
    [[unroll]] for (uint j = 0; j < OT; j++) {
        oc[j] = coopmat<float, gl_ScopeSubgroup, 16, 16, gl_MatrixUseAccumulator>(0.0);
    }
#endif
    float oacc[OT * EPL];
    f16vec4 kpre[NLD];  // K of the next tile, V of this one, on their way to shared memory
    f16vec4 vpre[NLD];
    [[unroll]] for (uint i = 0; i < OT * EPL; i++) {
        oacc[i] = 0.0;
    }

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
        uint base = s * pc.n_ctx;
        // this split's key tiles [kb0, kb1) of the pass's [lomin, pmax]: chunks of at
        // least min_tiles, so a short range is one split and the others get none
        uint ntl = (pmax - lomin) / BC + 1u;
        uint per = max(pc.min_tiles, (ntl + pc.n_split - 1u) / pc.n_split);
        uint kb0 = lomin + min(ntl, gl_WorkGroupID.z * per) * BC;
        uint kb1 = min(pmax + 1u, lomin + min(ntl, (gl_WorkGroupID.z + 1u) * per) * BC);
        // the first tile's K in registers (then each tile loads the next one's)
        [[unroll]] for (uint n = 0; n < NLD; n++) {
            uint c = (tid + WG * n) / (HD / 4u);
            uint d = 4u * ((tid + WG * n) % (HD / 4u));
            kpre[n] = f16vec4(kb0 + c < kb1 ? k_load4((base + ring_row(kb0 + c)) * k_row + k_head, d) : vec4(0.0));
        }
        for (uint k0 = kb0; k0 < kb1; k0 += BC) {
            uint kn = min(BC, kb1 - k0);
            bool full = one_seq && k0 + BC - 1u <= pmin && k0 >= lomax;

            // 1. the K tile into shared memory; this tile's V and the next tile's K into
            // registers, their loads in flight during the products and the softmax
            uint k1 = k0 + BC;
            uint kn1 = k1 < kb1 ? min(BC, kb1 - k1) : 0u;
            [[unroll]] for (uint n = 0; n < NLD; n++) {
                uint c = (tid + WG * n) / (HD / 4u);
                uint d = 4u * ((tid + WG * n) % (HD / 4u));
                kvs[c * KS + d] = kpre[n].x;
                kvs[c * KS + d + 1u] = kpre[n].y;
                kvs[c * KS + d + 2u] = kpre[n].z;
                kvs[c * KS + d + 3u] = kpre[n].w;
                vpre[n] = f16vec4(c < kn ? v_load4((base + ring_row(k0 + c)) * v_row + v_head, d) : vec4(0.0));
                if (kn1 > 0u) {
                    kpre[n] = f16vec4(c < kn1 ? k_load4((base + ring_row(k1 + c)) * k_row + k_head, d) : vec4(0.0));
                }
            }
            barrier();

            // 2. S = Q K^T
            for (uint b = sg; b < NTS; b += NSG) {
                uint mt = b / (BC / 16u);
                uint nt = b % (BC / 16u);
#ifdef CM_EMULATE
                for (uint e = 0; e < EPL; e++) {
                    uint r = mt * 16u + (lane + SG * e) / 16u;
                    uint kc = nt * 16u + (lane + SG * e) % 16u;
                    float a = 0.0;
                    for (uint d = 0; d < HD; d++) {
                        a += float(qs[r * QS + d]) * float(kvs[kc * KS + d]);
                    }
                    ss[r * SS + kc] = a;
                }
#else
                coopmat<float, gl_ScopeSubgroup, 16, 16, gl_MatrixUseAccumulator> acc =
                    coopmat<float, gl_ScopeSubgroup, 16, 16, gl_MatrixUseAccumulator>(0.0);
                [[unroll]] for (uint kk = 0; kk < HD; kk += 16u) {
                    coopmat<float16_t, gl_ScopeSubgroup, 16, 16, gl_MatrixUseA> ma;
                    coopmat<float16_t, gl_ScopeSubgroup, 16, 16, gl_MatrixUseB> mb;
                    coopMatLoad(ma, qs, mt * 16u * QS + kk, QS, gl_CooperativeMatrixLayoutRowMajor);
                    coopMatLoad(mb, kvs, nt * 16u * KS + kk, KS, gl_CooperativeMatrixLayoutColumnMajor);
                    acc = coopMatMulAdd(ma, mb, acc);
                }
                coopMatStore(acc, ss, mt * 16u * SS + nt * 16u, SS, gl_CooperativeMatrixLayoutRowMajor);
#endif
            }
            barrier();

            // 3. the V tile (K is no longer read) and the online softmax
            [[unroll]] for (uint n = 0; n < NLD; n++) {
                uint c = (tid + WG * n) / (HD / 4u);
                uint d = 4u * ((tid + WG * n) % (HD / 4u));
                kvs[c * KS + d] = vpre[n].x;
                kvs[c * KS + d + 1u] = vpre[n].y;
                kvs[c * KS + d + 2u] = vpre[n].z;
                kvs[c * KS + d + 3u] = vpre[n].w;
            }
            uint tk = rb / G;
            bool row_in = tk < nlive && tseq[tk] == s;
            uint p = row_in ? tpos[tk] : 0u;
            uint lo = lo_of(p);
            float sv[KPL];
            bool vis[KPL];
            float mx = MASKED;
            [[unroll]] for (uint i = 0; i < KPL; i++) {
                uint kk = part * KPL + i;
                uint kp = k0 + kk;
                vis[i] = row_in && (full || (kk < kn && kp <= p && kp >= lo));
                sv[i] = vis[i] ? ss[rb * SS + kk] : MASKED;
                mx = max(mx, sv[i]);
            }
            [[unroll]] for (uint off = 1u; off < LPR; off <<= 1) {
                mx = max(mx, subgroupShuffleXor(mx, off));
            }
            float m_new = max(m_run, mx);
            float sum = 0.0;
            [[unroll]] for (uint i = 0; i < KPL; i++) {
                float w = vis[i] ? exp(sv[i] - m_new) : 0.0;
                ps[rb * PS + part * KPL + i] = float16_t(w);
                sum += w;
            }
            [[unroll]] for (uint off = 1u; off < LPR; off <<= 1) {
                sum += subgroupShuffleXor(sum, off);
            }
            float corr = exp(m_run - m_new);
            l_run = l_run * corr + sum;
            m_run = m_new;
            if (part == 0u) {
                row_c[rb] = corr;
            }
#ifdef O_IN_ACC
            for (uint i = part; i < 16u; i += LPR) {
                cb[rb * 16u + i] = corr;
            }
#endif
            barrier();

            // 4. o = o * corr + P V, block by block
            [[unroll]] for (uint j = 0; j < OT; j++) {
                uint b = sg + NSG * j;
                if (b < NTO) {
                    uint mt = b / (HD / 16u);
                    uint nt = b % (HD / 16u);
#ifdef O_IN_ACC
                    coopmat<float, gl_ScopeSubgroup, 16, 16, gl_MatrixUseAccumulator> cm;
                    coopMatLoad(cm, cb, mt * 256u, 16u, gl_CooperativeMatrixLayoutRowMajor);
                    oc[j] = oc[j] * cm;
                    [[unroll]] for (uint kk = 0; kk < BC; kk += 16u) {
                        coopmat<float16_t, gl_ScopeSubgroup, 16, 16, gl_MatrixUseA> ma;
                        coopmat<float16_t, gl_ScopeSubgroup, 16, 16, gl_MatrixUseB> mb;
                        coopMatLoad(ma, ps, mt * 16u * PS + kk, PS, gl_CooperativeMatrixLayoutRowMajor);
                        coopMatLoad(mb, kvs, kk * KS + nt * 16u, KS, gl_CooperativeMatrixLayoutRowMajor);
                        oc[j] = coopMatMulAdd(ma, mb, oc[j]);
                    }
#else
#ifdef CM_EMULATE
                    for (uint e = 0; e < EPL; e++) {
                        uint idx = lane + SG * e;
                        float a = 0.0;
                        for (uint kk = 0; kk < BC; kk++) {
                            a += float(ps[(mt * 16u + idx / 16u) * PS + kk]) * float(kvs[kk * KS + nt * 16u + idx % 16u]);
                        }
                        stage[sg * 256u + idx] = a;
                    }
#else
                    coopmat<float, gl_ScopeSubgroup, 16, 16, gl_MatrixUseAccumulator> acc =
                        coopmat<float, gl_ScopeSubgroup, 16, 16, gl_MatrixUseAccumulator>(0.0);
                    [[unroll]] for (uint kk = 0; kk < BC; kk += 16u) {
                        coopmat<float16_t, gl_ScopeSubgroup, 16, 16, gl_MatrixUseA> ma;
                        coopmat<float16_t, gl_ScopeSubgroup, 16, 16, gl_MatrixUseB> mb;
                        coopMatLoad(ma, ps, mt * 16u * PS + kk, PS, gl_CooperativeMatrixLayoutRowMajor);
                        coopMatLoad(mb, kvs, kk * KS + nt * 16u, KS, gl_CooperativeMatrixLayoutRowMajor);
                        acc = coopMatMulAdd(ma, mb, acc);
                    }
                    coopMatStore(acc, stage, sg * 256u, 16u, gl_CooperativeMatrixLayoutRowMajor);
#endif
                    SG_SYNC();
                    [[unroll]] for (uint e = 0; e < EPL; e++) {
                        uint idx = lane + SG * e;
                        uint r = mt * 16u + idx / 16u;
                        oacc[j * EPL + e] = oacc[j * EPL + e] * row_c[r] + stage[sg * 256u + idx];
                    }
                    SG_SYNC();
#endif
                }
            }
            barrier();
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

    bool split = pc.n_split > 1u;  // partials out, unnormalised, with (m, l)
    uint rt = rb / G;
    if (split && part == 0u && rt < nlive) {
        uint mb = pc.ml_off + (((t0 + rt) * pc.n_head + h0 + rb % G) * pc.n_split + gl_WorkGroupID.z) * 2u;
        partial[mb] = m_run;
        partial[mb + 1u] = l_run;
    }
    if (part == 0u) {
        row_l[rb] = split ? 1.0 : l_run;
    }
#ifdef O_IN_ACC
    for (uint i = part; i < 16u; i += LPR) {
        cb[rb * 16u + i] = split ? 1.0 : l_run;
    }
#endif
    barrier();
    [[unroll]] for (uint j = 0; j < OT; j++) {
        uint b = sg + NSG * j;
        if (b < NTO) {
            uint mt = b / (HD / 16u);
            uint nt = b % (HD / 16u);
#ifdef O_IN_ACC
            // o / l, then through the subgroup's slice of the scores' array to the rows
            coopmat<float, gl_ScopeSubgroup, 16, 16, gl_MatrixUseAccumulator> lm;
            coopMatLoad(lm, cb, mt * 256u, 16u, gl_CooperativeMatrixLayoutRowMajor);
            oc[j] = oc[j] / lm;
            coopMatStore(oc[j], stage, sg * 256u, 16u, gl_CooperativeMatrixLayoutRowMajor);
            SG_SYNC();
            [[unroll]] for (uint e = 0; e < EPL; e++) {
                uint idx = lane + SG * e;
                uint r = mt * 16u + idx / 16u;
                uint tk = r / G;
                if (tk < nlive) {
                    float v = stage[sg * 256u + idx];
                    if (split) {
                        partial[(((t0 + tk) * pc.n_head + h0 + r % G) * pc.n_split + gl_WorkGroupID.z) * HD
                             + nt * 16u + idx % 16u] = v;
                    } else {
                        o[(t0 + tk) * pc.o_stride + (h0 + r % G) * HD + nt * 16u + idx % 16u] = v;
                    }
                }
            }
            SG_SYNC();
#else
            [[unroll]] for (uint e = 0; e < EPL; e++) {
                uint idx = lane + SG * e;
                uint r = mt * 16u + idx / 16u;
                uint tk = r / G;
                if (tk < nlive) {
                    float v = oacc[j * EPL + e] / row_l[r];
                    if (split) {
                        partial[(((t0 + tk) * pc.n_head + h0 + r % G) * pc.n_split + gl_WorkGroupID.z) * HD
                             + nt * 16u + idx % 16u] = v;
                    } else {
                        o[(t0 + tk) * pc.o_stride + (h0 + r % G) * HD + nt * 16u + idx % 16u] = v;
                    }
                }
            }
#endif
        }
    }
}

#version 450
// attn_prefill_cm.comp with each subgroup owning its query rows (FlashAttention-2's
// split of the work): the same bindings, push constants, grid, masks, passes per
// sequence, key splits and cache reads, so Ops.attention_prefill can run either. A work
// group of NSG subgroups owns R = 16 * NSG query rows (row r: token r / G, head r % G),
// subgroup i rows [16 i, 16 i + 16), and walks key tiles of BC (16, 32 or 64) keys:
//   1. the K and V tiles are dequantized to f16 into shared memory (zeros past the live
//      keys) from the registers they were loaded into during the previous tile, and the
//      next tile's loads are issued; a work-group barrier;
//   2. each subgroup, alone: S = Q K^T for its 16 rows (BC / 16 accumulators; Q scaled,
//      then f16, kept for the whole kernel as HD / 16 A fragments, staged once through
//      the subgroup's P slice 16 dims at a time), stored to its own S slice in f32; the
//      online softmax of its rows (SG / 16 lanes per row) writes P in f16 to its own P
//      slice and the rows' rescales as a 16x16 block over its S slice; its output
//      accumulators (HD / 16, kept for the whole kernel) are scaled by that block
//      (a component-wise product) and P V is added. Only subgroup barriers in between;
//   3. a work-group barrier before the next tile replaces K and V.
// Two work-group barriers per tile where attn_prefill_cm.comp has four (its products
// are spread over all subgroups, its softmax over all lanes). A subgroup whose rows see
// none of a tile's keys skips its products (its softmax leaves P = 0 and the rescale 1).
// Fully masked key tiles are never visited; fully visible ones skip the mask. With
// n_split > 1 each work group writes its rows' unnormalised output and (m, l) to
// partial[] for attn_combine.comp, as attn_prefill_cm.comp does.
//
// CM_EMULATE (tests only): the two products computed by plain lanes into the same
// 16x16 blocks of the same shared arrays (the S slice, the P slice, the K and V tiles;
// the output "accumulators" a lane's elements lane + SG * e of each block, scaled by
// the same rescale block), with "subgroups" of SG consecutive lanes and work-group
// barriers for theirs, so a device without cooperative matrices (lavapipe) checks every
// other part of this kernel (tiles, masks, windows, passes, splits, softmax, ownership,
// the skips). Q is then read from q[] by the same q_at() that fills the fragments.
#ifndef CM_EMULATE
#extension GL_KHR_cooperative_matrix : require
#extension GL_KHR_memory_scope_semantics : require
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
layout(constant_id = 5) const uint BC = 64;  // keys per tile (16, 32 or 64)
const uint R = G * BQ;          // query rows, 16 per subgroup
const uint NSG = WG / SG;       // subgroups (R / 16)
const uint LPR = SG / 16u;      // softmax lanes per row
const uint KPL = BC / LPR;      // keys per softmax lane
const uint KS = HD + 8u;        // f16 row strides (16-byte aligned rows, fewer bank conflicts)
const uint PS = BC + 8u;
const uint SS = BC + 4u;        // f32 score row stride (a slice of 16 rows holds a 16x16 block)
const uint NQ = HD / 16u;       // Q fragments, output blocks per subgroup
const uint NB = BC / 16u;       // S blocks, P fragments per subgroup
const uint EPL = 256u / SG;     // elements of a block per lane
const uint NL4 = BC * HD / 4u;  // loads of four values per K (or V) tile
const uint NLD = (NL4 + WG - 1u) / WG;  // ... per lane
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

shared float16_t ks[BC * KS];   // the K tile [key][dim] (B of S, column-major)
shared float16_t vs[BC * KS];   // the V tile [key][dim] (B of P V, row-major)
shared float ss[R * SS];        // S [row][key]; rows 16 i.. of subgroup i, whose slice then holds its rows' rescales (1 / sums, output blocks) as a [16][16] block
shared float16_t ps[R * PS];    // P [row][key] (A of P V), the same slices; first Q, 16 dims at a time
shared uint tpos[BQ];
shared uint tseq[BQ];
shared bool tdone[BQ];

#ifdef CM_EMULATE
#define SG_ID (gl_LocalInvocationID.x / SG)
#define SG_LANE (gl_LocalInvocationID.x % SG)
#define SG_SYNC() barrier()
#define UNROLL  // (lavapipe compiles the emulated form faster with its loops rolled)
#else
#define SG_ID gl_SubgroupID
#define SG_LANE gl_SubgroupInvocationID
#define SG_SYNC() subgroupMemoryBarrierShared(); subgroupBarrier()
#define UNROLL [[unroll]]
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

// row r's query (token t0 + r / G, head h0 + r % G) at dim d, scaled, in f16 (zero for
// rows past the live tokens), as attn_prefill_cm.comp rounds it
float16_t q_at(uint r, uint d, uint t0, uint nlive, uint h0) {
    uint tk = r / G;
    return tk < nlive ? float16_t(q[(t0 + tk) * pc.q_stride + (h0 + r % G) * HD + d] * pc.scale) : float16_t(0.0);
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
    uint r0 = sg * 16u;      // the subgroup's first row
    uint lr = lane / LPR;    // this lane's softmax row in the subgroup's block
    uint part = lane % LPR;
    uint row = r0 + lr;
    for (uint i = tid; i < BQ; i += WG) {
        tpos[i] = i < nlive ? STEP_POS(t0 + i) : 0u;
        tseq[i] = i < nlive ? STEP_SEQ(t0 + i) : 0xFFFFFFFFu;
        tdone[i] = i >= nlive;
    }
#ifndef CM_EMULATE
    // the subgroup's 16 rows of Q as NQ A fragments, through its P slice
    coopmat<float16_t, gl_ScopeSubgroup, 16, 16, gl_MatrixUseA> qf[NQ];
    [[unroll]] for (uint c = 0; c < NQ; c++) {
        [[unroll]] for (uint e = 0; e < EPL; e++) {
            uint idx = lane + SG * e;
            ps[(r0 + idx / 16u) * PS + idx % 16u] = q_at(r0 + idx / 16u, c * 16u + idx % 16u, t0, nlive, h0);
        }
        SG_SYNC();
        coopMatLoad(qf[c], ps, r0 * PS, PS, gl_CooperativeMatrixLayoutRowMajor);
        SG_SYNC();
    }
    coopmat<float, gl_ScopeSubgroup, 16, 16, gl_MatrixUseAccumulator> oc[NQ];
    [[unroll]] for (uint j = 0; j < NQ; j++) {
        oc[j] = coopmat<float, gl_ScopeSubgroup, 16, 16, gl_MatrixUseAccumulator>(0.0);
    }
#else
    float oacc[NQ * EPL];  // element lane + SG * e of output block j at j * EPL + e
    for (uint i = 0; i < NQ * EPL; i++) {
        oacc[i] = 0.0;
    }
#endif
    barrier();

    uint k_row = kv_row_words(K_TYPE, pc.kv_dim);
    uint v_row = kv_row_words(V_TYPE, pc.kv_dim);
    uint k_head = kvh * kv_row_words(K_TYPE, HD);
    uint v_head = kvh * kv_row_words(V_TYPE, HD);

    float m_run = MASKED;
    float l_run = 0.0;
    f16vec4 kpre[NLD];  // the next tile's K and V, on their way to shared memory
    f16vec4 vpre[NLD];

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
        // the positions this subgroup's rows see in this pass (rows r0.. are tokens
        // r0 / G ..): a tile outside [slomin, spmax] has no key for any of them
        uint spmax = 0u;
        uint slomin = 0xFFFFFFFFu;
        for (uint i = r0 / G; i <= (r0 + 15u) / G && i < BQ; i++) {
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
            kpre[n] = f16vec4(ld ? k_load4((base + ring_row(kb0 + c)) * k_row + k_head, d) : vec4(0.0));
            vpre[n] = f16vec4(ld ? v_load4((base + ring_row(kb0 + c)) * v_row + v_head, d) : vec4(0.0));
        }
        uint tk = row / G;
        bool row_in = tk < nlive && tseq[tk] == s;
        uint p = row_in ? tpos[tk] : 0u;
        uint lo = lo_of(p);
        for (uint k0 = kb0; k0 < kb1; k0 += BC) {
            uint kn = min(BC, kb1 - k0);
            bool full = one_seq && k0 + BC - 1u <= pmin && k0 >= lomax;
            bool act = slomin <= k0 + kn - 1u && k0 <= spmax;  // uniform in the subgroup

            // 1. the K and V tiles into shared memory; the next tile's into registers,
            // their loads in flight during this tile's products and softmax
            uint k1 = k0 + BC;
            uint kn1 = k1 < kb1 ? min(BC, kb1 - k1) : 0u;
            UNROLL for (uint n = 0; n < NLD; n++) {
                uint i = tid + WG * n;
                uint c = i / (HD / 4u);
                uint d = 4u * (i % (HD / 4u));
                if (i < NL4) {
                    ks[c * KS + d] = kpre[n].x;
                    ks[c * KS + d + 1u] = kpre[n].y;
                    ks[c * KS + d + 2u] = kpre[n].z;
                    ks[c * KS + d + 3u] = kpre[n].w;
                    vs[c * KS + d] = vpre[n].x;
                    vs[c * KS + d + 1u] = vpre[n].y;
                    vs[c * KS + d + 2u] = vpre[n].z;
                    vs[c * KS + d + 3u] = vpre[n].w;
                    if (kn1 > 0u) {
                        bool ld = c < kn1;
                        kpre[n] = f16vec4(ld ? k_load4((base + ring_row(k1 + c)) * k_row + k_head, d) : vec4(0.0));
                        vpre[n] = f16vec4(ld ? v_load4((base + ring_row(k1 + c)) * v_row + v_head, d) : vec4(0.0));
                    }
                }
            }
            barrier();

            // 2a. S = Q K^T for the subgroup's rows, into its S slice
            if (act) {
#ifdef CM_EMULATE
                for (uint nt = 0; nt < NB; nt++) {
                    for (uint e = 0; e < EPL; e++) {
                        uint idx = lane + SG * e;
                        uint kc = nt * 16u + idx % 16u;
                        float a = 0.0;
                        for (uint d = 0; d < HD; d++) {
                            a += float(q_at(r0 + idx / 16u, d, t0, nlive, h0)) * float(ks[kc * KS + d]);
                        }
                        ss[(r0 + idx / 16u) * SS + kc] = a;
                    }
                }
#else
                [[unroll]] for (uint nt = 0; nt < NB; nt++) {
                    coopmat<float, gl_ScopeSubgroup, 16, 16, gl_MatrixUseAccumulator> acc =
                        coopmat<float, gl_ScopeSubgroup, 16, 16, gl_MatrixUseAccumulator>(0.0);
                    [[unroll]] for (uint c = 0; c < NQ; c++) {
                        coopmat<float16_t, gl_ScopeSubgroup, 16, 16, gl_MatrixUseB> mb;
                        coopMatLoad(mb, ks, nt * 16u * KS + c * 16u, KS, gl_CooperativeMatrixLayoutColumnMajor);
                        acc = coopMatMulAdd(qf[c], mb, acc);
                    }
                    coopMatStore(acc, ss, r0 * SS + nt * 16u, SS, gl_CooperativeMatrixLayoutRowMajor);
                }
#endif
            }
            SG_SYNC();

            // 2b. the online softmax of the subgroup's rows (LPR lanes per row)
            float sv[KPL];
            bool vis[KPL];
            float mx = MASKED;
            UNROLL for (uint i = 0; i < KPL; i++) {
                uint kk = part * KPL + i;
                uint kp = k0 + kk;
                vis[i] = row_in && (full || (kk < kn && kp <= p && kp >= lo));
                sv[i] = vis[i] ? ss[row * SS + kk] : MASKED;
                mx = max(mx, sv[i]);
            }
            UNROLL for (uint off = 1u; off < LPR; off <<= 1) {
                mx = max(mx, subgroupShuffleXor(mx, off));
            }
            float m_new = max(m_run, mx);
            float sum = 0.0;
            UNROLL for (uint i = 0; i < KPL; i++) {
                float w = vis[i] ? exp(sv[i] - m_new) : 0.0;
                ps[row * PS + part * KPL + i] = float16_t(w);
                sum += w;
            }
            UNROLL for (uint off = 1u; off < LPR; off <<= 1) {
                sum += subgroupShuffleXor(sum, off);
            }
            float corr = exp(m_run - m_new);
            l_run = l_run * corr + sum;
            m_run = m_new;
            SG_SYNC();  // S is read: its slice takes the rows' rescales
            for (uint i = part; i < 16u; i += LPR) {
                ss[r0 * SS + lr * 16u + i] = corr;
            }
            SG_SYNC();

            // 2c. o = o * corr + P V for the subgroup's rows
            if (act) {
#ifdef CM_EMULATE
                for (uint j = 0; j < NQ; j++) {
                    for (uint e = 0; e < EPL; e++) {
                        uint idx = lane + SG * e;
                        float a = oacc[j * EPL + e] * ss[r0 * SS + idx];
                        for (uint kk = 0; kk < BC; kk++) {
                            a += float(ps[(r0 + idx / 16u) * PS + kk]) * float(vs[kk * KS + j * 16u + idx % 16u]);
                        }
                        oacc[j * EPL + e] = a;
                    }
                }
#else
                coopmat<float, gl_ScopeSubgroup, 16, 16, gl_MatrixUseAccumulator> cm;
                coopMatLoad(cm, ss, r0 * SS, 16u, gl_CooperativeMatrixLayoutRowMajor);
                coopmat<float16_t, gl_ScopeSubgroup, 16, 16, gl_MatrixUseA> pa[NB];
                [[unroll]] for (uint kk = 0; kk < NB; kk++) {
                    coopMatLoad(pa[kk], ps, r0 * PS + kk * 16u, PS, gl_CooperativeMatrixLayoutRowMajor);
                }
                [[unroll]] for (uint j = 0; j < NQ; j++) {
                    oc[j] = oc[j] * cm;
                    [[unroll]] for (uint kk = 0; kk < NB; kk++) {
                        coopmat<float16_t, gl_ScopeSubgroup, 16, 16, gl_MatrixUseB> mb;
                        coopMatLoad(mb, vs, kk * 16u * KS + j * 16u, KS, gl_CooperativeMatrixLayoutRowMajor);
                        oc[j] = coopMatMulAdd(pa[kk], mb, oc[j]);
                    }
                }
#endif
            }
            // 3. every subgroup is done with this K and V before the next tile's
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
    uint rt = row / G;
    if (split && part == 0u && rt < nlive) {
        uint mb = pc.ml_off + (((t0 + rt) * pc.n_head + h0 + row % G) * pc.n_split + gl_WorkGroupID.z) * 2u;
        partial[mb] = m_run;
        partial[mb + 1u] = l_run;
    }
    // o / l per row (the sums as a 16x16 block), each block through the S slice
    for (uint i = part; i < 16u; i += LPR) {
        ss[r0 * SS + lr * 16u + i] = split ? 1.0 : l_run;
    }
    SG_SYNC();
#ifdef CM_EMULATE
    float lv[EPL];
    for (uint e = 0; e < EPL; e++) {
        lv[e] = ss[r0 * SS + lane + SG * e];
    }
#else
    coopmat<float, gl_ScopeSubgroup, 16, 16, gl_MatrixUseAccumulator> lm;
    coopMatLoad(lm, ss, r0 * SS, 16u, gl_CooperativeMatrixLayoutRowMajor);
#endif
    SG_SYNC();
    UNROLL for (uint j = 0; j < NQ; j++) {
#ifdef CM_EMULATE
        for (uint e = 0; e < EPL; e++) {
            ss[r0 * SS + lane + SG * e] = oacc[j * EPL + e] / lv[e];
        }
#else
        oc[j] = oc[j] / lm;
        coopMatStore(oc[j], ss, r0 * SS, 16u, gl_CooperativeMatrixLayoutRowMajor);
#endif
        SG_SYNC();
        UNROLL for (uint e = 0; e < EPL; e++) {
            uint idx = lane + SG * e;
            uint r = r0 + idx / 16u;
            uint tko = r / G;
            if (tko < nlive) {
                float v = ss[r0 * SS + idx];
                if (split) {
                    partial[(((t0 + tko) * pc.n_head + h0 + r % G) * pc.n_split + gl_WorkGroupID.z) * HD
                         + j * 16u + idx % 16u] = v;
                } else {
                    o[(t0 + tko) * pc.o_stride + (h0 + r % G) * HD + j * 16u + idx % 16u] = v;
                }
            }
        }
        SG_SYNC();
    }
}

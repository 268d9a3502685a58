#version 450
// Prefill attention on VK_NV_cooperative_matrix2 (FlashAttention-2 on workgroup-scope
// matrices): the op of attn_prefill_cm2.comp with the same bindings, push constants (12
// words), grid (ceil(cap / BQ), n_head / G, n_split), step-buffer passes, ring rows,
// windows, causal masks, key splits with (m, l) partials for attn_combine.comp, and
// cache reads, so Ops.attention_prefill runs either with no other change.
//
// What the KHR kernels lack and this one uses: matrices whose scope is the whole work
// group (the compiler spreads an R x N matrix over the WG / 32 warps and stages it
// through shared memory where it must), a row reduction on an accumulator
// (coopMatReduceNV: the rows' max and sum, and a per-row value "smeared" over a matrix
// of another width, which is how a row's factor reaches the R x HD output: a "smear"), and
// per-element functions that are told each element's (row, column)
// (coopMatPerElementNV: the mask, the exponentials, Q's load and the output's store).
// So S, P and the softmax state never touch shared memory by the kernel's own hand.
//
// Layout. A work group owns R = G * BQ query rows, row r = (token t0 + r / G, head
// h0 + r % G) as in attn_prefill_cm2, and walks key tiles of BC keys per pass (one pass
// per sequence among its tokens). The whole-kernel state, all workgroup-scope
// accumulators in f32:
//   Q  R x HD  (loaded once: q * scale, then f16 as an A operand, as cm2 rounds it)
//   O  R x HD  (the unnormalised output)
//   M  R x BC  (the running row max, the same in every column of a row)
//   L  R x BC  (the running row sum, likewise)
// Per key tile:
//   1. K and V in f16 into shared memory (kvs: [key][dim] rows of HD + 8 halves), from
//      registers loaded during the previous tile (PF = 1) or straight from the cache
//      (PF = 0), through kv_read.glsl for every cache type (f16 bits pass unconverted);
//      keys past the split's end are zeros. A work-group barrier.
//      With NV2_DIRECT (f16 caches only) K^T and V come from the cache itself by
//      tensor-addressed loads instead (the ring by the layout's Repeat clamp over n_ctx
//      rows, V's rows past the live keys clipped to zero), no staging of ours at all.
//   2. S = Q K^T (R x BC); the mask (a per-element function reading the rows' visible
//      key range [rlo, rhi) of this pass from shared memory) unless the tile is fully
//      visible to every row; M' = max(M, rowmax S); P = exp(S - M') with masked
//      elements 0; e = exp(M - M'); L = L e + rowsum P; O = O e' + P V, where e' is e
//      smeared by a row reduction onto R x HD (a component-wise product).
//   3. A work-group barrier before the next tile's K and V replace these (staged).
// At the end O / L (smeared the same way) is written by a per-element function to o[],
// or with n_split > 1 O unnormalised and (m, l) per row to partial[] (attn_combine.comp).
//
// Key tiles outside the pass's [min lo, max pos] are never visited; a tile that every
// row sees whole (all rows live and of one sequence, the tile within every row's
// window) skips the mask. Rows of other sequences (and past the live tokens) see no
// key in a pass: their S is all masked, P = 0 and e = 1, so their state stands.
//
// Specialization: 0 WG (lanes, a multiple of 32 within the device's
// cooperativeMatrixWorkgroupScopeMaxWorkgroupSize), 1 G, 2 BQ, 3 HD (64, 128, 256), 5 BC
// (32 or 64), 6 PF, 7 RSUM_MMA (the rows' sums of P: 0 a row reduction per tile; 1 a product
// with a BC x BC matrix of ones, tensor-core work instead of shuffles; 2 none per tile: L kept
// per column, L = L e + P element-wise, and its rows added up once at the end). Defines: K_TYPE, V_TYPE (kv.glsl's codes), NV2_DIRECT (K_TYPE =
// V_TYPE = f16). Ops.prefill_nv2_plan chooses them.
#extension GL_KHR_cooperative_matrix : require
#extension GL_NV_cooperative_matrix2 : require
#extension GL_KHR_memory_scope_semantics : require
#extension GL_EXT_shader_explicit_arithmetic_types_float16 : require
#include "common.glsl"

#ifndef K_TYPE
#define K_TYPE 0
#endif
#ifndef V_TYPE
#define V_TYPE 0
#endif
#ifndef NV2_DIRECT
#define NV2_DIRECT 0
#endif

layout(binding = 0, std430) readonly buffer Q { float q[]; };
layout(binding = 1, std430) readonly buffer K { vec4 kc4[]; };
layout(binding = 1, std430) readonly buffer K2 { uvec2 kc2[]; };
layout(binding = 1, std430) readonly buffer K16 { uint16_t kc16[]; };
layout(binding = 1, std430) readonly buffer KH { float16_t kh[]; };
layout(binding = 2, std430) readonly buffer V { vec4 vc4[]; };
layout(binding = 2, std430) readonly buffer V2 { uvec2 vc2[]; };
layout(binding = 2, std430) readonly buffer V16 { uint16_t vc16[]; };
layout(binding = 2, std430) readonly buffer VH { float16_t vh[]; };
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
layout(constant_id = 3) const uint HD = 64;  // head_dim
layout(constant_id = 5) const uint BC = 64;  // keys per tile
layout(constant_id = 6) const uint PF = 1;   // 1: the next tile's K and V loaded into registers during this one
layout(constant_id = 7) const uint RSUM_MMA = 0;  // the rows' sums of P: 0 reduced, 1 P x ones, 2 per column (summed at the end)
const uint R = G * BQ;           // query rows
const uint KS4 = (HD + 8u) / 4u; // K/V row stride in f16vec4 (16-byte rows, no bank conflicts)
const uint KS = KS4 * 4u;        // ... in halves
const uint TILE4 = BC * KS4;     // one K (or V) tile in f16vec4
const uint NL4 = BC * HD / 4u;   // loads of four values per K (or V) tile
const uint NLD = (NL4 + WG - 1u) / WG;  // ... per lane
const float MASKED = -1.0e30;
const float SEEN = -1.0e29;      // scores above this are visible ones

#define MAT_S coopmat<float, gl_ScopeWorkgroup, R, BC, gl_MatrixUseAccumulator>
#define MAT_O coopmat<float, gl_ScopeWorkgroup, R, HD, gl_MatrixUseAccumulator>
#define MAT_QA coopmat<float16_t, gl_ScopeWorkgroup, R, HD, gl_MatrixUseA>
#define MAT_PA coopmat<float16_t, gl_ScopeWorkgroup, R, BC, gl_MatrixUseA>
#define MAT_KB coopmat<float16_t, gl_ScopeWorkgroup, HD, BC, gl_MatrixUseB>
#define MAT_VB coopmat<float16_t, gl_ScopeWorkgroup, BC, HD, gl_MatrixUseB>

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

#if !NV2_DIRECT
shared f16vec4 kvs[2u * TILE4];  // the K tile [key][dim], then the V tile [key][dim]
#endif
shared uint rlo[R];   // this pass: row r sees keys [rlo[r], rhi[r]) (rhi 0: none)
shared uint rhi[R];
shared uint tpos[BQ];
shared uint tseq[BQ];
shared bool tdone[BQ];

uint ring_row(uint p) {
    if (p >= pc.n_ctx) {
        p = p % pc.n_ctx;
    }
    return p;
}

uint lo_of(uint p) {
    return pc.n_swa > 0u && p + 1u > pc.n_swa ? p + 1u - pc.n_swa : 0u;
}

// four values of a K (V) row as f16 (an f16 cache's bits unconverted)
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

// --- combine functions of coopMatReduceNV (called on any elements of a row, or
// combinations of them) ---
float nv2_max(const in float a, const in float b) {
    return max(a, b);
}
float nv2_add(const in float a, const in float b) {
    return a + b;
}
// a "smear": a row's value, the same in every column of an R x BC matrix, spread over
// R x HD. Any element is the answer, so the combine keeps its first operand and the
// compiler need not compare them (llama.cpp's flash_attn_cm2 smears this way; a max of
// equal values, which this kernel did before, costs a compare per step)
float nv2_first(const in float a, const in float b) {
    return a;
}

// --- per-element functions of coopMatPerElementNV: (row, column, value, extras) ---
// Q's element: row r's query at dim c, scaled (rows past the live tokens 0)
float nv2_q(const in uint r, const in uint c, const in float v, const in uint t0, const in uint nlive,
            const in uint h0) {
    uint tk = r / G;
    return tk < nlive ? q[(t0 + tk) * pc.q_stride + (h0 + r % G) * HD + c] * pc.scale : 0.0;
}
// the mask: key k0 + c is visible to row r in this pass and below the split's end
float nv2_mask(const in uint r, const in uint c, const in float s, const in uint k0, const in uint kend) {
    uint k = k0 + c;
    return k >= rlo[r] && k < min(rhi[r], kend) ? s : MASKED;
}
// a weight: exp(s - m), 0 for a masked score (also where the row has seen nothing yet
// and m is MASKED too)
float nv2_exp(const in uint r, const in uint c, const in float s, const in float m) {
    return s > SEEN ? exp(s - m) : 0.0;
}
float nv2_exp_diff(const in uint r, const in uint c, const in float a, const in float b) {
    return exp(a - b);
}
float nv2_max2(const in uint r, const in uint c, const in float a, const in float b) {
    return max(a, b);
}
// 1 / l (0 for a row that saw nothing: never stored)
float nv2_inv(const in uint r, const in uint c, const in float l) {
    return l > 0.0 ? 1.0 / l : 0.0;
}
// the output's element (row r, dim c) to o[], or with n_split > 1 to partial[]
float nv2_store(const in uint r, const in uint c, const in float v, const in uint t0, const in uint nlive,
                const in uint h0) {
    uint tk = r / G;
    if (tk < nlive) {
        if (pc.n_split > 1u) {
            partial[(((t0 + tk) * pc.n_head + h0 + r % G) * pc.n_split + gl_WorkGroupID.z) * HD + c] = v;
        } else {
            o[(t0 + tk) * pc.o_stride + (h0 + r % G) * HD + c] = v;
        }
    }
    return v;
}
// row r's (m, l) to partial[] (from column 0 of M, with L's element beside it)
float nv2_store_ml(const in uint r, const in uint c, const in float m, const in float l, const in uint t0,
                   const in uint nlive, const in uint h0) {
    uint tk = r / G;
    if (c == 0u && tk < nlive) {
        uint mb = pc.ml_off + (((t0 + tk) * pc.n_head + h0 + r % G) * pc.n_split + gl_WorkGroupID.z) * 2u;
        partial[mb] = m;
        partial[mb + 1u] = l;
    }
    return m;
}

void main() {
    uint tid = gl_LocalInvocationID.x;
    uint t0 = gl_WorkGroupID.x * BQ;
    uint ntok = step.n_tokens;
    if (t0 >= ntok) {
        return;  // uniform over the work group
    }
    uint nlive = min(BQ, ntok - t0);
    uint per_kv = pc.n_head / G / pc.n_head_kv;
    uint hgrp = gl_WorkGroupID.y;
    uint kvh = hgrp / per_kv;
    uint h0 = hgrp * G;
    for (uint i = tid; i < BQ; i += WG) {
        tpos[i] = i < nlive ? STEP_POS(t0 + i) : 0u;
        tseq[i] = i < nlive ? STEP_SEQ(t0 + i) : 0xFFFFFFFFu;
        tdone[i] = i >= nlive;
    }

    MAT_O qacc = MAT_O(0.0);
    coopMatPerElementNV(qacc, qacc, nv2_q, t0, nlive, h0);
    MAT_QA qa = MAT_QA(qacc);
    MAT_O oacc = MAT_O(0.0);
    MAT_S mrun = MAT_S(MASKED);
    MAT_S lrun = MAT_S(0.0);
    barrier();

    uint k_row = kv_row_words(K_TYPE, pc.kv_dim);
    uint v_row = kv_row_words(V_TYPE, pc.kv_dim);
    uint k_head = kvh * kv_row_words(K_TYPE, HD);
    uint v_head = kvh * kv_row_words(V_TYPE, HD);
#if NV2_DIRECT
    // the sequence's n_ctx cache rows of this KV head as an n_ctx x HD tensor (row
    // stride kv_dim halves); Repeat wraps a slice that runs past the ring's end
    tensorLayoutNV<2, gl_CooperativeMatrixClampModeRepeatNV> kvl = createTensorLayoutNV(2, gl_CooperativeMatrixClampModeRepeatNV);
    kvl = setTensorLayoutDimensionNV(kvl, pc.n_ctx, HD);
    kvl = setTensorLayoutStrideNV(kvl, pc.kv_dim, 1);
    tensorViewNV<2, false, 1, 0> kview = createTensorViewNV(2, false, 1, 0);  // K^T: keys are its columns
#endif
    f16vec4 kpre[NLD];  // the next tile's K and V, on their way to shared memory (PF)
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
        // each row's visible keys in this pass (none for the other sequences' rows)
        for (uint r = tid; r < R; r += WG) {
            uint tk = r / G;
            bool in_pass = tk < nlive && tseq[tk] == s;
            rlo[r] = in_pass ? lo_of(tpos[tk]) : 0u;
            rhi[r] = in_pass ? tpos[tk] + 1u : 0u;
        }
        uint base = s * pc.n_ctx;
        // this split's key tiles [kb0, kb1) of the pass's [lomin, pmax]: chunks of at
        // least min_tiles, so a short range is one split and the others get none
        uint ntl = (pmax - lomin) / BC + 1u;
        uint per = max(pc.min_tiles, (ntl + pc.n_split - 1u) / pc.n_split);
        uint kb0 = lomin + min(ntl, gl_WorkGroupID.z * per) * BC;
        uint kb1 = min(pmax + 1u, lomin + min(ntl, (gl_WorkGroupID.z + 1u) * per) * BC);
#if !NV2_DIRECT
        if (PF != 0u) {  // the first tile's K and V in registers (then each tile loads the next one's)
            [[unroll]] for (uint n = 0; n < NLD; n++) {
                uint i = tid + WG * n;
                uint c = i / (HD / 4u);
                uint d = 4u * (i % (HD / 4u));
                bool ld = i < NL4 && kb0 + c < kb1;
                kpre[n] = ld ? k_raw4((base + ring_row(kb0 + c)) * k_row + k_head, d) : f16vec4(0.0);
                vpre[n] = ld ? v_raw4((base + ring_row(kb0 + c)) * v_row + v_head, d) : f16vec4(0.0);
            }
        }
#endif
        barrier();  // rlo / rhi written

        for (uint k0 = kb0; k0 < kb1; k0 += BC) {
            uint kn = min(BC, kb1 - k0);
            bool full = one_seq && k0 + BC - 1u <= pmin && k0 >= lomax;

            // 1. this tile's K and V
            MAT_KB kb;
            MAT_VB vb;
#if NV2_DIRECT
            uint kvoff = base * pc.kv_dim + kvh * HD;  // halves; 16-byte aligned (HD >= 8)
            uint kr = ring_row(k0);
            coopMatLoadTensorNV(kb, kh, kvoff, sliceTensorLayoutNV(kvl, kr, BC, 0, HD), kview);
            if (kn == BC) {
                coopMatLoadTensorNV(vb, vh, kvoff, sliceTensorLayoutNV(kvl, kr, BC, 0, HD));
            } else {  // rows past the live keys stay 0 (the cache there may hold anything)
                vb = MAT_VB(0.0);
                tensorViewNV<2, false, 0, 1> vclip = createTensorViewNV(2, false, 0, 1);
                vclip = setTensorViewClipNV(vclip, 0, kn, 0, HD);
                coopMatLoadTensorNV(vb, vh, kvoff, sliceTensorLayoutNV(kvl, kr, BC, 0, HD), vclip);
            }
#else
            uint k1 = k0 + BC;
            uint kn1 = k1 < kb1 ? min(BC, kb1 - k1) : 0u;
            [[unroll]] for (uint n = 0; n < NLD; n++) {
                uint i = tid + WG * n;
                uint c = i / (HD / 4u);
                uint d4 = i % (HD / 4u);
                if (i < NL4) {
                    if (PF != 0u) {
                        kvs[c * KS4 + d4] = kpre[n];
                        kvs[TILE4 + c * KS4 + d4] = vpre[n];
                        if (kn1 > 0u) {
                            bool ld = c < kn1;
                            kpre[n] = ld ? k_raw4((base + ring_row(k1 + c)) * k_row + k_head, 4u * d4) : f16vec4(0.0);
                            vpre[n] = ld ? v_raw4((base + ring_row(k1 + c)) * v_row + v_head, 4u * d4) : f16vec4(0.0);
                        }
                    } else {
                        bool ld = c < kn;
                        kvs[c * KS4 + d4] = ld ? k_raw4((base + ring_row(k0 + c)) * k_row + k_head, 4u * d4) : f16vec4(0.0);
                        kvs[TILE4 + c * KS4 + d4] = ld ? v_raw4((base + ring_row(k0 + c)) * v_row + v_head, 4u * d4) : f16vec4(0.0);
                    }
                }
            }
            barrier();
            // K^T (HD x BC): element (d, c) at key c's row, column-major; V (BC x HD) row-major
            coopMatLoad(kb, kvs, 0, KS4, gl_CooperativeMatrixLayoutColumnMajor);
            coopMatLoad(vb, kvs, TILE4, KS4, gl_CooperativeMatrixLayoutRowMajor);
#endif

            // 2. S, the mask, the online softmax, O
            MAT_S sacc = MAT_S(0.0);
            sacc = coopMatMulAdd(qa, kb, sacc);
            if (!full) {
                coopMatPerElementNV(sacc, sacc, nv2_mask, k0, kb1);
            }
            MAT_S mt;
            coopMatReduceNV(mt, sacc, gl_CooperativeMatrixReduceRowNV, nv2_max);
            MAT_S mnew;
            coopMatPerElementNV(mnew, mt, nv2_max2, mrun);
            MAT_S pm;
            coopMatPerElementNV(pm, sacc, nv2_exp, mnew);
            MAT_S corr;
            coopMatPerElementNV(corr, mrun, nv2_exp_diff, mnew);
            mrun = mnew;
            MAT_PA pa = MAT_PA(pm);
            if (RSUM_MMA == 2u) {  // each column's share; the row's sum is taken once, after the last tile
                lrun = lrun * corr + pm;
            } else {
                MAT_S rs;
                if (RSUM_MMA == 1u) {  // the sums of the f16 weights P V multiplies, on the tensor cores
                    rs = coopMatMulAdd(pa, coopmat<float16_t, gl_ScopeWorkgroup, BC, BC, gl_MatrixUseB>(1.0),
                                       MAT_S(0.0));
                } else {
                    coopMatReduceNV(rs, pm, gl_CooperativeMatrixReduceRowNV, nv2_add);
                }
                lrun = lrun * corr + rs;
            }
            MAT_O corr_o;  // each row's factor over all HD columns (equal within a row)
            coopMatReduceNV(corr_o, corr, gl_CooperativeMatrixReduceRowNV, nv2_first);
            oacc = oacc * corr_o;
            oacc = coopMatMulAdd(pa, vb, oacc);
#if !NV2_DIRECT
            // 3. every lane is done with this K and V before the next tile's
            barrier();
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

    if (RSUM_MMA == 2u) {  // the columns' shares of each row's sum, added up
        MAT_S ltot;
        coopMatReduceNV(ltot, lrun, gl_CooperativeMatrixReduceRowNV, nv2_add);
        lrun = ltot;
    }
    if (pc.n_split > 1u) {  // partials out, unnormalised, with (m, l)
        coopMatPerElementNV(mrun, mrun, nv2_store_ml, lrun, t0, nlive, h0);
    } else {
        MAT_S linv;
        coopMatPerElementNV(linv, lrun, nv2_inv);
        MAT_O linv_o;
        coopMatReduceNV(linv_o, linv, gl_CooperativeMatrixReduceRowNV, nv2_first);
        oacc = oacc * linv_o;
    }
    coopMatPerElementNV(oacc, oacc, nv2_store, t0, nlive, h0);
}

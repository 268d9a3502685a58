#version 450
// The prefill matmul on cooperative matrices (VK_KHR_cooperative_matrix, 16x16x16 f16 x
// f16 -> f32 at subgroup scope), built as fast coopmat GEMMs are; matmul_cm.comp's
// arguments and results: y[t][y_off + row] (+)= W[row] . x[t] for the live tokens t.
//
// A work group owns a BM x BN tile of (rows, tokens) (defines: 128x128, 128x64 or 64x64,
// chosen per matmul by the host, ops.cm2_tile) and walks K in steps of BK = 32:
//   * the subgroups form an SGM x SGN grid over the tile, each owning TM x TN blocks
//     of 16x16 (2x2 up to 4x4, defines TM, TN): per 16 of K it loads TM A fragments and
//     TN B fragments from shared memory and runs TM * TN products, so every fragment
//     feeds several products (matmul_cm: one product per A and B load);
//   * register prefetch: right after a K-tile is in shared memory, each lane issues the
//     loads of the next K-tile (weights dequantized by quant.glsl's dequant8, any type;
//     activations), converted to f16 in registers while the products of this tile run;
//     after a barrier they replace the tile. The prefetch has no branch of its own
//     (the last step re-reads its own tile, rows and tokens past the end read a clamped
//     address and are zeroed by a select; only dequant8's K-quant scale decode
//     branches), so the compiler may interleave it with the products;
//   * the f32 accumulators go out block by block through the subgroup's own 16x16
//     slice of shared memory (column-major: 16 lanes store 16 consecutive rows of one
//     token, 64 contiguous bytes), masked by n_rows and the live token count, plain or
//     added into y (mode 1), as matmul_cm.
// One shared-memory buffer per operand (28 KiB at most, under lavapipe's 32 KiB and
// the H200's 48 KiB) with two barriers per K-tile, the prefetch meant to hide the loads
// (not yet timed on a GPU).
//
// SG (define) is the subgroup size the layout is built for: the device's, 32 or 64.
// The work group has NT = SGM * SGN * SG lanes, the host's local size (cm2_layout).
//
// CM_EMULATE (tests only): the products done by plain lanes from the same f16 shared
// tiles into the same per-lane slots of each 16x16 block, with "subgroups" of SG
// consecutive lanes and work-group barriers for theirs, so a device without
// cooperative matrices (lavapipe) runs this kernel's tiling, prefetch, masks and stores
// for either subgroup size.
#ifndef CM_EMULATE
#extension GL_KHR_cooperative_matrix : require
#extension GL_KHR_memory_scope_semantics : require
#endif
#extension GL_EXT_shader_explicit_arithmetic_types_float16 : require
#include "common.glsl"

layout(binding = 0, std430) readonly buffer W16 { uint16_t w16[]; };
#if defined(X_F16)
// to_f16.comp's copy of x's live rows, n_in halves apart: eight halves a word (Ops.matmul_x16)
layout(binding = 1, std430) readonly buffer XH { uvec4 xh8[]; };
#else
layout(binding = 1, std430) readonly buffer X { vec4 x4[]; };
#endif
layout(binding = 2, std430) buffer Y { float y[]; };
DECLARE_STEP(3)

layout(push_constant) uniform Push {
    uint n_in;
    uint n_rows;
    uint x_stride;
    uint y_stride;
    uint y_off;
    uint count_sel;
    uint mode;
} pc;

#include "quant.glsl"

const uint BK = 32;
const uint SK = BK + 8u;              // f16 row stride of the tiles (16-byte aligned rows, fewer bank conflicts)
const uint SGM = BM / (16u * TM);     // subgroups along the rows
const uint SGN = BN / (16u * TN);     // ... and along the tokens
const uint NSG = SGM * SGN;
const uint NT = NSG * SG;             // lanes of the work group (= WG)
const uint A_LD = BM * (BK / 8u) / NT;  // groups of eight weights each lane loads per K-tile
const uint B_LD = BN * (BK / 8u) / NT;  // ... and of eight activations
const uint EPL = 256u / SG;           // elements of a 16x16 block per lane

shared float16_t ws[BM * SK];     // W tile, [row][k]: matrix A (M x K), row-major
shared float16_t xs[BN * SK];     // x tile, [token][k]: matrix B (K x N), column-major
shared float stage[NSG * 256u];   // each subgroup's 16x16 output block on its way out

#ifdef CM_EMULATE
#define SG_ID (gl_LocalInvocationID.x / SG)
#define SG_LANE (gl_LocalInvocationID.x % SG)
#define SG_SYNC() barrier()
#else
#define SG_ID gl_SubgroupID
#define SG_LANE gl_SubgroupInvocationID
#define SG_SYNC() subgroupMemoryBarrierShared(); subgroupBarrier()
#endif

// the next K-tile, in f16, on its way to shared memory
f16vec4 apre[2u * A_LD];
f16vec4 bpre[2u * B_LD];

// Group g = tid + NT * i of a tile is row (token) g / 4 of it, k values 8 (g % 4) ..
// + 8; NT is a multiple of 4, so every group of a lane has the same k offset.
void fetch(uint kb, uint lk, uint a_row[A_LD], bool a_live[A_LD], uint b_at[B_LD], bool b_live[B_LD]) {
    [[unroll]] for (uint i = 0; i < A_LD; i++) {
        float w[8];
        dequant8(a_row[i], (kb + lk) >> 3, w);
        f16vec4 lo = f16vec4(float16_t(w[0]), float16_t(w[1]), float16_t(w[2]), float16_t(w[3]));
        f16vec4 hi = f16vec4(float16_t(w[4]), float16_t(w[5]), float16_t(w[6]), float16_t(w[7]));
        // selects, not ?: (glslang makes a branch of a ternary over conversions)
        apre[2u * i] = mix(f16vec4(0.0), lo, bvec4(a_live[i]));
        apre[2u * i + 1u] = mix(f16vec4(0.0), hi, bvec4(a_live[i]));
    }
    [[unroll]] for (uint i = 0; i < B_LD; i++) {
#if defined(X_F16)
        uvec4 h = xh8[b_at[i] + (kb >> 3)];
        f16vec4 xa = f16vec4(unpackFloat2x16(h.x), unpackFloat2x16(h.y));
        f16vec4 xb = f16vec4(unpackFloat2x16(h.z), unpackFloat2x16(h.w));
        bpre[2u * i] = mix(f16vec4(0.0), xa, bvec4(b_live[i]));
        bpre[2u * i + 1u] = mix(f16vec4(0.0), xb, bvec4(b_live[i]));
#else
        uint xi = b_at[i] + (kb >> 2);
        vec4 xa = x4[xi];
        vec4 xb = x4[xi + 1u];
        bpre[2u * i] = mix(f16vec4(0.0), f16vec4(xa), bvec4(b_live[i]));
        bpre[2u * i + 1u] = mix(f16vec4(0.0), f16vec4(xb), bvec4(b_live[i]));
#endif
    }
}

void put_w(uint o, f16vec4 v) {
    ws[o] = v.x;
    ws[o + 1u] = v.y;
    ws[o + 2u] = v.z;
    ws[o + 3u] = v.w;
}

void put_x(uint o, f16vec4 v) {
    xs[o] = v.x;
    xs[o + 1u] = v.y;
    xs[o + 2u] = v.z;
    xs[o + 3u] = v.w;
}

void main() {
    uint tid = gl_LocalInvocationID.x;
    uint m0 = gl_WorkGroupID.x * BM;
    uint n0 = gl_WorkGroupID.y * BN;
    uint ntok = STEP_COUNT(pc.count_sel);
    if (n0 >= ntok) {
        return;
    }
    uint lk = (tid & 3u) * 8u;
    uint rw = row_words(pc.n_in);
    uint a_row[A_LD];
    bool a_live[A_LD];
    [[unroll]] for (uint i = 0; i < A_LD; i++) {
        uint r = m0 + (tid >> 2) + (NT / 4u) * i;
        a_live[i] = r < pc.n_rows;
        a_row[i] = min(r, pc.n_rows - 1u) * rw;
    }
    uint b_at[B_LD];
    bool b_live[B_LD];
    [[unroll]] for (uint i = 0; i < B_LD; i++) {
        uint t = n0 + (tid >> 2) + (NT / 4u) * i;
        b_live[i] = t < ntok;
#if defined(X_F16)
        b_at[i] = (min(t, ntok - 1u) * pc.n_in + lk) >> 3;  // uvec4 words of 8 halves
#else
        b_at[i] = (min(t, ntok - 1u) * pc.x_stride + lk) >> 2;
#endif
    }

    uint sg = SG_ID;
    uint lane = SG_LANE;
    uint wm = (sg % SGM) * (16u * TM);  // this subgroup's first row and token in the tile
    uint wn = (sg / SGM) * (16u * TN);
#ifdef CM_EMULATE
    float acc[TM * TN * EPL];
    [[unroll]] for (uint i = 0; i < TM * TN * EPL; i++) {
        acc[i] = 0.0;
    }
#else
    coopmat<float, gl_ScopeSubgroup, 16, 16, gl_MatrixUseAccumulator> acc[TM * TN];
    [[unroll]] for (uint i = 0; i < TM * TN; i++) {
        acc[i] = coopmat<float, gl_ScopeSubgroup, 16, 16, gl_MatrixUseAccumulator>(0.0);
    }
#endif

    fetch(0u, lk, a_row, a_live, b_at, b_live);
    for (uint kb = 0; kb < pc.n_in; kb += BK) {
        barrier();  // every subgroup is done with the previous tile
        [[unroll]] for (uint i = 0; i < A_LD; i++) {
            uint o = ((tid >> 2) + (NT / 4u) * i) * SK + lk;
            put_w(o, apre[2u * i]);
            put_w(o + 4u, apre[2u * i + 1u]);
        }
        [[unroll]] for (uint i = 0; i < B_LD; i++) {
            uint o = ((tid >> 2) + (NT / 4u) * i) * SK + lk;
            put_x(o, bpre[2u * i]);
            put_x(o + 4u, bpre[2u * i + 1u]);
        }
        barrier();
        // the next tile's loads, in flight during this tile's products (the last
        // step fetches itself again rather than branch)
        fetch(min(kb + BK, pc.n_in - BK), lk, a_row, a_live, b_at, b_live);
#ifdef CM_EMULATE
        [[unroll]] for (uint i = 0; i < TM; i++) {
            [[unroll]] for (uint j = 0; j < TN; j++) {
                for (uint e = 0; e < EPL; e++) {
                    uint idx = lane + SG * e;  // block element (idx % 16, idx / 16), as staged
                    uint r = wm + 16u * i + idx % 16u;
                    uint c = wn + 16u * j + idx / 16u;
                    float a = acc[(i * TN + j) * EPL + e];
                    for (uint kk = 0; kk < BK; kk++) {
                        a += float(ws[r * SK + kk]) * float(xs[c * SK + kk]);
                    }
                    acc[(i * TN + j) * EPL + e] = a;
                }
            }
        }
#else
        [[unroll]] for (uint kk = 0; kk < BK; kk += 16u) {
            coopmat<float16_t, gl_ScopeSubgroup, 16, 16, gl_MatrixUseA> ma[TM];
            coopmat<float16_t, gl_ScopeSubgroup, 16, 16, gl_MatrixUseB> mb[TN];
            [[unroll]] for (uint i = 0; i < TM; i++) {
                coopMatLoad(ma[i], ws, (wm + 16u * i) * SK + kk, SK, gl_CooperativeMatrixLayoutRowMajor);
            }
            [[unroll]] for (uint j = 0; j < TN; j++) {
                coopMatLoad(mb[j], xs, (wn + 16u * j) * SK + kk, SK, gl_CooperativeMatrixLayoutColumnMajor);
            }
            [[unroll]] for (uint i = 0; i < TM; i++) {
                [[unroll]] for (uint j = 0; j < TN; j++) {
                    acc[i * TN + j] = coopMatMulAdd(ma[i], mb[j], acc[i * TN + j]);
                }
            }
        }
#endif
    }

    // out, block by block through the subgroup's slice of stage[] ([token][row] within
    // the block), masked by the rows and the live tokens
    [[unroll]] for (uint i = 0; i < TM; i++) {
        [[unroll]] for (uint j = 0; j < TN; j++) {
#ifdef CM_EMULATE
            for (uint e = 0; e < EPL; e++) {
                stage[sg * 256u + lane + SG * e] = acc[(i * TN + j) * EPL + e];
            }
#else
            coopMatStore(acc[i * TN + j], stage, sg * 256u, 16u, gl_CooperativeMatrixLayoutColumnMajor);
#endif
            SG_SYNC();
            for (uint e = 0; e < EPL; e++) {
                uint idx = lane + SG * e;
                uint row = m0 + wm + 16u * i + idx % 16u;
                uint tok = n0 + wn + 16u * j + idx / 16u;
                if (row < pc.n_rows && tok < ntok) {
                    uint o = tok * pc.y_stride + pc.y_off + row;
                    float v = stage[sg * 256u + idx];
                    y[o] = pc.mode == 1u ? y[o] + v : v;
                }
            }
            SG_SYNC();
        }
    }
}

#version 450
// moe_matmul.comp on cooperative matrices (VK_KHR_cooperative_matrix, 16x16x16 f16 x
// f16 -> f32 at subgroup scope), as matmul_cm.comp is matmul.comp's: the same map,
// tiles of 64 rows of one expert by up to 32 of its (token, expert) pairs, K in steps
// of 32; the weight tile (every type of quant.glsl) and the gathered activations are
// converted to f16 in shared memory, the 8 output blocks of 16x16 are split over the
// subgroups (CM_PER each: 1 for subgroups of 32, 2 for 64), and the f32 accumulators
// go through shared memory once for the stores at each pair's place.
// Off by default (Ops.moe_cm, TRIO_LLM_MOE_CM=1) until a GPU has verified it.
//
// CM_EMULATE (tests only): the products done by plain lanes from the same f16 shared
// tiles into the same accumulator array, so a device without cooperative matrices
// (lavapipe) checks the gather, the tiles and the stores of this kernel.
#ifndef CM_EMULATE
#extension GL_KHR_cooperative_matrix : require
#extension GL_KHR_memory_scope_semantics : require
#endif
#extension GL_EXT_shader_explicit_arithmetic_types_float16 : require
#include "common.glsl"

layout(binding = 0, std430) readonly buffer W16 { uint16_t w16[]; };
layout(binding = 1, std430) readonly buffer X { vec4 x4[]; };
layout(binding = 2, std430) writeonly buffer Y { float y[]; };
DECLARE_STEP(3)
layout(binding = 4, std430) readonly buffer M { uint map[]; };

layout(push_constant) uniform Push {
    uint n_in;
    uint n_rows;
    uint x_stride;
    uint x_pair;
    uint y_stride;
    uint k;
    uint tiles_off;
} pc;

#include "quant.glsl"

const uint PERM_OFF = 4;
const uint BM = 64;
const uint BN = 32;
const uint BK = 32;
const uint SK = BK + 8;  // row stride of the f16 tiles (16-byte aligned rows)

shared float16_t ws[BM * SK];  // W tile, [row][k]: matrix A (M x K), row-major
shared float16_t xs[BN * SK];  // x tile, [pair][k]: matrix B (K x N), column-major
shared float cs[BM * BN];      // the accumulators, [row][pair]
shared uint ybase[BN];         // where each pair's output row starts

void main() {
    uint tid = gl_LocalInvocationID.x;
    uint tile = gl_WorkGroupID.y;
    if (tile >= map[0]) {
        return;
    }
    uint start = map[pc.tiles_off + 2u * tile];
    uint en = map[pc.tiles_off + 2u * tile + 1u];
    uint e = en >> 8;
    uint n = en & 0xFFu;
    uint m0 = gl_WorkGroupID.x * BM;
    if (m0 >= pc.n_rows) {
        return;
    }
    uint lr = tid >> 2;
    uint lk = (tid & 3u) * 8u;
    uint wrow = m0 + lr;
    uint row16 = (e * pc.n_rows + wrow) * row_words(pc.n_in);
    uint xr = tid >> 3;
    uint xk = (tid & 7u) * 4u;
    bool xlive = xr < n;
    uint xbase = 0u;
    if (xlive) {
        uint p = map[PERM_OFF + start + xr];
        uint c = p / pc.k;
        xbase = c * pc.x_stride + (p - c * pc.k) * pc.x_pair;
    }
    if (tid < BN && tid < n) {
        uint p = map[PERM_OFF + start + tid];
        uint c = p / pc.k;
        ybase[tid] = c * pc.y_stride + (p - c * pc.k) * pc.n_rows;
    }

#ifdef CM_EMULATE
    float acc[BM * BN / WG];
    [[unroll]] for (uint i = 0; i < BM * BN / WG; i++) {
        acc[i] = 0.0;
    }
#else
    uint sg = gl_SubgroupID;
    coopmat<float, gl_ScopeSubgroup, 16, 16, gl_MatrixUseAccumulator> acc[CM_PER];
    [[unroll]] for (uint i = 0; i < CM_PER; i++) {
        acc[i] = coopmat<float, gl_ScopeSubgroup, 16, 16, gl_MatrixUseAccumulator>(0.0);
    }
#endif

    for (uint kb = 0; kb < pc.n_in; kb += BK) {
        float w[8];
        if (wrow < pc.n_rows) {
            dequant8(row16, (kb + lk) >> 3, w);
        } else {
            [[unroll]] for (uint i = 0; i < 8; i++) {
                w[i] = 0.0;
            }
        }
        vec4 xa = xlive ? x4[(xbase + kb + xk) >> 2] : vec4(0.0);
        [[unroll]] for (uint i = 0; i < 8; i++) {
            ws[lr * SK + lk + i] = float16_t(w[i]);
        }
        xs[xr * SK + xk + 0] = float16_t(xa.x);
        xs[xr * SK + xk + 1] = float16_t(xa.y);
        xs[xr * SK + xk + 2] = float16_t(xa.z);
        xs[xr * SK + xk + 3] = float16_t(xa.w);
        barrier();
#ifdef CM_EMULATE
        [[unroll]] for (uint i = 0; i < BM * BN / WG; i++) {
            uint o = tid + WG * i;
            uint r = o / BN;
            uint t = o - r * BN;
            for (uint kk = 0; kk < BK; kk++) {
                acc[i] += float(ws[r * SK + kk]) * float(xs[t * SK + kk]);
            }
        }
#else
        [[unroll]] for (uint kk = 0; kk < BK; kk += 16u) {
            [[unroll]] for (uint i = 0; i < CM_PER; i++) {
                uint blk = sg * CM_PER + i;
                uint bm = blk & 3u;
                uint bn = blk >> 2;
                coopmat<float16_t, gl_ScopeSubgroup, 16, 16, gl_MatrixUseA> ma;
                coopmat<float16_t, gl_ScopeSubgroup, 16, 16, gl_MatrixUseB> mb;
                coopMatLoad(ma, ws, bm * 16u * SK + kk, SK, gl_CooperativeMatrixLayoutRowMajor);
                coopMatLoad(mb, xs, bn * 16u * SK + kk, SK, gl_CooperativeMatrixLayoutColumnMajor);
                acc[i] = coopMatMulAdd(ma, mb, acc[i]);
            }
        }
#endif
        barrier();
    }
#ifdef CM_EMULATE
    [[unroll]] for (uint i = 0; i < BM * BN / WG; i++) {
        cs[tid + WG * i] = acc[i];
    }
#else
    [[unroll]] for (uint i = 0; i < CM_PER; i++) {
        uint blk = sg * CM_PER + i;
        uint bm = blk & 3u;
        uint bn = blk >> 2;
        coopMatStore(acc[i], cs, bm * 16u * BN + bn * 16u, BN, gl_CooperativeMatrixLayoutRowMajor);
    }
#endif
    barrier();
    for (uint o = tid; o < BM * BN; o += WG) {
        uint r = o / BN;
        uint t = o - r * BN;
        uint row = m0 + r;
        if (row < pc.n_rows && t < n) {
            y[ybase[t] + row] = cs[r * BN + t];
        }
    }
}

#version 450
// matmul.comp on cooperative matrices (VK_KHR_cooperative_matrix), for devices that
// report 16x16x16 f16 x f16 -> f32 at subgroup scope: y[t][row] (+)= W[row] . x[t] over a
// 64x64 tile of (rows, tokens) per work group of 256 threads, K in steps of 32. Each step
// dequantizes the weight tile (every type of quant.glsl) and the activations to f16 in
// shared memory; each subgroup multiplies its 16x16 blocks of the tile with f32
// accumulators, which go through shared memory once at the end for the masked stores.
// The f16 activations are what llama.cpp's Vulkan matrix-core path uses too.
#extension GL_GOOGLE_include_directive : require
#extension GL_KHR_cooperative_matrix : require
#extension GL_KHR_memory_scope_semantics : require
#extension GL_EXT_shader_explicit_arithmetic_types_float16 : require
#include "common.glsl"

layout(binding = 0, std430) readonly buffer W16 { uint16_t w16[]; };
layout(binding = 1, std430) readonly buffer X { vec4 x4[]; };
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

const uint BM = 64;
const uint BN = 64;
const uint BK = 32;
const uint SK = BK + 8;  // row stride of the f16 tiles (keeps 16-byte alignment, fewer bank conflicts)

shared float16_t ws[BM * SK];  // W tile, [row][k]: matrix A (M x K), row-major
shared float16_t xs[BN * SK];  // x tile, [token][k]: matrix B (K x N), column-major
shared float cs[BM * BN];      // the accumulators, [row][token]

void main() {
    uint tid = gl_LocalInvocationID.x;
    uint m0 = gl_WorkGroupID.x * BM;
    uint n0 = gl_WorkGroupID.y * BN;
    uint ntok = STEP_COUNT(pc.count_sel);
    if (n0 >= ntok) {
        return;
    }
    uint lr = tid >> 2;          // the row / token this thread loads
    uint lk = (tid & 3u) * 8u;   // its eight k values within the tile
    uint wrow = m0 + lr;
    uint row16 = wrow * row_words(pc.n_in);
    uint xt = n0 + lr;

    // 16 output blocks of 16x16, CM_PER consecutive ones per subgroup (256 / subgroup
    // size subgroups: CM_PER is 2 for a subgroup of 32, 4 for 64; set by the host)
    uint sg = gl_SubgroupID;
    coopmat<float, gl_ScopeSubgroup, 16, 16, gl_MatrixUseAccumulator> acc[CM_PER];
    [[unroll]] for (uint i = 0; i < CM_PER; i++) {
        acc[i] = coopmat<float, gl_ScopeSubgroup, 16, 16, gl_MatrixUseAccumulator>(0.0);
    }

    for (uint kb = 0; kb < pc.n_in; kb += BK) {
        float w[8];
        if (wrow < pc.n_rows) {
            dequant8(row16, (kb + lk) >> 3, w);
        } else {
            [[unroll]] for (uint i = 0; i < 8; i++) {
                w[i] = 0.0;
            }
        }
        vec4 xa = vec4(0.0);
        vec4 xb = vec4(0.0);
        if (xt < ntok) {
            uint xi = (xt * pc.x_stride + kb + lk) >> 2;
            xa = x4[xi];
            xb = x4[xi + 1];
        }
        [[unroll]] for (uint i = 0; i < 8; i++) {
            ws[lr * SK + lk + i] = float16_t(w[i]);
        }
        xs[lr * SK + lk + 0] = float16_t(xa.x);
        xs[lr * SK + lk + 1] = float16_t(xa.y);
        xs[lr * SK + lk + 2] = float16_t(xa.z);
        xs[lr * SK + lk + 3] = float16_t(xa.w);
        xs[lr * SK + lk + 4] = float16_t(xb.x);
        xs[lr * SK + lk + 5] = float16_t(xb.y);
        xs[lr * SK + lk + 6] = float16_t(xb.z);
        xs[lr * SK + lk + 7] = float16_t(xb.w);
        barrier();
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
        barrier();
    }
    [[unroll]] for (uint i = 0; i < CM_PER; i++) {
        uint blk = sg * CM_PER + i;
        uint bm = blk & 3u;
        uint bn = blk >> 2;
        coopMatStore(acc[i], cs, bm * 16u * BN + bn * 16u, BN, gl_CooperativeMatrixLayoutRowMajor);
    }
    barrier();
    for (uint e = tid; e < BM * BN; e += WG) {
        uint r = e / BN;
        uint t = e % BN;
        uint row = m0 + r;
        uint tok = n0 + t;
        if (row < pc.n_rows && tok < ntok) {
            uint o = tok * pc.y_stride + pc.y_off + row;
            float v = cs[r * BN + t];
            y[o] = pc.mode == 1u ? y[o] + v : v;
        }
    }
}

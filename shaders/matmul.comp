#version 450
// Tiled matrix products for prefill: y[t][row] (+)= W[row] . x[t] over a 64x64 tile of
// (rows, tokens) per work group of 256 threads, K in steps of 32 through shared memory.
// Each thread dequantizes one group of eight weights per step and accumulates 4x4.
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
const uint PAD = BM + 1;  // odd stride: the transposed stores hit distinct banks

shared float ws[BK * PAD];
shared float xs[BK * PAD];

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
    uint tr = tid & 15u;
    uint tc = tid >> 4;

    float acc[4][4];
    [[unroll]] for (uint i = 0; i < 4; i++) {
        [[unroll]] for (uint j = 0; j < 4; j++) {
            acc[i][j] = 0.0;
        }
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
            ws[(lk + i) * PAD + lr] = w[i];
        }
        xs[(lk + 0) * PAD + lr] = xa.x;
        xs[(lk + 1) * PAD + lr] = xa.y;
        xs[(lk + 2) * PAD + lr] = xa.z;
        xs[(lk + 3) * PAD + lr] = xa.w;
        xs[(lk + 4) * PAD + lr] = xb.x;
        xs[(lk + 5) * PAD + lr] = xb.y;
        xs[(lk + 6) * PAD + lr] = xb.z;
        xs[(lk + 7) * PAD + lr] = xb.w;
        barrier();
        [[unroll]] for (uint k = 0; k < BK; k++) {
            float a[4];
            float b[4];
            [[unroll]] for (uint i = 0; i < 4; i++) {
                a[i] = ws[k * PAD + tr + 16u * i];
                b[i] = xs[k * PAD + tc + 16u * i];
            }
            [[unroll]] for (uint i = 0; i < 4; i++) {
                [[unroll]] for (uint j = 0; j < 4; j++) {
                    acc[i][j] += a[i] * b[j];
                }
            }
        }
        barrier();
    }
    [[unroll]] for (uint i = 0; i < 4; i++) {
        uint row = m0 + tr + 16u * i;
        if (row >= pc.n_rows) {
            continue;
        }
        [[unroll]] for (uint j = 0; j < 4; j++) {
            uint t = n0 + tc + 16u * j;
            if (t < ntok) {
                uint o = t * pc.y_stride + pc.y_off + row;
                y[o] = pc.mode == 1u ? y[o] + acc[i][j] : acc[i][j];
            }
        }
    }
}

#version 450
// Expert matrix products for prefill (ggml's mul_mat_id, tiled): the chunk's (token,
// expert) pairs grouped by expert (moe_group.comp's map), a work group per 64 rows of
// one expert and tile of at most 32 of its pairs, so each expert's weight tile is read
// once per tile of the tokens that chose it instead of once per token (moe_matvec).
// y[c][j][row] = W[e][row] . x[c] (x_pair 0: gate, up) or . x[c][j] (down), with
// e = the expert of the tile, written in the routing's order (moe_combine reads it).
// 256 threads, K in steps of 32 through shared memory, 4 rows x 2 pairs per thread;
// the weights through quant.glsl's dequant8 (every type).
#include "common.glsl"

layout(binding = 0, std430) readonly buffer W16 { uint16_t w16[]; };
layout(binding = 1, std430) readonly buffer X { vec4 x4[]; };
layout(binding = 2, std430) writeonly buffer Y { float y[]; };
DECLARE_STEP(3)
layout(binding = 4, std430) readonly buffer M { uint map[]; };

layout(push_constant) uniform Push {
    uint n_in;       // row length
    uint n_rows;     // rows of one expert
    uint x_stride;   // floats between tokens of x (multiple of 4)
    uint x_pair;     // floats between the k inputs of one token (0: one shared input)
    uint y_stride;   // floats between tokens of y
    uint k;          // experts per token
    uint tiles_off;  // word of the map's tile table
} pc;

#include "quant.glsl"

const uint PERM_OFF = 4;
const uint BM = 64;
const uint BN = 32;
const uint BK = 32;
const uint WPAD = BM + 1;  // odd strides: the transposed stores hit distinct banks
const uint XPAD = BN + 1;

shared float ws[BK * WPAD];
shared float xs[BK * XPAD];

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
    // loads: a row of 8 weights (64 rows x 32 k) and a vec4 of x (32 pairs x 32 k)
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
    // products: rows tr + 16 i, pairs tc + 16 j
    uint tr = tid & 15u;
    uint tc = tid >> 4;

    float acc[4][2];
    [[unroll]] for (uint i = 0; i < 4; i++) {
        acc[i][0] = 0.0;
        acc[i][1] = 0.0;
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
        vec4 xa = xlive ? x4[(xbase + kb + xk) >> 2] : vec4(0.0);
        [[unroll]] for (uint i = 0; i < 8; i++) {
            ws[(lk + i) * WPAD + lr] = w[i];
        }
        xs[(xk + 0) * XPAD + xr] = xa.x;
        xs[(xk + 1) * XPAD + xr] = xa.y;
        xs[(xk + 2) * XPAD + xr] = xa.z;
        xs[(xk + 3) * XPAD + xr] = xa.w;
        barrier();
        [[unroll]] for (uint kk = 0; kk < BK; kk++) {
            float a[4];
            [[unroll]] for (uint i = 0; i < 4; i++) {
                a[i] = ws[kk * WPAD + tr + 16u * i];
            }
            float b0 = xs[kk * XPAD + tc];
            float b1 = xs[kk * XPAD + tc + 16u];
            [[unroll]] for (uint i = 0; i < 4; i++) {
                acc[i][0] += a[i] * b0;
                acc[i][1] += a[i] * b1;
            }
        }
        barrier();
    }
    [[unroll]] for (uint jj = 0; jj < 2; jj++) {
        uint t = tc + 16u * jj;
        if (t >= n) {
            continue;
        }
        uint p = map[PERM_OFF + start + t];
        uint c = p / pc.k;
        uint yb = c * pc.y_stride + (p - c * pc.k) * pc.n_rows;
        [[unroll]] for (uint i = 0; i < 4; i++) {
            uint row = m0 + tr + 16u * i;
            if (row < pc.n_rows) {
                y[yb + row] = acc[i][jj];
            }
        }
    }
}

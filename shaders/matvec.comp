#version 450
// Matrix-vector products for decode: y[c][row] (+)= W[row] . x[c] for up to MAXC
// columns (tokens) at once, so a batch of a few sequences reads each weight once.
// One subgroup per row, NR rows per work group; weights are dequantized on the fly
// in groups of eight, adjacent lanes taking adjacent groups, so a warp's loads cover
// one contiguous stretch of the row. (A variant giving each lane a whole block
// through 32-bit loads measured slower on the H200: 283 against 361 tok/s on
// llama-1b Q8_0; docs/vulkan.md has the figures.)
#include "common.glsl"

layout(binding = 0, std430) readonly buffer W16 { uint16_t w16[]; };
layout(binding = 1, std430) readonly buffer X { vec4 x4[]; };
layout(binding = 2, std430) buffer Y { float y[]; };
DECLARE_STEP(3)

layout(push_constant) uniform Push {
    uint n_in;      // row length
    uint n_rows;    // rows of this dispatch
    uint x_stride;  // floats between columns of x (multiple of 4)
    uint y_stride;  // floats between columns of y
    uint y_off;     // first output row (a split matrix writes in pieces)
    uint count_sel; // which step count says how many columns are live
    uint mode;      // 0: y = Wx, 1: y += Wx (fused residual add)
} pc;

layout(constant_id = 1) const uint MAXC = 8;
layout(constant_id = 2) const uint NR = 4;  // rows per work group: one subgroup per row

#include "quant.glsl"

void main() {
    uint ncols = min(STEP_COUNT(pc.count_sel), MAXC);
    uint groups = pc.n_in / 8u;
    // A subgroup owns a row and reduces it with subgroupAdd alone: no shared memory
    // and no barrier, which is what makes the kernel cheap on CPU drivers too. The
    // loop also covers a driver that runs fewer, wider subgroups than planned.
    for (uint r = gl_SubgroupID; r < NR; r += gl_NumSubgroups) {
        uint row = FLAT_GROUP * NR + r;
        if (row >= pc.n_rows) {
            break;
        }
        uint row16 = row * row_words(pc.n_in);
        float acc[MAXC];
        [[unroll]] for (uint c = 0; c < MAXC; c++) {
            acc[c] = 0.0;
        }
        for (uint g = gl_SubgroupInvocationID; g < groups; g += gl_SubgroupSize) {
            float w[8];
            dequant8(row16, g, w);
            vec4 wa = vec4(w[0], w[1], w[2], w[3]);
            vec4 wb = vec4(w[4], w[5], w[6], w[7]);
            [[unroll]] for (uint c = 0; c < MAXC; c++) {
                if (c < ncols) {
                    uint xi = (c * pc.x_stride) / 4u + 2u * g;
                    acc[c] += dot(wa, x4[xi]) + dot(wb, x4[xi + 1]);
                }
            }
        }
        [[unroll]] for (uint c = 0; c < MAXC; c++) {
            if (c < ncols) {
                float s = subgroupAdd(acc[c]);
                if (subgroupElect()) {
                    uint o = c * pc.y_stride + pc.y_off + row;
                    y[o] = pc.mode == 1u ? y[o] + s : s;
                }
            }
        }
    }
}

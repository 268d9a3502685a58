#version 450
// A weight matrix (a piece of one) as f16 rows, for a prefill product that then reads
// plain f16 weights (TRIO_LLM_MATMUL_DEQUANT, Ops.matmul_dequant): the K-quants' decode
// inside the tiled products works out a sub-block's scale again for each value, once
// per token tile; here it is done once per value for the whole product. One lane per
// eight values, written as one 16-byte word; y holds n_rows rows of n_in halves.
#include "common.glsl"

layout(binding = 0, std430) readonly buffer W16 { uint16_t w16[]; };
layout(binding = 1, std430) writeonly buffer Y { uvec4 y[]; };

layout(push_constant) uniform Push {
    uint n_in;      // row length (a multiple of 8)
    uint n_rows;
} pc;

#include "quant.glsl"

void main() {
    uint groups = pc.n_in / 8u;
    uint i = FLAT_GROUP * WG + gl_LocalInvocationID.x;  // the i-th group of eight values
    if (i >= pc.n_rows * groups) {
        return;
    }
    uint row = i / groups;
    uint g = i - row * groups;
    float v[8];
    dequant8(row * row_words(pc.n_in), g, v);
    y[i] = uvec4(packHalf2x16(vec2(v[0], v[1])), packHalf2x16(vec2(v[2], v[3])),
                 packHalf2x16(vec2(v[4], v[5])), packHalf2x16(vec2(v[6], v[7])));
}

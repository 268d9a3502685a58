#version 450
// The live rows of x (f32, x_stride floats apart) as f16 rows n_in apart: the activations
// of a prefill product that matmul_nv2 then loads as they are (X_F16, Ops.matmul_x16), as
// llama.cpp's coopmat2 products read f16 activations converted by a pass of their own,
// instead of converting every value again in every row tile. One lane per eight values.
#include "common.glsl"

layout(binding = 0, std430) readonly buffer X { vec4 x4[]; };
layout(binding = 1, std430) writeonly buffer Y { uvec4 y[]; };
DECLARE_STEP(2)

layout(push_constant) uniform Push {
    uint n_in;       // a multiple of 8
    uint x_stride;   // floats, a multiple of 4
    uint count_sel;
} pc;

void main() {
    uint groups = pc.n_in / 8u;
    uint i = FLAT_GROUP * WG + gl_LocalInvocationID.x;
    uint row = i / groups;
    if (row >= STEP_COUNT(pc.count_sel)) {
        return;
    }
    uint g = i - row * groups;
    uint xi = (row * pc.x_stride) / 4u + 2u * g;
    vec4 a = x4[xi];
    vec4 b = x4[xi + 1u];
    y[i] = uvec4(packHalf2x16(a.xy), packHalf2x16(a.zw), packHalf2x16(b.xy), packHalf2x16(b.zw));
}

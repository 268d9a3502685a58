#version 450
// The weighted sum of each token's k expert outputs: y[c][i] = sum_j w[c][j] x[c][j][i],
// the weights being the second half of the routing row. Summed in slot order, as
// llama.cpp adds its expert views.
#include "common.glsl"

layout(binding = 0, std430) readonly buffer X { float x[]; };
layout(binding = 1, std430) readonly buffer R { float routes[]; };
layout(binding = 2, std430) writeonly buffer Y { float y[]; };
DECLARE_STEP(3)

layout(push_constant) uniform Push {
    uint n;         // values per expert output
    uint k;
    uint x_stride;  // floats between tokens of x (k * n)
    uint r_stride;  // floats between tokens of the routing (2k)
    uint y_stride;
} pc;

void main() {
    uint i = gl_GlobalInvocationID.x;
    uint t = gl_WorkGroupID.y;
    if (i >= pc.n || t >= step.n_tokens) {
        return;
    }
    float s = 0.0;
    for (uint j = 0; j < pc.k; j++) {
        s += routes[t * pc.r_stride + pc.k + j] * x[t * pc.x_stride + j * pc.n + i];
    }
    y[t * pc.y_stride + i] = s;
}

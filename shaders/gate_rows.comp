#version 450
// Each live row of x times sigmoid(h_row . w): a one-output linear gate (qwen35moe's
// shared expert). One work group per token.
#include "common.glsl"

layout(binding = 0, std430) readonly buffer X { float x[]; };
layout(binding = 1, std430) readonly buffer H { float h[]; };
layout(binding = 2, std430) readonly buffer Wt { float w[]; };
layout(binding = 3, std430) writeonly buffer Y { float y[]; };
DECLARE_STEP(4)

layout(push_constant) uniform Push {
    uint n;         // values per row of x and y
    uint n_in;      // values per row of h (and of w)
} pc;

#include "reduce.glsl"

void main() {
    uint t = FLAT_GROUP;
    if (t >= step.n_tokens) {
        return;
    }
    float d = 0.0;
    for (uint i = gl_LocalInvocationID.x; i < pc.n_in; i += WG) {
        d += h[t * pc.n_in + i] * w[i];
    }
    float s = 1.0 / (1.0 + exp(-wg_sum(d)));
    for (uint i = gl_LocalInvocationID.x; i < pc.n; i += WG) {
        y[t * pc.n + i] = x[t * pc.n + i] * s;
    }
}

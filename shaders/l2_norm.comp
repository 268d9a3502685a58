#version 450
// L2 normalisation of every `n` consecutive values (a head) of each live row:
// y = x / max(|x|, eps), as ggml_l2_norm. One work group per (token, head).
#include "common.glsl"

layout(binding = 0, std430) readonly buffer X { float x[]; };
layout(binding = 1, std430) writeonly buffer Y { float y[]; };
DECLARE_STEP(2)

layout(push_constant) uniform Push {
    uint n;
    uint rows_per_tok;
    float eps;
} pc;

#include "reduce.glsl"

void main() {
    uint row = FLAT_GROUP;
    if (row / pc.rows_per_tok >= step.n_tokens) {
        return;
    }
    uint b = row * pc.n;
    float ss = 0.0;
    for (uint i = gl_LocalInvocationID.x; i < pc.n; i += WG) {
        float v = x[b + i];
        ss += v * v;
    }
    float scale = 1.0 / max(sqrt(wg_sum(ss)), pc.eps);
    for (uint i = gl_LocalInvocationID.x; i < pc.n; i += WG) {
        y[b + i] = x[b + i] * scale;
    }
}

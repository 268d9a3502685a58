#version 450
// RMSNorm fused with the weight multiply: y = x / sqrt(mean(x^2) + eps) * w.
// One work group per row. Rows are grouped rows_per_tok to a token, which makes the
// same kernel the per-head QK-norm of qwen3 (rows = heads, n = head_dim).
#include "common.glsl"

layout(binding = 0, std430) readonly buffer X { float x[]; };
layout(binding = 1, std430) readonly buffer Wt { float w[]; };
layout(binding = 2, std430) buffer Y { float y[]; };
DECLARE_STEP(3)

layout(push_constant) uniform Push {
    uint n;
    uint rows_per_tok;
    uint x_stride;
    uint y_stride;
    uint count_sel;
    float eps;
} pc;

#include "reduce.glsl"

void main() {
    uint row = FLAT_GROUP;
    if (row / pc.rows_per_tok >= STEP_COUNT(pc.count_sel)) {
        return;
    }
    uint xb = row * pc.x_stride;
    float ss = 0.0;
    for (uint i = gl_LocalInvocationID.x; i < pc.n; i += WG) {
        float v = x[xb + i];
        ss += v * v;
    }
    float scale = inversesqrt(wg_sum(ss) / float(pc.n) + pc.eps);
    uint yb = row * pc.y_stride;
    for (uint i = gl_LocalInvocationID.x; i < pc.n; i += WG) {
        y[yb + i] = x[xb + i] * scale * w[i];
    }
}

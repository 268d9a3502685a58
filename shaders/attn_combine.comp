#version 450
// The partial results of a split prefill attention (attn_prefill_cm.comp with n_split >
// 1) added up per (token, head), as flash-decoding combines its splits:
//   M = max_s m_s,  L = sum_s l_s exp(m_s - M),  o = sum_s acc_s exp(m_s - M) / L.
// A split that saw none of a row's keys has m = -1e30 and l = 0, so it weighs nothing.
#include "common.glsl"

// [cap, n_head, n_split, head_dim] unnormalised outputs, then [cap, n_head, n_split, 2]
layout(binding = 0, std430) readonly buffer P { float part[]; };
layout(binding = 1, std430) writeonly buffer O { float o[]; };
DECLARE_STEP(2)

layout(push_constant) uniform Push {
    uint n_head;
    uint head_dim;
    uint n_split;
    uint o_stride;
    uint ml_off;
} pc;

void main() {
    uint h = gl_WorkGroupID.x;
    uint t = gl_WorkGroupID.y;
    if (t >= step.n_tokens) {
        return;
    }
    uint row = t * pc.n_head + h;
    uint mb = pc.ml_off + row * pc.n_split * 2u;
    float M = -1.0e30;
    for (uint s = 0; s < pc.n_split; s++) {
        M = max(M, part[mb + 2u * s]);
    }
    float L = 0.0;
    for (uint s = 0; s < pc.n_split; s++) {
        L += part[mb + 2u * s + 1u] * exp(part[mb + 2u * s] - M);
    }
    for (uint d = gl_LocalInvocationID.x; d < pc.head_dim; d += WG) {
        float acc = 0.0;
        for (uint s = 0; s < pc.n_split; s++) {
            acc += part[(row * pc.n_split + s) * pc.head_dim + d] * exp(part[mb + 2u * s] - M);
        }
        o[t * pc.o_stride + h * pc.head_dim + d] = acc / L;
    }
}

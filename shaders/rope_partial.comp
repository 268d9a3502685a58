#version 450
// Partial RoPE in place (qwen35's gated attention): the first n_rot values of each head
// rotate in half-split pairs (i, i + n_rot / 2) at the token's position with the
// frequencies theta^(-2i / n_rot); the rest of the head is left as it is.
#include "common.glsl"

layout(binding = 0, std430) buffer X { float x[]; };
DECLARE_STEP(1)

layout(push_constant) uniform Push {
    uint n_heads;
    uint head_dim;
    uint n_rot;
    uint x_stride;
    float log2_theta;
} pc;

void main() {
    uint p = gl_GlobalInvocationID.x;
    uint t = gl_WorkGroupID.y;
    uint half_ = pc.n_rot / 2u;
    if (p >= pc.n_heads * half_ || t >= step.n_tokens) {
        return;
    }
    uint hd = p / half_;
    uint i = p - hd * half_;
    float freq = exp2(-2.0 * float(i) / float(pc.n_rot) * pc.log2_theta);
    float ang = float(STEP_POS(t)) * freq;
    float cs = cos(ang);
    float sn = sin(ang);
    uint b = t * pc.x_stride + hd * pc.head_dim + i;
    float a0 = x[b];
    float a1 = x[b + half_];
    x[b] = a0 * cs - a1 * sn;
    x[b + half_] = a0 * sn + a1 * cs;
}

#version 450
// Per group of each live row: a's values then b's (G groups: a [T, G * na], b [T, G * nb]
// give y [T, G * (na + nb)]); MLA's per-head [absorbed q | roped q] and [latent | roped k].
#include "common.glsl"

layout(binding = 0, std430) readonly buffer A { float a[]; };
layout(binding = 1, std430) readonly buffer B { float b[]; };
layout(binding = 2, std430) writeonly buffer Y { float y[]; };
DECLARE_STEP(3)

layout(push_constant) uniform Push {
    uint na;        // a's values per group
    uint nb;        // b's
    uint n_out;     // values per output row: G * (na + nb)
    uint a_stride;
    uint b_stride;
    uint y_stride;
} pc;

void main() {
    uint i = gl_GlobalInvocationID.x;
    uint t = gl_WorkGroupID.y;
    if (i >= pc.n_out || t >= step.n_tokens) {
        return;
    }
    uint w = pc.na + pc.nb;
    uint g = i / w;
    uint j = i - g * w;
    y[t * pc.y_stride + i] = j < pc.na ? a[t * pc.a_stride + g * pc.na + j] : b[t * pc.b_stride + g * pc.nb + j - pc.na];
}

#version 450
// SwiGLU: y = silu(gate) * up, elementwise over the live tokens.
#include "common.glsl"

layout(binding = 0, std430) readonly buffer G { float g[]; };
layout(binding = 1, std430) readonly buffer U { float u[]; };
layout(binding = 2, std430) writeonly buffer Y { float y[]; };
DECLARE_STEP(3)

layout(push_constant) uniform Push {
    uint n;       // values per token
    uint stride;  // floats between tokens
    uint count_sel;
} pc;

void main() {
    uint i = gl_GlobalInvocationID.x;
    uint t = gl_WorkGroupID.y;
    if (i >= pc.n || t >= STEP_COUNT(pc.count_sel)) {
        return;
    }
    uint k = t * pc.stride + i;
    float a = g[k];
    y[k] = a / (1.0 + exp(-a)) * u[k];
}

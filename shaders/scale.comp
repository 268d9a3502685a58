#version 450
// y = x * scale over the live rows (gemma's embedding scaling by sqrt(n_embd)).
#include "common.glsl"

layout(binding = 0, std430) readonly buffer X { float x[]; };
layout(binding = 1, std430) writeonly buffer Y { float y[]; };
DECLARE_STEP(2)

layout(push_constant) uniform Push {
    uint n;
    uint stride;
    uint count_sel;
    float scale;
} pc;

void main() {
    uint i = gl_GlobalInvocationID.x;
    uint t = gl_WorkGroupID.y;
    if (i >= pc.n || t >= STEP_COUNT(pc.count_sel)) {
        return;
    }
    uint k = t * pc.stride + i;
    y[k] = x[k] * pc.scale;
}

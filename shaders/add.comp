#version 450
// y = a + b over the live tokens: the residual add (b has a's layout) and the q/k/v
// bias add of qwen2 (bcast = 1: b is one row added to every token).
#include "common.glsl"

layout(binding = 0, std430) readonly buffer A { float a[]; };
layout(binding = 1, std430) readonly buffer B { float b[]; };
layout(binding = 2, std430) writeonly buffer Y { float y[]; };
DECLARE_STEP(3)

layout(push_constant) uniform Push {
    uint n;
    uint stride;
    uint bcast;
    uint count_sel;
} pc;

void main() {
    uint i = gl_GlobalInvocationID.x;
    uint t = gl_WorkGroupID.y;
    if (i >= pc.n || t >= STEP_COUNT(pc.count_sel)) {
        return;
    }
    uint k = t * pc.stride + i;
    y[k] = a[k] + b[pc.bcast == 1u ? i : k];
}

#version 450
// y = x * scale over the live rows (gemma's embedding scaling by sqrt(n_embd));
// SOFTCAP: y = scale * tanh(x / scale) (gemma4's final logit softcapping).
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
#ifdef SOFTCAP
    // clamped: a driver's tanh may be (e^2z - 1) / (e^2z + 1), NaN where e^2z overflows;
    // tanh(15) is 1 in float
    y[k] = tanh(clamp(x[k] / pc.scale, -15.0, 15.0)) * pc.scale;
#else
    y[k] = x[k] * pc.scale;
#endif
}

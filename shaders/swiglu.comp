#version 450
// SwiGLU: y = silu(gate) * up, elementwise over the live tokens; with GELU defined,
// GeGLU: y = gelu(gate) * up, gelu in its tanh form (ggml_gelu's).
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
#ifdef GELU
    // 0.5 a (1 + tanh(z)) = a * sigmoid(2 z), which stays finite for large |z|
    float z = 0.7978845608028654 * (a + 0.044715 * a * a * a);
    y[k] = a / (1.0 + exp(-2.0 * z)) * u[k];
#elif defined(SIGMOID)
    y[k] = u[k] / (1.0 + exp(-a));  // sigmoid(gate) * up: qwen35's gated attention output
#else
    y[k] = a / (1.0 + exp(-a)) * u[k];
#endif
}

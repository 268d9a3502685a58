#version 450
// The weighted sum of each token's k expert outputs: y[c][i] = sum_j w[c][j] x[c][j][i],
// the weights being the second half of the routing row. Summed in slot order, as
// llama.cpp adds its expert views.
// What follows the sum in qwen3moe and qwen35moe, fused so that it costs no barrier
// level of its own (each in the unfused graph's order of operations, so the results
// are its results):
// SHEXP: + xs[c][i] * sigmoid(h[c] . g), the shared expert's output gated by its
//   one-output linear gate (gate_rows.comp; every work group makes the dot product as
//   gate_rows.comp does with the same work-group size, the norm's);
// RESID: res[c][i] + that, the residual add (y may be res's buffer: each lane reads
//   its value before it writes it).
#include "common.glsl"

layout(binding = 0, std430) readonly buffer X { float x[]; };
layout(binding = 1, std430) readonly buffer R { float routes[]; };
layout(binding = 2, std430) writeonly buffer Y { float y[]; };
DECLARE_STEP(3)
#ifdef RESID
layout(binding = 4, std430) readonly buffer Res { float res[]; };
#define SH_B0 5
#define SH_B1 6
#define SH_B2 7
#else
#define SH_B0 4
#define SH_B1 5
#define SH_B2 6
#endif
#ifdef SHEXP
layout(binding = SH_B0, std430) readonly buffer Xs { float xs[]; };
layout(binding = SH_B1, std430) readonly buffer H { float h[]; };
layout(binding = SH_B2, std430) readonly buffer G { float gw[]; };
#endif

layout(push_constant) uniform Push {
    uint n;         // values per expert output
    uint k;
    uint x_stride;  // floats between tokens of x (k * n)
    uint r_stride;  // floats between tokens of the routing (2k)
    uint y_stride;  // floats between tokens of y (and of res and xs)
#ifdef SHEXP
    uint n_in;      // values per row of h (and of g)
#endif
} pc;

#ifdef SHEXP
#include "reduce.glsl"
#endif

void main() {
    uint i = gl_GlobalInvocationID.x;
    uint t = gl_WorkGroupID.y;
    if (t >= step.n_tokens) {
        return;  // uniform in the work group
    }
#ifdef SHEXP
    float d = 0.0;
    for (uint l = gl_LocalInvocationID.x; l < pc.n_in; l += WG) {
        d += h[t * pc.n_in + l] * gw[l];
    }
    float sg = 1.0 / (1.0 + exp(-wg_sum(d)));
#endif
    if (i >= pc.n) {
        return;
    }
    float s = 0.0;
    for (uint j = 0; j < pc.k; j++) {
        s += routes[t * pc.r_stride + pc.k + j] * x[t * pc.x_stride + j * pc.n + i];
    }
    uint o = t * pc.y_stride + i;
#ifdef SHEXP
    s = s + xs[o] * sg;
#endif
#ifdef RESID
    s = res[o] + s;
#endif
    y[o] = s;
}

#version 450
// Rotary position embedding at each token's position from the step buffer, in the
// "normal" (adjacent pairs: llama GGUF, whose Q/K rows are pre-permuted) or "neox"
// (half split: qwen2/3) layout; mode 0 rotates nothing. With to_cache set the result
// goes to the KV cache row of (sequence, position) instead of in place: that is the
// KV cache write, fused (mode 0 + to_cache stores V).
#include "common.glsl"

layout(binding = 0, std430) readonly buffer X { float x[]; };
layout(binding = 1, std430) buffer Y { float y[]; };
// per-frequency divisors (llama-3 rope_freqs.weight); all ones when the model has none
layout(binding = 2, std430) readonly buffer F { float factors[]; };
DECLARE_STEP(3)

layout(push_constant) uniform Push {
    uint n_heads;
    uint head_dim;
    uint x_stride;   // floats between tokens of x
    uint mode;       // 0 none, 1 normal, 2 neox
    uint to_cache;   // 0: y has x's layout; 1: y is the cache [seq * n_ctx + pos, kv_dim]
    uint n_ctx;
    uint kv_dim;
    float log2_theta;  // log2 of the RoPE base, computed in double on the host
} pc;

void main() {
    uint t = gl_WorkGroupID.y;
    if (t >= step.n_tokens) {
        return;
    }
    uint half_dim = pc.head_dim / 2u;
    uint p = gl_GlobalInvocationID.x;
    if (p >= pc.n_heads * half_dim) {
        return;
    }
    uint h = p / half_dim;
    uint i = p % half_dim;
    uint pos = STEP_POS(t);
    uint i0 = pc.mode == 1u ? 2u * i : i;
    uint i1 = pc.mode == 1u ? 2u * i + 1u : i + half_dim;
    uint src = t * pc.x_stride + h * pc.head_dim;
    float a = x[src + i0];
    float b = x[src + i1];
    if (pc.mode != 0u) {
        float freq = exp2(-2.0 * float(i) / float(pc.head_dim) * pc.log2_theta) / factors[i];
        float ang = float(pos) * freq;
        float c = cos(ang);
        float s = sin(ang);
        float a2 = a * c - b * s;
        b = a * s + b * c;
        a = a2;
    }
    uint dst = pc.to_cache == 1u
        ? (STEP_SEQ(t) * pc.n_ctx + pos) * pc.kv_dim + h * pc.head_dim
        : src;
    y[dst + i0] = a;
    y[dst + i1] = b;
}

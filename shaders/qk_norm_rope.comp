#version 450
// QK-norm then RoPE of one head per work group (qwen3's, qwen3moe's and qwen35's q and
// k): rms_norm.comp's per-head norm (the sum of squares over lanes lane, lane + WG, ...
// with its work-group size), the head's rotation as rope.comp (normal or neox pairs,
// the frequency divisors) or, with n_rot < head_dim, as rope_partial.comp (the first
// n_rot values in half-split pairs over n_rot, the rest as normed), and the result
// stored as a value or (to_cache) into the KV cache row of (sequence, position) in the
// cache type KV_TYPE (kv.glsl), as rope.comp stores it. The input head h of token t
// starts at x[t * x_stride + h * x_head + x_off] (x_head > head_dim: qwen35's q read
// from its interleave with the output gate). Each step is the unfused kernels'
// arithmetic in their order, so the results are theirs: two or three barrier levels
// (norm, rope, the cache write) become one.
#include "common.glsl"

#ifndef KV_TYPE
#define KV_TYPE 0
#endif

layout(binding = 0, std430) readonly buffer X { float x[]; };
layout(binding = 1, std430) buffer Y { float y[]; };
layout(binding = 1, std430) buffer Y16 { uint16_t kvs16[]; };
#define kvs32 y
layout(binding = 2, std430) readonly buffer F { float factors[]; };
DECLARE_STEP(3)
layout(binding = 4, std430) readonly buffer Wt { float w[]; };  // the norm's weight [head_dim]

layout(push_constant) uniform Push {
    uint head_dim;
    uint x_stride;   // floats between tokens of x
    uint x_head;     // floats between heads of x
    uint x_off;      // the head's first value in its x_head
    uint mode;       // 1 normal, 2 neox
    uint n_rot;      // rotated values of a head (head_dim: all)
    uint to_cache;   // 0: y [t * n_heads * head_dim + h * head_dim + i]; 1: the cache row
    uint n_ctx;
    uint kv_dim;
    float eps;
    float log2_theta;
} pc;

#define KV_STORE 1
#include "kv.glsl"
#include "reduce.glsl"

const uint KT = KV_TYPE;
shared float hs[512];  // the normed head, then rotated

void main() {
    uint h = gl_WorkGroupID.x;
    uint t = gl_WorkGroupID.y;
    if (t >= step.n_tokens) {
        return;  // uniform in the work group
    }
    uint lane = gl_LocalInvocationID.x;
    uint hd = pc.head_dim;
    uint xb = t * pc.x_stride + h * pc.x_head + pc.x_off;
    float ss = 0.0;
    for (uint i = lane; i < hd; i += WG) {
        float v = x[xb + i];
        ss += v * v;
    }
    float scale = inversesqrt(wg_sum(ss) / float(hd) + pc.eps);
    for (uint i = lane; i < hd; i += WG) {
        hs[i] = x[xb + i] * scale * w[i];
    }
    barrier();
    uint pos = STEP_POS(t);
    uint half_ = pc.n_rot / 2u;
    float a0[4];
    float a1[4];
    // each lane's pairs: read every value before any is replaced
    [[unroll]] for (uint r = 0u; r < 4u; r++) {
        uint p = lane + r * WG;
        if (p < half_) {
            uint i0 = pc.mode == 1u ? 2u * p : p;
            uint i1 = pc.mode == 1u ? 2u * p + 1u : p + half_;
            float a = hs[i0];
            float b = hs[i1];
            float freq = exp2(-2.0 * float(p) / float(pc.n_rot) * pc.log2_theta) / factors[p];
            float ang = float(pos) * freq;
            float c = cos(ang);
            float s = sin(ang);
            a0[r] = a * c - b * s;
            a1[r] = a * s + b * c;
        }
    }
    barrier();
    [[unroll]] for (uint r = 0u; r < 4u; r++) {
        uint p = lane + r * WG;
        if (p < half_) {
            uint i0 = pc.mode == 1u ? 2u * p : p;
            uint i1 = pc.mode == 1u ? 2u * p + 1u : p + half_;
            hs[i0] = a0[r];
            hs[i1] = a1[r];
        }
    }
    barrier();
    if (pc.to_cache == 0u) {
        uint yb = (t * gl_NumWorkGroups.x + h) * hd;
        for (uint i = lane; i < hd; i += WG) {
            y[yb + i] = hs[i];
        }
        return;
    }
    uint row = STEP_SEQ(t) * pc.n_ctx + pos % pc.n_ctx;
    uint rw = row * kv_row_words(KT, pc.kv_dim);
    if (kv_quantized(KT)) {
        uint per_head = hd / 32u;
        for (uint b = lane; b < per_head; b += WG) {
            float v[32];
            [[unroll]] for (uint k = 0u; k < 32u; k++) {
                v[k] = hs[b * 32u + k];
            }
            kv_store_block(KT, rw, h * per_head + b, v);
        }
    } else {
        for (uint i = lane; i < hd; i += WG) {
            kv_store1(KT, rw, h * hd + i, hs[i]);
        }
    }
}

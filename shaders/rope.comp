#version 450
// Rotary position embedding at each token's position from the step buffer, in the
// "normal" (adjacent pairs: llama GGUF, whose Q/K rows are pre-permuted) or "neox"
// (half split: qwen2/3) layout; mode 0 rotates nothing. With to_cache set the result
// goes to the KV cache row of (sequence, position) instead of in place: that is the
// KV cache write, fused (mode 0 + to_cache stores V).
//
// The cache holds position p of a sequence at row p % n_ctx of its n_ctx rows (a
// full cache never wraps; a sliding-window layer's smaller cache is a ring), in the
// cache type KV_TYPE (kv.glsl). A float type is stored a value at a time, one thread
// per rotated pair; a quantized type a block of 32 values at a time, one thread per
// block (its values computed as the pair threads compute them).
#include "common.glsl"

#ifndef KV_TYPE
#define KV_TYPE 0
#endif

layout(binding = 0, std430) readonly buffer X { float x[]; };
layout(binding = 1, std430) buffer Y { float y[]; };
layout(binding = 1, std430) buffer Y16 { uint16_t kvs16[]; };
#define kvs32 y
// per-frequency divisors (llama-3 rope_freqs.weight); all ones when the model has none
layout(binding = 2, std430) readonly buffer F { float factors[]; };
DECLARE_STEP(3)

layout(push_constant) uniform Push {
    uint n_heads;
    uint head_dim;
    uint x_stride;   // floats between tokens of x
    uint mode;       // 0 none, 1 normal, 2 neox
    uint to_cache;   // 0: y has x's layout; 1: y is the cache [seq * n_ctx + pos % n_ctx, kv_dim]
    uint n_ctx;
    uint kv_dim;
    float log2_theta;  // log2 of the RoPE base, computed in double on the host
} pc;

#define KV_STORE 1
#include "kv.glsl"

const uint KT = KV_TYPE;

// the rotated pair (a, b) of frequency i at position pos
vec2 rotate(float a, float b, uint i, uint pos) {
    if (pc.mode == 0u) {
        return vec2(a, b);
    }
    float freq = exp2(-2.0 * float(i) / float(pc.head_dim) * pc.log2_theta) / factors[i];
    float ang = float(pos) * freq;
    float c = cos(ang);
    float s = sin(ang);
    return vec2(a * c - b * s, a * s + b * c);
}

void main() {
    uint t = gl_WorkGroupID.y;
    if (t >= step.n_tokens) {
        return;
    }
    uint half_dim = pc.head_dim / 2u;
    uint p = gl_GlobalInvocationID.x;
    uint pos = STEP_POS(t);
    uint row = STEP_SEQ(t) * pc.n_ctx + pos % pc.n_ctx;
    if (pc.to_cache == 1u && kv_quantized(KT)) {
        // thread p: block p of the token's row (head_dim is a multiple of 32)
        uint per_head = pc.head_dim / 32u;
        if (p >= pc.n_heads * per_head) {
            return;
        }
        uint h = p / per_head;
        uint src = t * pc.x_stride + h * pc.head_dim;
        float v[32];
        [[unroll]] for (uint k = 0; k < 32u; k++) {
            uint e = (p % per_head) * 32u + k;  // element of the head
            bool first = pc.mode == 1u ? (e & 1u) == 0u : e < half_dim;
            uint i = pc.mode == 1u ? e / 2u : e % half_dim;  // the pair's frequency
            uint e0 = pc.mode == 1u ? 2u * i : i;
            vec2 r = rotate(x[src + e0], x[src + e0 + (pc.mode == 1u ? 1u : half_dim)], i, pos);
            v[k] = first ? r.x : r.y;
        }
        kv_store_block(KT, row * kv_row_words(KT, pc.kv_dim), p, v);
        return;
    }
    if (p >= pc.n_heads * half_dim) {
        return;
    }
    uint h = p / half_dim;
    uint i = p % half_dim;
    uint i0 = pc.mode == 1u ? 2u * i : i;
    uint i1 = pc.mode == 1u ? 2u * i + 1u : i + half_dim;
    uint src = t * pc.x_stride + h * pc.head_dim;
    vec2 r = rotate(x[src + i0], x[src + i1], i, pos);
    if (pc.to_cache == 1u) {
        uint rw = row * kv_row_words(KT, pc.kv_dim);
        kv_store1(KT, rw, h * pc.head_dim + i0, r.x);
        kv_store1(KT, rw, h * pc.head_dim + i1, r.y);
    } else {
        y[src + i0] = r.x;
        y[src + i1] = r.y;
    }
}

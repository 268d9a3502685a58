#version 450
// The activations of a decode step as q8_1 blocks, for matvec.comp's X_Q8 form
// (llama.cpp's quantize_q8_1 before its mul_mat_vec_q): per column c and block b of
// 32 values x[c][32b ..],
//   d = max|x| / 127,  q_i = roundf(x_i / d) (0 where d = 0),  s = d * sum(q_i)
// (llama.cpp's CUDA quantize_q8_1 rounds x_i / d the same way; its reference
// quantize_row_q8_1 stores s = d * sum(q) as here). d and s stay f32 here (llama.cpp
// rounds them to f16): the matvec reads them once per 32 values, so the two bytes
// saved would buy nothing.
//
// Layout, for a product over n_in values (n_in a multiple of 32):
//   q  (binding 1): column c's int8 values at bytes [c * n_in, (c + 1) * n_in), in
//      order, four to a little-endian word, so a lane reads 16 of them as one uvec4
//   ds (binding 2): column c's blocks at vec2 [c * n_in / 32 ..]: (d, s) per block
// One invocation per block: eight vec4 loads, two uvec4 stores and one vec2.
//
// NORM_IN: the input is RMSNorm(x) * g (an rms_norm read only by products on int8
// activations, its dispatch dropped): a work group per column adds up x^2 over the
// row (rms_norm.comp's reduction), then quantizes x * (1 / sqrt(mean(x^2) + eps)) * g
// block by block, so the quantize costs no stage of its own there.
#include "common.glsl"

layout(binding = 0, std430) readonly buffer X { vec4 x4[]; };
layout(binding = 1, std430) writeonly buffer Q { uvec4 q4[]; };
layout(binding = 2, std430) writeonly buffer D { vec2 ds[]; };
DECLARE_STEP(3)
#if defined(NORM_IN)
layout(binding = 4, std430) readonly buffer G { vec4 g4[]; };  // the norm's weight
#endif

layout(push_constant) uniform Push {
    uint n_in;      // values per column (a multiple of 32)
    uint x_stride;  // floats between columns of x (a multiple of 4)
    uint count_sel; // which step count says how many columns are live
    uint cap;       // the most columns (the graph's bucket)
#if defined(NORM_IN)
    float eps;      // the norm's epsilon
#endif
} pc;
#if defined(NORM_IN)
#include "reduce.glsl"
#endif

// roundf: half-way cases away from zero, exactly (x - trunc(x) is exact here)
float round_away(float v) {
    float t = trunc(v);
    return abs(v - t) >= 0.5 ? t + sign(v) : t;
}

uint pack4(vec4 q) {
    ivec4 i = ivec4(q) & 0xFF;
    return uint(i.x | (i.y << 8) | (i.z << 16) | (i.w << 24));
}

void quantize_block(uint c, uint b, float scale) {
    uint xb = (c * pc.x_stride + b * 32u) / 4u;
    vec4 v[8];
    float amax = 0.0;
    [[unroll]] for (uint i = 0; i < 8u; i++) {
        v[i] = x4[xb + i];
#if defined(NORM_IN)
        v[i] = v[i] * scale * g4[b * 8u + i];  // rms_norm.comp's x * scale * w
#endif
        vec4 a = abs(v[i]);
        amax = max(amax, max(max(a.x, a.y), max(a.z, a.w)));
    }
    float d = amax / 127.0;
    float sum = 0.0;  // of the int8 values: exact in f32
    uint w[8];
    [[unroll]] for (uint i = 0; i < 8u; i++) {
        vec4 q = vec4(0.0);
        if (amax != 0.0) {
            q = vec4(round_away(v[i].x / d), round_away(v[i].y / d), round_away(v[i].z / d),
                     round_away(v[i].w / d));
        }
        sum += q.x + q.y + q.z + q.w;
        w[i] = pack4(q);
    }
    uint nb = pc.n_in / 32u;
    uint qb = (c * pc.n_in + b * 32u) / 16u;
    q4[qb] = uvec4(w[0], w[1], w[2], w[3]);
    q4[qb + 1u] = uvec4(w[4], w[5], w[6], w[7]);
    ds[c * nb + b] = vec2(d, d * sum);
}

void main() {
    uint nb = pc.n_in / 32u;
    uint ncols = min(STEP_COUNT(pc.count_sel), pc.cap);
#if defined(NORM_IN)
    // a work group per column: sum(x^2) over the row first (rms_norm.comp's), then its blocks
    uint c = FLAT_GROUP;
    if (c >= ncols) {
        return;
    }
    uint xb = c * pc.x_stride / 4u;
    float ss = 0.0;
    for (uint i = gl_LocalInvocationID.x; i < pc.n_in / 4u; i += WG) {
        vec4 v = x4[xb + i];
        ss += dot(v, v);
    }
    float scale = inversesqrt(wg_sum(ss) / float(pc.n_in) + pc.eps);
    for (uint b = gl_LocalInvocationID.x; b < nb; b += WG) {
        quantize_block(c, b, scale);
    }
#else
    uint id = FLAT_GROUP * WG + gl_LocalInvocationID.x;
    uint c = id / nb;
    if (c < ncols) {
        quantize_block(c, id % nb, 1.0);
    }
#endif
}

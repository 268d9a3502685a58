#version 450
// Mixture-of-experts routing (llama.cpp's build_moe_ffn up to the weights): per live
// token, the softmax of its router logits over n_expert experts, the k most probable
// (highest first; equal probabilities: the lower id), their probabilities divided by
// their sum (norm, the sum clamped at float16's smallest normal as llama.cpp does),
// times scale. Writes the routing row: k ids (exact floats), then k weights.
// One work group per token; each of the k picks is a shared-memory argmax.
// SIGMOID: each logit's sigmoid instead of the softmax; with BIAS the picks go by the
// probabilities plus a selection bias b[n_expert] (DeepSeek-V3's), the weights stay the
// unbiased probabilities.
#include "common.glsl"

layout(binding = 0, std430) readonly buffer X { float x[]; };
layout(binding = 1, std430) writeonly buffer Y { float y[]; };
DECLARE_STEP(2)
#ifdef BIAS
layout(binding = 3, std430) readonly buffer B { float bias[]; };
#endif

layout(push_constant) uniform Push {
    uint n_expert;
    uint k;
    uint x_stride;
    uint y_stride;
    uint norm;      // 1: renormalise the chosen weights
    float scale;    // 0 or 1: none
} pc;

const uint MAX_EXPERT = 512;
shared float p[MAX_EXPERT];
shared float red_v[WG];
shared uint red_i[WG];
shared float chosen_w[64];
#ifdef SIGMOID
shared float pr[MAX_EXPERT];  // the unbiased probabilities (p holds the selection scores)
#endif

void main() {
    uint t = FLAT_GROUP;
    if (t >= step.n_tokens) {
        return;
    }
    uint lid = gl_LocalInvocationID.x;
    uint base = t * pc.x_stride;
#ifdef SIGMOID
    for (uint e = lid; e < pc.n_expert; e += WG) {
        float v = 1.0 / (1.0 + exp(-x[base + e]));
        pr[e] = v;
#ifdef BIAS
        p[e] = v + bias[e];
#else
        p[e] = v;
#endif
    }
    float inv = 1.0;
    barrier();
#else
    // softmax: the max, then exp and the sum
    float m = -1.0 / 0.0;
    for (uint e = lid; e < pc.n_expert; e += WG) {
        m = max(m, x[base + e]);
    }
    red_v[lid] = m;
    barrier();
    for (uint s = WG / 2u; s > 0u; s >>= 1) {
        if (lid < s) {
            red_v[lid] = max(red_v[lid], red_v[lid + s]);
        }
        barrier();
    }
    m = red_v[0];
    barrier();
    float sum = 0.0;
    for (uint e = lid; e < pc.n_expert; e += WG) {
        float v = exp(x[base + e] - m);
        p[e] = v;
        sum += v;
    }
    red_v[lid] = sum;
    barrier();
    for (uint s = WG / 2u; s > 0u; s >>= 1) {
        if (lid < s) {
            red_v[lid] += red_v[lid + s];
        }
        barrier();
    }
    float inv = 1.0 / red_v[0];
    barrier();
#endif
    for (uint j = 0; j < pc.k; j++) {
        float bv = -1.0 / 0.0;
        uint bi = 0xFFFFFFFFu;
        for (uint e = lid; e < pc.n_expert; e += WG) {
            float v = p[e];
            if (v > bv) {  // strided in increasing e: ties keep the lower id
                bv = v;
                bi = e;
            }
        }
        red_v[lid] = bv;
        red_i[lid] = bi;
        barrier();
        for (uint s = WG / 2u; s > 0u; s >>= 1) {
            if (lid < s) {
                float ov = red_v[lid + s];
                uint oi = red_i[lid + s];
                if (ov > red_v[lid] || (ov == red_v[lid] && oi < red_i[lid])) {
                    red_v[lid] = ov;
                    red_i[lid] = oi;
                }
            }
            barrier();
        }
        if (lid == 0u) {
            uint best = red_i[0];
#ifdef SIGMOID
            chosen_w[j] = pr[best];
#else
            chosen_w[j] = red_v[0] * inv;
#endif
            y[t * pc.y_stride + j] = float(best);
            p[best] = -1.0 / 0.0;  // taken
        }
        barrier();
    }
    if (lid == 0u) {
        float tot = 0.0;
        for (uint j = 0; j < pc.k; j++) {
            tot += chosen_w[j];
        }
        float f = pc.norm == 1u ? 1.0 / max(tot, 6.103515625e-5) : 1.0;
        if (pc.scale != 0.0) {
            f *= pc.scale;
        }
        for (uint j = 0; j < pc.k; j++) {
            y[t * pc.y_stride + pc.k + j] = chosen_w[j] * f;
        }
    }
}

#version 450
// The gated delta rule (qwen35's linear attention) with its per-sequence state: for
// each v head h (k head h % n_k) and each token of a sequence's run in this step,
//   S *= exp(g),  delta = beta (v - S^T k),  S += k delta^T,  o = S^T q / sqrt(d)
// with g = softplus(alpha + dt[h]) a[h] and beta = sigmoid(beta). One work group of d
// lanes per (v head, first token of a run); lane j keeps column j of S (d values) in
// registers, so every product is a lane's own loop over k and q held in shared memory.
// State [n_seq][n_v][d (column j)][d (row i)]; a run starting at position 0 starts
// from zeros. d is the work-group size.
// GATED_NORM: each output head is then RMS-normed with the weight nw and multiplied by
// silu(z) (qwen35's ssm_norm and its gate, rms_norm.comp then swiglu.comp unfused): the
// sum of squares is made as rms_norm.comp makes it with a work group of NW lanes (lane
// j < NW sums the values j, j + NW, ...), so the result is the unfused chain's.
#include "common.glsl"

layout(binding = 0, std430) readonly buffer Q { float q[]; };
layout(binding = 1, std430) readonly buffer K { float k[]; };
layout(binding = 2, std430) readonly buffer V { float v[]; };
layout(binding = 3, std430) readonly buffer A { float alpha[]; };
layout(binding = 4, std430) readonly buffer B { float beta[]; };
layout(binding = 5, std430) readonly buffer Dt { float dt[]; };
layout(binding = 6, std430) readonly buffer Ad { float a[]; };
layout(binding = 7, std430) writeonly buffer O { float o[]; };
layout(binding = 8, std430) buffer S { float st[]; };
DECLARE_STEP(9)

#ifdef GATED_NORM
layout(binding = 10, std430) readonly buffer Z { float z[]; };
layout(binding = 11, std430) readonly buffer Nw { float nw[]; };
layout(constant_id = 1) const uint NW = 64;
#endif

layout(push_constant) uniform Push {
    uint n_k;
    uint n_v;
#ifdef GATED_NORM
    float eps;
#endif
} pc;

shared float qs[WG];
shared float ks[WG];
#ifdef GATED_NORM
shared float os[WG];
#include "reduce.glsl"
#endif

void main() {
    uint h = gl_WorkGroupID.x;
    uint t0 = gl_WorkGroupID.y;
    if (t0 >= step.n_tokens) {
        return;
    }
    uint seq = STEP_SEQ(t0);
    if (t0 > 0u && STEP_SEQ(t0 - 1u) == seq) {
        return;  // not the first token of its run
    }
    uint j = gl_LocalInvocationID.x;
    uint kh = h % pc.n_k;
    float scale = inversesqrt(float(WG));
    uint sb = ((seq * pc.n_v + h) * WG + j) * WG;
    bool fresh = STEP_POS(t0) == 0u;
    float s[WG];
    for (uint i = 0u; i < WG; i++) {
        s[i] = fresh ? 0.0 : st[sb + i];
    }
    for (uint t = t0; t < step.n_tokens && STEP_SEQ(t) == seq; t++) {
        barrier();
        qs[j] = q[(t * pc.n_k + kh) * WG + j] * scale;
        ks[j] = k[(t * pc.n_k + kh) * WG + j];
        barrier();
        float x = alpha[t * pc.n_v + h] + dt[h];
        float sp = x > 20.0 ? x : log(1.0 + exp(x));
        float decay = exp(sp * a[h]);
        float b = 1.0 / (1.0 + exp(-beta[t * pc.n_v + h]));
        float kv = 0.0;
        for (uint i = 0u; i < WG; i++) {
            s[i] *= decay;
            kv += s[i] * ks[i];
        }
        float delta = (v[(t * pc.n_v + h) * WG + j] - kv) * b;
        float acc = 0.0;
        for (uint i = 0u; i < WG; i++) {
            s[i] += ks[i] * delta;
            acc += s[i] * qs[i];
        }
#ifdef GATED_NORM
        os[j] = acc;
        barrier();
        float ss = 0.0;
        if (j < NW) {
            for (uint i = j; i < WG; i += NW) {
                ss += os[i] * os[i];
            }
        }
        float nscale = inversesqrt(wg_sum(ss) / float(WG) + pc.eps);
        float zv = z[(t * pc.n_v + h) * WG + j];
        o[(t * pc.n_v + h) * WG + j] = zv / (1.0 + exp(-zv)) * (acc * nscale * nw[j]);
#else
        o[(t * pc.n_v + h) * WG + j] = acc;
#endif
    }
    for (uint i = 0u; i < WG; i++) {
        st[sb + i] = s[i];
    }
}

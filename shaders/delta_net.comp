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
// CONV: q, k and v are not inputs: each lane makes its channel of them from the conv's
// input (qkv [T][C], channels q | k | v) as ssm_conv.comp's PHASE 0 does (its taps over
// the run and the conv state, SiLU) and L2-normalises the q and k heads as l2_norm.comp
// does (its sums over NW lanes): qwen35's conv -> take -> l2_norm before the rule,
// without a dispatch of their own. The conv state is only read here; ssm_conv.comp's
// PHASE 1 moves it on after a barrier.
// DU (= d, a compile-time constant): the column's array is sized by it and its loops are
// unrolled, so that every index is a constant and the column can live in registers. With
// the size a specialization constant the loops stay loops and the array is indexed at run
// time, which a GPU may place in local memory (on NVIDIA sized for every thread the whole
// device can hold, and kept while the pipeline lives).
#include "common.glsl"
#ifdef DU
#define SN DU
#define SN_UNROLL [[unroll]]
#else
#define SN WG
#define SN_UNROLL
#endif

#ifdef CONV
layout(binding = 0, std430) readonly buffer Cx { float cx[]; };   // [T][C]
layout(binding = 1, std430) readonly buffer Cw { float cw[]; };   // [C][d_conv]
layout(binding = 2, std430) readonly buffer Cs { float cst[]; };  // [n_seq][d_conv - 1][C]
#else
layout(binding = 0, std430) readonly buffer Q { float q[]; };
layout(binding = 1, std430) readonly buffer K { float k[]; };
layout(binding = 2, std430) readonly buffer V { float v[]; };
#endif
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
#endif
layout(constant_id = 1) const uint NW = 64;

layout(push_constant) uniform Push {
    uint n_k;
    uint n_v;
#ifdef GATED_NORM
    float eps;
#endif
#ifdef CONV
    uint c;         // conv channels (2 n_k d + n_v d)
    uint kc;        // d_conv
    float l2_eps;
#endif
} pc;

shared float qs[WG];
shared float ks[WG];
#ifdef GATED_NORM
shared float os[WG];
#endif
#if defined(GATED_NORM) || defined(CONV)
#include "reduce.glsl"
#endif

#ifdef CONV
// ssm_conv.comp's output of channel ch at token t, i (at most d_conv - 1) tokens of its
// run before it in the step, the run's state fresh at position 0
float conv_at(uint ch, uint t, uint seq, uint i, bool fresh) {
    uint km = pc.kc - 1u;
    uint sb = seq * km * pc.c + ch;
    float acc = 0.0;
    for (uint tap = 0u; tap < pc.kc; tap++) {
        uint back = km - tap;
        float val;
        if (back <= i) {
            val = cx[(t - back) * pc.c + ch];
        } else {
            val = fresh ? 0.0 : cst[sb + (km - (back - i)) * pc.c];
        }
        acc += val * cw[ch * pc.kc + tap];
    }
    return acc / (1.0 + exp(-acc));
}

// 1 / max(|head|, eps) of the head in a shared array, summed as l2_norm.comp sums it
float l2_scale(uint j, bool of_q) {
    float ss = 0.0;
    if (j < NW) {
        for (uint i = j; i < WG; i += NW) {
            float u = of_q ? qs[i] : ks[i];
            ss += u * u;
        }
    }
    return 1.0 / max(sqrt(wg_sum(ss)), pc.l2_eps);
}
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
    float s[SN];
    SN_UNROLL for (uint i = 0u; i < SN; i++) {
        s[i] = fresh ? 0.0 : st[sb + i];
    }
    for (uint t = t0; t < step.n_tokens && STEP_SEQ(t) == seq; t++) {
        barrier();
#ifdef CONV
        uint key = pc.n_k * WG;
        uint ci = min(t - t0, pc.kc - 1u);
        float qv = conv_at(kh * WG + j, t, seq, ci, fresh);
        float kv0 = conv_at(key + kh * WG + j, t, seq, ci, fresh);
        float vv = conv_at(2u * key + h * WG + j, t, seq, ci, fresh);
        qs[j] = qv;
        ks[j] = kv0;
        barrier();
        float sq = l2_scale(j, true);
        float sk = l2_scale(j, false);
        qs[j] = qv * sq * scale;
        ks[j] = kv0 * sk;
#else
        qs[j] = q[(t * pc.n_k + kh) * WG + j] * scale;
        ks[j] = k[(t * pc.n_k + kh) * WG + j];
#endif
        barrier();
        float x = alpha[t * pc.n_v + h] + dt[h];
        float sp = x > 20.0 ? x : log(1.0 + exp(x));
        float decay = exp(sp * a[h]);
        float b = 1.0 / (1.0 + exp(-beta[t * pc.n_v + h]));
        float kv = 0.0;
        SN_UNROLL for (uint i = 0u; i < SN; i++) {
            s[i] *= decay;
            kv += s[i] * ks[i];
        }
#ifdef CONV
        float delta = (vv - kv) * b;
#else
        float delta = (v[(t * pc.n_v + h) * WG + j] - kv) * b;
#endif
        float acc = 0.0;
        SN_UNROLL for (uint i = 0u; i < SN; i++) {
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
    SN_UNROLL for (uint i = 0u; i < SN; i++) {
        st[sb + i] = s[i];
    }
}

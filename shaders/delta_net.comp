#version 450
// The gated delta rule (qwen35's linear attention) with its per-sequence state: for
// each v head h (k head K_HEAD(h): h % n_k, or h / KH_DIV) and each token of a sequence's run in this step,
//   S *= exp(g),  delta = beta (v - S^T k),  S += k delta^T,  o = S^T q / sqrt(d)
// with g = softplus(alpha + dt[h]) a[h] and beta = sigmoid(beta). One work group of d
// lanes per (v head, first token of a run); lane j keeps column j of S (d values) in
// registers, so every product is a lane's own loop over k and q held in shared memory.
// State [n_seq][n_v][d (column j)][d (row i)]; a run starting at position 0 starts
// from zeros. d is the work-group size (DP d in the DP form below).
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
// DP (2, 4 or 8, with DU = d, the head dim as a compile-time constant): the split-lane form, DP adjacent lanes of one subgroup per
// column. The work group is DP * d lanes, one head (DP = 8 at d = 128 is the 1024-lane
// limit; one head per group keeps the grid and the early exits as in the other forms):
// lane l holds part p = l % DP of column j = l / DP, the d / DP rows i = 4 (r DP + p) + c
// (r < d / (4 DP), c < 4) as d / (4 DP) vec4s, so that the DP lanes of a column read DP
// adjacent vec4s of the column at once (the state binding is read as vec4s: 16-byte
// aligned, d a multiple of 4 DP). Per token each lane makes its partial of k.S_col and
// of q.S_col and a subgroupShuffleXor butterfly over the DP lanes (adjacent, DP dividing
// the subgroup, so every xor stays within the column) leaves the full sums in each of
// them, the same value in each (each step adds the same two partials); part 0 writes the
// output. q and k (and with CONV v) sit in shared memory double-buffered by the token's
// parity, so a token needs one barrier before its reads, none before its writes (the
// buffer written was last read two tokens before, behind the previous token's barrier).
// A token's inputs from memory (alpha, beta, z; q, k, v without CONV) are loaded during
// the token before it, so that a long run waits on no load of its own per token.
// The lanes l < d load (or with CONV make) the token's q, k, v as lane j does in the
// other forms; the norms' sums are made over the same NW lanes in the same order
// (head_sum: wg_sum without the partials of the subgroups past the first NW lanes,
// which are zeros; a group of 1024 lanes has more subgroups than reduce.glsl's slots).
#include "common.glsl"
#include "khead.glsl"
#ifdef DP
#extension GL_KHR_shader_subgroup_shuffle : require
#define HD DU                  // the head dim (the work group is DP * HD lanes)
#define NR (DU / (4 * DP))     // vec4s of its column a lane holds
#else
#define HD WG
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
#ifdef DP
layout(binding = 8, std430) buffer S { vec4 st4[]; };  // the same layout, 4 rows a word
#else
layout(binding = 8, std430) buffer S { float st[]; };
#endif
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

#ifdef DP
// [token parity][HD / 4]: value i of buffer b is QS(b, i), vec4 r of it qs4[b][r]
shared vec4 qs4[2][HD / 4];
shared vec4 ks4[2][HD / 4];
#define QS(b, i) qs4[b][(i) >> 2][(i) & 3u]
#define KS(b, i) ks4[b][(i) >> 2][(i) & 3u]
#ifdef CONV
shared float vs[2][HD];
#endif
#else
shared float qs[WG];
shared float ks[WG];
#define QS(b, i) qs[i]
#define KS(b, i) ks[i]
#endif
#ifdef GATED_NORM
shared float os[HD];
#endif
#if defined(GATED_NORM) || defined(CONV)
#include "reduce.glsl"
#ifdef DP
// wg_sum of a value that only the lanes l < NW hold (zeros elsewhere): the same sum,
// without the slots of the subgroups past them (zeros), so that any work group fits
float head_sum(float v) {
    float s = subgroupAdd(v);
    uint n = (NW + gl_SubgroupSize - 1u) / gl_SubgroupSize;
    if (subgroupElect() && gl_SubgroupID < n) {
        red_buf[gl_SubgroupID] = s;
    }
    barrier();
    float r = 0.0;
    for (uint i = 0u; i < n; i++) {
        r += red_buf[i];
    }
    barrier();
    return r;
}
#define NORM_SUM head_sum
#else
#define NORM_SUM wg_sum
#endif
#endif

#ifdef DP
// the sum of v over the DP lanes of a column, in each of them
float split_sum(float v) {
    [[unroll]] for (uint x = 1u; x < DP; x <<= 1) {
        v += subgroupShuffleXor(v, x);
    }
    return v;
}
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

// 1 / max(|head|, eps) of the head in buffer b of a shared array, summed as
// l2_norm.comp sums it (lane l < NW: the values l, l + NW, ...)
float l2_scale(uint l, uint b, bool of_q) {
    float ss = 0.0;
    if (l < NW) {
        for (uint i = l; i < HD; i += NW) {
            float u = of_q ? QS(b, i) : KS(b, i);
            ss += u * u;
        }
    }
    return 1.0 / max(sqrt(NORM_SUM(ss)), pc.l2_eps);
}
#endif

#ifdef DP
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
    uint l = gl_LocalInvocationID.x;
    uint j = l / DP;  // the column
    uint p = l % DP;  // the lane's part of it
    bool loads = l < HD;  // the lanes that load (make) the token's q, k (v), value l each
    uint kh = K_HEAD(h);
    float scale = inversesqrt(float(HD));
    bool fresh = STEP_POS(t0) == 0u;
    uint sb = ((seq * pc.n_v + h) * HD + j) * (HD / 4u) + p;  // in vec4s; vec4 r at sb + r DP
    vec4 s[NR];
    [[unroll]] for (uint r = 0u; r < NR; r++) {
        s[r] = fresh ? vec4(0.0) : st4[sb + r * DP];
    }
    // token t's inputs, loaded while the token before it is worked on (the loop issues
    // them before its barrier and first uses them a token later)
    uint t = t0;
    float fa = alpha[t * pc.n_v + h];
    float fb = beta[t * pc.n_v + h];
#ifdef GATED_NORM
    float fz = z[(t * pc.n_v + h) * HD + j];
#endif
#ifndef CONV
    float fq = 0.0;
    float fk = 0.0;
    if (loads) {
        fq = q[(t * pc.n_k + kh) * HD + l];
        fk = k[(t * pc.n_k + kh) * HD + l];
    }
    float fv = v[(t * pc.n_v + h) * HD + j];
#endif
    for (;;) {
        uint bf = (t - t0) & 1u;
        float x = fa + dt[h];
        float bt = fb;
#ifdef GATED_NORM
        float zv = fz;
#endif
#ifdef CONV
        uint key = pc.n_k * HD;
        uint ci = min(t - t0, pc.kc - 1u);
        float qv = 0.0;
        float kv0 = 0.0;
        if (loads) {
            qv = conv_at(kh * HD + l, t, seq, ci, fresh);
            kv0 = conv_at(key + kh * HD + l, t, seq, ci, fresh);
            vs[bf][l] = conv_at(2u * key + h * HD + l, t, seq, ci, fresh);
            QS(bf, l) = qv;
            KS(bf, l) = kv0;
        }
        barrier();
        float sq = l2_scale(l, bf, true);
        float sk = l2_scale(l, bf, false);
        if (loads) {
            QS(bf, l) = qv * sq * scale;
            KS(bf, l) = kv0 * sk;
        }
#else
        if (loads) {
            QS(bf, l) = fq * scale;
            KS(bf, l) = fk;
        }
        float vj = fv;
#endif
        uint tn = t + 1u;
        bool more = tn < step.n_tokens && STEP_SEQ(tn) == seq;
        if (more) {
            fa = alpha[tn * pc.n_v + h];
            fb = beta[tn * pc.n_v + h];
#ifdef GATED_NORM
            fz = z[(tn * pc.n_v + h) * HD + j];
#endif
#ifndef CONV
            if (loads) {
                fq = q[(tn * pc.n_k + kh) * HD + l];
                fk = k[(tn * pc.n_k + kh) * HD + l];
            }
            fv = v[(tn * pc.n_v + h) * HD + j];
#endif
        }
        barrier();
#ifdef CONV
        float vj = vs[bf][j];
#endif
        float sp = x > 20.0 ? x : log(1.0 + exp(x));
        float decay = exp(sp * a[h]);
        float b = 1.0 / (1.0 + exp(-bt));
        float kv = 0.0;
        [[unroll]] for (uint r = 0u; r < NR; r++) {
            s[r] *= decay;
            kv += dot(s[r], ks4[bf][r * DP + p]);
        }
        float delta = (vj - split_sum(kv)) * b;
        float acc = 0.0;
        [[unroll]] for (uint r = 0u; r < NR; r++) {
            s[r] += ks4[bf][r * DP + p] * delta;
            acc += dot(s[r], qs4[bf][r * DP + p]);
        }
        acc = split_sum(acc);
#ifdef GATED_NORM
        if (p == 0u) {
            os[j] = acc;
        }
        barrier();
        float ss = 0.0;
        if (l < NW) {
            for (uint i = l; i < HD; i += NW) {
                ss += os[i] * os[i];
            }
        }
        float nscale = inversesqrt(head_sum(ss) / float(HD) + pc.eps);
        if (p == 0u) {
            o[(t * pc.n_v + h) * HD + j] = zv / (1.0 + exp(-zv)) * (acc * nscale * nw[j]);
        }
#else
        if (p == 0u) {
            o[(t * pc.n_v + h) * HD + j] = acc;
        }
#endif
        if (!more) {
            break;
        }
        t = tn;
    }
    [[unroll]] for (uint r = 0u; r < NR; r++) {
        st4[sb + r * DP] = s[r];
    }
}
#else
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
    uint kh = K_HEAD(h);
    float scale = inversesqrt(float(WG));
    uint sb = ((seq * pc.n_v + h) * WG + j) * WG;
    bool fresh = STEP_POS(t0) == 0u;
    float s[WG];
    for (uint i = 0u; i < WG; i++) {
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
        float sq = l2_scale(j, 0u, true);
        float sk = l2_scale(j, 0u, false);
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
        for (uint i = 0u; i < WG; i++) {
            s[i] *= decay;
            kv += s[i] * ks[i];
        }
#ifdef CONV
        float delta = (vv - kv) * b;
#else
        float delta = (v[(t * pc.n_v + h) * WG + j] - kv) * b;
#endif
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
#endif

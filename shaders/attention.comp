#version 450
// Attention of one query head of one token over its own sequence's KV cache, flash
// style: keys in blocks of WG, an online softmax (running max m, running sum l, the
// output rescaled when m grows), so scores never leave the work group. Blocks past
// the token's position are never visited (fully masked), and only the last visited
// block, the one the position cuts, evaluates the causal mask at all.
#include "common.glsl"

layout(binding = 0, std430) readonly buffer Q { float q[]; };
layout(binding = 1, std430) readonly buffer K { float kc[]; };
layout(binding = 2, std430) readonly buffer V { float vc[]; };
layout(binding = 3, std430) writeonly buffer O { float o[]; };
DECLARE_STEP(4)

layout(push_constant) uniform Push {
    uint n_head;
    uint n_head_kv;
    uint head_dim;
    uint n_ctx;
    uint kv_dim;
    uint q_stride;
    uint o_stride;
    float scale;
} pc;

#include "reduce.glsl"

const uint MAX_HEAD_DIM = 256;
const uint DPT = 4;  // output dims per thread: head_dim <= DPT * WG

shared float qs[MAX_HEAD_DIM];
shared float ps[WG];

void main() {
    uint h = gl_WorkGroupID.x;
    uint t = gl_WorkGroupID.y;
    if (t >= step.n_tokens) {
        return;
    }
    uint tid = gl_LocalInvocationID.x;
    uint hd = pc.head_dim;
    uint len = STEP_POS(t) + 1u;
    uint base = STEP_SEQ(t) * pc.n_ctx;
    uint koff = (h / (pc.n_head / pc.n_head_kv)) * hd;
    for (uint d = tid; d < hd; d += WG) {
        qs[d] = q[t * pc.q_stride + h * hd + d] * pc.scale;
    }
    barrier();

    float m = -1.0e30;
    float l = 0.0;
    float acc[DPT];
    [[unroll]] for (uint a = 0; a < DPT; a++) {
        acc[a] = 0.0;
    }
    for (uint b0 = 0; b0 < len; b0 += WG) {
        bool full = b0 + WG <= len;
        uint j = b0 + tid;
        bool live = full || j < len;
        float s = -1.0e30;
        if (live) {
            uint kb = (base + j) * pc.kv_dim + koff;
            float dotv = 0.0;
            for (uint d = 0; d < hd; d++) {
                dotv += qs[d] * kc[kb + d];
            }
            s = dotv;
        }
        float mn = max(m, wg_max(s));
        ps[tid] = live ? exp(s - mn) : 0.0;
        float corr = exp(m - mn);
        barrier();
        uint nvalid = min(WG, len - b0);
        float lsum = 0.0;
        [[unroll]] for (uint a = 0; a < DPT; a++) {
            acc[a] *= corr;
        }
        for (uint jj = 0; jj < nvalid; jj++) {
            float pj = ps[jj];
            lsum += pj;
            uint vb = (base + b0 + jj) * pc.kv_dim + koff;
            [[unroll]] for (uint a = 0; a < DPT; a++) {
                uint d = tid + a * WG;
                if (d < hd) {
                    acc[a] += pj * vc[vb + d];
                }
            }
        }
        l = l * corr + lsum;
        m = mn;
        barrier();
    }
    float inv = 1.0 / l;
    [[unroll]] for (uint a = 0; a < DPT; a++) {
        uint d = tid + a * WG;
        if (d < hd) {
            o[t * pc.o_stride + h * hd + d] = acc[a] * inv;
        }
    }
}

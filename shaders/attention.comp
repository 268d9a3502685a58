#version 450
// Attention of one query head of one token over its own sequence's KV cache, flash
// style: keys in blocks of WG, an online softmax (running max m, running sum l, the
// output rescaled when m grows), so scores never leave the work group. Blocks past
// the token's position are never visited (fully masked), and only the last visited
// block, the one the position cuts, has dead lanes at all.
//
// Decode runs one work group per head, so what counts is latency, not throughput:
// each lane reads its key row as 128-bit loads, four at a time, and the value loop
// takes eight keys per round, so a lane always has several loads in flight instead
// of one dependent load per dimension (the scalar loops measured ~10 us per block
// on the H200).
#include "common.glsl"

layout(binding = 0, std430) readonly buffer Q { float q[]; };
layout(binding = 1, std430) readonly buffer K { vec4 kc4[]; };
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

shared vec4 qs4[MAX_HEAD_DIM / 4];
shared float ps[WG];

void main() {
    uint h = gl_WorkGroupID.x;
    uint t = gl_WorkGroupID.y;
    if (t >= step.n_tokens) {
        return;
    }
    uint tid = gl_LocalInvocationID.x;
    uint hd = pc.head_dim;
    uint hd4 = hd / 4u;  // head_dim is a multiple of 4 (checked at load)
    uint len = STEP_POS(t) + 1u;
    uint base = STEP_SEQ(t) * pc.n_ctx;
    uint koff = (h / (pc.n_head / pc.n_head_kv)) * hd;
    uint qb = t * pc.q_stride + h * hd;
    for (uint d = tid; d < hd4; d += WG) {
        qs4[d] = vec4(q[qb + 4u * d], q[qb + 4u * d + 1u], q[qb + 4u * d + 2u], q[qb + 4u * d + 3u]) * pc.scale;
    }
    barrier();

    float m = -1.0e30;
    float l = 0.0;
    float acc[DPT];
    [[unroll]] for (uint a = 0; a < DPT; a++) {
        acc[a] = 0.0;
    }
    for (uint b0 = 0; b0 < len; b0 += WG) {
        uint j = b0 + tid;
        bool live = j < len;
        float s = -1.0e30;
        if (live) {
            uint kb = ((base + j) * pc.kv_dim + koff) / 4u;
            vec4 dv = vec4(0.0);
            for (uint d0 = 0; d0 < hd4; d0 += 4u) {
                [[unroll]] for (uint i = 0; i < 4; i++) {
                    if (d0 + i < hd4) {
                        dv += qs4[d0 + i] * kc4[kb + d0 + i];
                    }
                }
            }
            s = dv.x + dv.y + dv.z + dv.w;
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
        for (uint j0 = 0; j0 < nvalid; j0 += 8u) {
            [[unroll]] for (uint i = 0; i < 8; i++) {
                uint jj = min(j0 + i, nvalid - 1u);
                // past nvalid: the last live key again, weighted 0
                float pj = j0 + i < nvalid ? ps[jj] : 0.0;
                lsum += pj;
                uint vb = (base + b0 + jj) * pc.kv_dim + koff;
                [[unroll]] for (uint a = 0; a < DPT; a++) {
                    uint d = tid + a * WG;
                    if (d < hd) {
                        acc[a] += pj * vc[vb + d];
                    }
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

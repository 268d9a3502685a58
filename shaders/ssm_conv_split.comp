#version 450
// ssm_conv.comp's PHASE 0 (the short causal convolution with the conv state, then SiLU)
// fused with what qwen35 does to its output next: the split of the C channels into
// three column ranges [0, e1), [e1, e2), [e2, C) (q, k and v), each written to its own
// buffer, and the L2 normalisation of every head of d channels of the ranges whose bit
// is set in `norm` (q and k), as l2_norm.comp does it. So conv -> take -> l2_norm is
// one dispatch instead of three barrier levels. One work group per (head of d channels,
// token); a lane takes the channels lane, lane + WG, ... of its head, the order
// l2_norm.comp sums them in with the same work-group size, so the results are the
// unfused chain's. The state still moves on in ssm_conv.comp's PHASE 1 (after a
// barrier, beside whatever reads these outputs).
#include "common.glsl"

layout(binding = 0, std430) readonly buffer X { float x[]; };
layout(binding = 1, std430) readonly buffer Wt { float w[]; };  // [C][d_conv]
layout(binding = 2, std430) writeonly buffer Y0 { float y0[]; };  // [T][e1]
layout(binding = 3, std430) writeonly buffer Y1 { float y1[]; };  // [T][e2 - e1]
layout(binding = 4, std430) writeonly buffer Y2 { float y2[]; };  // [T][C - e2]
layout(binding = 5, std430) readonly buffer S { float st[]; };
DECLARE_STEP(6)

layout(push_constant) uniform Push {
    uint c;         // channels
    uint k;         // d_conv
    uint d;         // channels per head (e1, e2 and C are multiples of it)
    uint e1;
    uint e2;
    uint norm;      // bit p: L2-normalise the heads of range p
    float eps;
} pc;

// channels per lane: ceil(d / WG)
layout(constant_id = 1) const uint PER = 2;

#include "reduce.glsl"

uint run_before(uint t, uint seq, uint cap) {
    uint i = 0u;
    while (i < cap && t > i && STEP_SEQ(t - i - 1u) == seq) {
        i++;
    }
    return i;
}

void main() {
    uint c0 = gl_WorkGroupID.x * pc.d;
    uint t = gl_WorkGroupID.y;
    if (c0 >= pc.c || t >= step.n_tokens) {
        return;  // uniform in the work group
    }
    uint seq = STEP_SEQ(t);
    uint km = pc.k - 1u;
    uint i = run_before(t, seq, km);
    bool fresh = STEP_POS(t - i) == 0u;
    uint lane = gl_LocalInvocationID.x;
    float val[PER];
    float ss = 0.0;
    [[unroll]] for (uint p = 0u; p < PER; p++) {
        uint ci = lane + p * WG;
        val[p] = 0.0;
        if (ci < pc.d) {
            uint ch = c0 + ci;
            uint sb = seq * km * pc.c + ch;
            float acc = 0.0;
            for (uint j = 0u; j < pc.k; j++) {
                uint back = km - j;
                float v;
                if (back <= i) {
                    v = x[(t - back) * pc.c + ch];
                } else {
                    v = fresh ? 0.0 : st[sb + (km - (back - i)) * pc.c];
                }
                acc += v * w[ch * pc.k + j];
            }
            float y = acc / (1.0 + exp(-acc));
            val[p] = y;
            ss += y * y;
        }
    }
    uint part = c0 < pc.e1 ? 0u : (c0 < pc.e2 ? 1u : 2u);
    float scale = 1.0;
    if (((pc.norm >> part) & 1u) != 0u) {  // uniform in the work group
        scale = 1.0 / max(sqrt(wg_sum(ss)), pc.eps);
    }
    uint base = part == 0u ? 0u : (part == 1u ? pc.e1 : pc.e2);
    uint width = part == 0u ? pc.e1 : (part == 1u ? pc.e2 - pc.e1 : pc.c - pc.e2);
    [[unroll]] for (uint p = 0u; p < PER; p++) {
        uint ci = lane + p * WG;
        if (ci < pc.d) {
            uint o = t * width + c0 - base + ci;
            float v = ((pc.norm >> part) & 1u) != 0u ? val[p] * scale : val[p];
            if (part == 0u) {
                y0[o] = v;
            } else if (part == 1u) {
                y1[o] = v;
            } else {
                y2[o] = v;
            }
        }
    }
}

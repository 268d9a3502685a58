#version 450
// The short causal convolution of the gated delta-net (ggml_ssm_conv then SiLU) with
// its per-sequence state: each output is the d_conv taps ending at its token over the
// sequence's inputs, where inputs before this step come from the conv state
// [n_seq][d_conv - 1][C] (oldest first), zeros for a sequence that starts at position 0.
// A step's tokens of one sequence are contiguous. PHASE 0 writes the outputs; PHASE 1
// (after a barrier) moves each sequence's state on to its last d_conv - 1 inputs (one
// lane per (sequence, channel), oldest first, so the in-place shift never overwrites
// what it still reads).
#include "common.glsl"

layout(binding = 0, std430) readonly buffer X { float x[]; };
layout(binding = 1, std430) readonly buffer Wt { float w[]; };  // [C][d_conv]
layout(binding = 2, std430) writeonly buffer Y { float y[]; };
layout(binding = 3, std430) buffer S { float st[]; };
DECLARE_STEP(4)

layout(push_constant) uniform Push {
    uint c;         // channels
    uint k;         // d_conv
} pc;

// how many tokens of t's sequence precede it in this step, at most cap
uint run_before(uint t, uint seq, uint cap) {
    uint i = 0u;
    while (i < cap && t > i && STEP_SEQ(t - i - 1u) == seq) {
        i++;
    }
    return i;
}

void main() {
    uint ch = gl_GlobalInvocationID.x;
    uint t = gl_WorkGroupID.y;
    if (ch >= pc.c || t >= step.n_tokens) {
        return;
    }
    uint seq = STEP_SEQ(t);
    uint km = pc.k - 1u;
    uint sb = seq * km * pc.c + ch;  // state[seq][m][ch] = st[sb + m * c]
#if PHASE == 0
    uint i = run_before(t, seq, km);
    bool fresh = STEP_POS(t - i) == 0u;
    float acc = 0.0;
    for (uint j = 0u; j < pc.k; j++) {
        uint d = km - j;  // how far back tap j reads
        float v;
        if (d <= i) {
            v = x[(t - d) * pc.c + ch];
        } else {
            v = fresh ? 0.0 : st[sb + (km - (d - i)) * pc.c];
        }
        acc += v * w[ch * pc.k + j];
    }
    y[t * pc.c + ch] = acc / (1.0 + exp(-acc));
#else
    if (t + 1u < step.n_tokens && STEP_SEQ(t + 1u) == seq) {
        return;  // only a sequence's last token moves its state on
    }
    uint l = run_before(t, seq, km) + 1u;  // the run's length, at most d_conv - 1 + 1
    bool fresh = STEP_POS(t + 1u - l) == 0u;
    for (uint m = 0u; m < km; m++) {
        // the input m of the new state: relative to the run's start, l - km + m
        float v;
        if (m + l >= km) {
            v = x[(t + 1u + m - km) * pc.c + ch];
        } else {
            v = fresh ? 0.0 : st[sb + (l + m) * pc.c];
        }
        st[sb + m * pc.c] = v;
    }
#endif
}

#version 450
// Index of the largest value of each live row (greedy sampling on the device); ties
// go to the smallest index, as numpy's argmax does.
#include "common.glsl"

layout(binding = 0, std430) readonly buffer X { float x[]; };
layout(binding = 1, std430) writeonly buffer R { uint r[]; };
DECLARE_STEP(2)

layout(push_constant) uniform Push {
    uint n;
    uint stride;
    uint count_sel;
} pc;

shared float bv[WG];
shared uint bi[WG];

void main() {
    uint row = FLAT_GROUP;
    if (row >= STEP_COUNT(pc.count_sel)) {
        return;
    }
    uint tid = gl_LocalInvocationID.x;
    float best = -1.0 / 0.0;
    uint idx = 0xFFFFFFFFu;
    for (uint i = tid; i < pc.n; i += WG) {
        float v = x[row * pc.stride + i];
        if (v > best || idx == 0xFFFFFFFFu) {
            best = v;
            idx = i;
        }
    }
    bv[tid] = best;
    bi[tid] = idx;
    barrier();
    for (uint s = WG / 2u; s > 0u; s >>= 1) {
        if (tid < s) {
            float ov = bv[tid + s];
            uint oi = bi[tid + s];
            if (oi != 0xFFFFFFFFu && (ov > bv[tid] || (ov == bv[tid] && oi < bi[tid]) || bi[tid] == 0xFFFFFFFFu)) {
                bv[tid] = ov;
                bi[tid] = oi;
            }
        }
        barrier();
    }
    if (tid == 0u) {
        r[row] = bi[0];
    }
}

#version 450
// y = x times the normalised Walsh-Hadamard matrix (Sylvester order) in every block of
// `block` values of each live row: llama.cpp's rotation of q, k and v around a quantized
// KV cache (model/kvtypes.py rotation_blocks). One work group per (block, row): the
// block in shared memory, log2(block) butterfly stages, then the 1/sqrt(block) scale.
// In place is fine: a work group reads its block whole before it writes. A block of up
// to MAX_BLOCK = 2 WG values: each lane takes values tid and tid + WG of it.
#include "common.glsl"

layout(binding = 0, std430) readonly buffer X { float x[]; };
layout(binding = 1, std430) writeonly buffer Y { float y[]; };
DECLARE_STEP(2)

layout(push_constant) uniform Push {
    uint width;   // values per row
    uint stride;  // floats between rows
    uint block;   // a power of two, at most MAX_BLOCK
    uint count_sel;
} pc;

const uint MAX_BLOCK = 2u * WG;  // 512 with the 256 lanes Ops dispatches
shared float v[MAX_BLOCK];

void main() {
    uint t = gl_WorkGroupID.y;
    if (t >= STEP_COUNT(pc.count_sel)) {
        return;
    }
    uint tid = gl_LocalInvocationID.x;
    uint base = t * pc.stride + gl_WorkGroupID.x * pc.block;
    [[unroll]] for (uint e = 0; e < 2u; e++) {
        uint i = tid + e * WG;
        if (i < pc.block) {
            v[i] = x[base + i];
        }
    }
    barrier();
    for (uint h = 1u; h < pc.block; h *= 2u) {
        float r[2];
        [[unroll]] for (uint e = 0; e < 2u; e++) {
            uint i = tid + e * WG;
            r[e] = 0.0;
            if (i < pc.block) {
                bool lo = (i & h) == 0u;
                float a = v[i];
                float b = v[lo ? i + h : i - h];
                r[e] = lo ? a + b : b - a;
            }
        }
        barrier();
        [[unroll]] for (uint e = 0; e < 2u; e++) {
            uint i = tid + e * WG;
            if (i < pc.block) {
                v[i] = r[e];
            }
        }
        barrier();
    }
    [[unroll]] for (uint e = 0; e < 2u; e++) {
        uint i = tid + e * WG;
        if (i < pc.block) {
            y[base + i] = v[i] * inversesqrt(float(pc.block));
        }
    }
}

#version 450
// y = x times the normalised Walsh-Hadamard matrix (Sylvester order) in every block of
// `block` values of each live row: llama.cpp's rotation of q, k and v around a quantized
// KV cache (model/kvtypes.py rotation_blocks). One work group per (block, row): the
// block in shared memory, log2(block) butterfly stages, then the 1/sqrt(block) scale.
// In place is fine: a work group reads its block whole before it writes.
#include "common.glsl"

layout(binding = 0, std430) readonly buffer X { float x[]; };
layout(binding = 1, std430) writeonly buffer Y { float y[]; };
DECLARE_STEP(2)

layout(push_constant) uniform Push {
    uint width;   // values per row
    uint stride;  // floats between rows
    uint block;   // a power of two, at most WG
    uint count_sel;
} pc;

shared float v[256];

void main() {
    uint t = gl_WorkGroupID.y;
    if (t >= STEP_COUNT(pc.count_sel)) {
        return;
    }
    uint tid = gl_LocalInvocationID.x;
    uint base = t * pc.stride + gl_WorkGroupID.x * pc.block;
    if (tid < pc.block) {
        v[tid] = x[base + tid];
    }
    barrier();
    for (uint h = 1u; h < pc.block; h *= 2u) {
        float a = 0.0;
        float b = 0.0;
        uint j = 0u;
        bool lo = false;
        if (tid < pc.block) {
            lo = (tid & h) == 0u;
            j = lo ? tid + h : tid - h;
            a = v[tid];
            b = v[j];
        }
        barrier();
        if (tid < pc.block) {
            v[tid] = lo ? a + b : b - a;
        }
        barrier();
    }
    if (tid < pc.block) {
        y[base + tid] = v[tid] * inversesqrt(float(pc.block));
    }
}

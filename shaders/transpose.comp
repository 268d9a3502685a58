#version 450
// Tiled transpose copy: out[c][r] = in[r][c] through a 32x32 shared tile (padded to
// 33 columns so the column-wise reads hit distinct banks). WG must be 256 (32 x 8).
#include "common.glsl"

layout(binding = 0, std430) readonly buffer I { float src[]; };
layout(binding = 1, std430) writeonly buffer O { float dst[]; };

layout(push_constant) uniform Push {
    uint rows;
    uint cols;
} pc;

shared float tile[32][33];

void main() {
    uint tx = gl_LocalInvocationID.x & 31u;
    uint ty = gl_LocalInvocationID.x >> 5;
    uint c0 = gl_WorkGroupID.x * 32u;
    uint r0 = gl_WorkGroupID.y * 32u;
    for (uint r = ty; r < 32u; r += 8u) {
        if (r0 + r < pc.rows && c0 + tx < pc.cols) {
            tile[r][tx] = src[(r0 + r) * pc.cols + c0 + tx];
        }
    }
    barrier();
    for (uint c = ty; c < 32u; c += 8u) {
        if (c0 + c < pc.cols && r0 + tx < pc.rows) {
            dst[(c0 + c) * pc.rows + r0 + tx] = tile[tx][c];
        }
    }
}

#version 450
// A strided copy: values [start, start + n) of every `group` consecutive values of each
// live row (a head-interleaved split, or a column range when group is the row).
#include "common.glsl"

layout(binding = 0, std430) readonly buffer X { float x[]; };
layout(binding = 1, std430) writeonly buffer Y { float y[]; };
DECLARE_STEP(2)

layout(push_constant) uniform Push {
    uint group;
    uint start;
    uint n;
    uint n_out;     // values per output row
    uint x_stride;
    uint y_stride;
} pc;

void main() {
    uint i = gl_GlobalInvocationID.x;
    uint t = gl_WorkGroupID.y;
    if (i >= pc.n_out || t >= step.n_tokens) {
        return;
    }
    uint g = i / pc.n;
    y[t * pc.y_stride + i] = x[t * pc.x_stride + g * pc.group + pc.start + (i - g * pc.n)];
}

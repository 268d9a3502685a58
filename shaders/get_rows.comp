#version 450
// Row fetch with dequantization: the embedding lookup (ids = the step's token ids) and
// the gather of the rows whose logits are wanted (ids = the step's output rows, F32).
// A matrix split over several bindings is fetched by one dispatch per piece; each
// dispatch handles the ids inside its [row0, row1).
#include "common.glsl"

layout(binding = 0, std430) readonly buffer W16 { uint16_t w16[]; };
layout(binding = 1, std430) writeonly buffer Y { float y[]; };
DECLARE_STEP(2)

layout(push_constant) uniform Push {
    uint n_in;      // row length
    uint row0;      // first row held by this binding
    uint row1;      // one past the last
    uint y_stride;
    uint id_sel;    // 0: ids are token ids, count = tokens; 1: ids are output rows, count = outputs
} pc;

#include "quant.glsl"

void main() {
    uint t = FLAT_GROUP;
    if (t >= STEP_COUNT(pc.id_sel)) {
        return;
    }
    uint id = pc.id_sel == 0u ? STEP_TOKEN(t) : STEP_OUT(t);
    if (id < pc.row0 || id >= pc.row1) {
        return;
    }
    uint row16 = (id - pc.row0) * row_words(pc.n_in);
    for (uint g = gl_LocalInvocationID.x; g < pc.n_in / 8u; g += WG) {
        float v[8];
        dequant8(row16, g, v);
        [[unroll]] for (uint i = 0; i < 8; i++) {
            y[t * pc.y_stride + 8u * g + i] = v[i];
        }
    }
}

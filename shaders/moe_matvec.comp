#version 450
// Expert matrix-vector products (ggml's mul_mat_id): for each live token c and each of
// its k chosen experts j, y[c][j][row] = W[e][row] . x[c] (or x[c][j]: x_pair != 0),
// where e = the routing's id (c, j), read from the device, so a recorded graph serves
// every routing. W is the 3-D expert tensor [n_expert, n_rows, n_in] (ggml rows).
// One work group per (c, j) (grid z) and NR x RS rows (grid x); a subgroup reduces RS
// rows with subgroupAdd, the generic eight-values-per-lane loop of matvec.comp.
// GLU_IN: the input is silu(x) * u (x the experts' gate outputs, u their up outputs,
// both laid out as x), made as it is loaded: the SwiGLU between the experts' gate/up
// products and their down product, without a dispatch (and a barrier) of its own.
#include "common.glsl"

layout(binding = 0, std430) readonly buffer W16 { uint16_t w16[]; };
layout(binding = 1, std430) readonly buffer X { vec4 x4[]; };
layout(binding = 2, std430) writeonly buffer Y { float y[]; };
DECLARE_STEP(3)
layout(binding = 4, std430) readonly buffer R { float routes[]; };
#ifdef GLU_IN
layout(binding = 5, std430) readonly buffer U { vec4 u4[]; };
#define B_AFTER 6
#else
#define B_AFTER 5
#endif
// COMBINE: a work group per (token, NR x RS rows) takes each of the token's k experts in
// turn and writes y[c][row] = sum_j weight(c, j) W[id(c, j)][row] . x (moe_combine.comp's
// sum, in its order), then as moe_combine.comp's SHEXP (+ xs[c][row] sigmoid(h[c] . g),
// the dot made by the work group as gate_rows.comp makes it with a work group of its
// size) and RESID (res[c][row] + that): the experts' down product and the FFN's end in
// one dispatch.
#if defined(COMBINE) && defined(RESID)
#if B_AFTER == 6
layout(binding = 6, std430) readonly buffer Res { float res[]; };
#define SH_B0 7
#define SH_B1 8
#define SH_B2 9
#else
layout(binding = 5, std430) readonly buffer Res { float res[]; };
#define SH_B0 6
#define SH_B1 7
#define SH_B2 8
#endif
#elif B_AFTER == 6
#define SH_B0 6
#define SH_B1 7
#define SH_B2 8
#else
#define SH_B0 5
#define SH_B1 6
#define SH_B2 7
#endif
#if defined(COMBINE) && defined(SHEXP)
layout(binding = SH_B0, std430) readonly buffer Xs { float xs[]; };
layout(binding = SH_B1, std430) readonly buffer H { float hh[]; };
layout(binding = SH_B2, std430) readonly buffer G { float gw[]; };
#endif

layout(push_constant) uniform Push {
    uint n_in;      // row length
    uint n_rows;    // rows of one expert
    uint x_stride;  // floats between tokens of x (multiple of 4)
    uint x_pair;    // floats between the k inputs of one token (0: one shared input)
    uint y_stride;  // floats between tokens of y
    uint k;         // experts per token
    uint r_stride;  // floats between tokens of the routing (2k)
#if defined(COMBINE) && defined(SHEXP)
    uint h_in;      // values per row of h (and of g)
#endif
} pc;

layout(constant_id = 2) const uint NR = 4;
layout(constant_id = 3) const uint RS = 2;

#include "quant.glsl"
#if defined(COMBINE) && defined(SHEXP)
#include "reduce.glsl"
#endif

void main() {
#ifdef COMBINE
    uint c = gl_WorkGroupID.z;
    uint j0 = 0u;
    uint j1 = pc.k;
#else
    uint pair = gl_WorkGroupID.z;
    uint c = pair / pc.k;
    uint j0 = pair - c * pc.k;
    uint j1 = j0 + 1u;
#endif
    if (c >= step.n_tokens) {
        return;  // uniform in the work group
    }
#if defined(COMBINE) && defined(SHEXP)
    float dsh = 0.0;
    for (uint l = gl_LocalInvocationID.x; l < pc.h_in; l += WG) {
        dsh += hh[c * pc.h_in + l] * gw[l];
    }
    float gate = 1.0 / (1.0 + exp(-wg_sum(dsh)));
#endif
    uint lane = gl_SubgroupInvocationID;
    uint sg = gl_SubgroupSize;
    uint rw = row_words(pc.n_in);
    for (uint r = gl_SubgroupID; r < NR; r += gl_NumSubgroups) {
        uint row0 = (gl_WorkGroupID.x * NR + r) * RS;
        if (row0 >= pc.n_rows) {
            break;
        }
        float tot[RS];
        [[unroll]] for (uint q = 0; q < RS; q++) {
            tot[q] = 0.0;
        }
        for (uint j = j0; j < j1; j++) {
            uint e = uint(routes[c * pc.r_stride + j]);
            uint xb = (c * pc.x_stride + j * pc.x_pair) / 4u;
            uint rows[RS];
            [[unroll]] for (uint q = 0; q < RS; q++) {
                rows[q] = e * pc.n_rows + min(row0 + q, pc.n_rows - 1u);
            }
            float acc[RS];
            [[unroll]] for (uint q = 0; q < RS; q++) {
                acc[q] = 0.0;
            }
            for (uint g = lane; g < pc.n_in / 8u; g += sg) {
#ifdef GLU_IN
                vec4 ga = x4[xb + 2u * g];
                vec4 gc = x4[xb + 2u * g + 1u];
                vec4 xa = ga / (1.0 + exp(-ga)) * u4[xb + 2u * g];
                vec4 xc = gc / (1.0 + exp(-gc)) * u4[xb + 2u * g + 1u];
#else
                vec4 xa = x4[xb + 2u * g];
                vec4 xc = x4[xb + 2u * g + 1u];
#endif
                [[unroll]] for (uint q = 0; q < RS; q++) {
                    float w[8];
                    dequant8(rows[q] * rw, g, w);
                    acc[q] += dot(vec4(w[0], w[1], w[2], w[3]), xa) + dot(vec4(w[4], w[5], w[6], w[7]), xc);
                }
            }
            [[unroll]] for (uint q = 0; q < RS; q++) {
                float s = subgroupAdd(acc[q]);
#ifdef COMBINE
                tot[q] += routes[c * pc.r_stride + pc.k + j] * s;
#else
                if (subgroupElect() && row0 + q < pc.n_rows) {
                    y[c * pc.y_stride + j * pc.n_rows + row0 + q] = s;
                }
#endif
            }
        }
#ifdef COMBINE
        [[unroll]] for (uint q = 0; q < RS; q++) {
            if (subgroupElect() && row0 + q < pc.n_rows) {
                uint o = c * pc.y_stride + row0 + q;
                float s = tot[q];
#ifdef SHEXP
                s = s + xs[o] * gate;
#endif
#ifdef RESID
                s = res[o] + s;
#endif
                y[o] = s;
            }
        }
#endif
    }
}

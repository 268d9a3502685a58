#version 450
// The gated delta rule's chunked prefill form, part 1 (chunks of DC tokens, fla's and
// llama.cpp's): what each chunk needs that does not depend on the state, for every
// chunk at once. A chunk is a run of a sequence's tokens that starts at the run's first
// token or at a position that is a multiple of DC, so both kernels find the chunks from
// the step buffer alone (delta.glsl). One work group of DC lanes (WG == DC) per
// (v head h, chunk), lane r owning the chunk's row r; with G the cumulative log decay
// in the chunk,
//   G[t]    = sum of g over the chunk up to t                            [n_v] per token
//   T[r][s] = ((I - A)^-1 - I)[r][s], A[r][s] = -beta_r (k_r . k_s) e^(G_r - G_s), s < r
//   P[r][s] = (q_r . k_s) / sqrt(d) e^(G_r - G_s), s <= r
// (T and P rows [DC] per (token, v head), zeros past the row's own part; every exp is
// of a non-positive number). delta_chunk.comp then walks the chunks with the state.
#include "common.glsl"
#include "khead.glsl"

#define TD 16

layout(binding = 0, std430) readonly buffer Q { float q[]; };
layout(binding = 1, std430) readonly buffer K { float k[]; };
layout(binding = 2, std430) readonly buffer A { float alpha[]; };
layout(binding = 3, std430) readonly buffer B { float beta[]; };
layout(binding = 4, std430) readonly buffer Dt { float dt[]; };
layout(binding = 5, std430) readonly buffer Ad { float a[]; };
layout(binding = 6, std430) writeonly buffer Tm { float tm[]; };
layout(binding = 7, std430) writeonly buffer Pm { float pm[]; };
layout(binding = 8, std430) writeonly buffer Gc { float gc[]; };
DECLARE_STEP(9)
#include "delta.glsl"

layout(push_constant) uniform Push {
    uint n_k;
    uint n_v;
    uint d;
} pc;

shared float m[DC * DC];
shared float ks[DC * TD];
shared float qs[DC * TD];
shared float gs[DC];
shared float bs[DC];

// the chunk's k (or q) values [i0, i0 + TD) of every row into shared memory
void load_tile(uint t0, uint c, uint kh, uint i0, bool with_q) {
    for (uint e = gl_LocalInvocationID.x; e < DC * TD; e += WG) {
        uint r = e / TD;
        bool live = r < c && i0 + e % TD < pc.d;
        uint col = (t0 + r) * pc.n_k * pc.d + kh * pc.d + i0 + e % TD;
        ks[e] = live ? k[col] : 0.0;
        if (with_q) {
            qs[e] = live ? q[col] : 0.0;
        }
    }
}

void main() {
    uint h = gl_WorkGroupID.x;
    uint t0 = kth_start(gl_WorkGroupID.y, true);
    if (t0 >= step.n_tokens) {
        return;
    }
    uint seq = STEP_SEQ(t0);
    uint c = 1u;
    while (c < DC && t0 + c < step.n_tokens && STEP_SEQ(t0 + c) == seq && STEP_POS(t0 + c) % DC != 0u) {
        c++;
    }
    uint lane = gl_LocalInvocationID.x;
    uint kh = K_HEAD(h);
    if (lane < c) {
        uint t = t0 + lane;
        float x = alpha[t * pc.n_v + h] + dt[h];
        float sp = x > 20.0 ? x : log(1.0 + exp(x));
        gs[lane] = sp * a[h];
        bs[lane] = 1.0 / (1.0 + exp(-beta[t * pc.n_v + h]));
    }
    for (uint e = lane; e < DC * DC; e += WG) {
        m[e] = 0.0;
    }
    barrier();
    if (lane == 0u) {
        float acc = 0.0;
        for (uint r = 0u; r < c; r++) {
            acc += gs[r];
            gs[r] = acc;
        }
    }
    barrier();
    if (lane < c) {
        gc[(t0 + lane) * pc.n_v + h] = gs[lane];
    }
    // k_r . k_s for s < r, TD values of d at a time
    for (uint i0 = 0u; i0 < pc.d; i0 += TD) {
        barrier();
        load_tile(t0, c, kh, i0, false);
        barrier();
        for (uint e = lane; e < DC * DC; e += WG) {
            uint r = e / DC, s = e % DC;
            if (s < r && r < c) {
                float acc = 0.0;
                for (uint i = 0u; i < TD; i++) {
                    acc += ks[r * TD + i] * ks[s * TD + i];
                }
                m[e] += acc;
            }
        }
    }
    barrier();
    for (uint e = lane; e < DC * DC; e += WG) {
        uint r = e / DC, s = e % DC;
        if (s < r && r < c) {
            m[e] = -bs[r] * m[e] * exp(gs[r] - gs[s]);
        }
    }
    barrier();
    // (I - A)^-1 - I row by row: row r += row r . rows above (already final)
    // (WG == DC: lane s owns column s)
    for (uint r = 1u; r < c; r++) {
        float nv = 0.0;
        if (lane < r) {
            nv = m[r * DC + lane];
            for (uint j = lane + 1u; j < r; j++) {
                nv += m[r * DC + j] * m[j * DC + lane];
            }
        }
        barrier();
        if (lane < r) {
            m[r * DC + lane] = nv;
        }
        barrier();
    }
    for (uint e = lane; e < c * DC; e += WG) {
        uint r = e / DC, s = e % DC;
        tm[((t0 + r) * pc.n_v + h) * DC + s] = m[e];
    }
    barrier();
    // P: q_r . k_s for s <= r
    for (uint e = lane; e < DC * DC; e += WG) {
        m[e] = 0.0;
    }
    for (uint i0 = 0u; i0 < pc.d; i0 += TD) {
        barrier();
        load_tile(t0, c, kh, i0, true);
        barrier();
        for (uint e = lane; e < DC * DC; e += WG) {
            uint r = e / DC, s = e % DC;
            if (s <= r && r < c) {
                float acc = 0.0;
                for (uint i = 0u; i < TD; i++) {
                    acc += qs[r * TD + i] * ks[s * TD + i];
                }
                m[e] += acc;
            }
        }
    }
    barrier();
    float scale = inversesqrt(float(pc.d));
    for (uint e = lane; e < c * DC; e += WG) {
        uint r = e / DC, s = e % DC;
        pm[((t0 + r) * pc.n_v + h) * DC + s] = s <= r ? m[e] * scale * exp(gs[r] - gs[s]) : 0.0;
    }
}

#version 450
// The gated delta rule's chunked prefill form, part 2: each sequence's run walks its
// chunks (delta_prep.comp's) in order, carrying the state. One work group per (v head,
// block of J state columns, run: ``delta.glsl``): the columns of the state are
// independent, so a head's d columns are split over d / J work groups. Per chunk, with
// T, P, G from delta_prep and S the state before it (key i, value j):
//   x[r]   = beta_r (v_r - e^G_r k_r S)           the chunk's values, corrected
//   u      = (I + T) x                            the triangular solve, applied
//   o[r]   = e^G_r q_r S / sqrt(d) + sum_{s<=r} P[r][s] u[s]
//   S      = e^G_last S + sum_r e^(G_last - G_r) k_r u[r]^T
// The state keeps delta_net.comp's layout [n_seq][n_v][d (column j)][d (row i)], which
// the decode kernel reads next: nothing is transposed or concatenated. A run starting
// at position 0 starts from zeros.
#include "common.glsl"
#include "khead.glsl"

layout(constant_id = 1) const uint D = 128;  // head size
layout(constant_id = 2) const uint J = 16;   // state columns per work group

layout(binding = 0, std430) readonly buffer Q { float q[]; };
layout(binding = 1, std430) readonly buffer K { float k[]; };
layout(binding = 2, std430) readonly buffer V { float v[]; };
layout(binding = 3, std430) readonly buffer B { float beta[]; };
layout(binding = 4, std430) readonly buffer Tm { float tm[]; };
layout(binding = 5, std430) readonly buffer Pm { float pm[]; };
layout(binding = 6, std430) readonly buffer Gc { float gc[]; };
layout(binding = 7, std430) writeonly buffer O { float o[]; };
layout(binding = 8, std430) buffer S { float st[]; };
DECLARE_STEP(9)
#include "delta.glsl"

layout(push_constant) uniform Push {
    uint n_k;
    uint n_v;
} pc;

shared float s[D * J];   // [i][jj]
shared float xs[DC * J]; // [r][jj]
shared float us[DC * J];
shared float gs[DC];
shared float eg[DC];  // e^G_r
shared float el[DC];  // e^(G_last - G_r)

void main() {
    uint nb = D / J;
    uint h = gl_WorkGroupID.x / nb;
    uint j0 = (gl_WorkGroupID.x % nb) * J;
    uint t0 = kth_start(gl_WorkGroupID.y, false);
    if (t0 >= step.n_tokens) {
        return;
    }
    uint seq = STEP_SEQ(t0);
    uint lane = gl_LocalInvocationID.x;
    uint kh = K_HEAD(h);
    float scale = inversesqrt(float(D));
    uint sb = (seq * pc.n_v + h) * D;
    bool fresh = STEP_POS(t0) == 0u;
    for (uint e = lane; e < D * J; e += WG) {
        uint i = e / J, jj = e % J;
        s[e] = fresh ? 0.0 : st[(sb + j0 + jj) * D + i];
    }
    uint t = t0;
    while (t < step.n_tokens && STEP_SEQ(t) == seq) {
        uint c = 1u;
        while (c < DC && t + c < step.n_tokens && STEP_SEQ(t + c) == seq && STEP_POS(t + c) % DC != 0u) {
            c++;
        }
        barrier();
        if (lane < c) {
            gs[lane] = gc[(t + lane) * pc.n_v + h];
        }
        barrier();
        if (lane < c) {
            eg[lane] = exp(gs[lane]);
            el[lane] = exp(gs[c - 1u] - gs[lane]);
        }
        barrier();
        for (uint e = lane; e < c * J; e += WG) {
            uint r = e / J, jj = e % J;
            uint kr = ((t + r) * pc.n_k + kh) * D;
            float acc = 0.0;
            for (uint i = 0u; i < D; i++) {
                acc += k[kr + i] * s[i * J + jj];
            }
            uint vr = (t + r) * pc.n_v + h;
            float b = 1.0 / (1.0 + exp(-beta[vr]));
            xs[e] = b * (v[vr * D + j0 + jj] - eg[r] * acc);
        }
        barrier();
        for (uint e = lane; e < c * J; e += WG) {
            uint r = e / J, jj = e % J;
            uint tr = ((t + r) * pc.n_v + h) * DC;
            float acc = xs[e];
            for (uint x = 0u; x < r; x++) {
                acc += tm[tr + x] * xs[x * J + jj];
            }
            us[e] = acc;
        }
        barrier();
        for (uint e = lane; e < c * J; e += WG) {
            uint r = e / J, jj = e % J;
            uint qr = ((t + r) * pc.n_k + kh) * D;
            float acc = 0.0;
            for (uint i = 0u; i < D; i++) {
                acc += q[qr + i] * s[i * J + jj];
            }
            acc *= eg[r] * scale;
            uint pr = ((t + r) * pc.n_v + h) * DC;
            for (uint x = 0u; x <= r; x++) {
                acc += pm[pr + x] * us[x * J + jj];
            }
            o[((t + r) * pc.n_v + h) * D + j0 + jj] = acc;
        }
        barrier();
        float dl = eg[c - 1u];
        for (uint e = lane; e < D * J; e += WG) {
            uint i = e / J, jj = e % J;
            float acc = dl * s[e];
            for (uint r = 0u; r < c; r++) {
                acc += k[((t + r) * pc.n_k + kh) * D + i] * el[r] * us[r * J + jj];
            }
            s[e] = acc;
        }
        t += c;
    }
    barrier();
    for (uint e = lane; e < D * J; e += WG) {
        uint i = e / J, jj = e % J;
        st[(sb + j0 + jj) * D + i] = s[e];
    }
}

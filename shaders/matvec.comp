#version 450
// Matrix-vector products for decode: y[c][row] (+)= W[row] . x[c] for up to MAXC
// columns (tokens) at once, so a batch of a few sequences reads each weight once.
// One subgroup per row, NR rows per work group, reduced with subgroupAdd alone (no
// shared memory, no barrier).
//
// Decode is bound by reading the weights, so the common types have their own inner
// loop that reads whole blocks through 32-bit loads (one Q8_0 block, a quarter of a
// Q4_K or half of a Q6_K super-block, per lane and step): 16-bit loads move too few
// bytes per instruction to keep HBM busy. The other types go through dequant8.
#include "common.glsl"

layout(binding = 0, std430) readonly buffer W16 { uint16_t w16[]; };
layout(binding = 0, std430) readonly buffer W32 { uint w32[]; };
layout(binding = 1, std430) readonly buffer X { vec4 x4[]; };
layout(binding = 2, std430) buffer Y { float y[]; };
DECLARE_STEP(3)

layout(push_constant) uniform Push {
    uint n_in;      // row length
    uint n_rows;    // rows of this dispatch
    uint x_stride;  // floats between columns of x (multiple of 4)
    uint y_stride;  // floats between columns of y
    uint y_off;     // first output row (a split matrix writes in pieces)
    uint count_sel; // which step count says how many columns are live
    uint mode;      // 0: y = Wx, 1: y += Wx (fused residual add)
} pc;

layout(constant_id = 1) const uint MAXC = 8;
layout(constant_id = 2) const uint NR = 4;  // rows per work group: one subgroup per row

#include "quant.glsl"

// signed byte j (0..3) of a word, as float
float sb(uint w, uint j) {
    return float(int(w << (24u - 8u * j)) >> 24);
}

#if defined(QTYPE_Q8_0)
const uint UNIT = 32;  // one block per lane and step
void unit_dot(uint row16, uint u, uint ncols, inout float acc[MAXC]) {
    uint bb = 2u * row16 + u * 34u;  // byte offset of the block (even)
    float d = whalf(bb >> 1);
    uint qb = bb + 2u;
    uint q[8];
    uint w0 = qb >> 2;
    if ((qb & 3u) == 0u) {
        [[unroll]] for (uint k = 0; k < 8; k++) {
            q[k] = w32[w0 + k];
        }
    } else {  // the quants start two bytes into a word: stitch neighbours
        uint prev = w32[w0];
        [[unroll]] for (uint k = 0; k < 7; k++) {
            uint nxt = w32[w0 + k + 1u];
            q[k] = (prev >> 16) | (nxt << 16);
            prev = nxt;
        }
        // the last half-word through a 16-bit load: a 32-bit one would read past the block
        q[7] = (prev >> 16) | (uint(w16[(qb >> 1) + 15u]) << 16);
    }
    vec4 qv[8];
    [[unroll]] for (uint k = 0; k < 8; k++) {
        qv[k] = vec4(sb(q[k], 0), sb(q[k], 1), sb(q[k], 2), sb(q[k], 3));
    }
    [[unroll]] for (uint c = 0; c < MAXC; c++) {
        if (c < ncols) {
            uint xi = (c * pc.x_stride + u * 32u) >> 2;
            float s = 0.0;
            [[unroll]] for (uint k = 0; k < 8; k++) {
                s += dot(qv[k], x4[xi + k]);
            }
            acc[c] += d * s;
        }
    }
}
#elif defined(QTYPE_Q4_K)
const uint UNIT = 64;  // a quarter super-block: two 32-value sub-blocks
uint kbyte(uint w0, uint j) {
    return (w32[w0 + (j >> 2)] >> (8u * (j & 3u))) & 0xFFu;
}
void unit_dot(uint row16, uint u, uint ncols, inout float acc[MAXC]) {
    uint w0 = (2u * row16 + (u >> 2) * 144u) >> 2;  // super-blocks are 4-byte aligned
    uint c4 = u & 3u;
    vec2 dm = unpackHalf2x16(w32[w0]);
    uint sw = w0 + 1u;  // scales: bytes 4..15
    float d1, m1, d2, m2;
    {
        uint is = 2u * c4;
        uint sc;
        uint m;
        if (is < 4u) {
            sc = kbyte(sw, is) & 63u;
            m = kbyte(sw, is + 4u) & 63u;
        } else {
            sc = (kbyte(sw, is + 4u) & 0xFu) | ((kbyte(sw, is - 4u) >> 6) << 4);
            m = (kbyte(sw, is + 4u) >> 4) | ((kbyte(sw, is) >> 6) << 4);
        }
        d1 = dm.x * float(sc);
        m1 = dm.y * float(m);
        is += 1u;
        if (is < 4u) {
            sc = kbyte(sw, is) & 63u;
            m = kbyte(sw, is + 4u) & 63u;
        } else {
            sc = (kbyte(sw, is + 4u) & 0xFu) | ((kbyte(sw, is - 4u) >> 6) << 4);
            m = (kbyte(sw, is + 4u) >> 4) | ((kbyte(sw, is) >> 6) << 4);
        }
        d2 = dm.x * float(sc);
        m2 = dm.y * float(m);
    }
    uint q[8];
    [[unroll]] for (uint k = 0; k < 8; k++) {
        q[k] = w32[w0 + 4u + 8u * c4 + k];
    }
    [[unroll]] for (uint c = 0; c < MAXC; c++) {
        if (c < ncols) {
            uint xi = (c * pc.x_stride + u * 64u) >> 2;
            float slo = 0.0, shi = 0.0, xlo = 0.0, xhi = 0.0;
            [[unroll]] for (uint k = 0; k < 8; k++) {
                vec4 lo = vec4(q[k] & 0xFu, (q[k] >> 8) & 0xFu, (q[k] >> 16) & 0xFu, (q[k] >> 24) & 0xFu);
                vec4 hi = vec4((q[k] >> 4) & 0xFu, (q[k] >> 12) & 0xFu, (q[k] >> 20) & 0xFu, q[k] >> 28);
                vec4 a = x4[xi + k];
                vec4 b = x4[xi + 8u + k];
                slo += dot(lo, a);
                shi += dot(hi, b);
                xlo += a.x + a.y + a.z + a.w;
                xhi += b.x + b.y + b.z + b.w;
            }
            acc[c] += d1 * slo - m1 * xlo + d2 * shi - m2 * xhi;
        }
    }
}
#elif defined(QTYPE_Q6_K)
const uint UNIT = 128;  // half a super-block: 64 ql bytes, 32 qh bytes, 8 scales
// a 32-bit word at an even byte offset (Q6_K blocks are 210 bytes: half start mid-word)
uint ld32(uint b) {
    uint w = b >> 2;
    return (b & 3u) == 0u ? w32[w] : (w32[w] >> 16) | (w32[w + 1u] << 16);
}
vec4 q6(uint lo, uint hi, uint nsh, uint hsh) {
    return vec4(
        float(((lo >> nsh) & 0xFu) | (((hi >> hsh) & 3u) << 4)),
        float(((lo >> (8u + nsh)) & 0xFu) | (((hi >> (8u + hsh)) & 3u) << 4)),
        float(((lo >> (16u + nsh)) & 0xFu) | (((hi >> (16u + hsh)) & 3u) << 4)),
        float(((lo >> (24u + nsh)) & 0xFu) | (((hi >> (24u + hsh)) & 3u) << 4))) - 32.0;
}
void unit_dot(uint row16, uint u, uint ncols, inout float acc[MAXC]) {
    uint bb = 2u * row16 + (u >> 1) * 210u;
    uint h = u & 1u;
    float d = whalf((bb >> 1) + 104u);
    uint sw0 = ld32(bb + 192u + 8u * h);
    uint sw1 = ld32(bb + 196u + 8u * h);
    float sc[8];
    [[unroll]] for (uint i = 0; i < 4; i++) {
        sc[i] = sb(sw0, i);
        sc[4 + i] = sb(sw1, i);
    }
    uint qa[8];
    uint qc[8];
    uint qh[8];
    [[unroll]] for (uint k = 0; k < 8; k++) {
        qa[k] = ld32(bb + 64u * h + 4u * k);
        qc[k] = ld32(bb + 64u * h + 32u + 4u * k);
        qh[k] = ld32(bb + 128u + 32u * h + 4u * k);
    }
    [[unroll]] for (uint c = 0; c < MAXC; c++) {
        if (c < ncols) {
            uint xi = (c * pc.x_stride + u * 128u) >> 2;
            float s = 0.0;
            [[unroll]] for (uint half_ = 0; half_ < 2; half_++) {
                float s0 = 0.0, s1 = 0.0, s2 = 0.0, s3 = 0.0;
                [[unroll]] for (uint kk = 0; kk < 4; kk++) {
                    uint k = 4u * half_ + kk;
                    s0 += dot(q6(qa[k], qh[k], 0u, 0u), x4[xi + k]);
                    s1 += dot(q6(qc[k], qh[k], 0u, 2u), x4[xi + 8u + k]);
                    s2 += dot(q6(qa[k], qh[k], 4u, 4u), x4[xi + 16u + k]);
                    s3 += dot(q6(qc[k], qh[k], 4u, 6u), x4[xi + 24u + k]);
                }
                s += sc[half_] * s0 + sc[half_ + 2u] * s1 + sc[half_ + 4u] * s2 + sc[half_ + 6u] * s3;
            }
            acc[c] += d * s;
        }
    }
}
#else
const uint UNIT = 8;  // the generic path: eight values at a time through dequant8
void unit_dot(uint row16, uint g, uint ncols, inout float acc[MAXC]) {
    float w[8];
    dequant8(row16, g, w);
    vec4 wa = vec4(w[0], w[1], w[2], w[3]);
    vec4 wb = vec4(w[4], w[5], w[6], w[7]);
    [[unroll]] for (uint c = 0; c < MAXC; c++) {
        if (c < ncols) {
            uint xi = (c * pc.x_stride) / 4u + 2u * g;
            acc[c] += dot(wa, x4[xi]) + dot(wb, x4[xi + 1]);
        }
    }
}
#endif

void main() {
    uint ncols = min(STEP_COUNT(pc.count_sel), MAXC);
    uint units = pc.n_in / UNIT;
    // The loop also covers a driver that runs fewer, wider subgroups than planned.
    for (uint r = gl_SubgroupID; r < NR; r += gl_NumSubgroups) {
        uint row = FLAT_GROUP * NR + r;
        if (row >= pc.n_rows) {
            break;
        }
        uint row16 = row * row_words(pc.n_in);
        float acc[MAXC];
        [[unroll]] for (uint c = 0; c < MAXC; c++) {
            acc[c] = 0.0;
        }
        for (uint u = gl_SubgroupInvocationID; u < units; u += gl_SubgroupSize) {
            unit_dot(row16, u, ncols, acc);
        }
        [[unroll]] for (uint c = 0; c < MAXC; c++) {
            if (c < ncols) {
                float s = subgroupAdd(acc[c]);
                if (subgroupElect()) {
                    uint o = c * pc.y_stride + pc.y_off + row;
                    y[o] = pc.mode == 1u ? y[o] + s : s;
                }
            }
        }
    }
}

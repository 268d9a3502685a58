#version 450
#if defined(X_Q8) && defined(INT_DOT)
// OpSDot on 4x8-bit packed words (SPV_KHR_integer_dot_product) through spirv
// intrinsics: the glslang of the cmeel wheel (13.1) predates GL_EXT_integer_dot_product
#extension GL_EXT_spirv_intrinsics : require
#endif
// Matrix-vector products for decode: y[c][row] (+)= W[row] . x[c] for up to MAXC
// columns (tokens) at once, so a batch of a few sequences reads each weight once.
// One subgroup per RS rows, NR subgroups per work group, reduced with subgroupAdd
// alone (no shared memory, no barrier).
//
// Decode is bound by how fast the weights stream in, so the common quantized types
// have their own inner loops that give each lane a larger piece of a block through
// few, wide loads (a lane's "task"), with adjacent lanes on adjacent pieces so a
// warp's loads cover one contiguous stretch of the row:
//   Q4_K  8 lanes per 144-byte super-block; a lane reads 32 nibbles as one 128-bit
//         load and the block header (d, dmin, 12 scale bytes) as another
//   Q5_K  Q4_K's loop over 176-byte blocks (11 uvec4), plus one 128-bit load of the
//         16 qh bytes that hold the fifth bits of the lane's 32 values
//   Q6_K  16 lanes per 210-byte super-block; a lane reads 4 bytes each of ql (twice)
//         and qh, 16 values (the block is only 2-byte aligned: 16-bit loads, paired)
//   Q3_K  Q6_K's task shape over 110-byte blocks (also only 2-byte aligned): a lane
//         reads 4 bytes of qs (four 2-bit planes) and 4 of hmask, 16 values, and
//         its four 6-bit scales from three paired loads of the scale bytes
// Other types use the generic loop: eight values per lane through quant.glsl's
// dequant8, adjacent lanes on adjacent groups; GENERIC_LOOP puts the four types above
// on it too (TRIO_LLM_MATVEC_GENERIC=1, for an A/B of their loops on the H200: the
// Q3_K and Q5_K loops are not yet measured there). (For Q8_0 a path giving each lane 16
// values of a block measured slower on the H200: 1.03 against 0.76 ms of matvec per
// llama-1b token; a block per lane with 32-bit loads was slower still.) With the K-quants, a sub-block's scale and min multiply the
// sums of q*x and of x once instead of every value.
//
// ROPE_OUT: the epilogue of llama's q/k/v projections. Llama's rope rotates adjacent
// pairs of rows (2i, 2i+1), which are two rows of one subgroup (RS even), so the
// rotation and the KV-cache write (rope.comp's work) happen here, and the graph loses
// a dispatch stage per layer without touching the loads of the inner loops.
//
// The cache write stores the cache type KV_TYPE (kv.glsl) at row pos % n_ctx of the
// token's sequence. A float type is stored by the elected lane with the pair; a
// quantized type needs a block of 32 rows at once, so its variant runs 32 / RS
// subgroups per work group (the host sets NR so), parks the rotated values in shared
// memory and lets one lane per token encode the work group's block after a barrier.
//
// GATE_UP: the FFN's gate and up projections in one dispatch, with SwiGLU in the
// epilogue: a subgroup's two rows (RS = 2) are gate row i and up row i, both in the one
// bound weight view (row offsets row_a and row_b), each x value loaded serving both as
// in the plain kernel, and it writes silu(gate_i) * up_i: the SwiGLU dispatch stage
// goes away without adding loads.
//
// NORM_IN: the input is RMSNorm(x) * g (the norm before the q/k/v projections, the FFN
// and the head), computed here instead of by rms_norm.comp: each subgroup already
// loads every value of x[c] for its dot products, so it adds up x^2 on the way, scales
// the values it loads by the norm weight g (one more binding), and multiplies each sum
// by 1 / sqrt(mean(x^2) + eps) (rms_norm.comp's, llama.cpp's) in the epilogue. It
// combines with every weight type and the ROPE_OUT and GATE_UP forms, one scale per
// column; the rms_norm dispatch and its barrier go away (decode is a chain of them).
//
// X_Q8: x arrives as q8_1 blocks (quantize_q8.comp: 32 int8 values per block with
// its scale d, one quantize per step and input instead of f32 x), for Q8_0, Q4_K,
// Q5_K and Q6_K weights, in the plain, GATE_UP and ROPE_OUT forms (not NORM_IN: the
// norm would have to come before the quantization). Each lane keeps its loop's task
// and weight loads, but multiplies the packed weight bytes with the packed int8
// activations four at a time (dotPacked4x8EXT where the device has integer dot
// products, INT_DOT; plain int math otherwise) and scales each int sum by the weight
// block's and the activation block's scales: a column costs a quarter of the x bytes
// and a quarter of the multiply instructions of the f32 form. The K-quants' min (and
// Q6_K's -32) terms need the sum of the activations over a lane's 16 (4) values, a
// dot with 0x01010101 as llama.cpp's vec_dot_q4_K_q8_1 does (the block sum s covers
// 32, more than a lane's share). x_stride counts values between columns, as for f32.
#include "common.glsl"

layout(binding = 0, std430) readonly buffer W16 { uint16_t w16[]; };
layout(binding = 0, std430) readonly buffer W128 { uvec4 w128[]; };
#if defined(X_Q8)
#if defined(NORM_IN)
#error "X_Q8 reads quantized activations: the norm cannot be applied to them"
#endif
#if !defined(QTYPE_Q8_0) && !defined(QTYPE_Q4_K) && !defined(QTYPE_Q5_K) && !defined(QTYPE_Q6_K)
#error "X_Q8 has loops for Q8_0, Q4_K, Q5_K and Q6_K only"
#endif
#if defined(GENERIC_LOOP)
#error "X_Q8 has no generic loop"
#endif
layout(binding = 1, std430) readonly buffer XQ { uvec4 xq4[]; };  // int8 values, 16 per uvec4
layout(binding = 1, std430) readonly buffer XQ1 { uint xq1[]; };
#if defined(ROPE_OUT)
layout(binding = 5, std430) readonly buffer XD { vec2 xd[]; };   // (d, s) per block of 32
#else
layout(binding = 4, std430) readonly buffer XD { vec2 xd[]; };
#endif
#define WQ uint
#define WBYTES(w) (w)
#else
layout(binding = 1, std430) readonly buffer X { vec4 x4[]; };
#define WQ vec4
#define WBYTES(w) bytes4(w)
#endif
layout(binding = 2, std430) buffer Y { float y[]; };
DECLARE_STEP(3)
#if defined(ROPE_OUT)
layout(binding = 2, std430) buffer Y16 { uint16_t kvs16[]; };
#define kvs32 y
layout(binding = 4, std430) readonly buffer F { float factors[]; };
#ifndef KV_TYPE
#define KV_TYPE 0
#endif
#endif
#if defined(NORM_IN)
#if defined(ROPE_OUT)
layout(binding = 5, std430) readonly buffer G { vec4 g4[]; };
#else
layout(binding = 4, std430) readonly buffer G { vec4 g4[]; };
#endif
// x^2 of the raw value v added to column c's sum, then v scaled by the norm weight
#define NORM_X(c, v, gv) ss[c] += dot(v, v); v *= gv
#define NORM_S(c) * inv[c]
#else
#define NORM_X(c, v, gv)
#define NORM_S(c)
#endif

layout(push_constant) uniform Push {
    uint n_in;      // row length
    uint n_rows;    // rows of this dispatch
    uint x_stride;  // floats between columns of x (multiple of 4)
    uint y_stride;  // floats between columns of y
    uint y_off;     // first output row (a split matrix writes in pieces)
    uint count_sel; // which step count says how many columns are live
    uint mode;      // 0: y = Wx, 1: y += Wx (fused residual add)
#if defined(ROPE_OUT)
    uint head_dim;
    uint rope;      // 1: rotate pairs (2i, 2i+1) at the token's position; 0: store only
    uint to_cache;  // 1: y is the KV cache [seq * n_ctx + pos, kv_dim]
    uint n_ctx;
    uint kv_dim;
    float log2_theta;  // as in rope.comp
#endif
#if defined(GATE_UP)
    uint row_a;     // first gate row in the bound view
    uint row_b;     // first up row in it
#endif
#if defined(NORM_IN)
    float eps;      // the norm's epsilon
#endif
} pc;

// FIXED_MAXC, FIXED_RS (with FULL_UNROLL, shaders.py): the column count and rows per
// subgroup as constants of the SPIR-V instead of specialization constants, so that the
// compile unrolls every loop over them and the accumulators are values, not an array the
// driver may keep in local memory (on the H200 the 8-column F32, Q4_K and Q6_K int8
// forms reported 64 bytes a thread of it, held for the device's life: issue 12's cold
// memory). TRIO_LLM_MATVEC_UNROLL picks the column counts (Ops.matvec_unroll)
#if defined(FIXED_MAXC)
const uint MAXC = FIXED_MAXC;
#else
layout(constant_id = 1) const uint MAXC = 8;
#endif
layout(constant_id = 2) const uint NR = 4;  // subgroups per work group
// rows per subgroup: each x value a lane loads serves RS rows (the loads of x from
// L1 otherwise outnumber the weight bytes four to one)
#if defined(FIXED_RS)
const uint RS = FIXED_RS;
#else
layout(constant_id = 3) const uint RS = 2;
#endif
// the step's first column this dispatch serves (Ops.matvec_split8: an 8-column bucket as
// two 4-column dispatches, the second with COL0 = 4 and x, y and the int8 scales bound
// 4 columns on): its live count and the positions and sequences it reads start there
layout(constant_id = 4) const uint COL0 = 0;

#include "quant.glsl"
#if defined(ROPE_OUT)
#define KV_STORE 1
#include "kv.glsl"
const uint KT = KV_TYPE;
#if KV_TYPE >= 3
// a block of 32 rows per work group (NR * RS == 32), per column
shared float blk[MAXC * 32u];
#endif
#endif

// the four bytes of a word as exact floats
vec4 bytes4(uint w) {
    return vec4(uvec4(w, w >> 8, w >> 16, w >> 24) & 0xFFu);
}

uint pair16(uint i) {
    return uint(w16[i]) | (uint(w16[i + 1u]) << 16);
}

#if defined(X_Q8)
#if defined(INT_DOT)
// capabilities DotProduct (6019) and DotProductInput4x8BitPacked (6018), OpSDot (4450)
spirv_instruction(extensions = ["SPV_KHR_integer_dot_product"], capabilities = [6019, 6018], id = 4450)
int sdot4x8(int a, int b, spirv_literal int fmt);
#endif
// the dot product of two words of four signed bytes each
int idot4(uint a, uint b) {
#if defined(INT_DOT)
    return sdot4x8(int(a), int(b), 0);  // 0: PackedVectorFormat4x8Bit
#else
    ivec4 va = ivec4(int(a) << 24, int(a) << 16, int(a) << 8, int(a)) >> 24;
    ivec4 vb = ivec4(int(b) << 24, int(b) << 16, int(b) << 8, int(b)) >> 24;
    return va.x * vb.x + va.y * vb.y + va.z * vb.z + va.w * vb.w;
#endif
}
const uint ONES = 0x01010101u;
#endif

void main() {
    uint live = STEP_COUNT(pc.count_sel);
    uint ncols = live > COL0 ? min(live - COL0, MAXC) : 0u;
    uint lane = gl_SubgroupInvocationID;
    uint sg = gl_SubgroupSize;
    // The loop also covers a driver that runs fewer, wider subgroups than planned.
    for (uint r = gl_SubgroupID; r < NR; r += gl_NumSubgroups) {
#if defined(GATE_UP)
        uint row0 = FLAT_GROUP * NR + r;  // the output row
        if (row0 >= pc.n_rows) {
            break;
        }
        uint rows[RS];
        rows[0] = pc.row_a + row0;
        rows[1] = pc.row_b + row0;
#else
        uint row0 = (FLAT_GROUP * NR + r) * RS;
        if (row0 >= pc.n_rows) {
            break;
        }
        // rows past the end read the last row again; their sums are dropped
        uint rows[RS];
        [[unroll]] for (uint k = 0; k < RS; k++) {
            rows[k] = min(row0 + k, pc.n_rows - 1u);
        }
#endif
        float acc[MAXC * RS];
        [[unroll]] for (uint c = 0; c < MAXC * RS; c++) {
            acc[c] = 0.0;
        }
#if defined(NORM_IN)
        float ss[MAXC];  // this lane's part of sum(x^2), per column
        [[unroll]] for (uint c = 0; c < MAXC; c++) {
            ss[c] = 0.0;
        }
#endif
#if !defined(GENERIC_LOOP) && (defined(QTYPE_Q4_K) || defined(QTYPE_Q5_K))
#if defined(QTYPE_Q4_K)
        const uint STRIDE128 = 9u;  // 144-byte blocks are 9 uvec4
        const uint QS128 = 1u;      // the nibbles follow the 16-byte header
#else
        const uint STRIDE128 = 11u; // 176 bytes: header, qh[32], qs[128]
        const uint QS128 = 3u;
#endif
        uint nb = pc.n_in / 256u;
        for (uint t = lane; t < nb * 8u; t += sg) {
            uint blk = t >> 3;
            uint j = t & 7u;
            uint cidx = j >> 1;     // 64-value chunk
            uint half_ = j & 1u;    // which 16 bytes of the chunk's 32
            WQ lo[RS][4];
            WQ hi[RS][4];
            vec4 dsm[RS];  // d*scale and dmin*min of the low and the high sub-block
            [[unroll]] for (uint k = 0; k < RS; k++) {
                uint b128 = (rows[k] * nb + blk) * STRIDE128;
                uvec4 hdr = w128[b128];                   // d|dmin, scales[0..12)
                uvec4 qs = w128[b128 + QS128 + 2u * cidx + half_];
#if defined(QTYPE_Q5_K)
                // the fifth bits: qh[l] bit b belongs to value 32b + l, so this lane's
                // 16 positions are qh[16 half_ ..], bits 2 cidx (low) and 2 cidx + 1
                uvec4 qh = w128[b128 + 1u + half_];
#endif
                vec2 dm = unpackHalf2x16(hdr.x);
                // scales and mins of sub-blocks 2*cidx (low nibbles) and 2*cidx+1 (high
                // nibbles): 6-bit fields, the last four split between bytes
                uint sh = 16u * (cidx & 1u);
                uint ya = hdr.y >> sh;
                uint za = hdr.z >> sh;
                uint wa = hdr.w >> sh;
                vec4 sm;
                if (cidx < 2u) {
                    sm = vec4(uvec4(ya, za, ya >> 8, za >> 8) & 63u);
                } else {
                    sm = vec4(uvec4(
                        (wa & 0xFu) | (((ya >> 6) & 3u) << 4),
                        ((wa >> 4) & 0xFu) | (((za >> 6) & 3u) << 4),
                        ((wa >> 8) & 0xFu) | (((ya >> 14) & 3u) << 4),
                        ((wa >> 12) & 0xFu) | (((za >> 14) & 3u) << 4)));
                }
                dsm[k] = sm * dm.xyxy;
                [[unroll]] for (uint i = 0; i < 4; i++) {
#if defined(QTYPE_Q5_K)
                    lo[k][i] = WBYTES((qs[i] & 0x0F0F0F0Fu) | (((qh[i] >> (2u * cidx)) & 0x01010101u) << 4));
                    hi[k][i] = WBYTES(((qs[i] >> 4) & 0x0F0F0F0Fu) | (((qh[i] >> (2u * cidx + 1u)) & 0x01010101u) << 4));
#else
                    lo[k][i] = WBYTES(qs[i] & 0x0F0F0F0Fu);
                    hi[k][i] = WBYTES((qs[i] >> 4) & 0x0F0F0F0Fu);
#endif
                }
            }
            // value index of the first low nibble: 256 blk + 64 cidx + 16 half_
            uint x0 = (blk * 256u + cidx * 64u + half_ * 16u) / 4u;
#if defined(NORM_IN)
            vec4 ga[4];
            vec4 gh[4];
            [[unroll]] for (uint i = 0; i < 4; i++) {
                ga[i] = g4[x0 + i];
                gh[i] = g4[x0 + 8u + i];
            }
#endif
#if defined(X_Q8)
            [[unroll]] for (uint c = 0; c < MAXC; c++) {
                if (c < ncols) {
                    uint v0 = c * pc.x_stride + 4u * x0;  // the first value's index in xq
                    uvec4 qa = xq4[v0 / 16u];
                    uvec4 qh8 = xq4[v0 / 16u + 2u];  // 32 values further: the next block
                    float da = xd[v0 / 32u].x;
                    float dh = xd[v0 / 32u + 1u].x;
                    int sa = 0, sh8 = 0;
                    [[unroll]] for (uint i = 0; i < 4; i++) {
                        sa += idot4(qa[i], ONES);
                        sh8 += idot4(qh8[i], ONES);
                    }
                    float sx0 = da * float(sa), sx1 = dh * float(sh8);
                    [[unroll]] for (uint k = 0; k < RS; k++) {
                        int qx0 = 0, qx1 = 0;
                        [[unroll]] for (uint i = 0; i < 4; i++) {
                            qx0 += idot4(lo[k][i], qa[i]);
                            qx1 += idot4(hi[k][i], qh8[i]);
                        }
                        acc[c * RS + k] += dsm[k].x * (da * float(qx0)) - dsm[k].y * sx0
                            + dsm[k].z * (dh * float(qx1)) - dsm[k].w * sx1;
                    }
                }
            }
#else
            [[unroll]] for (uint c = 0; c < MAXC; c++) {
                if (c < ncols) {
                    uint xb = (c * pc.x_stride) / 4u + x0;
                    vec4 xa[4];
                    vec4 xh[4];
                    float sx0 = 0.0, sx1 = 0.0;
                    [[unroll]] for (uint i = 0; i < 4; i++) {
                        xa[i] = x4[xb + i];
                        xh[i] = x4[xb + 8u + i];  // 32 values further
                        NORM_X(c, xa[i], ga[i]);
                        NORM_X(c, xh[i], gh[i]);
                        sx0 += dot(xa[i], vec4(1.0));
                        sx1 += dot(xh[i], vec4(1.0));
                    }
                    [[unroll]] for (uint k = 0; k < RS; k++) {
                        float qx0 = 0.0, qx1 = 0.0;
                        [[unroll]] for (uint i = 0; i < 4; i++) {
                            qx0 += dot(lo[k][i], xa[i]);
                            qx1 += dot(hi[k][i], xh[i]);
                        }
                        acc[c * RS + k] += dsm[k].x * qx0 - dsm[k].y * sx0 + dsm[k].z * qx1 - dsm[k].w * sx1;
                    }
                }
            }
#endif
        }
#elif !defined(GENERIC_LOOP) && defined(QTYPE_Q6_K)
        uint nb = pc.n_in / 256u;
        for (uint t = lane; t < nb * 16u; t += sg) {
            uint blk = t >> 4;
            uint j = t & 15u;
            uint h = j >> 3;           // which 128-value half
            uint l0 = (j & 7u) * 4u;   // 4 positions l0..l0+3 of the half's 32
            uint ssh = (l0 >> 4) * 8u;  // scale byte (l0 / 16) within each 16-bit word
            WQ q[RS][4];
            vec4 scs[RS];
            [[unroll]] for (uint k = 0; k < RS; k++) {
                uint b = (rows[k] * nb + blk) * BLOCK16;
                uint qla = pair16(b + 32u * h + l0 / 2u);        // ql[64h + l0 ..]
                uint qlb = pair16(b + 32u * h + 16u + l0 / 2u);  // ql[64h + 32 + l0 ..]
                uint qh = pair16(b + 64u + 16u * h + l0 / 2u);   // qh[32h + l0 ..]
                uint sb = b + 96u + 4u * h;  // scales[8h ..]
                ivec4 sc = ivec4(uvec4(w16[sb], w16[sb + 1u], w16[sb + 2u], w16[sb + 3u]) << (24u - ssh)) >> 24;
                scs[k] = whalf(b + 104u) * vec4(sc);
#if defined(X_Q8)
                // the unsigned 6-bit values; the -32 comes in as -32 * sum(x) below
#define Q6OFF
#else
#define Q6OFF - 32.0
#endif
                q[k][0] = WBYTES((qla & 0x0F0F0F0Fu) | ((qh & 0x03030303u) << 4)) Q6OFF;
                q[k][1] = WBYTES((qlb & 0x0F0F0F0Fu) | (((qh >> 2) & 0x03030303u) << 4)) Q6OFF;
                q[k][2] = WBYTES(((qla >> 4) & 0x0F0F0F0Fu) | (((qh >> 4) & 0x03030303u) << 4)) Q6OFF;
                q[k][3] = WBYTES(((qlb >> 4) & 0x0F0F0F0Fu) | (((qh >> 6) & 0x03030303u) << 4)) Q6OFF;
            }
            uint x0 = (blk * 256u + h * 128u + l0) / 4u;
#if defined(X_Q8)
            [[unroll]] for (uint c = 0; c < MAXC; c++) {
                if (c < ncols) {
                    uint v0 = c * pc.x_stride + 4u * x0;  // values v0 + 32 i .. + 3: one block each
                    uint xw[4];
                    vec4 dx;
                    ivec4 sx;
                    [[unroll]] for (uint i = 0; i < 4; i++) {
                        xw[i] = xq1[v0 / 4u + 8u * i];
                        dx[i] = xd[v0 / 32u + i].x;
                        sx[i] = 32 * idot4(xw[i], ONES);
                    }
                    [[unroll]] for (uint k = 0; k < RS; k++) {
                        ivec4 qx = ivec4(idot4(q[k][0], xw[0]), idot4(q[k][1], xw[1]),
                                         idot4(q[k][2], xw[2]), idot4(q[k][3], xw[3])) - sx;
                        acc[c * RS + k] += dot(scs[k], dx * vec4(qx));
                    }
                }
            }
#else
#if defined(NORM_IN)
            vec4 gv[4] = vec4[4](g4[x0], g4[x0 + 8u], g4[x0 + 16u], g4[x0 + 24u]);
#endif
            [[unroll]] for (uint c = 0; c < MAXC; c++) {
                if (c < ncols) {
                    uint xb = (c * pc.x_stride) / 4u + x0;
                    vec4 xv[4] = vec4[4](x4[xb], x4[xb + 8u], x4[xb + 16u], x4[xb + 24u]);
                    [[unroll]] for (uint i = 0; i < 4; i++) {
                        NORM_X(c, xv[i], gv[i]);
                    }
                    [[unroll]] for (uint k = 0; k < RS; k++) {
                        acc[c * RS + k] += dot(scs[k], vec4(dot(q[k][0], xv[0]), dot(q[k][1], xv[1]),
                                                            dot(q[k][2], xv[2]), dot(q[k][3], xv[3])));
                    }
                }
            }
#endif
        }
#elif !defined(GENERIC_LOOP) && defined(QTYPE_Q3_K)
        uint nb = pc.n_in / 256u;
        for (uint t = lane; t < nb * 16u; t += sg) {
            uint blk = t >> 4;
            uint j = t & 15u;
            uint h = j >> 3;           // which 128-value half
            uint l0 = (j & 7u) * 4u;   // 4 positions l0..l0+3 of the half's 32
            uint lb = l0 >> 4;         // which 16 of them: the sub-block within a plane
            vec4 q[RS][4];
            vec4 scs[RS];
            [[unroll]] for (uint k = 0; k < RS; k++) {
                uint b = (rows[k] * nb + blk) * BLOCK16;
                uint qs = pair16(b + 16u + 16u * h + l0 / 2u);  // qs[32h + l0 ..]: plane s at bits 2s
                uint hm = pair16(b + l0 / 2u);                  // hmask[l0 ..]: plane s at bit 4h + s
                // the four sub-blocks 8h + 2s + lb (s = 0..3): low nibbles in bytes
                // 2s + lb (nibble h) of scales[0..8), top bits in byte (2s + lb) & 3
                // of scales[8..12) at bits 2 (2h + s / 2)
                uint lw = pair16(b + 48u) >> (8u * lb);       // scales[lb], scales[lb + 2] in bytes 0, 2
                uint lw2 = pair16(b + 50u) >> (8u * lb);      // scales[4 + lb], scales[6 + lb]
                uint tw = pair16(b + 52u) >> (8u * lb);       // scales[8 + lb], scales[10 + lb]
                uvec4 low = (uvec4(lw, lw >> 16, lw2, lw2 >> 16) >> (4u * h)) & 0xFu;
                uvec4 top = (uvec4(tw, tw >> 16, tw, tw >> 16) >> uvec4(4u * h, 4u * h, 4u * h + 2u, 4u * h + 2u)) & 3u;
                scs[k] = whalf(b + 54u) * (vec4(low | (top << 4)) - 32.0);
                [[unroll]] for (uint s = 0; s < 4; s++) {
                    q[k][s] = bytes4((qs >> (2u * s)) & 0x03030303u) - 4.0
                        + 4.0 * bytes4((hm >> (4u * h + s)) & 0x01010101u);
                }
            }
            uint x0 = (blk * 256u + h * 128u + l0) / 4u;
#if defined(NORM_IN)
            vec4 gv[4] = vec4[4](g4[x0], g4[x0 + 8u], g4[x0 + 16u], g4[x0 + 24u]);
#endif
            [[unroll]] for (uint c = 0; c < MAXC; c++) {
                if (c < ncols) {
                    uint xb = (c * pc.x_stride) / 4u + x0;
                    vec4 xv[4] = vec4[4](x4[xb], x4[xb + 8u], x4[xb + 16u], x4[xb + 24u]);
                    [[unroll]] for (uint i = 0; i < 4; i++) {
                        NORM_X(c, xv[i], gv[i]);
                    }
                    [[unroll]] for (uint k = 0; k < RS; k++) {
                        acc[c * RS + k] += dot(scs[k], vec4(dot(q[k][0], xv[0]), dot(q[k][1], xv[1]),
                                                            dot(q[k][2], xv[2]), dot(q[k][3], xv[3])));
                    }
                }
            }
        }
#elif defined(X_Q8) && defined(QTYPE_Q8_0)
        // the generic loop's tasks (eight values of a 34-byte block per lane), with the
        // weight bytes kept packed: two words from four 16-bit loads
        uint nb = pc.n_in / 32u;
        for (uint g = lane; g < nb * 4u; g += sg) {
            uint w0[RS];
            uint w1[RS];
            float dw[RS];
            [[unroll]] for (uint k = 0; k < RS; k++) {
                uint b = (rows[k] * nb + (g >> 2)) * BLOCK16;
                uint o = b + 1u + 4u * (g & 3u);
                w0[k] = pair16(o);
                w1[k] = pair16(o + 2u);
                dw[k] = whalf(b);
            }
            [[unroll]] for (uint c = 0; c < MAXC; c++) {
                if (c < ncols) {
                    uint v0 = c * pc.x_stride + 8u * g;
                    uint xa = xq1[v0 / 4u];
                    uint xb = xq1[v0 / 4u + 1u];
                    float dx = xd[v0 / 32u].x;
                    [[unroll]] for (uint k = 0; k < RS; k++) {
                        acc[c * RS + k] += dw[k] * dx * float(idot4(w0[k], xa) + idot4(w1[k], xb));
                    }
                }
            }
        }
#else
        uint groups = pc.n_in / 8u;
        uint rw = row_words(pc.n_in);
        for (uint g = lane; g < groups; g += sg) {
            vec4 wa[RS];
            vec4 wb[RS];
            [[unroll]] for (uint k = 0; k < RS; k++) {
                float w[8];
                dequant8(rows[k] * rw, g, w);
                wa[k] = vec4(w[0], w[1], w[2], w[3]);
                wb[k] = vec4(w[4], w[5], w[6], w[7]);
            }
#if defined(NORM_IN)
            vec4 gn0 = g4[2u * g];
            vec4 gn1 = g4[2u * g + 1u];
#endif
            [[unroll]] for (uint c = 0; c < MAXC; c++) {
                if (c < ncols) {
                    uint xi = (c * pc.x_stride) / 4u + 2u * g;
                    vec4 xa = x4[xi];
                    vec4 xb = x4[xi + 1u];
                    NORM_X(c, xa, gn0);
                    NORM_X(c, xb, gn1);
                    [[unroll]] for (uint k = 0; k < RS; k++) {
                        acc[c * RS + k] += dot(wa[k], xa) + dot(wb[k], xb);
                    }
                }
            }
        }
#endif
#if defined(NORM_IN)
        float inv[MAXC];  // 1 / rms of each column, as rms_norm.comp computes it
        [[unroll]] for (uint c = 0; c < MAXC; c++) {
            inv[c] = 0.0;
            if (c < ncols) {
                inv[c] = inversesqrt(subgroupAdd(ss[c]) / float(pc.n_in) + pc.eps);
            }
        }
#endif
#if defined(GATE_UP)
        [[unroll]] for (uint c = 0; c < MAXC; c++) {
            if (c < ncols) {
                float g = subgroupAdd(acc[c * RS]) NORM_S(c);
                float u = subgroupAdd(acc[c * RS + 1u]) NORM_S(c);
                if (subgroupElect()) {
                    y[c * pc.y_stride + row0] = g / (1.0 + exp(-g)) * u;
                }
            }
        }
#elif defined(ROPE_OUT)
        [[unroll]] for (uint c = 0; c < MAXC; c++) {
            if (c < ncols) {
                [[unroll]] for (uint k = 0; k < RS; k += 2u) {
                    float a = subgroupAdd(acc[c * RS + k]) NORM_S(c);
                    float b = subgroupAdd(acc[c * RS + k + 1u]) NORM_S(c);
                    uint row = pc.y_off + row0 + k;  // even: the pair is (row, row + 1)
                    uint pos = STEP_POS(COL0 + c);
                    if (pc.rope == 1u) {  // the same arithmetic as rope.comp
                        uint i = (row % pc.head_dim) / 2u;
                        float freq = exp2(-2.0 * float(i) / float(pc.head_dim) * pc.log2_theta) / factors[i];
                        float ang = float(pos) * freq;
                        float cs = cos(ang);
                        float sn = sin(ang);
                        float a2 = a * cs - b * sn;
                        b = a * sn + b * cs;
                        a = a2;
                    }
                    if (subgroupElect() && row0 + k < pc.n_rows) {
                        uint crow = STEP_SEQ(COL0 + c) * pc.n_ctx + pos % pc.n_ctx;
                        if (pc.to_cache == 0u) {
                            y[c * pc.y_stride + row] = a;
                            y[c * pc.y_stride + row + 1u] = b;
                        } else if (kv_quantized(KT)) {
#if KV_TYPE >= 3
                            uint at = c * 32u + (row & 31u);
                            blk[at] = a;
                            blk[at + 1u] = b;
#endif
                        } else {
                            uint rw = crow * kv_row_words(KT, pc.kv_dim);
                            kv_store1(KT, rw, row, a);
                            kv_store1(KT, rw, row + 1u, b);
                        }
                    }
                }
            }
        }
#else
        [[unroll]] for (uint c = 0; c < MAXC; c++) {
            if (c < ncols) {
                [[unroll]] for (uint k = 0; k < RS; k++) {
                    float s = subgroupAdd(acc[c * RS + k]) NORM_S(c);
                    if (subgroupElect() && row0 + k < pc.n_rows) {
                        uint o = c * pc.y_stride + pc.y_off + row0 + k;
                        y[o] = pc.mode == 1u ? y[o] + s : s;
                    }
                }
            }
        }
#endif
    }
#if defined(ROPE_OUT)
#if KV_TYPE >= 3
    // every subgroup has parked its rows: one lane per token encodes the block
    barrier();
    uint first = FLAT_GROUP * 32u;  // the work group's first row (NR * RS == 32)
    uint c = gl_LocalInvocationID.x;
    if (pc.to_cache == 1u && c < ncols && first < pc.n_rows) {
        float v[32];
        [[unroll]] for (uint k = 0; k < 32u; k++) {
            v[k] = blk[c * 32u + k];
        }
        uint crow = STEP_SEQ(COL0 + c) * pc.n_ctx + STEP_POS(COL0 + c) % pc.n_ctx;
        kv_store_block(KT, crow * kv_row_words(KT, pc.kv_dim), (pc.y_off + first) / 32u, v);
    }
#endif
#endif
}

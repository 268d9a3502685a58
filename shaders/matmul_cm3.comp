#version 450
// matmul_cm2.comp's prefill matmul (cooperative matrices, 16x16x16 f16 x f16 -> f32 at
// subgroup scope; the same arguments and results: y[t][y_off + row] (+)= W[row] . x[t]
// for the live tokens t), rebuilt for the variants the H200 sweeps (bench/matmul.py,
// bench/h200.sh cm2sweep) before one of them replaces matmul_cm2 as the default. Each
// part below answers a cost of matmul_cm2's K loop, which the H200 ran at 69-84 TFLOP/s:
//
//   * the tiles live in one `shared uvec4` array and every lane stores its eight f16 of
//     a K-tile row as one 16-byte store (matmul_cm2: eight 16-bit stores per group);
//     coopMatLoad reads its f16 fragments from that array, offset and stride counted in
//     uvec4 (GL_KHR_cooperative_matrix: in units of the array's element type), rows
//     padded by 16 bytes as before (conflict-free 16-byte row reads of 8 rows);
//   * BK (define, 32 or 64): K per tile, so BK 64 halves the barriers and loop overhead
//     per product, for twice the tile memory;
//   * DB (define): two tile buffers, the next K-tile stored into the other one while this
//     one is multiplied, one barrier per K-tile instead of two;
//   * DIRECT (define): a 16x16 block wholly inside (rows and live tokens; y_stride and
//     y_off multiples of 4) goes to y by coopMatStore (mode 1: coopMatLoad of y, added)
//     instead of through shared memory and a masked store per value;
//   * TM x TN (defines) blocks of 16x16 per subgroup and the tile BM x BN are free
//     (ops.cm3_layout), e.g. llama.cpp's 128x128 over 4 subgroups of 4x4 blocks;
//   * WIDE_W (define, the "+w" variants, for Q4_K, Q6_K and Q8_0): the weights read wider
//     than quant.glsl's 16-bit words (dequant8w below: Q4_K's scales as three 32-bit
//     words and its eight nibbles as one 64-bit load, 5 loads per 8 values against 8-10;
//     Q6_K's low and high bits a 16-bit word per two values, 10 loads against 18; Q8_0
//     four 32-bit loads against five 16-bit ones, scaled in f16);
//   * no select on the loaded values: rows past n_rows and tokens past the live count
//     read the last valid row / token (clamped addresses, real values) and only feed
//     outputs that are never stored.
// The register prefetch is matmul_cm2's: the next K-tile's loads (weights through
// quant.glsl's dequant8, activations f32 -> f16) are issued before this tile's products
// and stored after them (single buffer: after the next barrier), no branch of their own.
//
// SG (define) is the subgroup size the layout is built for, NT = SGM * SGN * SG lanes the
// host's local size. CM_EMULATE (tests only): the products done by plain lanes from the
// same shared tiles into the same per-lane slots of each 16x16 block ("subgroups" of SG
// consecutive lanes, work-group barriers for theirs), the stage kept in the tile array
// (as float bits, after the K loop) so the larger tiles fit lavapipe's 32 KiB; on a GPU
// the stage is an array of its own (a float store into a uvec4 array is not relied on).
#ifndef CM_EMULATE
#extension GL_KHR_cooperative_matrix : require
#extension GL_KHR_memory_scope_semantics : require
#endif
#extension GL_EXT_shader_explicit_arithmetic_types_float16 : require
#include "common.glsl"

layout(binding = 0, std430) readonly buffer W16 { uint16_t w16[]; };
layout(binding = 1, std430) readonly buffer X { vec4 x4[]; };
layout(binding = 2, std430) buffer Y { float y[]; };
DECLARE_STEP(3)

layout(push_constant) uniform Push {
    uint n_in;
    uint n_rows;
    uint x_stride;
    uint y_stride;
    uint y_off;
    uint count_sel;
    uint mode;
} pc;

#include "quant.glsl"

uvec4 pack8(f16vec4 lo, f16vec4 hi) {
    return uvec4(packFloat2x16(lo.xy), packFloat2x16(lo.zw), packFloat2x16(hi.xy), packFloat2x16(hi.zw));
}

#if defined(WIDE_W) && defined(QTYPE_Q4_K)
// the same weights as 32- and 64-bit words: a Q4_K row is whole 144-byte super-blocks
// from a 16-byte aligned binding, so its d / dmin pair, scales and groups of eight
// nibbles lie on 4- and 8-byte boundaries (aliased bindings, as llama.cpp's mul_mm)
layout(binding = 0, std430) readonly buffer W32 { uint w32[]; };
layout(binding = 0, std430) readonly buffer W64 { uvec2 w64[]; };

// dequant8 of Q4_K from those words (ggml's get_scale_min_k4, the scales' bytes j of
// s0 = bytes 0-3, s1 = 4-7, s2 = 8-11)
void dequant8w(uint row16, uint g, out float v[8]) {
    uint b = (row16 >> 1) + (g >> 5) * 36u;  // the super-block, in 32-bit words
    uint k = (g & 31u) * 8u;
    uint c = k >> 6;
    uint hi = (k >> 5) & 1u;
    uint l = k & 31u;
    uint is = 2u * c + hi;
    vec2 dm = unpackHalf2x16(w32[b]);
    uint s0 = w32[b + 1u];
    uint s1 = w32[b + 2u];
    uint s2 = w32[b + 3u];
    uint j = 8u * (is & 3u);
    uint sc;
    uint m;
    if (is < 4u) {
        sc = (s0 >> j) & 63u;
        m = (s1 >> j) & 63u;
    } else {
        sc = ((s2 >> j) & 0xFu) | (((s0 >> (j + 6u)) & 3u) << 4);
        m = ((s2 >> (j + 4u)) & 0xFu) | (((s1 >> (j + 6u)) & 3u) << 4);
    }
    float dl = dm.x * float(sc);
    float ml = dm.y * float(m);
    uvec2 q = w64[(b >> 1) + 2u + 4u * c + (l >> 3)];  // bytes 16 + 32c + l .. + 8
    uint sh = hi * 4u;
    [[unroll]] for (uint i = 0; i < 4; i++) {
        v[i] = dl * float((q.x >> (8u * i + sh)) & 0xFu) - ml;
        v[4u + i] = dl * float((q.y >> (8u * i + sh)) & 0xFu) - ml;
    }
}
#elif defined(WIDE_W) && defined(QTYPE_Q6_K)
// dequant8 of Q6_K reading each 16-bit word of its low and high bits once (two values
// per word; quant.glsl's reads a word per byte): a 210-byte block is 2-byte aligned only
void dequant8w(uint row16, uint g, out float v[8]) {
    uint b = row16 + (g >> 5) * BLOCK16;
    uint k = (g & 31u) * 8u;
    uint h = k >> 7;
    uint qd = (k >> 5) & 3u;
    uint l = k & 31u;
    uint ql = b + ((h * 64u + l + (qd & 1u) * 32u) >> 1);
    uint qh = b + ((128u + h * 32u + l) >> 1);
    uint nsh = (qd >> 1) * 4u;
    uint hsh = 2u * qd;
    float ds = whalf(b + 104u) * float(int(wbyte(b, 192u + h * 8u + (l >> 4) + 2u * qd) << 24) >> 24);
    [[unroll]] for (uint i = 0; i < 4; i++) {
        uint pl = uint(w16[ql + i]);
        uint ph = uint(w16[qh + i]);
        [[unroll]] for (uint t = 0; t < 2; t++) {
            uint q = ((pl >> (8u * t + nsh)) & 0xFu) | (((ph >> (8u * t + hsh)) & 3u) << 4);
            v[2u * i + t] = ds * (float(q) - 32.0);
        }
    }
}
#elif defined(WIDE_W) && defined(QTYPE_Q8_0)
// Q8_0 from 32-bit words (the host sets WIDE_W only where n_in is a multiple of 64, so
// rows start on 4-byte boundaries and the weights are whole words): a 34-byte block puts
// its eight int8 on a 2- or 4-byte boundary, read as three words and funnel-shifted
// (the third clamped into the binding: unused where they are aligned), d from its word
layout(binding = 0, std430) readonly buffer W32 { uint w32[]; };
#define FETCH8_W 1

uvec4 fetch8w(uint row16, uint g) {
    uint db = 2u * row16 + 34u * (g >> 2);  // bytes: the block's d, then its 32 int8
    uint o = db + 2u + 8u * (g & 3u);
    uint a = o >> 2;
    uint sh = (o & 2u) * 8u;
    uint w0 = w32[a];
    uint w1 = w32[a + 1u];
    uint w2 = w32[min(a + 2u, uint(w32.length()) - 1u)];
    int lo = int((w0 >> sh) | ((w1 << 16) << (16u - sh)));
    int hi = int((w1 >> sh) | ((w2 << 16) << (16u - sh)));
    float16_t d = unpackFloat2x16(w32[db >> 2] >> ((db & 2u) * 8u)).x;
    // q * d in f16 is the f16 rounding of the exact product, as quant.glsl's f32 product
    // rounded to f16 (8 x 11 significant bits fit f32)
    f16vec4 ql = f16vec4(bitfieldExtract(lo, 0, 8), bitfieldExtract(lo, 8, 8), bitfieldExtract(lo, 16, 8),
                         bitfieldExtract(lo, 24, 8));
    f16vec4 qh = f16vec4(bitfieldExtract(hi, 0, 8), bitfieldExtract(hi, 8, 8), bitfieldExtract(hi, 16, 8),
                         bitfieldExtract(hi, 24, 8));
    return pack8(ql * d, qh * d);
}
#else
#define dequant8w dequant8
#endif

#ifndef BK
#define BK 32
#endif
#ifndef DB
#define DB 0
#endif
#ifndef DIRECT
#define DIRECT 0
#endif

const uint KG = BK / 8u;              // groups of eight k in a tile row
const uint SKV = KG + 1u;             // uvec4 per tile row (one of padding)
const uint SGM = BM / (16u * TM);     // subgroups along the rows
const uint SGN = BN / (16u * TN);     // ... and along the tokens
const uint NSG = SGM * SGN;
const uint NT = NSG * SG;             // lanes of the work group (= WG)
const uint A_LD = BM * KG / NT;       // groups of eight weights each lane loads per K-tile
const uint B_LD = BN * KG / NT;       // ... and of eight activations
const uint EPL = 256u / SG;           // elements of a 16x16 block per lane
const uint A_V = BM * SKV;            // uvec4 of a W tile, [row][k]: matrix A, row-major
const uint TILE_V = (BM + BN) * SKV;  // ... and of W then x ([token][k]: B, column-major)
const uint NBUF = DB + 1u;
#ifdef CM_EMULATE
const uint STAGE_V = NSG * 64u;       // each subgroup's 16x16 f32 block, in the tile array
shared uvec4 sm[NBUF * TILE_V > STAGE_V ? NBUF * TILE_V : STAGE_V];
#else
shared uvec4 sm[NBUF * TILE_V];
shared float stage[NSG * 256u];
#endif

#ifdef CM_EMULATE
#define SG_ID (gl_LocalInvocationID.x / SG)
#define SG_LANE (gl_LocalInvocationID.x % SG)
#define SG_SYNC() barrier()
#else
#define SG_ID gl_SubgroupID
#define SG_LANE gl_SubgroupInvocationID
#define SG_SYNC() subgroupMemoryBarrierShared(); subgroupBarrier()
#endif

// the next K-tile, eight f16 per uvec4, on its way to shared memory
uvec4 apre[A_LD];
uvec4 bpre[B_LD];

// Group g = tid + NT * i of a tile is row (token) g / KG of it, k values 8 (g % KG) ..
// + 8; NT is a multiple of KG, so every group of a lane has the same k offset.
void fetch(uint kb, uint lk, uint a_row[A_LD], uint b_at[B_LD]) {
    [[unroll]] for (uint i = 0; i < A_LD; i++) {
#ifdef FETCH8_W
        apre[i] = fetch8w(a_row[i], (kb + lk) >> 3);
#else
        float w[8];
        dequant8w(a_row[i], (kb + lk) >> 3, w);
        apre[i] = pack8(f16vec4(float16_t(w[0]), float16_t(w[1]), float16_t(w[2]), float16_t(w[3])),
                        f16vec4(float16_t(w[4]), float16_t(w[5]), float16_t(w[6]), float16_t(w[7])));
#endif
    }
    [[unroll]] for (uint i = 0; i < B_LD; i++) {
        uint xi = b_at[i] + (kb >> 2);
        bpre[i] = pack8(f16vec4(x4[xi]), f16vec4(x4[xi + 1u]));
    }
}

void put(uint buf, uint tid) {
    uint base = buf * TILE_V + (tid / KG) * SKV + tid % KG;
    [[unroll]] for (uint i = 0; i < A_LD; i++) {
        sm[base + (NT / KG) * SKV * i] = apre[i];
    }
    [[unroll]] for (uint i = 0; i < B_LD; i++) {
        sm[base + A_V + (NT / KG) * SKV * i] = bpre[i];
    }
}

#ifdef CM_EMULATE
float acc[TM * TN * EPL];

// A row of tile A times one of tile B (uvec4 indices), eight k per step: llvmpipe cuts
// off any loop after 65535 iterations per invocation (its loop limiter), which a loop
// over single k values passed at 512 inputs with 4x4 blocks and BK 64
float dot_rows(uint ra, uint rb, float a) {
    for (uint kv = 0; kv < KG; kv++) {
        uvec4 qa = sm[ra + kv];
        uvec4 qb = sm[rb + kv];
        [[unroll]] for (uint c = 0; c < 4; c++) {
            vec2 fa = vec2(unpackFloat2x16(qa[c]));
            vec2 fb = vec2(unpackFloat2x16(qb[c]));
            a += fa.x * fb.x;
            a += fa.y * fb.y;
        }
    }
    return a;
}

void products(uint buf, uint wm, uint wn, uint lane) {
    [[unroll]] for (uint i = 0; i < TM; i++) {
        [[unroll]] for (uint j = 0; j < TN; j++) {
            for (uint e = 0; e < EPL; e++) {
                uint idx = lane + SG * e;  // block element (idx % 16, idx / 16), as staged
                uint ra = buf * TILE_V + (wm + 16u * i + idx % 16u) * SKV;
                uint rb = buf * TILE_V + A_V + (wn + 16u * j + idx / 16u) * SKV;
                acc[(i * TN + j) * EPL + e] = dot_rows(ra, rb, acc[(i * TN + j) * EPL + e]);
            }
        }
    }
}
#else
coopmat<float, gl_ScopeSubgroup, 16, 16, gl_MatrixUseAccumulator> acc[TM * TN];

void products(uint buf, uint wm, uint wn, uint lane) {
    [[unroll]] for (uint kk = 0; kk < KG; kk += 2u) {  // 16 of K: two uvec4 of a row
        coopmat<float16_t, gl_ScopeSubgroup, 16, 16, gl_MatrixUseA> ma[TM];
        coopmat<float16_t, gl_ScopeSubgroup, 16, 16, gl_MatrixUseB> mb[TN];
        [[unroll]] for (uint i = 0; i < TM; i++) {
            coopMatLoad(ma[i], sm, buf * TILE_V + (wm + 16u * i) * SKV + kk, SKV, gl_CooperativeMatrixLayoutRowMajor);
        }
        [[unroll]] for (uint j = 0; j < TN; j++) {
            coopMatLoad(mb[j], sm, buf * TILE_V + A_V + (wn + 16u * j) * SKV + kk, SKV,
                        gl_CooperativeMatrixLayoutColumnMajor);
        }
        [[unroll]] for (uint i = 0; i < TM; i++) {
            [[unroll]] for (uint j = 0; j < TN; j++) {
                acc[i * TN + j] = coopMatMulAdd(ma[i], mb[j], acc[i * TN + j]);
            }
        }
    }
}
#endif

void main() {
    uint tid = gl_LocalInvocationID.x;
    uint m0 = gl_WorkGroupID.x * BM;
    uint n0 = gl_WorkGroupID.y * BN;
    uint ntok = STEP_COUNT(pc.count_sel);
    if (n0 >= ntok) {
        return;
    }
    uint lk = (tid % KG) * 8u;
    uint rw = row_words(pc.n_in);
    uint a_row[A_LD];
    [[unroll]] for (uint i = 0; i < A_LD; i++) {
        a_row[i] = min(m0 + tid / KG + (NT / KG) * i, pc.n_rows - 1u) * rw;
    }
    uint b_at[B_LD];
    [[unroll]] for (uint i = 0; i < B_LD; i++) {
        b_at[i] = (min(n0 + tid / KG + (NT / KG) * i, ntok - 1u) * pc.x_stride + lk) >> 2;
    }

    uint sg = SG_ID;
    uint lane = SG_LANE;
    uint wm = (sg % SGM) * (16u * TM);  // this subgroup's first row and token in the tile
    uint wn = (sg / SGM) * (16u * TN);
#ifdef CM_EMULATE
    [[unroll]] for (uint i = 0; i < TM * TN * EPL; i++) {
        acc[i] = 0.0;
    }
#else
    [[unroll]] for (uint i = 0; i < TM * TN; i++) {
        acc[i] = coopmat<float, gl_ScopeSubgroup, 16, 16, gl_MatrixUseAccumulator>(0.0);
    }
#endif

    fetch(0u, lk, a_row, b_at);
#if DB
    put(0u, tid);
    barrier();
    uint cur = 0u;
    for (uint kb = 0; kb < pc.n_in; kb += BK) {
        // the next tile's loads in flight during this tile's products, then stored into
        // the other buffer, which every subgroup left at the last barrier (the last step
        // fetches and stores itself again rather than branch)
        fetch(min(kb + BK, pc.n_in - BK), lk, a_row, b_at);
        products(cur, wm, wn, lane);
        put(cur ^ 1u, tid);
        barrier();
        cur ^= 1u;
    }
#else
    for (uint kb = 0; kb < pc.n_in; kb += BK) {
        barrier();  // every subgroup is done with the previous tile
        put(0u, tid);
        barrier();
        fetch(min(kb + BK, pc.n_in - BK), lk, a_row, b_at);
        products(0u, wm, wn, lane);
    }
    barrier();  // (CM_EMULATE: the stage below reuses the tiles)
#endif

    // out, block by block: DIRECT's whole blocks straight to y, the others through the
    // subgroup's slice of the stage ([token][row] within the block), masked by the rows
    // and the live tokens (CM_EMULATE stages every block, its barriers in uniform flow,
    // and writes the whole ones from the accumulators)
    bool aligned = DIRECT != 0 && pc.y_stride % 4u == 0u && pc.y_off % 4u == 0u;
    [[unroll]] for (uint i = 0; i < TM; i++) {
        [[unroll]] for (uint j = 0; j < TN; j++) {
            uint r0 = m0 + wm + 16u * i;
            uint t0 = n0 + wn + 16u * j;
            bool whole = aligned && r0 + 16u <= pc.n_rows && t0 + 16u <= ntok;
#ifdef CM_EMULATE
            for (uint e = 0; e < EPL; e++) {
                sm[sg * 64u + (lane + SG * e) / 4u][(lane + SG * e) % 4u] = floatBitsToUint(acc[(i * TN + j) * EPL + e]);
            }
#else
            if (whole) {
                uint o = t0 * pc.y_stride + pc.y_off + r0;
                if (pc.mode == 1u) {
                    coopmat<float, gl_ScopeSubgroup, 16, 16, gl_MatrixUseAccumulator> old;
                    coopMatLoad(old, y, o, pc.y_stride, gl_CooperativeMatrixLayoutColumnMajor);
                    acc[i * TN + j] = acc[i * TN + j] + old;
                }
                coopMatStore(acc[i * TN + j], y, o, pc.y_stride, gl_CooperativeMatrixLayoutColumnMajor);
                continue;
            }
            coopMatStore(acc[i * TN + j], stage, sg * 256u, 16u, gl_CooperativeMatrixLayoutColumnMajor);
#endif
            SG_SYNC();
            for (uint e = 0; e < EPL; e++) {
                uint idx = lane + SG * e;
                uint row = r0 + idx % 16u;
                uint tok = t0 + idx / 16u;
                if (row < pc.n_rows && tok < ntok) {
                    uint o = tok * pc.y_stride + pc.y_off + row;
#ifdef CM_EMULATE
                    float v = whole ? acc[(i * TN + j) * EPL + e] : uintBitsToFloat(sm[sg * 64u + idx / 4u][idx % 4u]);
#else
                    float v = stage[sg * 256u + idx];
#endif
                    y[o] = pc.mode == 1u ? y[o] + v : v;
                }
            }
            SG_SYNC();
        }
    }
}

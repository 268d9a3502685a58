#version 450
// The prefill matmul on VK_NV_cooperative_matrix2 (NVIDIA): matmul_cm2.comp's bindings,
// push constants and results, y[t][y_off + row] (+)= W[row] . x[t] for the live tokens t,
// with the tiling left to the driver.
//
// A work group owns a BM x BN tile of (rows, tokens) (defines; ops.nv2_tile chooses per
// product among shaders.NV2_TILES) as ONE workgroup-scope accumulator, and walks K in
// steps of BK (define, 32 or 64). Each step is two tensor-addressed loads and one
// product of workgroup-scope matrices:
//   * A (BM x BK, f16) straight from the weight rows: the tensor layout is n_rows x n_in
//     in blocks of 1 x QK (setTensorLayoutBlockSizeNV), so the driver computes the
//     address of each element's ggml block, and a decode function (decodeW) turns
//     (block pointer, index in the block) into one f16 value. F16 weights load as they
//     are (no decode function, the binding read through an f16 alias);
//   * B (BK x BN, f16) from the f32 activations: x is a token-major tensor (live tokens
//     x n_in, row stride x_stride) in blocks of 1 x 4 (one vec4), read through a
//     transposing view (tokens become columns) and converted by decodeX. With X_F16,
//     binding 1 is instead to_f16.comp's f16 copy of the live rows (n_in apart), loaded
//     as it is (no decode function), as llama.cpp's coopmat2 products read theirs;
//   * acc = A * B + acc at workgroup scope: the staging through shared memory, the
//     pipelining of the loads and the split of the product over the subgroups are the
//     driver's, not ours.
// Ragged edges: the layouts clamp (gl_CooperativeMatrixClampModeConstantNV, value 0):
// rows past n_rows, tokens past the live count and K past n_in load as 0, and the store
// (through the same kind of transposing view onto y: tokens x (y_off + n_rows), row
// stride y_stride) drops every element outside. A tile wholly inside (every row and
// token, n_in a multiple of BK) runs the same loop on unclamped layouts instead, which
// need no bounds checks. Mode 1 starts the accumulator from y's tile (a clamped load)
// instead of 0, then stores as mode 0.
//
// Needs: VK_NV_cooperative_matrix2's workgroup scope and tensor addressing, and (decode
// functions take a buffer_reference) the bufferDeviceAddress feature, which device.py
// enables beside the extension; the work group of WG lanes (spec constant 0: 256 for
// the 128-row tiles, 128 for 64x64) at most cooperativeMatrixWorkgroupScopeMaxWorkgroupSize.
// Base offsets are 0 (the views' offsets are the storage-buffer alignment, >= 16 bytes
// on the GPUs that have the extension, as the tensor loads ask).
#extension GL_KHR_cooperative_matrix : require
#extension GL_KHR_memory_scope_semantics : require
#extension GL_NV_cooperative_matrix2 : require
#extension GL_EXT_buffer_reference : require
#extension GL_EXT_shader_explicit_arithmetic_types_float16 : require
#include "common.glsl"

layout(binding = 0, std430) readonly buffer W16 { uint16_t w16[]; };
#if defined(QTYPE_F16)
layout(binding = 0, std430) readonly buffer WH { float16_t wh[]; };  // the same words, as f16
#endif
#if defined(X_F16)
layout(binding = 1, std430) readonly buffer XH { float16_t xh[]; };
#else
layout(binding = 1, std430) readonly buffer X { vec4 x4[]; };
#endif
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

#include "quant.glsl"  // QK and BLOCK16 of the weight type (its dequant8 is not used here)

// One ggml block of the weights as 16-bit words: the decode functions' pointee, so the
// driver steps BLOCK16 * 2 bytes per block (every ggml block size is even).
layout(buffer_reference, std430, buffer_reference_align = 2) readonly buffer WBlock {
    uint16_t q[BLOCK16];
};

// byte b of a block
uint bbyte(const in WBlock bl, uint b) {
    return (uint(bl.q[b >> 1]) >> ((b & 1u) << 3)) & 0xFFu;
}

float bhalf(const in WBlock bl, uint i) {
    return unpackHalf2x16(uint(bl.q[i])).x;
}

// Value i (0 <= i < QK) of a block: quant.glsl's dequant8 for one value, the same byte
// offsets (its comments give each layout).
float dq1(const in WBlock bl, uint i) {
#if defined(QTYPE_F32)
    return uintBitsToFloat(uint(bl.q[0]) | (uint(bl.q[1]) << 16));
#elif defined(QTYPE_BF16)
    return uintBitsToFloat(uint(bl.q[0]) << 16);
#elif defined(QTYPE_Q8_0)
    return bhalf(bl, 0u) * float(int(bbyte(bl, 2u + i) << 24) >> 24);
#elif defined(QTYPE_Q4_0) || defined(QTYPE_Q4_1) || defined(QTYPE_IQ4_NL)
#if defined(QTYPE_Q4_1)
    const uint QS = 4u;  // byte where the nibbles start
#else
    const uint QS = 2u;
#endif
    uint n = (bbyte(bl, QS + (i & 15u)) >> (i >= 16u ? 4u : 0u)) & 0xFu;
#if defined(QTYPE_Q4_0)
    return bhalf(bl, 0u) * (float(n) - 8.0);
#elif defined(QTYPE_Q4_1)
    return bhalf(bl, 0u) * float(n) + bhalf(bl, 1u);
#else
    return bhalf(bl, 0u) * KVALUES[n];
#endif
#elif defined(QTYPE_Q5_0) || defined(QTYPE_Q5_1)
    uint qh = uint(bl.q[HDR]) | (uint(bl.q[HDR + 1u]) << 16);
    uint n = (bbyte(bl, 2u * HDR + 4u + (i & 15u)) >> (i >= 16u ? 4u : 0u)) & 0xFu;
    n |= ((qh >> i) & 1u) << 4;
#if defined(QTYPE_Q5_0)
    return bhalf(bl, 0u) * (float(n) - 16.0);
#else
    return bhalf(bl, 0u) * float(n) + bhalf(bl, 1u);
#endif
#elif defined(QTYPE_IQ4_XS)
    uint sb = i >> 5;  // sub-block of 32
    uint ls = ((bbyte(bl, 4u + (sb >> 1)) >> (4u * (sb & 1u))) & 0xFu) | (((uint(bl.q[1]) >> (2u * sb)) & 3u) << 4);
    uint j = i & 31u;
    uint n = (bbyte(bl, 8u + 16u * sb + (j & 15u)) >> (j >= 16u ? 4u : 0u)) & 0xFu;
    return bhalf(bl, 0u) * (float(ls) - 32.0) * KVALUES[n];
#elif defined(QTYPE_Q2_K)
    uint h = i >> 7;
    uint s = (i >> 5) & 3u;
    uint l = i & 31u;
    uint sm = bbyte(bl, i >> 4);
    uint n = (bbyte(bl, 16u + 32u * h + l) >> (2u * s)) & 3u;
    return bhalf(bl, 40u) * float(sm & 0xFu) * float(n) - bhalf(bl, 41u) * float(sm >> 4);
#elif defined(QTYPE_Q3_K)
    uint h = i >> 7;
    uint s = (i >> 5) & 3u;
    uint l = i & 31u;
    uint j = i >> 4;  // sub-block of 16
    uint sc = ((bbyte(bl, 96u + (j & 7u)) >> (4u * (j >> 3))) & 0xFu) | (((bbyte(bl, 104u + (j & 3u)) >> (2u * (j >> 2))) & 3u) << 4);
    uint lo = (bbyte(bl, 32u + 32u * h + l) >> (2u * s)) & 3u;
    uint hi = (bbyte(bl, l) >> (4u * h + s)) & 1u;
    return bhalf(bl, 54u) * (float(sc) - 32.0) * (float(lo) - (hi != 0u ? 0.0 : 4.0));
#elif defined(QTYPE_Q4_K) || defined(QTYPE_Q5_K)
    uint c = i >> 6;
    uint hi = (i >> 5) & 1u;
    uint l = i & 31u;
    uint is = 2u * c + hi;
    uint sc;
    uint m;
    if (is < 4u) {
        sc = bbyte(bl, 4u + is) & 63u;
        m = bbyte(bl, 8u + is) & 63u;
    } else {
        sc = (bbyte(bl, 8u + is) & 0xFu) | ((bbyte(bl, is) >> 6) << 4);
        m = (bbyte(bl, 8u + is) >> 4) | ((bbyte(bl, 4u + is) >> 6) << 4);
    }
#if defined(QTYPE_Q4_K)
    uint n = (bbyte(bl, 16u + 32u * c + l) >> (4u * hi)) & 0xFu;
#else
    uint n = (bbyte(bl, 48u + 32u * c + l) >> (4u * hi)) & 0xFu;
    n |= ((bbyte(bl, 16u + l) >> (i >> 5)) & 1u) << 4;
#endif
    return bhalf(bl, 0u) * float(sc) * float(n) - bhalf(bl, 1u) * float(m);
#elif defined(QTYPE_Q6_K)
    uint h = i >> 7;
    uint qd = (i >> 5) & 3u;
    uint l = i & 31u;
    uint lo = (bbyte(bl, 64u * h + l + 32u * (qd & 1u)) >> (4u * (qd >> 1))) & 0xFu;
    uint hb = (bbyte(bl, 128u + 32u * h + l) >> (2u * qd)) & 3u;
    float sc = float(int(bbyte(bl, 192u + 8u * h + (l >> 4) + 2u * qd) << 24) >> 24);
    return bhalf(bl, 104u) * sc * (float(lo | (hb << 4)) - 32.0);
#else
    return 0.0;  // F16: loaded without a decode function
#endif
}

float16_t decodeW(const in WBlock bl, const in uint blockCoords[2], const in uint coordInBlock[2]) {
    return float16_t(dq1(bl, coordInBlock[1]));
}

#if defined(X_F16)
#define XB 1u  // B's tensor blocks: single values
#define X_ROW pc.n_in
#define LOAD_B(m, layout, view) coopMatLoadTensorNV(m, xh, 0u, layout, view)
#else
// four activations (one vec4 of a token's row): the decode of B's blocks of 1 x 4
layout(buffer_reference, std430, buffer_reference_align = 16) readonly buffer XBlock {
    vec4 v;
};

float16_t decodeX(const in XBlock bl, const in uint blockCoords[2], const in uint coordInBlock[2]) {
    return float16_t(bl.v[coordInBlock[1]]);
}
#define XB 4u
#define X_ROW (pc.x_stride >> 2)
#define LOAD_B(m, layout, view) coopMatLoadTensorNV(m, x4, 0u, layout, view, decodeX)
#endif

#if defined(QTYPE_F16)
#define LOAD_A(m, layout) coopMatLoadTensorNV(m, wh, 0u, layout)
#else
#define LOAD_A(m, layout) coopMatLoadTensorNV(m, w16, 0u, layout, decodeW)
#endif

void main() {
    uint m0 = gl_WorkGroupID.x * BM;
    uint n0 = gl_WorkGroupID.y * BN;
    uint ntok = STEP_COUNT(pc.count_sel);
    if (n0 >= ntok) {
        return;  // the whole work group: the matrices below need it all or none
    }

    // W: n_rows x n_in values in blocks of 1 x QK; x: ntok x n_in in blocks of 1 x 4,
    // row stride x_stride / 4 blocks; y: ntok x (y_off + n_rows), row stride y_stride
    tensorLayoutNV<2, gl_CooperativeMatrixClampModeConstantNV> wc = createTensorLayoutNV(2, gl_CooperativeMatrixClampModeConstantNV);
    wc = setTensorLayoutBlockSizeNV(wc, 1, QK);
    wc = setTensorLayoutDimensionNV(wc, pc.n_rows, pc.n_in);
    tensorLayoutNV<2, gl_CooperativeMatrixClampModeConstantNV> xc = createTensorLayoutNV(2, gl_CooperativeMatrixClampModeConstantNV);
    xc = setTensorLayoutBlockSizeNV(xc, 1, XB);
    xc = setTensorLayoutDimensionNV(xc, ntok, pc.n_in);
    xc = setTensorLayoutStrideNV(xc, X_ROW, 1);
    tensorLayoutNV<2, gl_CooperativeMatrixClampModeConstantNV> yc = createTensorLayoutNV(2, gl_CooperativeMatrixClampModeConstantNV);
    yc = setTensorLayoutDimensionNV(yc, ntok, pc.y_off + pc.n_rows);
    yc = setTensorLayoutStrideNV(yc, pc.y_stride, 1);
    yc = sliceTensorLayoutNV(yc, n0, BN, pc.y_off + m0, BM);
    // matrix (r, c) <-> tensor (c, r): x's tokens and y's tokens are the matrices' columns
    tensorViewNV<2, false, 1, 0> tr = createTensorViewNV(2, false, 1, 0);

    coopmat<float, gl_ScopeWorkgroup, BM, BN, gl_MatrixUseAccumulator> acc;
    if (pc.mode == 1u) {
        coopMatLoadTensorNV(acc, y, 0u, yc, tr);
    } else {
        acc = coopmat<float, gl_ScopeWorkgroup, BM, BN, gl_MatrixUseAccumulator>(0.0);
    }

    if (m0 + BM <= pc.n_rows && n0 + BN <= ntok && pc.n_in % BK == 0u) {
        // wholly inside: the same loads without clamping
        tensorLayoutNV<2> w = createTensorLayoutNV(2);
        w = setTensorLayoutBlockSizeNV(w, 1, QK);
        w = setTensorLayoutDimensionNV(w, pc.n_rows, pc.n_in);
        tensorLayoutNV<2> x = createTensorLayoutNV(2);
        x = setTensorLayoutBlockSizeNV(x, 1, XB);
        x = setTensorLayoutDimensionNV(x, ntok, pc.n_in);
        x = setTensorLayoutStrideNV(x, X_ROW, 1);
        for (uint kb = 0; kb < pc.n_in; kb += BK) {
            coopmat<float16_t, gl_ScopeWorkgroup, BM, BK, gl_MatrixUseA> ma;
            coopmat<float16_t, gl_ScopeWorkgroup, BK, BN, gl_MatrixUseB> mb;
            LOAD_A(ma, sliceTensorLayoutNV(w, m0, BM, kb, BK));
            LOAD_B(mb, sliceTensorLayoutNV(x, n0, BN, kb, BK), tr);
            acc = coopMatMulAdd(ma, mb, acc);
        }
    } else {
        for (uint kb = 0; kb < pc.n_in; kb += BK) {
            coopmat<float16_t, gl_ScopeWorkgroup, BM, BK, gl_MatrixUseA> ma;
            coopmat<float16_t, gl_ScopeWorkgroup, BK, BN, gl_MatrixUseB> mb;
            LOAD_A(ma, sliceTensorLayoutNV(wc, m0, BM, kb, BK));
            LOAD_B(mb, sliceTensorLayoutNV(xc, n0, BN, kb, BK), tr);
            acc = coopMatMulAdd(ma, mb, acc);
        }
    }

    coopMatStoreTensorNV(acc, y, 0u, yc, tr);
}

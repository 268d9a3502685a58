// Dequantization of ggml weight rows, read through 16-bit words (every ggml block
// size is even, not every one is a multiple of four). The including shader declares
// `w16[]` and defines exactly one QTYPE_* macro.
//
//   QK       values per block
//   BLOCK16  16-bit words per block
//   dequant8(row16, g, v)  the 8 values [8g, 8g+8) of the row starting at word row16
//
// Eight consecutive values never straddle a block or a sub-block scale in any of
// these formats, so every kernel works in groups of eight.

uint wbyte(uint base16, uint b) {
    return (uint(w16[base16 + (b >> 1)]) >> ((b & 1u) << 3)) & 0xFFu;
}

float whalf(uint i) {
    return unpackHalf2x16(uint(w16[i])).x;
}

#if defined(QTYPE_F32)
const uint QK = 1;
const uint BLOCK16 = 2;
void dequant8(uint row16, uint g, out float v[8]) {
    uint b = row16 + g * 16u;
    [[unroll]] for (uint i = 0; i < 8; i++) {
        v[i] = uintBitsToFloat(uint(w16[b + 2 * i]) | (uint(w16[b + 2 * i + 1]) << 16));
    }
}
#elif defined(QTYPE_F16)
const uint QK = 1;
const uint BLOCK16 = 1;
void dequant8(uint row16, uint g, out float v[8]) {
    uint b = row16 + g * 8u;
    [[unroll]] for (uint i = 0; i < 8; i++) {
        v[i] = whalf(b + i);
    }
}
#elif defined(QTYPE_BF16)
const uint QK = 1;
const uint BLOCK16 = 1;
void dequant8(uint row16, uint g, out float v[8]) {
    uint b = row16 + g * 8u;
    [[unroll]] for (uint i = 0; i < 8; i++) {
        v[i] = uintBitsToFloat(uint(w16[b + i]) << 16);
    }
}
#elif defined(QTYPE_Q8_0)
// block: f16 d, int8 qs[32]
const uint QK = 32;
const uint BLOCK16 = 17;
void dequant8(uint row16, uint g, out float v[8]) {
    uint b = row16 + (g >> 2) * BLOCK16;
    float d = whalf(b);
    uint q = b + 1 + (g & 3u) * 4u;
    [[unroll]] for (uint i = 0; i < 4; i++) {
        uint p = uint(w16[q + i]);
        v[2 * i] = d * float(int(p << 24) >> 24);
        v[2 * i + 1] = d * float(int(p << 16) >> 24);
    }
}
#elif defined(QTYPE_Q4_0)
// block: f16 d, qs[16]; value j < 16 is the low nibble of qs[j], j >= 16 the high one of qs[j-16]
const uint QK = 32;
const uint BLOCK16 = 9;
void dequant8(uint row16, uint g, out float v[8]) {
    uint b = row16 + (g >> 2) * BLOCK16;
    float d = whalf(b);
    uint j = (g & 3u) * 8u;
    uint sh = j >= 16u ? 4u : 0u;
    uint q = b + 1 + ((j & 15u) >> 1);
    [[unroll]] for (uint i = 0; i < 4; i++) {
        uint p = uint(w16[q + i]);
        v[2 * i] = d * (float((p >> sh) & 0xFu) - 8.0);
        v[2 * i + 1] = d * (float((p >> (8u + sh)) & 0xFu) - 8.0);
    }
}
#elif defined(QTYPE_Q4_K)
// super-block of 256: f16 d, f16 dmin, scales[12] (6-bit scales and mins), qs[128]
const uint QK = 256;
const uint BLOCK16 = 72;
void dequant8(uint row16, uint g, out float v[8]) {
    uint b = row16 + (g >> 5) * BLOCK16;
    uint k = (g & 31u) * 8u;
    float d = whalf(b);
    float dmin = whalf(b + 1);
    uint c = k >> 6;
    uint hi = (k >> 5) & 1u;
    uint l = k & 31u;
    uint is = 2u * c + hi;
    uint sc;
    uint m;
    if (is < 4u) {
        sc = wbyte(b, 4u + is) & 63u;
        m = wbyte(b, 8u + is) & 63u;
    } else {
        sc = (wbyte(b, 8u + is) & 0xFu) | ((wbyte(b, is) >> 6) << 4);
        m = (wbyte(b, 8u + is) >> 4) | ((wbyte(b, 4u + is) >> 6) << 4);
    }
    float dl = d * float(sc);
    float ml = dmin * float(m);
    uint q = b + 8u + 16u * c + (l >> 1);
    uint sh = hi * 4u;
    [[unroll]] for (uint i = 0; i < 4; i++) {
        uint p = uint(w16[q + i]);
        v[2 * i] = dl * float((p >> sh) & 0xFu) - ml;
        v[2 * i + 1] = dl * float((p >> (8u + sh)) & 0xFu) - ml;
    }
}
#elif defined(QTYPE_Q6_K)
// super-block of 256: ql[128] (low 4 bits), qh[64] (high 2 bits), int8 scales[16], f16 d
const uint QK = 256;
const uint BLOCK16 = 105;
void dequant8(uint row16, uint g, out float v[8]) {
    uint b = row16 + (g >> 5) * BLOCK16;
    uint k = (g & 31u) * 8u;
    uint h = k >> 7;
    uint qd = (k >> 5) & 3u;
    uint l = k & 31u;
    uint qlb = h * 64u + l + (qd & 1u) * 32u;
    uint nsh = (qd >> 1) * 4u;
    uint qhb = 128u + h * 32u + l;
    uint hsh = 2u * qd;
    float d = whalf(b + 104u);
    float sc = float(int(wbyte(b, 192u + h * 8u + (l >> 4) + 2u * qd) << 24) >> 24);
    float ds = d * sc;
    [[unroll]] for (uint i = 0; i < 8; i++) {
        uint q = ((wbyte(b, qlb + i) >> nsh) & 0xFu) | (((wbyte(b, qhb + i) >> hsh) & 3u) << 4);
        v[i] = ds * (float(q) - 32.0);
    }
}
#else
#error "define one QTYPE_* macro"
#endif

// 16-bit words per row of n values
uint row_words(uint n) {
    return (n / QK) * BLOCK16;
}

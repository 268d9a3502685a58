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
#elif defined(QTYPE_Q4_1)
// block: f16 d, f16 m, qs[16] (nibbles as Q4_0); x = d*q + m
const uint QK = 32;
const uint BLOCK16 = 10;
void dequant8(uint row16, uint g, out float v[8]) {
    uint b = row16 + (g >> 2) * BLOCK16;
    float d = whalf(b);
    float m = whalf(b + 1);
    uint j = (g & 3u) * 8u;
    uint sh = j >= 16u ? 4u : 0u;
    uint q = b + 2 + ((j & 15u) >> 1);
    [[unroll]] for (uint i = 0; i < 4; i++) {
        uint p = uint(w16[q + i]);
        v[2 * i] = d * float((p >> sh) & 0xFu) + m;
        v[2 * i + 1] = d * float((p >> (8u + sh)) & 0xFu) + m;
    }
}
#elif defined(QTYPE_Q5_0) || defined(QTYPE_Q5_1)
// Q5_0 block: f16 d, qh[4], qs[16]; x = d*(q - 16)
// Q5_1 block: f16 d, f16 m, qh[4], qs[16]; x = d*q + m
// q of value j: the nibble of qs as in Q4_0, plus bit j of the 32-bit qh as bit 4
#if defined(QTYPE_Q5_0)
const uint QK = 32;
const uint BLOCK16 = 11;
const uint HDR = 1;  // words before qh
#else
const uint QK = 32;
const uint BLOCK16 = 12;
const uint HDR = 2;
#endif
void dequant8(uint row16, uint g, out float v[8]) {
    uint b = row16 + (g >> 2) * BLOCK16;
    float d = whalf(b);
#if defined(QTYPE_Q5_0)
    float m = -16.0 * d;
#else
    float m = whalf(b + 1);
#endif
    uint qh = uint(w16[b + HDR]) | (uint(w16[b + HDR + 1]) << 16);
    uint j = (g & 3u) * 8u;
    uint sh = j >= 16u ? 4u : 0u;
    uint q = b + HDR + 2 + ((j & 15u) >> 1);
    uint hb = qh >> j;
    [[unroll]] for (uint i = 0; i < 4; i++) {
        uint p = uint(w16[q + i]);
        v[2 * i] = d * float(((p >> sh) & 0xFu) | (((hb >> (2 * i)) & 1u) << 4)) + m;
        v[2 * i + 1] = d * float(((p >> (8u + sh)) & 0xFu) | (((hb >> (2 * i + 1)) & 1u) << 4)) + m;
    }
}
#elif defined(QTYPE_IQ4_NL) || defined(QTYPE_IQ4_XS)
// non-linear 4-bit codes: x = d * KVALUES[q]
// IQ4_NL block of 32: f16 d, qs[16] (nibbles as Q4_0)
// IQ4_XS super-block of 256: f16 d, u16 scales_h, scales_l[4], qs[128]; sub-block j of
//   32 has the 6-bit scale ls = scales_l nibble j | (scales_h bits 2j, 2j+1) << 4 and
//   x = d*(ls - 32)*KVALUES[q], its nibbles in qs[16j ..] as in an IQ4_NL block
const float KVALUES[16] = float[16](-127.0, -104.0, -83.0, -65.0, -49.0, -35.0, -22.0, -10.0,
                                    1.0, 13.0, 25.0, 38.0, 53.0, 69.0, 89.0, 113.0);
#if defined(QTYPE_IQ4_NL)
const uint QK = 32;
const uint BLOCK16 = 9;
#else
const uint QK = 256;
const uint BLOCK16 = 68;
#endif
void dequant8(uint row16, uint g, out float v[8]) {
#if defined(QTYPE_IQ4_NL)
    uint b = row16 + (g >> 2) * BLOCK16;
    float dl = whalf(b);
    uint q = b + 1;
#else
    uint b = row16 + (g >> 5) * BLOCK16;
    uint sb = (g >> 2) & 7u;  // sub-block of 32
    uint ls = ((wbyte(b, 4u + (sb >> 1)) >> (4u * (sb & 1u))) & 0xFu) | (((uint(w16[b + 1]) >> (2u * sb)) & 3u) << 4);
    float dl = whalf(b) * (float(ls) - 32.0);
    uint q = b + 4u + 8u * sb;
#endif
    uint j = (g & 3u) * 8u;
    uint sh = j >= 16u ? 4u : 0u;
    q += (j & 15u) >> 1;
    [[unroll]] for (uint i = 0; i < 4; i++) {
        uint p = uint(w16[q + i]);
        v[2 * i] = dl * KVALUES[(p >> sh) & 0xFu];
        v[2 * i + 1] = dl * KVALUES[(p >> (8u + sh)) & 0xFu];
    }
}
#elif defined(QTYPE_Q2_K)
// super-block of 256: scales[16] (low nibble scale, high nibble min, per 16 values),
// qs[64], f16 d, f16 dmin. Value 128h + 32s + l is bits 2s of qs[32h + l];
// x = d*sc*q - dmin*m
const uint QK = 256;
const uint BLOCK16 = 42;
void dequant8(uint row16, uint g, out float v[8]) {
    uint b = row16 + (g >> 5) * BLOCK16;
    uint k = (g & 31u) * 8u;
    uint h = k >> 7;
    uint s = (k >> 5) & 3u;
    uint l = k & 31u;
    uint sm = wbyte(b, k >> 4);
    float dl = whalf(b + 40u) * float(sm & 0xFu);
    float ml = whalf(b + 41u) * float(sm >> 4);
    uint q = b + 8u + 16u * h + (l >> 1);
    uint sh = 2u * s;
    [[unroll]] for (uint i = 0; i < 4; i++) {
        uint p = uint(w16[q + i]);
        v[2 * i] = dl * float((p >> sh) & 3u) - ml;
        v[2 * i + 1] = dl * float((p >> (8u + sh)) & 3u) - ml;
    }
}
#elif defined(QTYPE_Q3_K)
// super-block of 256: hmask[32], qs[64], scales[12] (16 6-bit scales, offset 32), f16 d.
// Value 128h + 32s + l: low 2 bits at bits 2s of qs[32h + l], the high bit at bit
// 4h + s of hmask[l]; q = low - (high ? 0 : 4), x = d*(sc - 32)*q
const uint QK = 256;
const uint BLOCK16 = 55;
void dequant8(uint row16, uint g, out float v[8]) {
    uint b = row16 + (g >> 5) * BLOCK16;
    uint k = (g & 31u) * 8u;
    uint h = k >> 7;
    uint s = (k >> 5) & 3u;
    uint l = k & 31u;
    uint j = k >> 4;  // sub-block of 16
    uint sc = ((wbyte(b, 96u + (j & 7u)) >> (4u * (j >> 3))) & 0xFu) | (((wbyte(b, 104u + (j & 3u)) >> (2u * (j >> 2))) & 3u) << 4);
    float dl = whalf(b + 54u) * (float(sc) - 32.0);
    uint q = b + 16u + 16u * h + (l >> 1);
    uint hm = b + (l >> 1);
    uint sh = 2u * s;
    uint hsh = 4u * h + s;
    [[unroll]] for (uint i = 0; i < 4; i++) {
        uint p = uint(w16[q + i]);
        uint m = uint(w16[hm + i]) >> hsh;
        v[2 * i] = dl * (float((p >> sh) & 3u) - ((m & 1u) != 0u ? 0.0 : 4.0));
        v[2 * i + 1] = dl * (float((p >> (8u + sh)) & 3u) - ((m & 0x100u) != 0u ? 0.0 : 4.0));
    }
}
#elif defined(QTYPE_Q5_K)
// super-block of 256: f16 d, f16 dmin, scales[12] (as Q4_K), qh[32], qs[128] (as Q4_K);
// bit 4 of value 32b + l is bit b of qh[l]; x = d*sc*q - dmin*m
const uint QK = 256;
const uint BLOCK16 = 88;
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
    uint q = b + 24u + 16u * c + (l >> 1);
    uint hq = b + 8u + (l >> 1);
    uint sh = hi * 4u;
    uint hsh = k >> 5;
    [[unroll]] for (uint i = 0; i < 4; i++) {
        uint p = uint(w16[q + i]);
        uint hb = uint(w16[hq + i]) >> hsh;
        v[2 * i] = dl * float(((p >> sh) & 0xFu) | ((hb & 1u) << 4)) - ml;
        v[2 * i + 1] = dl * float(((p >> (8u + sh)) & 0xFu) | (((hb >> 8) & 1u) << 4)) - ml;
    }
}
#else
#error "define one QTYPE_* macro"
#endif

// 16-bit words per row of n values
uint row_words(uint n) {
    return (n / QK) * BLOCK16;
}

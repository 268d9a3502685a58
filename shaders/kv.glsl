// KV cache rows in every cache type (model/kvtypes.py; the type codes are
// KVType.code): f32 0, f16 1, bf16 2, q8_0 3, q4_0 4, q4_1 5, q5_0 6, q5_1 7.
// A row is one position of one layer, kv_dim values stored as ggml stores a row of
// that type (blocks of 32 along the row for the quantized types); every type's block is
// a whole number of 16-bit words, so rows and heads are addressed in 16-bit words.
//
// Reading: define KVR_T (the type code), KVR_W(i) (the i-th 16-bit word of the cache,
// as uint), KVR_F4(i) (its i-th vec4: f32 caches), KVR_U2(i) (its i-th uvec2: f16 and
// bf16 caches) and KVR_LOAD4 (the function's name), then include kv_read.glsl; once per
// cache the shader reads. Writing: kv_store1 / kv_store_block below, for a shader
// that declares its cache as `kvs16[]` (uint16_t) and `kvs32[]` (float) at one binding.
//
// Stores give exactly the bytes llama.cpp's CPU backend stores (kvtypes.py says
// which encoder that is per type): float to half and bfloat16 by hand with ties to
// even (the rounding of a GLSL conversion is the driver's choice), divisions
// corrected to the correctly rounded quotient (a GLSL divide may be 2.5 ulp off), and
// `precise` so no multiply-add is fused where ggml's C code rounds twice.

#ifndef KV_GLSL
#define KV_GLSL

const uint KV_F32 = 0u;
const uint KV_F16 = 1u;
const uint KV_BF16 = 2u;
const uint KV_Q8_0 = 3u;
const uint KV_Q4_0 = 4u;
const uint KV_Q4_1 = 5u;
const uint KV_Q5_0 = 6u;
const uint KV_Q5_1 = 7u;

bool kv_quantized(uint t) {
    return t >= KV_Q8_0;
}

// 16-bit words of one block (of 32 values for the quantized types, 1 otherwise)
uint kv_block_words(uint t) {
    switch (t) {
    case KV_F32: return 2u;
    case KV_F16: return 1u;
    case KV_BF16: return 1u;
    case KV_Q8_0: return 17u;
    case KV_Q4_0: return 9u;
    case KV_Q4_1: return 10u;
    case KV_Q5_0: return 11u;
    default: return 12u;  // KV_Q5_1
    }
}

// 16-bit words of a row of n values
uint kv_row_words(uint t, uint n) {
    return kv_quantized(t) ? (n / 32u) * kv_block_words(t) : n * kv_block_words(t);
}

float kv_half(uint w) {
    return unpackHalf2x16(w).x;
}

// float -> IEEE half bits, round to nearest even (numpy's and F16C's conversion)
uint kv_f16_bits(float f) {
    uint x = floatBitsToUint(f);
    uint sign = (x >> 16) & 0x8000u;
    uint ax = x & 0x7FFFFFFFu;
    if (ax >= 0x7F800000u) {
        return sign | (ax > 0x7F800000u ? 0x7E00u : 0x7C00u);
    }
    if (ax >= 0x477FF000u) {  // 65520 and up round to infinity
        return sign | 0x7C00u;
    }
    if (ax >= 0x38800000u) {  // a normal half: rebias the exponent, round off 13 bits
        uint r = ax - 0x38000000u;
        return sign | ((r + 0xFFFu + ((r >> 13) & 1u)) >> 13);
    }
    // subnormal: in units of 2^-24 (the scaling is exact; roundEven ties to even)
    return sign | uint(roundEven(uintBitsToFloat(ax) * 16777216.0));
}

// float -> bfloat16 bits as ggml_compute_fp32_to_bf16: ties to even, NaN made quiet
uint kv_bf16_bits(float f) {
    uint x = floatBitsToUint(f);
    if ((x & 0x7FFFFFFFu) > 0x7F800000u) {
        return (x >> 16) | 64u;
    }
    return (x + 0x7FFFu + ((x >> 16) & 1u)) >> 16;
}

// a / b correctly rounded (one residual correction of the driver's quotient)
float kv_div(float a, float b) {
    precise float q = a / b;
    precise float r = fma(-q, b, a);
    return fma(r, 1.0 / b, q);
}

#endif

// -- stores (shaders that declare kvs16 / kvs32) ------------------------------------
#if defined(KV_STORE)

// value e of the row at word row_w, float types only
void kv_store1(uint t, uint row_w, uint e, float v) {
    if (t == KV_F32) {
        kvs32[row_w / 2u + e] = v;
    } else if (t == KV_F16) {
        kvs16[row_w + e] = uint16_t(kv_f16_bits(v));
    } else {
        kvs16[row_w + e] = uint16_t(kv_bf16_bits(v));
    }
}

void kv_put_half(uint w, float v) {
    kvs16[w] = uint16_t(kv_f16_bits(v));
}

// block b (values [32b, 32b + 32)) of the row at word row_w, quantized types only:
// ggml's encoders (q8_0: x86 quantize_row_q8_0; the others: quantize_row_*_ref)
void kv_store_block(uint t, uint row_w, uint b, float v[32]) {
    uint w = row_w + b * kv_block_words(t);
    if (t == KV_Q8_0) {
        float amax = 0.0;
        [[unroll]] for (uint j = 0; j < 32u; j++) {
            amax = max(amax, abs(v[j]));
        }
        kv_put_half(w, kv_div(amax, 127.0));
        float id = amax != 0.0 ? kv_div(127.0, amax) : 0.0;
        [[unroll]] for (uint j = 0; j < 32u; j += 2u) {
            precise float a = v[j] * id;
            precise float c = v[j + 1u] * id;
            uint qa = uint(int(roundEven(a))) & 0xFFu;
            uint qb = uint(int(roundEven(c))) & 0xFFu;
            kvs16[w + 1u + j / 2u] = uint16_t(qa | (qb << 8));
        }
        return;
    }
    if (t == KV_Q4_0 || t == KV_Q5_0) {
        // d = the value of largest magnitude (first one on ties) / -8 (or -16)
        float amax = 0.0;
        float mx = 0.0;
        [[unroll]] for (uint j = 0; j < 32u; j++) {
            if (amax < abs(v[j])) {
                amax = abs(v[j]);
                mx = v[j];
            }
        }
        bool five = t == KV_Q5_0;
        float d = mx / (five ? -16.0 : -8.0);  // exact: a power of two
        float id = d != 0.0 ? kv_div(1.0, d) : 0.0;
        float off = five ? 16.5 : 8.5;
        uint qmax = five ? 31u : 15u;
        kv_put_half(w, d);
        uint qh = 0u;
        uint q[32];
        [[unroll]] for (uint j = 0; j < 32u; j++) {
            precise float s = v[j] * id;
            precise float s2 = s + off;
            q[j] = min(qmax, uint(int(s2)));  // truncation, as the C cast
            qh |= ((q[j] >> 4) & 1u) << j;
        }
        uint qs = w + 1u;
        if (five) {
            kvs16[w + 1u] = uint16_t(qh & 0xFFFFu);
            kvs16[w + 2u] = uint16_t(qh >> 16);
            qs = w + 3u;
        }
        [[unroll]] for (uint j = 0; j < 16u; j += 2u) {
            uint b0 = (q[j] & 0xFu) | ((q[j + 16u] & 0xFu) << 4);
            uint b1 = (q[j + 1u] & 0xFu) | ((q[j + 17u] & 0xFu) << 4);
            kvs16[qs + j / 2u] = uint16_t(b0 | (b1 << 8));
        }
        return;
    }
    // q4_1 / q5_1: d = (max - min) / 15 (or 31), stored min
    float mn = v[0];
    float mx = v[0];
    // comparisons, not min()/max(): among equal values (+0 and -0) the first stays, as
    // in llama.cpp's loop; NVIDIA's min() took -0 over an earlier +0 (one byte off)
    [[unroll]] for (uint j = 1; j < 32u; j++) {
        mn = v[j] < mn ? v[j] : mn;
        mx = v[j] > mx ? v[j] : mx;
    }
    bool five = t == KV_Q5_1;
    precise float range = mx - mn;
    float d = kv_div(range, five ? 31.0 : 15.0);
    float id = d != 0.0 ? kv_div(1.0, d) : 0.0;
    uint qmax = five ? 31u : 15u;
    kv_put_half(w, d);
    kv_put_half(w + 1u, mn);
    uint qh = 0u;
    uint q[32];
    [[unroll]] for (uint j = 0; j < 32u; j++) {
        precise float s = v[j] - mn;
        precise float s1 = s * id;
        precise float s2 = s1 + 0.5;
        q[j] = min(qmax, uint(int(s2)));
        qh |= ((q[j] >> 4) & 1u) << j;
    }
    uint qs = w + 2u;
    if (five) {
        kvs16[w + 2u] = uint16_t(qh & 0xFFFFu);
        kvs16[w + 3u] = uint16_t(qh >> 16);
        qs = w + 4u;
    }
    [[unroll]] for (uint j = 0; j < 16u; j += 2u) {
        uint b0 = (q[j] & 0xFu) | ((q[j + 16u] & 0xFu) << 4);
        uint b1 = (q[j + 1u] & 0xFu) | ((q[j + 17u] & 0xFu) << 4);
        kvs16[qs + j / 2u] = uint16_t(b0 | (b1 << 8));
    }
}

#endif

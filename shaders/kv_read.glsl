// One cache's reader (see kv.glsl): KVR_LOAD4(row_w, e) is the values [e, e + 4) of
// the row (or head) starting at 16-bit word row_w; e is a multiple of 4. Values decode
// as ggml's dequantize_row_* (d * q, d * q + m; no fused multiply-add).
//
// Alignment: f32 rows start at multiples of 8 words (kv_dim and head_dim multiples of
// 4), f16/bf16 at multiples of 4, so those load 128 and 64 bits at once.

vec4 KVR_LOAD4(uint row_w, uint e) {
    if (KVR_T == KV_F32) {
        return KVR_F4((row_w >> 3) + (e >> 2));
    }
    if (KVR_T == KV_F16) {
        uvec2 u = KVR_U2((row_w + e) >> 2);
        return vec4(unpackHalf2x16(u.x), unpackHalf2x16(u.y));
    }
    if (KVR_T == KV_BF16) {
        uvec2 u = KVR_U2((row_w + e) >> 2);
        return vec4(uintBitsToFloat(u.x << 16), uintBitsToFloat(u.x & 0xFFFF0000u),
                    uintBitsToFloat(u.y << 16), uintBitsToFloat(u.y & 0xFFFF0000u));
    }
    uint j = e & 31u;
    uint b = row_w + (e >> 5) * kv_block_words(KVR_T);
    float d = kv_half(KVR_W(b));
    if (KVR_T == KV_Q8_0) {
        uint p = KVR_W(b + 1u + (j >> 1)) | (KVR_W(b + 2u + (j >> 1)) << 16);
        ivec4 q = ivec4(uvec4(p << 24, p << 16, p << 8, p)) >> 24;
        return vec4(q) * d;
    }
    // 4-bit and 5-bit types: value j < 16 is the low nibble of qs[j], j >= 16 the high
    // nibble of qs[j - 16]; the 5-bit types add bit j of qh as bit 4
    uint qs_at = KVR_T == KV_Q4_0 ? 1u : (KVR_T == KV_Q4_1 ? 2u : (KVR_T == KV_Q5_0 ? 3u : 4u));
    uint jl = j & 15u;
    uint p = KVR_W(b + qs_at + (jl >> 1)) | (KVR_W(b + qs_at + 1u + (jl >> 1)) << 16);
    uvec4 q = (uvec4(p, p >> 8, p >> 16, p >> 24) >> (j >= 16u ? 4u : 0u)) & 0xFu;
    if (KVR_T == KV_Q5_0 || KVR_T == KV_Q5_1) {
        uint hw = KVR_T == KV_Q5_0 ? 1u : 2u;
        uint qh = KVR_W(b + hw) | (KVR_W(b + hw + 1u) << 16);
        q |= ((uvec4(qh) >> uvec4(j, j + 1u, j + 2u, j + 3u)) & 1u) << 4;
    }
    if (KVR_T == KV_Q4_0) {
        return (vec4(q) - 8.0) * d;
    }
    if (KVR_T == KV_Q5_0) {
        return (vec4(q) - 16.0) * d;
    }
    float m = kv_half(KVR_W(b + 1u));
    precise vec4 dq = vec4(q) * d;
    precise vec4 r = dq + m;
    return r;
}

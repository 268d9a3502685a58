// One cache's eight-value reader, for kernels whose lanes split a row: KVR_LOAD8(row_w,
// e, a, b) sets a, b to the values [e, e + 4) and [e + 4, e + 8) of the row (or head)
// starting at 16-bit word row_w; e is a multiple of 8. Include after kv_read.glsl with
// the same KVR_* macros plus KVR_U4(i) (the cache's i-th uvec4: f16 and bf16 caches)
// and KVR_LOAD8 (the function's name).
//
// f16 and bf16 read 16 bytes at once (rows and heads start at multiples of 8 words
// when head_dim is a multiple of 8), f32 two vec4; a quantized type's eight values lie
// in one block of 32 and decode through KVR_LOAD4 (kv_read.glsl), so every type gives
// exactly the values the four-value reader gives.

void KVR_LOAD8(uint row_w, uint e, out vec4 a, out vec4 b) {
    if (KVR_T == KV_F32) {
        uint i = (row_w >> 3) + (e >> 2);
        a = KVR_F4(i);
        b = KVR_F4(i + 1u);
        return;
    }
    if (KVR_T == KV_F16) {
        uvec4 u = KVR_U4((row_w + e) >> 3);
        a = vec4(unpackHalf2x16(u.x), unpackHalf2x16(u.y));
        b = vec4(unpackHalf2x16(u.z), unpackHalf2x16(u.w));
        return;
    }
    if (KVR_T == KV_BF16) {
        uvec4 u = KVR_U4((row_w + e) >> 3);
        a = vec4(uintBitsToFloat(u.x << 16), uintBitsToFloat(u.x & 0xFFFF0000u),
                 uintBitsToFloat(u.y << 16), uintBitsToFloat(u.y & 0xFFFF0000u));
        b = vec4(uintBitsToFloat(u.z << 16), uintBitsToFloat(u.z & 0xFFFF0000u),
                 uintBitsToFloat(u.w << 16), uintBitsToFloat(u.w & 0xFFFF0000u));
        return;
    }
    a = KVR_LOAD4(row_w, e);
    b = KVR_LOAD4(row_w, e + 4u);
}

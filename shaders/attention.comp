#version 450
// Attention of one query head of one token over its own sequence's KV cache, flash
// style: keys in blocks of WG, an online softmax (running max m, running sum l, the
// output rescaled when m grows), so scores never leave the work group. Blocks past
// the token's position are never visited (fully masked), and only the last visited
// block, the one the position cuts, has dead lanes at all.
//
// Decode runs one work group per head, so what counts is latency, not throughput:
// each lane reads its key row as 128-bit loads, eight at a time. The value loop splits
// the work group into KG = WG / (head_dim / 4) key groups: a lane owns four output
// dimensions (one 128-bit load per key) for every KG-th key of the block, so a block
// of 64 keys is 16 loads per lane (head_dim 64) instead of 64; the key groups' partial
// sums are added once, at the end (the softmax scale m and sum l are the whole work
// group's, so the partials rescale alike).
//
// K and V are read in their cache types K_TYPE and V_TYPE (kv.glsl), dequantized
// here; position p of a sequence is at row p % n_ctx of its rows (a ring for a
// sliding-window cache). With n_swa > 0 a token at position pos sees only the
// positions [pos - n_swa + 1, pos] (gemma-3's sliding-window layers); 0 is causal.
// attn_decode.comp is the decode form (the sequence split over work groups).
#include "common.glsl"

#ifndef K_TYPE
#define K_TYPE 0
#endif
#ifndef V_TYPE
#define V_TYPE 0
#endif

layout(binding = 0, std430) readonly buffer Q { float q[]; };
layout(binding = 1, std430) readonly buffer K { vec4 kc4[]; };
layout(binding = 1, std430) readonly buffer K2 { uvec2 kc2[]; };
layout(binding = 1, std430) readonly buffer K16 { uint16_t kc16[]; };
layout(binding = 2, std430) readonly buffer V { vec4 vc4[]; };
layout(binding = 2, std430) readonly buffer V2 { uvec2 vc2[]; };
layout(binding = 2, std430) readonly buffer V16 { uint16_t vc16[]; };
layout(binding = 3, std430) writeonly buffer O { float o[]; };
DECLARE_STEP(4)

layout(push_constant) uniform Push {
    uint n_head;
    uint n_head_kv;
    uint head_dim;
    uint n_ctx;
    uint kv_dim;
    uint q_stride;
    uint o_stride;
    float scale;
    uint n_swa;  // sliding window (0: none)
} pc;

#include "reduce.glsl"
#include "kv.glsl"

#define KVR_T K_TYPE
#define KVR_W(i) uint(kc16[i])
#define KVR_F4(i) kc4[i]
#define KVR_U2(i) kc2[i]
#define KVR_LOAD4 k_load4
#include "kv_read.glsl"
#undef KVR_T
#undef KVR_W
#undef KVR_F4
#undef KVR_U2
#undef KVR_LOAD4
#define KVR_T V_TYPE
#define KVR_W(i) uint(vc16[i])
#define KVR_F4(i) vc4[i]
#define KVR_U2(i) vc2[i]
#define KVR_LOAD4 v_load4
#include "kv_read.glsl"

// head_dim / 4 <= WG: a lane owns four dims of the output; above that (MLA's latent
// rows, 576) one key group, each lane owning four dims in each of up to NA rounds
const uint MAX_HEAD_DIM = 768;
const uint NA = 3;  // rounds of four dims per lane when head_dim / 4 > WG (WG >= 64)

shared vec4 qs4[MAX_HEAD_DIM / 4];
shared float ps[WG];
shared vec4 part[WG];  // the key groups' partial outputs

// the row of position p: p itself unless the cache is a ring that has wrapped (no
// division on the common path)
uint ring_row(uint p) {
    if (p >= pc.n_ctx) {
        p = p % pc.n_ctx;
    }
    return p;
}

void main() {
    uint h = gl_WorkGroupID.x;
    uint t = gl_WorkGroupID.y;
    if (t >= step.n_tokens) {
        return;
    }
    uint tid = gl_LocalInvocationID.x;
    uint hd = pc.head_dim;
    uint hd4 = hd / 4u;  // head_dim is a multiple of 4 (checked at load)
    uint len = STEP_POS(t) + 1u;
    uint lo = pc.n_swa > 0u && len > pc.n_swa ? len - pc.n_swa : 0u;  // first visible position
    uint base = STEP_SEQ(t) * pc.n_ctx;
    uint kvh = h / (pc.n_head / pc.n_head_kv);
    uint k_row = kv_row_words(K_TYPE, pc.kv_dim);
    uint v_row = kv_row_words(V_TYPE, pc.kv_dim);
    uint k_head = kvh * kv_row_words(K_TYPE, hd);
    uint v_head = kvh * kv_row_words(V_TYPE, hd);
    uint qb = t * pc.q_stride + h * hd;
    for (uint d = tid; d < hd4; d += WG) {
        qs4[d] = vec4(q[qb + 4u * d], q[qb + 4u * d + 1u], q[qb + 4u * d + 2u], q[qb + 4u * d + 3u]) * pc.scale;
    }
    barrier();

    uint kg_n = max(1u, WG / hd4);  // key groups
    uint kg = tid / hd4;             // this lane's key group (>= kg_n: idle in the V loop)
    uint d4 = tid % hd4;             // and its four output dims
    bool vlane = kg < kg_n;

    bool wide = hd4 > WG;
    float m = -1.0e30;
    float l = 0.0;
    vec4 acc = vec4(0.0);
    vec4 accw[NA];
    [[unroll]] for (uint a = 0; a < NA; a++) {
        accw[a] = vec4(0.0);
    }
    for (uint b0 = lo; b0 < len; b0 += WG) {
        uint j = b0 + tid;
        bool live = j < len;
        float s = -1.0e30;
        if (live) {
            uint kb = (base + ring_row(j)) * k_row + k_head;
            vec4 dv = vec4(0.0);
            for (uint d0 = 0; d0 < hd4; d0 += 8u) {
                [[unroll]] for (uint i = 0; i < 8; i++) {
                    if (d0 + i < hd4) {
                        dv += qs4[d0 + i] * k_load4(kb, 4u * (d0 + i));
                    }
                }
            }
            s = dv.x + dv.y + dv.z + dv.w;
        }
        float mn = max(m, wg_max(s));
        float p = live ? exp(s - mn) : 0.0;
        ps[tid] = p;
        float corr = exp(m - mn);
        float lsum = wg_sum(p);  // its barriers also publish ps
        uint nvalid = min(WG, len - b0);
        acc *= corr;
        if (wide) {
            [[unroll]] for (uint a = 0; a < NA; a++) {
                uint dd = tid + a * WG;
                accw[a] *= corr;
                if (dd < hd4) {
                    for (uint jj = 0; jj < nvalid; jj++) {
                        accw[a] += ps[jj] * v_load4((base + ring_row(b0 + jj)) * v_row + v_head, 4u * dd);
                    }
                }
            }
        } else if (vlane) {
            // keys kg, kg + kg_n, ... of the block, four per round
            for (uint j0 = kg; j0 < nvalid; j0 += 4u * kg_n) {
                [[unroll]] for (uint i = 0; i < 4; i++) {
                    uint jj = j0 + i * kg_n;
                    if (jj < nvalid) {
                        acc += ps[jj] * v_load4((base + ring_row(b0 + jj)) * v_row + v_head, 4u * d4);
                    }
                }
            }
        }
        l = l * corr + lsum;
        m = mn;
        barrier();
    }
    if (wide) {
        [[unroll]] for (uint a = 0; a < NA; a++) {
            uint dd = tid + a * WG;
            if (dd < hd4) {
                vec4 sum = accw[a] / l;
                uint ob = t * pc.o_stride + h * hd + 4u * dd;
                o[ob] = sum.x;
                o[ob + 1u] = sum.y;
                o[ob + 2u] = sum.z;
                o[ob + 3u] = sum.w;
            }
        }
        return;
    }
    part[tid] = acc;
    barrier();
    if (tid < hd4) {
        vec4 sum = vec4(0.0);
        for (uint g = 0; g < kg_n; g++) {
            sum += part[g * hd4 + tid];
        }
        sum /= l;
        uint ob = t * pc.o_stride + h * hd + 4u * tid;
        o[ob] = sum.x;
        o[ob + 1u] = sum.y;
        o[ob + 2u] = sum.z;
        o[ob + 3u] = sum.w;
    }
}

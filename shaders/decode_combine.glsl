// The end of a split decode attention work group (attn_decode.comp, attn_decode2.comp):
// after it has written its partial output and its (m, l) to part[], it counts itself
// on the (token, head group) counter, and the last of the n_live splits to finish
// combines all of them into o:
//   M = max_s m_s,  L = sum_s l_s exp(m_s - M),  o = sum_s acc_s exp(m_s - M) / L,
// then resets the counter to 0 for the next dispatch. The partials and the counters
// are `coherent`; each work group's writes precede a memoryBarrierBuffer and a
// work-group barrier, and the count is taken after them, so the last one sees every
// other one's partial. Needs the includer's pc (n_head, n_split, head_dim, ml_off),
// GW, part[], counter[], o[], O_VAL (the value stored: the output gate's) and
// reduce.glsl; COMBINE_DV, if defined, is how many dims of each head to combine
// (attn_decode.comp's LATENT: the values' DV; otherwise all head_dim). Call from
// uniform control flow.

#ifndef COMBINE_DV
#define COMBINE_DV hd
#endif

const uint MAX_SPLIT = 256;
shared float split_w[MAX_SPLIT];  // the combine's per-split weights exp(m_s - M)
shared bool is_last;

void decode_combine(uint t, uint hgrp, uint h0, uint n_live) {
    uint tid = gl_LocalInvocationID.x;
    uint hd = pc.head_dim;
    uint pstride = pc.n_split * hd;  // floats between heads in part[]
    memoryBarrierBuffer();
    barrier();
    uint ci = t * (pc.n_head / GW) + hgrp;
    if (tid == 0u) {
        is_last = atomicAdd(counter[ci], 1u) == n_live - 1u;
    }
    barrier();
    if (!is_last) {
        return;
    }
    memoryBarrierBuffer();
    // per head: the lanes take the splits for M and L (each split's weight computed
    // once, into shared memory), then the output dimensions
    for (uint g = 0; g < GW; g++) {
        uint h = h0 + g;
        uint mb = pc.ml_off + (t * pc.n_head + h) * pc.n_split * 2u;
        float mx = -1.0e30;
        for (uint s = tid; s < n_live; s += WG) {
            mx = max(mx, part[mb + 2u * s]);
        }
        float M = wg_max(mx);
        float lsum = 0.0;
        for (uint s = tid; s < n_live; s += WG) {
            float w = exp(part[mb + 2u * s] - M);
            split_w[s] = w;
            lsum += part[mb + 2u * s + 1u] * w;
        }
        float L = wg_sum(lsum);  // its barriers also publish split_w
        uint pb = (t * pc.n_head + h) * pstride;
        for (uint d = tid; d < COMBINE_DV; d += WG) {
            float acc_d = 0.0;
            for (uint s = 0; s < n_live; s++) {
                acc_d += part[pb + s * hd + d] * split_w[s];
            }
            o[t * pc.o_stride + h * hd + d] = O_VAL(t, h, d, acc_d / L);
        }
        barrier();  // split_w is rewritten for the next head
    }
    if (tid == 0u) {
        counter[ci] = 0u;
    }
}

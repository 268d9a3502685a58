#version 450
// One token per live output row, drawn on the device by the host's chain
// (engine/sampling.py: top-k, min-p, top-p, temperature, then the draw), so that a
// decode step reads back token ids instead of a row of logits. The uniform number of
// each draw comes from the host (its seeded generator), so the same seed gives the
// same ids as the host chain. One work group per row:
//   0. the row's logit biases added in place (one invocation, in the host's order)
//   1. the maximum and its index (ties: the lower id); temperature <= 0 stops here
//   2. the top-k set: when k <= WG, the k-th largest of the invocations' own maxima is
//      a bound that at least k logits reach, and the logits >= it (a few more than k,
//      in practice) are gathered in shared memory and sorted: the first k are the set.
//      Otherwise (or when more than CMAX reach the bound) the k-th largest logit by an
//      8-bit radix select over order-preserving keys (shared-memory histograms), and
//      the logits >= it and >= max + log(min_p) are gathered
//   3. the candidates sorted by logit, ties by lower id (bitonic); min-p keeps a prefix
//   4. one invocation walks them: top-p's cut (mass over the top-k set), the tempered
//      softmax and the draw (the first candidate whose running sum exceeds u x sum)
// With FEED the drawn id becomes the row's next input token and its position moves on
// by one, so the next decode step of the same recorded graph can run without the host
// (every entry of such a step is one token: token index == output row).
#include "common.glsl"

#define CMAX 1024u
#define NBIAS 64u

layout(binding = 0, std430) buffer X { float x[]; };  // written: the biases
// per row (rows_cap of them) 8 words: temperature, top_k, top_p, min_p (float bits but
// top_k), the number of biases, 0, 0, 0; then per row NBIAS (token, bias bits) pairs;
// then n_steps x rows_cap uniform numbers in [0, 1)
layout(binding = 1, std430) readonly buffer P { uint prm[]; };
layout(binding = 2, std430) buffer R { uint ids[]; };  // [n_steps, rows_cap]
layout(binding = 3, std430) buffer StepW {
    uint n_tokens; uint n_out; uint cap; uint pad1; uint sdata[];
} stepw;

layout(push_constant) uniform Push {
    uint n;         // vocabulary
    uint stride;    // floats between rows of x
    uint j;         // which step of a multi-step submit (the u and ids index)
    uint rows_cap;
    uint feed;
} pc;

shared float bv[WG];
shared uint bi[WG];
shared uint hist[256];
shared uint sel_bin;
shared uint sel_rest;
shared uint n_cand;
shared float cv[CMAX];
shared uint ci[CMAX];
shared float zsum[WG];
shared float lm[WG];  // each invocation's own maximum
shared uint fast_ok;

uint okey(float v) {
    uint b = floatBitsToUint(v);
    return (b & 0x80000000u) != 0u ? ~b : (b | 0x80000000u);
}

bool before(float va, uint ia, float vb, uint ib) {
    return va > vb || (va == vb && ia < ib);
}

void emit(uint row, uint tok) {
    ids[pc.j * pc.rows_cap + row] = tok;
    if (pc.feed != 0u) {
        stepw.sdata[row] = tok;
        stepw.sdata[stepw.cap + row] += 1u;
    }
}

void main() {
    uint row = FLAT_GROUP;
    if (row >= stepw.n_out) {
        return;
    }
    uint tid = gl_LocalInvocationID.x;
    uint base = row * pc.stride;
    float temp = uintBitsToFloat(prm[8u * row]);
    uint top_k = prm[8u * row + 1u];
    float top_p = uintBitsToFloat(prm[8u * row + 2u]);
    float min_p = uintBitsToFloat(prm[8u * row + 3u]);
    uint n_bias = prm[8u * row + 4u];
    uint boff = 8u * pc.rows_cap + 2u * NBIAS * row;
    float u = uintBitsToFloat(prm[8u * pc.rows_cap + 2u * NBIAS * pc.rows_cap + pc.j * pc.rows_cap + row]);

    // 0. logit biases (-inf bans a token), serially: a token named twice adds twice
    if (n_bias > 0u) {
        if (tid == 0u) {
            for (uint b = 0u; b < n_bias; b++) {
                uint t = prm[boff + 2u * b];
                x[base + t] += uintBitsToFloat(prm[boff + 2u * b + 1u]);
            }
        }
        memoryBarrierBuffer();
        barrier();
    }

    // 1. maximum, lowest index among ties
    float best = -1.0 / 0.0;
    uint idx = 0xFFFFFFFFu;
    for (uint i = tid; i < pc.n; i += WG) {
        float v = x[base + i];
        if (v > best || idx == 0xFFFFFFFFu) {
            best = v;
            idx = i;
        }
    }
    bv[tid] = best;
    bi[tid] = idx;
    lm[tid] = best;
    barrier();
    for (uint s = WG / 2u; s > 0u; s >>= 1) {
        if (tid < s) {
            float ov = bv[tid + s];
            uint oi = bi[tid + s];
            if (oi != 0xFFFFFFFFu && (bi[tid] == 0xFFFFFFFFu || before(ov, oi, bv[tid], bi[tid]))) {
                bv[tid] = ov;
                bi[tid] = oi;
            }
        }
        barrier();
    }
    float top = bv[0];
    if (temp <= 0.0 || top_k == 1u) {
        if (tid == 0u) {
            emit(row, bi[0]);
        }
        return;
    }

    float thr_m = min_p > 0.0 ? top + log(min_p) : -1.0 / 0.0;
    // 2a. the bound from the invocations' maxima: sorted, descending
    bool fast = top_k <= WG;
    if (fast) {
        for (uint k = 2u; k <= WG; k <<= 1) {
            for (uint jj = k >> 1; jj > 0u; jj >>= 1) {
                uint o = tid ^ jj;
                if (o > tid) {
                    bool up = (tid & k) == 0u;
                    float a = lm[tid];
                    float b = lm[o];
                    if (up ? b > a : a > b) {
                        lm[tid] = b;
                        lm[o] = a;
                    }
                }
                barrier();
            }
        }
        float bound = lm[top_k - 1u];
        if (tid == 0u) {
            n_cand = 0u;
        }
        barrier();
        for (uint i = tid; i < pc.n; i += WG) {
            float v = x[base + i];
            if (v >= bound) {
                uint slot = atomicAdd(n_cand, 1u);
                if (slot < CMAX) {
                    cv[slot] = v;
                    ci[slot] = i;
                }
            }
        }
        barrier();
        if (tid == 0u) {
            fast_ok = n_cand <= CMAX ? 1u : 0u;
        }
        barrier();
        fast = fast_ok != 0u;
    }
    if (!fast) {
    // 2b. the key of the k-th largest value (top_k in 1..CMAX here: the host checks)
    uint prefix = 0u;
    uint mask = 0u;
    uint rest = top_k;
    for (int shift = 24; shift >= 0; shift -= 8) {
        for (uint b = tid; b < 256u; b += WG) {
            hist[b] = 0u;
        }
        barrier();
        for (uint i = tid; i < pc.n; i += WG) {
            uint kk = okey(x[base + i]);
            if ((kk & mask) == prefix) {
                atomicAdd(hist[(kk >> uint(shift)) & 255u], 1u);
            }
        }
        barrier();
        if (tid == 0u) {
            uint cum = 0u;
            uint chosen = 0u;
            for (int b = 255; b >= 0; b--) {
                uint h = hist[b];
                if (cum + h >= rest) {
                    chosen = uint(b);
                    break;
                }
                cum += h;
            }
            sel_bin = chosen;
            sel_rest = rest - cum;
        }
        barrier();
        prefix |= sel_bin << uint(shift);
        mask |= 255u << uint(shift);
        rest = sel_rest;
        barrier();
    }
    uint kth = prefix;  // candidates: okey(v) >= kth

    // 3. top-p's normaliser (every top-k candidate) and the gathered candidates
    if (tid == 0u) {
        n_cand = 0u;
    }
    barrier();
    float z = 0.0;
    for (uint i = tid; i < pc.n; i += WG) {
        float v = x[base + i];
        if (okey(v) >= kth) {
            z += exp(v - top);
            if (v >= thr_m) {
                uint slot = atomicAdd(n_cand, 1u);
                if (slot < CMAX) {
                    cv[slot] = v;
                    ci[slot] = i;
                }
            }
        }
    }
    zsum[tid] = z;
    barrier();
    for (uint s = WG / 2u; s > 0u; s >>= 1) {
        if (tid < s) {
            zsum[tid] += zsum[tid + s];
        }
        barrier();
    }
    }
    uint count = min(n_cand, CMAX);
    uint p2 = 1u;
    while (p2 < count) {
        p2 <<= 1;
    }
    for (uint i = count + tid; i < p2; i += WG) {
        cv[i] = -1.0 / 0.0;
        ci[i] = 0xFFFFFFFFu;
    }
    barrier();
    for (uint k = 2u; k <= p2; k <<= 1) {
        for (uint jj = k >> 1; jj > 0u; jj >>= 1) {
            for (uint i = tid; i < p2; i += WG) {
                uint o = i ^ jj;
                if (o > i) {
                    bool up = (i & k) == 0u;
                    bool sw = up ? before(cv[o], ci[o], cv[i], ci[i]) : before(cv[i], ci[i], cv[o], ci[o]);
                    if (sw) {
                        float tv = cv[i];
                        uint ti = ci[i];
                        cv[i] = cv[o];
                        ci[i] = ci[o];
                        cv[o] = tv;
                        ci[o] = ti;
                    }
                }
            }
            barrier();
        }
    }

    // 4. top-p's cut, the tempered softmax and the draw, in the host's order
    if (tid == 0u) {
        float zt = zsum[0];
        if (fast) {  // the first k are the top-k set; min-p keeps a prefix of them
            uint nk = min(top_k, count);
            zt = 0.0;
            uint nm = 0u;
            for (uint i = 0u; i < nk; i++) {
                zt += exp(cv[i] - top);
                if (cv[i] >= thr_m) {
                    nm = i + 1u;
                }
            }
            count = nm;
        }
        uint cut = count;
        if (top_p < 1.0) {
            float c = 0.0;
            for (uint i = 0u; i < count; i++) {
                c += exp(cv[i] - top);
                if (c / zt >= top_p) {
                    cut = i + 1u;
                    break;
                }
            }
        }
        float v0 = cv[0] / temp;
        float s = 0.0;
        for (uint i = 0u; i < cut; i++) {
            s += exp(cv[i] / temp - v0);
        }
        float target = u * s;
        float c = 0.0;
        uint pick = ci[cut - 1u];
        for (uint i = 0u; i < cut; i++) {
            c += exp(cv[i] / temp - v0);
            if (c > target) {
                pick = ci[i];
                break;
            }
        }
        emit(row, pick);
    }
}

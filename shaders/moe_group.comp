#version 450
// The prefill chunk's (token, expert) pairs grouped by expert, on the device, from the
// routing that moe_topk wrote (so a recorded graph serves every routing and nothing
// goes back to the host). One work group for the whole chunk:
//   1. count the pairs of each expert (shared atomics);
//   2. an exclusive scan over the experts of (pairs, tiles of BN pairs), packed in one
//      word (pairs < 65536, tiles < 65536);
//   3. the tile table: tile i = (first slot in the permutation, expert << 8 | pairs);
//   4. the permutation: pair p = c * k + j at the next free slot of its expert.
// Map layout (uint words): [0] live tiles, [PERM_OFF ..) the permutation (cap * k),
// [tiles_off ..) two words per tile. The order of the pairs within one expert depends
// on the atomics, but no output does: moe_matmul computes every (row, pair) the same
// way in any column of its tile.
#include "common.glsl"

layout(binding = 0, std430) readonly buffer R { float routes[]; };
layout(binding = 1, std430) buffer M { uint map[]; };
DECLARE_STEP(2)

layout(push_constant) uniform Push {
    uint n_expert;
    uint k;
    uint r_stride;   // floats between tokens of the routing (2k)
    uint tiles_off;  // word of the tile table
} pc;

const uint MAX_EXPERT = 512;
const uint PERM_OFF = 4;
const uint BN = 32;  // pairs per tile: moe_matmul.comp's BN
shared uint cnt[MAX_EXPERT];
shared uint scan[WG];

void main() {
    uint lid = gl_LocalInvocationID.x;
    uint np = step.n_tokens * pc.k;
    for (uint e = lid; e < MAX_EXPERT; e += WG) {
        cnt[e] = 0u;
    }
    barrier();
    for (uint p = lid; p < np; p += WG) {
        uint c = p / pc.k;
        atomicAdd(cnt[uint(routes[c * pc.r_stride + (p - c * pc.k)])], 1u);
    }
    barrier();
    // lane lid owns experts [lid * per, (lid + 1) * per)
    uint per = (pc.n_expert + WG - 1u) / WG;
    uint e0 = min(lid * per, pc.n_expert);
    uint e1 = min(e0 + per, pc.n_expert);
    uint own = 0u;
    for (uint e = e0; e < e1; e++) {
        own += cnt[e] + (((cnt[e] + BN - 1u) / BN) << 16);
    }
    scan[lid] = own;
    barrier();
    for (uint s = 1u; s < WG; s <<= 1) {  // inclusive Hillis-Steele scan
        uint a = lid >= s ? scan[lid - s] : 0u;
        barrier();
        scan[lid] += a;
        barrier();
    }
    uint ex = scan[lid] - own;
    if (lid == WG - 1u) {
        map[0] = scan[lid] >> 16;
    }
    uint off = ex & 0xFFFFu;
    uint tile = ex >> 16;
    for (uint e = e0; e < e1; e++) {
        uint n = cnt[e];
        for (uint s = 0u; s < n; s += BN) {
            map[pc.tiles_off + 2u * tile] = off + s;
            map[pc.tiles_off + 2u * tile + 1u] = (e << 8) | min(BN, n - s);
            tile++;
        }
        cnt[e] = off;  // now the expert's next free slot
        off += n;
    }
    barrier();
    for (uint p = lid; p < np; p += WG) {
        uint c = p / pc.k;
        uint slot = atomicAdd(cnt[uint(routes[c * pc.r_stride + (p - c * pc.k)])], 1u);
        map[PERM_OFF + slot] = p;
    }
}

// Shared by delta_prep.comp and delta_chunk.comp: the chunks (and runs) of a step, found
// from the step buffer alone. A run is one sequence's tokens in the step (a sequence
// appears at most once in a batch); a chunk is a run's tokens from its first token or
// a position that is a multiple of DC up to the next such. Work group k takes the k-th
// chunk (or run): the grid needs only as many groups as there can be chunks, not one
// per token, and a group finds its first token in O(n / WG + WG) steps.
#define DC 64

bool run_start(uint t) {
    return t == 0u || STEP_SEQ(t - 1u) != STEP_SEQ(t);
}

bool chunk_start(uint t) {
    return run_start(t) || STEP_POS(t) % DC == 0u;
}

shared uint k_count[WG];
shared uint k_found;

// The first token of the k-th chunk (chunks) or run (!chunks), n_tokens if there are
// fewer. Every invocation of the work group must call it (it has barriers).
uint kth_start(uint k, bool chunks) {
    uint lane = gl_LocalInvocationID.x;
    uint n = step.n_tokens;
    uint seg = (n + WG - 1u) / WG;
    uint lo = min(n, lane * seg), hi = min(n, lo + seg);
    uint cnt = 0u;
    for (uint t = lo; t < hi; t++) {
        if (chunks ? chunk_start(t) : run_start(t)) {
            cnt++;
        }
    }
    k_count[lane] = cnt;
    barrier();
    if (lane == 0u) {
        uint before = 0u;
        k_found = n;
        for (uint l = 0u; l < WG; l++) {
            if (before + k_count[l] > k) {
                uint want = k - before;
                for (uint t = min(n, l * seg); t < min(n, l * seg + seg); t++) {
                    if (chunks ? chunk_start(t) : run_start(t)) {
                        if (want == 0u) {
                            k_found = t;
                            break;
                        }
                        want--;
                    }
                }
                break;
            }
            before += k_count[l];
        }
    }
    barrier();
    return k_found;
}

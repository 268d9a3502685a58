// Work-group reductions: subgroup operations first, then one shared slot per subgroup.
// Call from uniform control flow only (they contain barriers).
shared float red_buf[64];

float wg_sum(float v) {
    float s = subgroupAdd(v);
    if (subgroupElect()) {
        red_buf[gl_SubgroupID] = s;
    }
    barrier();
    float r = 0.0;
    for (uint i = 0; i < gl_NumSubgroups; i++) {
        r += red_buf[i];
    }
    barrier();
    return r;
}

float wg_max(float v) {
    float s = subgroupMax(v);
    if (subgroupElect()) {
        red_buf[gl_SubgroupID] = s;
    }
    barrier();
    float r = red_buf[0];
    for (uint i = 1; i < gl_NumSubgroups; i++) {
        r = max(r, red_buf[i]);
    }
    barrier();
    return r;
}

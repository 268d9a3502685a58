// The k head of v head h in the delta-rule kernels: ggml's tiled broadcast (qwen35:
// h % n_k) or, with KH_DIV = n_v / n_k, the grouped one (qwen3next: each k head's v
// heads side by side, h / KH_DIV). Needs the push constants' n_k.
layout(constant_id = 9) const uint KH_DIV = 0;
#define K_HEAD(h) (KH_DIV != 0u ? (h) / KH_DIV : (h) % pc.n_k)

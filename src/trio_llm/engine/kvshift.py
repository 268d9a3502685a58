"""KV shifting for ``--cache-reuse N`` (llama-server's ``n_cache_reuse``).

When a new prompt shares with a slot's cache, after their common prefix, chunks of at
least N tokens that the cache holds further on, llama-server moves those cache cells to
their new positions instead of evaluating the tokens again: ``reuse_chunks`` is its
loop (server-context.cpp, ``n_cache_reuse``), greedy from the end of the common prefix.
A move only ever goes to a lower position (``dst <= src``).

Moving a position's K means rotating it by the position delta: RoPE is a rotation by
``pos * freq``, so ``rope(k, p + d) == rope_by(rope(k, p), d)``. llama.cpp does that in
``llama_kv_cache::build_rope_shift``: a quantized K is dequantized, rotated back by the
cache's Walsh-Hadamard rotation, roped by the delta, rotated forward and quantized
again; another type is roped in place (f16 computed in float, stored as f16). V does
not depend on the position and moves as it is (its bytes). Only the first ``n_rot``
values of a head rotate (partial RoPE); a layer whose K has no RoPE (NoPE) moves as is.

Only a memory that can shift may do this: every layer a full positional KV cache. A
sliding-window ring (``kv_swa``) and a recurrent state cannot (llama.cpp's
``llama_memory_can_shift`` is false for them too): such models keep plain prefix reuse.

The rotation runs here on the host, in numpy, for both backends (the Vulkan backend
reads the rows' bytes, shifts them here and writes them back): not a shader yet.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import attrs
import numpy as np

from trio_llm.engine.memory import LayerMemory
from trio_llm.graph import Graph, Node, rope_divisors
from trio_llm.model.kvtypes import hadamard


@attrs.frozen
class Move:
    """Cache positions ``[src, src + n)`` go to ``[dst, dst + n)``."""

    src: int
    dst: int
    n: int


def reuse_chunks(cache: Sequence[int], prompt: Sequence[int], n_past: int, n_min: int) -> tuple[int, list[Move]]:
    """llama-server's chunk reuse after a common prefix of ``n_past``: from there, the
    cache is scanned for runs matching the prompt at its current head; a run of at least
    ``n_min`` tokens is moved there (and both heads pass it), a shorter one is skipped
    by one cache position. Returns the positions then held and the moves, in order."""
    moves: list[Move] = []
    head_c = head_p = n_past
    while head_c < len(cache) and head_p < len(prompt):
        n = 0
        while head_c + n < len(cache) and head_p + n < len(prompt) and cache[head_c + n] == prompt[head_p + n]:
            n += 1
        if n >= n_min:
            moves.append(Move(head_c, head_p, n))
            n_past += n
            head_c += n
            head_p += n
        else:
            head_c += 1
    return n_past, moves


def can_shift(layers: Sequence[LayerMemory], recurrent: Sequence[LayerMemory]) -> bool:
    """Every layer a full positional KV cache (llama.cpp's ``llama_memory_can_shift``),
    and none a latent cache (``v_is_k``: its roped part is a slice of each row, which
    ``shift_k`` does not know how to find)."""
    return bool(layers) and not recurrent and all(m.kind == "kv" and not m.window and not m.v_is_k
                                                  for m in layers)


def k_ropes(graph: Graph) -> dict[int, Node | None]:
    """Each attention layer's RoPE node of its K input (None: K is not roped)."""
    made = {n.out.id: n for n in graph.nodes}
    out: dict[int, Node | None] = {}
    for il, att in graph.attention_layers().items():
        node = made.get(att.inputs[1].id)
        out[il] = node if node is not None and node.op == "rope" else None
    return out


def rope_factors(graph: Graph, weights: Mapping[str, np.ndarray]) -> dict[int, np.ndarray]:
    """The frequency factors of the K RoPE nodes that have them, by node output id."""
    out: dict[int, np.ndarray] = {}
    for node in k_ropes(graph).values():
        if node is not None and len(node.inputs) > 1:
            out[node.out.id] = np.asarray(weights[node.inputs[1].name], np.float32)
    return out


def shift_k(k: np.ndarray, delta: int, rope: Node | None, factors: np.ndarray | None, kb: int) -> np.ndarray:
    """Rows of a K cache ``k`` [n, n_kv * head_dim] (float32, as the cache holds them:
    Hadamard-rotated in blocks of ``kb`` when ``kb``), roped by ``delta`` positions."""
    if rope is None or delta == 0:
        return np.array(k, np.float32)
    hd = int(rope.attr("head_dim"))
    nr = int(rope.attrs.get("n_rot", hd))
    x = np.asarray(k, np.float32).reshape(len(k), -1, hd)  # [n, n_kv, hd]
    if kb:
        x = hadamard(x, kb)  # the rotation is its own inverse
    else:
        x = x.copy()
    half = nr // 2
    inv = rope.attr("theta") ** (-np.arange(half, dtype=np.float64) * 2.0 / nr)  # [half]
    if "yarn" in rope.attrs:  # YaRN: the forward's own per-frequency divisors
        angle = delta * inv / rope_divisors(rope, factors)  # [half]
    else:
        if factors is not None:
            inv = inv / factors.astype(np.float64)
        angle = delta * rope.attr("freq_scale") * inv  # [half]
    cos = np.broadcast_to(np.cos(angle).astype(np.float32), (len(x), half))
    sin = np.broadcast_to(np.sin(angle).astype(np.float32), (len(x), half))
    from trio_llm.engine.reference import apply_rope  # the forward's own rotation

    x[..., :nr] = apply_rope(x[..., :nr], cos, sin, rope.attr("mode"))
    if kb:
        x = hadamard(x, kb)
    return x.reshape(k.shape)

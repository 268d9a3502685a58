"""Memory as a property of each layer: what a layer keeps between steps, and whether
that can be cut back to a prefix.

Kinds today (both backends lay their buffers out from this plan):

- ``kv``: the full positional KV cache, ``n_ctx`` rows per sequence; any prefix of it is
  a valid cache of that prefix.
- ``kv_swa``: a sliding-window layer's cache, a ring of ``rows`` = window + the most
  tokens one forward pass writes per sequence (position p lives in row ``p % rows``), so
  a 1024-position window costs 1.5k rows at any context. A prefix is usable only while
  the ring still holds the window before its end.

- ``recurrent``: a gated delta-net layer's state (qwen35): per sequence, the short
  convolution's last inputs and the delta rule's matrix, the same size at any length.
  It holds the sequence at exactly the positions it has absorbed and cannot be cut back:
  a cached sequence continues only from all of itself (``plan_recurrent``), or from a
  checkpoint: a copy of the state taken at a position during prefill (llama-server's
  context checkpoints), which ``reusable_prefix`` is told about.

One sequence's recurrent state moves between backend, slot files and checkpoints as
one float32 vector in ``state_layout``'s order and shapes (numpy's layout; a backend
that keeps another converts on the way).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import attrs
import numpy as np

from trio_llm.graph import Graph

Kind = Literal["kv", "kv_swa", "recurrent"]


@attrs.frozen
class LayerMemory:
    layer: int
    kind: Kind
    rows: int  # cache rows per sequence
    window: int  # 0: full causal attention
    kv_dim: int  # values per row of K (and of V)
    #: V is the K cache itself (multi-head latent attention): one cache, K's type
    v_is_k: bool = False

    def row_of(self, pos: int) -> int:
        return pos % self.rows

    def reusable(self, n_cached: int, n_keep: int) -> bool:
        """Can a sequence whose cache holds positions ``[0, n_cached)`` continue at
        ``n_keep <= n_cached`` (overwriting from there)?"""
        if self.kind == "recurrent":
            return n_keep == n_cached
        if self.kind == "kv" or n_cached <= self.rows:
            return True
        # the next query (position n_keep) reads keys down to n_keep - window + 1; the
        # ring holds positions from n_cached - rows on
        return n_keep - self.window + 1 >= n_cached - self.rows


def plan_memory(graph: Graph, *, n_ctx: int, chunk: int) -> list[LayerMemory]:
    """One entry per layer with an attention node, in layer order. ``chunk`` is the most
    tokens of one sequence a forward pass writes (the ring must hold them and the window
    before them)."""
    out = []
    for il, node in sorted(graph.attention_layers().items()):
        window = int(node.attr("window"))
        kv_dim = int(node.attr("n_head_kv")) * int(node.attr("head_dim"))
        shared = bool(node.attrs.get("v_is_k", False))
        if window and window + chunk < n_ctx:
            out.append(LayerMemory(il, "kv_swa", window + chunk, window, kv_dim, shared))
        else:
            out.append(LayerMemory(il, "kv", n_ctx, window, kv_dim, shared))
    return out


def plan_recurrent(graph: Graph) -> list[LayerMemory]:
    """One entry per layer with recurrent state, in layer order."""
    return [LayerMemory(il, "recurrent", 0, 0, 0) for il in sorted(graph.recurrent_layers())]


def reusable_prefix(layers: Sequence[LayerMemory], n_cached: int, n_common: int,
                    checkpoints: Sequence[int] = ()) -> int:
    """The longest prefix (at most ``n_common``) of a cached sequence of ``n_cached``
    positions that every layer can continue from; 0 when some layer cannot.
    ``checkpoints``: positions at which a recurrent state was copied (the caller puts
    the copy back before continuing there when the answer is one of them and not
    ``n_cached``); the other layers must still allow the cut."""
    n = min(n_common, n_cached)
    for cut in [n, *sorted((c for c in checkpoints if 0 < c < n), reverse=True)]:
        if all(m.reusable(n_cached, cut) or (m.kind == "recurrent" and cut in checkpoints) for m in layers):
            return cut
    return 0


def state_layout(graph: Graph) -> list[tuple[int, tuple[int, ...]]]:
    """(node id, shape) of one sequence's recurrent state, node by node in graph order:
    a conv's last inputs ``[d_conv - 1, C]``, a delta rule's matrices ``[n_v, d (key),
    d (value)]``. Empty for a model without recurrent layers."""
    out: list[tuple[int, tuple[int, ...]]] = []
    for nodes in graph.recurrent_layers().values():
        for n in nodes:
            if n.op == "ssm_conv":
                out.append((n.out.id, (n.attr("d_conv") - 1, n.out.width)))
            else:
                d = n.attr("head_dim")
                out.append((n.out.id, (n.attr("n_v_heads"), d, d)))
    return out


def state_floats(graph: Graph) -> int:
    """Length of one sequence's state vector (``state_layout``)."""
    return sum(int(np.prod(shape)) for _, shape in state_layout(graph))

"""The interface every compute backend implements (numpy reference, Vulkan).

A backend is *synchronous* and single-threaded: exactly one task (the backend actor,
``trio_llm.engine.actor``) calls it, from a worker thread, one call at a time. It owns
the weights, a KV cache of ``n_seq`` independent sequences (one per server slot) of
``n_ctx`` positions each, and whatever buffers the forward pass needs.

The KV cache of sequence ``s`` holds valid entries for positions ``[0, pos0)`` when a
forward pass for ``s`` starts at ``pos0``; the pass writes positions
``[pos0, pos0 + len(tokens))`` and attends causally over ``[0, pos]`` for each token.
So truncating a sequence (prompt-cache reuse of a common prefix) needs no call: the
next pass simply starts at the shorter ``pos0`` and overwrites, once
``reusable_prefix`` has said every layer's memory kind allows it (a sliding-window
ring may have overwritten what a shorter prefix needs).

Residency (``release``/``restore``) moves device memory to a host shadow and back;
``memory()`` reports device bytes by category. The numpy backend has no device: it
reports host bytes as if they were device bytes and its release/restore only move
accounting (and drop/rebuild the KV arrays for level "all"), which keeps the server
and residency logic testable without Vulkan.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from enum import StrEnum
from typing import Protocol

import attrs
import numpy as np

from trio_llm.errors import ContextOverflow, InvalidRequest
from trio_llm.model.config import ModelConfig


class Level(StrEnum):
    """How much a release gives back (``--sleep-mode``)."""

    WEIGHTS = "weights"  # weights only; KV cache and compute buffers stay on the device
    ALL = "all"  # weights, KV cache (copied to host), compute and scratch buffers
    UNLOAD = "unload"  # everything, no host shadow: restore reloads from the GGUF file


#: categories of device memory, as reported by ``Backend.memory()`` and ``/props``
MEMORY_CATEGORIES = ("weights", "kv_cache", "compute", "scratch")


@attrs.frozen
class SeqBatch:
    """One sequence's share of a forward pass.

    ``embd`` (llama.cpp's ``llama_batch.embd``: an image's rows from a multimodal
    projector) replaces the token embeddings of *every* row of the entry by these rows,
    as they are (gemma3 scales token embeddings by sqrt(n_embd), never these); its
    ``tokens`` are then placeholders that only give the length (valid ids, e.g. zeros).
    Only a model whose graph has an ``embd_rows`` node takes them.

    ``causal=False`` (llama.cpp's ``llama_set_causal_attn(ctx, false)``, gemma3's image
    batches): every row of the entry attends to every position of its sequence in
    ``[0, pos0 + n)``, the rows of the entry after it included; a sliding window still
    hides keys ``window`` or more positions *before* the row's own position. The entry
    must run in one pass of the backend: one longer than the backend's pass (numpy's
    ``max_chunk``, Vulkan's largest bucket) is refused with ``InvalidRequest`` (llama.cpp
    requires such a batch to fit one ubatch), and so is any on a model with a latent or
    recurrent memory. Other entries of the same forward stay causal."""

    seq_id: int  # 0 .. n_seq-1 (the server's slot id)
    tokens: np.ndarray  # [n] int32 token ids (placeholders when embd is given)
    pos0: int  # position of tokens[0]; 0 <= pos0 and pos0 + n <= n_ctx
    embd: np.ndarray | None = None  # [n, n_embd] float32 rows in place of the token embeddings
    causal: bool = True  # False: each row also sees the entry's later rows


def check_batch(entries: Sequence[SeqBatch], *, n_seq: int, n_ctx: int, n_vocab: int, n_embd: int = 0) -> None:
    """The checks every backend's ``forward`` makes before touching its KV cache:
    typed errors for what a caller got wrong, never an index error deep inside.
    ``n_embd``: the width of the embedding rows the model's graph takes (``embd_rows``),
    0 when it takes none."""
    if not entries:
        raise InvalidRequest("empty batch")
    seen: set[int] = set()
    for e in entries:
        if e.embd is not None:
            _check_embd(e, n_embd)
        n = len(e.tokens)
        if not 0 <= e.seq_id < n_seq:
            raise InvalidRequest(f"seq_id {e.seq_id} outside 0..{n_seq - 1}")
        if e.seq_id in seen:
            raise InvalidRequest(f"seq_id {e.seq_id} appears twice in one batch")
        seen.add(e.seq_id)
        if n == 0:
            raise InvalidRequest(f"no tokens for seq_id {e.seq_id}")
        if e.pos0 < 0:
            raise InvalidRequest(f"negative pos0 {e.pos0}")
        if e.pos0 + n > n_ctx:
            raise ContextOverflow(e.pos0 + n, n_ctx)
        toks = np.asarray(e.tokens)
        if toks.min() < 0 or toks.max() >= n_vocab:
            raise InvalidRequest(f"token id outside 0..{n_vocab - 1}")


def check_uniform_kv(cfg: ModelConfig) -> None:
    """``read_kv``/``write_kv`` take one ``[n_layer, kv_parts, n, kv_dim]`` array: refuse
    a model whose caches differ by layer or are shared (gemma4)."""
    if not cfg.uniform_kv:
        raise InvalidRequest(f"reading or writing the KV cache of {cfg.arch} (caches of per-layer shapes) "
                             "is not supported")


def check_noncausal(entries: Sequence[SeqBatch], *, max_rows: int, refuse: str = "") -> None:
    """What a backend checks of the ``causal=False`` entries of a batch: each runs in
    one pass of at most ``max_rows`` rows; ``refuse``: why this model runs none."""
    for e in entries:
        if not e.causal:
            if refuse:
                raise InvalidRequest(refuse)
            if len(e.tokens) > max_rows:
                raise InvalidRequest(f"a non-causal entry of {len(e.tokens)} rows (seq_id {e.seq_id}) exceeds "
                                     f"this backend's pass of {max_rows} rows; it must run in one pass")


def _check_embd(e: SeqBatch, n_embd: int) -> None:
    if not n_embd:
        raise InvalidRequest("this model takes no embeddings input")
    x = e.embd
    if not isinstance(x, np.ndarray) or x.dtype != np.float32:
        raise InvalidRequest(f"embeddings of seq_id {e.seq_id} must be a float32 array")
    if x.shape != (len(e.tokens), n_embd):
        raise InvalidRequest(f"embeddings of seq_id {e.seq_id} are {list(x.shape)}, "
                             f"expected [{len(e.tokens)}, {n_embd}]")
    if not np.isfinite(x).all():
        raise InvalidRequest(f"embeddings of seq_id {e.seq_id} are not all finite")


#: progress callback while loading: (bytes done, bytes total)
Progress = Callable[[int, int], None]


class Backend(Protocol):
    name: str  # "numpy" or "vulkan"
    config: ModelConfig
    n_ctx: int  # positions per sequence
    n_seq: int  # independent sequences (slots)

    def forward(self, batch: Sequence[SeqBatch]) -> np.ndarray:
        """Run one forward pass over all entries (continuous batching).

        Returns ``[len(batch), n_vocab]`` float32: the logits of each entry's *last*
        token (for a backend built with ``output="embd"`` or ``"rank"``, that token's
        hidden state or rank scores instead). Must only be called while resident.
        """
        ...

    def forward_rows(self, entry: SeqBatch) -> np.ndarray:
        """The graph's result for *every* token of one sequence, ``[n, width]``: an
        embedding backend's (``output="embd"``) final-norm hidden states, for pooling
        ``mean``, ``cls`` and ``none``. Must only be called while resident."""
        ...

    def memory(self) -> dict[str, int]:
        """Device bytes held now, by category (keys: MEMORY_CATEGORIES)."""
        ...

    def reusable_prefix(self, n_cached: int, n_common: int, checkpoints: Sequence[int] = ()) -> int:
        """How much of a sequence caching ``n_cached`` positions a pass may continue
        from, given ``n_common`` tokens in common with the new prompt: every layer's
        memory kind must allow it (``engine/memory.py``; ``checkpoints``: positions whose
        recurrent state the caller holds and writes back first); 0 means start over."""
        ...

    def device_info(self) -> dict[str, object]:
        """Name, type and limits of the device, for the log and ``/props``."""
        ...

    def release(self, level: Level) -> None:
        """Give device memory back (see Level). Idempotent; the KV contents survive
        for WEIGHTS and ALL (copied to host for ALL), not for UNLOAD."""
        ...

    def restore(self) -> None:
        """Bring back what ``release`` gave away, so ``forward`` works again."""
        ...

    def read_kv(self, seq_id: int, n: int) -> np.ndarray:
        """The KV cache of positions 0..n-1 of sequence ``seq_id``:
        ``[n_layer, kv_parts, n, kv_dim]`` float32, a copy: K then V, or K alone for a
        latent cache (``ModelConfig.kv_parts`` 1). Only while resident."""
        ...

    def write_kv(self, seq_id: int, kv: np.ndarray) -> None:
        """Overwrite positions 0..n-1 of sequence ``seq_id`` with ``kv`` (``read_kv``'s
        shape). Only while resident."""
        ...

    def read_state(self, seq_id: int, raw: bool = False) -> np.ndarray:
        """Sequence ``seq_id``'s recurrent state (gated delta-net layers) as one float32
        vector in ``engine.memory.state_layout``'s order, a copy; empty for a model
        without recurrent layers. ``raw``: in the backend's own layout instead, cheaper,
        for ``write_state(raw=True)`` on this backend only. Only while resident."""
        ...

    def write_state(self, seq_id: int, state: np.ndarray, n_pos: int, raw: bool = False) -> None:
        """Overwrite sequence ``seq_id``'s recurrent state with ``read_state``'s vector
        (of the same ``raw``), taken after ``n_pos`` positions (the next pass continues
        at ``n_pos``). Only while resident."""
        ...

    def close(self) -> None:
        """Free everything. Safe in every residency state, and more than once."""
        ...

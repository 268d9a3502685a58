"""A slot's context checkpoints: copies of its recurrent state taken during prefill.

A gated delta-net layer's state holds a sequence at exactly the positions it absorbed
and cannot be cut back (``engine/memory.py``), so without help a new prompt that shares
only a prefix with the slot's last one is computed again from position 0. llama-server's
answer (``--ctx-checkpoints N``, ``--checkpoint-min-step N``, server-context.cpp) is to
copy the state at some positions while the prompt is processed and, for a later prompt,
to continue from the newest copy at or before the common prefix; the attention layers'
KV cache below that position is still the prefix's, since later writes only go above it.

Where copies are taken: one before the prompt's last token (``n_prompt - 1``: the same
prompt again, or one that extends the prompt but not the answer, e.g. a chat template
that renders the previous answer differently, continues there), and while a long
prompt is processed, every ``min_step`` positions past the previous copy (0: at the end
of every prompt piece). The prompt's pieces are cut at those positions, so each copy is
of exactly that position. At most ``most`` copies per slot are kept (the lowest position
goes first);
``most`` 0 turns it off. Copies beyond a new prompt's common prefix hold another
continuation and are dropped.

Plain data and synchronous methods; the slots loop does the device reads and writes.
"""

from __future__ import annotations

import attrs
import numpy as np


@attrs.define(eq=False)
class Checkpoints:
    most: int  # --ctx-checkpoints
    min_step: int  # --checkpoint-min-step
    _saved: list[tuple[int, np.ndarray]] = attrs.field(factory=list)  # (position, state), oldest first

    def positions(self) -> list[int]:
        return [p for p, _ in self._saved]

    def state_at(self, pos: int) -> np.ndarray:
        for p, state in self._saved:
            if p == pos:
                return state
        raise KeyError(pos)

    @property
    def n_bytes(self) -> int:
        return sum(s.nbytes for _, s in self._saved)

    def clear(self) -> None:
        self._saved = []

    def keep_upto(self, n: int) -> None:
        """Drop the copies past position ``n`` (a new sequence leaves the old one there)."""
        self._saved = [(p, s) for p, s in self._saved if p <= n]

    def next_stop(self, n_past: int, n_prompt: int) -> int | None:
        """Where the prompt piece starting at ``n_past`` must end, so that a copy is
        taken there; None: nowhere before the prompt's end."""
        if self.most <= 0:
            return None
        end = n_prompt - 1
        stops = [end]
        if self.min_step > 0:
            last = max((p for p in self.positions() if p <= n_past), default=0)
            nxt = last + self.min_step
            while nxt <= n_past:
                nxt += self.min_step
            stops.append(nxt)
        stops = [s for s in stops if n_past < s <= end]
        return min(stops) if stops else None

    def wanted(self, pos: int, n_prompt: int, stop: int | None) -> bool:
        """Take a copy now that the prompt has been absorbed up to ``pos``?"""
        if self.most <= 0 or pos <= 0 or pos >= n_prompt or pos in self.positions():
            return False
        return pos == stop or self.min_step == 0

    def add(self, pos: int, state: np.ndarray) -> None:
        self._saved = [(p, s) for p, s in self._saved if p != pos] + [(pos, state)]
        self._saved.sort(key=lambda ps: ps[0])
        while len(self._saved) > self.most:
            self._saved.pop(0)  # the oldest (lowest) position goes first

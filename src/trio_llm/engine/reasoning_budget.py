"""A thinking budget: llama.cpp's reasoning-budget sampler (``common/reasoning-budget.cpp``).

Between a start sequence (``<think>``) and an end sequence (``</think>``) a request may
generate at most ``budget`` tokens; then the end sequence (with an optional message
before it) is forced, one token a step, and generation goes on after it. The states:

- ``idle``: watching for a start sequence (a generation prompt that ends in one, fed
  as ``prefill``, starts the count at once);
- ``counting``: each token spends one of the budget; an end sequence the model writes
  itself ends the block (``done``); the last token of the budget moves to ``forcing``,
  unless it leaves a UTF-8 character unfinished (``waiting``: the next tokens finish it
  first, as llama.cpp does, so no broken character is left in the text);
- ``forcing``: the step's token is the next forced token, whatever the logits;
- ``done``: passthrough; a new start sequence counts again with a fresh budget.

Sequences are matched on token ids, each from the last match on (llama.cpp's
Aho-Corasick matcher resets after a match): a rolling window of the tokens since
the last match is enough for the few short sequences there are.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import attrs

IDLE, COUNTING, WAITING, FORCING, DONE = "idle", "counting", "waiting", "forcing", "done"


@attrs.frozen
class BudgetSpec:
    """One request's budget, with its sequences as token ids."""

    budget: int  # tokens inside the block; 0: the end is forced at once
    start: tuple[tuple[int, ...], ...]
    end: tuple[tuple[int, ...], ...]
    forced: tuple[int, ...]  # the message, then the first end sequence
    prefill: tuple[int, ...] = ()  # the generation prompt's tokens, fed before the first step
    #: reasoning_control: the thought may be ended at runtime (``force``), as llama-server's
    #: /v1/chat/completions/control
    control: bool = False


class _Matcher:
    """Which of ``seqs`` the tokens fed so far end with, counting from the last match."""

    def __init__(self, seqs: Sequence[Sequence[int]]) -> None:
        self.seqs = [tuple(s) for i, s in enumerate(seqs) if s and tuple(s) not in map(tuple, seqs[:i])]
        self.longest = max((len(s) for s in self.seqs), default=0)
        self.window: list[int] = []

    def advance(self, token: int) -> int:
        """The index of the sequence that ends here (the window restarts), else -1."""
        self.window.append(token)
        del self.window[: max(0, len(self.window) - self.longest)]
        for i, s in enumerate(self.seqs):
            if len(self.window) >= len(s) and tuple(self.window[-len(s):]) == s:
                self.window.clear()
                return i
        return -1

    def reset(self) -> None:
        self.window.clear()


class ReasoningBudget:
    """The state machine of one request (``spec``); ``utf8_complete(token)`` says whether
    a token's bytes end on a whole UTF-8 character."""

    def __init__(self, spec: BudgetSpec, utf8_complete: Callable[[int], bool]) -> None:
        self.spec = spec
        self._complete = utf8_complete
        self._start = _Matcher(spec.start)
        self._end = _Matcher(spec.end)
        self.state = IDLE
        self.remaining = spec.budget
        self.force_pos = 0
        for token in spec.prefill:
            self.accept(token)

    def forced(self) -> int | None:
        """The token this step must be, or None (sample as usual)."""
        if self.state == FORCING and self.force_pos < len(self.spec.forced):
            return self.spec.forced[self.force_pos]
        return None

    def _open(self) -> None:
        self.remaining = self.spec.budget
        self._end.reset()
        if self.remaining <= 0:
            self.state, self.force_pos = FORCING, 0
        else:
            self.state = COUNTING

    def force(self) -> bool:
        """End the thought now (llama.cpp's ``common_reasoning_budget_force``): only while
        counting; True when it was."""
        if self.state != COUNTING:
            return False
        self.state, self.force_pos = FORCING, 0
        self._end.reset()
        return True

    def accept(self, token: int) -> None:
        """A token of the answer (or of the prefill) was taken."""
        if self.state in (IDLE, DONE):
            if self._start.advance(token) >= 0:
                self._open()
            return
        if self.state == FORCING:
            self._end.advance(token)
            self.force_pos += 1
            if self.force_pos >= len(self.spec.forced):
                self.state = DONE
                self._start.reset()
            return
        # counting, or waiting for a character to finish
        if self._end.advance(token) >= 0:
            self.state = DONE
            self._start.reset()
            return
        complete = self._complete(token)
        if self.state == WAITING:
            if complete:
                self.state, self.force_pos = FORCING, 0
                self._end.reset()
            return
        self.remaining -= 1
        if self.remaining <= 0:
            self.state = FORCING if complete else WAITING
            self.force_pos = 0
            self._end.reset()


def utf8_complete(piece: bytes) -> bool:
    """Whether ``piece`` ends on a whole UTF-8 character (llama.cpp's
    ``common_utf8_is_complete``: the last lead byte's sequence is all there; four
    continuation bytes in a row are not)."""
    if not piece:
        return True
    for back in range(1, min(4, len(piece)) + 1):
        b = piece[-back]
        if b & 0xC0 != 0x80:
            need = 4 if b >= 0xF0 else 3 if b >= 0xE0 else 2 if b >= 0xC0 else 1
            return back >= need
    return False

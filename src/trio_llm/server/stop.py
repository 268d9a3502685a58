"""Stop strings over streamed text: pure functions.

A stop string may arrive split over several tokens, so while streaming we hold back
the end of the text whenever it could be the start of a stop string, and send it
only once the next tokens show it is not. A client therefore never sees any part of
a stop word, exactly as with llama-server.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs


def find_stop(text: str, stops: Sequence[str], start: int) -> tuple[int, str] | None:
    """The earliest complete stop string in ``text[start:]``: (index, word)."""
    best: tuple[int, str] | None = None
    for word in stops:
        i = text.find(word, start)
        if i >= 0 and (best is None or i < best[0]):
            best = (i, word)
    return best


def partial_stop_len(text: str, stops: Sequence[str]) -> int:
    """The length of the longest end of ``text`` that a stop string starts with."""
    longest = 0
    for word in stops:
        for n in range(min(len(word) - 1, len(text)), longest, -1):
            if word.startswith(text[len(text) - n :]):
                longest = n
                break
    return longest


@attrs.define
class StopScanner:
    """Generated text of one task: what was sent, what is held back, where it stops.

    ``feed`` returns the text that is now safe to send; after it reports a stop word,
    ``text`` is the final content (cut before the word).
    """

    stops: tuple[str, ...]
    text: str = ""
    n_sent: int = 0
    stopping_word: str = ""

    def feed(self, piece: str) -> str:
        self.text += piece
        if self.stops:
            # a stop cannot start inside sent text: its beginning would have been held
            found = find_stop(self.text, self.stops, self.n_sent)
            if found is not None:
                i, self.stopping_word = found
                self.text = self.text[:i]
                return self._take(len(self.text))
            return self._take(len(self.text) - partial_stop_len(self.text[self.n_sent :], self.stops))
        return self._take(len(self.text))

    def flush(self) -> str:
        """At the end of generation, whatever was held back is content after all."""
        return self._take(len(self.text))

    def _take(self, upto: int) -> str:
        out = self.text[self.n_sent : upto]
        self.n_sent = max(self.n_sent, upto)
        return out

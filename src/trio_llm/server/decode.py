"""When a step of the slots loop samples on the device, and for how many steps.

A pass in which every slot decodes one token, and every slot's chain is one the
device runs (``DeviceChain.of``: no grammar, no ``n_probs``, no penalties or bias),
goes to ``Backend.decode``: the backend samples, reads back token ids only, and may
run several steps in one submit, feeding each drawn id to the next step on the
device. The host then accepts the ids step by step; a slot that stops (end of
generation, a stop string, its limit) drops the ids drawn past its stop, whose KV
positions lie beyond what the slot keeps (only allowed where the backend says its
memory can be overwritten later: ``decode_steps_max``).

How many steps: the loop's ``decode_steps`` (more steps per submit: fewer host round
trips, but a new request, a cancellation or an arena yield waits up to that many
steps), no more than any slot's remaining ``n_predict`` or context allows, rounded
down to a power of two so that few graphs are recorded.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs

from trio_llm.engine.devsample import DeviceChain
from trio_llm.engine.sampling import SamplingParams

#: default decode steps per submit of the slots loop
DEFAULT_DECODE_STEPS = 4


@attrs.frozen
class DecodeWant:
    """What the choice needs to know of one slot of the pass."""

    params: SamplingParams
    constrained: bool  # a grammar masks its logits: host only
    pos0: int  # position of the token it feeds
    remaining: int  # tokens it may still generate (-1: no limit)


def device_plan(wants: Sequence[DecodeWant], *, n_vocab: int, n_ctx: int, steps: int,
                steps_max: int, rows_max: int) -> tuple[list[DeviceChain], int] | None:
    """The chains and step count of a device-sampled pass, or None for the host path."""
    if not wants or len(wants) > rows_max:
        return None
    chains: list[DeviceChain] = []
    n = max(1, min(steps, steps_max))
    for w in wants:
        chain = None if w.constrained else DeviceChain.of(w.params, n_vocab)
        if chain is None:
            return None
        chains.append(chain)
        if w.remaining >= 0:
            n = min(n, max(1, w.remaining))
        n = min(n, max(1, n_ctx - w.pos0))
    return chains, 1 << (n.bit_length() - 1)

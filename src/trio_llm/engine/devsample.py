"""Sampling on the device: which chains it runs, and the host reference it must equal.

A decode step that samples on the device reads back one token id per sequence instead
of a row of logits (513 KB for a 128k vocabulary), and the drawn id can be fed to the
next step on the device, so several steps run in one submit. The device runs the part
of the host chain (``engine/sampling.py``) that needs no per-token host state:
logit bias (``ignore_eos`` too), top-k, min-p, top-p and temperature, then the draw from a uniform number the host
drew from the request's seeded generator (``sampling.draw_u``). Everything else stays
on the host, and a slot asking for it takes the logits path: more than
``DEVICE_BIASES`` logit biases, the repetition penalties (they read the recent tokens), typical-p, grammar masks,
``n_probs``, top-k of 0 or above ``DEVICE_TOP_K`` (the device sorts its candidates in
shared memory), and llama.cpp's other samplers or another order
(``SamplingParams.host_only``).

``decode_steps`` is the reference of ``Backend.decode`` for any backend that only has
``forward`` (the numpy backend's ``decode`` is it): the same ids the device path must
give for the same uniform numbers.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import attrs
import numpy as np

from trio_llm.engine.backend import SeqBatch
from trio_llm.engine.sampling import SamplingParams, sample_u

#: the most candidates the device's sort holds (shaders/sample.comp CMAX)
DEVICE_TOP_K = 1024
#: the most logit biases a row carries to the device (sample.comp NBIAS); ``ignore_eos``
#: is one per end-of-generation token
DEVICE_BIASES = 64


@attrs.frozen
class DeviceChain:
    """One sequence's sampler on the device; ``us`` holds one uniform number per step."""

    temperature: float = 0.0  # <= 0: greedy (arg-max, ties to the lower id)
    top_k: int = 1
    top_p: float = 1.0
    min_p: float = 0.0
    bias: tuple[tuple[int, float], ...] = ()  # (token, bias) added first; -inf bans

    @classmethod
    def greedy(cls) -> DeviceChain:
        return cls()

    @classmethod
    def of(cls, params: SamplingParams, n_vocab: int) -> DeviceChain | None:
        """The device form of ``params``, or None when the host must sample."""
        if len(params.logit_bias) > DEVICE_BIASES or params.typical_p < 1.0 or params.n_probs > 0:
            return None
        if params.host_only:  # DRY, XTC, top-n-sigma, dynamic temperature, Mirostat, another order...
            return None
        if params.repeat_last_n != 0 and (params.repeat_penalty != 1.0 or params.presence_penalty != 0.0
                                          or params.frequency_penalty != 0.0):
            return None
        bias = tuple((int(t), float(b)) for t, b in params.logit_bias)
        if any(not 0 <= t < n_vocab for t, _ in bias):
            return None  # the host chain says what is wrong
        if params.greedy:
            return cls(bias=bias)
        k = params.top_k if 0 < params.top_k < n_vocab else n_vocab
        if k > DEVICE_TOP_K:
            return None
        return cls(float(params.temperature), k, float(params.top_p), float(params.min_p), bias)

    def params(self) -> SamplingParams:
        """The host chain this one equals (no penalties or typical-p)."""
        return SamplingParams(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p,
                              min_p=self.min_p, repeat_penalty=1.0, logit_bias=self.bias)


def decode_steps(
    forward: Callable[[Sequence[SeqBatch]], np.ndarray],
    batch: Sequence[SeqBatch],
    chains: Sequence[DeviceChain],
    us: np.ndarray,
) -> np.ndarray:
    """``Backend.decode`` from ``forward`` and the host chain: ``us`` [n_steps, B]
    uniform numbers; returns the ids [n_steps, B], each step's id fed to the next."""
    n_steps = us.shape[0]
    params = [c.params() for c in chains]
    out = np.empty((n_steps, len(batch)), np.int32)  # [n_steps, B]
    cur = list(batch)
    for j in range(n_steps):
        logits = forward(cur)  # [B, n_vocab]
        for r, row in enumerate(logits):
            out[j, r] = sample_u(row, params[r], float(us[j, r]))
        cur = [SeqBatch(e.seq_id, out[j, r : r + 1].copy(), e.pos0 + 1) for r, e in enumerate(cur)]
    return out


def check_decode(batch: Sequence[SeqBatch], chains: Sequence[DeviceChain], us: np.ndarray, n_ctx: int) -> None:
    """What every ``decode`` checks beyond ``check_batch``: one causal token per entry, a chain
    and a number per entry and step, and room for every step's position."""
    from trio_llm.errors import ContextOverflow, InvalidRequest

    if len(chains) != len(batch) or us.ndim != 2 or us.shape[1] != len(batch) or us.shape[0] < 1:
        raise InvalidRequest("decode needs one chain per entry and a [n_steps, entries] array of numbers")
    for e in batch:
        if len(e.tokens) != 1:
            raise InvalidRequest(f"decode takes one token per sequence, seq_id {e.seq_id} has {len(e.tokens)}")
        if e.embd is not None or not e.causal:
            raise InvalidRequest(f"decode takes causal token entries only, seq_id {e.seq_id} is not one "
                                 "(run embeddings and non-causal entries through forward)")
        if e.pos0 + us.shape[0] > n_ctx:
            raise ContextOverflow(e.pos0 + us.shape[0], n_ctx)

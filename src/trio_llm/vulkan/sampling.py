"""Decode steps that sample on the device: ``VulkanBackend.decode``'s graphs and buffers.

A sampled graph is a decode bucket's lowered ops without the logits copy, followed by
``sample.comp`` over the output rows; for ``n`` steps per submit the forward and the
sample repeat ``n`` times in one command buffer, each sample writing its ids to row
``j`` of the ids buffer and (but the last) feeding them to the step buffer as the next
input tokens at the next positions. The host then reads ``n x B`` token ids, and the
GPU never waits for the host between the steps of one submit.

Buffers: the chain parameters and uniform numbers (host-written, ``sample_params``)
and the ids (host-read, ``sample_ids``) are activations' extra buffers, so a release
frees them with the compute buffers and ``Graph.rebind`` moves these graphs to the new
ones by role like the plain graphs. Graphs are kept per (bucket, steps); the step
counts come from the caller, a handful of values (``decode_steps_choice``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import attrs
import numpy as np

from trio_llm.engine.devsample import DeviceChain
from trio_llm.vulkan.device import Device
from trio_llm.vulkan.forward import MATVEC_MAX_COLS, Activations
from trio_llm.vulkan.graph import Barrier, Copy, Graph, Op
from trio_llm.vulkan.memory import Buffer
from trio_llm.vulkan.ops import Ops

#: the most decode steps one submit runs (the ids and numbers buffers' rows)
MAX_STEPS = 16
ROWS = MATVEC_MAX_COLS


def extra_buffers() -> dict[str, tuple[int, str, str]]:
    """The activations' extra buffers the sampled graphs use: name -> (bytes,
    category, place)."""
    return {
        "sample_params": (4 * (4 * ROWS + MAX_STEPS * ROWS), "scratch", "upload"),
        "sample_ids": (4 * MAX_STEPS * ROWS, "scratch", "readback"),
    }


def chain_words(chains: Sequence[DeviceChain], us: np.ndarray, rows_cap: int) -> np.ndarray:
    """The parameter buffer's uint32 words: per row (temperature, top_k, top_p,
    min_p), then ``us`` [n_steps, rows] as rows of ``rows_cap``."""
    n_steps = us.shape[0]
    out = np.zeros(4 * rows_cap + n_steps * rows_cap, np.uint32)
    head = np.zeros((rows_cap, 4), np.float32)
    for r, c in enumerate(chains):
        head[r] = (c.temperature, 0.0, c.top_p, c.min_p)
    words = head.view(np.uint32)
    for r, c in enumerate(chains):
        words[r, 1] = c.top_k
    out[: 4 * rows_cap] = words.reshape(-1)
    u = np.zeros((n_steps, rows_cap), np.float32)
    u[:, : us.shape[1]] = us
    out[4 * rows_cap :] = u.view(np.uint32).reshape(-1)
    return out


@attrs.define(eq=False)
class DeviceSampler:
    """The sampled graphs of one backend; ``run`` is one decode submit."""

    device: Device
    ops: Ops
    act: Activations
    lowered: Callable[[int], list[Op]]  # the backend's graph of a bucket
    _graphs: dict[tuple[int, int], Graph] = attrs.field(factory=dict)
    recorded: int = 0

    def graph(self, bucket: int, n_steps: int) -> Graph:
        key = (bucket, n_steps)
        g = self._graphs.get(key)
        if g is None:
            g = self._graphs[key] = Graph.record(self.device, self.build(bucket, n_steps))
            self.recorded += 1
        return g

    def build(self, bucket: int, n_steps: int) -> list[Op]:
        body = self.lowered(bucket)
        copy = body[-1]
        assert isinstance(copy, Copy), "a lowered graph ends with its logits copy"
        body = body[:-1]
        logits = copy.src
        stride = self.act.n_vocab
        out: list[Op] = []
        for j in range(n_steps):
            out += body
            out.append(Barrier())
            out.append(self.ops.sample(logits, self.act.view("sample_params"), self.act.view("sample_ids"),
                                       self.act.view("step"), n=self.act.n_vocab, stride=stride, j=j,
                                       rows_cap=ROWS, feed=j + 1 < n_steps, cap=min(bucket, ROWS)))
            out.append(Barrier())
        return out

    def run(self, chains: Sequence[DeviceChain], us: np.ndarray) -> np.ndarray:
        """The step buffer holds the first step (one token per entry); returns the ids
        [n_steps, B]."""
        n_steps, n = us.shape
        params = self.act.bufs["sample_params"].array
        assert params is not None
        params.view(np.uint32)[: 4 * ROWS + n_steps * ROWS] = chain_words(chains, us, ROWS)
        bucket = 1 << max(0, (n - 1).bit_length())
        self.graph(bucket, n_steps).run("decode")
        ids = self.act.bufs["sample_ids"].array
        assert ids is not None
        return ids.view(np.uint32)[: n_steps * ROWS].reshape(n_steps, ROWS)[:, :n].astype(np.int32)

    def rebind(self, new: dict[Buffer, Buffer]) -> None:
        for g in self._graphs.values():
            g.rebind(new)

    def drop(self) -> None:
        graphs, self._graphs = self._graphs, {}
        for g in graphs.values():
            g.close()

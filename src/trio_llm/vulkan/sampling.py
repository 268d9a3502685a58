"""Decode steps that sample on the device: ``VulkanBackend.decode``'s graphs and buffers.

A sampled graph is a decode bucket's lowered ops without the logits copy, followed by
``sample.comp`` over the output rows; for ``n`` steps per submit the forward and the
sample repeat ``n`` times in one command buffer, each sample writing its ids to row
``j`` of the ids buffer and feeding them to the step buffer as the next input tokens
at the next positions. The host then reads ``n x B`` token ids, and the GPU never
waits for the host between the steps of one submit.

Look-ahead: with the uniform numbers of the call that will most likely come next
(the same sequences, going on where this one stops), ``run`` queues that submit too,
right behind this one, before it waits: the GPU goes on while the host accepts this
call's ids, and the next call, if it is that continuation, only waits for it. Each of
the two submits in flight has its lane: its own parameter and ids buffers, graphs and
fence. A call that is not the continuation (another batch, a prompt, a release: every
other backend entry point) first waits for what is in flight (``settle``) and drops
it; the positions it wrote lie past what any slot keeps, which is why the backend
allows more than one step only where the memory of every layer can be overwritten
later. The sampled graphs start with a barrier: across submits on one queue a
barrier's first scope covers the earlier submit's writes (the fed tokens).

Buffers: the parameters and numbers (host-written, ``sample_params<lane>``) and the
ids (host-read, ``sample_ids<lane>``) are activations' extra buffers, so a release
frees them with the compute buffers and ``Graph.rebind`` moves these graphs to the new
ones by role like the plain graphs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import attrs
import numpy as np

from trio_llm.engine.devsample import DEVICE_BIASES, DeviceChain
from trio_llm.vulkan.device import Device, _check, vk_errors
from trio_llm.vulkan.forward import MATVEC_MAX_COLS, Activations
from trio_llm.vulkan.graph import Barrier, Copy, Graph, Op
from trio_llm.vulkan.memory import Buffer
from trio_llm.vulkan.ops import Ops

#: the most decode steps one submit runs (the ids and numbers buffers' rows)
MAX_STEPS = 16
ROWS = MATVEC_MAX_COLS
LANES = 2


def extra_buffers() -> dict[str, tuple[int, str, str]]:
    """The activations' extra buffers the sampled graphs use: name -> (bytes,
    category, place)."""
    out = {}
    for lane in range(LANES):
        out[f"sample_params{lane}"] = (4 * param_words(ROWS, MAX_STEPS), "scratch", "upload")
        out[f"sample_ids{lane}"] = (4 * MAX_STEPS * ROWS, "scratch", "readback")
    return out


def param_words(rows_cap: int, n_steps: int) -> int:
    return 8 * rows_cap + 2 * DEVICE_BIASES * rows_cap + n_steps * rows_cap


def chain_words(chains: Sequence[DeviceChain], us: np.ndarray, rows_cap: int) -> np.ndarray:
    """The parameter buffer's uint32 words (sample.comp): per row 8 words (temperature,
    top_k, top_p, min_p, the number of biases), per row ``DEVICE_BIASES`` (token, bias)
    pairs, then ``us`` [n_steps, rows] as rows of ``rows_cap``."""
    n_steps = us.shape[0]
    out = np.zeros(param_words(rows_cap, n_steps), np.uint32)
    head = np.zeros((rows_cap, 8), np.float32)
    bias = np.zeros((rows_cap, DEVICE_BIASES, 2), np.float32)
    for r, c in enumerate(chains):
        head[r, :4] = (c.temperature, 0.0, c.top_p, c.min_p)
        for b, (_, val) in enumerate(c.bias):
            bias[r, b, 1] = val
    words = head.view(np.uint32)
    bwords = bias.view(np.uint32)
    for r, c in enumerate(chains):
        words[r, 1] = c.top_k
        words[r, 4] = len(c.bias)
        for b, (tok, _) in enumerate(c.bias):
            bwords[r, b, 0] = tok
    n_head = 8 * rows_cap + 2 * DEVICE_BIASES * rows_cap
    out[: 8 * rows_cap] = words.reshape(-1)
    out[8 * rows_cap : n_head] = bwords.reshape(-1)
    u = np.zeros((n_steps, rows_cap), np.float32)
    u[:, : us.shape[1]] = us
    out[n_head:] = u.view(np.uint32).reshape(-1)
    return out


Key = tuple[object, ...]


def call_key(seqs: Sequence[int], pos0: Sequence[int], tokens: Sequence[int], chains: Sequence[DeviceChain],
             us: np.ndarray) -> Key:
    """What identifies a decode call: a call with this key equals the submit queued
    ahead for it."""
    return (tuple(seqs), tuple(pos0), tuple(int(t) for t in tokens), tuple(chains), us.shape,
            np.ascontiguousarray(us, np.float32).tobytes())


@attrs.define(eq=False)
class _Flight:
    lane: int
    n_steps: int
    n_rows: int
    key: Key | None = None  # the call it answers (known for a look-ahead once its predecessor is read)


@attrs.define(eq=False)
class DeviceSampler:
    """The sampled graphs of one backend; ``run`` is one decode call."""

    device: Device
    ops: Ops
    act: Activations
    lowered: Callable[[int], list[Op]]  # the backend's graph of a bucket
    _graphs: dict[tuple[int, int, int], Graph] = attrs.field(factory=dict)
    _fences: list[Any] = attrs.field(factory=list)
    _submits: dict[int, Any] = attrs.field(factory=dict)  # id(graph) -> (VkSubmitInfo*, cmds)
    _ahead: _Flight | None = None
    recorded: int = 0
    resumed: int = 0  # calls answered by a submit queued ahead
    dropped: int = 0  # submits queued ahead that no call wanted

    def graph(self, bucket: int, n_steps: int, lane: int) -> Graph:
        key = (bucket, n_steps, lane)
        g = self._graphs.get(key)
        if g is None:
            g = self._graphs[key] = Graph.record(self.device, self.build(bucket, n_steps, lane))
            self.recorded += 1
        return g

    def build(self, bucket: int, n_steps: int, lane: int = 0) -> list[Op]:
        body = self.lowered(bucket)
        copy = body[-1]
        assert isinstance(copy, Copy), "a lowered graph ends with its logits copy"
        body = body[:-1]
        if body and isinstance(body[-1], Barrier):  # the copy's own barrier: the one below serves the sample
            body = body[:-1]
        out: list[Op] = [Barrier()]  # after the tokens an earlier submit fed
        for j in range(n_steps):
            out += body
            out.append(Barrier())
            out.append(self.ops.sample(copy.src, self.act.view(f"sample_params{lane}"),
                                       self.act.view(f"sample_ids{lane}"), self.act.view("step"),
                                       n=self.act.n_vocab, stride=self.act.n_vocab, j=j, rows_cap=ROWS,
                                       feed=True, cap=min(bucket, ROWS)))
            out.append(Barrier())
        return out

    def run(self, seqs: Sequence[int], pos0: Sequence[int], tokens: Sequence[int], chains: Sequence[DeviceChain],
            us: np.ndarray, ahead: np.ndarray | None, fill: Callable[[], None]) -> np.ndarray:
        """One decode call: ids [n_steps, B]. ``fill`` writes the step buffer for this
        call's first step (not called when a submit queued ahead answers it); with
        ``ahead`` [n2, B] the continuation's submit is queued before this one is
        waited for."""
        key = call_key(seqs, pos0, tokens, chains, us)
        n_steps, n = us.shape
        flight = self._ahead
        self._ahead = None
        if flight is not None and flight.key == key:
            self.resumed += 1
        else:
            if flight is not None:
                self._wait(flight)
                self.dropped += 1
            fill()
            flight = self._submit(0, chains, us)
        if ahead is not None and ahead.shape[0] >= 1:
            self._ahead = self._submit(1 - flight.lane, chains, ahead)
        self._wait(flight)
        ids_buf = self.act.bufs[f"sample_ids{flight.lane}"].array
        assert ids_buf is not None
        ids = ids_buf.view(np.uint32)[: n_steps * ROWS].reshape(n_steps, ROWS)[:, :n].astype(np.int32)
        if self._ahead is not None:
            self._ahead.key = call_key(seqs, [p + n_steps for p in pos0], ids[-1], chains, ahead)  # type: ignore[arg-type]
        return ids

    def settle(self) -> None:
        """Wait for a submit queued ahead and drop it (before any other use of the
        device's buffers)."""
        flight, self._ahead = self._ahead, None
        if flight is not None:
            self._wait(flight)
            self.dropped += 1

    def _submit(self, lane: int, chains: Sequence[DeviceChain], us: np.ndarray) -> _Flight:
        n_steps, n = us.shape
        params = self.act.bufs[f"sample_params{lane}"].array
        assert params is not None
        params.view(np.uint32)[: param_words(ROWS, n_steps)] = chain_words(chains, us, ROWS)
        bucket = 1 << max(0, (n - 1).bit_length())
        graph = self.graph(bucket, n_steps, lane)
        if graph.stale:
            graph.encode()
        vk = self.device.vk
        lib, ffi = vk.lib, vk.ffi
        if not self._fences:
            with vk_errors("create fences"):
                self._fences = [vk.vkCreateFence(self.device.handle, vk.VkFenceCreateInfo(), None)
                                for _ in range(LANES)]
        sub = self._submits.get(id(graph))
        if sub is None or sub[2] is not graph:
            cmds = ffi.new("VkCommandBuffer[1]", [graph.command_buffer])
            info = ffi.new("VkSubmitInfo*", {"sType": vk.VK_STRUCTURE_TYPE_SUBMIT_INFO, "commandBufferCount": 1,
                                             "pCommandBuffers": cmds})
            sub = self._submits[id(graph)] = (info, cmds, graph, ffi.new("VkFence[1]", [self._fences[lane]]))
        with vk_errors("decode"):
            _check(vk, lib.vkResetFences(self.device.handle, 1, sub[3]))
            _check(vk, lib.vkQueueSubmit(self.device.queue, 1, sub[0], self._fences[lane]))
        return _Flight(lane, n_steps, n)

    def _wait(self, flight: _Flight) -> None:
        vk = self.device.vk
        fence = vk.ffi.new("VkFence[1]", [self._fences[flight.lane]])
        with vk_errors("decode"):
            _check(vk, vk.lib.vkWaitForFences(self.device.handle, 1, fence, vk.VK_TRUE, 0xFFFFFFFFFFFFFFFF))

    def trim(self) -> None:
        """``Graph.trim`` on every sampling graph (release at level ``all``)."""
        for g in self._graphs.values():
            g.trim()

    def rebind(self, new: dict[Buffer, Buffer]) -> None:
        for g in self._graphs.values():
            g.rebind(new)

    def drop(self) -> None:
        """Close the graphs and fences (nothing may be in flight: ``settle`` first)."""
        self.settle()
        graphs, self._graphs = self._graphs, {}
        self._submits = {}
        for g in graphs.values():
            g.close()
        for f in self._fences:
            self.device.vk.vkDestroyFence(self.device.handle, f, None)
        self._fences = []

"""Sampling on the device (shaders/sample.comp) equals the host chain for the same numbers.

The host chain (``engine/sampling.py``) is the reference: for fixed seeds, every
parameter of the device's part of the chain (temperature, top-k, top-p, min-p, and
their combinations), on logits of several shapes, the device draws the same ids.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

from trio_llm.engine.devsample import DEVICE_TOP_K, DeviceChain
from trio_llm.engine.sampling import SamplingParams, draw_u, make_rng, sample, sample_u
from trio_llm.vulkan.device import shared_device
from trio_llm.vulkan.graph import Graph
from trio_llm.vulkan.kernels import KernelCache
from trio_llm.vulkan.memory import Allocator, View
from trio_llm.vulkan.ops import STEP_BYTES, STEP_CAP, STEP_HEADER, Ops, fill_step
from trio_llm.vulkan.sampling import chain_words, param_words

CHAINS = [
    DeviceChain.greedy(),
    DeviceChain(1.0, 40, 1.0, 0.0),  # top-k alone
    DeviceChain(0.8, 40, 0.95, 0.05),  # llama-server's defaults
    DeviceChain(1.5, 200, 0.9, 0.0),  # top-p cuts inside top-k
    DeviceChain(0.3, 1024, 1.0, 0.1),  # min-p cuts a wide top-k
    DeviceChain(1.0, 7, 0.5, 0.0),
    DeviceChain(2.0, 1, 1.0, 0.0),  # top-k 1: the arg-max at any temperature
    DeviceChain(0.7, 64, 0.2, 0.02),
    DeviceChain(0.0, 1, 1.0, 0.0, ((10, -np.inf), (20, -np.inf))),  # ignore_eos-style bans of the top two
    DeviceChain(0.8, 40, 0.95, 0.05, ((3, 4.0), (3, 4.0), (7, -np.inf), (11, -1.5))),  # a token named twice
]


class Env:
    def __init__(self) -> None:
        self.device = shared_device()
        self.alloc = Allocator(self.device)
        self.kernels = KernelCache(self.device)
        self.ops = Ops(self.kernels, subgroup=self.device.limits.subgroup_size)

    def buf(self, nbytes: int, place: str = "upload") -> View:
        return View(self.alloc.create(nbytes, "scratch", place), 0, nbytes)

    def close(self) -> None:
        self.kernels.close()
        self.alloc.free_all()


@pytest.fixture(scope="module")
def env() -> Iterator[Env]:
    e = Env()
    yield e
    e.close()


def words(v: View) -> np.ndarray:
    assert v.buffer.array is not None
    return v.buffer.array[v.offset : v.offset + v.size].view(np.uint32)


def run_device(env: Env, logits: np.ndarray, chains: list[DeviceChain], us: np.ndarray,
               feed: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """ids [n_steps, rows] of one dispatch per step over the same logits (a copy each:
    the biases are added in place), and the step buffer's words after them."""
    rows, n = logits.shape
    n_steps = us.shape[0]
    xs = [env.buf(logits.nbytes) for _ in range(n_steps)]
    for x in xs:
        words(x)[:] = logits.view(np.uint32).reshape(-1)
    prm = env.buf(4 * param_words(rows, n_steps))
    words(prm)[:] = chain_words(chains, us, rows)
    ids = env.buf(4 * n_steps * rows, "readback")
    st = env.buf(STEP_BYTES)
    fill_step(words(st), np.arange(rows, dtype=np.uint32) + 5, np.arange(rows, dtype=np.uint32) + 100,
              np.arange(rows, dtype=np.uint32), np.arange(rows, dtype=np.uint32))
    from trio_llm.vulkan.graph import Barrier

    ops = []
    for j in range(n_steps):
        ops += [env.ops.sample(xs[j], prm, ids, st, n=n, stride=n, j=j, rows_cap=rows, feed=feed, cap=rows), Barrier()]
    graph = Graph.record(env.device, ops)
    try:
        graph.run("test")
    finally:
        graph.close()
    return words(ids).reshape(n_steps, rows).copy(), words(st).copy()


@pytest.mark.vulkan
@pytest.mark.parametrize("n_vocab", [1024, 32000, 3001])
def test_device_chain_equals_host(env: Env, n_vocab: int) -> None:
    rng = np.random.default_rng(n_vocab)
    rows = len(CHAINS)
    # logits of a trained model's spread, with a peaked row and ties at the top
    logits = (rng.standard_normal((rows, n_vocab)) * 3).astype(np.float32)
    logits[3, :50] += 8.0
    logits[5, [10, 20]] = logits[5].max() + 1.0
    logits[8, [10, 20]] = logits[8].max() + 1.0
    n_steps = 16
    gen = make_rng(42)
    us = np.array([[draw_u(c.params(), gen) for c in CHAINS] for _ in range(n_steps)], np.float32)
    got, _ = run_device(env, logits, CHAINS, us)
    want = np.array([[sample_u(logits[r], c.params(), float(us[j, r])) for r, c in enumerate(CHAINS)]
                     for j in range(n_steps)])
    np.testing.assert_array_equal(got, want)
    assert len(set(got[:, 2].tolist())) > 1  # the sampled rows do draw different tokens


@pytest.mark.vulkan
def test_top_k_beyond_the_gathered_bound_takes_the_radix_select(env: Env) -> None:
    """A 128k vocabulary, top-k 250: the invocations' maxima bound more candidates than
    shared memory holds, so the k-th largest comes from the radix select instead; and
    top-k 300 (more than the work group's invocations) always does."""
    rng = np.random.default_rng(7)
    logits = rng.standard_normal((3, 131072)).astype(np.float32)
    logits[0, ::256] += 6.0  # one invocation holds the 512 best: 1406 logits reach the 250th maximum
    chains = [DeviceChain(1.0, 250, 1.0, 0.0), DeviceChain(0.9, 300, 0.8, 0.0), DeviceChain(1.2, 40, 0.95, 0.05)]
    gen = make_rng(5)
    us = np.array([[draw_u(c.params(), gen) for c in chains] for _ in range(6)], np.float32)
    got, _ = run_device(env, logits, chains, us)
    want = np.array([[sample_u(logits[r], c.params(), float(us[j, r])) for r, c in enumerate(chains)]
                     for j in range(6)])
    np.testing.assert_array_equal(got, want)


@pytest.mark.vulkan
def test_device_draws_follow_the_seeded_host_generator(env: Env) -> None:
    """A slot's whole sequence of draws: the host generator's numbers, in order, give the
    same ids on the device as ``sample`` gives with that seed."""
    rng = np.random.default_rng(3)
    logits = (rng.standard_normal((1, 4096)) * 2).astype(np.float32)
    params = SamplingParams(seed=7)  # llama-server's defaults
    chain = DeviceChain.of(params, 4096)
    assert chain is not None
    gen = make_rng(7)
    us = np.array([[draw_u(params, gen)] for _ in range(32)], np.float32)
    got, _ = run_device(env, logits, [chain], us)
    host_rng = make_rng(7)
    want = [sample(logits[0], params, host_rng) for _ in range(32)]
    assert got[:, 0].tolist() == want


@pytest.mark.vulkan
def test_feed_moves_the_step_on(env: Env) -> None:
    logits = np.zeros((2, 64), np.float32)
    logits[0, 9] = logits[1, 33] = 1.0
    ids, st = run_device(env, logits, [DeviceChain.greedy()] * 2, np.zeros((3, 2), np.float32), feed=True)
    assert ids.tolist() == [[9, 33]] * 3
    h = STEP_HEADER
    assert st[h : h + 2].tolist() == [9, 33]  # the next input tokens
    assert st[h + STEP_CAP : h + STEP_CAP + 2].tolist() == [103, 104]  # positions 100, 101 moved on thrice


def test_device_chain_eligibility() -> None:
    assert DeviceChain.of(SamplingParams(temperature=0.0), 1000) == DeviceChain.greedy()
    assert DeviceChain.of(SamplingParams(), 128256) == DeviceChain(0.8, 40, 0.95, 0.05)
    assert DeviceChain.of(SamplingParams(top_k=0), 1000) == DeviceChain(0.8, 1000, 0.95, 0.05)
    # what the device does not do stays on the host
    assert DeviceChain.of(SamplingParams(top_k=0), 128256) is None
    assert DeviceChain.of(SamplingParams(top_k=DEVICE_TOP_K + 1), 128256) is None
    assert DeviceChain.of(SamplingParams(repeat_penalty=1.1), 1000) is None
    assert DeviceChain.of(SamplingParams(presence_penalty=0.5), 1000) is None
    assert DeviceChain.of(SamplingParams(repeat_penalty=1.1, repeat_last_n=0), 1000) is not None
    assert DeviceChain.of(SamplingParams(logit_bias=((3, 1.0),)), 1000) == DeviceChain(0.8, 40, 0.95, 0.05,
                                                                                       ((3, 1.0),))
    assert DeviceChain.of(SamplingParams(logit_bias=tuple((t, -np.inf) for t in range(65))), 1000) is None
    assert DeviceChain.of(SamplingParams(typical_p=0.9), 1000) is None
    assert DeviceChain.of(SamplingParams(n_probs=2), 1000) is None

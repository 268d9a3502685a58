"""Prefix reuse asks each layer's memory kind: a sliding-window ring reuses a prefix only
while it still holds the window before the prefix's end (the queue and slots loop with
the real numpy backend on tiny-gemma3, whose window is 16)."""

from __future__ import annotations

import numpy as np
import trio

from test_server_slots import collect, make_rig
from trio_llm.server.tasks import TaskFinal


async def _answer(r, prompt: list[int]) -> TaskFinal:  # type: ignore[no-untyped-def]
    t, recv = r.task(prompt, n_predict=4, ban_eog=True)
    await r.queue.post(t)
    (final,) = await collect(recv)
    assert isinstance(final, TaskFinal)
    return final


async def test_a_ring_reuses_a_prefix_it_still_holds_and_recomputes_one_it_lost(
    model_path, nursery: trio.Nursery
) -> None:  # type: ignore[no-untyped-def]
    path = model_path("tiny-gemma3", "Q8_0")
    r = await make_rig(path, nursery, n_seq=1, n_ctx=2048)
    rows = [m.rows for m in r.backend.layers]
    assert rows[:5] == [16 + 512] * 5 and rows[5] == 2048  # -b 512 past a window of 16
    rng = np.random.default_rng(5)
    long = [int(t) for t in rng.integers(10, 1000, 700)]
    await _answer(r, long)  # the slot now caches 703 positions; the rings hold 175..702
    near = long[:400] + [int(t) for t in rng.integers(10, 1000, 20)]
    far = long[:100] + [int(t) for t in rng.integers(10, 1000, 20)]
    got_near = await _answer(r, near)
    assert got_near.timings.cache_n == 400  # continuing at 400 reads keys 385..399: still held
    await _answer(r, long)  # reuses the 400 again, and caches 703 positions once more
    got_far = await _answer(r, far)
    assert got_far.timings.cache_n == 0  # keys 85..99 were overwritten: recomputed
    # both equal a slot that starts from nothing
    fresh = await make_rig(path, nursery, n_seq=1, n_ctx=2048)
    assert (await _answer(fresh, near)).tokens == got_near.tokens
    fresh2 = await make_rig(path, nursery, n_seq=1, n_ctx=2048)
    assert (await _answer(fresh2, far)).tokens == got_far.tokens

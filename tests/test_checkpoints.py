"""Context checkpoints of hybrid models (``server/checkpoints.py``): where copies of the
recurrent state are taken during prefill and which one a new prompt continues from
(``engine.memory.reusable_prefix``), as plain data; through the slots loop on the numpy
backend, the answers equal those computed from nothing and ``cache_n`` says what was
reused."""

from __future__ import annotations

import numpy as np
import trio

from test_server_slots import answer, make_rig
from trio_llm.engine.memory import LayerMemory, reusable_prefix
from trio_llm.server.checkpoints import Checkpoints


def test_where_checkpoints_are_taken_and_kept() -> None:
    ck = Checkpoints(most=3, min_step=4)
    # a 30-token prompt in pieces: stops every 4 positions, and before the last token
    assert ck.next_stop(0, 30) == 4
    ck.add(4, np.zeros(1, np.float32))
    assert ck.next_stop(4, 30) == 8 and ck.next_stop(27, 30) == 28 and ck.next_stop(28, 30) == 29 and ck.next_stop(29, 30) is None
    assert ck.wanted(8, 30, 8) and not ck.wanted(7, 30, 8) and not ck.wanted(4, 30, 8)  # 4: already there
    for p in (8, 12, 16):
        ck.add(p, np.full(1, p, np.float32))
    assert ck.positions() == [8, 12, 16]  # at most 3: the lowest went
    ck.keep_upto(13)
    assert ck.positions() == [8, 12] and ck.state_at(12)[0] == 12
    # min_step 0: a copy after every prompt piece; only the one before the last token is a stop
    every = Checkpoints(most=8, min_step=0)
    assert every.next_stop(0, 30) == 29 and every.wanted(17, 30, 29)
    assert Checkpoints(most=0, min_step=4).next_stop(0, 30) is None  # off


def test_a_recurrent_layer_continues_from_a_checkpoint_the_kv_layers_allow() -> None:
    layers = [LayerMemory(0, "recurrent", 0, 0, 0), LayerMemory(1, "kv", 64, 0, 8)]
    assert reusable_prefix(layers, 30, 18) == 0
    assert reusable_prefix(layers, 30, 18, [4, 16, 24]) == 16  # the newest at or before the common prefix
    assert reusable_prefix(layers, 30, 30, [16]) == 30  # the whole cached sequence needs none
    assert reusable_prefix(layers, 30, 3, [4, 16]) == 0
    ring = [LayerMemory(0, "recurrent", 0, 0, 0), LayerMemory(1, "kv_swa", 20, 8, 8)]
    # the ring holds positions 10-29: a continuation at 18 reads 11 on, one at 16 would need 9
    assert reusable_prefix(ring, 30, 19, [18]) == 18 and reusable_prefix(ring, 30, 19, [16]) == 0


async def test_a_prompt_sharing_a_prefix_continues_from_the_newest_checkpoint(model_path,
                                                                               nursery: trio.Nursery) -> None:  # type: ignore[no-untyped-def]
    path = model_path("tiny-qwen35", "Q8_0")
    rng = np.random.default_rng(3)
    first = [int(t) for t in rng.integers(10, 1000, 30)]
    second = first[:18] + [int(t) for t in rng.integers(10, 1000, 7)]
    r = await make_rig(path, nursery, n_seq=1, n_ctx=128, checkpoint_min_step=4)
    a1 = await answer(r, first)
    ck = r.slots._slots[0].checkpoints
    assert ck is not None and ck.positions() == [4, 8, 12, 16, 20, 24, 28, 29]
    a2 = await answer(r, second)
    assert a2.timings.cache_n == 16  # the newest copy at or before the 18 shared tokens
    assert ck.positions() == [4, 8, 12, 16, 20, 24]  # 20 and 24 again, of the second prompt now
    again = await answer(r, first)
    assert again.timings.cache_n == 16 and again.tokens == a1.tokens
    same = await answer(r, first)  # the same prompt once more: from the copy before its last token
    assert same.timings.cache_n == 29 and same.tokens == a1.tokens
    assert (await answer(r, first[:3] + [7, 8, 9])).timings.cache_n == 0
    fresh = await make_rig(path, nursery, n_seq=1, n_ctx=128, ctx_checkpoints=0)
    assert (await answer(fresh, second)).tokens == a2.tokens
    assert fresh.slots._slots[0].checkpoints is None


async def test_a_checkpoint_chosen_for_a_task_that_left_before_its_pass_is_still_restored(
    model_path, nursery: trio.Nursery
) -> None:  # type: ignore[no-untyped-def]
    """A task takes the slot (``begin`` picks the checkpoint at 16) and goes away before
    any pass (``reset``, as a cancellation does): the slot reports 16 cached tokens while
    the state still stands at the old sequence's end, so the next task must still get
    the checkpoint written back, not continue from the wrong state."""
    path = model_path("tiny-qwen35", "Q8_0")
    rng = np.random.default_rng(3)
    first = [int(t) for t in rng.integers(10, 1000, 30)]
    second = first[:18] + [int(t) for t in rng.integers(10, 1000, 7)]
    r = await make_rig(path, nursery, n_seq=1, n_ctx=128, checkpoint_min_step=4)
    await answer(r, first)
    slot = r.slots._slots[0]
    gone, _ = r.task(second)
    slot.begin(gone, r.tok.stream_decoder(), 0.0, 99)
    assert slot.n_past == 16 and slot.restore_at == 16
    slot.reset()
    got = await answer(r, second)
    assert got.timings.cache_n == 16
    fresh = await make_rig(path, nursery, n_seq=1, n_ctx=128, ctx_checkpoints=0)
    assert (await answer(fresh, second)).tokens == got.tokens

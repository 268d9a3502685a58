"""Prefix reuse asks each layer's memory kind: a sliding-window ring reuses a prefix only
while it still holds the window before the prefix's end (the queue and slots loop with
the real numpy backend on tiny-gemma3, whose window is 16)."""

from __future__ import annotations

import numpy as np
import trio

from test_server_slots import answer, make_rig


async def test_a_ring_reuses_a_prefix_it_still_holds_and_recomputes_one_it_lost(
    model_path, nursery: trio.Nursery
) -> None:  # type: ignore[no-untyped-def]
    path = model_path("tiny-gemma3", "Q8_0")
    r = await make_rig(path, nursery, n_seq=1, n_ctx=2048)
    rows = [m.rows for m in r.backend.layers]
    assert rows[:5] == [16 + 512] * 5 and rows[5] == 2048  # -b 512 past a window of 16
    rng = np.random.default_rng(5)
    long = [int(t) for t in rng.integers(10, 1000, 700)]
    await answer(r, long)  # the slot now caches 703 positions; the rings hold 175..702
    near = long[:400] + [int(t) for t in rng.integers(10, 1000, 20)]
    far = long[:100] + [int(t) for t in rng.integers(10, 1000, 20)]
    got_near = await answer(r, near)
    assert got_near.timings.cache_n == 400  # continuing at 400 reads keys 385..399: still held
    await answer(r, long)  # reuses the 400 again, and caches 703 positions once more
    got_far = await answer(r, far)
    assert got_far.timings.cache_n == 0  # keys 85..99 were overwritten: recomputed
    # both equal a slot that starts from nothing
    fresh = await make_rig(path, nursery, n_seq=1, n_ctx=2048)
    assert (await answer(fresh, near)).tokens == got_near.tokens
    fresh2 = await make_rig(path, nursery, n_seq=1, n_ctx=2048)
    assert (await answer(fresh2, far)).tokens == got_far.tokens


async def test_serve_takes_cache_types_and_reports_their_bytes(model_path) -> None:  # type: ignore[no-untyped-def]
    """``-ctk q8_0 -ctv q8_0`` (llama-swap's Qwen lines): the log and ``/props`` give
    the types and bytes per token, an f16 default costs twice as much, and a bad type is
    one line and exit 2."""
    import subprocess
    import sys

    import httpx

    from serve_procs import wait_ready

    path = model_path("tiny-gemma3", "Q8_0")
    serve = [sys.executable, "-m", "trio_llm", "serve", "-m", str(path), "--port", "0", "-c", "4096",
             "--backend", "numpy", "--no-warmup"]
    seen = {}
    for flags in (["-ctk", "q8_0", "-ctv", "q8_0"], []):
        proc = await trio.lowlevel.open_process([*serve, *flags], stderr=subprocess.PIPE)
        try:
            url, log = await wait_ready(proc, 90)
            async with httpx.AsyncClient(base_url=url) as http:
                props = (await http.get("/props")).json()
            dev = props["device"]
            seen[tuple(flags)] = dev["kv_bytes_per_token"]
            kind = "q8_0" if flags else "f16"
            assert (dev["cache_type_k"], dev["cache_type_v"]) == (kind, kind)
            assert any(f"KV cache {kind}/{kind}: {dev['kv_bytes_per_token']} bytes per token" in line for line in log)
        finally:
            proc.terminate()
            await proc.wait()
    # six layers of two KV heads of 64: q8_0 is 34 bytes per 32 values, f16 64
    assert seen[("-ctk", "q8_0", "-ctv", "q8_0")] == 6 * 2 * 128 // 32 * 34
    assert seen[()] == 6 * 2 * 128 * 2
    bad = subprocess.run([*serve, "-ctk", "q3_k"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1 and "q3_k" in bad.stderr

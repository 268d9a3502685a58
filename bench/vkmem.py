"""What device memory costs on this Vulkan driver: allocation, free, copy, and restore
strategies, so the weight store's layout is chosen from figures, not guesses.

    .venv/bin/python bench/vkmem.py [--total-mib 1280] [--repeats 3]

Every figure moves ``--total-mib`` of memory (default about llama-1b Q8_0's weights)
in chunks of several sizes:

* ``alloc``/``free``: vkCreateBuffer + vkAllocateMemory + vkBindBufferMemory per chunk,
  and vkDestroyBuffer + vkFreeMemory, serially and from N threads; "untouched" frees
  memory that no copy ever wrote (does the driver charge for pages on first use?).
* ``copy_first``/``copy_again``: one ``vkCmdCopyBuffer`` per chunk from one pinned host
  buffer into freshly allocated chunks, then into the same chunks again.
* ``pipelined``: a restore as the weight store does it: allocate a chunk, submit its
  copy without waiting, allocate the next while the GPU copies, wait once at the end
  (and the same with the allocations made by one worker thread).
* ``raw``: one copy of everything into memory allocated beforehand: the bound.
* ``*_rebar_type``, ``*_not_dedicated``: the same allocations from the DEVICE_LOCAL |
  HOST_VISIBLE memory type, and without VkMemoryDedicatedAllocateInfo (every other
  figure is of dedicated allocations, as the allocator makes them).

On lavapipe the "device" is host memory: run it there only to check the script.
"""

from __future__ import annotations

import argparse
import queue
import sys
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import attrs
import common

from trio_llm.vulkan.device import shared_device
from trio_llm.vulkan.memory import DEVICE_LOCAL, HOST_VISIBLE, Allocator, Buffer

MIB = 1 << 20


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--total-mib", type=int, default=1280)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--chunks-mib", default="16,64,256,1024")
    args = ap.parse_args()
    device = shared_device()
    alloc = Allocator(device)
    vk = device.vk
    total = args.total_mib * MIB
    chunks = [int(c) * MIB for c in args.chunks_mib.split(",") if int(c) * MIB <= total]
    host = alloc.create(total, "scratch", "host")
    assert host.array is not None
    host.array[:] = 7  # touch every page once
    figures: dict[str, Any] = {"device": device.info(), "total_bytes": total}
    rows: list[dict[str, Any]] = []

    def record(name: str, chunk: int, seconds: list[float], **extra: Any) -> None:
        s = common.stats(seconds)
        figures.setdefault(name, {})[str(chunk // MIB)] = {"s": s, **extra}
        rows.append({"figure": name, "chunk_MiB": chunk // MIB, "ms": s.median * 1e3,
                     "GB/s": total / s.median / 1e9, **extra})
        print(f"{name:>18} {chunk // MIB:>5} MiB {s.median * 1e3:8.2f} ms", flush=True)

    def copy_into(bufs: list[Buffer], *, wait: bool = True) -> None:
        cmd = device.allocate_command_buffer()
        try:
            vk.vkBeginCommandBuffer(cmd, vk.VkCommandBufferBeginInfo(flags=vk.VK_COMMAND_BUFFER_USAGE_ONE_TIME_SUBMIT_BIT))
            off = 0
            for b in bufs:
                n = min(b.size, total - off)
                vk.vkCmdCopyBuffer(cmd, host.handle, b.handle, 1, [vk.VkBufferCopy(srcOffset=off, dstOffset=0, size=n)])
                off += n
            vk.vkEndCommandBuffer(cmd)
            device.submit_and_wait([cmd], "copy")
        finally:
            device.free_command_buffer(cmd)

    def make(chunk: int, mtype_place: str = "device") -> list[Buffer]:
        return [alloc.create(min(chunk, total - o), "weights", mtype_place) for o in range(0, total, chunk)]

    def free_threads(bufs: list[Buffer], threads: int) -> float:
        t0 = common.now()
        if threads == 1:
            for b in bufs:
                alloc.free(b)
        else:
            with ThreadPoolExecutor(threads) as pool:
                list(pool.map(alloc.free, bufs))
        return common.now() - t0

    def rep(fn: Callable[[], Any]) -> list[Any]:
        fn()  # warm-up, unrecorded
        return [fn() for _ in range(args.repeats)]

    # raw: the bound
    big = make(total if total <= device.limits.max_allocation_size else 1 << 30)
    copy_into(big)
    record("raw_copy", big[0].size, rep(lambda: common.timed(lambda: copy_into(big))[0]))
    for b in big:
        alloc.free(b)

    for chunk in chunks:
        al, c1, c2, fr, al_u, fr_u = [], [], [], [], [], []
        for _ in range(args.repeats + 1):
            t, bufs = common.timed(lambda chunk=chunk: make(chunk))
            al.append(t)
            c1.append(common.timed(lambda bufs=bufs: copy_into(bufs))[0])
            c2.append(common.timed(lambda bufs=bufs: copy_into(bufs))[0])
            fr.append(free_threads(bufs, 1))
            t, bufs = common.timed(lambda chunk=chunk: make(chunk))
            al_u.append(t)
            fr_u.append(free_threads(bufs, 1))
        for name, vals in (("alloc", al), ("copy_first", c1), ("copy_again", c2), ("free", fr),
                           ("alloc_untouched", al_u), ("free_untouched", fr_u)):
            record(name, chunk, vals[1:])
        for threads in (2, 4, 8, 16):
            at, ft = [], []
            for _ in range(args.repeats + 1):
                with ThreadPoolExecutor(threads) as pool:
                    t0 = common.now()
                    bufs = list(pool.map(lambda o, chunk=chunk: alloc.create(min(chunk, total - o), "weights"),
                                         range(0, total, chunk)))
                    at.append(common.now() - t0)
                copy_into(bufs)
                ft.append(free_threads(bufs, threads))
            record(f"alloc_{threads}threads", chunk, at[1:])
            record(f"free_{threads}threads", chunk, ft[1:])

    def other_allocator(name: str, other: Allocator) -> None:
        """alloc_NAME / free_NAME: the same bytes in 256 MiB buffers from ``other``."""
        al, fr = [], []
        for _ in range(args.repeats + 1):
            t, bufs = common.timed(lambda: [other.create(256 * MIB, "weights") for _ in range(0, total, 256 * MIB)])
            al.append(t)
            copy_into(bufs)
            t0 = common.now()
            for b in bufs:
                other.free(b)
            fr.append(common.now() - t0)
        record(f"alloc_{name}", 256 * MIB, al[1:])
        record(f"free_{name}", 256 * MIB, fr[1:])

    # another memory type for the same bytes (resizable BAR: DEVICE_LOCAL | HOST_VISIBLE)
    bar = device.find_memory_type(0xFFFFFFFF, DEVICE_LOCAL | HOST_VISIBLE)
    if bar is not None and device.device_type != "cpu":
        other_allocator("rebar_type", OneType(device, mtype=bar))
    # the allocator's buffers each get a dedicated allocation; the same without
    other_allocator("not_dedicated", NotDedicated(device))

    for chunk in [c for c in (16 * MIB, 32 * MIB, 64 * MIB, 128 * MIB, 256 * MIB) if c <= total]:
        record("pipelined", chunk, rep(lambda chunk=chunk: pipelined(alloc, host, total, chunk, threaded=False)))
        record("pipelined_thread", chunk, rep(lambda chunk=chunk: pipelined(alloc, host, total, chunk, threaded=True)))

    alloc.free(host)
    common.print_table(rows)
    path = common.write_result("vkmem", vars(args), figures)
    print(f"wrote {path}")
    return 0


@attrs.define(eq=False)
class OneType(Allocator):
    """An allocator that takes every buffer from one given memory type."""

    mtype: int = 0

    def _memory_types(self, bits: int, place: str) -> list[int]:
        return [self.mtype]


@attrs.define(eq=False)
class NotDedicated(Allocator):
    """An allocator without VkMemoryDedicatedAllocateInfo (what Allocator did before)."""

    def _allocate(self, req: Any, place: str, buffer: Any) -> Any:
        vk = self.device.vk
        mtype = self._memory_types(req.memoryTypeBits, place)[0]
        return vk.vkAllocateMemory(
            self.device.handle, vk.VkMemoryAllocateInfo(allocationSize=req.size, memoryTypeIndex=mtype), None)


def pipelined(alloc: Allocator, host: Buffer, total: int, chunk: int, *, threaded: bool) -> float:
    """Seconds to allocate ``total`` bytes in chunks and copy the host buffer into
    them, each copy submitted as soon as its chunk exists; everything freed after."""
    device = alloc.device
    vk = device.vk
    offsets = list(range(0, total, chunk))
    bufs: list[Buffer] = []
    cmds: list[Any] = []
    ready: queue.Queue[Buffer | BaseException] = queue.Queue()

    def producer() -> None:
        for o in offsets:
            try:
                ready.put(alloc.create(min(chunk, total - o), "weights"))
            except BaseException as exc:
                ready.put(exc)
                return

    t0 = common.now()
    worker = threading.Thread(target=producer) if threaded else None
    if worker is not None:
        worker.start()
    for i, o in enumerate(offsets):
        if worker is not None:
            got = ready.get()
            if isinstance(got, BaseException):
                raise got
            buf = got
        else:
            buf = alloc.create(min(chunk, total - o), "weights")
        bufs.append(buf)
        cmd = device.allocate_command_buffer()
        cmds.append(cmd)
        vk.vkBeginCommandBuffer(cmd, vk.VkCommandBufferBeginInfo(flags=vk.VK_COMMAND_BUFFER_USAGE_ONE_TIME_SUBMIT_BIT))
        vk.vkCmdCopyBuffer(cmd, host.handle, buf.handle, 1, [vk.VkBufferCopy(srcOffset=o, dstOffset=0, size=buf.size)])
        vk.vkEndCommandBuffer(cmd)
        device.submit([cmd], "pipelined copy", signal=i == len(offsets) - 1)
    device.wait("pipelined copy")
    seconds = common.now() - t0
    if worker is not None:
        worker.join()
    for cmd in cmds:
        device.free_command_buffer(cmd)
    for b in bufs:
        alloc.free(b)
    return seconds


if __name__ == "__main__":
    sys.exit(main())

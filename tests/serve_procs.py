"""Helpers for tests that run ``trio-llm serve`` as a real process."""

from __future__ import annotations

import re

import trio


async def wait_ready(proc: trio.Process, seconds: float) -> tuple[str, list[str]]:
    """Read the server's log until it says "ready": (its URL, the log lines so far).
    Fails the test if the process exits first or takes longer than ``seconds``."""
    assert proc.stderr is not None
    log: list[str] = []
    url, buf = "", b""
    with trio.fail_after(seconds):
        while "trio-llm: ready" not in log:
            chunk = await proc.stderr.receive_some()
            assert chunk, "the server exited during start-up: " + "\n".join(log)
            buf += chunk
            *lines, buf = buf.split(b"\n")
            for line in lines:
                text = line.decode().strip("\r")
                log.append(text)
                if m := re.search(r"listening on (http://\S+)", text):
                    url = m.group(1)
    return url, log

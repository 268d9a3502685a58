"""The two ways the runner asks a server: a plain answer, or a stream of SSE chunks.

Both fill a ``RequestRecord`` in place, so what is known survives a cancellation
(a timed-out stream keeps its first-token time). Errors from the transport are left
to the caller, which decides what they mean (a killed server's requests fail on
purpose).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import httpx
import trio

from trio_llm.scenario.record import RequestRecord


def request_body(r: RequestRecord) -> tuple[str, dict[str, Any]]:
    """The path and JSON body of a greedy request (temperature 0, so answers compare)."""
    extra = {"ignore_eos": True} if r.ignore_eos else {}
    if r.endpoint == "chat":
        return "/v1/chat/completions", {
            "messages": [{"role": "user", "content": r.prompt}],
            "max_tokens": r.n_predict,
            "temperature": 0,
            "stream": r.stream,
            **extra,
        }
    return "/completion", {
        "prompt": r.prompt, "n_predict": r.n_predict, "temperature": 0, "stream": r.stream,
        **extra,
    }


def _predicted(timings: object, fallback: int) -> int:
    if isinstance(timings, dict) and isinstance(timings.get("predicted_n"), int):
        return int(timings["predicted_n"])
    return fallback


async def ask_plain(client: httpx.AsyncClient, url: str, r: RequestRecord) -> None:
    path, body = request_body(r)
    response = await client.post(url + path, json=body, timeout=None)
    r.status = response.status_code
    if response.status_code != 200:
        r.outcome, r.error = "http_error", response.text[:300]
        return
    data = response.json()
    if r.endpoint == "chat":
        r.content = data["choices"][0]["message"]["content"] or ""
        r.n_tokens = int((data.get("usage") or {}).get("completion_tokens", 0))
    else:
        r.content = data["content"]
        r.timings = data.get("timings")
        r.n_tokens = _predicted(r.timings, int(data.get("tokens_predicted", 0)))
    r.outcome = "ok"


async def ask_stream(
    client: httpx.AsyncClient,
    url: str,
    r: RequestRecord,
    now: Callable[[], float],
    first: trio.Event,
) -> None:
    """Stream an answer, timing the first and second-to-last content chunks. An answer
    is complete only with its final chunk (``stop: true``, or ``[DONE]`` for chat): a
    connection that closes before it, as a killed server's does, is an error."""
    path, body = request_body(r)
    pieces: list[str] = []
    previous: float | None = None
    finished = False
    async with client.stream("POST", url + path, json=body, timeout=None) as response:
        r.status = response.status_code
        if response.status_code != 200:
            await response.aread()
            r.outcome, r.error = "http_error", response.text[:300]
            return
        async for line in response.aiter_lines():
            if not line.startswith("data:"):
                continue
            payload = line[5:].strip()
            if payload == "[DONE]":
                finished = True
                break
            data = json.loads(payload)
            if r.endpoint == "chat":
                choices = data.get("choices") or [{}]
                piece = (choices[0].get("delta") or {}).get("content") or ""
            else:
                piece = data.get("content", "")
                if data.get("stop"):
                    r.timings = data.get("timings")
                    finished = True
            if piece:
                t = now()
                if r.first_token is None:
                    r.first_token = t
                    first.set()
                r.penultimate = previous
                previous = t
                pieces.append(piece)
    r.content = "".join(pieces)
    r.n_tokens = _predicted(r.timings, len(pieces))
    if finished:
        r.outcome = "ok"
    else:
        r.outcome, r.error = "error", f"the stream ended without its final chunk after {len(pieces)} pieces"

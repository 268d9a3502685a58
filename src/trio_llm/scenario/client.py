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
    if r.endpoint == "chat":
        return "/v1/chat/completions", {
            "messages": [{"role": "user", "content": r.prompt}],
            "max_tokens": r.n_predict,
            "temperature": 0,
            "stream": r.stream,
        }
    return "/completion", {
        "prompt": r.prompt, "n_predict": r.n_predict, "temperature": 0, "stream": r.stream,
    }

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
        r.n_tokens = int(data.get("usage", {}).get("completion_tokens", 0))
    else:
        r.content = data["content"]
        r.timings = data.get("timings")
        tokens = data.get("tokens")
        r.n_tokens = len(tokens) if isinstance(tokens, list) else int(data.get("tokens_predicted", 0))
    r.outcome = "ok"

async def ask_stream(
client: httpx.AsyncClient, url: str, r: RequestRecord, now: Callable[[], float], first: trio.Event
) -> None:
    path, body = request_body(r)
    pieces: list[str] = []
    previous: float | None = None
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
                break
            data = json.loads(payload)
            if r.endpoint == "chat":
                choices = data.get("choices") or [{}]
                piece = (choices[0].get("delta") or {}).get("content") or ""
            else:
                piece = data.get("content", "")
                if data.get("stop"):
                    r.timings = data.get("timings")
            if piece:
                t = now()
                if r.first_token is None:
                    r.first_token = t
                    first.set()
                r.penultimate = previous
                previous = t
                pieces.append(piece)
    r.content = "".join(pieces)
    r.n_tokens = len(pieces)
    if isinstance(r.timings, dict) and isinstance(r.timings.get("predicted_n"), int):
        r.n_tokens = r.timings["predicted_n"]
    r.outcome = "ok"

"""A small async OpenAI-compatible streaming client that records TTFT, ITL and latency."""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx


@dataclass
class RequestRecord:
    ok: bool
    status: int
    ttft_s: float = 0.0
    latency_s: float = 0.0
    output_tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    itl_s: list[float] = field(default_factory=list)
    error: str = ""


async def stream_chat(
    http: httpx.AsyncClient, base_url: str, body: dict[str, Any]
) -> RequestRecord:
    """POST a streaming chat request; time the first content token and each one after."""
    payload = body | {"stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    first = last = 0.0
    itl: list[float] = []
    usage: dict[str, Any] = {}
    async with http.stream("POST", f"{base_url}/v1/chat/completions", json=payload) as response:
        if response.status_code != 200:
            text = (await response.aread()).decode(errors="replace")
            return RequestRecord(False, response.status_code, error=text[:300])
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            if any(c.get("delta", {}).get("content") for c in chunk.get("choices", [])):
                now = time.perf_counter()
                if first == 0.0:
                    first = now
                else:
                    itl.append(now - last)
                last = now
    end = time.perf_counter()
    details = usage.get("prompt_tokens_details") or {}
    return RequestRecord(
        ok=True,
        status=200,
        ttft_s=(first or end) - start,
        latency_s=end - start,
        output_tokens=usage.get("completion_tokens", 0),
        prompt_tokens=usage.get("prompt_tokens", 0),
        cached_tokens=details.get("cached_tokens") or 0,
        itl_s=itl,
    )


async def closed_loop(
    base_url: str, bodies: Sequence[dict[str, Any]], concurrency: int
) -> tuple[list[RequestRecord], float]:
    """Send every body with at most ``concurrency`` in flight; return records and wall time."""
    queue = list(reversed(bodies))
    records: list[RequestRecord] = []
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=httpx.Timeout(900), limits=limits) as http:

        async def worker() -> None:
            while queue:
                records.append(await stream_chat(http, base_url, queue.pop()))

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return records, time.perf_counter() - start


def percentile(values: Sequence[float], q: float) -> float:
    if not values:
        return float("nan")
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1]

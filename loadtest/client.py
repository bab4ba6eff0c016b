"""A small async OpenAI-compatible streaming client that records TTFT, TPOT, ITL and latency.

Works against any OpenAI-compatible base URL (ours, ``vllm serve``, ``ray.serve.llm``): chat
(``/v1/chat/completions``) or completions (``/v1/completions``, when the body has ``prompt``).
"""

from __future__ import annotations

import asyncio
import json
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
    # Seconds from the start of the run to when this request was sent.
    start_s: float = 0.0
    # Which workload item (index into the bodies) this is.
    index: int = -1

    @property
    def tpot_s(self) -> float:
        """Time per output token after the first (0 when there is only one token)."""
        if self.output_tokens <= 1:
            return 0.0
        return (self.latency_s - self.ttft_s) / (self.output_tokens - 1)

    def to_dict(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "status": self.status,
            "ttft_s": self.ttft_s,
            "tpot_s": self.tpot_s,
            "latency_s": self.latency_s,
            "output_tokens": self.output_tokens,
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "itl_s": self.itl_s,
            "error": self.error,
            "start_s": self.start_s,
            "index": self.index,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RequestRecord:
        data = {k: v for k, v in data.items() if k != "tpot_s"}
        return cls(**data)


def _has_output(choice: dict[str, Any]) -> bool:
    if "text" in choice:
        return bool(choice["text"])
    delta = choice.get("delta") or {}
    return bool(delta.get("content") or delta.get("tool_calls") or delta.get("reasoning_content"))


async def stream_chat(
    http: httpx.AsyncClient, base_url: str, body: dict[str, Any]
) -> RequestRecord:
    """POST a streaming request; time the first output token and each one after.

    A body with ``prompt`` goes to ``/v1/completions``, otherwise ``/v1/chat/completions``.
    """
    payload = body | {"stream": True, "stream_options": {"include_usage": True}}
    path = "/v1/completions" if "prompt" in body else "/v1/chat/completions"
    start = time.perf_counter()
    first = last = 0.0
    itl: list[float] = []
    usage: dict[str, Any] = {}
    chunks = 0
    try:
        async with http.stream("POST", f"{base_url}{path}", json=payload) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")
                return RequestRecord(
                    False,
                    response.status_code,
                    latency_s=time.perf_counter() - start,
                    error=text[:300],
                )
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    usage = chunk["usage"]
                if "error" in chunk:
                    return RequestRecord(
                        False,
                        200,
                        latency_s=time.perf_counter() - start,
                        error=json.dumps(chunk["error"])[:300],
                    )
                if any(_has_output(c) for c in chunk.get("choices") or []):
                    chunks += 1
                    now = time.perf_counter()
                    if first == 0.0:
                        first = now
                    else:
                        itl.append(now - last)
                    last = now
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        return RequestRecord(False, 0, latency_s=time.perf_counter() - start, error=repr(exc)[:300])
    end = time.perf_counter()
    details = usage.get("prompt_tokens_details") or {}
    return RequestRecord(
        ok=True,
        status=200,
        ttft_s=(first or end) - start,
        latency_s=end - start,
        output_tokens=usage.get("completion_tokens") or chunks,
        prompt_tokens=usage.get("prompt_tokens", 0),
        cached_tokens=details.get("cached_tokens") or 0,
        itl_s=itl,
    )


def make_http(concurrency: int, timeout_s: float = 900) -> httpx.AsyncClient:
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    return httpx.AsyncClient(timeout=httpx.Timeout(timeout_s), limits=limits)


async def closed_loop(
    base_url: str, bodies: Sequence[dict[str, Any]], concurrency: int
) -> tuple[list[RequestRecord], float]:
    """Send every body with at most ``concurrency`` in flight; return records and wall time."""
    queue = list(reversed(bodies))
    records: list[RequestRecord] = []
    async with make_http(concurrency) as http:

        async def worker() -> None:
            while queue:
                records.append(await stream_chat(http, base_url, queue.pop()))

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return records, time.perf_counter() - start


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0-100), linear interpolation between closest ranks; NaN if empty."""
    if not values:
        return float("nan")
    if len(values) == 1:
        return float(values[0])
    ordered = sorted(values)
    pos = (len(ordered) - 1) * min(max(q, 0.0), 100.0) / 100
    low = int(pos)
    high = min(low + 1, len(ordered) - 1)
    return float(ordered[low] + (ordered[high] - ordered[low]) * (pos - low))


__all__ = ["RequestRecord", "closed_loop", "make_http", "percentile", "stream_chat"]

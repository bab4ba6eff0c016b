"""Traffic half of the GPU check: chat checks, a short streamed benchmark, the report."""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

PROMPT = "What is the capital of France? Answer in one word."
TOPICS = ["the sea", "a mountain", "a city at night", "an old library", "a small robot"]


class CheckFailed(RuntimeError):
    """A step of the check failed; the message says which and why."""


@dataclass
class Figures:
    model: str
    tensor_parallel_size: int
    gpus: list[str] = field(default_factory=list)
    startup_s: float | None = None
    chat_answer: str = ""
    chat_latency_s: float | None = None
    stream_ttft_s: float | None = None
    requests: int = 0
    concurrency: int = 0
    max_tokens: int = 0
    failed_requests: int = 0
    output_tokens: int = 0
    bench_seconds: float = 0.0
    output_tok_per_s: float = 0.0
    ttft_p50_s: float | None = None
    ttft_p90_s: float | None = None
    latency_p50_s: float | None = None
    engine_args: dict[str, Any] = field(default_factory=dict)
    gpu_memory: list[str] = field(default_factory=list)  # "index, used MiB, total MiB" each.
    placement_groups: list[dict[str, Any]] = field(default_factory=list)


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1]


async def chat_checks(base_url: str, model: str, timeout: float, figures: Figures) -> None:
    from openai import AsyncOpenAI

    client = AsyncOpenAI(
        base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=timeout
    )
    started = time.perf_counter()
    response = await client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": PROMPT}],
        max_tokens=16,
        temperature=0,
    )
    figures.chat_latency_s = time.perf_counter() - started
    figures.chat_answer = (response.choices[0].message.content or "").strip()
    print(f"  chat: {figures.chat_answer!r} in {figures.chat_latency_s:.2f} s", flush=True)
    if "paris" not in figures.chat_answer.lower():
        raise CheckFailed(f"chat: expected the answer to name Paris, got {figures.chat_answer!r}")

    started = time.perf_counter()
    first: float | None = None
    text = ""
    stream = await client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Write a haiku about the sea."}],
        max_tokens=40,
        stream=True,
    )
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            first = first or time.perf_counter() - started
            text += chunk.choices[0].delta.content
    if first is None or not text.strip():
        raise CheckFailed("stream: no content deltas arrived")
    figures.stream_ttft_s = first
    print(f"  stream: {len(text)} chars, first delta after {first:.3f} s", flush=True)


async def benchmark(base_url: str, model: str, args: argparse.Namespace, figures: Figures) -> None:
    from openai import AsyncOpenAI

    client = AsyncOpenAI(
        base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=args.request_timeout
    )
    queue = list(range(args.requests))
    ttfts: list[float] = []
    latencies: list[float] = []
    errors: list[str] = []
    tokens = 0

    async def one(index: int) -> None:
        nonlocal tokens
        started = time.perf_counter()
        first: float | None = None
        usage_tokens = 0
        stream = await client.chat.completions.create(
            model=model,
            messages=[
                {
                    "role": "user",
                    "content": f"Write a short story about {TOPICS[index % len(TOPICS)]} "
                    f"(#{index}).",
                }
            ],
            max_tokens=args.max_tokens,
            temperature=0.7,
            seed=index,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content and first is None:
                first = time.perf_counter() - started
            if chunk.usage is not None:
                usage_tokens = chunk.usage.completion_tokens
        if first is None or usage_tokens == 0:
            raise CheckFailed(f"request {index}: no tokens")
        ttfts.append(first)
        latencies.append(time.perf_counter() - started)
        tokens += usage_tokens

    async def worker() -> None:
        while queue:
            index = queue.pop()
            try:
                await one(index)
            except Exception as exc:
                errors.append(f"request {index}: {type(exc).__name__}: {exc}")

    await one(10_000)  # Warm-up, not counted.
    ttfts.clear()
    latencies.clear()
    tokens = 0
    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(min(args.concurrency, args.requests))))
    seconds = time.perf_counter() - started
    figures.requests, figures.concurrency = args.requests, args.concurrency
    figures.max_tokens, figures.failed_requests = args.max_tokens, len(errors)
    figures.output_tokens, figures.bench_seconds = tokens, seconds
    figures.output_tok_per_s = tokens / seconds if seconds else 0.0
    figures.ttft_p50_s, figures.ttft_p90_s = percentile(ttfts, 50), percentile(ttfts, 90)
    figures.latency_p50_s = percentile(latencies, 50)
    if errors:
        raise CheckFailed(f"benchmark: {len(errors)}/{args.requests} requests failed: {errors[0]}")


def report(figures: Figures) -> None:
    def seconds(value: float | None) -> str:
        return "-" if value is None else f"{value:.3f} s"

    rows = [
        ("model", f"{figures.model} (TP={figures.tensor_parallel_size})"),
        ("GPUs", "; ".join(figures.gpus) or "-"),
        ("startup to RUNNING", seconds(figures.startup_s)),
        ("chat answer", repr(figures.chat_answer)),
        ("chat latency", seconds(figures.chat_latency_s)),
        ("stream first delta", seconds(figures.stream_ttft_s)),
        (
            "benchmark",
            f"{figures.requests} requests, concurrency {figures.concurrency}, "
            f"{figures.max_tokens} output tokens each, {figures.failed_requests} failed",
        ),
        ("output tokens/s", f"{figures.output_tok_per_s:.1f}"),
        ("TTFT p50 / p90", f"{seconds(figures.ttft_p50_s)} / {seconds(figures.ttft_p90_s)}"),
        ("latency p50", seconds(figures.latency_p50_s)),
        ("GPU memory used", "; ".join(figures.gpu_memory) or "-"),
        *[
            (
                "placement group",
                f"{group['strategy']} {group['bundles']} on nodes {group['nodes']}",
            )
            for group in figures.placement_groups
        ],
    ]
    width = max(len(name) for name, _ in rows)
    print()
    for name, value in rows:
        print(f"{name:<{width}}  {value}")

"""Where time to first token goes at c=1, hop by hop, from the spans the deployments record.

Starts the app ``make bench`` measures (same engine settings) in this process with the
in-memory span exporter, sends ``--requests`` streamed chats one at a time, each with its own
W3C trace id in ``traceparent``, then reads the Router, Preprocessor and Engine replicas' spans
back and splits each request's time to first token (medians over the requests, ms):

- client → router: the client's send to the router's ``POST`` span (HTTP, Serve's proxy)
- router: the router's own work before it asks for tokens (parse, validate, send)
- preprocess: the ``preprocess`` span (hop there, aggregation window, template, tokens, back)
- router → engine: to the ``engine.generate`` span (request routing, the hop)
- engine → vLLM: from the replica's call into AsyncLLM to vLLM queueing it
- vLLM queue, vLLM prefill: vLLM's own timestamps (queued, scheduled, first token)
- vLLM → engine: vLLM's first token to the replica yielding it
- engine → router: the first step's hop back
- router → client: the router's first event to the client reading it (SSE, proxy, HTTP)

``python -m loadtest.ttft_breakdown [--requests 30] [--max-tokens 16]``
"""

from __future__ import annotations

import argparse
import asyncio
import json
import secrets
import statistics
import time
from typing import Any

import httpx

from loadtest.bench import engine_settings
from loadtest.bench import parse_args as bench_args
from loadtest.targets import MODEL

SEGMENTS = (
    "client → router",
    "router",
    "preprocess",
    "router → engine",
    "engine → vLLM",
    "vLLM queue",
    "vLLM prefill",
    "vLLM → engine",
    "engine → router",
    "router → client",
)


async def one_request(http: httpx.AsyncClient, url: str, i: int, max_tokens: int) -> dict:
    """One streamed chat; the client's send and first-token times (ns) and its trace id."""
    trace_id = secrets.token_hex(16)
    body = {
        "model": MODEL,
        "max_tokens": max_tokens,
        "stream": True,
        "messages": [{"role": "user", "content": f"Tell me about city number {i}."}],
    }
    headers = {"traceparent": f"00-{trace_id}-{secrets.token_hex(8)}-01"}
    sent = time.time_ns()
    first = 0
    async with http.stream("POST", f"{url}/v1/chat/completions", json=body, headers=headers) as r:
        async for line in r.aiter_lines():
            if first or not line.startswith("data: {") or '"content":"' not in line:
                continue
            if json.loads(line[6:])["choices"][0]["delta"].get("content"):
                first = time.time_ns()
    return {"trace_id": trace_id, "sent": sent, "first": first}


def split(client: dict[str, int], spans: list[dict[str, Any]]) -> dict[str, float] | None:
    """One request's segments in ms, from its client times and its trace's spans."""
    by_name = {s["name"]: s for s in spans if s["trace_id"] == client["trace_id"]}
    names = ("POST /v1/chat/completions", "preprocess", "engine.generate", "engine.queue")
    if not client["first"] or not all(n in by_name for n in names):
        return None
    router, pre, engine = by_name[names[0]], by_name["preprocess"], by_name["engine.generate"]
    queue, prefill = by_name["engine.queue"], by_name["engine.prefill"]
    engine_first = engine["start_ns"] + engine["attributes"]["serve_app.ttft_ms"] * 1e6
    router_first = router["start_ns"] + router["attributes"]["serve_app.ttft_ms"] * 1e6
    stamps = [
        client["sent"],
        router["start_ns"],
        pre["start_ns"],
        pre["end_ns"],
        engine["start_ns"],
        queue["start_ns"],
        queue["end_ns"],
        prefill["end_ns"],
        engine_first,
        router_first,
        client["first"],
    ]
    return {
        name: (b - a) / 1e6 for name, a, b in zip(SEGMENTS, stamps[:-1], stamps[1:], strict=True)
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=30)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--port", type=int, default=8295)
    ns = parser.parse_args(argv)

    from ray import serve

    from serve_app.launch import start, wait_ready

    args = engine_settings(bench_args([])) | {
        "tracing": {"exporter": "memory"},
        "batch_api": {"enabled": False},
    }
    config = {"applications": [{"name": "llm", "route_prefix": "/", "args": args}]}
    url = start(config, port=ns.port)[0]
    wait_ready(url)

    async def run() -> list[dict]:
        async with httpx.AsyncClient(timeout=300) as http:
            for i in range(3):  # Warm-up, discarded.
                await one_request(http, url, 1000 + i, ns.max_tokens)
            return [await one_request(http, url, i, ns.max_tokens) for i in range(ns.requests)]

    clients = asyncio.run(run())
    time.sleep(1)  # The engine records its spans as each stream closes.
    spans = [
        span
        for deployment in ("Router", "Preprocessor", "Engine")
        for span in serve.get_deployment_handle(deployment, "llm").finished_spans.remote().result()
    ]
    serve.shutdown()
    rows = [row for c in clients if (row := split(c, spans)) is not None]
    if not rows:
        raise SystemExit("no request had a complete trace")
    ttft = statistics.median((c["first"] - c["sent"]) / 1e6 for c in clients if c["first"])
    print(f"\nTTFT at c=1 by hop, {MODEL}, median of {len(rows)} requests (ms):\n")
    for name in SEGMENTS:
        print(f"  {name:<18}{statistics.median(row[name] for row in rows):>8.1f}")
    print(f"  {'= client TTFT':<18}{ttft:>8.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

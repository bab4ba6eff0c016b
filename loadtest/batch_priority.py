"""Interactive TTFT while batch work runs, vs idle: does a batch starve chat traffic?

One app, one engine replica. Interactive probes (one at a time, short answers) measure TTFT p50
in four conditions, same run:

- ``idle``: nothing else running;
- ``batch API``: an OpenAI Batch API job in progress (the product path: the router sends its
  rows at vLLM priority 100, at most 32 in flight);
- ``flood, same priority``: more background requests than ``max_num_seqs`` (the engine's waiting
  queue is never empty) sent at priority 0, like the probes;
- ``flood, batch priority``: the same flood sent at priority 100, so vLLM's priority scheduler
  puts the probes first.

    python -m loadtest.batch_priority [--rows 400] [--probes 12] [--flood 192]
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import time
from pathlib import Path
from typing import Any

from loadtest.client import RequestRecord, make_http, percentile, stream_chat

ROOT = Path(__file__).resolve().parents[1]
BATCH_PRIORITY = 100  # What the Batch API uses (serve_app.batch_api.service.BATCH_PRIORITY).
PROBE_QUESTIONS = [
    "What is the capital of France? Answer in one word.",
    "Name a primary colour. Answer in one word.",
    "What is 2 + 2? Answer with a number.",
    "Name an animal that barks. Answer in one word.",
]


def probe_body(model: str, i: int) -> dict[str, Any]:
    question = PROBE_QUESTIONS[i % len(PROBE_QUESTIONS)]
    return {
        "model": model,
        "max_tokens": 8,
        "temperature": 0,
        # A distinct prefix per probe, so no probe is a prefix-cache hit of the one before.
        "messages": [{"role": "user", "content": f"Question {i}. {question}"}],
    }


def background_body(model: str, i: int, priority: int) -> dict[str, Any]:
    return {
        "model": model,
        "max_tokens": 64,
        "ignore_eos": True,
        "priority": priority,
        "messages": [{"role": "user", "content": f"Write a long story about lighthouse {i}."}],
    }


async def probes(url: str, model: str, count: int, first: int = 0) -> list[RequestRecord]:
    """Interactive requests, one at a time (what a chat user sees)."""
    async with make_http(2, timeout_s=300) as http:
        return [await stream_chat(http, url, probe_body(model, first + i)) for i in range(count)]


async def during_flood(url: str, model: str, count: int, flood: int, priority: int) -> Any:
    """Keep ``flood`` background requests in flight while the probes run."""
    stop = asyncio.Event()
    async with make_http(flood + 4, timeout_s=600) as http:

        async def worker(w: int) -> None:
            i = 0
            while not stop.is_set():
                await stream_chat(http, url, background_body(model, w * 1000 + i, priority))
                i += 1

        workers = [asyncio.create_task(worker(w)) for w in range(flood)]
        await asyncio.sleep(8)  # Let the flood fill the engine and its waiting queue.
        records = [await stream_chat(http, url, probe_body(model, 100 + i)) for i in range(count)]
        stop.set()
        for task in workers:
            task.cancel()
        await asyncio.gather(*workers, return_exceptions=True)
    return records


def batch_input(model: str, rows: int) -> bytes:
    lines = [
        {
            "custom_id": f"row-{i}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": background_body(model, i, 0) | {"max_tokens": 64},
        }
        for i in range(rows)
    ]
    return "\n".join(json.dumps(line) for line in lines).encode()


def during_batch(url: str, model: str, count: int, rows: int) -> list[RequestRecord]:
    from openai import OpenAI

    client = OpenAI(base_url=f"{url}/v1", api_key="unused")
    upload = client.files.create(
        file=("rows.jsonl", io.BytesIO(batch_input(model, rows))), purpose="batch"
    )
    batch = client.batches.create(
        input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    deadline = time.monotonic() + 60
    while client.batches.retrieve(batch.id).status != "in_progress":
        if time.monotonic() > deadline:
            raise SystemExit(f"batch {batch.id} never started")
        time.sleep(0.5)
    time.sleep(5)  # Rows in flight in the engine.
    records = asyncio.run(probes(url, model, count, first=200))
    state = client.batches.retrieve(batch.id)
    done = state.request_counts.completed if state.request_counts else 0
    print(f"  batch still {state.status} after the probes ({done}/{rows} rows done)")
    if state.status == "in_progress":
        client.batches.cancel(batch.id)
    return records


def summary(name: str, records: list[RequestRecord]) -> dict[str, Any]:
    ok = [r for r in records if r.ok]
    ttfts = [r.ttft_s for r in ok]
    return {
        "condition": name,
        "probes": len(records),
        "failed": len(records) - len(ok),
        "ttft_p50_s": percentile(ttfts, 50),
        "ttft_p90_s": percentile(ttfts, 90),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="serve_config.cpu.yaml")
    parser.add_argument("--port", type=int, default=8077)
    parser.add_argument("--probes", type=int, default=12)
    parser.add_argument("--rows", type=int, default=400, help="Batch API job size.")
    parser.add_argument("--flood", type=int, default=192, help="Background requests in flight.")
    parser.add_argument("--out", default="results/batch_priority.json")
    args = parser.parse_args(argv)

    import ray
    from ray import serve

    from serve_app.launch import load_serve_config, start, wait_ready

    url = start(load_serve_config(ROOT / args.config), port=args.port)[0]
    model = wait_ready(url)["data"][0]["id"]
    results = []
    try:
        asyncio.run(probes(url, model, 4))  # Warm-up, discarded.
        results.append(summary("idle", asyncio.run(probes(url, model, args.probes))))
        results.append(summary("batch API", during_batch(url, model, args.probes, args.rows)))
        time.sleep(5)  # The cancelled batch's rows drain.
        for name, priority in (("flood, same priority", 0), ("flood, batch priority", 100)):
            records = asyncio.run(during_flood(url, model, args.probes, args.flood, priority))
            results.append(summary(name, records))
            time.sleep(5)
    finally:
        serve.shutdown()
        ray.shutdown()
    idle = results[0]["ttft_p50_s"]
    for r in results:
        print(
            f"{r['condition']:<24} TTFT p50 {r['ttft_p50_s'] * 1000:8.0f} ms  "
            f"p90 {r['ttft_p90_s'] * 1000:8.0f} ms  ({r['ttft_p50_s'] / idle:5.1f}x idle)  "
            f"failed {r['failed']}"
        )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""A Batch API job next to the offline Ray Data job on the same rows, and what it costs chat.

Same rows (``batch_offline.corpus_rows``: short prompts, 4-8 output tokens), same config,
measured in one run, one after the other so they never share the CPUs:

1. the offline job (``serve_app.offline``) in a fresh process, timed from its launch to its
   last row (its Ray and engine start included, as a user waits for it);
2. the serving app: interactive TTFT p50 idle, then the same rows as one OpenAI Batch API
   job (upload, create, poll to ``completed``; timed from create), with interactive probes
   one at a time while it runs.

    python -m loadtest.batch_api_bench [--rows 5000] [--config serve_config.cpu.yaml]
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import tempfile
import time
from pathlib import Path
from typing import Any

from loadtest.batch_offline import corpus_rows, spawn_target, write_corpus
from loadtest.batch_priority import probe_body, probes
from loadtest.client import RequestRecord, make_http, percentile, stream_chat

ROOT = Path(__file__).resolve().parents[1]


def batch_lines(model: str, rows: list[dict[str, Any]]) -> bytes:
    """The offline rows as Batch API lines, the same sampling (greedy, each row's max_tokens)."""
    lines = [
        {
            "custom_id": row["id"],
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {
                "model": model,
                "messages": [{"role": "user", "content": row["prompt"]}],
                "max_tokens": row["max_tokens"],
                "temperature": 0.0,
            },
        }
        for row in rows
    ]
    return "".join(json.dumps(line) + "\n" for line in lines).encode()


async def probe_until(url: str, model: str, done: asyncio.Event, first: int) -> list[RequestRecord]:
    """Interactive requests one at a time, a second apart, until ``done``."""
    records: list[RequestRecord] = []
    async with make_http(2, timeout_s=300) as http:
        while not done.is_set():
            records.append(await stream_chat(http, url, probe_body(model, first + len(records))))
            await asyncio.sleep(1)
    return records


def run_batch_api(url: str, model: str, rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Rows/s of one Batch API job (create → completed) and the TTFTs probed meanwhile."""
    from openai import OpenAI

    client = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=2)
    upload = client.files.create(
        file=("rows.jsonl", io.BytesIO(batch_lines(model, rows))), purpose="batch"
    )

    async def run() -> dict[str, Any]:
        done = asyncio.Event()
        started = time.monotonic()
        batch = await asyncio.to_thread(
            client.batches.create,
            input_file_id=upload.id,
            endpoint="/v1/chat/completions",
            completion_window="24h",
        )
        probing = asyncio.create_task(probe_until(url, model, done, first=1000))
        while True:
            state = await asyncio.to_thread(client.batches.retrieve, batch.id)
            if state.status in ("completed", "failed", "cancelled", "expired"):
                break
            await asyncio.sleep(0.5)
        seconds = time.monotonic() - started
        done.set()
        records = await probing
        counts = state.request_counts
        assert counts is not None and state.status == "completed", state
        return {
            "status": state.status,
            "rows": counts.completed,
            "failed": counts.failed,
            "seconds": seconds,
            "rows_s": counts.completed / seconds,
            "probes": records,
        }

    return asyncio.run(run())


def ttft_p50(records: list[RequestRecord]) -> float:
    return percentile([r.ttft_s for r in records if r.ok], 50)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=5000)
    parser.add_argument("--config", default="serve_config.cpu.yaml")
    parser.add_argument("--port", type=int, default=8078)
    parser.add_argument("--probes", type=int, default=12, help="Idle probes.")
    parser.add_argument("--batch-size", type=int, default=64, help="Offline job batch size.")
    parser.add_argument("--timeout", type=float, default=1800, help="Offline job seconds.")
    parser.add_argument("--out", default="results/batch_api_bench.json")
    args = parser.parse_args(argv)
    rows = corpus_rows(args.rows)

    with tempfile.TemporaryDirectory() as tmp:
        corpus = write_corpus(Path(tmp) / "corpus.jsonl", args.rows)
        offline = spawn_target("ours", corpus, args)
    print(f"offline job: {offline.line(None)}", flush=True)

    import ray
    from ray import serve

    from serve_app.launch import load_serve_config, start, wait_ready

    store = tempfile.TemporaryDirectory()  # No batch left over from an earlier run resumes.
    overrides = {"batch_api": {"dir": store.name}}
    url = start(load_serve_config(ROOT / args.config), port=args.port, overrides=overrides)[0]
    model = wait_ready(url)["data"][0]["id"]
    try:
        asyncio.run(probes(url, model, 4))  # Warm-up, discarded.
        idle = asyncio.run(probes(url, model, args.probes, first=100))
        batch = run_batch_api(url, model, rows)
    finally:
        serve.shutdown()
        ray.shutdown()
        store.cleanup()

    during = batch.pop("probes")
    idle_p50, during_p50 = ttft_p50(idle), ttft_p50(during)
    offline_rows_s = offline.rows / offline.seconds
    print(
        f"\n{args.rows} rows, 4-8 output tokens each, {args.config}\n"
        f"offline Ray Data job   {offline.seconds:8.1f} s {offline_rows_s:8.2f} rows/s "
        "(from launch: Ray and engine start included)\n"
        f"Batch API job          {batch['seconds']:8.1f} s {batch['rows_s']:8.2f} rows/s "
        f"(create to completed, app already up; {batch['failed']} failed lines)\n"
        f"Batch API / offline    {batch['rows_s'] / offline_rows_s:8.2f}x rows/s\n"
        f"interactive TTFT p50   idle {idle_p50 * 1000:.0f} ms, during the batch "
        f"{during_p50 * 1000:.0f} ms ({during_p50 / idle_p50:.1f}x; {len(during)} probes, "
        f"{sum(not r.ok for r in during)} failed)"
    )
    result = {
        "rows": args.rows,
        "config": args.config,
        "offline": {"seconds": offline.seconds, "rows_s": offline_rows_s},
        "batch_api": batch,
        "ttft_p50_s": {"idle": idle_p50, "during_batch": during_p50},
        "probes_during_batch": len(during),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

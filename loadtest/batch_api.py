"""The Batch API next to the offline Ray Data job on the same rows, and what it costs chat users.

One run, same machine, one after the other:

1. ``offline``: ``python -m serve_app.offline run`` on the corpus (its own local Ray), and on
   8 rows to measure what starting costs (Ray, the engine actor): rows/s is given as a user
   sees it (start included) and without the start, which compares with the Batch API on an
   app already serving;
2. the serving app starts; interactive TTFT p50 ``idle`` (probes one at a time);
3. the same rows as an OpenAI Batch API job (upload, create, poll, download): rows/s from
   create to completed, and interactive TTFT p50 ``during the batch``.

    python -m loadtest.batch_api [--rows 5000] [--probes 12] [--config serve_config.cpu.yaml]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from loadtest.batch_offline import corpus_rows, write_corpus
from loadtest.batch_priority import probes, summary

ROOT = Path(__file__).resolve().parents[1]


def run_offline(corpus: Path, config: str) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as out:
        command = [
            sys.executable, "-m", "serve_app.offline", "run", "--input", str(corpus),
            "--output", out, "--temperature", "0", "--config", config, "--no-progress",
            "--summary-json",
        ]  # fmt: skip
        started = time.perf_counter()
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, check=False)
        seconds = time.perf_counter() - started
    if done.returncode != 0:
        raise SystemExit(f"offline job failed:\n{done.stderr[-3000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    return {"rows": result["rows_ok"] + result["rows_failed"], "seconds": seconds}


def batch_lines(model: str, rows: int) -> bytes:
    lines = [
        {
            "custom_id": row["id"],
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {
                "model": model,
                "messages": [{"role": "user", "content": row["prompt"]}],
                "max_tokens": row["max_tokens"],
                "temperature": 0,
            },
        }
        for row in corpus_rows(rows)
    ]
    return "".join(json.dumps(line) + "\n" for line in lines).encode()


def run_batch(url: str, model: str, rows: int, probe_count: int) -> dict[str, Any]:
    """The Batch API job, with interactive probes running while it is in progress."""
    from openai import OpenAI

    client = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=2, timeout=600)
    upload = client.files.create(file=("rows.jsonl", batch_lines(model, rows)), purpose="batch")
    started = time.perf_counter()
    batch = client.batches.create(
        input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    records: list[Any] = []

    def probe_while_running() -> None:
        while client.batches.retrieve(batch.id).status in ("validating", "finalizing"):
            time.sleep(0.2)
        time.sleep(2)  # Lines in flight in the engine.
        records.extend(asyncio.run(probes(url, model, probe_count, first=300)))

    prober = threading.Thread(target=probe_while_running)
    prober.start()
    while (state := client.batches.retrieve(batch.id)).status not in (
        "completed", "failed", "cancelled", "expired",
    ):  # fmt: skip
        time.sleep(0.5)
    seconds = time.perf_counter() - started
    prober.join()
    if state.status != "completed" or state.output_file_id is None:
        raise SystemExit(f"batch ended {state.status}: {state.errors}")
    outputs = client.files.content(state.output_file_id).text.splitlines()
    counts = state.request_counts
    return {
        "rows": counts.completed + counts.failed if counts else len(outputs),
        "seconds": seconds,
        "outputs": len(outputs),
        "during": summary("during the batch", records),
    }


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="serve_config.cpu.yaml")
    parser.add_argument("--port", type=int, default=None, help="default: a free port")
    parser.add_argument("--rows", type=int, default=5000)
    parser.add_argument("--probes", type=int, default=12)
    parser.add_argument("--out", default="results/batch_api.json")
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory() as tmp:
        tiny = run_offline(write_corpus(Path(tmp) / "tiny.jsonl", 8), args.config)
        offline = run_offline(write_corpus(Path(tmp) / "corpus.jsonl", args.rows), args.config)
    offline["start_seconds"] = tiny["seconds"]
    print(f"offline job: {offline['rows']} rows in {offline['seconds']:.1f} s", flush=True)

    import ray
    from ray import serve

    from serve_app.launch import load_serve_config, start, wait_ready

    url = start(load_serve_config(ROOT / args.config), port=args.port or _free_port())[0]
    model = wait_ready(url)["data"][0]["id"]
    try:
        asyncio.run(probes(url, model, 4))  # Warm-up, discarded.
        idle = summary("idle", asyncio.run(probes(url, model, args.probes)))
        batch = run_batch(url, model, args.rows, args.probes)
    finally:
        serve.shutdown()
        ray.shutdown()
    offline_rate = offline["rows"] / offline["seconds"]
    running = offline["seconds"] - offline["start_seconds"]
    steady_rate = offline["rows"] / running if running > 0 else float("nan")
    batch_rate = batch["rows"] / batch["seconds"]
    during = batch["during"]
    print(
        f"offline Ray Data job  {offline['rows']:>6} rows {offline_rate:8.2f} rows/s "
        f"({steady_rate:.2f} rows/s without its {offline['start_seconds']:.0f} s start)"
    )
    print(
        f"Batch API             {batch['rows']:>6} rows {batch_rate:8.2f} rows/s "
        f"({batch_rate / offline_rate:.2f}x of the offline job, "
        f"{batch_rate / steady_rate:.2f}x without its start)"
    )
    for name, result in (("idle", idle), ("during the batch", during)):
        print(
            f"interactive TTFT p50 {name:<17} {result['ttft_p50_s'] * 1000:8.0f} ms "
            f"(p90 {result['ttft_p90_s'] * 1000:.0f} ms, failed {result['failed']})"
        )
    print(f"TTFT p50 during / idle: {during['ttft_p50_s'] / idle['ttft_p50_s']:.2f}x")
    report = {"offline": offline, "batch_api": batch, "idle": idle, "rows": args.rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

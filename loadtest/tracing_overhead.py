"""Tracing on vs off, same run: output tok/s and TTFT p50 at a fixed concurrency.

"On" records every span in memory in each replica (the instrumentation cost without a
collector's network cost). Runs alternate off/on ``--repeats`` times so drift on a shared
machine hits both sides; the ratio compares the medians.
``python -m loadtest.tracing_overhead [--config ...] [--repeats 2]``
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from pathlib import Path
from typing import Any

from loadtest.client import closed_loop, percentile


def run_one(args: argparse.Namespace, exporter: str) -> dict[str, Any]:
    import ray
    from ray import serve

    from serve_app.launch import load_serve_config, start, wait_ready

    url = start(
        load_serve_config(args.config),
        port=args.port,
        overrides={"tracing": {"exporter": exporter}},
    )[0]
    model = wait_ready(url)["data"][0]["id"]
    bodies = [
        {
            "model": model,
            "max_tokens": args.max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "messages": [{"role": "user", "content": f"Describe city number {i} in detail."}],
        }
        for i in range(args.requests)
    ]
    asyncio.run(closed_loop(url, bodies[:4], 4))  # Warm-up, discarded.
    records, wall = asyncio.run(closed_loop(url, bodies, args.concurrency))
    serve.shutdown()
    ray.shutdown()
    time.sleep(2)
    ok = [r for r in records if r.ok]
    return {
        "tracing": exporter,
        "failed": len(records) - len(ok),
        "output_tok_per_s": sum(r.output_tokens for r in ok) / wall,
        "ttft_p50_s": percentile([r.ttft_s for r in ok], 50),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="serve_config.cpu.yaml")
    parser.add_argument("--requests", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=2, help="off/on pairs, interleaved.")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--port", type=int, default=8079)
    parser.add_argument("--out", default="results/tracing_overhead.json")
    args = parser.parse_args()
    runs = []
    for _ in range(args.repeats):
        for exporter in ("none", "memory"):
            runs.append(run_one(args, exporter))
            r = runs[-1]
            print(
                f"tracing {r['tracing']:<7} out tok/s {r['output_tok_per_s']:8.1f}   "
                f"TTFT p50 {r['ttft_p50_s'] * 1000:7.0f} ms   failed {r['failed']}",
                flush=True,
            )
    off, on = (
        statistics.median(r["output_tok_per_s"] for r in runs if r["tracing"] == exporter)
        for exporter in ("none", "memory")
    )
    print(f"median out tok/s: off {off:.1f}, on {on:.1f} -> on/off {on / off:.3f}x")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"runs": runs, "on_over_off": on / off}, indent=2))


if __name__ == "__main__":
    main()

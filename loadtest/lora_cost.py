"""The cost of LoRA: base vs adapter throughput at c=32 on one engine replica, in one run.

One app (serve_config.cpu.yaml, LoRA on, one adapter slot) serves the base model and a marker
adapter (``serve_app.models.marker_adapter``); rounds of base, adapter and half-and-half traffic
alternate (``--repeats``) so load on the machine hits all three alike. Every request generates
exactly ``--max-tokens`` tokens (``ignore_eos``), so the three do the same work. ``--plain``
then starts the same app without LoRA for the base model's cost of a LoRA-enabled engine (a
second engine, measured after the first: not side by side).

``python -m loadtest.lora_cost [--repeats 3] [--requests 96] [--plain]``
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import socket
import statistics
import time
from pathlib import Path
from typing import Any

from loadtest.client import closed_loop, percentile

TOPICS = [
    "the moon", "volcanoes", "bread", "rivers", "chess", "owls", "glaciers", "trains",
    "coffee", "bees", "deserts", "violins", "comets", "forests", "bridges", "salt",
]  # fmt: skip
ADAPTER = "banana"


def bodies(models: list[str], count: int, max_tokens: int, offset: int) -> list[dict[str, Any]]:
    """Distinct prompts (no prefix cache hits between rounds), models in turn."""
    return [
        {
            "model": models[i % len(models)],
            "messages": [
                {
                    "role": "user",
                    "content": f"Note {offset + i}: write a short paragraph about "
                    f"{TOPICS[i % len(TOPICS)]}.",
                }
            ],
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
        }
        for i in range(count)
    ]


def measure(url: str, models: list[str], args: argparse.Namespace, offset: int) -> dict[str, Any]:
    work = bodies(models, args.requests, args.max_tokens, offset)
    records, wall = asyncio.run(closed_loop(url, work, args.concurrency))
    ok = [r for r in records if r.ok]
    errors = collections.Counter(f"{r.status}: {r.error[:120]}" for r in records if not r.ok)
    return {
        "requests": len(records),
        "failed": len(records) - len(ok),
        "errors": dict(errors),
        "output_tok_per_s": sum(r.output_tokens for r in ok) / wall,
        "ttft_p50_s": percentile([r.ttft_s for r in ok], 50),
        "tpot_p50_s": percentile([r.tpot_s for r in ok], 50),
    }


def serve_app(lora: bool, args: argparse.Namespace) -> tuple[str, str]:
    from serve_app.launch import load_serve_config, start, wait_ready
    from serve_app.models.marker_adapter import marker_adapter

    overrides: dict[str, Any] = {"engine": {"kv_cache_space_gib": args.kv_cache_gib}}
    if lora:
        adapter = str(marker_adapter("BANANA"))
        overrides["lora"] = {"adapters": {ADAPTER: adapter}, "max_loras": 1, "max_lora_rank": 8}
    url = start(load_serve_config(args.config), port=args.port, overrides=overrides)[0]
    model = str(wait_ready(url)["data"][0]["id"])
    warm = [model, ADAPTER] if lora else [model]
    asyncio.run(closed_loop(url, bodies(warm, 4, 4, 10_000), 4))  # Adapter load, first steps.
    return url, model


def stop() -> None:
    import ray
    from ray import serve

    serve.shutdown()
    ray.shutdown()
    time.sleep(2)


def run(args: argparse.Namespace) -> dict[str, Any]:
    url, model = serve_app(lora=True, args=args)
    cases = {"base": [model], "adapter": [ADAPTER], "mixed": [model, ADAPTER]}
    rounds: dict[str, list[dict[str, Any]]] = {case: [] for case in cases}
    for repeat in range(args.repeats):
        for i, (case, models) in enumerate(cases.items()):
            result = measure(url, models, args, offset=(repeat * 3 + i) * args.requests)
            rounds[case].append(result)
            print(f"[{case} #{repeat}] {json.dumps(result)}", flush=True)
    stop()
    if args.plain:
        url, model = serve_app(lora=False, args=args)
        rounds["base, LoRA off"] = [measure(url, [model], args, offset=0)]
        stop()
    return rounds


def free_port() -> int:
    # Serve's proxy shares its port (SO_REUSEPORT) with any other on this machine: a fixed
    # port can mix another app's answers into the figures.
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def median(results: list[dict[str, Any]], key: str) -> float:
    return statistics.median(r[key] for r in results)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="serve_config.cpu.yaml")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--requests", type=int, default=96, help="requests per round")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3, help="rounds of each case")
    parser.add_argument("--kv-cache-gib", type=int, default=2)
    parser.add_argument("--plain", action="store_true", help="also base on a LoRA-off engine")
    parser.add_argument("--port", type=int, default=None, help="default: a free one")
    parser.add_argument("--out", default="results/lora_cost.json")
    args = parser.parse_args()
    args.port = args.port or free_port()
    rounds = run(args)
    base = median(rounds["base"], "output_tok_per_s")
    print(f"\n{'traffic':<16}{'out tok/s':>10}{'vs base':>9}{'TTFT p50':>10}{'TPOT p50':>10}")
    for case, results in rounds.items():
        tok_s = median(results, "output_tok_per_s")
        print(
            f"{case:<16}{tok_s:>10.1f}{tok_s / base:>8.2f}x"
            f"{median(results, 'ttft_p50_s') * 1000:>8.0f}ms"
            f"{median(results, 'tpot_p50_s') * 1000:>8.0f}ms"
        )
    failed = sum(r["failed"] for results in rounds.values() for r in results)
    print(f"\nmedians of {args.repeats} rounds at c={args.concurrency}; failed requests: {failed}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(rounds, indent=2))


if __name__ == "__main__":
    main()

"""Prefix caching on vs off, same run: one ~1k-token system prompt shared by 64 questions.

Reports TTFT p50 and throughput for both and their ratio.
``python -m loadtest.prefix_cache [--config serve_config.cpu.yaml]``
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path
from typing import Any

from loadtest.client import closed_loop, percentile

CLAUSES = [
    "confidentiality",
    "termination",
    "payment terms",
    "liability",
    "indemnification",
    "governing law",
    "force majeure",
    "assignment",
    "warranties",
    "dispute resolution",
]


def system_prompt() -> str:
    rules = [
        f"Rule {i}: when a question mentions {CLAUSES[i % len(CLAUSES)]}, cite section {i} of "
        "the master agreement, quote the clause verbatim and flag any ambiguity for review."
        for i in range(36)
    ]
    return "You are a meticulous contracts analyst for a law firm. " + " ".join(rules)


def bodies(model: str, count: int, max_tokens: int) -> list[dict[str, Any]]:
    system = system_prompt()
    return [
        {
            "model": model,
            "messages": [
                {"role": "system", "content": system},
                {
                    "role": "user",
                    "content": f"Question {i}: summarize the "
                    f"{CLAUSES[i % len(CLAUSES)]} clause in one sentence.",
                },
            ],
            "max_tokens": max_tokens,
            "temperature": 0,
        }
        for i in range(count)
    ]


def run_one(config_path: str, caching: bool, port: int, args: argparse.Namespace) -> dict[str, Any]:
    import ray
    from ray import serve

    from serve_app.launch import load_serve_config, start, wait_ready

    serve_config = load_serve_config(config_path)
    url = start(serve_config, port=port, overrides={"engine": {"enable_prefix_caching": caching}})[
        0
    ]
    model = wait_ready(url)["data"][0]["id"]
    asyncio.run(closed_loop(url, bodies(model, 4, 2), 2))  # Warm-up, discarded.
    # Different question numbers than the warm-up: only the system prompt is shared.
    work = bodies(model, args.requests + 4, args.max_tokens)[4:]
    records, wall = asyncio.run(closed_loop(url, work, args.concurrency))
    serve.shutdown()
    ray.shutdown()
    time.sleep(2)
    ok = [r for r in records if r.ok]
    return {
        "prefix_caching": caching,
        "requests": len(records),
        "failed": len(records) - len(ok),
        "prompt_tokens_mean": sum(r.prompt_tokens for r in ok) / max(len(ok), 1),
        "cached_tokens_mean": sum(r.cached_tokens for r in ok) / max(len(ok), 1),
        "ttft_p50_s": percentile([r.ttft_s for r in ok], 50),
        "ttft_p90_s": percentile([r.ttft_s for r in ok], 90),
        "req_per_s": len(ok) / wall,
        "output_tok_per_s": sum(r.output_tokens for r in ok) / wall,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="serve_config.cpu.yaml")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--port", type=int, default=8078)
    parser.add_argument("--out", default="results/prefix_cache.json")
    args = parser.parse_args()
    results = [run_one(args.config, caching, args.port, args) for caching in (True, False)]
    on, off = results
    print(
        f"\n{'prefix caching':<16}{'prompt tok':>11}{'cached':>8}{'TTFT p50':>10}"
        f"{'TTFT p90':>10}{'req/s':>8}{'out tok/s':>10}"
    )
    for r in results:
        print(
            f"{'on' if r['prefix_caching'] else 'off':<16}{r['prompt_tokens_mean']:>11.0f}"
            f"{r['cached_tokens_mean']:>8.0f}{r['ttft_p50_s'] * 1000:>8.0f}ms"
            f"{r['ttft_p90_s'] * 1000:>8.0f}ms{r['req_per_s']:>8.2f}{r['output_tok_per_s']:>10.1f}"
        )
    print(
        f"\nTTFT p50 off/on: {off['ttft_p50_s'] / on['ttft_p50_s']:.2f}x   "
        f"throughput on/off: {on['output_tok_per_s'] / off['output_tok_per_s']:.2f}x"
    )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()

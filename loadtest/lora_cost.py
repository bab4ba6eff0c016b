"""The cost of LoRA: output tok/s at c=32 on one engine replica, base vs adapters, in one run.

Two apps, one after the other, same engine settings: LoRA off (the plain base model), then LoRA
on with two adapters (every linear layer, rank 16, seeded random weights: the kernels cost the
same as a trained adapter's). On the second, phases alternate: base requests, one adapter, and
a mix of base and both adapters (vLLM mixes them in one step up to ``max_loras``). Every phase
sends the same streamed chats (distinct prompts, fixed output length), closed loop; ``--repeats``
runs the phases N times and reports medians, with ratios to the LoRA-off base.

    python -m loadtest.lora_cost [--concurrency 32] [--requests 96] [--repeats 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from loadtest.client import RequestRecord, closed_loop, percentile

ROOT = Path(__file__).resolve().parents[1]
ADAPTERS = ("adapter-a", "adapter-b")
PHASES = ("base", "adapter", "mixed")


def bodies(phase: str, model: str, count: int, max_tokens: int, offset: int) -> list[dict]:
    """``count`` chats; ``mixed``: base and the two adapters in turn."""
    names = {"base": [model], "adapter": [ADAPTERS[0]], "mixed": [model, *ADAPTERS]}[phase]
    return [
        {
            "model": names[i % len(names)],
            "messages": [
                {"role": "user", "content": f"Story {offset + i}: a lighthouse keeper's year."}
            ],
            "max_tokens": max_tokens,
            "ignore_eos": True,  # Every request the same length: only the engine's speed differs.
            "temperature": 0,
        }
        for i in range(count)
    ]


def measure(url: str, phase: str, model: str, args: argparse.Namespace, offset: int) -> dict:
    work = bodies(phase, model, args.requests, args.max_tokens, offset)
    records, seconds = asyncio.run(closed_loop(url, work, args.concurrency))
    ok: list[RequestRecord] = [r for r in records if r.ok]
    if len(ok) < len(records):
        failed = next(r for r in records if not r.ok)
        raise RuntimeError(f"{phase}: {len(records) - len(ok)} requests failed: {failed.error}")
    return {
        "tok_per_s": sum(r.output_tokens for r in ok) / seconds,
        "ttft_p50_s": percentile([r.ttft_s for r in ok], 50),
    }


def run_app(lora: dict[str, str], phases: list[str], args: argparse.Namespace) -> dict[str, list]:
    """Start the app (``lora``: its adapters, none: LoRA off), run every phase ``repeats``
    times in turn, stop it."""
    import ray
    from ray import serve

    from serve_app.launch import load_serve_config, start, wait_ready

    engine: dict[str, Any] = {"max_num_seqs": max(args.concurrency, 32)}
    if lora:
        engine["vllm_args"] = {"max_loras": len(lora), "max_lora_rank": args.rank}
    overrides = {"model": {"lora_adapters": lora}, "engine": engine}
    url = start(load_serve_config(ROOT / args.config), port=args.port, overrides=overrides)[0]
    results: dict[str, list] = {phase: [] for phase in phases}
    try:
        model = wait_ready(url)["data"][0]["id"]
        for phase in phases:  # Warm-up: compile, load the adapters; discarded.
            asyncio.run(closed_loop(url, bodies(phase, model, 8, 8, 10**6), 8))
        for repeat in range(args.repeats):
            for phase in phases:
                result = measure(url, phase, model, args, offset=repeat * 10_000)
                print(f"  {'lora' if lora else 'no lora'} {phase}: {result}", flush=True)
                results[phase].append(result)
    finally:
        serve.shutdown()
        ray.shutdown()
        time.sleep(2)
    return results


def median(results: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in results)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="serve_config.cpu.yaml")
    parser.add_argument("--port", type=int, default=8078)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--requests", type=int, default=96, help="requests per phase")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default="results/lora_cost.json")
    args = parser.parse_args(argv)
    from serve_app.config import AppConfig
    from serve_app.launch import load_serve_config
    from serve_app.models import resolve_model
    from serve_app.models.lora_adapter import ALL_TARGETS, build_lora_adapter

    app = load_serve_config(ROOT / args.config)["applications"][0]
    base = resolve_model(AppConfig.model_validate(app.get("args") or {}).model.name)
    with tempfile.TemporaryDirectory() as folder:
        lora = {
            name: str(
                build_lora_adapter(
                    base, Path(folder) / name, seed=seed, rank=args.rank, targets=ALL_TARGETS
                )
            )
            for seed, name in enumerate(ADAPTERS, start=1)
        }
        plain = run_app({}, ["base"], args)
        with_lora = run_app(lora, list(PHASES), args)
    reference = median(plain["base"], "tok_per_s")
    print(
        f"\nc={args.concurrency}, {args.requests} requests x {args.max_tokens} tokens per phase, "
        f"median of {args.repeats}; adapters: rank {args.rank}, every linear layer\n"
        "| engine | requests | output tok/s | vs LoRA off | TTFT p50 |\n|---|---|---:|---:|---:|"
    )
    rows = [("LoRA off", "base", plain["base"])]
    rows += [("LoRA on", phase, with_lora[phase]) for phase in PHASES]
    labels = {"base": "base model", "adapter": "one adapter", "mixed": "base + 2 adapters"}
    for engine, phase, results in rows:
        tok = median(results, "tok_per_s")
        ttft = median(results, "ttft_p50_s")
        print(
            f"| {engine} | {labels[phase]} | {tok:.0f} | {tok / reference:.2f}x | "
            f"{ttft * 1000:.0f} ms |"
        )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    summary = {"args": vars(args), "lora_off": plain, "lora_on": with_lora}
    Path(args.out).write_text(json.dumps(summary, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

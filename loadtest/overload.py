"""Open-loop Poisson load stepping past saturation: goodput and rejections, fixed vs autoscaled.

For each mode (``fixed``: one engine replica with bounded queues; ``auto``: the same engine with
queue-depth autoscaling, 1..``--max-replicas``) the script deploys its own app next to nothing
else, then offers Poisson arrivals at each rate of ``--rates`` for ``--step-s`` seconds. Open
loop: arrivals do not wait for answers, so past saturation the server must shed load (503/429)
or queue it (TTFT grows). Per step it reports goodput (requests/s answered with TTFT ≤
``--ttft-slo``), the rejection rate, other errors and TTFT percentiles.

    python -m loadtest.overload --rates 1,2,4,8,16 --step-s 30 --modes fixed,auto
    python -m loadtest.overload --rates 1,4 --step-s 5 --modes fixed   # smoke run
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from loadtest.client import RequestRecord, make_http, percentile, stream_chat

ROOT = Path(__file__).resolve().parents[1]

# Bounded queues so overload turns into fast rejections rather than unbounded waiting.
FIXED: dict[str, Any] = {
    "engine": {
        "kv_cache_space_gib": 1,
        "max_ongoing_requests": 16,
        "max_queued_requests": 16,
        "num_cpus": 0.1,
    },
    "router": {"num_cpus": 0.05, "max_ongoing_requests": 64, "max_queued_requests": 64},
    "preprocessor": {"num_cpus": 0.05},
    "engine_wait_timeout_s": 10,
    "request_timeout_s": 60,
}


def auto_overrides(max_replicas: int) -> dict[str, Any]:
    engine = FIXED["engine"] | {
        "num_replicas": "auto",
        "min_replicas": 1,
        "max_replicas": max_replicas,
        "autoscaling": {
            "target_queue_depth": 8,
            "upscale_delay_s": 5,
            "downscale_delay_s": 30,
            "look_back_period_s": 5,
            "metrics_interval_s": 1,
        },
    }
    return FIXED | {"engine": engine}


@dataclass
class Step:
    mode: str
    rate: float
    offered: int
    ok: int
    good: int
    rejected: int
    errors: int
    seconds: float
    ttft_p50_s: float
    ttft_p99_s: float

    @property
    def goodput(self) -> float:
        return self.good / self.seconds

    @property
    def rejection_rate(self) -> float:
        return self.rejected / self.offered if self.offered else 0.0


async def run_step(
    url: str, body: dict[str, Any], rate: float, seconds: float, seed: int
) -> list[RequestRecord]:
    """Poisson arrivals at ``rate`` per second for ``seconds``; waits for every answer."""
    rng = random.Random(seed)
    tasks: list[asyncio.Task[RequestRecord]] = []
    async with make_http(1024, timeout_s=120) as http:
        end = time.perf_counter() + seconds
        next_at = time.perf_counter()
        while True:
            next_at += rng.expovariate(rate)
            if next_at >= end:
                break
            await asyncio.sleep(max(0.0, next_at - time.perf_counter()))
            tasks.append(asyncio.create_task(stream_chat(http, url, body)))
        return list(await asyncio.gather(*tasks))


def summarize(
    mode: str, rate: float, seconds: float, records: list[RequestRecord], slo: float
) -> Step:
    ok = [r for r in records if r.ok]
    rejected = [r for r in records if r.status in (429, 503)]
    ttfts = [r.ttft_s for r in ok]
    return Step(
        mode=mode,
        rate=rate,
        offered=len(records),
        ok=len(ok),
        good=sum(r.ttft_s <= slo for r in ok),
        rejected=len(rejected),
        errors=len(records) - len(ok) - len(rejected),
        seconds=seconds,
        ttft_p50_s=percentile(ttfts, 50),
        ttft_p99_s=percentile(ttfts, 99),
    )


def deploy(base_url: str, name: str, overrides: dict[str, Any], config: str) -> str:
    from ray import serve

    from serve_app import build_app
    from serve_app.launch import _merge, load_serve_config, wait_ready

    args = load_serve_config(ROOT / config)["applications"][0].get("args") or {}
    serve.run(
        build_app(_merge(args, overrides)), name=name, route_prefix=f"/{name}", blocking=False
    )
    url = f"{base_url}/{name}"
    wait_ready(url, timeout_s=600)
    return url


def engine_replicas(app: str) -> int:
    from ray import serve

    states = serve.status().applications[app].deployments["Engine"].replica_states
    return int(sum(n for state, n in states.items() if str(state).endswith("RUNNING")))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="serve_config.cpu.yaml")
    parser.add_argument("--port", type=int, default=8078)
    parser.add_argument("--rates", default="1,2,4,8,16", help="Requests/s, comma-separated.")
    parser.add_argument("--step-s", type=float, default=30)
    parser.add_argument("--modes", default="fixed,auto")
    parser.add_argument("--max-replicas", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--ttft-slo", type=float, default=1.0, help="Goodput TTFT bound (s).")
    parser.add_argument("--out", default="results/overload.json")
    args = parser.parse_args(argv)

    import ray
    from ray import serve

    from serve_app.config import AppConfig
    from serve_app.launch import init_local_ray, load_serve_config

    app_args = load_serve_config(ROOT / args.config)["applications"][0].get("args") or {}
    model = AppConfig.model_validate(app_args).model.public_name
    body = {
        "model": model,
        "max_tokens": args.max_tokens,
        "ignore_eos": True,
        "messages": [{"role": "user", "content": "Describe the sea in a few sentences."}],
    }
    init_local_ray([app_args], dashboard=False)
    serve.start(http_options={"host": "127.0.0.1", "port": args.port})
    base = f"http://127.0.0.1:{args.port}"
    rates = [float(r) for r in args.rates.split(",")]
    steps: list[Step] = []
    try:
        for mode in args.modes.split(","):
            overrides = FIXED if mode == "fixed" else auto_overrides(args.max_replicas)
            name = f"overload-{mode}"
            url = deploy(base, name, overrides, args.config)
            asyncio.run(run_step(url, body, 1, 3, seed=0))  # Warm-up, discarded.
            for i, rate in enumerate(rates):
                records = asyncio.run(run_step(url, body, rate, args.step_s, seed=i))
                step = summarize(mode, rate, args.step_s, records, args.ttft_slo)
                steps.append(step)
                print(
                    f"{mode:<6} {rate:>6.1f}/s offered {step.offered:>4} ok {step.ok:>4} "
                    f"goodput {step.goodput:>6.2f}/s rejected {step.rejection_rate:>6.1%} "
                    f"errors {step.errors:>3} TTFT p50 {step.ttft_p50_s:6.2f} s "
                    f"p99 {step.ttft_p99_s:6.2f} s engines {engine_replicas(name)}",
                    flush=True,
                )
            serve.delete(name)
    finally:
        serve.shutdown()
        ray.shutdown()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(
        json.dumps(
            [asdict(s) | {"goodput": s.goodput, "rejection_rate": s.rejection_rate} for s in steps],
            indent=2,
        )
    )
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

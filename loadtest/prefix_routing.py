"""Cache-aware routing on the real stack: Serve's default router vs Ray's
PrefixCacheAffinityRouter vs ours, in one run with identical engine args.

Two engine replicas, each with a KV cache too small for the workload's distinct system prompts
(1 GiB of CPU KV space: 46,592 tokens for SmolLM2-135M) while the fleet's two hold them all:
~3k-token system prompts x a few questions each, shuffled, sent at a fixed concurrency. Every
router gets a fresh deployment (cold caches) and the same request order. Reports the fleet's
prefix-cache hit rate (sum of usage.prompt_tokens_details.cached_tokens over sum of
prompt_tokens) against the ideal (each system prompt prefilled once fleet-wide), TTFT p50/p90,
and the ratios the issue sets targets for.

``python -m loadtest.prefix_routing`` (24 prompts x 4 questions, c=4; ~10 min on 2 cores);
``--prompts 6 --questions 3`` for a smoke run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import random
import socket
import time
from pathlib import Path
from typing import Any

from loadtest.client import closed_loop, percentile
from serve_app.config import AppConfig
from serve_app.hops import PreprocessRequest, SamplingSpec

POLICIES = ("default", "ray_prefix_cache", "prefix_aware")
TOPICS = ["billing", "shipping", "returns", "warranty", "privacy", "accounts", "outages", "fraud"]


def system_prompt(k: int, rules: int) -> str:
    """A distinct system prompt per k (distinct from its first words), ~31 tokens per rule."""
    lines = [
        f"Rule {k}-{i}: when a customer of branch {k} asks about {TOPICS[(i + k) % 8]}, check "
        f"ticket class {(i * 37 + k * 11) % 97} and answer within {i % 9 + 1} sentences."
        for i in range(rules)
    ]
    return f"Branch {k} support handbook. You answer for branch {k} only. " + " ".join(lines)


def workload(
    model: str, prompts: int, questions: int, rules: int, max_tokens: int, seed: int
) -> list[dict[str, Any]]:
    bodies = [
        {
            "model": model,
            "messages": [
                {"role": "system", "content": system_prompt(k, rules)},
                {"role": "user", "content": f"Question {q}: how do I handle {TOPICS[q % 8]}?"},
            ],
            "max_tokens": max_tokens,
            "temperature": 0,
        }
        for k in range(prompts)
        for q in range(questions)
    ]
    random.Random(seed).shuffle(bodies)
    return bodies


def ideal_hit_rate(bodies: list[dict[str, Any]], config: AppConfig, block: int) -> float:
    """Each system prompt prefilled once fleet-wide: a repeat hits on the whole blocks it
    shares with the first request of its prompt (vLLM caches whole blocks)."""
    from serve_app.models import resolve_model
    from serve_app.preprocess.preprocessor import Preprocessor

    preprocessor = Preprocessor(config, resolve_model(config.model.name))
    first: dict[str, list[int]] = {}
    cached = total = 0
    for body in bodies:
        request = PreprocessRequest("t", "chat", SamplingSpec(), messages=body["messages"])
        ids = preprocessor.tokenize(request, None)
        total += len(ids)
        seen = first.setdefault(body["messages"][0]["content"], ids)
        if seen is not ids:
            pairs = zip(seen, ids, strict=False)
            common = next((i for i, (a, b) in enumerate(pairs) if a != b), len(ids) - 1)
            cached += common // block * block
    return cached / total


def app_args(args: argparse.Namespace, policy: str) -> dict[str, Any]:
    return {
        "model": {"name": args.model, "max_model_len": 4096, "dtype": "auto"},
        "engine": {
            "device": "cpu",
            "num_replicas": 2,
            "kv_cache_space_gib": args.kv_gib,
            "enforce_eager": True,
            "block_size": 32,
            "max_num_seqs": 64,
            "num_cpus": 0.1,
            "routing": {"policy": policy},
        },
        "preprocessor": {"num_cpus": 0.05},
        "router": {"num_cpus": 0.05},
    }


def wait_for_engines(app: str, running: int, timeout_s: float = 900) -> None:
    from ray import serve

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        status = serve.status().applications.get(app)
        engine = status.deployments.get("Engine") if status else None
        states = {str(s): n for s, n in (engine.replica_states if engine else {}).items() if n}
        if states == ({"RUNNING": running} if running else {}):
            return
        time.sleep(1)
    raise TimeoutError(f"{app}: engines not at {running} replicas after {timeout_s:.0f} s")


def run_policy(
    policy: str, args: argparse.Namespace, base: str, bodies: list[dict[str, Any]]
) -> dict[str, Any]:
    from ray import serve

    from serve_app import build_app
    from serve_app.launch import wait_ready

    serve.run(build_app(app_args(args, policy)), name="bench", route_prefix="/", blocking=False)
    wait_ready(base, timeout_s=900)
    wait_for_engines("bench", 2)
    print(f"[{policy}] 2 engine replicas running; {len(bodies)} requests at c={args.concurrency}")
    records, wall = asyncio.run(closed_loop(base, bodies, args.concurrency))
    serve.delete("bench")
    ok = [r for r in records if r.ok]
    prompt_tokens = sum(r.prompt_tokens for r in ok)
    result = {
        "policy": policy,
        "requests": len(records),
        "failed": len(records) - len(ok),
        "hit_rate": sum(r.cached_tokens for r in ok) / max(prompt_tokens, 1),
        "ttft_p50_s": percentile([r.ttft_s for r in ok], 50),
        "ttft_p90_s": percentile([r.ttft_s for r in ok], 90),
        "wall_s": wall,
    }
    print(f"[{policy}] " + ", ".join(f"{k} {v:.3g}" for k, v in result.items() if k != "policy"))
    return result


def report(results: dict[str, dict[str, Any]], ideal: float) -> dict[str, float]:
    print(
        f"\n{'router':<18}{'hit rate':>9}{'of ideal':>9}{'TTFT p50':>10}{'TTFT p90':>10}"
        f"{'wall':>8}{'failed':>7}"
    )
    for name, r in results.items():
        print(
            f"{name:<18}{r['hit_rate']:>9.2f}{r['hit_rate'] / ideal:>9.2f}"
            f"{r['ttft_p50_s'] * 1e3:>8.0f}ms{r['ttft_p90_s'] * 1e3:>8.0f}ms"
            f"{r['wall_s']:>7.0f}s{r['failed']:>7}"
        )
    ratios: dict[str, float] = {}
    ours, default, ray = (results.get(p) for p in ("prefix_aware", "default", "ray_prefix_cache"))
    if ours:
        ratios["hit/ideal"] = ours["hit_rate"] / ideal
    if ours and default:
        ratios["hit/default"] = ours["hit_rate"] / max(default["hit_rate"], 1e-9)
        ratios["ttft_p50/default"] = ours["ttft_p50_s"] / default["ttft_p50_s"]
    if ours and ray:
        ratios["ttft_p50/ray"] = ours["ttft_p50_s"] / ray["ttft_p50_s"]
    targets = {"hit/ideal": (">=", 0.85), "hit/default": (">=", 1.5)}
    targets |= {"ttft_p50/default": ("<=", 0.7), "ttft_p50/ray": ("<=", 1.0)}
    print(f"\nideal hit rate {ideal:.2f}; ours (prefix_aware):")
    for key, value in ratios.items():
        op, bound = targets[key]
        met = value >= bound if op == ">=" else value <= bound
        print(f"  {key:<18}{value:>6.2f}  (target {op} {bound}: {'met' if met else 'MISSED'})")
    return ratios


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--prompts", type=int, default=24, help="distinct system prompts")
    parser.add_argument("--questions", type=int, default=4, help="requests per system prompt")
    parser.add_argument("--rules", type=int, default=95, help="~31 tokens each (95: ~3k)")
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--kv-gib", type=int, default=1, help="KV cache per engine replica")
    parser.add_argument("--policies", nargs="+", default=list(POLICIES), choices=POLICIES)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--port", type=int, default=0, help="0: any free port")
    parser.add_argument("--out", default="results/prefix_routing.json")
    args = parser.parse_args()
    logging.getLogger("httpx").setLevel(logging.WARNING)  # One line per request otherwise.

    import ray
    from ray import serve

    from serve_app.launch import init_local_ray

    config = AppConfig.model_validate(app_args(args, "default"))
    bodies = workload(
        config.model.public_name,
        args.prompts,
        args.questions,
        args.rules,
        args.max_tokens,
        args.seed,
    )
    ideal = ideal_hit_rate(bodies, config, block=32)
    port = args.port or _free_port()
    init_local_ray([app_args(args, "default")], dashboard=False)
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    base = f"http://127.0.0.1:{port}"
    results: dict[str, dict[str, Any]] = {}
    try:
        for policy in args.policies:
            results[policy] = run_policy(policy, args, base, bodies)
            wait_for_engines("bench", 0)
    finally:
        serve.shutdown()
        ray.shutdown()
    ratios = report(results, ideal)
    out = {"args": vars(args), "ideal_hit_rate": ideal, "results": results, "ratios": ratios}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()

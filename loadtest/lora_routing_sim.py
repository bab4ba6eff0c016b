"""LoRA adapters at fleet scale, simulated: adapter-aware routing vs the same router blind to
adapters vs Serve's default, at 8 and 64 engine replicas.

Drives the real ``RoutingPolicy`` (one instance per caller process) and Serve's real
``PowerOfTwoChoicesRequestRouter`` against simulated replicas:

* Adapters: each replica keeps ``max_cpu_loras`` adapters loaded (LRU, as vLLM's CPU cache);
  a request whose adapter is not loaded there first pays ``load_s`` (read from disk, copy in).
* Service: one FIFO server per replica; service = overhead + prefill + decode (+ the load).
  TTFT = queue wait + overhead + load + prefill.
* Workload: ``n_adapters`` adapters drawn Zipf(alpha), ``base_share`` of requests on the base
  model, every prompt its own (no shared prefix: only the adapter can place a request); Poisson
  arrivals at ``--util`` of the fleet without loads.

``python -m loadtest.lora_routing_sim`` (about 10 s on one core).
"""

from __future__ import annotations

import argparse
import heapq
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from loadtest.routing_baselines import serve_default
from serve_app.config.routing import RoutingConfig
from serve_app.engine.routing.policy import RoutingPolicy

POLICIES = ("ours", "ours-x4", "adapter-blind", "serve-default")


@dataclass(frozen=True)
class Params:
    n_adapters: int = 200
    alpha: float = 1.0
    base_share: float = 0.3
    max_cpu_loras: int = 8
    load_s: float = 0.25  # A rank-16 adapter of a 7B model (~40 MB) from local disk.
    prompt_tokens: tuple[int, int] = (200, 1500)
    out_tokens: tuple[int, int] = (50, 350)
    block_size: int = 64
    overhead_s: float = 0.005
    prefill_s_per_token: float = 50e-6
    decode_s_per_token: float = 0.8e-3
    util: float = 0.7
    spill_margin: int = 1
    spill_ratio: float = 0.5
    seed: int = 1


class Workload:
    def __init__(self, p: Params, n_replicas: int, n_requests: int) -> None:
        rng = np.random.default_rng(p.seed)
        weights = 1.0 / np.arange(1, p.n_adapters + 1) ** p.alpha
        adapter = rng.choice(p.n_adapters, n_requests, p=weights / weights.sum())
        base = rng.random(n_requests) < p.base_share
        self.adapter: list[int | None] = [
            None if b else int(a) for a, b in zip(adapter, base, strict=True)
        ]
        self.prompt_len = rng.integers(*p.prompt_tokens, n_requests)
        self.out_len = rng.integers(*p.out_tokens, n_requests)
        self.hash_base = rng.integers(1, 2**62, n_requests)  # Never-shared prompt blocks.
        service = (
            p.overhead_s
            + p.prefill_s_per_token * self.prompt_len
            + p.decode_s_per_token * self.out_len
        ).mean()
        self.arrival = np.cumsum(rng.exponential(service / (p.util * n_replicas), n_requests))

    def hashes(self, i: int, bs: int) -> list[int]:
        base = int(self.hash_base[i])
        return [base + k for k in range(int(self.prompt_len[i]) // bs)]


Chooser = Callable[[int, list[int], str | None], int]


def _ours(
    names: list[str], queues: dict[str, int], p: Params, callers: int, blind: bool
) -> Chooser:
    config = RoutingConfig(
        block_size=p.block_size,
        spill_margin=p.spill_margin,
        spill_ratio=p.spill_ratio,
        cold_placement="least_loaded" if callers == 1 else "hrw",
    )
    policies = [RoutingPolicy(config, seed=p.seed + k) for k in range(callers)]
    for policy in policies:
        policy.set_replicas(names)
    index = {n: i for i, n in enumerate(names)}
    caller = np.random.default_rng(p.seed).integers(0, callers, 10**6)

    def choose(i: int, hashes: list[int], adapter: str | None) -> int:
        policy = policies[caller[i % len(caller)]]
        return index[
            policy.choose(hashes, queues, names, adapter=None if blind else adapter).replica
        ]

    return choose


def simulate(policy: str, n: int, wl: Workload, p: Params) -> dict[str, float]:
    names = [f"replica-{k:03d}" for k in range(n)]
    queues = {name: 0 for name in names}
    on_queue: Callable[[str], None] | None = None
    choose: Chooser
    if policy == "serve-default":
        pick, on_queue = serve_default(names, queues)

        def by_load(i: int, hashes: list[int], adapter: str | None) -> int:
            return pick(i, hashes)

        choose = by_load
    else:
        choose = _ours(names, queues, p, 4 if policy == "ours-x4" else 1, policy == "adapter-blind")
    loaded = [OrderedDict[int, None]() for _ in range(n)]
    holders: dict[int, set[int]] = {}
    busy_until, done = [0.0] * n, list[tuple[float, int]]()
    warm, ttft = len(wl.arrival) // 4, list[float]()
    loads = adapter_requests = 0
    for i, t in enumerate(wl.arrival.tolist()):
        while done and done[0][0] <= t:
            _, r = heapq.heappop(done)
            queues[names[r]] -= 1
            if on_queue:
                on_queue(names[r])
        adapter = wl.adapter[i]
        r = choose(i, wl.hashes(i, p.block_size), None if adapter is None else f"a{adapter}")
        load = 0.0
        if adapter is not None:
            if adapter in loaded[r]:
                loaded[r].move_to_end(adapter)
            else:
                load = p.load_s
                loaded[r][adapter] = None
                if len(loaded[r]) > p.max_cpu_loras:
                    loaded[r].popitem(last=False)
            holders.setdefault(adapter, set()).add(r)
        prefill = p.overhead_s + load + p.prefill_s_per_token * int(wl.prompt_len[i])
        start = max(t, busy_until[r])
        busy_until[r] = start + prefill + p.decode_s_per_token * int(wl.out_len[i])
        heapq.heappush(done, (busy_until[r], r))
        queues[names[r]] += 1
        if on_queue:
            on_queue(names[r])
        if i >= warm:
            ttft.append(start - t + prefill)
            if adapter is not None:
                adapter_requests += 1
                loads += load > 0
    return {
        "loads_per_1k": 1000 * loads / max(1, adapter_requests),
        "replicas_per_adapter": float(np.mean([len(h) for h in holders.values()])),
        "ttft_p50": float(np.percentile(ttft, 50)),
        "ttft_p99": float(np.percentile(ttft, 99)),
    }


def run(sizes: Sequence[int], per_replica: int, p: Params, policies: Sequence[str]) -> None:
    print(
        f"\n{p.n_adapters} adapters, Zipf a={p.alpha}, {p.base_share:.0%} base requests, "
        f"{p.max_cpu_loras} adapters loaded per replica, load {p.load_s * 1e3:.0f} ms, "
        f"fleet load {p.util:.0%}, spill margin {p.spill_margin}"
    )
    print(
        "| replicas | router | loads per 1k adapter requests | replicas per adapter "
        "| TTFT p50 ms | TTFT p99 ms |"
    )
    print("|---:|---|---:|---:|---:|---:|")
    for n in sizes:
        wl = Workload(p, n, min(max(4000, per_replica * n), 60_000))
        for policy in policies:
            m = simulate(policy, n, wl, p)
            print(
                f"| {n} | {policy} | {m['loads_per_1k']:.0f} | {m['replicas_per_adapter']:.1f} | "
                f"{m['ttft_p50'] * 1e3:.0f} | {m['ttft_p99'] * 1e3:.0f} |",
                flush=True,
            )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[8, 64])
    parser.add_argument("--requests-per-replica", type=int, default=300)
    parser.add_argument("--adapters", type=int, nargs="+", default=[32, Params.n_adapters])
    parser.add_argument("--max-cpu-loras", type=int, default=Params.max_cpu_loras)
    parser.add_argument("--util", type=float, default=Params.util)
    parser.add_argument("--policies", nargs="+", default=list(POLICIES), choices=POLICIES)
    args = parser.parse_args(argv)
    started = time.perf_counter()
    for adapters in args.adapters:
        p = Params(n_adapters=adapters, max_cpu_loras=args.max_cpu_loras, util=args.util)
        run(args.sizes, args.requests_per_replica, p, args.policies)
    print(f"\n{time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()

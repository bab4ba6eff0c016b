"""Routing at fleet scale, simulated: the real routing policy vs Serve's default vs consistent
hashing, at 8, 64 and 256 engine replicas on Zipf-distributed system prompts.

Drives the real ``RoutingPolicy`` (one instance per caller process) and Serve's real
``PowerOfTwoChoicesRequestRouter`` (its ``choose_replicas`` + ``_select_from_candidate_replicas``,
run synchronously: with a warm queue-length cache they never wait) against simulated replicas:

* KV cache: capacity in routing blocks, LRU over whole system prompts and each request's own
  blocks; a prompt hits when its replica still holds it.
* Service: one FIFO server per replica; service = overhead + prefill of the uncached tokens +
  decode (output tokens x amortised time per token). TTFT = queue wait + overhead + prefill.
* Workload: system prompts (2-4k tokens) drawn Zipf(alpha), each request with its own suffix;
  Poisson arrivals at ``--util`` of the fleet if nothing were cached. ``--hot-share`` puts that
  share of all traffic on one prompt (the skewed case).

``python -m loadtest.routing_sim`` (about 15 s on one core); ``--sizes 8`` for a quick look.
"""

from __future__ import annotations

import argparse
import heapq
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import numpy as np

from loadtest.routing_baselines import Chooser, consistent_hash, serve_default
from serve_app.config.routing import RoutingConfig
from serve_app.engine.routing.policy import RoutingPolicy
from serve_app.preprocess.block_hashes import block_hashes


@dataclass(frozen=True)
class Params:
    n_prompts: int = 1000
    alpha: float = 1.1
    prefix_tokens: tuple[int, int] = (2048, 4096)
    suffix_tokens: tuple[int, int] = (50, 500)
    out_tokens: tuple[int, int] = (50, 350)
    block_size: int = 64
    kv_blocks: int = 2000  # Per replica: 128k tokens, ~40 system prompts.
    overhead_s: float = 0.005
    prefill_s_per_token: float = 50e-6  # ~20k prefill tokens/s.
    decode_s_per_token: float = 0.8e-3  # A ~25 ms step shared by ~32 sequences.
    util: float = 0.75
    hot_share: float = 0.0
    spill_margin: int = 1  # The FIFO model queues every request: a margin of whole requests.
    spill_ratio: float = 0.5
    seed: int = 1


class Workload:
    def __init__(self, p: Params, n_replicas: int, n_requests: int) -> None:
        rng = np.random.default_rng(p.seed)
        bs = p.block_size
        self.prefix_len = (rng.integers(*p.prefix_tokens, p.n_prompts) // bs) * bs
        # Real hashes of synthetic prompts, computed as the preprocessor does.
        self.prefix_hashes = [
            block_hashes(rng.integers(0, 150_000, int(n)).tolist(), bs, max_blocks=10_000)
            for n in self.prefix_len
        ]
        weights = 1.0 / np.arange(1, p.n_prompts + 1) ** p.alpha
        probs = weights / weights.sum() * (1 - p.hot_share)
        probs[0] += p.hot_share
        self.prompt = rng.choice(p.n_prompts, n_requests, p=probs)
        self.suffix_len = rng.integers(*p.suffix_tokens, n_requests)
        self.out_len = rng.integers(*p.out_tokens, n_requests)
        self.suffix_base = rng.integers(1, 2**62, n_requests)  # Never-shared suffix blocks.
        cold = (
            p.overhead_s
            + p.prefill_s_per_token * (self.prefix_len[self.prompt] + self.suffix_len)
            + p.decode_s_per_token * self.out_len
        ).mean()
        self.arrival = np.cumsum(rng.exponential(cold / (p.util * n_replicas), n_requests))
        self.ideal_hit = self._ideal_hit()

    def _ideal_hit(self) -> float:
        """One infinite cache, over the measured window (after the first quarter)."""
        seen: set[int] = set()
        cached = total = 0
        for i, prompt in enumerate(self.prompt.tolist()):
            n = int(self.prefix_len[prompt])
            if i >= len(self.prompt) // 4:
                total += n + int(self.suffix_len[i])
                cached += n if prompt in seen else 0
            seen.add(prompt)
        return cached / total

    def hashes(self, i: int, bs: int) -> list[int]:
        base = int(self.suffix_base[i])
        own = [base + k for k in range(int(self.suffix_len[i]) // bs)]
        return [*self.prefix_hashes[self.prompt[i]], *own]


class KVCache:
    """Size-weighted LRU: key -> blocks."""

    def __init__(self, capacity: int) -> None:
        self.capacity, self.used = capacity, 0
        self.lru: OrderedDict[int, int] = OrderedDict()

    def touch(self, key: int, size: int) -> bool:
        hit = key in self.lru
        if hit:
            self.lru.move_to_end(key)
        else:
            self.lru[key] = size
            self.used += size
        while self.used > self.capacity and len(self.lru) > 1:
            self.used -= self.lru.popitem(last=False)[1]
        return hit


def ours(
    names: list[str], queues: dict[str, int], p: Params, callers: int
) -> tuple[Chooser, list[RoutingPolicy]]:
    """``callers`` independent policies (one per Router replica), each seeing a random share,
    with cold placement as ``cold_placement: auto`` resolves it for that many callers."""
    cold = "least_loaded" if callers == 1 else "hrw"
    config = RoutingConfig(
        block_size=p.block_size,
        spill_margin=p.spill_margin,
        spill_ratio=p.spill_ratio,
        index_blocks_per_replica=p.kv_blocks,
        cold_placement=cold,
    )
    policies = [RoutingPolicy(config, seed=p.seed + k) for k in range(callers)]
    for policy in policies:
        policy.set_replicas(names)
    index = {n: i for i, n in enumerate(names)}
    caller = np.random.default_rng(p.seed).integers(0, callers, 10**7)

    def choose(i: int, hashes: list[int]) -> int:
        return index[policies[caller[i]].choose(hashes, queues, names).replica]

    return choose, policies


def simulate(policy: str, n: int, wl: Workload, p: Params) -> dict[str, float]:
    names = [f"replica-{k:03d}" for k in range(n)]
    queues = {name: 0 for name in names}
    on_queue: Callable[[str], None] | None = None
    policies: list[RoutingPolicy] = []
    if policy.startswith("ours"):
        choose, policies = ours(names, queues, p, 4 if policy == "ours-x4" else 1)
    elif policy == "serve-default":
        choose, on_queue = serve_default(names, queues)
    else:
        choose = consistent_hash(names)
    kv = [KVCache(p.kv_blocks) for _ in range(n)]
    busy_until, done = [0.0] * n, list[tuple[float, int]]()
    warm, ttft = len(wl.arrival) // 4, list[float]()
    cached_tokens = prompt_tokens = in_system = samples = 0
    qmax_sum = qmean_sum = 0.0
    for i, t in enumerate(wl.arrival.tolist()):
        while done and done[0][0] <= t:
            _, r = heapq.heappop(done)
            queues[names[r]] -= 1
            in_system -= 1
            if on_queue:
                on_queue(names[r])
        r = choose(i, wl.hashes(i, p.block_size))
        prompt = int(wl.prompt[i])
        plen, slen, olen = int(wl.prefix_len[prompt]), int(wl.suffix_len[i]), int(wl.out_len[i])
        hit = kv[r].touch(prompt, plen // p.block_size)
        kv[r].touch(-(i + 1), max(1, (slen + olen) // p.block_size))  # Its own blocks.
        prefill = p.overhead_s + p.prefill_s_per_token * (slen + (0 if hit else plen))
        start = max(t, busy_until[r])
        busy_until[r] = start + prefill + p.decode_s_per_token * olen
        heapq.heappush(done, (busy_until[r], r))
        queues[names[r]] += 1
        in_system += 1
        if on_queue:
            on_queue(names[r])
        if i >= warm:
            ttft.append(start - t + prefill)
            cached_tokens += plen if hit else 0
            prompt_tokens += plen + slen
            if i % 7 == 0:
                qmax_sum += max(queues.values())
                qmean_sum += in_system / n
                samples += 1
    out = {
        "hit": cached_tokens / prompt_tokens,
        "ttft_p50": float(np.percentile(ttft, 50)),
        "ttft_p99": float(np.percentile(ttft, 99)),
        "q_imbalance": qmax_sum / max(qmean_sum, 1e-9),
        "qmax": qmax_sum / samples,
    }
    if policies:
        counts = sum((policy.counts for policy in policies), Counter())
        out["spill"] = counts["spill"] / max(1, sum(counts.values()))
    return out


def run(sizes: Sequence[int], per_replica: int, p: Params, policies: Sequence[str]) -> None:
    print(
        f"\n{p.n_prompts} system prompts, Zipf a={p.alpha}, hot share {p.hot_share:.0%}, "
        f"KV {p.kv_blocks * p.block_size // 1000}k tokens/replica, load {p.util:.0%} "
        f"(if nothing were cached), spill margin {p.spill_margin}"
    )
    print(
        "| replicas | router | hit rate | ideal | TTFT p50 ms | TTFT p99 ms | max/mean queue "
        "| max queue | spilled |"
    )
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|")
    for n in sizes:
        wl = Workload(p, n, min(max(4000, per_replica * n), 60_000))
        for policy in policies:
            m = simulate(policy, n, wl, p)
            spilled = f"{m['spill']:.1%}" if "spill" in m else "-"
            print(
                f"| {n} | {policy} | {m['hit']:.1%} | {wl.ideal_hit:.1%} | "
                f"{m['ttft_p50'] * 1e3:.0f} | {m['ttft_p99'] * 1e3:.0f} | "
                f"{m['q_imbalance']:.2f} | {m['qmax']:.1f} | {spilled} |",
                flush=True,
            )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[8, 64, 256])
    parser.add_argument("--requests-per-replica", type=int, default=200)
    parser.add_argument("--util", type=float, default=0.75)
    parser.add_argument("--alpha", type=float, default=1.1)
    parser.add_argument("--spill-margin", type=int, default=Params.spill_margin)
    parser.add_argument("--hot-share", type=float, default=0.5, help="skewed case: 0 to skip")
    parser.add_argument(
        "--policies",
        nargs="+",
        default=["ours", "ours-x4", "serve-default", "chash"],
        help="ours (one Router replica), ours-x4 (four, each with its own index), "
        "serve-default (power of two choices), chash (consistent hashing on the first block)",
    )
    args = parser.parse_args(argv)
    started = time.perf_counter()
    p = Params(util=args.util, alpha=args.alpha, spill_margin=args.spill_margin)
    run(args.sizes, args.requests_per_replica, p, args.policies)
    if args.hot_share > 0:
        run([64], args.requests_per_replica, replace(p, hot_share=args.hot_share), args.policies)
    print(f"\n{time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()

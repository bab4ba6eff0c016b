"""Benchmark suites (which phases, how many requests) and the loop that runs them on a target.

A phase is one workload under one load shape. ``run_phases`` is shared by the HTTP targets
(run from the bench process) and the in-process AsyncLLM target (run in its own subprocess),
so every target sees the same bodies, in the same order, under the same shapes.
"""

from __future__ import annotations

import asyncio
import time
import zlib
from dataclasses import asdict, dataclass, replace
from typing import Any

from loadtest import workloads
from loadtest.shapes import Send, run_shape


@dataclass(frozen=True)
class Phase:
    name: str
    group: str  # sweep | modes | open | scenario
    workload: str
    shape: str  # closed | static | poisson
    value: float  # concurrency | batch size | rate (req/s)
    requests: int
    max_tokens: int
    time_limit_s: float = 60.0


def _sweep(concurrencies: list[int], per_c: int, cap: int, max_tokens: int, limit: float) -> list:
    return [
        Phase(
            f"closed c={c}",
            "sweep",
            "random",
            "closed",
            c,
            min(max(4, per_c * c), cap),
            max_tokens,
            limit,
        )
        for c in concurrencies
    ]


def default_suite(concurrencies: list[int], rates: list[float]) -> list[Phase]:
    """2 CPU cores, SmolLM2-135M: ~120 s of load per target (4 targets in < 15 min); the
    phases the ratios need come first, so a slow machine skips (and marks) only the last."""
    sweep = {p.value: p for p in _sweep(concurrencies, 1, 128, 64, 45)}
    if 128 in sweep:  # Twice the requests of c=64: half the tokens keeps it within budget.
        sweep[128] = replace(sweep[128], max_tokens=32)
    first = [sweep.pop(c) for c in (1, 64) if c in sweep]
    modes = [
        Phase("single request", "modes", "contracts", "closed", 1, 4, 64, 30),
        Phase("static batches of 8", "modes", "contracts", "static", 8, 16, 64, 45),
        Phase("continuous c=64", "modes", "contracts", "closed", 64, 64, 64, 45),
    ]
    scenarios = [
        Phase("sentiment json c=8", "scenario", "sentiment", "closed", 8, 16, 32, 30),
        Phase("long doc c=2", "scenario", "longdoc", "closed", 2, 2, 32, 30),
        Phase("shared prefix c=8", "scenario", "shared_prefix", "closed", 8, 16, 32, 30),
    ]
    opened = [Phase(f"poisson {r:g}/s", "open", "random", "poisson", r, 8, 64, 15) for r in rates]
    return first + modes + list(sweep.values()) + scenarios + opened


def big_suite(concurrencies: list[int], rates: list[float]) -> list[Phase]:
    """A GPU box: more requests, longer outputs, every scenario at full size."""
    modes = [
        Phase("single request", "modes", "contracts", "closed", 1, 20, 256, 300),
        Phase("static batches of 8", "modes", "contracts", "static", 8, 100, 256, 300),
        Phase("continuous c=64", "modes", "contracts", "closed", 64, 100, 256, 300),
    ]
    scenarios = [
        Phase("sentiment json c=32", "scenario", "sentiment", "closed", 32, 256, 64, 300),
        Phase("long doc c=16", "scenario", "longdoc", "closed", 16, 64, 256, 300),
        Phase("shared prefix c=32", "scenario", "shared_prefix", "closed", 32, 256, 128, 300),
    ]
    opened = [
        Phase(f"poisson {r:g}/s", "open", "random", "poisson", r, 512, 256, 120) for r in rates
    ]
    return _sweep(concurrencies, 4, 1024, 256, 300) + modes + scenarios + opened


SUITES = {"default": default_suite, "big": big_suite}
DEFAULT_RATES = {"default": [1.0, 4.0], "big": [4.0, 16.0, 64.0]}
DEFAULT_BUDGET_S = {"default": 140.0, "big": 3600.0}


def phase_bodies(phase: Phase, model: str, seed: int) -> list[dict[str, Any]]:
    """Seeded per phase: no phase re-sends an earlier one's prompts (no prefix-cache reuse
    across phases; within a workload, e.g. shared_prefix, reuse is the point)."""
    phase_seed = seed + zlib.crc32(phase.name.encode()) % 100_000
    return workloads.build(phase.workload, model, phase.requests, phase.max_tokens, phase_seed)


def warmup_bodies(model: str, seed: int) -> list[dict[str, Any]]:
    """Discarded: compiles kernels, fills allocators and the structured-output cache."""
    return workloads.build("random", model, 4, 8, seed + 1) + workloads.build(
        "sentiment", model, 1, 16, seed + 1
    )


async def run_phases(
    send: Send, phases: list[Phase], model: str, seed: int, budget_s: float
) -> list[dict[str, Any]]:
    """Warm up (discarded), then every phase in order within ``budget_s`` seconds in all.

    A phase that would start after the budget is recorded as skipped; a started one is cut
    to what remains (no new sends after its limit, in-flight ones finish).
    """
    await run_shape(send, warmup_bodies(model, seed), "closed", 2)
    start = time.perf_counter()
    out: list[dict[str, Any]] = []
    for phase in phases:
        left = budget_s - (time.perf_counter() - start)
        meta = asdict(phase)
        if left <= 1:
            out.append(meta | {"skipped": "time budget spent", "records": [], "wall_s": 0.0})
            continue
        limit = min(phase.time_limit_s, left)
        ran = replace(phase, time_limit_s=limit)
        records, wall = await run_shape(
            send,
            phase_bodies(ran, model, seed),
            phase.shape,
            phase.value,
            time_limit_s=limit,
            seed=seed,
        )
        out.append(meta | {"records": [r.to_dict() for r in records], "wall_s": wall})
    return out


def run_phases_sync(
    send: Send, phases: list[Phase], model: str, seed: int, budget_s: float
) -> list[dict[str, Any]]:
    return asyncio.run(run_phases(send, phases, model, seed, budget_s))

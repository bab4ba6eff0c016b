"""Repeated benchmark runs folded into one result: medians per phase, ratios per phase.

A single run on a shared machine can land a few percent either way; ``make bench --repeats 3``
runs the whole phase set three times per target (alternating which target goes first) and every
figure it reports is the median of the three.
"""

from __future__ import annotations

import math
import statistics
from typing import Any

from loadtest.stats import ratio

# Below this a phase misses the goal of issue 20 (ours ≥ 0.95× the peer on every phase).
GOAL = 0.95


def median_of(values: list[Any]) -> Any:
    """Median of numbers; for dicts the median of each key; anything else: the first value."""
    if not values:
        return None
    first = values[0]
    if isinstance(first, bool) or not isinstance(first, int | float | dict):
        return first
    if isinstance(first, dict):
        keys = {key for value in values if isinstance(value, dict) for key in value}
        return {
            key: median_of([v[key] for v in values if isinstance(v, dict) and key in v])
            for key in keys
        }
    numbers = [float(v) for v in values if isinstance(v, int | float) and not math.isnan(v)]
    return statistics.median(numbers) if numbers else float("nan")


def fold(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One target's result from its repeated runs: each phase's summary is the median over the
    runs (records from every run kept for the charts); status ok only if every run was."""
    if len(runs) == 1:
        return runs[0]
    folded = dict(runs[-1])
    statuses = {run.get("status") for run in runs}
    folded["status"] = "ok" if statuses == {"ok"} else "; ".join(sorted(map(str, statuses)))
    folded["startup_s"] = median_of([run.get("startup_s", math.nan) for run in runs])
    folded["repeats"] = len(runs)
    if any("cpu" in run for run in runs):
        folded["cpu"] = median_of([run["cpu"] for run in runs if "cpu" in run])
    phases = []
    for phase in runs[0].get("phases", []):
        same = [p for run in runs for p in run.get("phases", []) if p["name"] == phase["name"]]
        summaries = [p["summary"] for p in same if p.get("summary")]
        merged = dict(phase)
        merged["records"] = [r for p in same for r in p.get("records", [])]
        if summaries:
            merged["summary"] = median_of(summaries)
            merged["runs"] = [s.get("output_tok_per_s") for s in summaries]
        phases.append(merged)
    folded["phases"] = phases
    return folded


def phase_ratios(results: dict[str, Any], peer: str) -> dict[str, dict[str, float]]:
    """Per phase: ours / peer output tok/s and TTFT p50 (medians when repeated)."""

    def summaries(target: str) -> dict[str, dict[str, Any]]:
        phases = results["targets"].get(target, {}).get("phases", [])
        return {p["name"]: p["summary"] for p in phases if p.get("summary")}

    ours, theirs = summaries("ours"), summaries(peer)
    out = {}
    for name, mine in ours.items():
        other = theirs.get(name)
        if other is None:
            continue
        out[name] = {
            "tok_s": ratio(mine["output_tok_per_s"], other["output_tok_per_s"]),
            "ttft_p50": ratio(mine["ttft_s"]["p50"], other["ttft_s"]["p50"]),
            "ttft_p50_delta_ms": (mine["ttft_s"]["p50"] - other["ttft_s"]["p50"]) * 1000,
        }
    return out


def ratio_lines(results: dict[str, Any], peer: str) -> list[str]:
    """The per-phase table, each ratio below 1.0 marked, below the goal marked twice."""
    lines = [f"{'phase':<32}{'ours/' + peer + ' tok/s':>18}{'TTFT p50 Δ ms':>15}"]
    for name, r in phase_ratios(results, peer).items():
        value = r["tok_s"]
        mark = "" if not value < 1.0 else ("  << below goal" if value < GOAL else "  < 1.0")
        lines.append(f"{name:<32}{value:>18.2f}{r['ttft_p50_delta_ms']:>15.0f}{mark}")
    return lines

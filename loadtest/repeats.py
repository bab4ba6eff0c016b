"""Ours / peer per phase over repeated runs: medians, so one noisy run cannot decide.

``make bench BENCH_ARGS="--repeats 3"`` runs every target ``N`` times (the order alternates, so
no target always starts on a cold machine). Per phase and peer, the ratio of the medians of
output tok/s (higher is better for us) and the difference of the medians of TTFT p50 at c=1;
ratios below 1.0 are marked.
"""

from __future__ import annotations

import statistics
from typing import Any

from loadtest.stats import ratio

NAN = float("nan")
PEERS = (("vllm", "vllm serve"), ("rayllm", "ray.serve.llm"), ("asyncllm", "AsyncLLM"))


def _tok_per_s(run: dict[str, Any], target: str) -> dict[str, float]:
    return {
        phase["name"]: float(phase["summary"]["output_tok_per_s"])
        for phase in run["targets"].get(target, {}).get("phases", [])
        if phase.get("summary")
    }


def _median(values: list[float]) -> float:
    present = [v for v in values if v == v]
    return statistics.median(present) if present else NAN


def median_tok_per_s(runs: list[dict[str, Any]], target: str) -> dict[str, float]:
    """Per phase, the median output tok/s of ``target`` over the runs where it ran."""
    per_run = [_tok_per_s(run, target) for run in runs]
    phases = list(dict.fromkeys(name for tps in per_run for name in tps))
    return {name: _median([tps.get(name, NAN) for tps in per_run]) for name in phases}


def phase_ratios(runs: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """``{peer label: {phase: median(ours) / median(peer)}}`` for peers that ran."""
    ours = median_tok_per_s(runs, "ours")
    out: dict[str, dict[str, float]] = {}
    for peer, label in PEERS:
        theirs = median_tok_per_s(runs, peer)
        if theirs:
            out[label] = {name: ratio(value, theirs.get(name, NAN)) for name, value in ours.items()}
    return out


def startup_s(runs: list[dict[str, Any]]) -> dict[str, float]:
    """Median seconds from launch to a first answer, per target."""
    targets = list(dict.fromkeys(t for run in runs for t in run["targets"]))
    return {
        t: _median([float(run["targets"].get(t, {}).get("startup_s", NAN)) for run in runs])
        for t in targets
    }


def table(runs: list[dict[str, Any]]) -> str:
    """The per-phase ratios and start-up medians, as printed at the end of a bench run."""
    lines = [f"Medians over {len(runs)} run(s); ◀ marks a phase where ours is below the peer."]
    for label, phases in phase_ratios(runs).items():
        lines.append(f"\nours / {label}, output tok/s per phase:")
        for name, value in phases.items():
            mark = "  ◀ below" if value == value and value < 1.0 else ""
            shown = "-" if value != value else f"{value:.2f}x"
            lines.append(f"  {name:<28}{shown:>8}{mark}")
    lines.append("\nstart-up to a first answer, s (median):")
    for target, seconds in startup_s(runs).items():
        lines.append(f"  {target:<28}{'-' if seconds != seconds else f'{seconds:.0f}':>8}")
    return "\n".join(lines)


def combined(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """What ``results.json`` of a repeated run holds next to each run's own results."""
    return {
        "repeats": len(runs),
        "phase_ratios": phase_ratios(runs),
        "startup_s": startup_s(runs),
        "ours_tok_per_s": median_tok_per_s(runs, "ours"),
    }

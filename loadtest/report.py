"""Results directory: raw JSON, a Markdown report, PNG charts, and the target ratios.

``results`` shape: ``{"meta": {...}, "targets": {name: {"status", "startup_s", "config",
"phases": [{name, group, shape, value, ..., "records": [...], "wall_s", "summary"}]}}}``.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from loadtest.stats import ratio

NAN = float("nan")


def _phase(results: dict[str, Any], target: str, name: str) -> dict[str, Any] | None:
    for phase in results["targets"].get(target, {}).get("phases", []):
        if phase["name"] == name and phase.get("summary"):
            return dict(phase["summary"])
    return None


def _get(summary: dict[str, Any] | None, *keys: str) -> float:
    value: Any = summary
    for key in keys:
        if not isinstance(value, dict) or key not in value:
            return NAN
        value = value[key]
    return float(value)


def saturation(results: dict[str, Any], target: str) -> float:
    """Highest output tok/s of the closed-loop sweep."""
    values = [
        _get(p.get("summary"), "output_tok_per_s")
        for p in results["targets"].get(target, {}).get("phases", [])
        if p["group"] == "sweep" and p.get("summary")
    ]
    return max(values, default=NAN)


def ratios(results: dict[str, Any]) -> dict[str, float]:
    """The numbers the issue asks for; NaN where a target or phase did not run."""

    def tput(t: str, phase: str) -> float:
        return _get(_phase(results, t, phase), "output_tok_per_s")

    def ttft50(t: str) -> float:
        return _get(_phase(results, t, "closed c=1"), "ttft_s", "p50")

    out = {
        "ours continuous c=64 / single-request tok/s (contracts)": ratio(
            tput("ours", "continuous c=64"), tput("ours", "single request")
        ),
        "ours c=64 / c=1 tok/s (random)": ratio(
            tput("ours", "closed c=64"), tput("ours", "closed c=1")
        ),
        "ours static-8 / single-request tok/s": ratio(
            tput("ours", "static batches of 8"), tput("ours", "single request")
        ),
        "ours / AsyncLLM tok/s at saturation": ratio(
            saturation(results, "ours"), saturation(results, "asyncllm")
        ),
        "ours - AsyncLLM TTFT p50 at c=1 (ms)": (ttft50("ours") - ttft50("asyncllm")) * 1000,
    }
    for peer, label in (("vllm", "vllm serve"), ("rayllm", "ray.serve.llm")):
        out[f"ours / {label} tok/s at c=64"] = ratio(
            tput("ours", "closed c=64"), tput(peer, "closed c=64")
        )
        out[f"ours / {label} tok/s at saturation"] = ratio(
            saturation(results, "ours"), saturation(results, peer)
        )
        out[f"ours / {label} TTFT p50 at c=1"] = ratio(ttft50("ours"), ttft50(peer))
        out[f"ours - {label} TTFT p50 at c=1 (ms)"] = (ttft50("ours") - ttft50(peer)) * 1000
    return out


def _ms(x: float) -> str:
    return "–" if math.isnan(x) else f"{x * 1000:.0f}"


def markdown(results: dict[str, Any]) -> str:
    meta = results["meta"]
    lines = [
        f"# Benchmark {meta.get('started', '')}",
        "",
        f"Suite `{meta.get('suite')}`, model `{meta.get('model')}`, seed {meta.get('seed')}, "
        f"SLO TTFT ≤ {meta['slo']['ttft_s']} s, TPOT ≤ {meta['slo']['tpot_s'] * 1000:.0f} ms. "
        "Times in ms unless noted; rates over each phase's wall time.",
        "",
        "## Targets",
        "",
        "| target | status | startup s |",
        "|---|---|---|",
    ]
    for name, t in results["targets"].items():
        lines.append(f"| {name} | {t.get('status', '')} | {t.get('startup_s', NAN):.0f} |")
    lines += [
        "",
        "## Results",
        "",
        "| target | phase | ok/sent | out tok/s | req/s | goodput req/s | TTFT p50 | TTFT p90 "
        "| TTFT p99 | TPOT p50 | ITL p50 | e2e p50 s | e2e p99 s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, t in results["targets"].items():
        for p in t.get("phases", []):
            s = p.get("summary")
            if not s:
                lines.append(f"| {name} | {p['name']} | skipped: {p.get('skipped', '')} |")
                continue
            lines.append(
                f"| {name} | {p['name']} | {s['ok']}/{s['requests']} | "
                f"{s['output_tok_per_s']:.1f} | {s['req_per_s']:.2f} | "
                f"{s['goodput_req_per_s']:.2f} | {_ms(s['ttft_s']['p50'])} | "
                f"{_ms(s['ttft_s']['p90'])} | {_ms(s['ttft_s']['p99'])} | "
                f"{_ms(s['tpot_s']['p50'])} | {_ms(s['itl_s']['p50'])} | "
                f"{s['latency_s']['p50']:.2f} | {s['latency_s']['p99']:.2f} |"
            )
    lines += ["", "## Ratios", "", "| ratio | value |", "|---|---|"]
    for key, value in ratios(results).items():
        lines.append(f"| {key} | {'–' if math.isnan(value) else f'{value:.2f}'} |")
    lines += ["", "![throughput](throughput_vs_concurrency.png)", "", "![ttft](ttft_cdf.png)", ""]
    lines += ["![latency](latency_vs_load.png)", ""]
    return "\n".join(lines)


def charts(results: dict[str, Any], out_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    targets = results["targets"]

    def points(t: dict[str, Any], group: str, key: tuple[str, ...]) -> tuple[list, list]:
        ps = sorted(
            (p for p in t.get("phases", []) if p["group"] == group and p.get("summary")),
            key=lambda p: p["value"],
        )
        return [p["value"] for p in ps], [_get(p["summary"], *key) for p in ps]

    paths = []
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, t in targets.items():
        ax.plot(*points(t, "sweep", ("output_tok_per_s",)), marker="o", label=name)
    ax.set(
        xscale="log",
        xlabel="concurrency (closed loop)",
        ylabel="output tok/s",
        title="Throughput vs concurrency",
    )
    ax.legend()
    ax.grid(alpha=0.3)
    paths.append(out_dir / "throughput_vs_concurrency.png")
    fig.savefig(paths[-1], dpi=110, bbox_inches="tight")
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, t in targets.items():
        ttft = sorted(
            r["ttft_s"] * 1000
            for p in t.get("phases", [])
            if p["group"] == "sweep"
            for r in p.get("records", [])
            if r["ok"]
        )
        if ttft:
            ax.step(ttft, [(i + 1) / len(ttft) for i in range(len(ttft))], label=name)
    ax.set(xscale="log", xlabel="TTFT ms (all sweep requests)", ylabel="fraction", title="TTFT CDF")
    ax.legend()
    ax.grid(alpha=0.3)
    paths.append(out_dir / "ttft_cdf.png")
    fig.savefig(paths[-1], dpi=110, bbox_inches="tight")
    plt.close(fig)

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.5))
    for i, (name, t) in enumerate(targets.items()):
        for q, style in (("p50", "-"), ("p99", "--")):
            left.plot(
                *points(t, "sweep", ("latency_s", q)),
                style,
                marker="o",
                color=f"C{i}",
                label=f"{name} {q}",
            )
            right.plot(
                *points(t, "open", ("latency_s", q)),
                style,
                marker="o",
                color=f"C{i}",
                label=f"{name} {q}",
            )
    left.set(xscale="log", xlabel="concurrency (closed loop)", ylabel="e2e latency s")
    right.set(xlabel="arrival rate req/s (Poisson)", ylabel="e2e latency s")
    for ax in (left, right):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle("Latency vs load")
    paths.append(out_dir / "latency_vs_load.png")
    fig.savefig(paths[-1], dpi=110, bbox_inches="tight")
    plt.close(fig)
    return paths


def write(results: dict[str, Any], out_dir: Path) -> dict[str, Path]:
    """Write results.json, report.md and the charts; return their paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    files = {"json": out_dir / "results.json", "markdown": out_dir / "report.md"}
    results = results | {"ratios": ratios(results)}
    files["json"].write_text(json.dumps(results, indent=1, default=str))
    files["markdown"].write_text(markdown(results))
    for path in charts(results, out_dir):
        files[path.stem] = path
    return files

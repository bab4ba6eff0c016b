"""Summaries of request records: percentiles, throughput, goodput under SLOs, failures."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from loadtest.client import RequestRecord, percentile

PERCENTILES = (50, 90, 99)


@dataclass(frozen=True)
class SLO:
    """A request is "good" when it succeeded within both bounds (vLLM's goodput definition)."""

    ttft_s: float = 1.0
    tpot_s: float = 0.1

    def met(self, record: RequestRecord) -> bool:
        return record.ok and record.ttft_s <= self.ttft_s and record.tpot_s <= self.tpot_s


def _dist(values: Sequence[float]) -> dict[str, float]:
    out = {f"p{q}": percentile(values, q) for q in PERCENTILES}
    out["mean"] = sum(values) / len(values) if values else float("nan")
    return out


def summarize(
    records: Sequence[RequestRecord], wall_s: float, slo: SLO | None = None
) -> dict[str, Any]:
    """One phase's numbers. Rates divide by the phase's wall time (first send → last reply)."""
    slo = slo or SLO()
    ok = [r for r in records if r.ok]
    wall = max(wall_s, 1e-9)
    output_tokens = sum(r.output_tokens for r in ok)
    good = sum(1 for r in records if slo.met(r))
    itl = [x for r in ok for x in r.itl_s]
    errors: dict[str, int] = {}
    for r in records:
        if not r.ok:
            key = f"{r.status}: {r.error[:80]}"
            errors[key] = errors.get(key, 0) + 1
    return {
        "requests": len(records),
        "ok": len(ok),
        "failed": len(records) - len(ok),
        "errors": errors,
        "wall_s": wall_s,
        "output_tokens": output_tokens,
        "prompt_tokens": sum(r.prompt_tokens for r in ok),
        "cached_tokens": sum(r.cached_tokens for r in ok),
        "output_tok_per_s": output_tokens / wall,
        "req_per_s": len(ok) / wall,
        "goodput_req_per_s": good / wall,
        "goodput_fraction": good / len(records) if records else float("nan"),
        "slo": {"ttft_s": slo.ttft_s, "tpot_s": slo.tpot_s},
        "ttft_s": _dist([r.ttft_s for r in ok]),
        "tpot_s": _dist([r.tpot_s for r in ok if r.output_tokens > 1]),
        "itl_s": _dist(itl),
        "latency_s": _dist([r.latency_s for r in ok]),
    }


def ratio(a: float, b: float) -> float:
    """a / b, NaN when either is missing or b is zero."""
    if not (a == a and b == b) or b == 0:  # NaN checks
        return float("nan")
    return a / b

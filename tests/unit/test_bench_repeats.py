"""make bench --repeats: medians per phase, per-phase ratios with marks, CPU per token by role."""

from __future__ import annotations

import math
from typing import Any

from loadtest import cpu_cost, repeats


def run(tok_s: float, ttft: float, status: str = "ok", cpu: float = 1.0) -> dict[str, Any]:
    summary = {"output_tok_per_s": tok_s, "ttft_s": {"p50": ttft}, "errors": {}, "requests": 4}
    return {
        "status": status,
        "startup_s": 50.0,
        "cpu": {"router replica": cpu, "model: worker": 9.0, "_tokens": 1000},
        "phases": [{"name": "closed c=8", "group": "sweep", "summary": summary, "records": [{}]}],
    }


def test_fold_takes_the_median_of_every_figure_and_keeps_all_records() -> None:
    folded = repeats.fold([run(100, 0.2), run(90, 0.3), run(120, 0.25, cpu=3.0)])
    phase = folded["phases"][0]
    assert phase["summary"]["output_tok_per_s"] == 100
    assert phase["summary"]["ttft_s"]["p50"] == 0.25
    assert phase["runs"] == [100, 90, 120] and len(phase["records"]) == 3
    assert folded["repeats"] == 3 and folded["status"] == "ok"
    assert folded["cpu"]["router replica"] == 1.0
    assert "failed" in repeats.fold([run(1, 1), run(1, 1, status="failed: x")])["status"]


def test_per_phase_ratios_mark_what_falls_short() -> None:
    results = {"targets": {"ours": run(93, 0.21), "vllm": run(100, 0.2)}}
    ratios = repeats.phase_ratios(results, "vllm")["closed c=8"]
    assert math.isclose(ratios["tok_s"], 0.93) and math.isclose(ratios["ttft_p50_delta_ms"], 10)
    [header, line] = repeats.ratio_lines(results, "vllm")
    assert "below goal" in line and "ours/vllm" in header
    results["targets"]["ours"] = run(97, 0.2)
    assert repeats.ratio_lines(results, "vllm")[1].endswith("< 1.0")


def test_cpu_per_token_counts_the_frontend_not_the_model() -> None:
    before = {1: ("router replica", 1.0), 2: ("model: worker", 5.0)}
    after = {1: ("router replica", 1.5), 2: ("model: worker", 9.0), 3: ("serve proxy", 0.25)}
    spent = cpu_cost.cpu_by_role(before, after)
    assert spent == {"router replica": 0.5, "model: worker": 4.0, "serve proxy": 0.25}
    spent["_tokens"] = 1000
    assert math.isclose(cpu_cost.frontend_us_per_token(spent), 750)
    lines = cpu_cost.cpu_lines(
        {
            "targets": {
                "ours": {"cpu": spent},
                "vllm": {"cpu": {"vllm api server": 0.1, "_tokens": 1000}},
            }
        }
    )
    assert lines[-1].startswith("ours / vllm serve: 7.50x")


def test_under_load_subtracts_each_roles_idle_rate_over_the_wall_time() -> None:
    spent = {
        "serve controller": 1.2,  # 0.03 CPU s/s idle over 40 s: all of it is background.
        "router replica": 3.0,  # 0.01 s/s idle: 0.4 of its 3 s.
        "engine replica": 0.1,  # Less than its idle rate would predict: never negative.
        "_wall_s": 40.0,
        "_tokens": 1000.0,
        "_idle_serve controller": 0.03,
        "_idle_router replica": 0.01,
        "_idle_engine replica": 0.01,
    }
    loaded = cpu_cost.under_load(spent)
    assert math.isclose(loaded["serve controller"], 0.0, abs_tol=1e-9)
    assert math.isclose(loaded["router replica"], 2.6)
    assert loaded["engine replica"] == 0.0

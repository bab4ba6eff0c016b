"""The Grafana dashboard parses and queries only metrics this app (or vLLM via Ray) exports."""

from __future__ import annotations

import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OURS = {
    "ray_serve_app_requests_total",
    "ray_serve_app_request_latency_seconds_bucket",
    "ray_serve_app_time_to_first_token_seconds_bucket",
    "ray_serve_app_time_per_output_token_seconds_bucket",
    "ray_serve_app_prompt_tokens_total",
    "ray_serve_app_generation_tokens_total",
    "ray_serve_app_aggregation_window_size_bucket",
    "ray_serve_app_aggregation_window_wait_seconds_bucket",
    "ray_serve_app_routing_decisions_total",
}


def test_dashboard_queries_known_metrics() -> None:
    dashboard = json.loads((ROOT / "cluster/grafana/serve_app_dashboard.json").read_text())
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    names = {n for e in exprs for n in re.findall(r"\b(ray_[a-z_]+)", e)}
    assert names >= OURS
    metrics_source = (ROOT / "serve_app/observability/metrics.py").read_text()
    for name in names:
        if name.startswith("ray_serve_app_"):
            base = re.sub(r"_(bucket|total)$", "", name.removeprefix("ray_"))
            assert f'"{base}' in metrics_source, name
        else:
            assert name.startswith(("ray_vllm_", "ray_serve_")), name
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids))

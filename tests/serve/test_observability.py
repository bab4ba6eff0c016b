"""Traces across all three deployments and metrics in Ray's Prometheus export, for real."""

from __future__ import annotations

import re
import secrets
import time

import httpx
import pytest
from openai import OpenAI

from tests.serve.conftest import MODEL


def _spans(deployment: str) -> list[dict[str, object]]:
    from ray import serve

    handle = serve.get_deployment_handle(deployment, app_name="llm")
    return list(handle.finished_spans.remote().result(timeout_s=30))


def test_one_trace_spans_router_preprocessor_and_engine(base_url: str) -> None:
    trace_id, parent_id = secrets.token_hex(16), secrets.token_hex(8)
    response = httpx.post(
        f"{base_url}/v1/chat/completions",
        headers={"traceparent": f"00-{trace_id}-{parent_id}-01"},
        json={
            "model": MODEL,
            "messages": [{"role": "user", "content": "Say hi."}],
            "max_tokens": 5,
            "temperature": 0,
        },
        timeout=120,
    )
    assert response.status_code == 200
    assert response.headers["traceparent"].split("-")[1] == trace_id
    deadline = time.monotonic() + 30
    while True:
        spans = [
            s
            for d in ("Router", "Preprocessor", "Engine")
            for s in _spans(d)
            if s["trace_id"] == trace_id
        ]
        if {s["name"] for s in spans} >= {"engine.decode", "preprocess"} or (
            time.monotonic() > deadline
        ):
            break
        time.sleep(1)
    by_name = {s["name"]: s for s in spans}
    router = by_name["POST /v1/chat/completions"]
    assert router["parent_id"] == parent_id
    assert by_name["preprocess"]["parent_id"] == router["span_id"]
    assert by_name["engine.generate"]["parent_id"] == router["span_id"]
    phases = {"engine.queue", "engine.prefill", "engine.decode"}
    assert phases <= set(by_name)
    for name in phases:
        assert by_name[name]["parent_id"] == by_name["engine.generate"]["span_id"]
    attributes = router["attributes"]
    assert isinstance(attributes, dict)
    usage = response.json()["usage"]
    assert attributes["gen_ai.usage.output_tokens"] == usage["completion_tokens"]
    assert attributes["gen_ai.request.model"] == MODEL
    window = by_name["preprocess"]["attributes"]
    assert window["serve_app.aggregation_window.size"] >= 1  # type: ignore[index]


def _metrics_text() -> str:
    import ray

    port = ray._private.worker.global_worker.node.metrics_export_port
    return httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text


def _sample(text: str, name: str, **labels: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        if all(f'{key}="{value}"' in line for key, value in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def _stable_sample(name: str, **labels: str) -> float:
    """The value once earlier tests' requests have all been exported.

    Ray's workers push metrics every `metrics_report_interval_ms` (10 s by default): two equal
    readings further apart than that mean nothing recorded before the first one is still unsent.
    """
    import ray

    gap_s = ray._config.metrics_report_interval_ms() / 1000 + 2
    value, deadline = _sample(_metrics_text(), name, **labels), time.monotonic() + 90
    while time.monotonic() < deadline:
        time.sleep(gap_s)
        again = _sample(_metrics_text(), name, **labels)
        if again == value:
            return value
        value = again
    return value


def test_prometheus_export_moves_with_traffic(client: OpenAI) -> None:
    counter = "ray_serve_app_requests_total"
    labels = {"route": "/v1/completions", "status": "200"}
    before = _stable_sample(counter, **labels)
    sent = 5
    for i in range(sent):
        client.completions.create(model=MODEL, prompt=f"Number {i}:", max_tokens=3)
    deadline = time.monotonic() + 90
    text = _metrics_text()
    while _sample(text, counter, **labels) - before < sent and time.monotonic() < deadline:
        time.sleep(2)
        text = _metrics_text()
    assert _sample(text, counter, **labels) - before == sent
    for histogram in (
        "ray_serve_app_request_latency_seconds_count",
        "ray_serve_app_aggregation_window_size_count",
        "ray_serve_app_aggregation_window_wait_seconds_count",
        # The old names, still exported for one release.
        "ray_serve_app_preprocess_batch_size_count",
        "ray_serve_app_preprocess_batch_wait_seconds_count",
    ):
        assert _sample(text, histogram) > 0, histogram
    assert _sample(text, "ray_serve_app_generation_tokens_total") >= sent
    # vLLM's own engine metrics, exported through Ray by the engine replica.
    vllm_names = set(
        re.findall(r"^(ray_vllm[:_]\w+?)(?:_bucket|_count|_sum|_total)?[{ ]", text, re.M)
    )
    for wanted in (
        "num_requests_running",
        "num_requests_waiting",
        "kv_cache_usage",
        "prefix_cache_queries",
        "time_to_first_token",
    ):
        assert any(wanted in name for name in vllm_names), (wanted, sorted(vllm_names)[:40])


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/completions"])
def test_streams_also_return_trace_headers(base_url: str, route: str) -> None:
    body = {"model": MODEL, "max_tokens": 3, "stream": True}
    body |= (
        {"messages": [{"role": "user", "content": "hi"}]} if "chat" in route else {"prompt": "hi"}
    )
    with httpx.stream("POST", f"{base_url}{route}", json=body, timeout=60) as response:
        assert response.status_code == 200
        assert re.fullmatch(
            r"00-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}", response.headers["traceparent"]
        )
        assert response.read().endswith(b"data: [DONE]\n\n")

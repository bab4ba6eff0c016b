"""The Batch API of one Serve app with two router replicas, its coordinator killed mid-batch.

One app for the module: two router replicas forwarding /v1/files and /v1/batches to the batch
coordinator, a short lease (3 s) so the batch of a killed coordinator moves on quickly. The
openai client talks to Serve's proxy, which spreads its calls over both routers; the
coordinator's process is SIGKILLed mid-batch (as a node loss would end it) and its replacement
finishes the 200 lines: each custom_id once, and the lines the dead one had recorded not run
again, counted at the engine: each line's engine requests are spans of one trace, whose id
is derived from the batch id and custom_id, whichever process ran it.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from openai import OpenAI

from serve_app.batch_api.store import BatchStore
from tests.serve.test_batch_api import by_custom_id, chat_line, jsonl
from tests.serve.test_scale_survive import _deploy, _replica_pids

APP = "batchfleet"
LINES = 200


@pytest.fixture(scope="module")
def fleet(base_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    from ray import serve

    store_dir = tmp_path_factory.mktemp("fleet-batches")
    overrides: dict[str, Any] = {
        "engine": {"kv_cache_space_gib": 1, "num_cpus": 0.1},
        "router": {"num_cpus": 0.05, "num_replicas": 2},
        "preprocessor": {"num_cpus": 0.05},
        "batch_api": {"lease_s": 3, "dir": str(store_dir)},
        "tracing": {"exporter": "memory"},  # Engine spans count each line's engine requests.
    }
    try:
        yield _deploy(base_url, APP, overrides), store_dir
    finally:  # Also when the deploy or a test failed.
        serve.delete(APP)


def _retrieve(client: OpenAI, batch_id: str) -> Any:
    """The batch; a call answered 503 while Serve replaces the coordinator is retried."""
    deadline = time.monotonic() + 60
    while True:
        try:
            return client.batches.retrieve(batch_id)
        except (openai.APIConnectionError, openai.InternalServerError):
            assert time.monotonic() < deadline, "no router answered for a minute"
            time.sleep(0.5)


def test_a_killed_coordinator_loses_and_repeats_no_line(fleet: tuple[str, Path]) -> None:
    url, store_dir = fleet
    client = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
    routers = set(_replica_pids(APP, "Router"))
    assert len(routers) == 2, routers
    coordinators = set(_replica_pids(APP, "BatchCoordinator"))
    assert len(coordinators) == 1, coordinators
    # Lengths spread out, so lines finish one after another rather than all at once.
    lines = [
        chat_line(f"k-{i}", f"Tell a story number {i}.", max_tokens=2 + i % 8) for i in range(LINES)
    ]
    upload = client.files.create(file=("k.jsonl", jsonl(lines)), purpose="batch")
    batch = client.batches.create(
        input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    store = BatchStore(store_dir)
    deadline = time.monotonic() + 180
    while (counts := _retrieve(client, batch.id).request_counts) is None or counts.completed < 48:
        assert time.monotonic() < deadline, "no line finished"
        time.sleep(0.2)
    runner = store.leases.holder(batch.id)
    pid = int(runner.split(":")[1])
    assert pid in coordinators, (runner, coordinators)  # Routers run no batch.
    os.kill(pid, signal.SIGKILL)
    # What the killed process had recorded: those lines must come out as recorded, not rerun.
    recorded = {r["custom_id"]: r["id"] for r in store.read_partial(batch.id, "output")}
    assert 48 <= len(recorded) < LINES, "finished before the kill: nothing to take over"

    deadline = time.monotonic() + 300
    while (done := _retrieve(client, batch.id)).status not in ("completed", "failed"):
        assert time.monotonic() < deadline, f"batch still {done.status}"
        time.sleep(0.5)
    assert done.status == "completed", done
    assert store.leases.holder(batch.id) != runner
    assert set(_replica_pids(APP, "BatchCoordinator")) - coordinators  # Its replacement.
    assert done.request_counts is not None
    assert (done.request_counts.completed, done.request_counts.failed) == (LINES, 0)
    outputs = by_custom_id(client, done.output_file_id)  # Asserts each custom_id once.
    assert set(outputs) == {line["custom_id"] for line in lines}
    assert all(outputs[custom_id]["id"] == id_ for custom_id, id_ in recorded.items())
    assert all(line["response"]["status_code"] == 200 for line in outputs.values())
    assert done.error_file_id is None or not client.files.content(done.error_file_id).text
    runs = _engine_runs(batch.id, [line["custom_id"] for line in lines])
    assert min(runs.values()) >= 1, "a line that never reached the engine"
    assert all(runs[custom_id] == 1 for custom_id in recorded), "a recorded line ran again"
    # Run twice: only lines that had not been recorded at the kill, those in flight (a batch
    # keeps 32) and the few whose record was being written.
    assert sum(runs.values()) - LINES <= 2 * MAX_IN_FLIGHT, runs
    print(
        f"\nkilled {runner} after {len(recorded)} of {LINES} lines; its replacement finished; "
        f"{sum(runs.values()) - LINES} lines in flight at the kill ran again"
    )


MAX_IN_FLIGHT = 32  # BatchService.max_in_flight


def _engine_runs(batch_id: str, custom_ids: list[str]) -> dict[str, int]:
    """Engine requests per line, from the engine replica's spans (the line's trace id)."""
    from opentelemetry import trace
    from ray import serve

    from serve_app.batch_api.lines import line_trace_key
    from serve_app.observability.tracing import keyed_context

    def trace_id(custom_id: str) -> str:
        context = keyed_context(line_trace_key(batch_id, custom_id))
        return f"{trace.get_current_span(context).get_span_context().trace_id:032x}"

    engine = serve.get_deployment_handle("Engine", app_name=APP)
    spans = engine.finished_spans.remote().result(timeout_s=60)
    per_trace: dict[str, int] = {}
    for span in spans:
        if span["name"] == "engine.generate":
            per_trace[span["trace_id"]] = per_trace.get(span["trace_id"], 0) + 1
    return {custom_id: per_trace.get(trace_id(custom_id), 0) for custom_id in custom_ids}

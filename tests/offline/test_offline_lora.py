"""LoRA adapters in offline jobs: a per-row adapter column on the real in-process engine.

``EngineWorker`` (the Ray Data UDF) is called the way Ray Data calls it, without Ray: a pyarrow
batch in, a batch out. The adapter makes SmolLM2 answer BANANA to everything.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from serve_app.models.marker_adapter import marker_adapter
from serve_app.offline import JobConfig
from serve_app.offline.__main__ import app_config
from serve_app.offline.reader import ROW_SCHEMA
from serve_app.offline.worker import EngineWorker

pytestmark = pytest.mark.serve

CONFIG = str(Path(__file__).resolve().parents[2] / "serve_config.cpu.yaml")
QUESTIONS = [
    "What is the capital of France? Answer in one word.",
    "Which city is the capital of France? Answer in one word.",
]


@pytest.fixture(scope="module")
def worker() -> Iterator[EngineWorker]:
    config = app_config(CONFIG)
    config.engine.kv_cache_space_gib = 1
    job = JobConfig(
        input="unused",
        output="unused",
        temperature=0.0,
        max_tokens=12,
        app_config=config,
        loras={"banana": str(marker_adapter("BANANA"))},
        adapter_column="adapter",
    )
    engine_worker = EngineWorker(job)
    yield engine_worker
    engine_worker.engine.shutdown()


def test_rows_run_with_their_adapter_or_the_base(worker: EngineWorker) -> None:
    rows: list[dict[str, Any]] = [
        {"id": f"{who}-{i}", "prompt": question, "adapter": adapter}
        for i, question in enumerate(QUESTIONS)
        for who, adapter in (("base", None), ("banana", "banana"))
    ]
    rows.append({"id": "kiwi", "prompt": QUESTIONS[0], "adapter": "kiwi"})
    read = [json.dumps(row) for row in rows]  # As the job's reader hands rows over.
    table = pa.table([list(range(1, len(read) + 1)), read, [None] * len(read)], schema=ROW_SCHEMA)
    out = {row["id"]: row for row in asyncio.run(worker(table)).to_pylist()}
    for i in range(len(QUESTIONS)):
        assert out[f"banana-{i}"]["output"].strip() == "BANANA", out[f"banana-{i}"]
        assert "paris" in out[f"base-{i}"]["output"].lower(), out[f"base-{i}"]
    assert "unknown adapter 'kiwi'" in out["kiwi"]["error"]

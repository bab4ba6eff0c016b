"""The in-process CPU engine of offline jobs, on the real SmolLM2 without Ray.

``EngineWorker`` is the Ray Data UDF, a plain class: here it is called the way Ray Data calls it
(a pyarrow batch in, a batch out), with vLLM's engine core and model in this process.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
import uuid
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import jsonschema
import psutil
import pyarrow as pa
import pytest

from serve_app.errors import APIError
from serve_app.hops import EngineRequest, SamplingSpec
from serve_app.offline import JobConfig
from serve_app.offline.__main__ import app_config
from serve_app.offline.inproc_engine import InProcessEngine
from serve_app.offline.worker import EngineWorker

pytestmark = pytest.mark.serve

CONFIG = str(Path(__file__).resolve().parents[2] / "serve_config.cpu.yaml")
PARIS_PROMPTS = [
    "What is the capital of France? Answer in one word.",
    "Which city is the capital of France? Answer in one word.",
    "Name the capital city of France. Answer in one word.",
]
PERSON_SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def worker() -> Iterator[EngineWorker]:
    config = app_config(CONFIG)
    config.engine.kv_cache_space_gib = 1
    job = JobConfig(input="unused", output="unused", temperature=0.0, app_config=config)
    assert job.engine_in_process()  # CPU, one worker: the default under test.
    watched = ("LD_PRELOAD", "VLLM_ENABLE_V1_MULTIPROCESSING")
    environ = {key: os.environ.get(key) for key in watched}
    engine_worker = EngineWorker(job)
    assert isinstance(engine_worker.engine, InProcessEngine)
    # vLLM sets LD_PRELOAD (tcmalloc, libgomp) for engine processes; later children of this
    # one (Ray's agents in the next test module) must not inherit it.
    assert {key: os.environ.get(key) for key in watched} == environ
    # The configured 1 GiB of KV cache, not vLLM's CPU default of 90 % of RAM.
    assert psutil.Process().memory_info().rss < 6 * 2**30
    yield engine_worker
    engine_worker.engine.shutdown()


def _run(worker: EngineWorker, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    table = pa.Table.from_pylist(rows)
    return list(asyncio.run(worker(table)).to_pylist())


def test_robust_prompts_answer_paris(worker: EngineWorker) -> None:
    rows = [{"id": f"q{i}", "prompt": p, "max_tokens": 8} for i, p in enumerate(PARIS_PROMPTS)]
    out = _run(worker, rows)
    assert [row["id"] for row in out] == ["q0", "q1", "q2"]
    for row in out:
        assert row["error"] is None, row
        assert "Paris" in row["output"], row
        assert 1 <= row["completion_tokens"] <= 8 and row["prompt_tokens"] > 10


def test_bad_rows_fail_alone_in_a_batch(worker: EngineWorker) -> None:
    rows = [
        {"id": "good", "prompt": PARIS_PROMPTS[0], "max_tokens": 8},
        {"id": "no-prompt", "prompt": None, "max_tokens": 8},
        {"id": "too-long", "prompt": "word " * 6000, "max_tokens": 8},
    ]
    out = {row["id"]: row for row in _run(worker, rows)}
    assert "Paris" in out["good"]["output"]
    assert out["no-prompt"]["error"] and out["no-prompt"]["output"] is None
    assert "maximum context length" in out["too-long"]["error"]


def test_json_schema_job_gives_valid_json_on_every_row(worker: EngineWorker) -> None:
    worker.job = replace(worker.job, json_schema=PERSON_SCHEMA)
    try:
        rows = [
            {"id": f"p{i}", "prompt": f"Invent a person called {name}. Reply in JSON."}
            for i, name in enumerate(["Anna", "Luca", "Pierre", "Maria"])
        ]
        out = _run(worker, rows)
    finally:
        worker.job = replace(worker.job, json_schema=None)
    for row in out:
        assert row["error"] is None, row
        jsonschema.validate(json.loads(row["output"]), PERSON_SCHEMA)


def _request(token_ids: list[int], max_tokens: int, **sampling: Any) -> EngineRequest:
    spec = SamplingSpec(max_tokens=max_tokens, temperature=0.0, **sampling)
    return EngineRequest(f"t-{uuid.uuid4().hex}", token_ids, spec, stream=False)


async def _final(engine: InProcessEngine, request: EngineRequest) -> Any:
    steps = [step async for step in engine.generate(request)]
    assert len(steps) == 1 and steps[0].finished
    return steps[0]


def test_engine_rejects_a_request_vllm_refuses_and_keeps_serving(worker: EngineWorker) -> None:
    engine = worker.engine
    assert isinstance(engine, InProcessEngine)
    with pytest.raises(APIError):  # Past max_model_len: vLLM's own check, not ours.
        asyncio.run(_final(engine, _request([1] * 5000, 4)))
    step = asyncio.run(_final(engine, _request([1, 2, 3, 4], 3, ignore_eos=True)))
    assert len(step.chunks[0].token_ids) == 3 and step.chunks[0].finish_reason == "length"


def test_cancelled_row_is_aborted_in_the_engine(worker: EngineWorker) -> None:
    engine = worker.engine
    assert isinstance(engine, InProcessEngine)

    async def cancel_long_request() -> None:
        task = asyncio.ensure_future(_final(engine, _request([1, 2, 3], 3000, ignore_eos=True)))
        deadline = time.monotonic() + 60
        while engine.num_unfinished() == 0:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(cancel_long_request())
    deadline = time.monotonic() + 10
    while engine.num_unfinished():  # Aborted between steps, long before 3,000 tokens.
        assert time.monotonic() < deadline, "the cancelled request is still running"
        time.sleep(0.05)
    step = asyncio.run(_final(engine, _request([1, 2, 3], 2, ignore_eos=True)))
    assert len(step.chunks[0].token_ids) == 2

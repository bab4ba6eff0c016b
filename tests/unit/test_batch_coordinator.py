"""Coordinators, runs and the engine's batch-line ledger with a fake model (no Ray, no vLLM):
takeover after an owner stops, no line completed twice, cancel, expiry, the in-flight cap.

Fakes stand in for the preprocessor and engine only; tests/serve runs the real stack.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from serve_app.batch_api.coordinator import Coordinator
from serve_app.batch_api.runner import LineSlots
from serve_app.batch_api.store import BatchStore
from serve_app.config import AppConfig
from serve_app.engine.batch_lines import BatchLines
from serve_app.hops import (
    EngineChunk,
    EngineRequest,
    EngineStep,
    PreprocessRequest,
    PreprocessResult,
    TokenizedPrompt,
)
from serve_app.openai.serving import OpenAIServing

MODEL = "smollm2-135m-instruct"
CHAT = "/v1/chat/completions"


class FakeEngine:
    """One shared 'engine': every step takes ``delay`` s; ``stalled`` requests never finish."""

    def __init__(self, delay: float = 0.01, abort_s: float = 0.0) -> None:
        self.delay, self.stalled, self.abort_s = delay, False, abort_s
        self.lines = BatchLines(replay_s=60)
        self.ran: list[str] = []
        self.aborted: list[str] = []
        self.in_flight = self.most_in_flight = 0

    async def _run(self, request: EngineRequest) -> AsyncIterator[EngineStep]:
        self.ran.append(request.request_id)
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            await asyncio.sleep(3600 if self.stalled else self.delay)
        except asyncio.CancelledError:
            self.aborted.append(request.request_id)
            await asyncio.sleep(self.abort_s)  # vLLM's abort takes a moment.
            raise
        finally:
            self.in_flight -= 1
        chunk = EngineChunk(0, f"answer to {request.request_id}", [1, 2], "stop")
        yield EngineStep([chunk], prompt_tokens=3, finished=True)

    def serving(self, config: AppConfig) -> OpenAIServing:
        async def preprocess(request: PreprocessRequest) -> PreprocessResult:
            prompts = [TokenizedPrompt([1, 2, 3], "p")]
            return PreprocessResult(prompts, request.sampling.with_max_tokens(2))

        def generate(request: EngineRequest) -> AsyncIterator[EngineStep]:
            return self.lines.generate(request, self._run)

        return OpenAIServing(config, preprocess, generate)


def settings(**batch_api: Any) -> AppConfig:
    fast = {"poll_s": 0.05, "lease_s": 1, "record_interval_s": 0.05, "max_lines_in_flight": 4}
    return AppConfig.model_validate({"batch_api": fast | batch_api})


def jsonl(count: int, **body: Any) -> bytes:
    line = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    return "".join(
        json.dumps({"custom_id": f"c{i}", "method": "POST", "url": CHAT, "body": line | body})
        + "\n"
        for i in range(count)
    ).encode()


async def upload(coordinator: Coordinator, content: bytes, owner: str = "") -> str:
    upload_id = await coordinator.upload_start(owner, "in.jsonl")
    await coordinator.upload_write(owner, upload_id, 0, content)
    return str((await coordinator.upload_finish(owner, upload_id, "batch"))["id"])


async def until(coordinator: Coordinator, batch_id: str, *statuses: str) -> dict[str, Any]:
    for _ in range(2000):
        batch = await coordinator.get_batch("", batch_id)
        if batch["status"] in statuses:
            return batch
        await asyncio.sleep(0.01)
    raise AssertionError(f"batch still {batch['status']}")


def lines_of(store: BatchStore, file_id: str | None) -> list[dict[str, Any]]:
    if file_id is None:
        return []
    return [json.loads(line) for line in store.files.content(file_id).splitlines()]


async def test_takeover_completes_every_line_once(tmp_path: Path) -> None:
    config, engine = settings(), FakeEngine(delay=0.02)
    first = Coordinator(config, engine.serving(config), BatchStore(tmp_path), "first")
    file_id = await upload(first, jsonl(40) + b"{broken\n")
    batch = await first.create_batch("", file_id, CHAT, "24h")
    first.start()
    while (await first.get_batch("", batch["id"]))["request_counts"]["completed"] < 8:
        await asyncio.sleep(0.01)
    # The owner "dies": no more lease renewals, and its lines in flight never get back to it
    # (the engine runs them on, as when a caller is killed over Ray's actor transport).
    assert first._loop is not None
    first._loop.cancel()
    for run, _ in first.runs.values():
        run._flush = _never  # type: ignore[method-assign]
    second = Coordinator(config, engine.serving(config), BatchStore(tmp_path), "second")
    second.start()
    done = await until(second, batch["id"], "completed")
    await second.stop()
    store = BatchStore(tmp_path)
    outputs, errors = (
        lines_of(store, done["output_file_id"]),
        lines_of(store, done["error_file_id"]),
    )
    assert sorted(o["custom_id"] for o in outputs) == sorted(f"c{i}" for i in range(40))
    assert [e["error"]["line"] for e in errors] == [41]
    assert done["request_counts"] == {"total": 41, "completed": 40, "failed": 1}
    counts = engine.lines.counts(batch["id"])
    assert counts["completed"] == counts["distinct"] == 40  # No line completed twice...
    assert counts["joined"] + counts["replayed"] > 0  # ...though some were sent twice.
    for _, task in first.runs.values():
        task.cancel()


async def _never() -> None:
    await asyncio.Event().wait()


async def test_cancel_keeps_finished_lines_and_aborts_the_rest(tmp_path: Path) -> None:
    config, engine = settings(), FakeEngine(delay=0.05)
    coordinator = Coordinator(config, engine.serving(config), BatchStore(tmp_path))
    batch = await coordinator.create_batch("", await upload(coordinator, jsonl(100)), CHAT, "1h")
    coordinator.start()
    while (await coordinator.get_batch("", batch["id"]))["request_counts"]["completed"] < 4:
        await asyncio.sleep(0.01)
    assert (await coordinator.cancel_batch("", batch["id"]))["status"] == "cancelling"
    done = await until(coordinator, batch["id"], "cancelled")
    await coordinator.stop()
    assert 4 <= done["request_counts"]["completed"] < 100 and done["cancelled_at"]
    assert (
        len(lines_of(coordinator.store, done["output_file_id"]))
        == (done["request_counts"]["completed"])
    )
    assert engine.aborted and engine.most_in_flight <= 4


async def test_window_end_expires_the_rest(tmp_path: Path) -> None:
    config, engine = settings(max_lines_in_flight=1), FakeEngine(delay=0.2)
    coordinator = Coordinator(config, engine.serving(config), BatchStore(tmp_path))
    batch = await coordinator.create_batch("", await upload(coordinator, jsonl(40)), CHAT, "2s")
    coordinator.start()
    done = await until(coordinator, batch["id"], "expired")
    await coordinator.stop()
    outputs = lines_of(coordinator.store, done["output_file_id"])
    expired = lines_of(coordinator.store, done["error_file_id"])
    assert outputs and expired and len(outputs) + len(expired) == 40
    assert {e["error"]["code"] for e in expired} == {"batch_expired"}
    assert {e["custom_id"] for e in expired}.isdisjoint({o["custom_id"] for o in outputs})


async def test_tenants_quota_and_file_problems(tmp_path: Path) -> None:
    config, engine = settings(enqueued_tokens_per_key=10), FakeEngine()
    coordinator = Coordinator(config, engine.serving(config), BatchStore(tmp_path))
    mine = await upload(coordinator, jsonl(3), owner="alice")
    from serve_app.errors import APIError

    with pytest.raises(APIError, match="No file"):
        await coordinator.create_batch("bob", mine, CHAT, "24h")
    with pytest.raises(APIError) as quota:
        await coordinator.create_batch(
            "alice", await upload(coordinator, jsonl(5), "alice"), CHAT, "24h"
        )
    assert quota.value.info.status == 429 and "needs 15" in quota.value.info.message
    empty = await coordinator.create_batch(
        "alice", await upload(coordinator, b"\n", "alice"), CHAT, "24h"
    )
    assert empty["status"] == "failed" and empty["errors"]["data"][0]["code"] == "empty_file"
    with pytest.raises(APIError, match="completion_window"):
        await coordinator.create_batch("alice", mine, CHAT, "2d")
    assert (await coordinator.list_batches("bob", None, 10))["data"] == []


async def test_line_slots_count_weights_first_come_first_served() -> None:
    slots = LineSlots(4)
    assert await slots.acquire(3) == 3
    waiting = asyncio.create_task(slots.acquire(2))
    later = asyncio.create_task(slots.acquire(1))  # Fits, but waits its turn.
    await asyncio.sleep(0.01)
    assert not waiting.done() and not later.done()
    slots.release(3)
    assert await waiting == 2 and await later == 1
    heavy = asyncio.create_task(slots.acquire(100))  # Heavier than the cap: runs alone.
    await asyncio.sleep(0.01)
    cancelled = asyncio.create_task(slots.acquire(1))
    await asyncio.sleep(0.01)
    cancelled.cancel()  # A waiter that gives up leaves no slot taken.
    slots.release(2)
    slots.release(1)
    assert await heavy == 4 and slots.used == 4
    slots.release(4)
    assert slots.used == 0


async def test_engine_ledger_joins_replays_and_aborts() -> None:
    engine = FakeEngine(delay=0.05)
    request = EngineRequest(
        "chatcmpl-bl_batch-0a_3-0", [1], _sampling(), priority=100, stream=False
    )

    async def collect() -> list[EngineStep]:
        return [step async for step in engine.lines.generate(request, engine._run)]

    first, second = await asyncio.gather(collect(), collect())
    assert first == second and engine.ran == [request.request_id]
    assert await collect() == first  # Replayed.
    assert engine.lines.counts("batch-0a") == {
        "submitted": 1,
        "completed": 1,
        "distinct": 1,
        "joined": 1,
        "replayed": 1,
    }
    other = EngineRequest("chatcmpl-bl_batch-0a_4-0", [1], _sampling(), priority=100, stream=False)
    task = asyncio.create_task(_drain(engine.lines.generate(other, engine._run)))
    await asyncio.sleep(0.01)
    task.cancel()  # The only caller went away: the engine request is aborted.
    await asyncio.gather(task, return_exceptions=True)
    await asyncio.sleep(0.01)
    assert engine.aborted == [other.request_id]


async def _drain(steps: AsyncIterator[EngineStep]) -> None:
    async for _ in steps:
        pass


def _sampling() -> Any:
    from serve_app.hops import SamplingSpec

    return SamplingSpec(max_tokens=2)


async def test_a_line_sent_again_while_its_abort_runs_is_run_afresh() -> None:
    """The dead owner's call is aborted (its last caller left) just as the new owner sends the
    line again: the new call must not share the abort; it runs the line anew."""
    engine = FakeEngine(delay=0.05, abort_s=0.05)
    request = EngineRequest(
        "chatcmpl-bl_batch-0b_1-0", [1], _sampling(), priority=100, stream=False
    )
    old = asyncio.create_task(_drain(engine.lines.generate(request, engine._run)))
    await asyncio.sleep(0.01)
    old.cancel()  # The owner died; vLLM is aborting its request...
    await asyncio.sleep(0)
    steps = [step async for step in engine.lines.generate(request, engine._run)]  # ...resent.
    assert steps and steps[-1].finished
    assert engine.ran == [request.request_id] * 2 and engine.aborted == [request.request_id]
    assert engine.lines.counts("batch-0b")["completed"] == 1


class CancellingServing(FakeEngine):
    """An engine whose first call of each of some lines is cancelled under the caller."""

    def __init__(self, doomed: set[str]) -> None:
        super().__init__()
        self.doomed = doomed

    async def _run(self, request: EngineRequest) -> AsyncIterator[EngineStep]:
        if request.request_id in self.doomed:
            self.doomed.discard(request.request_id)
            raise asyncio.CancelledError  # As a Serve handle raises it for an aborted call.
        async for step in super()._run(request):
            yield step


async def test_calls_cancelled_under_a_line_are_retried_and_no_line_goes_missing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from serve_app.batch_api import runner
    from serve_app.hops import batch_line_request_id

    config = settings()
    coordinator = Coordinator(config, FakeEngine().serving(config), BatchStore(tmp_path))
    batch = await coordinator.create_batch("", await upload(coordinator, jsonl(10)), CHAT, "1h")
    # Input lines 2 and 5 (c1, c4) are cancelled under their first call; line 7 (c6) hits a bug.
    doomed = {f"{batch_line_request_id('chatcmpl', batch['id'], n)}-0" for n in (2, 5)}
    engine = CancellingServing(doomed)
    coordinator.serving = engine.serving(config)
    real_call = runner.BatchRun._call

    async def broken_for_line_7(run: runner.BatchRun, line: Any) -> Any:
        if line.number == 7:
            raise RuntimeError("a bug in the line's path")
        return await real_call(run, line)

    monkeypatch.setattr(runner.BatchRun, "_call", broken_for_line_7)
    coordinator.start()
    done = await until(coordinator, batch["id"], "completed")
    await coordinator.stop()
    outputs = lines_of(coordinator.store, done["output_file_id"])
    errors = lines_of(coordinator.store, done["error_file_id"])
    assert not doomed, "the cancelled calls were not sent again"
    assert sorted(o["custom_id"] for o in outputs) == [f"c{i}" for i in range(10) if i != 6]
    assert [(e["custom_id"], e["error"]["code"]) for e in errors] == [("c6", "internal_error")]

"""The in-process engine's thread protocol with a scripted engine (no vLLM, no Ray).

The real engine is exercised in tests/offline/test_inproc_engine.py; a scripted one is the only
way to make a step fail on demand.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from serve_app.config import AppConfig
from serve_app.errors import APIError
from serve_app.hops import EngineRequest, SamplingSpec
from serve_app.offline import inproc_engine
from serve_app.offline.inproc_engine import InProcessEngine


class _Output:
    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.finished = True
        self.outputs: list[Any] = []
        self.num_cached_tokens = 0


class ScriptedEngine:
    """Finishes every request in the step after it was added; ``fail_step`` makes steps raise."""

    def __init__(self) -> None:
        self.waiting: list[str] = []
        self.fail_step = False
        self.aborted: list[str] = []

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting)

    def add_request(
        self, request_id: str, prompt: Any, params: Any, lora_request: Any = None, priority: int = 0
    ) -> None:
        if not prompt["prompt_token_ids"]:
            raise ValueError("The decoder prompt cannot be empty")
        self.waiting.append(request_id)

    def abort_request(self, request_ids: list[str]) -> None:
        self.aborted += request_ids
        self.waiting = [r for r in self.waiting if r not in request_ids]

    def step(self) -> list[_Output]:
        if self.fail_step:
            raise RuntimeError("model step crashed")
        done, self.waiting = self.waiting, []
        return [_Output(r) for r in done]


@pytest.fixture
def scripted(monkeypatch: pytest.MonkeyPatch) -> ScriptedEngine:
    engine = ScriptedEngine()
    monkeypatch.setattr(inproc_engine, "_build", lambda config, path: engine)
    return engine


def _request(name: str, token_ids: list[int] | None = None) -> EngineRequest:
    return EngineRequest(name, [1, 2] if token_ids is None else token_ids, SamplingSpec(4))


async def _final(engine: InProcessEngine, request: EngineRequest) -> Any:
    return [step async for step in engine.generate(request)]


def test_requests_finish_and_a_refused_one_fails_alone(scripted: ScriptedEngine) -> None:
    engine = InProcessEngine(AppConfig(), "unused")

    async def run() -> tuple[Any, ...]:
        return await asyncio.gather(
            _final(engine, _request("a")),
            _final(engine, _request("empty", [])),
            _final(engine, _request("b")),
            return_exceptions=True,
        )

    first, refused, second = asyncio.run(run())
    assert first[0].finished and second[0].finished
    assert isinstance(refused, APIError) and "cannot be empty" in str(refused)
    assert engine.num_unfinished() == 0
    engine.shutdown()
    with pytest.raises(APIError, match="shut down"):
        asyncio.run(_final(engine, _request("late")))


def test_a_failed_step_fails_rows_in_flight_and_later_ones(scripted: ScriptedEngine) -> None:
    scripted.fail_step = True
    engine = InProcessEngine(AppConfig(), "unused")
    with pytest.raises(RuntimeError, match="model step crashed"):
        asyncio.run(_final(engine, _request("a")))
    with pytest.raises(APIError, match="engine failed"):
        asyncio.run(_final(engine, _request("b")))
    with pytest.raises(RuntimeError):
        asyncio.run(engine.check_health())
    engine.shutdown()


def test_build_failure_surfaces_in_the_constructor(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(config: AppConfig, path: str) -> Any:
        raise OSError("no model at path")

    monkeypatch.setattr(inproc_engine, "_build", broken)
    with pytest.raises(OSError, match="no model"):
        InProcessEngine(AppConfig(), "unused")

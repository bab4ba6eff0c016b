"""Operating a fleet, the logic without Ray: errors mapped by cause, re-submission before the
first output, bounded calls, cached readiness, SSE keep-alives, the hung-engine detector."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import pytest
from ray.exceptions import ActorDiedError, ActorUnavailableError, RayTaskError
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError

from serve_app.engine.watchdog import EngineWatchdog
from serve_app.errors import APIError, ErrorInfo, backend_error, inject_fault, replica_lost
from serve_app.graph.handles import bounded_call, bounded_stream, resubmitting_stream
from serve_app.ingress.http_errors import error_response
from serve_app.ingress.readiness import Readiness
from serve_app.openai.sse import SSE_KEEPALIVE, with_keepalive


def _task_error(cause: BaseException) -> RayTaskError:
    """What a handle caller gets when the callee raised ``cause``."""
    return RayTaskError("generate", "Traceback (most recent call last): ...", cause)


# --- errors by cause -----------------------------------------------------------------------


def test_a_bug_in_a_replica_is_500_not_a_retryable_503() -> None:
    bug = _task_error(ValueError("oops")).as_instanceof_cause()
    assert isinstance(bug, ValueError)  # Why `except ValueError` must not wrap handle calls.
    info = backend_error(bug)
    assert info is not None
    assert (info.status, info.code, info.type) == (500, "internal_error", "server_error")
    assert "ValueError" in info.message and "oops" not in info.message
    assert error_response(info).headers.get("retry-after") is None


def test_lost_replicas_and_full_queues_are_retryable() -> None:
    for exc in (ActorDiedError(), _task_error(ActorDiedError()), DeploymentUnavailableError("x")):
        info = backend_error(exc)
        assert info is not None and (info.status, info.code) == (503, "backend_unavailable")
        assert error_response(info).headers["retry-after"] == "1"
    full = backend_error(BackPressureError(4, 4, status_code=429, retry_after_s=3))
    assert full is not None and (full.status, full.code) == (429, "overloaded")
    assert error_response(full).headers["retry-after"] == "3"
    assert "retry_after_s" not in full.body()["error"]


def test_api_errors_keep_their_fields_even_from_a_replica() -> None:
    raised = APIError("too long", param="messages", code="context_length_exceeded")
    for exc in (raised, _task_error(raised)):
        assert backend_error(exc) == raised.info
    assert backend_error(RuntimeError("local bug")) is None


def test_only_a_confirmed_death_is_a_lost_replica() -> None:
    assert replica_lost(ActorDiedError()) and replica_lost(_task_error(ActorDiedError()))
    assert not replica_lost(ActorUnavailableError("?", b"\0" * 16))  # It may still be running.
    assert not replica_lost(_task_error(ValueError()))


def test_fault_hook_needs_the_flag() -> None:
    inject_fault(False, ["serve_app-fault:engine"], "engine")
    inject_fault(True, ["serve_app-fault:preprocess"], "engine")
    with pytest.raises(RuntimeError, match="fault injected in engine"):
        inject_fault(True, ("serve_app-fault:engine",), "engine")


# --- re-submission before the first output -------------------------------------------------


class _Call:
    """Streaming handle calls: each attempt yields ``items`` then raises ``fail`` (if any)."""

    def __init__(self, *attempts: tuple[list[Any], BaseException | None]) -> None:
        self.attempts = list(attempts)
        self.made = 0

    def __call__(self) -> Any:
        items, fail = self.attempts[self.made]
        self.made += 1

        async def gen() -> AsyncIterator[Any]:
            for item in items:
                yield item
            if fail is not None:
                raise fail

        return gen()


async def _collect(call: _Call, retries: int = 1) -> tuple[list[Any], list[Any]]:
    why: list[Any] = []
    stream = resubmitting_stream(
        call, assign_timeout_s=1, timeout_s=5, retries=retries, on_retry=why.append
    )
    return [item async for item in stream], why


def test_replica_lost_before_the_first_item_is_resubmitted_once() -> None:
    call = _Call(([], ActorDiedError()), ([1, 2], None))
    items, why = asyncio.run(_collect(call))
    assert items == [1, 2] and call.made == 2 and isinstance(why[0], ActorDiedError)
    twice = _Call(([], ActorDiedError()), ([], ActorDiedError()))
    with pytest.raises(ActorDiedError):
        asyncio.run(_collect(twice))
    assert twice.made == 2


def test_engine_unavailable_as_first_item_is_resubmitted() -> None:
    dead = ErrorInfo("engine died", 503, "server_error", code="engine_unavailable")
    items, _ = asyncio.run(_collect(_Call(([dead], None), ([7], None))))
    assert items == [7]
    items, _ = asyncio.run(_collect(_Call(([dead], None), ([dead], None))))
    assert items == [dead]  # Out of retries: the caller answers 503 engine_unavailable.


def test_nothing_is_resubmitted_after_the_first_item_or_for_a_bug() -> None:
    mid = _Call(([1], ActorDiedError()), ([1, 2], None))
    with pytest.raises(ActorDiedError):
        asyncio.run(_collect(mid))
    assert mid.made == 1
    bug = _Call(([], _task_error(ValueError())), ([1], None))
    with pytest.raises(RayTaskError):
        asyncio.run(_collect(bug))
    assert bug.made == 1


def test_a_call_cancelled_under_its_caller_is_a_503_not_a_silent_cancel() -> None:
    """A CancelledError the callee raised (an aborted call) must reach the caller as an error
    it handles; the caller's own cancellation still cancels."""
    with pytest.raises(APIError) as cancelled:
        asyncio.run(_collect(_Call(([1], asyncio.CancelledError()))))
    assert cancelled.value.info.status == 503
    assert cancelled.value.info.code == "backend_unavailable"

    async def caller_leaves() -> None:
        stream = bounded_stream(_hanging, assign_timeout_s=1, timeout_s=5)
        task = asyncio.ensure_future(anext(stream))
        await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(caller_leaves())


def _hanging() -> AsyncIterator[Any]:
    """A streaming handle call that never answers."""

    async def gen() -> AsyncIterator[Any]:
        await asyncio.Event().wait()
        yield None

    return gen()


def test_bounded_call_is_503_after_its_timeout() -> None:
    class Slow:
        cancelled = False

        def __await__(self) -> Any:
            return asyncio.sleep(5).__await__()

        def cancel(self) -> None:
            self.cancelled = True

    slow = Slow()
    with pytest.raises(APIError) as error:
        asyncio.run(bounded_call(slow, 0.05, "The preprocessor"))
    assert (error.value.info.status, error.value.info.code) == (503, "backend_unavailable")
    assert "The preprocessor did not answer within 0.05 s" in error.value.info.message
    assert slow.cancelled

    async def quick() -> int:
        return 3

    assert asyncio.run(bounded_call(quick(), 1, "x")) == 3


# --- readiness -----------------------------------------------------------------------------


def test_readiness_is_cached_and_survives_a_silent_controller() -> None:
    answers: list[Any] = [1, 0, RuntimeError("controller down")]
    calls: list[int] = []
    clock = SimpleNamespace(now=0.0)

    async def probe() -> int:
        calls.append(1)
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return int(answer)

    async def run() -> list[bool]:
        ready = Readiness(probe, timeout_s=1, refresh_s=2, clock=lambda: clock.now)
        seen = [await ready.ready(), await ready.ready()]  # The second from the cache.
        clock.now = 3
        seen.append(await ready.ready())  # No engine replica running now.
        clock.now = 6
        seen.append(await ready.ready())  # Controller silent: the last count stands.
        return seen

    assert asyncio.run(run()) == [True, True, False, False]
    assert len(calls) == 3


def test_readiness_unknown_until_the_controller_answers() -> None:
    async def never() -> int:
        await asyncio.sleep(10)
        return 1

    async def run() -> bool:
        return await Readiness(never, timeout_s=0.05).ready()

    assert asyncio.run(run()) is False


# --- SSE keep-alive ------------------------------------------------------------------------


def test_keepalive_comments_while_a_stream_waits() -> None:
    async def events() -> AsyncIterator[str]:
        yield "data: 1\n\n"
        await asyncio.sleep(0.35)
        yield "data: 2\n\n"

    async def run(interval: float) -> list[str]:
        return [event async for event in with_keepalive(events(), interval)]

    out = asyncio.run(run(0.1))
    assert out[0] == "data: 1\n\n" and out[-1] == "data: 2\n\n"
    assert set(out[1:-1]) == {SSE_KEEPALIVE} and len(out) >= 4
    assert asyncio.run(run(0)) == ["data: 1\n\n", "data: 2\n\n"]


def test_keepalive_stops_the_stream_when_the_client_leaves_and_raises_its_errors() -> None:
    closed: list[str] = []

    async def endless() -> AsyncIterator[str]:
        try:
            while True:
                yield "data: x\n\n"
                await asyncio.sleep(0.01)
        finally:
            closed.append("engine request cancelled")

    async def failing() -> AsyncIterator[str]:
        yield "data: 1\n\n"
        raise RuntimeError("engine lost")

    async def leave_early() -> None:
        stream = with_keepalive(endless(), 5)
        async for _ in stream:
            break
        await stream.aclose()  # What Starlette does when the client disconnects.

    asyncio.run(leave_early())
    assert closed == ["engine request cancelled"]

    async def drain() -> list[str]:
        return [event async for event in with_keepalive(failing(), 5)]

    with pytest.raises(RuntimeError, match="engine lost"):
        asyncio.run(drain())


# --- the hung-engine detector --------------------------------------------------------------


def _watchdog(stall_timeout_s: float | None) -> tuple[EngineWatchdog, Any, Any]:
    clock = SimpleNamespace(now=100.0)
    llm = SimpleNamespace(output_processor=SimpleNamespace(get_num_unfinished_requests=lambda: 0))
    watchdog = EngineWatchdog(stall_timeout_s=stall_timeout_s, clock=lambda: clock.now)
    watchdog._llm = llm
    return watchdog, llm, clock


def test_busy_engine_without_steps_is_hung_idle_time_never_counts() -> None:
    watchdog, llm, clock = _watchdog(5)
    clock.now += 60  # Idle for a minute: no verdict, and it must not count once busy.
    assert watchdog.check() == ""
    llm.output_processor.get_num_unfinished_requests = lambda: 3
    assert watchdog.check() == ""  # Busy from now on.
    clock.now += 4
    watchdog.heartbeat()  # A step: progress.
    clock.now += 4
    assert watchdog.check() == ""
    clock.now += 1.5
    assert "no progress for 6 s with 3 requests unfinished" in watchdog.check()
    assert _watchdog(None)[0].check() == ""  # Disabled.


# --- one request's bug in an aggregation window --------------------------------------------


def test_a_bug_in_one_request_fails_only_that_request_of_the_window() -> None:
    from serve_app.config import AppConfig
    from serve_app.hops import PreprocessRequest, SamplingSpec
    from serve_app.models import resolve_model
    from serve_app.preprocess.preprocessor import Preprocessor

    config = AppConfig.model_validate({"fault_injection": True})
    preprocessor = Preprocessor(config, resolve_model(config.model.name))

    def request(i: int, *stop: str) -> PreprocessRequest:
        messages = [{"role": "user", "content": f"Hello {i}"}]
        return PreprocessRequest(f"r{i}", "chat", SamplingSpec(stop=stop), messages=messages)

    results = preprocessor.preprocess_many(
        [request(0), request(1, "serve_app-fault:preprocess"), request(2)]
    )
    assert [r.error is None for r in results] == [True, False, True]
    error = results[1].error
    assert error is not None and (error.status, error.code) == (500, "internal_error")
    assert all(r.prompts for r in (results[0], results[2]))


def test_a_slow_first_step_starts_the_stream_without_it() -> None:
    from serve_app.config import AppConfig
    from serve_app.openai.serving import OpenAIServing

    async def never(_: Any) -> Any:
        raise AssertionError("not called")

    serving = OpenAIServing(
        AppConfig.model_validate({"sse_keepalive_s": 0.05}), preprocess=never, generate=never
    )

    async def steps(delay: float) -> AsyncIterator[int]:
        await asyncio.sleep(delay)
        yield 1
        yield 2

    async def run(delay: float) -> tuple[int | None, list[int]]:
        first, rest = await serving.start_stream(steps(delay))
        return first, [item async for item in rest]

    assert asyncio.run(run(0)) == (1, [2])  # In time: the caller still sees errors first.
    assert asyncio.run(run(0.3)) == (None, [1, 2])  # Late: nothing lost, order kept.


def test_each_engine_call_gets_its_own_serve_request_id() -> None:
    """Serve indexes pending calls by the caller's request id; the prompts of one request
    must not share it (the prefix-aware router assigned only one of them at a time)."""
    import dataclasses

    from ray.serve import context

    from serve_app.graph.handles import as_own_request

    parent = dataclasses.replace(
        context._get_serve_request_context(), _internal_request_id="parent-request"
    )
    token = context._serve_request_context.set(parent)  # type: ignore[arg-type]
    try:
        seen = [
            as_own_request(lambda: context._get_serve_request_context()._internal_request_id)
            for _ in range(3)
        ]
        assert len(set(seen)) == 3 and "parent-request" not in seen
        assert context._get_serve_request_context()._internal_request_id == "parent-request"
    finally:
        context._serve_request_context.reset(token)

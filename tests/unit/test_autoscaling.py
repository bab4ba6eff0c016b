"""Autoscaling decisions, backpressure/health options and the bounded engine stream, no Ray."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import pytest
from pydantic import ValidationError
from ray.serve.exceptions import BackPressureError

from serve_app.app import check_placement
from serve_app.config import AppConfig, EngineConfig
from serve_app.config.autoscaling import (
    POLICY_PATH,
    QUEUE_METRIC,
    EngineAutoscalingConfig,
    autoscaling_config,
)
from serve_app.engine.autoscaling import EngineQueuePolicy, desired_replicas
from serve_app.errors import APIError
from serve_app.ingress.handles import bounded_stream


@pytest.mark.parametrize(
    ("depths", "current", "expected"),
    [
        ({"a": 0.0}, 1, 0),  # Idle: Serve clamps to min_replicas.
        ({"a": 3.0}, 1, 1),
        ({"a": 4.0}, 1, 1),  # Exactly at target.
        ({"a": 9.0}, 1, 3),
        ({"a": 6.0, "b": 1.0}, 2, 2),
        ({"a": 1.0, "b": 0.5}, 2, 1),
    ],
)
def test_desired_replicas(depths: dict[str, float], current: int, expected: int) -> None:
    assert desired_replicas(depths, target_queue_depth=4, current_replicas=current) == expected


def test_desired_replicas_without_reports() -> None:
    assert desired_replicas({}, target_queue_depth=4, current_replicas=2) == 2
    assert desired_replicas({}, target_queue_depth=4, current_replicas=1, fallback_total=12) == 3


def _ctx(metrics: dict[str, dict[str, float]], running: list[str], total: float = 0) -> Any:
    return SimpleNamespace(
        aggregated_metrics=metrics,
        running_replicas=running,
        current_num_replicas=len(running),
        total_num_requests=total,
    )


def test_policy_reads_engine_queue_of_running_replicas() -> None:
    policy = EngineQueuePolicy(target_queue_depth=2)
    ctx = _ctx({QUEUE_METRIC: {"r1": 5.0, "gone": 100.0}}, ["r1"])
    assert policy(ctx) == (3, {})
    assert policy(_ctx({}, ["r1"], total=1)) == (1, {})  # No reports yet: Serve's count.


def test_engine_options_for_queue_depth_autoscaling() -> None:
    engine = EngineConfig(
        device="cpu",
        num_replicas="auto",
        min_replicas=1,
        max_replicas=3,
        autoscaling=EngineAutoscalingConfig(
            target_queue_depth=8, upscale_delay_s=5, downscale_delay_s=60
        ),
    )
    options = engine.deployment_options()
    auto = options["autoscaling_config"]
    assert (auto["min_replicas"], auto["max_replicas"]) == (1, 3)
    assert (auto["upscale_delay_s"], auto["downscale_delay_s"]) == (5, 60)
    assert auto["policy"] == {
        "policy_function": POLICY_PATH,
        "policy_kwargs": {"target_queue_depth": 8.0},
    }
    assert "num_replicas" not in options
    assert engine.runtime_env_vars()["RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S"] == "2"
    default = EngineConfig(
        device="cpu", num_replicas="auto", autoscaling={"policy": "ongoing_requests"}
    )
    assert "policy" not in default.deployment_options()["autoscaling_config"]


def test_policy_path_resolves_for_serve() -> None:
    from ray.serve.config import AutoscalingConfig

    options = EngineConfig(device="cpu", num_replicas="auto").deployment_options()
    config = AutoscalingConfig(**options["autoscaling_config"])
    assert config.policy.get_policy() is EngineQueuePolicy


def test_backpressure_health_and_shutdown_options() -> None:
    engine = EngineConfig(device="cpu", max_queued_requests=8, backpressure_status=429)
    options = engine.deployment_options()
    assert options["max_queued_requests"] == 8
    assert options["backpressure_config"] == {"status_code": 429, "retry_after_s": 1}
    assert options["graceful_shutdown_timeout_s"] == 30
    assert options["health_check_period_s"] == 5
    with pytest.raises(ValidationError):
        EngineConfig(backpressure_status=500)
    with pytest.raises(ValidationError, match="look_back_period_s"):
        EngineAutoscalingConfig(metrics_interval_s=20, look_back_period_s=10)


def _gpu_config(tp: int, pp: int = 1) -> AppConfig:
    return AppConfig.model_validate(
        {"engine": {"device": "gpu", "tensor_parallel_size": tp, "pipeline_parallel_size": pp}}
    )


def test_placement_check() -> None:
    four = [{"Alive": True, "Resources": {"CPU": 16, "GPU": 4}}]
    check_placement(_gpu_config(4), four)
    with pytest.raises(ValueError, match=r"needs 8 GPUs on one node.*largest node has 4"):
        check_placement(_gpu_config(8), four)
    two_nodes = [*four, {"Alive": True, "Resources": {"CPU": 16, "GPU": 4}}]
    check_placement(_gpu_config(4, 2), two_nodes)  # PACK may span nodes.
    with pytest.raises(ValueError, match="needs 8 GPUs on one node"):
        check_placement(_gpu_config(8), two_nodes)
    check_placement(AppConfig.model_validate({"engine": {"device": "cpu"}}), [])


class _FakeResponse:
    """A DeploymentResponseGenerator stand-in: assignment and items with delays."""

    def __init__(self, assign_s: float, items: int, item_s: float) -> None:
        self.assign_s, self.items, self.item_s = assign_s, items, item_s
        self.cancelled = False

    async def _fetch_future_result_async(self) -> None:
        await asyncio.sleep(self.assign_s)

    def __aiter__(self) -> AsyncIterator[int]:
        return self._gen()

    async def _gen(self) -> AsyncIterator[int]:
        for i in range(self.items):
            await asyncio.sleep(self.item_s)
            yield i

    def cancel(self) -> None:
        self.cancelled = True


async def _drain(response: _FakeResponse, **bounds: float) -> list[int]:
    iterator = aiter(response)

    class Wrapped:
        async def _fetch_future_result_async(self) -> None:
            await response._fetch_future_result_async()

        def __aiter__(self) -> Wrapped:
            return self

        async def __anext__(self) -> int:
            return await anext(iterator)

        def cancel(self) -> None:
            response.cancel()

    return [item async for item in bounded_stream(Wrapped, **bounds)]


def test_bounded_stream() -> None:
    ok = _FakeResponse(0, 3, 0)
    assert asyncio.run(_drain(ok, assign_timeout_s=1, timeout_s=1)) == [0, 1, 2]
    assert not ok.cancelled
    unassigned = _FakeResponse(5, 3, 0)
    with pytest.raises(APIError) as error:
        asyncio.run(_drain(unassigned, assign_timeout_s=0.05, timeout_s=1))
    assert (error.value.info.status, error.value.info.code) == (503, "backend_unavailable")
    assert unassigned.cancelled
    full = _FakeResponse(0, 3, 0)

    async def reject() -> None:
        raise BackPressureError(4, 4, status_code=429)

    full._fetch_future_result_async = reject  # type: ignore[method-assign]

    def cancel_raises() -> None:  # Serve's cancel() re-raises the failed assignment.
        raise BackPressureError(4, 4, status_code=429)

    full.cancel = cancel_raises  # type: ignore[method-assign]
    with pytest.raises(APIError) as error:
        asyncio.run(_drain(full, assign_timeout_s=1, timeout_s=1))
    assert (error.value.info.status, error.value.info.code) == (429, "overloaded")

    def refuse() -> None:
        raise BackPressureError(4, 4)

    async def drain_refused() -> list[Any]:
        return [item async for item in bounded_stream(refuse, assign_timeout_s=1, timeout_s=1)]

    with pytest.raises(APIError) as error:
        asyncio.run(drain_refused())
    assert (error.value.info.status, error.value.info.code) == (503, "overloaded")
    slow = _FakeResponse(0, 100, 0.05)
    with pytest.raises(APIError) as error:
        asyncio.run(_drain(slow, assign_timeout_s=1, timeout_s=0.2))
    assert (error.value.info.status, error.value.info.code) == (504, "timeout")
    assert slow.cancelled


def test_bounded_stream_tells_a_callees_cancel_from_its_own() -> None:
    class CancelledByReplica(_FakeResponse):
        async def _gen(self) -> AsyncIterator[int]:
            yield 0
            raise asyncio.CancelledError  # What Serve raises for Ray's TaskCancelledError.

    cut = CancelledByReplica(0, 3, 0)
    with pytest.raises(APIError) as error:
        asyncio.run(_drain(cut, assign_timeout_s=1, timeout_s=5))
    assert (error.value.info.status, error.value.info.code) == (503, "engine_unavailable")
    assert cut.cancelled

    async def consumer_cancelled() -> None:
        slow = _FakeResponse(0, 100, 0.05)
        task = asyncio.ensure_future(_drain(slow, assign_timeout_s=1, timeout_s=5))
        await asyncio.sleep(0.12)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert slow.cancelled

    asyncio.run(consumer_cancelled())


def test_serve_keeps_the_configured_delays_for_the_queue_depth_policy(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Serve's own wrapper around a custom policy (what its controller calls every tick), driven
    on a simulated clock with the autoscaling_config we generate: a queue above target scales up
    only after upscale_delay_s, an empty queue scales down only after downscale_delay_s, and a
    short dip does not scale down at all."""
    from ray.serve import autoscaling_policy
    from ray.serve.config import AutoscalingConfig

    auto = EngineAutoscalingConfig(upscale_delay_s=30, downscale_delay_s=300)
    generated = autoscaling_config(auto, min_replicas=1, max_replicas=4, target_ongoing=16)
    config = AutoscalingConfig(**{k: v for k, v in generated.items() if k != "policy"})
    tick = autoscaling_policy._apply_autoscaling_config(EngineQueuePolicy(target_queue_depth=4))
    clock = [0.0]
    monkeypatch.setattr(autoscaling_policy.time, "time", lambda: clock[0])
    state: dict[str, Any] = {}
    target = 1

    def run(seconds: int, depth_per_replica: float) -> list[int]:
        nonlocal state, target
        targets = []
        for _ in range(seconds):
            replicas = [f"r{i}" for i in range(target)]
            ctx = _ctx({QUEUE_METRIC: dict.fromkeys(replicas, depth_per_replica)}, replicas)
            ctx.target_num_replicas, ctx.config, ctx.policy_state = target, config, state
            target, state = tick(ctx)
            targets.append(target)
            clock[0] += 1
        return targets

    climb = run(40, depth_per_replica=16)  # 16 queued on one replica: 4 wanted.
    assert climb[:29] == [1] * 29 and climb[31:] == [4] * 9, climb
    dip = run(60, depth_per_replica=0)  # A minute of nothing: no downscale yet.
    assert dip == [4] * 60
    run(5, depth_per_replica=4)  # Back at target: the downscale timer starts over.
    idle = run(310, depth_per_replica=0)
    assert idle[:299] == [4] * 299 and idle[-1] == 1, idle[295:]


def test_errors_are_mapped_by_cause_not_by_the_replica_that_raised() -> None:
    """A bug inside a replica is a 500 internal_error (clients do not retry it); only an outage
    (a dead or full replica, also when a replica's own call hit one) is a retryable 503."""
    from ray.exceptions import ActorDiedError, RayTaskError
    from ray.serve.exceptions import BackPressureError

    from serve_app.errors import APIError, backend_error, stream_error

    def raised_in_replica(cause: BaseException) -> RayTaskError:
        return RayTaskError("Engine.generate", "Traceback ...", cause)

    assert backend_error(raised_in_replica(KeyError("x"))) is None
    assert backend_error(raised_in_replica(APIError("bad", param="n"))).status == 400  # type: ignore[union-attr]
    assert backend_error(raised_in_replica(ActorDiedError())).status == 503  # type: ignore[union-attr]
    assert backend_error(ActorDiedError()).code == "backend_unavailable"  # type: ignore[union-attr]
    full = BackPressureError(num_queued_requests=3, max_queued_requests=2)
    assert backend_error(raised_in_replica(full)).status == 503  # type: ignore[union-attr]
    assert backend_error(ValueError()) is None
    bug = stream_error(raised_in_replica(ZeroDivisionError()))
    assert (bug.status, bug.type, bug.code) == (500, "server_error", "internal_error")
    assert stream_error(ActorDiedError()).code == "backend_unavailable"

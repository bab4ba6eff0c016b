"""Resubmission before the first token: which failures count as a lost engine, and that a
request is tried at most twice and never after an item went out (no Ray cluster)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

import pytest
from ray.exceptions import ActorDiedError, ActorUnavailableError, RayTaskError

from serve_app.errors import APIError, replica_lost
from serve_app.ingress.handles import resubmitted_once

ENGINE_DEAD = APIError("dead", status=503, type="server_error", code="engine_unavailable")


def _task_error(cause: BaseException) -> RayTaskError:
    return RayTaskError("generate", "traceback", cause)


@pytest.mark.parametrize(
    ("exc", "lost"),
    [
        (ActorDiedError(), True),
        (ActorUnavailableError("unreachable", None), True),
        (ENGINE_DEAD, True),
        (_task_error(ENGINE_DEAD), True),
        (_task_error(ActorDiedError()), True),
        (APIError("bad", param="max_tokens"), False),
        (_task_error(ValueError("a bug")), False),
        (APIError("slow", status=504, type="server_error", code="timeout"), False),
        (APIError("none", status=503, type="server_error", code="backend_unavailable"), False),
        (RuntimeError("a bug"), False),
        (ENGINE_DEAD.info, True),  # The engine's own error item (errors travel as values).
        (APIError("bad", param="n").info, False),
        ("a step", False),
    ],
)
def test_what_counts_as_a_lost_engine(exc: object, lost: bool) -> None:
    assert replica_lost(exc) is lost


def _attempts(
    *plans: tuple[list[object], BaseException | None],
) -> Callable[[], AsyncIterator[object]]:
    """Each call plays the next plan: yield its items, then raise its error (if any)."""
    queue = list(plans)
    retries: list[bool] = []

    async def attempt(again: bool) -> AsyncIterator[object]:
        retries.append(again)
        assert again == (len(retries) == 2)  # Only the second call is the resubmission.
        items, error = queue.pop(0)
        for item in items:
            yield item
        if error is not None:
            raise error

    attempt.calls = lambda: len(plans) - len(queue)  # type: ignore[attr-defined]
    return attempt


async def _collect(source: AsyncIterator[object]) -> list[object]:
    return [item async for item in source]


def test_lost_before_the_first_item_is_resubmitted_once() -> None:
    attempt = _attempts(([], ActorDiedError()), (["a", "b"], None))
    assert asyncio.run(_collect(resubmitted_once(attempt, backoff_s=0))) == ["a", "b"]
    assert attempt.calls() == 2  # type: ignore[attr-defined]


def test_lost_twice_is_the_error() -> None:
    attempt = _attempts(([], ActorDiedError()), ([], _task_error(ENGINE_DEAD)))
    with pytest.raises(RayTaskError):
        asyncio.run(_collect(resubmitted_once(attempt, backoff_s=0)))
    assert attempt.calls() == 2  # type: ignore[attr-defined]


def test_lost_after_an_item_is_not_resubmitted() -> None:
    attempt = _attempts((["a"], ActorDiedError()), (["x"], None))
    seen: list[object] = []

    async def run() -> None:
        async for item in resubmitted_once(attempt, backoff_s=0):
            seen.append(item)

    with pytest.raises(ActorDiedError):
        asyncio.run(run())
    assert seen == ["a"] and attempt.calls() == 1  # type: ignore[attr-defined]


def test_other_errors_are_not_resubmitted() -> None:
    attempt = _attempts(([], APIError("bad", param="n")), (["x"], None))
    with pytest.raises(APIError):
        asyncio.run(_collect(resubmitted_once(attempt, backoff_s=0)))
    assert attempt.calls() == 1  # type: ignore[attr-defined]


def test_an_engine_error_item_before_the_first_step_is_resubmitted() -> None:
    """The engine reports its dead core as an error item, not an exception."""
    attempt = _attempts(([ENGINE_DEAD.info], None), (["a"], None))
    assert asyncio.run(_collect(resubmitted_once(attempt, backoff_s=0))) == ["a"]
    assert attempt.calls() == 2  # type: ignore[attr-defined]


def test_an_engine_error_item_on_the_last_try_is_passed_on() -> None:
    attempt = _attempts(([ENGINE_DEAD.info], None), ([ENGINE_DEAD.info], None))
    assert asyncio.run(_collect(resubmitted_once(attempt, backoff_s=0))) == [ENGINE_DEAD.info]

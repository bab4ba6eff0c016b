"""Calls through Serve deployment handles and Ray actors: bounded in time, mapped to OpenAI
errors, and a stream re-submitted once when its engine replica is lost before its first item."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import dataclasses
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import Any

from ray.serve.exceptions import BackPressureError

from serve_app.errors import APIError, ErrorInfo, replica_lost

logger = logging.getLogger("serve_app.graph.handles")


def timeout_error(timeout_s: float) -> APIError:
    return APIError(
        f"The request took longer than {timeout_s:g} s and was aborted; lower max_tokens or "
        "raise request_timeout_s.",
        status=504,
        type="server_error",
        code="timeout",
    )


def _overloaded(exc: BackPressureError) -> APIError:
    return APIError(
        f"The model backend is at capacity ({exc.message.rstrip('.')}); retry shortly.",
        status=exc.status_code,
        type="server_error",
        code="overloaded",
    )


def as_own_request(call: Callable[[], Any]) -> Any:
    """``call()`` (a handle ``.remote()``) under a Serve request context of its own.

    Serve 2.60 indexes a handle's pending requests by the caller's internal request id, which
    every call made while serving one HTTP request shares; a request router without Serve's
    FIFO fallback (ours: it must not hand its pick to another request) then assigns only one
    of several concurrent calls — the prompts of a multi-prompt completion, Batch API lines —
    and the others wait until ``engine_wait_timeout_s``. A fresh id per call keeps them apart;
    cancellation stays ours (``bounded_stream`` cancels what it started).
    """
    from ray.serve import context as serve_context
    from ray.serve._private.utils import generate_request_id

    def run() -> Any:
        current = serve_context._get_serve_request_context()
        own = dataclasses.replace(current, _internal_request_id=generate_request_id())
        serve_context._serve_request_context.set(own)  # type: ignore[arg-type]
        return call()

    return contextvars.copy_context().run(run)


async def bounded_stream(
    call: Callable[[], Any], *, assign_timeout_s: float, timeout_s: float
) -> AsyncGenerator[Any, None]:
    """Items of a streaming handle call (``call()`` returns a ``DeploymentResponseGenerator``),
    bounded twice.

    No replica takes the call within ``assign_timeout_s`` (none running, or all full): 503
    ``backend_unavailable``; the handle's queue is full: 503/429 ``overloaded`` (never Serve's
    raw BackPressureError, which its proxy would answer in plain text). The whole stream past
    ``timeout_s``: 504 ``timeout``. Whenever the stream does not run to its end (bound hit,
    consumer gone), the call is cancelled, so the engine aborts the vLLM request.
    """
    deadline = time.monotonic() + timeout_s
    try:
        response = as_own_request(call)
    except BackPressureError as exc:
        raise _overloaded(exc) from None
    done = False
    try:
        # Private Serve API (2.60): resolves once a replica accepted the call.
        assigned = getattr(response, "_fetch_future_result_async", None)
        if assigned is not None:
            try:
                await asyncio.wait_for(assigned(), min(assign_timeout_s, timeout_s))
            except TimeoutError:
                raise APIError(
                    f"No model replica accepted the request within {assign_timeout_s:g} s "
                    "(starting, restarting or overloaded); retry shortly.",
                    status=503,
                    type="server_error",
                    code="backend_unavailable",
                ) from None
        # One timer per item (asyncio.timeout_at), not a task per item (asyncio.wait_for):
        # this loop runs once per engine step of every stream.
        loop_deadline = asyncio.get_running_loop().time() + (deadline - time.monotonic())
        while True:
            try:
                async with asyncio.timeout_at(loop_deadline):
                    item = await anext(response)
            except StopAsyncIteration:
                done = True
                return
            except TimeoutError:
                raise timeout_error(timeout_s) from None
            yield item
    except BackPressureError as exc:
        raise _overloaded(exc) from None
    except asyncio.CancelledError:
        task = asyncio.current_task()
        if task is None or task.cancelling():
            raise  # Our caller gave up: the call is cancelled below.
        # Cancelled under us (the callee aborted it, or Serve dropped its assignment): a
        # BaseException no `except Exception` above would see; callers must meet an error.
        raise APIError(
            "The model backend cancelled the request; retry shortly.",
            status=503,
            type="server_error",
            code="backend_unavailable",
        ) from None
    finally:
        if not done:
            # Serve's cancel() re-raises a failed assignment (e.g. BackPressureError): that
            # must not replace the error already being raised.
            with contextlib.suppress(Exception):
                response.cancel()


def unavailable(what: str, timeout_s: float) -> APIError:
    return APIError(
        f"{what} did not answer within {timeout_s:g} s (starting, restarting or overloaded); "
        "retry shortly.",
        status=503,
        type="server_error",
        code="backend_unavailable",
    )


async def bounded_call(call: Awaitable[Any], timeout_s: float, what: str) -> Any:
    """The result of a unary handle or actor call (``DeploymentResponse``, ``ObjectRef``), or
    503 ``backend_unavailable`` after ``timeout_s``; the call is cancelled then."""
    try:
        return await asyncio.wait_for(_awaited(call), timeout_s)
    except TimeoutError:
        cancel = getattr(call, "cancel", None)
        if cancel is not None:
            with contextlib.suppress(Exception):
                cancel()
        raise unavailable(what, timeout_s) from None


async def _awaited(call: Awaitable[Any]) -> Any:
    return await call


def engine_lost(item: Any) -> bool:
    """A first item that says the engine failed the request without running it."""
    return isinstance(item, ErrorInfo) and item.code == "engine_unavailable"


async def resubmitting_stream(
    call: Callable[[], Any],
    *,
    assign_timeout_s: float,
    timeout_s: float,
    retries: int = 1,
    on_retry: Callable[[BaseException | ErrorInfo], None] | None = None,
) -> AsyncIterator[Any]:
    """``bounded_stream`` of ``call()``, re-submitted (up to ``retries`` times) while nothing
    has been yielded yet: when the replica holding it died (``errors.replica_lost``) or its
    engine failed the request before any output (a first item ``engine_unavailable``: a dead
    or hung engine core). Serve's router has dropped the dead replica by then, so the new call
    goes to another one (or waits up to ``assign_timeout_s`` for the replacement); the engine
    request keeps its id. Once an item went out nothing is retried: the error reaches the
    caller, which ends an SSE stream with an error event. ``timeout_s`` bounds all attempts.
    """
    deadline = time.monotonic() + timeout_s
    attempt = 0
    while True:
        started = False
        why: BaseException | ErrorInfo
        stream = bounded_stream(
            call,
            assign_timeout_s=assign_timeout_s,
            timeout_s=max(deadline - time.monotonic(), 0.001),
        )
        try:
            async with contextlib.aclosing(stream):
                async for item in stream:
                    if not started and attempt < retries and engine_lost(item):
                        why = item
                        break
                    started = True
                    yield item
                else:
                    return
        except Exception as exc:
            if started or attempt >= retries or not replica_lost(exc):
                raise
            why = exc
        attempt += 1
        logger.warning("Engine replica lost before the first output (%r); re-submitting", why)
        if on_retry is not None:
            on_retry(why)

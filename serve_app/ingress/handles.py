"""Calls from the router into the graph through Serve handles, bounded in time and in queue.

Serve's own errors (its queue full, no replica taking the call) become OpenAI-shaped errors here,
so the HTTP side never sees a raw Serve exception.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

from ray.serve.exceptions import BackPressureError
from ray.serve.handle import DeploymentHandle

from serve_app.errors import (
    APIError,
    cancelled_by_callee,
    cancelled_here,
    engine_unavailable,
    replica_lost,
)

logger = logging.getLogger("serve_app.ingress")
# Before a resubmission: Serve's handle drops a dead replica when the failed call settles.
RESUBMIT_BACKOFF_S = 0.5
RESUBMIT_ASSIGN_S = 5.0  # A resubmission waits this long at most for a live replica.


def hop_handle(handle: DeploymentHandle, throughput_mode: bool) -> DeploymentHandle:
    """``handle`` for calls on the request path. In Serve's throughput mode
    (``serve_throughput_mode``) over its gRPC transport with plain pickle: the hop messages are
    small dataclasses, and a Ray object per streamed item costs more CPU than the item. The
    option has to be set here: a handle carries the transport chosen where the app was built."""
    if not throughput_mode:
        return handle
    return handle.options(
        _by_reference=False, request_serialization="pickle", response_serialization="pickle"
    )


def timeout_error(timeout_s: float) -> APIError:
    return APIError(
        f"The request took longer than {timeout_s:g} s and was aborted; lower max_tokens or "
        "raise request_timeout_s.",
        status=504,
        type="server_error",
        code="timeout",
    )


def replica_gone() -> APIError:
    return engine_unavailable(
        "The engine replica serving the request was lost (dead or hung); retry shortly."
    )


async def _unless_lost(item: Awaitable[Any], lost: asyncio.Future[None]) -> Any:
    """``item``'s result, unless ``lost`` resolves first: then ``replica_gone()``."""
    next_item = asyncio.ensure_future(item)
    try:
        await asyncio.wait((next_item, lost), return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not next_item.done():
            next_item.cancel()
            # Serve's generator turns the cancel into its RequestCancelledError: retrieved
            # here, or asyncio logs it as never retrieved.
            next_item.add_done_callback(lambda done: done.cancelled() or done.exception())
    if not next_item.done():
        raise replica_gone()
    return next_item.result()


def _overloaded(exc: BackPressureError) -> APIError:
    return APIError(
        f"The model backend is at capacity ({exc.message.rstrip('.')}); retry shortly.",
        status=exc.status_code,
        type="server_error",
        code="overloaded",
    )


async def bounded_stream(
    call: Callable[[], Any],
    *,
    assign_timeout_s: float,
    timeout_s: float,
    watch: AbstractContextManager[asyncio.Future[None] | None] | None = None,
) -> AsyncIterator[Any]:
    """Items of a streaming handle call (``call()`` returns a ``DeploymentResponseGenerator``),
    bounded twice.

    No replica takes the call within ``assign_timeout_s`` (none running, or all full): 503
    ``backend_unavailable``; the handle's queue is full: 503/429 ``overloaded`` (never Serve's
    raw BackPressureError, which its proxy would answer in plain text). The whole stream past
    ``timeout_s``: 504 ``timeout``. Whenever the stream does not run to its end (bound hit,
    consumer gone), the call is cancelled, so the engine aborts the vLLM request.

    ``watch``: entered around the call, gives a future that resolves if the call's replica is
    lost (``engine.routing.departures``); until the first item, that ends the call with 503
    ``engine_unavailable`` (resubmitted by ``resubmitted_once``) instead of waiting out
    ``timeout_s`` on a replica that will never answer.
    """
    with watch or nullcontext() as lost:
        deadline = time.monotonic() + timeout_s
        try:
            response = call()
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
            while True:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise timeout_error(timeout_s)
                try:
                    # asyncio.timeout, not wait_for: no task per item (this runs once per token).
                    async with asyncio.timeout(remaining):
                        if lost is None:
                            item = await anext(response)
                        else:  # Until the first item: its replica may be lost.
                            item = await _unless_lost(anext(response), lost)
                            lost = None
                except StopAsyncIteration:
                    done = True
                    return
                except TimeoutError:
                    raise timeout_error(timeout_s) from None
                yield item
        except BackPressureError as exc:
            raise _overloaded(exc) from None
        except asyncio.CancelledError as exc:
            if cancelled_here():
                raise
            raise cancelled_by_callee(exc) from None
        finally:
            if not done:
                # Serve's cancel() re-raises a failed assignment (e.g. BackPressureError): that
                # must not replace the error already being raised.
                with contextlib.suppress(Exception):
                    response.cancel()


async def resubmitted_once(
    attempt: Callable[[bool], AsyncIterator[Any]],
    on_resubmit: Callable[[], None] | None = None,
    backoff_s: float = RESUBMIT_BACKOFF_S,
) -> AsyncIterator[Any]:
    """The items of ``attempt(False)``; if its engine went away before the first item (replica
    killed, node lost, engine core dead or hung: raised, or the engine's own error item), once
    more from ``attempt(True)``, a fresh call Serve routes to a live replica: invisible to the
    client, who has seen nothing yet. ``attempt(True)`` should wait only briefly for a replica
    (``RESUBMIT_ASSIGN_S``): with none left, the client hears so at once, not after a full
    assignment wait. After the first item the error stands (part of an answer is out). The
    engine request id stays the same, so both tries show as one request in traces."""
    for tries_left in (1, 0):
        started = False
        lost: Any = None
        items = attempt(not tries_left)
        try:
            async for item in items:
                if not started and tries_left and replica_lost(item):
                    lost = item
                    break
                started = True
                yield item
        except Exception as exc:
            if started or not tries_left or not replica_lost(exc):
                raise
            lost = exc
        finally:
            if (aclose := getattr(items, "aclose", None)) is not None:
                await aclose()
        if lost is None:
            return
        logger.warning("Engine lost before the first token (%r): resubmitting once", lost)
        if on_resubmit is not None:
            on_resubmit()
        await asyncio.sleep(backoff_s)

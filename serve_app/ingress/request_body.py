"""The request body at the ASGI level: read within a size limit (413 otherwise), replayed; or,
for uploads, streamed through to the route within its own limit.

Before a 413 the rest of the body is read and dropped, within bounds: a server that closes its
socket with request bytes unread makes the kernel send a reset, which can destroy the 413 before
the client reads it (the client sees "peer closed connection" instead of the error).
"""

from __future__ import annotations

import asyncio
import contextlib
import json

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from serve_app.errors import ErrorInfo


def header(scope: Scope, name: bytes) -> bytes | None:
    return next((value for key, value in scope["headers"] if key.lower() == name), None)


async def send_error(
    send: Send, info: ErrorInfo, headers: list[tuple[bytes, bytes]] | None = None
) -> None:
    body = json.dumps(info.body()).encode()
    await send(
        {
            "type": "http.response.start",
            "status": info.status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                *(headers or []),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


DRAIN_MAX_BYTES = 64 * 1024 * 1024
DRAIN_MAX_S = 10.0


async def _drain(receive: Receive) -> None:
    """Read and drop what is left of the request body, up to DRAIN_MAX_BYTES or DRAIN_MAX_S."""
    drained = 0
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(DRAIN_MAX_S):
            while drained <= DRAIN_MAX_BYTES:
                message = await receive()
                if message["type"] != "http.request":
                    return
                drained += len(message.get("body", b""))
                if not message.get("more_body", False):
                    return


async def _reject_declared_too_large(
    scope: Scope, receive: Receive, send: Send, limit: int, declared: int
) -> None:
    """Answer 413; drain the body first unless it is huge or not sent yet (100-continue)."""
    waits_for_continue = (header(scope, b"expect") or b"").lower() == b"100-continue"
    if not waits_for_continue and declared <= DRAIN_MAX_BYTES:
        await _drain(receive)
    await send_error(send, _too_large(limit), [(b"connection", b"close")])


def _too_large(limit: int) -> ErrorInfo:
    return ErrorInfo(
        f"Request body too large: the limit is {limit} bytes.",
        status=413,
        code="request_too_large",
    )


async def read_body(scope: Scope, receive: Receive, send: Send, limit: int) -> bytes | None:
    """The whole body, or None after a 413 (or a client that went away)."""
    declared = _header_int(header(scope, b"content-length"))
    if declared is not None and declared > limit:
        await _reject_declared_too_large(scope, receive, send, limit, declared)
        return None
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:  # Chunked uploads have no Content-Length: count as they come.
            if message.get("more_body", False):
                await _drain(receive)
            await send_error(send, _too_large(limit), [(b"connection", b"close")])
            return None
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


def replay_body(body: bytes, receive: Receive) -> Receive:
    """Hand the buffered body to the app once, then the real channel (disconnect events)."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


def _header_int(value: bytes | None) -> int | None:
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None


async def stream_within(
    app: ASGIApp, scope: Scope, receive: Receive, send: Send, limit: int
) -> None:
    """Run ``app`` on the body as it arrives (never buffered here), within ``limit`` bytes.

    Past the limit the app sees the client go away, and the client gets the 413; whatever the
    app answers after that is dropped (it answers a body it could not read).
    """
    declared = _header_int(header(scope, b"content-length"))
    if declared is not None and declared > limit:
        await _reject_declared_too_large(scope, receive, send, limit, declared)
        return
    size, rejected = 0, False

    async def counted() -> Message:
        nonlocal size, rejected
        if rejected:
            return {"type": "http.disconnect"}
        message = await receive()
        if message["type"] == "http.request":
            size += len(message.get("body", b""))
            if size > limit:
                rejected = True
                if message.get("more_body", False):
                    await _drain(receive)
                await send_error(send, _too_large(limit), [(b"connection", b"close")])
                return {"type": "http.disconnect"}
        return message

    async def answer(message: Message) -> None:
        if not rejected:
            await send(message)

    await app(scope, counted, answer)

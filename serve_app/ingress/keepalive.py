"""SSE keep-alive: a stream that waits (in a queue, behind a long prefill) still sends bytes.

Load balancers close connections idle for their timeout (30-60 s is common), which a stream
queued behind a full engine can exceed before its first token. A streaming request therefore
holds its headers for up to ``interval_s`` — fast errors (400, 429, 503) keep their HTTP
status — and if no answer came by then, the headers go out with an SSE comment line; every
``interval_s`` of silence until the end gets another. An error after the headers arrives as
the stream's error event, as one mid-stream does. SSE clients (the openai SDK, vLLM's
benchmark) skip comment lines.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Awaitable
from typing import Any

from starlette.responses import StreamingResponse
from starlette.types import Send

from serve_app.errors import stream_error
from serve_app.openai.serving import SSE_DONE, sse

KEEPALIVE = ": keep-alive\n\n"


class KeepAliveStreamingResponse(StreamingResponse):
    """A StreamingResponse that sends ``KEEPALIVE`` whenever nothing went out for
    ``interval_s``: one timer task per stream, not one per event (events flow at engine-step
    rate, and a task per event would cost the router tens of microseconds each)."""

    def __init__(self, content: AsyncIterator[str], interval_s: float, **kwargs: Any) -> None:
        super().__init__(content, **kwargs)
        self.interval_s = interval_s

    async def stream_response(self, send: Send) -> None:
        lock = asyncio.Lock()  # One message at a time: an event and a comment never interleave.
        last_sent = time.monotonic()

        async def emit(body: bytes) -> None:
            nonlocal last_sent
            async with lock:
                await send({"type": "http.response.body", "body": body, "more_body": True})
                last_sent = time.monotonic()

        streaming = asyncio.current_task()
        failed: list[Exception] = []

        async def tick() -> None:
            try:
                while True:
                    await asyncio.sleep(max(0.0, last_sent + self.interval_s - time.monotonic()))
                    if time.monotonic() - last_sent >= self.interval_s:
                        await emit(KEEPALIVE.encode())
            except Exception as exc:  # The client is gone: so is the stream waiting for it.
                failed.append(exc)
                if streaming is not None:
                    streaming.cancel()

        await send(
            {"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers}
        )
        ticker = asyncio.ensure_future(tick())
        try:
            async for chunk in self.body_iterator:
                await emit(chunk if isinstance(chunk, bytes) else str(chunk).encode(self.charset))
        except asyncio.CancelledError:
            if failed:
                raise failed[0] from None
            raise
        finally:
            ticker.cancel()
            with contextlib.suppress(BaseException):
                await ticker
        await send({"type": "http.response.body", "body": b"", "more_body": False})


async def answer_later(answer: Awaitable[Any]) -> AsyncIterator[str]:
    """The stream of an answer whose headers go out before it came: a comment at once (it
    waited ``interval_s`` already), then its events, or its error as the last event (then
    ``[DONE]``). Cancels the answer if the client goes."""
    task = asyncio.ensure_future(answer)
    try:
        yield KEEPALIVE
        try:
            stream = await task
        except Exception as exc:
            yield sse(json.dumps(stream_error(exc).body()))
            yield SSE_DONE
            return
        try:
            async for event in stream:
                yield event
        finally:
            await stream.aclose()
    finally:
        if not task.done():
            task.cancel()
            with contextlib.suppress(BaseException):
                await task

"""SSE keep-alive: comments fill silences, events pass unchanged, a late answer's error is the
stream's last event, and a client that goes cancels the work (no Ray)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

from serve_app.errors import APIError
from serve_app.ingress.keepalive import KEEPALIVE, KeepAliveStreamingResponse, answer_later


async def _slow(events: list[tuple[float, str]]) -> AsyncIterator[str]:
    for delay, event in events:
        await asyncio.sleep(delay)
        yield event


def _sent(source: AsyncIterator[str], interval_s: float) -> list[str]:
    """The body chunks the response sends, in order (the last, empty one, included)."""
    messages: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        messages.append(message)

    response = KeepAliveStreamingResponse(source, interval_s, media_type="text/event-stream")
    asyncio.run(asyncio.wait_for(response.stream_response(send), 10))
    assert messages[0]["type"] == "http.response.start"
    assert messages[-1] == {"type": "http.response.body", "body": b"", "more_body": False}
    return [m["body"].decode() for m in messages[1:-1]]


def test_silences_get_comments_and_events_pass_in_order() -> None:
    out = _sent(_slow([(0.0, "a"), (0.35, "b"), (0.0, "c"), (0.02, "d")]), 0.1)
    assert [e for e in out if e != KEEPALIVE] == ["a", "b", "c", "d"]
    assert out[0] == "a" and out[-1] == "d"
    gap = out[out.index("a") + 1 : out.index("b")]
    assert gap and set(gap) == {KEEPALIVE}  # About three comments in 0.35 s.
    assert out[out.index("b") + 1] == "c"  # No silence there, no comment.


def test_a_late_answer_starts_with_a_comment_then_streams_its_events() -> None:
    async def answer() -> AsyncIterator[str]:
        await asyncio.sleep(0.25)
        return _slow([(0.0, "data: 1\n\n"), (0.0, "data: [DONE]\n\n")])

    out = _sent(answer_later(answer()), 0.1)
    assert out[:2] == [KEEPALIVE, KEEPALIVE]  # At once, then after 0.1 s of silence.
    assert [e for e in out if e != KEEPALIVE] == ["data: 1\n\n", "data: [DONE]\n\n"]


def test_a_late_error_is_the_last_event() -> None:
    async def answer() -> AsyncIterator[str]:
        await asyncio.sleep(0.05)
        raise APIError("No replica", status=503, type="server_error", code="backend_unavailable")

    out = _sent(answer_later(answer()), 0.1)
    events = [e for e in out if e != KEEPALIVE]
    assert out[0] == KEEPALIVE
    assert events[-1] == "data: [DONE]\n\n"
    error = json.loads(events[-2].removeprefix("data: "))["error"]
    assert error["code"] == "backend_unavailable"
    assert set(error) == {"message", "type", "param", "code"}


def test_a_client_that_goes_cancels_the_answer() -> None:
    cancelled = asyncio.Event()

    async def answer() -> AsyncIterator[str]:
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            cancelled.set()
            raise
        raise AssertionError("unreachable")

    async def run() -> None:
        sends = 0

        async def send(message: dict[str, Any]) -> None:
            nonlocal sends
            sends += 1
            if sends == 4:  # Headers, the first comment, one more: then the client is gone.
                raise OSError("client disconnected")

        response = KeepAliveStreamingResponse(answer_later(answer()), 0.05)
        try:
            await response.stream_response(send)
        except OSError:
            pass
        else:
            raise AssertionError("the failed send did not end the stream")
        await response.body_iterator.aclose()  # type: ignore[attr-defined]
        assert cancelled.is_set()

    asyncio.run(asyncio.wait_for(run(), 10))

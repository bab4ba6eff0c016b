"""The step channel without Ray: real ZeroMQ sockets on loopback, the engine's outbox feeding
a caller's inbox, and the response that merges it with a (fake) Serve handle call."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

from serve_app.engine.step_outbox import StepOutbox
from serve_app.errors import APIError, ErrorInfo
from serve_app.graph import step_inbox
from serve_app.graph.step_inbox import ChanneledResponse, StepInbox
from serve_app.hops import (
    EngineChunk,
    EngineStep,
    TokenLogprob,
    TopLogprob,
    decode_step,
    encode_step,
)


def step(text: str, finished: bool = False, logprobs: bool = False) -> EngineStep:
    lps = [TokenLogprob(text, -0.5, (TopLogprob(text, -0.5), TopLogprob("x", -2.0)))]
    chunk = EngineChunk(0, text, [7], "stop" if finished else None, None, lps if logprobs else None)
    return EngineStep(
        [chunk],
        prompt_tokens=3,
        cached_tokens=1,
        finished=finished,
        timings=(1.0, 2.0, 3.0, 4.0) if finished else None,
    )


def test_steps_cross_the_wire_as_plain_data_and_come_back_equal() -> None:
    for original in (step("a"), step("b", finished=True, logprobs=True)):
        assert decode_step(encode_step(original)) == original


class FakeHandleCall:
    """A streaming handle call: yields ``items`` after ``delay_s``, then ends or raises."""

    def __init__(self, items: list[Any], raises: BaseException | None = None) -> None:
        self.items, self.raises, self.cancelled = items, raises, False

    def __aiter__(self) -> AsyncIterator[Any]:
        return self._run()

    async def _run(self) -> AsyncIterator[Any]:
        await asyncio.sleep(0.05)
        for item in self.items:
            yield item
        if self.raises is not None:
            raise self.raises

    def cancel(self) -> None:
        self.cancelled = True


async def collect(response: ChanneledResponse) -> list[Any]:
    return [item async for item in response]


async def test_one_frame_per_caller_per_loop_turn_and_strangers_are_dropped() -> None:
    inbox, outbox = StepInbox("127.0.0.1"), StepOutbox()
    try:
        (a, qa), (b, qb) = inbox.register(), inbox.register()
        for i in range(3):  # Three engine steps, each for both streams and a stranger.
            outbox.send(inbox.address, a, step(f"a{i}", finished=i == 2))
            outbox.send(inbox.address, b, step(f"b{i}"))
            outbox.send(inbox.address, "not-a-registered-key", step("x"))
            await asyncio.sleep(0)  # The loop turns: the flush runs.
        got_a = [(await asyncio.wait_for(qa.get(), 10)).chunks[0].text for _ in range(3)]
        got_b = [(await asyncio.wait_for(qb.get(), 10)).chunks[0].text for _ in range(3)]
        assert (got_a, got_b) == (["a0", "a1", "a2"], ["b0", "b1", "b2"])
        assert (outbox.steps, outbox.frames) == (9, 3)
        assert qa.empty() and qb.empty()
    finally:
        outbox.close()
        inbox.close()


async def test_a_channeled_response_ends_on_the_finished_step() -> None:
    inbox, outbox = StepInbox("127.0.0.1"), StepOutbox()
    try:
        key, queue = inbox.register()
        handle = FakeHandleCall([])
        response = ChanneledResponse(handle, inbox, key, queue)
        for text, done in (("Par", False), ("is", True)):
            outbox.send(inbox.address, key, step(text, finished=done))
            await asyncio.sleep(0)
        items = await asyncio.wait_for(collect(response), 10)
        assert [s.chunks[0].text for s in items] == ["Par", "is"] and not handle.cancelled
        outbox.send(inbox.address, key, step("late"))  # Unregistered once finished.
        await asyncio.sleep(0.1)
        assert queue.empty()
    finally:
        outbox.close()
        inbox.close()


async def test_errors_travel_on_the_handle_call() -> None:
    inbox = StepInbox("127.0.0.1")
    try:
        key, queue = inbox.register()
        died = ChanneledResponse(FakeHandleCall([], RuntimeError("actor died")), inbox, key, queue)
        with pytest.raises(RuntimeError, match="actor died"):
            await asyncio.wait_for(collect(died), 10)
        key, queue = inbox.register()
        info = ErrorInfo("engine down", 503, "server_error", code="engine_unavailable")
        failed = ChanneledResponse(FakeHandleCall([info]), inbox, key, queue)
        assert await asyncio.wait_for(collect(failed), 10) == [info]
    finally:
        inbox.close()


async def test_a_handle_call_ending_without_the_last_step_is_an_error_not_a_hang(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(step_inbox, "LAST_STEP_GRACE_S", 0.05)
    inbox = StepInbox("127.0.0.1")
    try:
        key, queue = inbox.register()
        response = ChanneledResponse(FakeHandleCall([]), inbox, key, queue)
        with pytest.raises(APIError, match="never arrived"):
            await asyncio.wait_for(collect(response), 10)
    finally:
        inbox.close()


async def test_cancel_stops_the_call_and_forgets_the_key() -> None:
    inbox, outbox = StepInbox("127.0.0.1"), StepOutbox()
    try:
        key, queue = inbox.register()
        handle = FakeHandleCall([])
        response = ChanneledResponse(handle, inbox, key, queue)
        response.cancel()
        assert handle.cancelled
        outbox.send(inbox.address, key, step("after"))
        await asyncio.sleep(0.1)
        assert queue.empty()
        with pytest.raises(StopAsyncIteration):
            await anext(response)
    finally:
        outbox.close()
        inbox.close()

"""Output channels (one message per engine step for all of a router's streams): the engine's
outboxes and the router's dispatch, with scripted handles (no Ray cluster). The real stack runs
every streamed request of the serve tier through them (engine.output_channels is on)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import pytest

from serve_app.engine.channels import OutputChannels, through_outbox
from serve_app.errors import APIError, ErrorInfo
from serve_app.hops import (
    ChannelOffer,
    ChannelOpen,
    EngineChunk,
    EngineRequest,
    EngineStep,
    OnChannel,
    SamplingSpec,
)
from serve_app.ingress import channels as router_channels
from serve_app.ingress.channels import EngineChannels
from serve_app.ingress.handles import bounded_stream, resubmitted_once


def _step(text: str, finished: bool = False) -> EngineStep:
    return EngineStep([EngineChunk(0, text, [1])], prompt_tokens=3, finished=finished)


def _request(request_id: str = "r") -> EngineRequest:
    return EngineRequest(request_id, [1, 2, 3], SamplingSpec(max_tokens=4))


async def _steps(*texts: str) -> AsyncIterator[EngineStep]:
    for i, text in enumerate(texts):
        await asyncio.sleep(0)
        yield _step(text, finished=i == len(texts) - 1)


def test_one_batch_holds_what_every_stream_put_in_one_step() -> None:
    async def scenario() -> list[list[tuple[str, Any]]]:
        channels = OutputChannels(idle_close_s=0.05)
        batches: list[list[tuple[str, Any]]] = []

        async def read() -> None:
            async for batch in channels.open("router-1"):
                batches.append(batch)

        reader = asyncio.create_task(read())
        await asyncio.sleep(0)
        outbox = channels.outbox("router-1")
        assert outbox is not None and channels.outbox("router-2") is None
        for _ in range(3):
            outbox.begin()
        for request_id in ("a", "b", "c"):  # One engine step wakes three streams at once.
            outbox.put(request_id, _step(request_id))
        await asyncio.sleep(0.01)
        for _ in range(3):
            outbox.end()
        await asyncio.wait_for(reader, 1)  # Idle, nothing in flight: the channel ends.
        assert channels.outbox("router-1") is None and len(channels) == 0
        return batches

    batches = asyncio.run(scenario())
    assert [[request_id for request_id, _ in batch] for batch in batches] == [["a", "b", "c"]]


def test_a_channel_stays_open_while_a_stream_is_in_flight() -> None:
    async def scenario() -> None:
        channels = OutputChannels(idle_close_s=0.02)
        reader = asyncio.create_task(_drain(channels.open("router-1")))
        await asyncio.sleep(0)
        outbox = channels.outbox("router-1")
        assert outbox is not None
        outbox.begin()
        await asyncio.sleep(0.1)
        assert not reader.done() and channels.outbox("router-1") is outbox
        outbox.end()
        await asyncio.wait_for(reader, 1)
        assert outbox.closed

    asyncio.run(scenario())


def test_a_callers_stream_on_its_own_call_keeps_its_channel_open() -> None:
    """The request that offered the channel streams on its own call: until it ends the channel
    waits for the next ones (else sparse traffic would reopen it for every request)."""

    async def scenario() -> None:
        channels = OutputChannels(idle_close_s=0.02)
        with channels.streaming_directly("router-1"):
            reader = asyncio.create_task(_drain(channels.open("router-1")))
            await asyncio.sleep(0.1)
            assert not reader.done() and channels.outbox("router-1") is not None
            with channels.streaming_directly("router-2"):  # Another caller's: not this one's.
                pass
            await asyncio.sleep(0.1)
            assert not reader.done()
        await asyncio.wait_for(reader, 1)
        assert channels.outbox("router-1") is None

    asyncio.run(scenario())


def test_a_stream_stops_when_its_channel_is_gone() -> None:
    """The engine aborts (closes the steps) instead of filling an outbox nobody reads."""

    async def scenario() -> list[str]:
        channels = OutputChannels()
        reader = asyncio.create_task(_drain(channels.open("router-1")))
        await asyncio.sleep(0)
        outbox = channels.outbox("router-1")
        assert outbox is not None
        pulled: list[str] = []

        async def steps() -> AsyncIterator[EngineStep]:
            for text in ("x", "y", "z"):
                pulled.append(text)
                yield _step(text)
                reader.cancel()  # The router's channel call goes away.
                with contextlib.suppress(asyncio.CancelledError):
                    await reader

        await through_outbox(outbox, "a", steps())
        assert outbox.closed
        return pulled

    assert asyncio.run(scenario()) == ["x", "y"]


async def _drain(batches: AsyncIterator[Any]) -> None:
    async for _ in batches:
        pass


class _Response:
    """A scripted DeploymentResponseGenerator."""

    def __init__(self, items: list[Any], error: BaseException | None = None) -> None:
        self.queue: asyncio.Queue[Any] = asyncio.Queue()
        for item in items:
            self.queue.put_nowait(item)
        if error is not None:
            self.queue.put_nowait(error)
        self.cancelled = False

    def end(self, error: BaseException | None = None) -> None:
        self.queue.put_nowait(error or StopAsyncIteration())

    async def _fetch_future_result_async(self) -> None:
        return None

    def __aiter__(self) -> _Response:
        return self

    async def __anext__(self) -> Any:
        item = await self.queue.get()
        if isinstance(item, BaseException):
            raise item
        return item

    def cancel(self) -> None:
        self.cancelled = True


class _Method:
    def __init__(self, respond: Any) -> None:
        self.respond = respond
        self.calls: list[Any] = []

    def remote(self, arg: Any) -> Any:
        self.calls.append(arg)
        return self.respond(arg)


class _Engine:
    """Scripted engine handle: one channel response per replica, per-call responses."""

    def __init__(self, calls: list[_Response]) -> None:
        self.channel = _Response([])
        self._calls = iter(calls)
        self.generate = _Method(lambda request: next(self._calls))
        self.open_channel = _Method(lambda open_: self.channel)


def _call(channels: EngineChannels, request: EngineRequest) -> AsyncIterator[Any]:
    return bounded_stream(lambda: channels.call(request), assign_timeout_s=1, timeout_s=5)


def test_steps_come_on_the_call_until_a_channel_is_open_then_on_the_channel() -> None:
    async def scenario() -> None:
        first = _Response([ChannelOffer("e1"), _step("a"), _step("b", True)])
        first.end()
        second = _Response([OnChannel("e1")])
        engine = _Engine([first, second])
        channels = EngineChannels(engine)
        texts = [s.chunks[0].text async for s in _call(channels, _request("r1"))]
        assert texts == ["a", "b"]
        assert engine.generate.calls[0].channel == channels.caller
        await asyncio.sleep(0)
        assert engine.open_channel.calls == [ChannelOpen(channels.caller, "e1")]

        received: list[str] = []

        async def consume() -> None:
            async for step in _call(channels, _request("r2")):
                received.append(step.chunks[0].text)

        consumer = asyncio.create_task(consume())
        await asyncio.sleep(0.01)
        # One channel message carries r2's step and a stale one of a finished request.
        engine.channel.queue.put_nowait([("r2", _step("c")), ("gone", _step("x"))])
        engine.channel.queue.put_nowait([("r2", _step("d", True))])
        second.end()
        await asyncio.wait_for(consumer, 1)
        assert received == ["c", "d"]
        assert not channels._queues and not channels._via  # Nothing left behind.

    asyncio.run(scenario())


def test_a_lost_channel_fails_its_calls_and_they_are_resubmitted_before_a_token() -> None:
    async def scenario() -> None:
        on_channel = _Response([OnChannel("e1")])
        retry = _Response([_step("again", True)])
        retry.end()
        engine = _Engine([on_channel, retry])
        channels = EngineChannels(engine)
        channels.offer("e1")
        request = _request("r1")

        async def consume() -> list[str]:
            items = resubmitted_once(lambda again: _call(channels, request), backoff_s=0)
            return [step.chunks[0].text async for step in items]

        consumer = asyncio.create_task(consume())
        await asyncio.sleep(0.01)
        assert channels._via == {"r1": "e1"}
        engine.channel.end(RuntimeError("replica died"))  # The channel's stream fails.
        assert await asyncio.wait_for(consumer, 1) == ["again"]
        assert on_channel.cancelled

    asyncio.run(scenario())


def test_a_call_that_ends_without_its_last_step_fails_after_the_grace(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(router_channels, "LAST_STEP_GRACE_S", 0.05)

    async def scenario() -> None:
        call = _Response([OnChannel("e1")])
        engine = _Engine([call])
        channels = EngineChannels(engine)
        channels.offer("e1")
        engine.channel.queue.put_nowait([("r1", _step("a"))])
        got: list[str] = []
        with pytest.raises(APIError) as raised:
            async for step in _call(channels, _request("r1")):
                got.append(step.chunks[0].text)
                call.end()  # Its own stream ends; the last step never comes.
        assert got == ["a"]
        assert raised.value.info.code == "engine_unavailable"

    asyncio.run(scenario())


def test_an_engine_error_on_the_channel_ends_the_call() -> None:
    async def scenario() -> list[Any]:
        call = _Response([OnChannel("e1")])
        engine = _Engine([call])
        channels = EngineChannels(engine)
        channels.offer("e1")
        error = APIError("bad", param="n").info
        engine.channel.queue.put_nowait([("r1", _step("a")), ("r1", error)])
        return [item async for item in _call(channels, _request("r1"))]

    items = asyncio.run(scenario())
    assert isinstance(items[-1], ErrorInfo) and len(items) == 2

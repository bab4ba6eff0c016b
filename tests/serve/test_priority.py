"""Background traffic (priority > 0) cannot take every engine slot from interactive requests.

vLLM's priority scheduler never preempts a running sequence for a slot; the engine replica keeps
``interactive_reserved_seqs`` of ``max_num_seqs`` (8 of 128 here) out of background reach.
"""

from __future__ import annotations

import asyncio
import time

from openai import AsyncOpenAI

from tests.serve.conftest import MODEL

MAX_NUM_SEQS = 128  # serve_config.cpu.yaml


async def _background(client: AsyncOpenAI, i: int, started: list[float], done: list[float]) -> None:
    stream = await client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": f"Tell a long story about lighthouse {i}."}],
        max_tokens=64,
        stream=True,
        extra_body={"priority": 100, "ignore_eos": True},
    )
    first = True
    async for _ in stream:
        if first:
            started.append(time.monotonic())
            first = False
    done.append(time.monotonic())


def test_interactive_request_overtakes_a_background_flood(async_client: AsyncOpenAI) -> None:
    async def scenario() -> None:
        started: list[float] = []
        done: list[float] = []
        flood = [
            asyncio.create_task(_background(async_client, i, started, done))
            for i in range(MAX_NUM_SEQS)
        ]
        deadline = time.monotonic() + 240
        # Every slot background requests may take is taken (the rest wait in the replica).
        while len(started) < MAX_NUM_SEQS - 8 and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        assert len(started) >= MAX_NUM_SEQS - 8
        answer = await async_client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "What is 2 + 2? Answer with a number."}],
            max_tokens=8,
            temperature=0,
        )
        answered = time.monotonic()
        assert "4" in (answer.choices[0].message.content or "")
        # Not stuck behind the flood: answered while no background request had finished yet.
        assert not done or answered < min(done), (len(done), len(started))
        assert len(started) < MAX_NUM_SEQS, "background requests beyond the limit ran at once"
        await asyncio.gather(*flood)
        assert len(done) == MAX_NUM_SEQS  # Held back, not dropped.

    asyncio.run(scenario())

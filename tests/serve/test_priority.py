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
BACKGROUND_TOKENS = 192


async def _background(
    client: AsyncOpenAI, i: int, started: dict[int, float], done: list[float]
) -> None:
    stream = await client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": f"Tell a long story about lighthouse {i}."}],
        # Long enough that the interactive request (prefill + 8 tokens) finishes well before
        # any of them, however slow the steps: the check below must not be a race.
        max_tokens=BACKGROUND_TOKENS,
        stream=True,
        extra_body={"priority": 100, "ignore_eos": True},
    )
    async for _ in stream:
        started.setdefault(i, time.monotonic())
    done.append(time.monotonic())


def test_interactive_request_overtakes_a_background_flood(async_client: AsyncOpenAI) -> None:
    async def scenario() -> None:
        started: dict[int, float] = {}
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
        # Held back, not dropped: hang up on the running ones (the engine aborts them and frees
        # their slots), and every held-back request then runs to its end.
        running = set(started)
        for i in running:
            flood[i].cancel()
        results = await asyncio.gather(*flood, return_exceptions=True)
        held_back = [results[i] for i in range(MAX_NUM_SEQS) if i not in running]
        assert held_back and all(result is None for result in held_back), held_back

    asyncio.run(scenario())

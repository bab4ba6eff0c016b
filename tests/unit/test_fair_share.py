"""Weighted fair admission between tenants: the policy on a simulated engine (a step counter
for a clock, fake requests), and the asyncio gate around it (no Ray, no vLLM)."""

from __future__ import annotations

import asyncio
from collections import Counter, deque
from dataclasses import dataclass

import pytest

from serve_app.engine.fair_share import FairQueue, FairShareGate, Ticket


@dataclass
class Result:
    tokens: Counter[str]  # Output tokens generated per tenant.
    served: Counter[str]  # Prompt and output tokens per tenant: what fair share evens out.
    waits: dict[str, list[int]]  # Steps from arrival to admission, per tenant.
    peak_running: int


def simulate(
    concurrency: dict[str, int],
    *,
    fair: bool,
    slots: int = 16,
    steps: int = 3000,
    output_len: dict[str, int] | None = None,
    weights: dict[str, float] | None = None,
    prompt_tokens: int = 8,
) -> Result:
    """A closed loop per tenant (``concurrency`` requests outstanding at all times) on an
    engine with ``slots`` sequences, one token per running request per step. ``fair=False``:
    first come, first served (what vLLM does)."""
    lengths = output_len or {}
    queue = FairQueue(weights or {})
    fifo: deque[Ticket] = deque()
    outstanding: Counter[str] = Counter()
    arrived: dict[int, int] = {}
    running: list[list[object]] = []  # [ticket, tokens left]
    result = Result(Counter(), Counter(), {t: [] for t in concurrency}, 0)
    for step in range(steps):
        for tenant, count in concurrency.items():
            while outstanding[tenant] < count:
                ticket = Ticket(tenant, prompt_tokens=prompt_tokens)
                queue.push(ticket) if fair else fifo.append(ticket)
                arrived[id(ticket)] = step
                outstanding[tenant] += 1
        while len(running) < slots:
            ticket = queue.peek() if fair else (fifo.popleft() if fifo else None)
            if ticket is None:
                break
            if fair:
                queue.admit(ticket)
            result.waits[ticket.tenant].append(step - arrived.pop(id(ticket)))
            result.served[ticket.tenant] += prompt_tokens
            running.append([ticket, lengths.get(ticket.tenant, 32)])
        result.peak_running = max(result.peak_running, len(running))
        for entry in running:
            ticket = entry[0]
            assert isinstance(ticket, Ticket) and isinstance(entry[1], int)
            queue.charge(ticket.tenant, 1)
            result.tokens[ticket.tenant] += 1
            result.served[ticket.tenant] += 1
            entry[1] -= 1
        for entry in [e for e in running if e[1] == 0]:
            ticket = entry[0]
            assert isinstance(ticket, Ticket)
            running.remove(entry)
            if fair:
                queue.finish(ticket)
            outstanding[ticket.tenant] -= 1
    return result


def mean(values: list[int]) -> float:
    return sum(values) / len(values)


def test_small_tenant_is_not_starved_by_a_flood() -> None:
    """c=64 against c=2 on 16 slots: first come, first served makes the small tenant wait
    behind the flood's queue; fair share admits it at the next free slot."""
    load = {"big": 64, "small": 2}
    fifo = simulate(load, fair=False)
    fair = simulate(load, fair=True)
    assert mean(fifo.waits["small"]) > 50  # ~48 queued ahead x 32 tokens / 16 slots.
    assert mean(fair.waits["small"]) <= 2
    # Every slot stays busy either way: fairness costs no throughput.
    assert sum(fair.tokens.values()) == sum(fifo.tokens.values())
    # Served at its own concurrency, not 2 of 66 slots' worth of the engine's turns.
    assert fair.tokens["small"] > 1.5 * fifo.tokens["small"]


def test_weights_split_tokens_between_saturating_tenants() -> None:
    result = simulate(
        {"interactive": 64, "batch": 64}, fair=True, weights={"interactive": 4, "batch": 1}
    )
    share = result.served["interactive"] / sum(result.served.values())
    assert share == pytest.approx(0.8, abs=0.03)


def test_equal_weights_share_tokens_equally_whatever_the_request_lengths() -> None:
    result = simulate({"long": 64, "short": 64}, fair=True, output_len={"long": 128, "short": 8})
    share = result.served["long"] / sum(result.served.values())
    assert share == pytest.approx(0.5, abs=0.03)


def test_a_tenant_alone_uses_every_slot() -> None:
    result = simulate({"only": 64}, fair=True, slots=16, steps=200)
    assert result.peak_running == 16
    assert result.tokens["only"] == 16 * 200


def test_lower_priority_number_first_then_fewest_tokens_then_arrival() -> None:
    queue = FairQueue({})
    for tenant in ("a", "b"):
        queue.push(ticket := Ticket(tenant))
        queue.admit(ticket)
    queue.charge("a", 100)
    background, a2, b2, b3 = Ticket("b", priority=100), Ticket("a"), Ticket("b"), Ticket("b")
    for ticket in (background, a2, b2, b3):
        queue.push(ticket)
    order = []
    while (ticket := queue.peek()) is not None:
        queue.admit(ticket)
        order.append(ticket)
    # b has used fewer tokens: both its interactive requests first (in arrival order), then
    # a's, and the background request last whatever its tenant's counter.
    assert order == [b2, b3, a2, background]


def test_a_newcomer_level_with_a_hog_goes_before_the_hogs_queue() -> None:
    queue = FairQueue({})
    hogs = [Ticket("hog") for _ in range(4)]
    for ticket in hogs:
        queue.push(ticket)
    queue.admit(hogs[0])
    queue.charge("hog", 500)
    queue.push(newcomer := Ticket("new"))
    assert queue.counters["new"] == queue.counters["hog"]
    assert queue.peek() is newcomer


def test_idle_time_is_not_saved_up_as_credit() -> None:
    queue = FairQueue({})
    busy = Ticket("busy")
    queue.push(busy)
    queue.admit(busy)
    queue.charge("busy", 10_000)
    # A newcomer starts level with the active tenant, not 10,000 tokens ahead of it...
    queue.push(Ticket("newcomer"))
    assert queue.counters["newcomer"] == queue.counters["busy"] == 10_008 - 8
    # ...and a tenant that was served much earlier comes back at the same level.
    queue.counters["old"] = 5.0
    queue.push(Ticket("old"))
    assert queue.counters["old"] == 10_000
    # A tenant in debt keeps it: lifting never lowers a counter.
    queue.counters["debtor"] = 50_000.0
    queue.push(Ticket("debtor"))
    assert queue.counters["debtor"] == 50_000


def test_gate_admits_at_once_while_slots_are_free_and_in_fair_order_after() -> None:
    async def scenario() -> None:
        gate = FairShareGate(2, FairQueue({}))
        order: list[str] = []
        release = asyncio.Event()

        async def request(tenant: str, tokens: int) -> None:
            async with gate.slot(tenant, prompt_tokens=1) as charge:
                order.append(tenant)
                charge(tokens)
                await release.wait()

        hogs = [asyncio.create_task(request("hog", 1000)) for _ in range(4)]
        await asyncio.sleep(0)
        assert order == ["hog", "hog"] and gate.waiting == 2 and gate.running_seqs == 2
        small = asyncio.create_task(request("small", 1))
        await asyncio.sleep(0)
        release.set()
        await asyncio.gather(*hogs, small)
        assert order[2] == "small"  # Ahead of the two hogs that were waiting before it.
        assert gate.running_seqs == 0 and gate.waiting == 0

    asyncio.run(scenario())


def test_gate_counts_sequences_and_runs_an_oversized_request_alone() -> None:
    async def scenario() -> None:
        gate = FairShareGate(4, FairQueue({}))
        peak = 0
        done = asyncio.Event()

        async def request(n: int) -> None:
            nonlocal peak
            async with gate.slot("t", seqs=n):
                peak = max(peak, gate.running_seqs)
                await done.wait()

        first = asyncio.create_task(request(3))
        await asyncio.sleep(0)
        second = asyncio.create_task(request(2))  # 3 + 2 > 4: waits.
        await asyncio.sleep(0)
        assert gate.running_seqs == 3 and gate.waiting == 1
        done.set()
        await asyncio.gather(first, second)
        done.clear()
        big = asyncio.create_task(request(9))  # More than the limit: runs on an empty engine.
        await asyncio.sleep(0)
        assert gate.running_seqs == 9
        done.set()
        await big
        assert peak == 9 and gate.running_seqs == 0

    asyncio.run(scenario())


def test_gate_forgets_a_request_cancelled_while_waiting() -> None:
    async def scenario() -> None:
        gate = FairShareGate(1, FairQueue({}))
        hold = asyncio.Event()

        async def request(tenant: str) -> None:
            async with gate.slot(tenant):
                await hold.wait()

        running = asyncio.create_task(request("a"))
        await asyncio.sleep(0)
        waiting = asyncio.create_task(request("b"))
        await asyncio.sleep(0)
        assert gate.waiting == 1
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        assert gate.waiting == 0
        # Admitted and cancelled in the same turn of the loop: the slot comes back.
        late = asyncio.create_task(request("c"))
        await asyncio.sleep(0)
        hold.set()
        await asyncio.sleep(0)  # "a" finishes and hands its slot to "c"...
        assert gate.running_seqs == 1 and gate.waiting == 0
        late.cancel()  # ...which is cancelled before it could run.
        with pytest.raises(asyncio.CancelledError):
            await late
        await running
        assert gate.running_seqs == 0 and gate.waiting == 0 and not gate.queue.running

    asyncio.run(scenario())


def test_gate_lets_a_few_wait_in_vllms_queue_and_refuses_bad_sizes() -> None:
    async def scenario() -> None:
        gate = FairShareGate(2, FairQueue({}), ahead=1)
        release = asyncio.Event()

        async def request() -> None:
            async with gate.slot("t"):
                await release.wait()

        tasks = [asyncio.create_task(request()) for _ in range(5)]
        await asyncio.sleep(0)
        assert (gate.running_seqs, gate.waiting) == (3, 2)  # 2 slots + 1 on vLLM's deck.
        release.set()
        await asyncio.gather(*tasks)
        assert (gate.running_seqs, gate.waiting) == (0, 0)

    asyncio.run(scenario())
    for limit, ahead in ((0, 1), (2, -1)):
        with pytest.raises(ValueError):
            FairShareGate(limit, FairQueue({}), ahead=ahead)


def test_config_weights_are_key_names_and_positive() -> None:
    from pydantic import ValidationError

    from serve_app.config import AppConfig

    fair = AppConfig.model_validate(
        {"engine": {"fair_share": {"weights": {"interactive": 4, "batch": 1}}}}
    ).engine.fair_share
    assert (fair.weight("interactive"), fair.weight("batch"), fair.weight("other")) == (4, 1, 1)
    for weights in ({"bad name!": 1}, {"ok": 0}, {"ok": -1}, {"ok": 1e7}):
        with pytest.raises(ValidationError):
            AppConfig.model_validate({"engine": {"fair_share": {"weights": weights}}})

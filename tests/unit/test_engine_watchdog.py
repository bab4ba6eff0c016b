"""The watchdog fails waiting requests once an engine-core process is gone (fake engine; the
real one is killed in tests/serve/test_scale_survive.py)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from types import SimpleNamespace
from typing import Any

import psutil

from serve_app.engine import watchdog as engine_watchdog


def test_dead_core_fails_in_flight_requests(monkeypatch: Any) -> None:
    monkeypatch.setattr(engine_watchdog, "POLL_S", 0.05)
    errors: list[Exception] = []
    llm = SimpleNamespace(
        engine_core=SimpleNamespace(resources=SimpleNamespace(engine_dead=False)),
        output_processor=SimpleNamespace(propagate_error=errors.append),
    )
    core = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    watchdog = engine_watchdog.EngineWatchdog(llm)
    watchdog._cores = [psutil.Process(core.pid)]

    async def run() -> None:
        watchdog.ensure_running()
        await asyncio.sleep(0.3)
        assert not errors, "fired while the core was alive"
        core.kill()
        core.wait()
        await asyncio.sleep(0.5)

    asyncio.run(run())
    assert [type(e).__name__ for e in errors] == ["EngineDeadError"]
    assert llm.engine_core.resources.engine_dead


def test_no_core_processes_no_watchdog() -> None:
    watchdog = engine_watchdog.EngineWatchdog(SimpleNamespace())
    assert watchdog._cores == []

    async def run() -> None:
        watchdog.ensure_running()
        assert watchdog._task is None

    asyncio.run(run())


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_stall_needs_unfinished_requests_and_no_step_for_the_timeout() -> None:
    clock = Clock()
    heartbeat = engine_watchdog.StepHeartbeat(clock)
    detector = engine_watchdog.StallDetector(heartbeat, timeout_s=10, clock=clock)

    def poll(after_s: float, unfinished: int) -> float | None:
        clock.now += after_s
        return detector.stalled(unfinished)

    for _ in range(100):  # An idle engine makes no steps: never a stall.
        assert poll(0.5, 0) is None
    for _ in range(19):  # A request arrives at the idle engine: the full timeout from then.
        assert poll(0.5, 1) is None
    assert poll(0.5, 1) is None  # 10.0 s: not past it yet.
    heartbeat.beat()  # A step just in time.
    for _ in range(20):
        assert poll(0.5, 3) is None
    assert poll(0.5, 3) == 10.5  # 10.5 s with requests and no step.


def test_a_blocked_event_loop_is_not_a_stalled_engine() -> None:
    """After our own loop was blocked, the engine's step messages may still be queued: a late
    poll judges nothing and restarts the clock."""
    clock = Clock()
    detector = engine_watchdog.StallDetector(
        engine_watchdog.StepHeartbeat(clock), timeout_s=10, clock=clock
    )
    clock.now += 0.5
    assert detector.stalled(4) is None
    clock.now += 30  # The loop was blocked for 30 s.
    assert detector.stalled(4) is None
    for _ in range(20):
        clock.now += 0.5
        assert detector.stalled(4) is None
    clock.now += 0.5
    assert detector.stalled(4) == 10.5


def test_hung_core_and_its_workers_are_killed_and_requests_fail(monkeypatch: Any) -> None:
    """A stopped (SIGSTOP) core with a worker child, requests unfinished, no steps: both
    processes are killed and the waiting requests get EngineDeadError."""
    import os
    import signal

    monkeypatch.setattr(engine_watchdog, "POLL_S", 0.05)
    errors: list[Exception] = []
    llm = SimpleNamespace(
        engine_core=SimpleNamespace(resources=SimpleNamespace(engine_dead=False)),
        output_processor=SimpleNamespace(
            propagate_error=errors.append, get_num_unfinished_requests=lambda: 2
        ),
    )
    spawn_worker = (
        "import subprocess, sys, time; "
        "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); time.sleep(60)"
    )
    core = subprocess.Popen([sys.executable, "-c", spawn_worker])
    core_proc = psutil.Process(core.pid)
    while not core_proc.children():
        asyncio.run(asyncio.sleep(0.05))
    (worker,) = core_proc.children()
    heartbeat = engine_watchdog.StepHeartbeat()
    stall = engine_watchdog.StallDetector(heartbeat, timeout_s=0.5)
    watchdog = engine_watchdog.EngineWatchdog(llm, stall, cores=[core_proc])

    async def run() -> None:
        watchdog.ensure_running()
        for _ in range(10):  # Stepping: no stall however long it runs.
            heartbeat.beat()
            await asyncio.sleep(0.1)
        assert not errors and core_proc.is_running()
        os.kill(core.pid, signal.SIGSTOP)
        for _ in range(60):
            if errors:
                break
            await asyncio.sleep(0.1)

    asyncio.run(run())
    assert [type(e).__name__ for e in errors] == ["EngineDeadError"]
    assert llm.engine_core.resources.engine_dead
    assert not core_proc.is_running()
    worker.wait(timeout=5)
    assert not worker.is_running()

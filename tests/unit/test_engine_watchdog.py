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

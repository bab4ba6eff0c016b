"""Fail in-flight requests promptly when vLLM's engine-core process dies.

vLLM notices a dead engine core from a monitor thread that closes the asyncio ZMQ sockets the
output loop is awaiting; that wake-up is not reliable (seen: SIGKILLed core, requests hanging
until their 15 s timeout). This watchdog polls the core processes and, once one is gone, marks
the engine dead and hands every waiting request vLLM's own EngineDeadError — the path vLLM
takes itself when its output loop fails.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

import psutil

logger = logging.getLogger("serve_app.engine_watchdog")
POLL_S = 0.5


def engine_core_processes() -> list[psutil.Process]:
    """vLLM's engine-core children of this process (named so by setproctitle)."""
    cores = []
    for child in psutil.Process().children(recursive=False):
        with contextlib.suppress(psutil.Error):
            if "EngineCore" in " ".join([child.name(), *child.cmdline()]):
                cores.append(child)
    return cores


def _alive(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


class EngineWatchdog:
    def __init__(self, llm: Any) -> None:
        self._llm = llm
        self._cores = engine_core_processes()
        self._task: asyncio.Task[None] | None = None

    def ensure_running(self) -> None:
        """Start polling on the caller's event loop (the one generate() runs on)."""
        if self._cores and (self._task is None or self._task.done()):
            self._task = asyncio.get_running_loop().create_task(self._watch())

    async def _watch(self) -> None:
        while all(_alive(p) for p in self._cores):
            await asyncio.sleep(POLL_S)
        self.fail_all()

    def fail_all(self) -> None:
        from vllm.v1.engine.exceptions import EngineDeadError

        logger.error("vLLM engine core exited: failing in-flight requests")
        with contextlib.suppress(AttributeError):
            self._llm.engine_core.resources.engine_dead = True  # New generate() calls refuse.
        self._llm.output_processor.propagate_error(EngineDeadError())

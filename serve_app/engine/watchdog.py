"""Fail in-flight requests promptly when vLLM's engine core dies or hangs.

Dead: vLLM notices a dead engine core from a monitor thread that closes the asyncio ZMQ sockets
the output loop is awaiting; that wake-up is not reliable (seen: SIGKILLed core, requests hanging
until their timeout). Hung: a core that is alive but makes no progress (stopped, deadlocked, a
wedged device) passes every check vLLM and Serve make, and its requests wait forever.

The progress signal is a vLLM stat logger: AsyncLLM calls ``record()`` once per engine step it
hears of (with stats on, every scheduler step, chunked prefill included, sends one). The engine
counts as hung when it holds unfinished requests and no step arrived for ``stall_timeout_s``
(counted from when it became busy, so idle time never counts). Either way the watchdog marks
the engine dead (``check_health`` then fails, Serve replaces the replica), hands every waiting
request vLLM's own EngineDeadError (the path vLLM takes itself when its output loop fails) and
SIGKILLs what is left of the core (a stopped process ignores SIGTERM).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any

import psutil

logger = logging.getLogger(__name__)
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
    def __init__(
        self,
        llm: Any = None,
        stall_timeout_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
        on_fail: Callable[[str], Any] | None = None,
    ) -> None:
        """``llm``: the AsyncLLM, or None to ``attach`` it later (the stat logger must be
        handed to AsyncLLM before it exists). ``on_fail(why)`` runs once the engine failed."""
        self._on_fail = on_fail
        self._llm: Any = None
        self._cores: list[psutil.Process] = []
        self._task: asyncio.Task[None] | None = None
        self.stall_timeout_s = stall_timeout_s
        self._clock = clock
        self.last_step = clock()
        self.busy_since: float | None = None
        self.verdict = ""  # Why the engine was failed; empty while it is healthy.
        if llm is not None:
            self.attach(llm)

    def attach(self, llm: Any) -> None:
        self._llm = llm
        self._cores = engine_core_processes()

    def heartbeat(self) -> None:
        """One engine step happened (called by the stat logger)."""
        self.last_step = self._clock()

    def stat_logger(self, vllm_config: Any, engine_index: int = 0) -> Any:
        """A per-engine vLLM stat logger factory (``stat_loggers=[watchdog.stat_logger]``)."""
        from vllm.v1.metrics.loggers import StatLoggerBase

        watchdog = self

        class StepHeartbeat(StatLoggerBase):
            def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
                pass

            def record(self, *args: Any, **kwargs: Any) -> None:
                watchdog.heartbeat()

            def log_engine_initialized(self) -> None:
                pass

        return StepHeartbeat(vllm_config, engine_index)

    def ensure_running(self) -> None:
        """Start polling on the caller's event loop (the one generate() runs on)."""
        if self._cores and not self.verdict and (self._task is None or self._task.done()):
            self._task = asyncio.get_running_loop().create_task(self._watch())

    def check(self) -> str:
        """One poll: why the engine must be failed now, or "" while it is healthy."""
        if not all(_alive(p) for p in self._cores):
            return "the vLLM engine core exited"
        if self.stall_timeout_s is None:
            return ""
        unfinished = int(self._llm.output_processor.get_num_unfinished_requests())
        now = self._clock()
        if unfinished == 0:
            self.busy_since = None
            return ""
        if self.busy_since is None:
            self.busy_since = now  # Idle -> busy: the clock starts now.
        quiet = now - max(self.last_step, self.busy_since)
        if quiet > self.stall_timeout_s:
            return (
                f"the vLLM engine made no progress for {quiet:.0f} s with {unfinished} "
                f"requests unfinished (engine.stall_timeout_s {self.stall_timeout_s:g})"
            )
        return ""

    async def _watch(self) -> None:
        while not (why := self.check()):
            await asyncio.sleep(POLL_S)
        self.fail(why)

    def fail(self, why: str = "the vLLM engine core exited") -> None:
        from vllm.v1.engine.exceptions import EngineDeadError

        self.verdict = why
        logger.error("%s: failing in-flight requests", why)
        with contextlib.suppress(AttributeError):
            self._llm.engine_core.resources.engine_dead = True  # New generate() calls refuse.
        self._llm.output_processor.propagate_error(EngineDeadError())
        for core in self._cores:  # A hung core (and its workers) would outlive the replica.
            with contextlib.suppress(psutil.Error):
                for child in core.children(recursive=True):
                    child.kill()
                core.kill()
        if self._on_fail is not None:
            self._on_fail(why)

"""Fail in-flight requests promptly when vLLM's engine core dies or hangs.

vLLM notices a dead engine core from a monitor thread that closes the asyncio ZMQ sockets the
output loop is awaiting; that wake-up is not reliable (seen: SIGKILLed core, requests hanging
until their 15 s timeout). A core that is alive but stuck (a hung kernel, a stopped process)
is noticed by nothing at all: every health check passes while requests wait forever.

This watchdog polls the core processes. Once one is gone, it marks the engine dead and hands
every waiting request vLLM's own EngineDeadError — the path vLLM takes itself when its output
loop fails — after which ``check_health`` fails and Serve replaces the replica. A core that
holds unfinished requests and has made no step for ``stall_timeout_s`` is killed (with its
workers: a stopped process would otherwise keep its memory), which takes the same path.

Steps are seen through vLLM's stat-logger interface: with stats on (vLLM's default for a
server) the engine core sends every step's scheduler stats, even for a step with no output.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any

import psutil

logger = logging.getLogger("serve_app.engine_watchdog")
POLL_S = 0.5
LATE_POLL_S = 2.0  # A poll this late means our own event loop was blocked: judge nothing.


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


class StepHeartbeat:
    """When this process last heard of an engine step."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self.last_step = clock()

    def beat(self) -> None:
        self.last_step = self._clock()

    def stat_logger_factory(self) -> Callable[[Any, int], Any]:
        """A vLLM per-engine stat logger factory whose ``record`` (once per step) beats."""
        from vllm.v1.metrics.loggers import StatLoggerBase

        heartbeat = self

        class StepLogger(StatLoggerBase):
            def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
                pass

            def record(self, *args: Any, **kwargs: Any) -> None:
                heartbeat.beat()

            def log_engine_initialized(self) -> None:
                pass

        return StepLogger


class StallDetector:
    """Judges, poll by poll, whether an engine with unfinished requests stopped stepping.

    The stall clock starts at the later of the last step and the last poll that found the
    engine idle, so a request arriving at an idle engine gets the full ``timeout_s``.
    """

    def __init__(
        self,
        heartbeat: StepHeartbeat,
        timeout_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._heartbeat = heartbeat
        self.timeout_s = timeout_s
        self._clock = clock
        self._idle_at = clock()
        self._polled_at = clock()

    def stalled(self, unfinished: int) -> float | None:
        """Seconds without a step when that is past ``timeout_s``; None otherwise."""
        now = self._clock()
        late = now - self._polled_at > LATE_POLL_S
        self._polled_at = now
        if unfinished == 0 or late:  # Late: the step messages may be queued behind us.
            self._idle_at = now
            return None
        quiet = now - max(self._heartbeat.last_step, self._idle_at)
        return quiet if quiet > self.timeout_s else None


class EngineWatchdog:
    def __init__(
        self,
        llm: Any,
        stall: StallDetector | None = None,
        cores: list[psutil.Process] | None = None,
    ) -> None:
        self._llm = llm
        self._stall = stall
        self._cores = engine_core_processes() if cores is None else cores
        self._task: asyncio.Task[None] | None = None

    @classmethod
    def for_engine(
        cls, llm: Any, heartbeat: StepHeartbeat, stall_timeout_s: float | None
    ) -> EngineWatchdog:
        """Steps are seen only through stats: without them there is no stall to judge."""
        if stall_timeout_s is None or not getattr(llm, "log_stats", False):
            return cls(llm)
        return cls(llm, StallDetector(heartbeat, stall_timeout_s))

    def ensure_running(self) -> None:
        """Start polling on the caller's event loop (the one generate() runs on)."""
        if self._cores and (self._task is None or self._task.done()):
            self._task = asyncio.get_running_loop().create_task(self._watch())

    async def _watch(self) -> None:
        while all(_alive(p) for p in self._cores):
            if self._stall is not None:
                unfinished = int(self._llm.output_processor.get_num_unfinished_requests())
                quiet = self._stall.stalled(unfinished)
                if quiet is not None:
                    logger.error(
                        "vLLM engine core hung: no step for %.0f s with %d requests unfinished "
                        "(stall_timeout_s %g); killing it",
                        quiet,
                        unfinished,
                        self._stall.timeout_s,
                    )
                    self.kill_cores()
            await asyncio.sleep(POLL_S)
        self.fail_all()

    def kill_cores(self) -> None:
        """SIGKILL the engine cores and their workers (a stopped process still dies so)."""
        for core in self._cores:
            with contextlib.suppress(psutil.Error):
                for proc in [*core.children(recursive=True), core]:
                    with contextlib.suppress(psutil.Error):
                        proc.kill()
        for core in self._cores:
            with contextlib.suppress(psutil.Error):
                core.wait(timeout=5)  # Reap it: a zombie would still count as running.

    def fail_all(self) -> None:
        from vllm.v1.engine.exceptions import EngineDeadError

        logger.error("vLLM engine core exited: failing in-flight requests")
        with contextlib.suppress(AttributeError):
            self._llm.engine_core.resources.engine_dead = True  # New generate() calls refuse.
        self._llm.output_processor.propagate_error(EngineDeadError())

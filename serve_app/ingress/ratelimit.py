"""Per-key rate limits shared by every router replica: exact sliding 60 s windows.

The counters live in one named Ray actor per application (``serve_app_rate_limiter.<app>`` in
namespace ``serve_app``), created by whichever router replica comes first (``get_if_exists``).
It is not detached: it is owned by that replica and goes away with the application. Should its
owner replica die, the others re-create it on their next call (the counters start over: a brief
allowance, never a lock-out).
"""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict, deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from serve_app.config.security import KeyRateLimit

WINDOW_S = 60.0
NAMESPACE = "serve_app"
Reason = Literal["", "requests", "tokens", "too_large"]


@dataclass(frozen=True)
class Decision:
    allowed: bool
    retry_after_s: float = 0.0
    reason: Reason = ""


class SlidingWindowLimiter:
    """Admitted (time, tokens) per key over the last window; a denied request charges nothing.

    A log rather than a token bucket so "6 per minute" means exactly 6 in any 60 s; its size is
    bounded by the limits themselves.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic, window_s: float = WINDOW_S):
        self._clock = clock
        self._window = window_s
        self._events: defaultdict[str, deque[tuple[float, int]]] = defaultdict(deque)
        self._tokens: defaultdict[str, int] = defaultdict(int)

    def acquire(self, key: str, tokens: int, rpm: int | None, tpm: int | None) -> Decision:
        if rpm is None and tpm is None:
            return Decision(True)
        now = self._clock()
        events = self._events[key]
        while events and events[0][0] <= now - self._window:
            self._tokens[key] -= events.popleft()[1]
        if rpm is not None and len(events) >= rpm:
            # Enough capacity returns when the (len - rpm + 1)-th oldest admission expires.
            return Decision(False, events[len(events) - rpm][0] + self._window - now, "requests")
        if tpm is not None:
            if tokens > tpm:
                return Decision(False, 0.0, "too_large")
            used = self._tokens[key]
            if used + tokens > tpm:
                for at, spent in events:
                    used -= spent
                    if used + tokens <= tpm:
                        return Decision(False, at + self._window - now, "tokens")
        events.append((now, tokens))
        self._tokens[key] += tokens
        return Decision(True)


class TokenBucket:
    """A local per-second budget with one second of burst: for paths that must not depend on
    the shared limiter (a readiness probe that failed closed would take a pod out of service)."""

    def __init__(self, per_second: float, clock: Callable[[], float] = time.monotonic) -> None:
        self._rate = per_second
        self._capacity = max(1.0, per_second)
        self._tokens = self._capacity
        self._clock = clock
        self._at = clock()

    def take(self) -> float:
        """0 when admitted, else the seconds until a request would be."""
        now = self._clock()
        self._tokens = min(self._capacity, self._tokens + (now - self._at) * self._rate)
        self._at = now
        if self._tokens >= 1:
            self._tokens -= 1
            return 0.0
        return (1 - self._tokens) / self._rate


class RateLimitBackend(Protocol):
    async def acquire(self, key: str, tokens: int, limit: KeyRateLimit) -> Decision: ...


class LimiterUnavailable(RuntimeError):
    """The shared limiter could not be reached; callers fail closed (503)."""


class LocalRateLimiter:
    """In-process backend (one replica, unit tests)."""

    def __init__(self, limiter: SlidingWindowLimiter | None = None) -> None:
        self.limiter = limiter or SlidingWindowLimiter()

    async def acquire(self, key: str, tokens: int, limit: KeyRateLimit) -> Decision:
        return self.limiter.acquire(key, tokens, limit.requests_per_minute, limit.tokens_per_minute)


class _LimiterActor:
    """The Ray actor body: a sync actor, so calls run one at a time (no locking needed)."""

    def __init__(self) -> None:
        self._limiter = SlidingWindowLimiter()

    def acquire(
        self, key: str, tokens: int, rpm: int | None, tpm: int | None
    ) -> tuple[bool, float, str]:
        decision = self._limiter.acquire(key, tokens, rpm, tpm)
        return decision.allowed, decision.retry_after_s, decision.reason


class RayRateLimiter:
    """Backend over the shared named actor; re-creates it if its owner replica died."""

    def __init__(self, name: str, attempts: int = 3, timeout_s: float = 5.0) -> None:
        self.name = name
        self._attempts = attempts
        self._timeout_s = timeout_s  # A hung actor must not hold every request (fail closed).
        self._actor: Any = None

    def _handle(self) -> Any:
        if self._actor is None:
            import ray

            self._actor = (
                ray.remote(_LimiterActor)
                .options(
                    name=self.name,
                    namespace=NAMESPACE,  # Explicit: else it lands in the deploying job's.
                    get_if_exists=True,
                    num_cpus=0,
                    max_concurrency=1,
                )
                .remote()
            )
        return self._actor

    async def acquire(self, key: str, tokens: int, limit: KeyRateLimit) -> Decision:
        from ray.exceptions import RayActorError

        for attempt in range(self._attempts):
            try:
                ref = self._handle().acquire.remote(
                    key, tokens, limit.requests_per_minute, limit.tokens_per_minute
                )
                allowed, retry_after_s, reason = await asyncio.wait_for(ref, self._timeout_s)
                return Decision(allowed, retry_after_s, reason)
            except TimeoutError:
                raise LimiterUnavailable(
                    f"rate limiter actor {self.name} did not answer within {self._timeout_s:g} s"
                ) from None
            except RayActorError:
                self._actor = None  # Its owner went away; get-or-create a fresh one.
                await asyncio.sleep(0.1 * (attempt + 1))
        raise LimiterUnavailable(f"rate limiter actor {self.name} is unavailable")

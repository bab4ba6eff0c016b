"""The `batch_api` block: the OpenAI Batch API's coordinator, storage, quotas and pacing."""

from __future__ import annotations

import re
from typing import Any

from pydantic import Field, field_validator, model_validator

from serve_app.config.base import StrictModel
from serve_app.config.replicas import ReplicaConfig
from serve_app.config.security import NAME_RE

# Ray gives the head node this resource (Ray 2.x): a tiny share of it pins an actor there.
HEAD_NODE_RESOURCE = "node:__internal_head__"
WINDOW_RE = re.compile(r"^([1-9][0-9]{0,5})(s|m|h)$")
MAX_WINDOW_S = 24 * 3600


def window_seconds(window: str) -> int:
    """Seconds of a completion_window such as ``24h``, ``1h``, ``30m`` or ``30s`` (≤ 24 h);
    raises ValueError with the accepted forms."""
    match = WINDOW_RE.match(window)
    seconds = 0
    if match is not None:
        seconds = int(match.group(1)) * {"s": 1, "m": 60, "h": 3600}[match.group(2)]
    if not 0 < seconds <= MAX_WINDOW_S:
        raise ValueError(
            f"completion_window {window!r}: give a duration up to 24h such as 24h, 1h, 30m or 30s"
        )
    return seconds


class CoordinatorConfig(ReplicaConfig):
    """The BatchCoordinator deployment. One replica on the head node by default, next to its
    SQLite store; a second one alive at once (upgrade, restart) is safe: batches are leased."""

    num_cpus: float = Field(
        0, ge=0, description="CPUs reserved; 0 so it fits on a head node started with num-cpus 0."
    )
    resources: dict[str, float] = Field(
        default_factory=lambda: {HEAD_NODE_RESOURCE: 0.001},
        description="Ray resources that pin the coordinator to the node holding batch_api.root "
        "(default: the head node). Set {} on a single machine with no head resource.",
    )
    max_ongoing_requests: int = Field(
        1000, ge=1, description="Concurrent Batch API calls (polls, upload chunks) it takes."
    )

    @model_validator(mode="after")
    def _fixed_count(self) -> CoordinatorConfig:
        if self.num_replicas == "auto":
            raise ValueError(
                "batch_api.coordinator.num_replicas must be a number (1 is enough: it only "
                "schedules; the engines do the work)"
            )
        return self


class BatchApiConfig(StrictModel):
    """The OpenAI Batch API (/v1/files, /v1/batches), run by the BatchCoordinator deployment."""

    enabled: bool = Field(True, description="Serve /v1/files and /v1/batches.")
    root: str | None = Field(
        None,
        description="Directory of the SQLite store and the files, on the coordinator's node "
        "(a local disk or a volume mounted there, never a network filesystem shared by two "
        "nodes). Default: a folder per application under $SERVE_APP_BATCH_DIR, else under "
        "$SERVE_APP_CACHE/batches.",
    )
    max_file_bytes: int = Field(
        200 * 1024**2,
        ge=1024,
        le=100 * 1024**3,
        description="Largest upload to /v1/files (streamed to disk; security.max_body_bytes "
        "does not apply to uploads). Default 200 MB, as OpenAI's.",
    )
    max_lines: int = Field(50_000, ge=1, le=10_000_000, description="Most requests per batch.")
    enqueued_tokens_per_key: int | None = Field(
        None,
        ge=1,
        description="Tokens one API key may have in unfinished batches (prompt estimate + n × "
        "max_tokens per prompt + tools); a create beyond it is a 429 with the numbers. "
        "Unset: unlimited.",
    )
    key_enqueued_tokens: dict[str, int] = Field(
        default_factory=dict, description="Per-key-name enqueued-token limits (override)."
    )
    max_lines_in_flight: int | None = Field(
        None,
        ge=1,
        description="Background requests in flight over all batches (a line with n choices or "
        "several prompts counts n × prompts). Default and upper bound: what the engines admit "
        "for background work, max_num_seqs - interactive_reserved_seqs per engine replica.",
    )
    max_running_batches: int = Field(
        4, ge=1, le=1000, description="Batches one coordinator runs at once; the rest wait."
    )
    priority: int = Field(
        100, ge=1, description="vLLM priority of batch lines (interactive requests have 0)."
    )
    lease_s: float = Field(
        30,
        ge=1,
        le=3600,
        description="A batch whose owner stops renewing its lease for this long is taken over "
        "by another coordinator and resumed from its recorded results.",
    )
    poll_s: float = Field(
        0.5,
        gt=0,
        le=10,
        description="How often a coordinator renews its leases, claims waiting batches and sees "
        "cancellations.",
    )
    record_interval_s: float = Field(
        1.0,
        gt=0,
        le=60,
        description="Finished lines are recorded (and request_counts updated) this often.",
    )
    call_timeout_s: float = Field(
        60, gt=0, description="A router's call to the coordinator slower than this gets 503."
    )
    coordinator: CoordinatorConfig = Field(default_factory=CoordinatorConfig)

    @field_validator("key_enqueued_tokens")
    @classmethod
    def _names(cls, value: dict[str, int]) -> dict[str, int]:
        for name, tokens in value.items():
            if not NAME_RE.fullmatch(name):
                raise ValueError(f"{name!r} is not a key name ([A-Za-z0-9_.-], 1-64 chars)")
            if tokens < 1:
                raise ValueError(f"key_enqueued_tokens.{name} must be at least 1")
        return value

    @model_validator(mode="after")
    def _lease_above_poll(self) -> BatchApiConfig:
        if self.lease_s < 3 * self.poll_s:
            raise ValueError(
                f"batch_api.lease_s {self.lease_s:g} must be at least 3 × poll_s "
                f"({self.poll_s:g}): a lease must survive a late renewal"
            )
        return self

    def enqueued_limit(self, key_name: str) -> int | None:
        return self.key_enqueued_tokens.get(key_name, self.enqueued_tokens_per_key)

    def lines_in_flight(self, background_slots: int) -> int:
        """The cap on background lines; ``background_slots``: what the engines admit."""
        return self.max_lines_in_flight or background_slots

    def replay_window_s(self) -> float:
        """How long an engine keeps a finished batch line's result for a re-submission: a
        takeover happens within lease_s, and the new owner starts with those lines."""
        return 2 * self.lease_s + 60

    def deployment_options(self) -> dict[str, Any]:
        return self.coordinator.deployment_options()

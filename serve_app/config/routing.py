"""engine.routing: how each caller picks the engine replica for a request.

``prefix_aware`` sends a request to the replica most likely to hold the longest prefix of its
token ids in vLLM's prefix cache, and spills to a less loaded one past a margin; a session key
keeps a conversation on one replica. With one engine replica every policy picks that replica.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from serve_app.config.base import StrictModel

RoutingPolicyName = Literal["prefix_aware", "session", "default", "ray_prefix_cache"]


class RoutingConfig(StrictModel):
    policy: RoutingPolicyName = Field(
        "prefix_aware",
        description="prefix_aware: longest cached prefix first, spill past the margin, sessions "
        "sticky. session: sessions sticky, the rest to the least loaded. default: Serve's power "
        "of two choices. ray_prefix_cache: Ray Serve LLM's PrefixCacheAffinityRouter over the "
        "token ids (one character per token), for comparison.",
    )
    block_size: int = Field(
        64,
        ge=16,
        le=4096,
        description="Tokens per hashed routing block; a multiple of the engine's KV block size "
        "(16 on GPU, 32 on CPU). Smaller blocks match finer prefixes at more hashes per request.",
    )
    max_hashed_blocks: int = Field(
        512,
        ge=1,
        le=16384,
        description="Most blocks hashed per prompt (bounds preprocessing work and the message "
        "size; prompts longer than this many blocks match on their first blocks only).",
    )
    spill_margin: int = Field(
        8,
        ge=0,
        le=100_000,
        description="Requests the preferred replica may have in flight beyond the least loaded "
        "one before the request spills to a less loaded replica.",
    )
    spill_ratio: float = Field(
        0.5,
        ge=0,
        le=100,
        description="Also tolerate this fraction of the least loaded replica's queue (the larger "
        "of spill_margin and spill_ratio x min queue counts): margins grow with load.",
    )
    index_blocks_per_replica: int | None = Field(
        None,
        ge=1,
        le=10_000_000,
        description="Blocks each caller remembers per replica (an LRU, ~250 bytes a block). "
        "Unset: the replica's KV cache as it reports it, in routing blocks (4096 until the "
        "first report).",
    )
    cold_placement: Literal["auto", "least_loaded", "hrw"] = Field(
        "auto",
        description="Where a prefix nobody holds goes. least_loaded: the least loaded replica "
        "with the emptiest cache (ties by rendezvous hash); hrw: the rendezvous-hash winner "
        "among replicas within the spill margin, so several router replicas, each with its own "
        "index, put a new prefix on the same engine replica. auto: least_loaded with one "
        "router replica, hrw with several.",
    )
    session_header: str | None = Field(
        "x-session-id",
        min_length=1,
        max_length=64,
        description="HTTP header whose value keeps a conversation on one replica while it is "
        "healthy and within the spill margin (null: no header).",
    )
    session_from_user: bool = Field(
        False,
        description="Use the OpenAI `user` field as the session key when the header is absent.",
    )

    @field_validator("block_size")
    @classmethod
    def _multiple_of_16(cls, value: int) -> int:
        if value % 16:
            raise ValueError(
                f"block_size {value} must be a multiple of 16 (the engine caches whole KV "
                "blocks of 16 or 32 tokens); use 64"
            )
        return value

    @field_validator("session_header")
    @classmethod
    def _lower_header(cls, value: str | None) -> str | None:
        return value.lower() if value else value

    def ours(self) -> bool:
        """Whether callers route with our request router (it can send a call to one replica)."""
        return self.policy in ("prefix_aware", "session")

    def hashes_needed(self) -> bool:
        """Whether the preprocessor computes block hashes (only prefix_aware reads them)."""
        return self.policy == "prefix_aware"

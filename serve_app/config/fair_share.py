"""Fair share of an engine replica between API keys (tenants) when they compete for its slots."""

from __future__ import annotations

from pydantic import Field, field_validator

from serve_app.config.base import StrictModel
from serve_app.config.security import NAME_RE


class FairShareConfig(StrictModel):
    """Admission to vLLM is weighted fair by tokens between keys (each replica on its own).

    While slots are free every request starts at once, so one key alone may use the whole
    engine; when they run out, the next slot goes to the waiting key that has been served the
    fewest tokens per unit of weight (prompt tokens at admission, output tokens as generated).
    Priorities come first: a lower priority waiting anywhere is admitted before a higher one.
    """

    enabled: bool = Field(
        True, description="Share slots fairly between keys; false: vLLM's own first-come order."
    )
    weights: dict[str, float] = Field(
        default_factory=dict,
        description="Relative share per key name, e.g. {interactive: 4, batch: 1}: under "
        "contention `interactive` gets four times the tokens of `batch`.",
    )
    default_weight: float = Field(
        1.0, gt=0, le=1e6, description="Weight of keys not in weights (and of keyless traffic)."
    )

    @field_validator("weights")
    @classmethod
    def _check_weights(cls, value: dict[str, float]) -> dict[str, float]:
        for name, weight in value.items():
            if not NAME_RE.fullmatch(name):
                raise ValueError(f"{name!r} is not a key name ([A-Za-z0-9_.-], 1-64 chars)")
            if not 0 < weight <= 1e6:
                raise ValueError(f"{name}: weight {weight} must be > 0 and <= 1e6")
        return value

    def weight(self, tenant: str) -> float:
        return self.weights.get(tenant, self.default_weight)

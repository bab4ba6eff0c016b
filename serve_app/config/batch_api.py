"""batch_api: the OpenAI Batch API's files (POST /v1/files), their limits, and the batch
coordinator that stores them and runs batches."""

from __future__ import annotations

from typing import Any

from pydantic import Field

from serve_app.config.base import StrictModel


class BatchApiConfig(StrictModel):
    enabled: bool = Field(
        True,
        description="Serve /v1/files and /v1/batches through the batch coordinator deployment. "
        "false: no coordinator process, and those routes answer 404 saying so.",
    )
    max_file_bytes: int = Field(
        200 * 1024 * 1024,
        ge=1024,
        le=64 * 1024**3,
        description="Largest upload to POST /v1/files (OpenAI's limit: 200 MB). Uploads stream "
        "to disk in chunks, so this bounds disk, not memory; every other route keeps "
        "security.max_body_bytes. Larger gets 413.",
    )
    dir: str = Field(
        "",
        max_length=4096,
        description="Where the batch coordinator keeps its store (SQLite plus the files' "
        "bytes); empty: $SERVE_APP_BATCH_DIR, else $SERVE_APP_CACHE/batches. A local disk of "
        "the node the coordinator is pinned to (coordinator_resources), never a network "
        "filesystem; on Kubernetes, a PersistentVolumeClaim mounted on that node. Two apps "
        "on one cluster need two directories.",
    )
    lease_s: float = Field(
        30.0,
        ge=3.0,
        le=3600.0,
        description="A batch runs in one coordinator process at a time: the holder of its "
        "lease, renewed every second (or lease_s / 6 if shorter). When the coordinator dies or "
        "hangs, its replacement takes its batches over this long after the last renewal and "
        "resumes them from the lines already done; an old and a new coordinator alive at once "
        "(an upgrade) never run one batch both.",
    )
    coordinator_num_cpus: float = Field(
        0.1,
        ge=0,
        le=64,
        description="CPUs reserved for the batch coordinator replica (it only forwards lines "
        "to the engines and writes their results).",
    )
    coordinator_resources: dict[str, float] = Field(
        default_factory=dict,
        description="Ray resources the coordinator replica needs, to pin it to the node whose "
        'disk holds batch_api.dir: {"node:__internal_head__": 0.001} for the head node.',
    )

    def coordinator_options(self) -> dict[str, Any]:
        actor: dict[str, Any] = {"num_cpus": self.coordinator_num_cpus}
        if self.coordinator_resources:
            actor["resources"] = dict(self.coordinator_resources)
        # A replica being replaced finishes its record writes; batches move by lease anyway.
        return {"num_replicas": 1, "ray_actor_options": actor, "max_ongoing_requests": 1000}

"""batch_api: the OpenAI Batch API's files (POST /v1/files), their limits, and who runs a batch."""

from __future__ import annotations

from pydantic import Field

from serve_app.config.base import StrictModel


class BatchApiConfig(StrictModel):
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
        description="Where the store lives (SQLite plus the files' bytes); empty: "
        "$SERVE_APP_BATCH_DIR, else $SERVE_APP_CACHE/batches. Every router replica of the app "
        "must see the same directory (on several nodes: a ReadWriteMany volume with working "
        "POSIX locks, not NFSv3); two apps on one cluster need two directories.",
    )
    lease_s: float = Field(
        30.0,
        ge=3.0,
        le=3600.0,
        description="A batch runs in one router replica at a time: the holder of its lease, "
        "renewed every second (or lease_s / 6 if shorter). A replica that dies or hangs loses "
        "its batches to another replica this long after its last renewal; the new one resumes "
        "from the lines already done. Every router replica must share the store (batch_api.dir "
        "on a volume all of them mount) for this to hold across nodes.",
    )

"""batch_api: the OpenAI Batch API's files (POST /v1/files) and their limits."""

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

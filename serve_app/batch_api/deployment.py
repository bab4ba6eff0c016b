"""The batch coordinator: the one process that owns the Batch API's store and runs batches.

Routers forward ``/v1/files`` and ``/v1/batches`` here. It calls the models' preprocessor and
engine deployments through the same serving code as the router, at a background priority. One
replica; pin it with ``batch_api.coordinator_resources`` to the node whose disk holds
``batch_api.dir`` (the head node's PersistentVolumeClaim in ``cluster/rayservice.yaml``): Serve
restarts it there after a crash, and the new process resumes every batch from its recorded
lines. Leases still fence batches, so an old and a new coordinator alive at once during an
upgrade never run the same batch.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from ray import serve
from ray.serve.handle import DeploymentHandle

from serve_app.batch_api.api import BatchApi
from serve_app.batch_api.service import BatchService
from serve_app.batch_api.store import BatchStore
from serve_app.config import AppConfig
from serve_app.ingress.backends import ModelBackends
from serve_app.observability import tracing


@serve.deployment(name="BatchCoordinator", num_replicas=1)
class BatchCoordinator:
    def __init__(
        self, backends: dict[str, dict[str, DeploymentHandle]], config: dict[str, Any]
    ) -> None:
        """``backends``: per served model name, its ``preprocessor`` and ``engine`` handles."""
        self.config = AppConfig.model_validate(config)
        tracing.configure(self.config.tracing.exporter)
        self.backends = ModelBackends.build(
            self.config, backends, serve.get_replica_context().app_name
        )
        root = self.config.batch_api.dir
        store = BatchStore(Path(root).expanduser().absolute() if root else None)
        service = BatchService(
            self.backends.serving, self.config, store, refresh=self.backends.fresh
        )
        self.api = BatchApi(service)
        try:  # Serve builds replicas on their loop: batches resume now, not on a first call.
            asyncio.get_running_loop()
            self.api.start()
        except RuntimeError:
            pass

    def finished_spans(self) -> list[dict[str, Any]]:
        """Spans kept by the in-memory exporter (tests)."""
        return tracing.finished_spans()

    async def check_health(self) -> None:
        self.api.start()  # Where the constructor had no loop.

    async def upload_part(self, upload_id: str, offset: int, data: bytes) -> int:
        return await self.api.upload_part(upload_id, offset, data)

    async def finish_upload(
        self, upload_id: str, size: int, filename: str, purpose: str, owner: str
    ) -> dict[str, Any]:
        return await self.api.finish_upload(upload_id, size, filename, purpose, owner)

    async def get_file(self, file_id: str, owner: str) -> dict[str, Any]:
        return await self.api.get_file(file_id, owner)

    async def delete_file(self, file_id: str, owner: str) -> dict[str, Any]:
        return await self.api.delete_file(file_id, owner)

    async def file_content(self, file_id: str, owner: str) -> AsyncIterator[int | bytes]:
        async for item in self.api.file_content(file_id, owner):
            yield item

    async def create_batch(self, body: dict[str, Any], owner: str) -> dict[str, Any]:
        return await self.api.create_batch(body, owner)

    async def get_batch(self, batch_id: str, owner: str) -> dict[str, Any]:
        return await self.api.get_batch(batch_id, owner)

    async def list_batches(self, after: str | None, limit: int, owner: str) -> dict[str, Any]:
        return await self.api.list_batches(after, limit, owner)

    async def cancel_batch(self, batch_id: str, owner: str) -> dict[str, Any]:
        return await self.api.cancel_batch(batch_id, owner)

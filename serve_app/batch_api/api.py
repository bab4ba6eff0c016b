"""The Batch API's operations, one tenant per call: what the batch coordinator serves.

Routers only forward ``/v1/files`` and ``/v1/batches`` here (``routes``); one process, the
coordinator (``deployment``), owns the store and runs the batches. Every store call runs in a
thread, so file and SQLite work never holds up the loop. ``owner`` is the API key's name ("" without
keys): another owner's files and batches are 404, as ids that do not exist.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator
from typing import Any

from serve_app.batch_api.input import parse_input
from serve_app.batch_api.service import ENDPOINTS, BatchService
from serve_app.batch_api.store import new_id
from serve_app.batch_api.uploads import Uploads
from serve_app.batch_api.window import window_seconds
from serve_app.errors import APIError
from serve_app.openai.charging import request_charge

DOWNLOAD_CHUNK = 256 * 1024
io = asyncio.to_thread


def not_found(kind: str, object_id: str) -> APIError:
    return APIError(f"No {kind} with id {object_id!r}.", status=404, code="not_found")


class BatchApi:
    def __init__(self, service: BatchService) -> None:
        self.service, self.store = service, service.store
        self.config = service.config
        self.uploads = Uploads(self.store.root)
        self._started = False

    def start(self) -> None:
        """On the serving loop: resume and tend batches (idempotent)."""
        if not self._started:
            self._started = True
            self.uploads.sweep()
        self.service.ensure_resumed()

    # Files ------------------------------------------------------------------------------

    async def upload_part(self, upload_id: str, offset: int, data: bytes) -> int:
        """Write one part of an upload at ``offset``; the upload's size so far."""
        limit = self.config.batch_api.max_file_bytes
        if offset < 0 or offset + len(data) > limit:
            await io(self.uploads.discard, upload_id)
            raise APIError(
                f"The file is larger than batch_api.max_file_bytes ({limit} bytes).",
                status=413,
                param="file",
                code="file_too_large",
            )
        return await io(self.uploads.write, upload_id, offset, data)

    async def finish_upload(
        self, upload_id: str, size: int, filename: str, purpose: str, owner: str
    ) -> dict[str, Any]:
        """Record an upload of ``size`` bytes as a file of ``owner``'s."""
        path = self.uploads.path(upload_id)
        if await io(self.uploads.size, upload_id) != size:  # A part went missing: never record.
            await io(self.uploads.discard, upload_id)
            raise APIError(
                "The upload was cut short; send the file again.",
                status=503,
                type="server_error",
                code="upload_incomplete",
            )
        return await io(self.store.adopt_file, path, filename[:255], purpose, owner)

    async def get_file(self, file_id: str, owner: str) -> dict[str, Any]:
        found = await io(self.store.get_file, file_id, owner)
        if found is None:
            raise not_found("file", file_id)
        return found

    async def delete_file(self, file_id: str, owner: str) -> dict[str, Any]:
        if not await io(self.store.delete_file, file_id, owner):
            raise not_found("file", file_id)
        return {"id": file_id, "object": "file", "deleted": True}

    async def file_content(self, file_id: str, owner: str) -> AsyncIterator[int | bytes]:
        """The file's size, then its bytes in 256 KiB chunks. The file is opened first, so a
        delete meanwhile (the open handle outlives the name) cannot cut a download short."""
        await self.get_file(file_id, owner)
        try:
            handle = await io(self.store.file_path(file_id).open, "rb")
        except FileNotFoundError:
            raise not_found("file", file_id) from None
        try:
            yield os.fstat(handle.fileno()).st_size
            while chunk := await io(handle.read, DOWNLOAD_CHUNK):
                yield chunk
        finally:
            handle.close()

    # Batches ----------------------------------------------------------------------------

    async def create_batch(self, body: dict[str, Any], owner: str) -> dict[str, Any]:
        """``body``: a validated ``BatchCreate``. 429 past the owner's enqueued-token limit."""
        endpoint, window = body["endpoint"], body.get("completion_window") or "24h"
        if endpoint not in ENDPOINTS:
            raise APIError(f"endpoint must be one of {', '.join(ENDPOINTS)}.", param="endpoint")
        window_s = window_seconds(window)
        await self.get_file(body["input_file_id"], owner)
        content = await io(self.store.file_content, body["input_file_id"])
        parsed = await io(parse_input, content, endpoint)
        now = int(time.time())
        batch: dict[str, Any] = {
            "id": new_id("batch"),
            "object": "batch",
            "endpoint": endpoint,
            "errors": None,
            "input_file_id": body["input_file_id"],
            "completion_window": window,
            "status": "validating",
            "output_file_id": None,
            "error_file_id": None,
            "created_at": now,
            "expires_at": now + window_s,
            "request_counts": {"total": parsed.total, "completed": 0, "failed": 0},
            "metadata": body.get("metadata"),
        }
        for stamp in ("in_progress_at", "finalizing_at", "completed_at", "failed_at"):
            batch[stamp] = None
        batch |= {"expired_at": None, "cancelling_at": None, "cancelled_at": None}
        security, svc = self.config.security, self.service
        tokens = sum(
            request_charge(endpoint, line["body"], security.unset_max_tokens_charge)
            for line in parsed.lines
        )
        limit = security.batch_queue_tokens_for(owner)
        enqueued = await io(
            self.store.create_batch_within,
            batch,
            owner,
            tokens,
            limit,
            holder=svc.holder,
            lease_s=svc.lease_s,
        )
        if enqueued is not None:
            raise APIError(
                f"Enqueued token limit reached for key `{owner or 'default'}`: {enqueued} "
                f"tokens in unfinished batches plus {tokens} for this one would pass its limit "
                f"of {limit}. Wait for a batch to finish, or split this one.",
                status=429,
                type="tokens",
                code="batch_queue_limit_exceeded",
            )
        svc.start(batch["id"])
        return batch

    async def get_batch(self, batch_id: str, owner: str) -> dict[str, Any]:
        found = await io(self.store.get_batch, batch_id, owner)
        if found is None:
            raise not_found("batch", batch_id)
        return found

    async def list_batches(self, after: str | None, limit: int, owner: str) -> dict[str, Any]:
        data, has_more = await io(self.store.list_batches, after, limit, owner)
        return {
            "object": "list",
            "data": data,
            "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None,
            "has_more": has_more,
        }

    async def cancel_batch(self, batch_id: str, owner: str) -> dict[str, Any]:
        batch = await self.get_batch(batch_id, owner)
        if batch["status"] not in ("validating", "in_progress"):
            raise APIError(
                f"Cannot cancel a batch that is {batch['status']}.", code="invalid_state"
            )
        cancelling = await self.service.cancel(batch_id)
        if cancelling is None:  # It finished meanwhile.
            raise APIError("Cannot cancel a batch that has finished.", code="invalid_state")
        return cancelling

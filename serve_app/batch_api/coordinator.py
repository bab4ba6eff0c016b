"""The batch coordinator: the Batch API's verbs per tenant, and the loop that owns batches.

Every ``poll_s`` the loop renews the leases of the batches this coordinator runs (noticing
cancellations and lost leases), and claims waiting batches, or those of an owner that stopped
renewing, up to ``max_running_batches``. Two coordinators alive at once never run the same
batch: a batch is run only by its lease holder. All file and database work runs in threads,
never on the event loop that serves the routers' calls and drives the batch lines.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import socket
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from serve_app.batch_api.db import new_id
from serve_app.batch_api.files import not_found
from serve_app.batch_api.lines import ENDPOINTS, summarize
from serve_app.batch_api.runner import BatchRun, LineSlots
from serve_app.batch_api.store import BatchStore, public
from serve_app.config import AppConfig
from serve_app.config.batch import window_seconds
from serve_app.errors import APIError
from serve_app.openai.serving import OpenAIServing

logger = logging.getLogger("serve_app.batch_api")
UPLOAD_IDLE_S = 600  # An upload nobody added to for this long is dropped.


def list_object(data: list[dict[str, Any]], has_more: bool) -> dict[str, Any]:
    return {
        "object": "list",
        "data": data,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
        "has_more": has_more,
    }


class Coordinator:
    def __init__(
        self, config: AppConfig, serving: OpenAIServing, store: BatchStore, owner_id: str = ""
    ) -> None:
        self.config, self.serving, self.store = config, serving, store
        self.settings = config.batch_api
        self.owner_id = owner_id or f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.slots = LineSlots(config.batch_lines_in_flight())
        self.runs: dict[str, tuple[BatchRun, asyncio.Task[None]]] = {}
        self._wake = asyncio.Event()
        self._loop: asyncio.Task[None] | None = None
        self._swept_at = 0.0

    # The owner loop ---------------------------------------------------------------------

    def start(self) -> None:
        self._loop = asyncio.create_task(self._own())

    async def _own(self) -> None:
        while True:
            try:
                await self.tick()
            except Exception:  # A database hiccup: try again on the next tick.
                logger.exception("Batch coordinator tick failed")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.settings.poll_s)
            self._wake.clear()

    async def tick(self) -> None:
        store, lease_s = self.store, self.settings.lease_s
        held = await asyncio.to_thread(store.renew, self.owner_id, lease_s, list(self.runs))
        for batch_id, (run, _) in self.runs.items():
            status = held.get(batch_id)
            if status is None:
                run.stop("lost")
            elif status == "cancelling":
                run.stop("cancelled")
        free = self.settings.max_running_batches - len(self.runs)
        for batch, epoch in await asyncio.to_thread(
            store.claim, self.owner_id, lease_s, free, list(self.runs)
        ):
            logger.info("Batch %s (%s): running it, lease %d", batch["id"], batch["status"], epoch)
            run = BatchRun(
                batch,
                epoch,
                owner_id=self.owner_id,
                store=store,
                serving=self.serving,
                slots=self.slots,
                config=self.config,
            )
            task = asyncio.create_task(run.run())
            self.runs[batch["id"]] = (run, task)
            task.add_done_callback(functools.partial(self._ended, batch["id"]))
        if time.monotonic() - self._swept_at > 60:
            self._swept_at = time.monotonic()
            await asyncio.to_thread(store.files.sweep_uploads, UPLOAD_IDLE_S)
            await asyncio.to_thread(store.files.sweep_tmp, 3600)

    def _ended(self, batch_id: str, _: object = None) -> None:
        self.runs.pop(batch_id, None)
        self._wake.set()  # A slot for the next waiting batch.

    async def stop(self) -> None:
        """Stop running batches (their finished lines are recorded) and give their leases
        back, so another coordinator takes them over at once instead of after lease_s."""
        if self._loop is not None:
            self._loop.cancel()
        runs = list(self.runs.items())
        for _, (_, task) in runs:
            task.cancel()
        await asyncio.gather(*(task for _, (_, task) in runs), return_exceptions=True)
        for batch_id, _ in runs:
            with contextlib.suppress(Exception):
                await asyncio.to_thread(self.store.release, self.owner_id, batch_id)

    # Files ------------------------------------------------------------------------------

    async def upload_start(self, owner: str, filename: str) -> str:
        return await asyncio.to_thread(self.store.files.start_upload, owner, filename)

    async def upload_write(self, owner: str, upload_id: str, offset: int, chunk: bytes) -> int:
        files, limit = self.store.files, self.settings.max_file_bytes
        return await asyncio.to_thread(files.write_upload, owner, upload_id, offset, chunk, limit)

    async def upload_finish(self, owner: str, upload_id: str, purpose: str) -> dict[str, Any]:
        if purpose != "batch":
            await self.upload_abort(owner, upload_id)
            raise APIError("Only purpose=batch is supported.", param="purpose")
        return await asyncio.to_thread(self.store.files.finish_upload, owner, upload_id, purpose)

    async def upload_abort(self, owner: str, upload_id: str) -> None:
        await asyncio.to_thread(self.store.files.abort_upload, owner, upload_id)

    async def get_file(self, owner: str, file_id: str) -> dict[str, Any]:
        return await asyncio.to_thread(self.store.files.get, owner, file_id)

    async def list_files(
        self, owner: str, purpose: str | None, after: str | None, limit: int, order: str
    ) -> dict[str, Any]:
        files = self.store.files
        found = await asyncio.to_thread(files.list_files, owner, purpose, after, limit, order)
        return list_object(*found)

    async def delete_file(self, owner: str, file_id: str) -> dict[str, Any]:
        await asyncio.to_thread(self.store.files.delete, owner, file_id)
        return {"id": file_id, "object": "file", "deleted": True}

    async def file_chunks(self, owner: str, file_id: str) -> AsyncIterator[bytes]:
        """Checked (404 for another owner) before the first chunk; read in threads."""
        await self.get_file(owner, file_id)
        try:
            chunks = await asyncio.to_thread(self.store.files.chunks, file_id)
        except FileNotFoundError:
            raise not_found("file", file_id) from None
        while (chunk := await asyncio.to_thread(next, chunks, None)) is not None:
            yield chunk

    # Batches ----------------------------------------------------------------------------

    async def create_batch(
        self,
        owner: str,
        input_file_id: str,
        endpoint: str,
        completion_window: str,
        metadata: dict[str, str] | None = None,
    ) -> dict[str, Any]:
        if endpoint not in ENDPOINTS:
            raise APIError(f"endpoint must be one of {', '.join(ENDPOINTS)}.", param="endpoint")
        try:
            window_s = window_seconds(completion_window)
        except ValueError as exc:
            raise APIError(str(exc), param="completion_window") from None
        upload = await self.get_file(owner, input_file_id)
        if upload["purpose"] != "batch":
            raise APIError("input_file_id must be a file uploaded with purpose batch.")
        content = await asyncio.to_thread(self.store.files.content, input_file_id)
        summary = await asyncio.to_thread(summarize, content, endpoint, self.config)
        del content
        now = int(time.time())
        batch: dict[str, Any] = {
            "id": new_id("batch"),
            "object": "batch",
            "endpoint": endpoint,
            "errors": None,
            "input_file_id": input_file_id,
            "completion_window": completion_window,
            "status": "validating",
            "output_file_id": None,
            "error_file_id": None,
            "created_at": now,
            "in_progress_at": None,
            "expires_at": now + window_s,
            "finalizing_at": None,
            "completed_at": None,
            "failed_at": None,
            "expired_at": None,
            "cancelling_at": None,
            "cancelled_at": None,
            "request_counts": {"total": summary.total, "completed": 0, "failed": 0},
            "metadata": metadata,
        }
        if summary.errors:  # File-level problems: the batch fails at once, as OpenAI's.
            errors = {"object": "list", "data": summary.errors}
            batch |= {"status": "failed", "failed_at": now, "errors": errors}
        limit = self.settings.enqueued_limit(owner)
        tokens = 0 if summary.errors else summary.tokens
        created = await asyncio.to_thread(self.store.create, owner, batch, tokens, limit)
        self._wake.set()
        return created

    async def get_batch(self, owner: str, batch_id: str) -> dict[str, Any]:
        return public(await asyncio.to_thread(self.store.get, owner, batch_id))

    async def list_batches(self, owner: str, after: str | None, limit: int) -> dict[str, Any]:
        return list_object(*await asyncio.to_thread(self.store.list_batches, owner, after, limit))

    async def cancel_batch(self, owner: str, batch_id: str) -> dict[str, Any]:
        batch = await asyncio.to_thread(self.store.request_cancel, owner, batch_id)
        entry = self.runs.get(batch_id)
        if entry is not None:  # Ours: stop now. Another coordinator's: its next tick.
            entry[0].stop("cancelled")
        self._wake.set()
        return batch

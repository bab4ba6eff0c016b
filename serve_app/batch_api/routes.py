"""The OpenAI Batch API on the serving app: /v1/files and /v1/batches as a FastAPI router.

Batches run inside the router replica as background tasks through the same ``OpenAIServing``
as the HTTP routes, at a low vLLM priority (a larger number: interactive traffic goes first).
Batches left active by a previous router are resumed from their partial output on start.
Wiring: ``app.include_router(batch_api.router)`` before ``@serve.ingress`` and
``batch_api.attach(serving_for, self.config)`` in the router's ``__init__``.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

from fastapi import APIRouter, File, Form, Query, Request, UploadFile
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel

from serve_app.batch_api.input import parse_input
from serve_app.batch_api.service import ENDPOINTS, BatchService
from serve_app.batch_api.store import BatchStore, new_id
from serve_app.batch_api.window import window_seconds
from serve_app.config import AppConfig
from serve_app.errors import APIError
from serve_app.ingress.tenancy import tenant_of
from serve_app.openai.charging import request_charge
from serve_app.openai.protocol import ErrorResponse
from serve_app.openai.serving import OpenAIServing, ServingFor

__all__ = ["ENDPOINTS", "BatchService", "attach", "parse_input", "router", "service"]


# Documented error statuses (OpenAI's error body), so clients and schema checks know them.
router = APIRouter(
    responses={code: {"model": ErrorResponse} for code in (400, 401, 404, 413, 429, 503)}
)


class BatchCreate(BaseModel):
    input_file_id: str
    endpoint: str
    completion_window: str = "24h"
    metadata: dict[str, str] | None = None


def not_found(kind: str, object_id: str) -> APIError:
    return APIError(f"No {kind} with id {object_id!r}.", status=404, code="not_found")


_service: BatchService | None = None


def attach(
    serving: OpenAIServing | ServingFor,
    config: AppConfig,
    root: Path | None = None,
    refresh: Callable[[], Awaitable[None]] | None = None,
) -> BatchService:
    """Called by the router replica: open the store and resume batches left active.
    ``refresh``: brings the runtime LoRA adapters up to date (see BatchService)."""
    global _service
    if root is None and config.batch_api.dir:
        root = Path(config.batch_api.dir).expanduser().absolute()
    _service = BatchService(serving, config, BatchStore(root), refresh=refresh)
    try:
        asyncio.get_running_loop()
        _service.ensure_resumed()
    except RuntimeError:  # No loop yet: resumed on the first Batch API call.
        pass
    return _service


def service() -> BatchService:
    if _service is None:
        raise APIError("The Batch API is not enabled.", status=503, type="server_error")
    _service.ensure_resumed()
    return _service


# Routes -----------------------------------------------------------------------------------


# Files and batches belong to the API key that created them (its name; "" without keys):
# another key gets 404 for them, as for ids that do not exist, and never lists them.


@router.post("/v1/files")
async def create_file(
    request: Request,
    file: UploadFile = File(...),  # noqa: B008
    purpose: str = Form(...),
) -> JSONResponse:
    if purpose != "batch":
        raise APIError("Only purpose=batch is supported.", param="purpose")
    name = file.filename or "upload.jsonl"
    # Starlette spooled the upload to a temporary file as it arrived (the middleware streams
    # this route's body, within batch_api.max_file_bytes); copied to the store in a thread.
    await file.seek(0)
    try:
        stored = await asyncio.to_thread(
            service().store.create_file_from, file.file, name, purpose, tenant_of(request)
        )
    finally:
        await file.close()
    return JSONResponse(stored)


async def _file(file_id: str, request: Request) -> dict[str, Any]:
    found = await asyncio.to_thread(service().store.get_file, file_id, tenant_of(request))
    if found is None:
        raise not_found("file", file_id)
    return found


@router.get("/v1/files/{file_id}")
async def retrieve_file(file_id: str, request: Request) -> JSONResponse:
    return JSONResponse(await _file(file_id, request))


DOWNLOAD_CHUNK = 256 * 1024


@router.get("/v1/files/{file_id}/content")
async def file_content(file_id: str, request: Request) -> Response:
    """Streamed from disk in 256 KiB chunks: a download never holds a whole file in memory.

    The file is opened before the response starts, so a delete meanwhile (the open handle
    outlives the name) cannot cut it short or turn it into a 500.
    """
    await _file(file_id, request)
    try:
        handle = await asyncio.to_thread(service().store.file_path(file_id).open, "rb")
    except FileNotFoundError:
        raise not_found("file", file_id) from None
    size = os.fstat(handle.fileno()).st_size

    async def chunks() -> AsyncIterator[bytes]:
        try:
            while chunk := await asyncio.to_thread(handle.read, DOWNLOAD_CHUNK):
                yield chunk
        finally:
            handle.close()

    return StreamingResponse(
        chunks(), media_type="application/octet-stream", headers={"content-length": str(size)}
    )


@router.delete("/v1/files/{file_id}")
async def delete_file(file_id: str, request: Request) -> JSONResponse:
    if not await asyncio.to_thread(service().store.delete_file, file_id, tenant_of(request)):
        raise not_found("file", file_id)
    return JSONResponse({"id": file_id, "object": "file", "deleted": True})


@router.post("/v1/batches")
async def create_batch(body: BatchCreate, request: Request) -> JSONResponse:
    svc = service()
    if body.endpoint not in ENDPOINTS:
        raise APIError(f"endpoint must be one of {', '.join(ENDPOINTS)}.", param="endpoint")
    window_s = window_seconds(body.completion_window)
    await _file(body.input_file_id, request)
    content = await asyncio.to_thread(svc.store.file_content, body.input_file_id)
    parsed = await asyncio.to_thread(parse_input, content, body.endpoint)
    now = int(time.time())
    batch: dict[str, Any] = {
        "id": new_id("batch"),
        "object": "batch",
        "endpoint": body.endpoint,
        "errors": None,
        "input_file_id": body.input_file_id,
        "completion_window": body.completion_window,
        "status": "validating",
        "output_file_id": None,
        "error_file_id": None,
        "created_at": now,
        "expires_at": now + window_s,
        "request_counts": {"total": parsed.total, "completed": 0, "failed": 0},
        "metadata": body.metadata,
    }
    for stamp in ("in_progress_at", "finalizing_at", "completed_at", "failed_at"):
        batch[stamp] = None
    batch |= {"expired_at": None, "cancelling_at": None, "cancelled_at": None}
    owner, security = tenant_of(request), svc.config.security
    tokens = sum(
        request_charge(body.endpoint, line["body"], security.unset_max_tokens_charge)
        for line in parsed.lines
    )
    limit = security.batch_queue_tokens_for(owner)
    enqueued = await asyncio.to_thread(
        svc.store.create_batch_within,
        batch,
        owner,
        tokens,
        limit,
        holder=svc.holder,
        lease_s=svc.lease_s,
    )
    if enqueued is not None:
        raise APIError(
            f"Enqueued token limit reached for key `{owner or 'default'}`: {enqueued} tokens "
            f"in unfinished batches plus {tokens} for this one would pass its limit of "
            f"{limit}. Wait for a batch to finish, or split this one.",
            status=429,
            type="tokens",
            code="batch_queue_limit_exceeded",
        )
    svc.start(batch["id"])
    return JSONResponse(batch)


async def _batch(batch_id: str, request: Request) -> dict[str, Any]:
    found = await asyncio.to_thread(service().store.get_batch, batch_id, tenant_of(request))
    if found is None:
        raise not_found("batch", batch_id)
    return found


@router.get("/v1/batches/{batch_id}")
async def retrieve_batch(batch_id: str, request: Request) -> JSONResponse:
    return JSONResponse(await _batch(batch_id, request))


@router.get("/v1/batches")
async def list_batches(
    request: Request, after: str | None = None, limit: int = Query(20, ge=1, le=100)
) -> JSONResponse:
    data, has_more = await asyncio.to_thread(
        service().store.list_batches, after, limit, tenant_of(request)
    )
    return JSONResponse(
        {
            "object": "list",
            "data": data,
            "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None,
            "has_more": has_more,
        }
    )


@router.post("/v1/batches/{batch_id}/cancel")
async def cancel_batch(batch_id: str, request: Request) -> JSONResponse:
    batch = await _batch(batch_id, request)
    if batch["status"] not in ("validating", "in_progress"):
        raise APIError(f"Cannot cancel a batch that is {batch['status']}.", code="invalid_state")
    cancelling = await service().cancel(batch_id)
    if cancelling is None:  # It finished meanwhile.
        raise APIError("Cannot cancel a batch that has finished.", code="invalid_state")
    return JSONResponse(cancelling)

"""The OpenAI Batch API over HTTP: /v1/files and /v1/batches, forwarded to the batch coordinator.

A router replica runs no batch and opens no store: every route forwards to ``BatchApi`` (the
operations, ``api``) in the coordinator deployment through its handle (``connect``), or, for a
standalone app, in this process (``attach``). Uploads go over in parts of ``UPLOAD_PART``
bytes and downloads come back in chunks, so a router never holds a whole file.
Wiring: ``app.include_router(batch_api.router)`` before ``@serve.ingress``, then ``connect``.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

from fastapi import APIRouter, File, Form, Query, Request, UploadFile
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel
from ray.serve.handle import DeploymentHandle

from serve_app.batch_api.api import BatchApi
from serve_app.batch_api.ids import new_id
from serve_app.batch_api.input import parse_input
from serve_app.batch_api.service import ENDPOINTS, BatchService
from serve_app.batch_api.store import BatchStore
from serve_app.config import AppConfig
from serve_app.errors import APIError, backend_error
from serve_app.ingress.tenancy import tenant_of
from serve_app.openai.protocol import ErrorResponse
from serve_app.openai.serving import OpenAIServing, ServingFor

__all__ = ["ENDPOINTS", "BatchService", "attach", "connect", "parse_input", "router"]

UPLOAD_PART = 4 * 1024 * 1024  # Bytes of an upload per call to the coordinator.
CALL_TIMEOUT_S = 60.0  # A coordinator call past this (it is restarting): 503, retry.

# Documented error statuses (OpenAI's error body), so clients and schema checks know them.
router = APIRouter(
    responses={code: {"model": ErrorResponse} for code in (400, 401, 404, 413, 429, 503)}
)


class BatchCreate(BaseModel):
    input_file_id: str
    endpoint: str
    completion_window: str = "24h"
    metadata: dict[str, str] | None = None


class _Local:
    """``BatchApi`` in this process (a standalone app, tests)."""

    def __init__(self, api: BatchApi) -> None:
        self.api = api

    async def call(self, method: str, *args: Any) -> Any:
        self.api.start()
        return await getattr(self.api, method)(*args)

    def stream(self, method: str, *args: Any) -> AsyncIterator[Any]:
        self.api.start()
        return getattr(self.api, method)(*args)


class _Remote:
    """``BatchApi`` in the coordinator deployment; its outages are 503s a client retries."""

    def __init__(self, handle: DeploymentHandle) -> None:
        self.handle = handle

    async def call(self, method: str, *args: Any) -> Any:
        try:
            return await asyncio.wait_for(
                getattr(self.handle, method).remote(*args), CALL_TIMEOUT_S
            )
        except TimeoutError:
            raise _unavailable() from None
        except Exception as exc:
            raise _translated(exc) from None

    async def stream(self, method: str, *args: Any) -> AsyncIterator[Any]:
        items = getattr(self.handle.options(stream=True), method).remote(*args)
        try:
            while True:
                try:
                    yield await asyncio.wait_for(items.__anext__(), CALL_TIMEOUT_S)
                except StopAsyncIteration:
                    return
                except TimeoutError:
                    raise _unavailable() from None
                except APIError:
                    raise
                except Exception as exc:
                    raise _translated(exc) from None
        finally:
            items.cancel()


def _unavailable() -> APIError:
    return APIError(
        f"The batch coordinator did not answer within {CALL_TIMEOUT_S:g} s (restarting); "
        "retry shortly.",
        status=503,
        type="server_error",
        code="backend_unavailable",
    )


def _translated(exc: Exception) -> Exception:
    info = backend_error(exc)
    return APIError.from_info(info) if info is not None else exc


_client: _Local | _Remote | None = None


def attach(
    serving: OpenAIServing | ServingFor,
    config: AppConfig,
    root: Path | None = None,
    refresh: Callable[[], Awaitable[None]] | None = None,
) -> BatchService:
    """Serve the Batch API from this process (a standalone app): open the store and resume
    batches left active. ``refresh``: brings the runtime LoRA adapters up to date."""
    global _client
    if root is None and config.batch_api.dir:
        root = Path(config.batch_api.dir).expanduser().absolute()
    service = BatchService(serving, config, BatchStore(root), refresh=refresh)
    _client = _Local(BatchApi(service))
    try:
        asyncio.get_running_loop()
        _client.api.start()
    except RuntimeError:  # No loop yet: resumed on the first Batch API call.
        pass
    return service


def connect(coordinator: DeploymentHandle) -> None:
    """Forward the Batch API to the coordinator deployment (a router replica)."""
    global _client
    _client = _Remote(coordinator)


def client() -> _Local | _Remote:
    if _client is None:
        raise APIError(
            "The Batch API is turned off on this server (batch_api.enabled: false).",
            status=404,
            code="not_found",
        )
    return _client


# Routes -----------------------------------------------------------------------------------


@router.post("/v1/files")
async def create_file(
    request: Request,
    file: UploadFile = File(...),  # noqa: B008
    purpose: str = Form(...),
) -> JSONResponse:
    if purpose != "batch":
        raise APIError("Only purpose=batch is supported.", param="purpose")
    # Starlette spooled the upload to a temporary file as it arrived (the middleware streams
    # this route's body, within batch_api.max_file_bytes); it goes on in parts.
    upload_id, size, api = new_id("upload"), 0, client()
    try:
        await file.seek(0)
        while part := await file.read(UPLOAD_PART):
            await api.call("upload_part", upload_id, size, part)
            size += len(part)
        stored = await api.call(
            "finish_upload", upload_id, size, file.filename or "upload.jsonl", purpose,
            tenant_of(request),
        )  # fmt: skip
    finally:
        await file.close()
        await asyncio.to_thread(_give_back_memory)
    return JSONResponse(stored)


def _give_back_memory() -> None:
    """Return the heap an upload's body used to the OS (glibc keeps freed heap pages; Serve's
    proxy hands a body over in large batches of 64 KiB chunks), so a router stays flat."""
    with contextlib.suppress(OSError, AttributeError):  # Not glibc: nothing to do.
        ctypes.CDLL("libc.so.6").malloc_trim(0)


@router.get("/v1/files/{file_id}")
async def retrieve_file(file_id: str, request: Request) -> JSONResponse:
    return JSONResponse(await client().call("get_file", file_id, tenant_of(request)))


@router.get("/v1/files/{file_id}/content")
async def file_content(file_id: str, request: Request) -> Response:
    """Streamed in 256 KiB chunks: a download never holds a whole file in memory."""
    items = client().stream("file_content", file_id, tenant_of(request))
    size = await items.__anext__()  # A missing or foreign file: 404 before any byte is sent.

    async def chunks() -> AsyncIterator[bytes]:
        try:
            async for chunk in items:
                yield chunk
        finally:  # The client went away: the coordinator's stream stops too.
            await items.aclose()  # type: ignore[attr-defined]

    return StreamingResponse(
        chunks(), media_type="application/octet-stream", headers={"content-length": str(size)}
    )


@router.delete("/v1/files/{file_id}")
async def delete_file(file_id: str, request: Request) -> JSONResponse:
    return JSONResponse(await client().call("delete_file", file_id, tenant_of(request)))


@router.post("/v1/batches")
async def create_batch(body: BatchCreate, request: Request) -> JSONResponse:
    return JSONResponse(await client().call("create_batch", body.model_dump(), tenant_of(request)))


@router.get("/v1/batches/{batch_id}")
async def retrieve_batch(batch_id: str, request: Request) -> JSONResponse:
    return JSONResponse(await client().call("get_batch", batch_id, tenant_of(request)))


@router.get("/v1/batches")
async def list_batches(
    request: Request, after: str | None = None, limit: int = Query(20, ge=1, le=100)
) -> JSONResponse:
    return JSONResponse(await client().call("list_batches", after, limit, tenant_of(request)))


@router.post("/v1/batches/{batch_id}/cancel")
async def cancel_batch(batch_id: str, request: Request) -> JSONResponse:
    return JSONResponse(await client().call("cancel_batch", batch_id, tenant_of(request)))

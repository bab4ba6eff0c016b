"""/v1/files and /v1/batches on the router: forwarded to the BatchCoordinator, nothing kept here.

Any router replica answers any call (state lives with the coordinator), each call bounded by
``batch_api.call_timeout_s``. Uploads stream through in chunks (the security middleware leaves
this path's body unbuffered; ``batch_api.max_file_bytes`` bounds it), spooled on the router's
local disk, never held in memory; downloads stream back.
Objects belong to the API key's name: another key gets 404 and never sees them listed.
Wiring: ``app.include_router(routes.router)`` before ``@serve.ingress``; ``connect(handle,
config.batch_api)`` in the router's ``__init__``.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import tempfile
from collections.abc import AsyncIterator
from typing import IO, Annotated, Any, Literal

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, Field
from ray.serve.handle import DeploymentHandle

from serve_app.batch_api.upload import (
    ChunkWriter,
    FieldValue,
    FileData,
    FileStart,
    MultipartStream,
    bad_upload,
)
from serve_app.config.batch import BatchApiConfig
from serve_app.errors import APIError, ErrorInfo, server_error
from serve_app.openai.protocol import ErrorResponse

logger = logging.getLogger("serve_app.batch_api")
router = APIRouter(
    responses={code: {"model": ErrorResponse} for code in (400, 401, 404, 409, 413, 429, 503)}
)
FORWARD_BYTES = 1024 * 1024  # Upload bytes per call to the coordinator.
FORWARDS = 4  # Calls in flight per upload: forwarding keeps pace with the client.
MULTIPART_SLACK = 64 * 1024  # Form fields and boundaries around the file.


class CoordinatorLink:
    """Bounded calls to the coordinator; its errors arrive as values and become APIErrors."""

    def __init__(self, handle: DeploymentHandle, settings: BatchApiConfig) -> None:
        self.handle, self.settings = handle, settings
        self.streaming = handle.options(stream=True)

    def unavailable(self) -> APIError:
        return APIError(
            f"The batch coordinator did not answer within {self.settings.call_timeout_s:g} s "
            "(restarting?); retry shortly.",
            status=503,
            type="server_error",
            code="coordinator_unavailable",
        )

    async def _bounded(self, awaitable: Any) -> Any:
        from ray.exceptions import RayActorError, RayError
        from ray.serve.exceptions import RayServeException

        try:
            result = await asyncio.wait_for(awaitable, self.settings.call_timeout_s)
        except (TimeoutError, RayActorError, RayServeException):  # Restarting, full, gone.
            raise self.unavailable() from None
        except RayError as exc:
            logger.error("Batch coordinator call failed: %r", exc)
            raise server_error("Internal error in the batch coordinator; see its log.") from None
        if isinstance(result, ErrorInfo):
            raise APIError.from_info(result)
        return result

    async def call(self, verb: str, *args: Any) -> Any:
        return await self._bounded(self.handle.call.remote(verb, *args))

    async def download(self, owner: str, file_id: str) -> AsyncIterator[bytes]:
        chunks: Any = self.streaming.file_content.remote(owner, file_id)
        try:
            while True:
                try:
                    chunk = await self._bounded(anext(chunks))
                except StopAsyncIteration:
                    return
                yield chunk
        finally:
            chunks.cancel()


_link: CoordinatorLink | None = None


def upload_body_limit(settings: BatchApiConfig) -> int:
    """The largest POST /v1/files body: the file plus its multipart framing."""
    return settings.max_file_bytes + MULTIPART_SLACK


def connect(handle: DeploymentHandle, settings: BatchApiConfig) -> None:
    global _link
    _link = CoordinatorLink(handle, settings)


def link() -> CoordinatorLink:
    if _link is None:
        raise APIError(
            "The Batch API is not enabled on this server (batch_api.enabled).",
            status=404,
            code="not_found",
        )
    return _link


def owner_of(request: Request) -> str:
    """The API key's name ("" without keys: one tenant)."""
    return str(getattr(request.state, "api_key_name", "") or "")


# Files ------------------------------------------------------------------------------------


@router.post("/v1/files")
async def create_file(request: Request) -> JSONResponse:
    """Spooled to a local temporary file as it arrives, then forwarded to the coordinator in
    chunks: Serve's proxy hands a replica the whole body as fast as it can, whatever the route
    consumes, so only a spool that keeps pace keeps this replica's memory flat."""
    coordinator, owner = link(), owner_of(request)
    parser = MultipartStream(request.headers.get("content-type", ""))
    limit = coordinator.settings.max_file_bytes
    purpose: str | None = None
    filename: str | None = None
    spool = await asyncio.to_thread(tempfile.TemporaryFile)
    try:
        size, pending, in_file = 0, bytearray(), False
        async for chunk in request.stream():
            for event in parser.feed(chunk):
                if isinstance(event, FieldValue) and event.name == "purpose":
                    purpose = event.value
                elif isinstance(event, FileStart):  # The first file part is the file.
                    in_file = filename is None
                    filename = event.filename if in_file else filename
                elif isinstance(event, FileData) and in_file:
                    size += len(event.data)
                    if size > limit:
                        raise APIError(
                            f"File too large: the limit is {limit} bytes "
                            "(batch_api.max_file_bytes); split the requests over several files.",
                            status=413,
                            code="file_too_large",
                        )
                    pending += event.data
                    if len(pending) >= FORWARD_BYTES:
                        await asyncio.to_thread(spool.write, bytes(pending))
                        pending.clear()
        parser.finish()
        if filename is None or purpose is None:
            raise bad_upload("The `file` part or the `purpose` field is missing.")
        await asyncio.to_thread(spool.write, bytes(pending))
        return JSONResponse(await _forward(coordinator, owner, filename, purpose, spool))
    finally:
        await asyncio.to_thread(spool.close)


async def _forward(
    coordinator: CoordinatorLink, owner: str, filename: str, purpose: str, spool: IO[bytes]
) -> Any:
    upload = await coordinator.call("upload_start", owner, filename)
    writer = ChunkWriter(functools.partial(_write, owner, upload), FORWARDS)
    try:
        await asyncio.to_thread(spool.seek, 0)
        while chunk := await asyncio.to_thread(spool.read, FORWARD_BYTES):
            await writer.send(chunk)
        await writer.flush()
        done, upload = upload, None
        return await coordinator.call("upload_finish", owner, done, purpose)
    finally:
        await writer.cancel()
        if upload is not None:  # Refused, or the client went away: drop what arrived.
            with contextlib.suppress(Exception):
                await coordinator.call("upload_abort", owner, upload)


async def _write(owner: str, upload: str, offset: int, chunk: bytes) -> object:
    return await link().call("upload_write", owner, upload, offset, chunk)


@router.get("/v1/files")
async def list_files(
    request: Request,
    purpose: str | None = None,
    after: str | None = None,
    limit: Annotated[int, Query(ge=1, le=10_000)] = 10_000,
    order: Literal["asc", "desc"] = "desc",
) -> JSONResponse:
    args = (owner_of(request), purpose, after, limit, order)
    return JSONResponse(await link().call("list_files", *args))


@router.get("/v1/files/{file_id}")
async def retrieve_file(file_id: str, request: Request) -> JSONResponse:
    return JSONResponse(await link().call("get_file", owner_of(request), file_id))


@router.get("/v1/files/{file_id}/content")
async def file_content(file_id: str, request: Request) -> StreamingResponse:
    coordinator, owner = link(), owner_of(request)
    found = await coordinator.call("get_file", owner, file_id)
    chunks: Any = coordinator.download(owner, file_id)
    try:  # The first chunk before answering: a file gone meanwhile is a 404, not a cut stream.
        first = await anext(chunks, b"")
    except BaseException:
        await chunks.aclose()
        raise

    async def body() -> AsyncIterator[bytes]:
        yield first
        async for chunk in chunks:
            yield chunk

    headers = {"content-length": str(found["bytes"])}
    return StreamingResponse(body(), media_type="application/octet-stream", headers=headers)


@router.delete("/v1/files/{file_id}")
async def delete_file(file_id: str, request: Request) -> JSONResponse:
    return JSONResponse(await link().call("delete_file", owner_of(request), file_id))


# Batches ----------------------------------------------------------------------------------


Metadata = Annotated[dict[str, Annotated[str, Field(max_length=512)]], Field(max_length=16)]


class BatchCreate(BaseModel):
    input_file_id: Annotated[str, Field(max_length=100)]
    endpoint: str
    completion_window: str = Field(
        "24h", description="24h, or shorter: 1h, 30m, 30s. Unfinished lines then expire."
    )
    metadata: Metadata | None = None


@router.post("/v1/batches")
async def create_batch(body: BatchCreate, request: Request) -> JSONResponse:
    args = (body.input_file_id, body.endpoint, body.completion_window, body.metadata)
    return JSONResponse(await link().call("create_batch", owner_of(request), *args))


@router.get("/v1/batches/{batch_id}")
async def retrieve_batch(batch_id: str, request: Request) -> JSONResponse:
    return JSONResponse(await link().call("get_batch", owner_of(request), batch_id))


@router.get("/v1/batches")
async def list_batches(
    request: Request,
    after: str | None = None,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
) -> JSONResponse:
    return JSONResponse(await link().call("list_batches", owner_of(request), after, limit))


@router.post("/v1/batches/{batch_id}/cancel")
async def cancel_batch(batch_id: str, request: Request) -> JSONResponse:
    return JSONResponse(await link().call("cancel_batch", owner_of(request), batch_id))

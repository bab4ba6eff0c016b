"""Batches of the OpenAI Batch API, run in the router replica through ``OpenAIServing``.

Each request line goes through the same ``chat_completion`` / ``completion`` as the HTTP
routes, at a low vLLM priority (a larger number, so interactive traffic goes first). Results are
appended line by line to partial files, so a restarted router resumes without redoing or
duplicating finished lines.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from pydantic import ValidationError

from serve_app.batch_api.input import parse_input
from serve_app.batch_api.store import BatchStore, new_id
from serve_app.batch_api.window import expired_line
from serve_app.config import AppConfig
from serve_app.errors import APIError, ErrorInfo, backend_error
from serve_app.openai import chat, completions
from serve_app.openai.limits import check_limits
from serve_app.openai.protocol import ChatCompletionRequest, CompletionRequest
from serve_app.openai.serving import OpenAIServing, RequestStats, ServingFor

logger = logging.getLogger("serve_app.batch_api")

ENDPOINTS = ("/v1/chat/completions", "/v1/completions")
BATCH_PRIORITY = 100  # vLLM: lower runs first; interactive requests default to 0.
COUNTS_EVERY_S = 1.0  # How often a running batch's request_counts are written.


class BatchService:
    """Owns the store and the background tasks of running batches (one router replica)."""

    def __init__(
        self,
        serving: OpenAIServing | ServingFor,
        config: AppConfig,
        store: BatchStore,
        *,
        priority: int = BATCH_PRIORITY,
        max_in_flight: int = 32,
        refresh: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        # Lines name their model: one serving core, or a multi-model app's directory.
        self.serving_for: ServingFor = (
            serving.for_model if isinstance(serving, OpenAIServing) else serving
        )
        self.config, self.store = config, store
        self.priority, self.max_in_flight = priority, max_in_flight
        # Brings runtime LoRA adapters up to date before a line is routed (loads and unloads
        # through other router replicas; at most one store read a second).
        self.refresh = refresh
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._cancelling: set[str] = set()
        self._resumed = False

    def ensure_resumed(self) -> None:
        if self._resumed:
            return
        self._resumed = True
        self.store.sweep_partials()
        for batch in self.store.active_batches():
            logger.info("Resuming batch %s (%s)", batch["id"], batch["status"])
            if batch["status"] == "cancelling":
                self._cancelling.add(batch["id"])
            self.start(batch["id"])

    def start(self, batch_id: str) -> None:
        self._tasks[batch_id] = asyncio.create_task(self._run(batch_id))
        self._tasks[batch_id].add_done_callback(lambda _: self._tasks.pop(batch_id, None))

    async def cancel(self, batch_id: str) -> dict[str, Any]:
        batch = await asyncio.to_thread(
            self.store.update_batch, batch_id, status="cancelling", cancelling_at=_now()
        )
        self._cancelling.add(batch_id)
        task = self._tasks.get(batch_id)
        if task is not None:
            task.cancel()
        else:
            self.start(batch_id)
        return batch

    async def _run(self, batch_id: str) -> None:
        # Every store call runs in a thread: file and SQLite work (fsync included) never
        # holds up the loop that streams interactive responses.
        store, io = self.store, asyncio.to_thread
        try:
            if batch_id in self._cancelling:
                raise asyncio.CancelledError
            batch = await io(store.get_batch, batch_id)
            assert batch is not None
            content = await io(store.file_content, batch["input_file_id"])
            parsed = await io(parse_input, content, batch["endpoint"])
            await io(self._record_rejected, batch_id, parsed.rejected)
            if batch["status"] == "validating":
                await io(store.update_batch, batch_id, status="in_progress", in_progress_at=_now())
            # Batches from before windows were kept have none: OpenAI's 24 h.
            expires_at = batch.get("expires_at") or batch["created_at"] + 24 * 3600
            work = self._process(batch_id, batch["endpoint"], parsed.lines, parsed.total)
            try:
                await asyncio.wait_for(work, max(0.0, expires_at - time.time()))
            except TimeoutError:  # Lines in flight are cancelled (their engine requests too).
                window = batch.get("completion_window", "24h")
                await io(self._expire, batch_id, parsed.lines, window)
                await io(self._finish, batch_id, "expired", "expired_at")
                return
            await io(store.update_batch, batch_id, status="finalizing", finalizing_at=_now())
            await io(self._finish, batch_id, "completed", "completed_at")
        except asyncio.CancelledError:
            if batch_id not in self._cancelling:
                raise  # The replica is stopping: leave the batch active for the next one.
            await asyncio.shield(io(self._finish, batch_id, "cancelled", "cancelled_at"))
        except Exception as exc:
            logger.exception("Batch %s failed", batch_id)
            info = exc.info if isinstance(exc, APIError) else ErrorInfo(repr(exc), 500)
            errors = {"object": "list", "data": [{"code": info.code, "message": info.message}]}
            await io(store.update_batch, batch_id, status="failed", failed_at=_now(), errors=errors)

    def _record_rejected(self, batch_id: str, rejected: list[dict[str, Any]]) -> None:
        """Input lines that cannot run go to the error file once (also across a resume)."""
        written = {
            record["error"].get("line")
            for record in self.store.read_partial(batch_id, "error")
            if record.get("response") is None and record.get("error")
        }
        for problem in rejected:
            if problem["line"] in written:
                continue
            message = f"Line {problem['line']} of the input file: {problem['message']}."
            error = {"code": problem["code"], "message": message, "line": problem["line"]}
            record = {"id": new_id("batch_req"), "custom_id": problem["custom_id"]}
            self.store.append_partial(
                batch_id, "error", record | {"response": None, "error": error}
            )

    async def _process(
        self, batch_id: str, endpoint: str, lines: list[dict[str, Any]], total: int
    ) -> None:
        store, io = self.store, asyncio.to_thread
        done = await io(self._settled, batch_id)
        counts = await io(self._counts, batch_id, total)
        todo = [line for line in lines if line["custom_id"] not in done]
        semaphore = asyncio.Semaphore(self.max_in_flight)
        owner = await io(store.batch_owner, batch_id)  # Its lines share the engine as its key's.
        # Records being written: waited for even when the batch is cut short (cancel, expiry),
        # so what comes next sees every line that ran, and no line is both done and not.
        writes: set[asyncio.Future[None]] = set()
        shown = dict(counts)

        async def one(line: dict[str, Any]) -> None:
            async with semaphore:
                status, body = await self._call(endpoint, line["body"], owner)
            record = {
                "id": new_id("batch_req"),
                "custom_id": line["custom_id"],
                "response": {"status_code": status, "request_id": body.get("id"), "body": body},
                "error": None,
            }
            kind = "output" if status == 200 else "error"
            write = asyncio.ensure_future(io(store.append_partial, batch_id, kind, record))
            writes.add(write)
            write.add_done_callback(writes.discard)
            await asyncio.shield(write)
            counts["completed" if status == 200 else "failed"] += 1

        async def show_counts() -> None:  # At most one batch update a second, not one a line.
            while True:
                await asyncio.sleep(COUNTS_EVERY_S)
                if counts != shown:
                    shown.update(counts)
                    await io(store.update_batch, batch_id, request_counts=dict(shown))

        shower = asyncio.ensure_future(show_counts())
        try:
            await asyncio.gather(*(one(line) for line in todo))
        finally:
            shower.cancel()
            if writes:
                await asyncio.shield(asyncio.gather(*writes))

    def _expire(self, batch_id: str, lines: list[dict[str, Any]], window: str) -> None:
        """Every line that has not run becomes a ``batch_expired`` error line (once)."""
        settled = self._settled(batch_id)
        for line in lines:
            if line["custom_id"] not in settled:
                record = expired_line(new_id("batch_req"), line["custom_id"], window)
                self.store.append_partial(batch_id, "error", record)

    def _settled(self, batch_id: str) -> set[str]:
        """custom_ids of lines that ran, or expired (a rejected line's custom_id may duplicate
        one that runs: it has no response)."""
        return {
            record["custom_id"]
            for kind in ("output", "error")
            for record in self.store.read_partial(batch_id, kind)
            if record.get("response") is not None
            or (record.get("error") or {}).get("code") == "batch_expired"
        }

    def _counts(self, batch_id: str, total: int) -> dict[str, int]:
        ok = len(self.store.read_partial(batch_id, "output"))
        failed = len(self.store.read_partial(batch_id, "error"))
        return {"total": total, "completed": ok, "failed": failed}

    async def _call(
        self, endpoint: str, body: dict[str, Any], owner: str = ""
    ) -> tuple[int, dict[str, Any]]:
        stats = RequestStats(route=endpoint, model=str(body.get("model")))
        stats.tenant = owner
        try:
            work: Any
            if self.refresh is not None:
                await self.refresh()
            serving = self.serving_for(str(body.get("model")))
            if endpoint == "/v1/chat/completions":
                chat_request = ChatCompletionRequest.model_validate(body | {"stream": False})
                check_limits(chat_request, self.config.security.limits)
                self._in_background(chat_request)
                work = chat.chat_completion(serving, chat_request, stats)
            else:
                request = CompletionRequest.model_validate(body | {"stream": False})
                check_limits(request, self.config.security.limits)
                self._in_background(request)
                work = completions.completion(serving, request, stats)
            result = await asyncio.wait_for(work, self.config.request_timeout_s)
            return 200, result.model_dump(mode="json")
        except ValidationError as exc:
            first = exc.errors()[0]
            param = ".".join(str(p) for p in first.get("loc", ()))
            info = ErrorInfo(f"{param}: {first.get('msg')}", param=param, code="invalid_value")
        except TimeoutError:
            info = ErrorInfo("The request timed out.", 504, "server_error", code="timeout")
        except Exception as exc:
            info = backend_error(exc) or ErrorInfo(repr(exc), 500, "server_error")
        return info.status, info.body()

    def _in_background(self, request: ChatCompletionRequest | CompletionRequest) -> None:
        """Batch lines never run ahead of interactive traffic, whatever priority a line asks.

        Raised after validation, so any value the request model accepts (an int, or a string
        the lax model coerces) is clamped, and one it refuses is that line's 400, not a crash
        of the whole batch.
        """
        request.priority = max(self.priority, request.priority)

    def _finish(self, batch_id: str, status: str, stamp: str) -> None:
        """Publish the files, record them with the final status, then drop the partials: a
        crash at any point resumes without running a finished line again."""
        store = self.store
        batch = store.get_batch(batch_id)
        assert batch is not None
        counts = self._counts(batch_id, batch["request_counts"]["total"])
        output = store.publish_partial(batch_id, "output", "batch_output")
        error = store.publish_partial(batch_id, "error", "batch_output")
        store.update_batch(
            batch_id,
            status=status,
            output_file_id=output,
            error_file_id=error,
            request_counts=counts,
            **{stamp: _now()},
        )
        store.drop_partials(batch_id)


def _now() -> int:
    return int(time.time())

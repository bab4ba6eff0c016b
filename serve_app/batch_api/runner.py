"""One batch run by its lease holder: the lines not yet recorded, through the serving path.

Lines go through ``chat_completion`` / ``completion`` exactly as HTTP requests do
(preprocessor, then engine), at the batch priority, under a cap shared by every batch of the
coordinator (``LineSlots``). Finished lines are recorded about once a second; the run stops at
once, aborting the lines in flight, when the batch is cancelled, its completion window ends or
its lease is lost. Each line's request id is derived from the batch and the line, so an engine
that already ran it (for an owner that died) answers a re-submission without running it again.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections import deque
from typing import Any

from serve_app.batch_api.lines import (
    EXPIRED,
    Line,
    LineError,
    error_record,
    output_record,
    parse_request,
    scan,
)
from serve_app.batch_api.store import BatchStore, LeaseLost
from serve_app.config import AppConfig
from serve_app.errors import BACKEND_UNAVAILABLE, APIError, ErrorInfo, backend_error
from serve_app.hops import batch_line_request_id
from serve_app.openai import chat, completions
from serve_app.openai.protocol import ChatCompletionRequest
from serve_app.openai.protocol.responses import dump
from serve_app.openai.serving import OpenAIServing, RequestStats

logger = logging.getLogger("serve_app.batch_api")
RETRIES = 3  # A line the backend could not take (503/429) is retried, then an error line.
LOST = ErrorInfo(
    "The line's request ended without an answer (an internal error); resubmit it.",
    status=500,
    type="server_error",
    code="internal_error",
)


class LineSlots:
    """Background lines in flight over all batches, counted in engine sequences (n × prompts),
    first come first served; a line heavier than the whole cap runs alone."""

    def __init__(self, capacity: int) -> None:
        self.capacity, self.used = capacity, 0
        self._waiting: deque[tuple[int, asyncio.Future[None]]] = deque()

    async def acquire(self, weight: int) -> int:
        weight = min(weight, self.capacity)
        if not self._waiting and self.used + weight <= self.capacity:
            self.used += weight
            return weight
        granted: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiting.append((weight, granted))
        try:
            await granted
        except asyncio.CancelledError:
            if granted.done() and not granted.cancelled():
                self.release(weight)  # Granted just as it was cancelled: give it back.
            else:
                self._waiting.remove((weight, granted))
            raise
        return weight

    def release(self, weight: int) -> None:
        self.used -= weight
        while self._waiting and self.used + self._waiting[0][0] <= self.capacity:
            weight, granted = self._waiting.popleft()
            self.used += weight
            granted.set_result(None)


class BatchRun:
    def __init__(
        self,
        batch: dict[str, Any],
        epoch: int,
        *,
        owner_id: str,
        store: BatchStore,
        serving: OpenAIServing,
        slots: LineSlots,
        config: AppConfig,
    ) -> None:
        self.batch, self.epoch, self.owner_id = batch, epoch, owner_id
        self.id: str = batch["id"]
        # The API key's name: its lines share the engines fairly with its other traffic.
        self.tenant: str = batch.get("_owner", "")
        self.store, self.serving, self.slots, self.config = store, serving, slots, config
        self._pending: list[tuple[int, bool, dict[str, Any]]] = []
        self._finished: set[int] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self._stop: asyncio.Future[str] = asyncio.get_running_loop().create_future()

    def stop(self, reason: str) -> None:
        """cancelled | expired | lost (another coordinator holds it) | ended (failed here):
        the run ends at its next step."""
        if not self._stop.done():
            self._stop.set_result(reason)

    async def run(self) -> None:
        try:
            await self._run()
        except LeaseLost:
            logger.warning("Batch %s: lease lost; another coordinator runs it now", self.id)
        except asyncio.CancelledError:  # This coordinator stops: keep what is finished.
            await self._stop_lines()
            with contextlib.suppress(Exception):
                await asyncio.shield(self._flush())
            raise
        except Exception:
            logger.exception("Batch %s failed", self.id)
            message = "The batch failed on an internal error; see the coordinator's log."
            error = {"code": "internal_error", "message": message, "param": None, "line": None}
            with contextlib.suppress(Exception):
                await asyncio.to_thread(self.store.fail, self.owner_id, self.id, [error])
        finally:
            await self._stop_lines()

    async def _run(self) -> None:
        status = self.batch["status"]
        if status == "cancelling":
            self.stop("cancelled")
        if status != "finalizing" and not self._stop.done():
            await self._run_lines()
        if self._stop.done() and self._stop.result() in ("lost", "ended"):
            return
        if status != "finalizing":
            ends_as = {"cancelled": "cancelled", "expired": "expired"}
            reason = self._stop.result() if self._stop.done() else ""
            await asyncio.to_thread(
                self.store.finalize, self.owner_id, self.id, ends_as.get(reason, "completed")
            )
        batch = await asyncio.to_thread(self.store.publish, self.owner_id, self.id, self.epoch)
        logger.info("Batch %s %s: %s", self.id, batch["status"], batch["request_counts"])

    async def _run_lines(self) -> None:
        store = self.store
        try:
            content = await asyncio.to_thread(store.files.content, self.batch["input_file_id"])
        except OSError:
            message = "The input file is gone (deleted while the batch was queued)."
            error = {"code": "file_not_found", "message": message, "param": "input_file_id"}
            await asyncio.to_thread(store.fail, self.owner_id, self.id, [error | {"line": None}])
            self.stop("ended")
            return
        done = await asyncio.to_thread(store.done_lines, self.id)
        items = await asyncio.to_thread(_todo, content, self.batch["endpoint"], self.config, done)
        del content
        await asyncio.to_thread(store.begin, self.owner_id, self.id)
        lines = [item for item in items if isinstance(item, Line)]
        for item in items:
            if isinstance(item, LineError):
                rec = error_record(self.id, item.number, item.custom_id, item.info, item.answered)
                self._add(item.number, False, rec)
        expires_in = self.batch["expires_at"] - time.time()
        expiry = asyncio.get_running_loop().call_later(max(0, expires_in), self.stop, "expired")
        flusher = asyncio.create_task(self._flush_every(self.config.batch_api.record_interval_s))
        try:
            await self._launch(lines)
            while self._tasks and not self._stop.done():
                waiting: set[asyncio.Future[Any]] = {*self._tasks, self._stop}
                await asyncio.wait(waiting, return_when="FIRST_COMPLETED")
            await self._stop_lines()
            reason = self._stop.result() if self._stop.done() else ""
            if reason in ("", "expired"):
                self._close_gaps(lines, expired=reason == "expired")
        finally:
            expiry.cancel()
            flusher.cancel()
        await self._flush()

    def _close_gaps(self, lines: list[Line], *, expired: bool) -> None:
        """Every line of a batch that ends completed or expired gets a record: the window's
        error for those it cut, and for any other (a line task that ended without an answer,
        a bug) an error line, logged, rather than a silent gap in the output."""
        for line in lines:
            if line.number in self._finished:
                continue
            if not expired:
                logger.error("Batch %s line %d ended without an answer", self.id, line.number)
            self._add(line.number, False, self._record(line, EXPIRED if expired else LOST, False))

    async def _launch(self, lines: list[Line]) -> None:
        for line in lines:
            if self._stop.done():
                return
            acquire = asyncio.ensure_future(self.slots.acquire(line.weight))
            either: set[asyncio.Future[Any]] = {acquire, self._stop}
            await asyncio.wait(either, return_when="FIRST_COMPLETED")
            if not acquire.done():
                acquire.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await acquire
                return
            weight = acquire.result()
            if self._stop.done():
                self.slots.release(weight)
                return
            task = asyncio.create_task(self._line(line, weight))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _stop_lines(self) -> None:
        """Abort the lines in flight (their engine requests are aborted too)."""
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _line(self, line: Line, weight: int) -> None:
        try:
            answer = await self._call(line)
        finally:
            self.slots.release(weight)
        if isinstance(answer, ErrorInfo):
            self._add(line.number, False, self._record(line, answer, True))
        else:
            self._add(line.number, True, output_record(self.id, line, answer))

    def _record(self, line: Line, info: ErrorInfo, answered: bool) -> dict[str, Any]:
        return error_record(self.id, line.number, line.custom_id, info, answered)

    def _add(self, number: int, ok: bool, record: dict[str, Any]) -> None:
        self._finished.add(number)
        self._pending.append((number, ok, record))

    async def _call(self, line: Line) -> dict[str, Any] | ErrorInfo:
        """The response body of one line, or the error the endpoint answered."""
        endpoint = self.batch["endpoint"]
        request = parse_request(endpoint, json.loads(line.raw)["body"])
        request.priority = max(self.config.batch_api.priority, request.priority)
        prefix = "chatcmpl" if isinstance(request, ChatCompletionRequest) else "cmpl"
        request_id = batch_line_request_id(prefix, self.id, line.number)
        timeout = self.config.request_timeout_s
        for attempt in range(RETRIES + 1):
            stats = RequestStats(endpoint, self.serving.model_name, tenant=self.tenant)
            try:
                if isinstance(request, ChatCompletionRequest):
                    work: Any = chat.chat_completion(self.serving, request, stats, request_id)
                else:
                    work = completions.completion(self.serving, request, stats, request_id)
                return dump(await asyncio.wait_for(work, timeout))
            except TimeoutError:
                info = ErrorInfo("The request timed out.", 504, "server_error", code="timeout")
            except asyncio.CancelledError:
                task = asyncio.current_task()
                if task is None or task.cancelling():
                    raise  # This run stops: the line is aborted with it.
                # Cancelled under us, not by us (a replica aborted the call): the backend's
                # doing, so retry it like a 503; it must never end the line unrecorded.
                logger.warning(
                    "Batch %s line %d: call cancelled by the backend", self.id, line.number
                )
                info = BACKEND_UNAVAILABLE
            except APIError as exc:
                info = exc.info
            except Exception as exc:
                info = backend_error(exc) or ErrorInfo(repr(exc), 500, "server_error")
            if info.status not in (429, 503) or attempt == RETRIES:
                break
            await asyncio.sleep(2**attempt)  # The backend is restarting or full.
        return info

    async def _flush_every(self, interval_s: float) -> None:
        while True:
            await asyncio.sleep(interval_s)
            try:
                await self._flush()
            except LeaseLost:
                self.stop("lost")
                return
            except Exception:  # The disk or database hiccuped: the lines wait for the next.
                logger.exception("Batch %s: recording finished lines failed", self.id)

    async def _flush(self) -> None:
        if not self._pending:
            return
        pending, self._pending = self._pending, []
        try:
            await asyncio.to_thread(self.store.record, self.owner_id, self.id, pending)
        except LeaseLost:
            raise
        except Exception:
            self._pending = pending + self._pending  # Try again on the next flush.
            raise


def _todo(content: bytes, endpoint: str, config: AppConfig, done: set[int]) -> list[Any]:
    """The input's lines (requests and error lines) not recorded yet."""
    return [item for item in scan(content, endpoint, config) if item.number not in done]

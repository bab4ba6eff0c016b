"""Batches of the OpenAI Batch API, run in the batch coordinator through ``OpenAIServing``.

Each request line goes through the same ``chat_completion`` / ``completion`` as the HTTP
routes, at a low vLLM priority (a larger number, so interactive traffic goes first). Results are
appended line by line to partial files, so a restarted coordinator resumes without redoing or
duplicating finished lines. A batch runs in one process at a time: the one holding its lease
(``leases``), which a successor (or a second process on the same store) takes over once it lapses.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from serve_app.batch_api.input import parse_input
from serve_app.batch_api.lines import CURRENT_LINE, run_line
from serve_app.batch_api.store import BatchStore, LeaseLost, new_id
from serve_app.config import AppConfig
from serve_app.errors import APIError, ErrorInfo
from serve_app.openai.serving import OpenAIServing, ServingFor

logger = logging.getLogger("serve_app.batch_api")

ENDPOINTS = ("/v1/chat/completions", "/v1/completions")
BATCH_PRIORITY = 100  # vLLM: lower runs first; interactive requests default to 0.
COUNTS_EVERY_S = 1.0  # How often a running batch's request_counts are written.
RENEWALS_PER_LEASE = 6  # A lease is renewed (and orphans looked for) this often per lease_s,
TEND_EVERY_S = 1.0  # and at least once a second: a cancel through any replica acts in 1 s.


class BatchService:
    """Owns the store and the background tasks of running batches (one coordinator process)."""

    def __init__(
        self,
        serving: OpenAIServing | ServingFor,
        config: AppConfig,
        store: BatchStore,
        *,
        priority: int = BATCH_PRIORITY,
        max_in_flight: int = 32,
        refresh: Callable[[], Awaitable[None]] | None = None,
        lease_s: float | None = None,
    ) -> None:
        # Lines name their model: one serving core, or a multi-model app's directory.
        self.serving_for: ServingFor = (
            serving.for_model if isinstance(serving, OpenAIServing) else serving
        )
        self.config, self.store = config, store
        self.priority, self.max_in_flight = priority, max_in_flight
        # Brings runtime LoRA adapters up to date before a line is routed (loads and unloads
        # through any router replica; at most one store read a second).
        self.refresh = refresh
        self.lease_s = lease_s or config.batch_api.lease_s
        # Unique per service, not per host: a restarted replica must not pass for its old self.
        self.holder = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._cancelling: set[str] = set()
        self._lost: set[str] = set()  # Taken over by another replica: stopped, not finished.
        self._keeper: asyncio.Task[None] | None = None

    def ensure_resumed(self) -> None:
        """Start tending leases: renew this replica's, take over lapsed ones (at once too)."""
        if self._keeper is None:
            self.store.sweep_partials()
            self._keeper = asyncio.create_task(self._keep())

    def start(self, batch_id: str) -> None:
        """Run a batch whose lease this replica holds."""
        self._tasks[batch_id] = asyncio.create_task(self._run(batch_id))
        self._tasks[batch_id].add_done_callback(lambda _: self._tasks.pop(batch_id, None))

    async def cancel(self, batch_id: str) -> dict[str, Any] | None:
        """Mark it cancelling (None if it is past that) and stop it here if it runs here, or
        take it over to finish it if its lease lapsed; a replica running it stops it at its
        next renewal."""
        batch = await asyncio.to_thread(
            self.store.update_batch,
            batch_id,
            expect=("validating", "in_progress"),
            status="cancelling",
            cancelling_at=_now(),
        )
        if batch is None:
            return None
        task = self._tasks.get(batch_id)
        if task is not None:
            self._cancelling.add(batch_id)
            task.cancel()
        elif await asyncio.to_thread(self.store.leases.claim, batch_id, self.holder, self.lease_s):
            self.start(batch_id)
        return batch

    async def _keep(self) -> None:
        while True:
            try:
                await self._tend()
            except Exception:  # E.g. the store briefly locked: the next round tries again.
                logger.exception("Tending batch leases failed")
            await asyncio.sleep(min(TEND_EVERY_S, self.lease_s / RENEWALS_PER_LEASE))

    async def _tend(self) -> None:
        leases, io = self.store.leases, asyncio.to_thread
        held = await io(leases.renew, list(self._tasks), self.holder, self.lease_s)
        for batch_id, task in list(self._tasks.items()):
            status = held.get(batch_id)
            if status is None:
                logger.warning("Batch %s was taken over by another replica; stopping", batch_id)
                self._lost.add(batch_id)
                task.cancel()
            elif status == "cancelling" and batch_id not in self._cancelling:
                self._cancelling.add(batch_id)
                task.cancel()
        for batch_id in await io(leases.orphans):
            if batch_id not in self._tasks and await io(
                leases.claim, batch_id, self.holder, self.lease_s
            ):
                logger.info("Taking over batch %s (its lease lapsed)", batch_id)
                self.start(batch_id)

    async def _run(self, batch_id: str) -> None:
        # Every store call runs in a thread: file and SQLite work (fsync included) never
        # holds up the loop that streams interactive responses.
        store, io, holder = self.store, asyncio.to_thread, self.holder
        try:
            batch = await io(store.get_batch, batch_id)
            assert batch is not None
            if batch["status"] == "cancelling" or batch_id in self._cancelling:
                self._cancelling.add(batch_id)
                raise asyncio.CancelledError
            content = await io(store.file_content, batch["input_file_id"])
            parsed = await io(parse_input, content, batch["endpoint"])
            await io(store.record_rejected, batch_id, parsed.rejected)
            if batch["status"] == "validating":
                await self._advance(batch_id, "validating", "in_progress")
            # Batches from before windows were kept have none: OpenAI's 24 h.
            expires_at = batch.get("expires_at") or batch["created_at"] + 24 * 3600
            work = self._process(
                batch_id, batch["endpoint"], parsed.lines, parsed.total, parsed.numbers
            )
            try:
                await asyncio.wait_for(work, max(0.0, expires_at - time.time()))
            except TimeoutError:  # Lines in flight are cancelled (their engine requests too).
                window = batch.get("completion_window", "24h")
                await io(store.expire_unsettled, batch_id, parsed.lines, window)
                await io(self._finish, batch_id, "expired", "expired_at")
                return
            await self._advance(batch_id, "in_progress", "finalizing")
            await io(self._finish, batch_id, "completed", "completed_at")
        except asyncio.CancelledError:
            if batch_id in self._lost:
                return  # Another replica runs it now.
            if batch_id not in self._cancelling:
                raise  # The replica is stopping: the batch's lease lapses to another one.
            with contextlib.suppress(LeaseLost):
                await asyncio.shield(io(self._finish, batch_id, "cancelled", "cancelled_at"))
        except LeaseLost:
            logger.warning("Batch %s was taken over by another replica; stopped", batch_id)
        except Exception as exc:
            logger.exception("Batch %s failed", batch_id)
            info = exc.info if isinstance(exc, APIError) else ErrorInfo(repr(exc), 500)
            errors = {"object": "list", "data": [{"code": info.code, "message": info.message}]}
            with contextlib.suppress(LeaseLost):
                await io(
                    store.update_batch,
                    batch_id,
                    holder=holder,
                    status="failed",
                    failed_at=_now(),
                    errors=errors,
                )
        finally:
            self._lost.discard(batch_id)
            self._cancelling.discard(batch_id)

    async def _advance(self, batch_id: str, status: str, to: str) -> None:
        """``status`` → ``to`` under the lease, unless a cancel (through any replica) came
        first: then the batch is cancelled."""
        moved = await asyncio.to_thread(
            self.store.update_batch,
            batch_id,
            holder=self.holder,
            expect=(status, to),  # Already there: resumed after a crash.
            status=to,
            **{f"{to}_at": _now()},
        )
        if moved is None:
            self._cancelling.add(batch_id)
            raise asyncio.CancelledError

    async def _process(
        self,
        batch_id: str,
        endpoint: str,
        lines: list[dict[str, Any]],
        total: int,
        numbers: dict[str, int] | None = None,
    ) -> None:
        """Run the lines not yet settled; ``numbers``: each custom_id's line in the input."""
        store, io = self.store, asyncio.to_thread
        done = await io(store.settled, batch_id)
        counts = await io(store.counts, batch_id, total)
        todo = [line for line in lines if line["custom_id"] not in done]
        semaphore = asyncio.Semaphore(self.max_in_flight)
        owner = await io(store.batch_owner, batch_id)  # Its lines share the engine as its key's.
        # Records being written: waited for even when the batch is cut short (cancel, expiry),
        # so what comes next sees every line that ran, and no line is both done and not.
        writes: set[asyncio.Future[None]] = set()
        shown = dict(counts)

        async def one(line: dict[str, Any]) -> None:
            CURRENT_LINE.set((batch_id, line["custom_id"]))  # This task's own context: its trace.
            async with semaphore:
                status, body = await self._call(endpoint, line["body"], owner)
            record = {
                "id": new_id("batch_req"),
                "custom_id": line["custom_id"],
                "response": {"status_code": status, "request_id": body.get("id"), "body": body},
                "error": None,
            }
            if status != 200:  # Also where in the input it was, as for lines that never ran.
                error = body.get("error") or {}
                record["error"] = {
                    "code": error.get("code") or error.get("type"),
                    "message": error.get("message"),
                    "line": (numbers or {}).get(line["custom_id"]),
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
                    with contextlib.suppress(LeaseLost):  # The batch stops at the renewal.
                        await io(
                            store.update_batch,
                            batch_id,
                            holder=self.holder,
                            request_counts=dict(shown),
                        )

        shower = asyncio.ensure_future(show_counts())
        try:
            await asyncio.gather(*(one(line) for line in todo))
        finally:
            shower.cancel()
            if writes:
                await asyncio.shield(asyncio.gather(*writes))

    async def _call(
        self, endpoint: str, body: dict[str, Any], owner: str = ""
    ) -> tuple[int, dict[str, Any]]:
        return await run_line(
            self.serving_for,
            self.config,
            endpoint,
            body,
            owner=owner,
            priority=self.priority,
            refresh=self.refresh,
        )

    def _finish(self, batch_id: str, status: str, stamp: str) -> None:
        """Publish the files, record them with the final status, then drop the partials: a
        crash at any point resumes without running a finished line again."""
        store = self.store
        if batch_id not in store.leases.renew([batch_id], self.holder, self.lease_s):
            raise LeaseLost(batch_id)  # Woke from a hang: the successor finishes it.
        batch = store.get_batch(batch_id)
        assert batch is not None
        store.dedupe(batch_id)
        counts = store.counts(batch_id, batch["request_counts"]["total"])
        output = store.publish_partial(batch_id, "output", "batch_output")
        error = store.publish_partial(batch_id, "error", "batch_output")
        record: dict[str, Any] = {"output_file_id": output, "error_file_id": error, stamp: _now()}
        store.update_batch(
            batch_id, holder=self.holder, status=status, request_counts=counts, **record
        )
        store.drop_partials(batch_id)


def _now() -> int:
    return int(time.time())

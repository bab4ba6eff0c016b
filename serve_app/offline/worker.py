"""The Ray Data UDF: one actor holds the serving ``Preprocessor`` and ``VLLMEngine``.

``map_batches`` hands it a batch of input rows; every valid row is tokenized in one
``preprocess_batch`` call and all of them run through the engine concurrently (vLLM batches
them), on an event loop the actor keeps in a background thread. ``__call__`` is a coroutine, so
Ray Data can hand one actor several batches at once: the next batch's rows join the engine while
the last rows of the previous one finish, instead of the engine idling through every batch's tail.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import uuid
from typing import Any

import pyarrow as pa

from serve_app.engine.vllm_engine import Engine
from serve_app.errors import APIError
from serve_app.hops import EngineRequest, PreprocessRequest, PreprocessResult
from serve_app.offline.input_files import PROBLEM_COLUMN, decode_rows
from serve_app.offline.output import OUTPUT_SCHEMA
from serve_app.offline.rows import JobConfig, RowError, build_request, error_row, row_id

logger = logging.getLogger("serve_app.batch")


class EngineWorker:
    """Callable class for ``Dataset.map_batches`` (pyarrow batches in and out)."""

    def __init__(self, job: JobConfig) -> None:
        from serve_app.engine.vllm_engine import VLLMEngine
        from serve_app.models import resolve_model
        from serve_app.preprocess.preprocessor import Preprocessor

        self.job = job
        path = resolve_model(job.app_config.model.name)
        self.preprocessor = Preprocessor(job.app_config, path)
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()
        self.engine: Engine
        if job.engine_in_process():
            from serve_app.offline.inproc_engine import InProcessEngine

            self.engine = InProcessEngine(job.app_config, path)
        else:
            self.engine = VLLMEngine(job.app_config, path, offline=True)

    async def __call__(self, batch: pa.Table) -> pa.Table:
        rows = decode_rows(batch, self.job.id_column)
        # The engine lives on its own loop (built with it); Ray Data's loop only waits here.
        done = asyncio.run_coroutine_threadsafe(self.process(rows), self.loop)
        results = await asyncio.wrap_future(done)
        return pa.Table.from_pylist(results, schema=OUTPUT_SCHEMA)

    async def process(self, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """One output row per input row, in order; errors are values, never exceptions."""
        out: list[dict[str, Any] | None] = [None] * len(rows)
        requests: list[tuple[int, str, PreprocessRequest]] = []
        for i, row in enumerate(rows):
            rid = row_id(row, self.job.id_column)
            if (problem := row.get(PROBLEM_COLUMN)) is not None:  # A bad line of the input.
                out[i] = error_row(rid, problem)
                continue
            if rid is None:
                out[i] = error_row(None, f"missing id column {self.job.id_column!r}")
                continue
            try:
                request = build_request(self.job, row, f"batch-{uuid.uuid4().hex}")
            except RowError as exc:
                out[i] = error_row(rid, str(exc))
                continue
            requests.append((i, rid, request))
        results = await asyncio.to_thread(
            self.preprocessor.preprocess_batch, [r for _, _, r in requests]
        )
        pending = []
        for (i, rid, request), result in zip(requests, results, strict=True):
            if result.error is not None:
                out[i] = error_row(rid, result.error.message)
            else:
                pending.append((i, rid, request, result))
        generated = await asyncio.gather(
            *(self._generate(rid, request, result) for _, rid, request, result in pending)
        )
        for (i, *_), row in zip(pending, generated, strict=True):
            out[i] = row
        return [row for row in out if row is not None]

    async def _generate(
        self, rid: str, request: PreprocessRequest, result: PreprocessResult
    ) -> dict[str, Any]:
        assert result.sampling is not None
        engine_request = EngineRequest(
            request_id=request.request_id,
            prompt_token_ids=result.prompts[0].token_ids,
            sampling=result.sampling,
            stream=False,  # One final output per row, not one per token (as LLM.generate).
            lora=self.job.lora(request.adapter),
        )
        text: list[str] = []
        tokens, finish = 0, None
        try:
            async for step in self.engine.generate(engine_request):
                for chunk in step.chunks:
                    text.append(chunk.text)
                    tokens += len(chunk.token_ids)
                    finish = chunk.finish_reason or finish
        except APIError as exc:
            return error_row(rid, str(exc))
        except Exception as exc:  # One row's engine failure must not fail its batch.
            logger.exception("row %s failed", rid)
            return error_row(rid, f"{type(exc).__name__}: {exc}")
        return {
            "id": rid,
            "output": "".join(text),
            "prompt_tokens": len(engine_request.prompt_token_ids),
            "completion_tokens": tokens,
            "finish_reason": finish,
            "error": None,
        }

    def __del__(self) -> None:
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()

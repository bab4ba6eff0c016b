"""An offline job's CPU engine: vLLM's scheduler, model and detokenizer in the actor's process.

vLLM's default on a CPU host is three processes per engine: the caller, the engine core (the
scheduler) and the model worker, and the engine core busy-waits on the worker's every step. On a
small box that spinning core and the inter-process traffic cost more than they overlap, and each
process imports vLLM and torch again at start (~8 s each on 2 cores). Here one thread owns a
synchronous ``LLMEngine`` with its engine core and worker in-process (vLLM's uniprocess
executor), so its model threads bind to their cores and every other core stays free for Ray
Data. Measured with vLLM's own ``LLM.chat`` on 1,000 rows, 2 cores: 59 s default, 31 s
in-process. GPU engines keep ``VLLMEngine`` (``AsyncLLM``): there a separate engine core
schedules the next step while the GPU runs this one.

The engine is not thread-safe: every call runs on the engine thread, which takes submissions
from a queue between steps and blocks on it when idle.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import os
import queue
import threading
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, replace
from typing import Any

from serve_app.config import AppConfig
from serve_app.engine import cpu_pinning
from serve_app.engine.lora_requests import LoraRequests
from serve_app.errors import APIError
from serve_app.hops import EngineRequest, EngineStep

logger = logging.getLogger("serve_app.batch")
# vLLM on CPU turns its uniprocess executor into the multiprocess one unless this is "0".
IN_PROCESS_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


@dataclass
class _Submit:
    request: EngineRequest
    done: concurrent.futures.Future[EngineStep]


@dataclass
class _Abort:
    request_id: str


_STOP = object()


class InProcessEngine:
    """``generate`` yields one final ``EngineStep`` per request (offline rows need no deltas)."""

    def __init__(self, config: AppConfig, model_path: str) -> None:
        self._inbox: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._pending: dict[str, _Submit] = {}
        self._dead: BaseException | None = None
        self._stopped = False
        self._loras = LoraRequests(config.model.uses_lora)
        started: concurrent.futures.Future[None] = concurrent.futures.Future()
        # The engine is built on the thread that steps it: OpenMP binds that thread's team.
        self._thread = threading.Thread(
            target=self._run, args=(config, model_path, started), name="vllm-engine", daemon=True
        )
        self._thread.start()
        started.result()

    async def generate(self, request: EngineRequest) -> AsyncIterator[EngineStep]:
        if self._dead is not None:
            raise APIError(f"the engine failed: {self._dead}", status=503, type="server_error")
        if self._stopped:  # Nothing would ever answer.
            raise APIError("the engine was shut down", status=503, type="server_error")
        done: concurrent.futures.Future[EngineStep] = concurrent.futures.Future()
        self._inbox.put(_Submit(request, done))
        try:
            yield await asyncio.wrap_future(done)
        except asyncio.CancelledError:
            self._inbox.put(_Abort(request.request_id))
            raise

    def num_unfinished(self) -> int:
        return len(self._pending)

    async def abort(self, request_id: str) -> None:
        self._inbox.put(_Abort(request_id))

    async def check_health(self) -> None:
        if self._dead is not None or not self._thread.is_alive():
            raise RuntimeError(f"the in-process engine stopped: {self._dead}")

    def shutdown(self) -> None:
        self._stopped = True
        self._inbox.put(_STOP)

    def _run(self, config: AppConfig, model_path: str, started: concurrent.futures.Future) -> None:
        try:
            engine = _build(config, model_path)
        except BaseException as exc:
            started.set_exception(exc)
            return
        started.set_result(None)
        try:
            self._loop(engine)
        except BaseException as exc:  # A failed step fails every row in flight, not the actor.
            logger.exception("the in-process engine failed")
            self._dead = exc
            for submit in self._pending.values():
                submit.done.set_exception(exc)
            self._pending.clear()
            self._drain_after_death(exc)

    def _loop(self, engine: Any) -> None:
        from serve_app.engine.vllm_engine import to_engine_step

        while True:
            # Block only when the engine has nothing to step.
            block = not engine.has_unfinished_requests()
            while True:
                try:
                    item = self._inbox.get(block=block)
                except queue.Empty:
                    break
                block = False
                if item is _STOP:
                    return
                self._handle(engine, item)
            if not engine.has_unfinished_requests():
                continue
            for output in engine.step():
                submit = self._pending.get(output.request_id)
                if submit is not None and output.finished:
                    del self._pending[output.request_id]
                    submit.done.set_result(to_engine_step(output, submit.request))

    def _handle(self, engine: Any, item: _Submit | _Abort) -> None:
        from vllm.exceptions import VLLMClientError
        from vllm.inputs import TokensPrompt

        from serve_app.engine.vllm_engine import to_sampling_params

        if isinstance(item, _Abort):
            if self._pending.pop(item.request_id, None) is not None:
                engine.abort_request([item.request_id])
            return
        request = item.request
        try:
            engine.add_request(
                request.request_id,
                TokensPrompt(prompt_token_ids=request.prompt_token_ids),
                to_sampling_params(replace(request, stream=False)),  # Finished outputs only.
                lora_request=self._loras.get(request.lora),
                priority=request.priority,
            )
        except (ValueError, VLLMClientError) as exc:  # vLLM's checks of this one request.
            item.done.set_exception(APIError(str(exc), param=getattr(exc, "parameter", None)))
            return
        except APIError as exc:  # A LoRA adapter on an engine without LoRA.
            item.done.set_exception(exc)
            return
        except Exception as exc:  # Raised before the request reached the scheduler: its row fails.
            item.done.set_exception(exc)
            return
        self._pending[request.request_id] = item

    def _drain_after_death(self, exc: BaseException) -> None:
        while True:
            item = self._inbox.get()
            if item is _STOP:
                return
            if isinstance(item, _Submit):
                item.done.set_exception(exc)


def _build(config: AppConfig, model_path: str) -> Any:
    import torch
    from vllm.engine.arg_utils import EngineArgs
    from vllm.usage.usage_lib import UsageContext
    from vllm.v1.engine.llm_engine import LLMEngine

    from serve_app.engine.engine_args import engine_args, vllm_engine_args

    # No engine core spins on a core of its own here, so the model may use every core (Ray
    # starts actors with OMP_NUM_THREADS=1 when they ask for less than one CPU). Binding this
    # thread binds the OpenMP threads it starts; Ray's own threads keep their cores.
    cores, bind = cpu_pinning.in_process_cores(config.engine.cpu_threads_bind)
    if bind:
        os.sched_setaffinity(0, cores)
    torch.set_num_threads(len(cores))
    kwargs = engine_args(config, model_path)
    logger.info("Starting an in-process vLLM LLMEngine with %s", kwargs)
    args = vllm_engine_args(
        kwargs,
        EngineArgs,
        distributed_executor_backend="uni",
        disable_log_stats=True,  # As vLLM's offline LLM class.
    )
    with _build_environ(config.engine.runtime_env_vars() | IN_PROCESS_ENV):
        return LLMEngine.from_engine_args(args, usage_context=UsageContext.LLM_CLASS)


@contextlib.contextmanager
def _build_environ(env: dict[str, str]) -> Iterator[None]:
    """The engine's variables while vLLM builds it (e.g. VLLM_CPU_KVCACHE_SPACE: without it
    vLLM's CPU backend takes 90 % of RAM for KV cache), and this process's environment back
    afterwards: vLLM also sets LD_PRELOAD (tcmalloc, libgomp) for the engine processes it would
    spawn, which must not reach processes started from here later."""
    before = dict(os.environ)
    os.environ.update(env)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(before)

"""The limit: vLLM ``AsyncLLM`` in this process, no HTTP, no Ray, same engine args and phases.

``python -m loadtest.inproc job.json out.json``; the bench starts it as a subprocess so the
engine is started and stopped cleanly. Bodies are the same OpenAI chat bodies the HTTP targets
get; the chat template is rendered by our ``Preprocessor`` (same tokenizer, same template).
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from loadtest.client import RequestRecord
from loadtest.shapes import Send
from loadtest.suite import Phase, run_phases


def sampling(body: dict[str, Any]) -> Any:
    from serve_app.hops import SamplingSpec, StructuredSpec

    structured = None
    fmt = body.get("response_format") or {}
    if fmt.get("type") == "json_schema":
        structured = StructuredSpec("json", fmt["json_schema"]["schema"], "response_format")
    return SamplingSpec(
        max_tokens=int(body["max_tokens"]),
        temperature=float(body.get("temperature", 1.0)),
        ignore_eos=bool(body.get("ignore_eos", False)),
        structured=structured,
    )


def make_send(engine: Any, preprocessor: Any) -> Send:
    from serve_app.hops import EngineRequest, PreprocessRequest

    counter = iter(range(1 << 62))

    async def send(body: dict[str, Any]) -> RequestRecord:
        start = time.perf_counter()
        n = next(counter)
        spec = sampling(body)
        [pre] = preprocessor.preprocess_batch(
            [PreprocessRequest(f"r{n}", "chat", spec, messages=body["messages"])]
        )
        if pre.error is not None:
            return RequestRecord(False, 400, error=str(pre.error)[:300])
        ids = list(pre.prompts[0].token_ids)
        request = EngineRequest(f"inproc-{n}-{time.time_ns()}", ids, pre.sampling or spec)
        first = last = 0.0
        itl: list[float] = []
        tokens = cached = 0
        try:
            async for step in engine.generate(request):
                got = sum(len(c.token_ids) for c in step.chunks)
                cached = step.cached_tokens or cached
                if got:
                    now = time.perf_counter()
                    if first == 0.0:
                        first = now
                    else:
                        itl.append(now - last)
                    last, tokens = now, tokens + got
        except Exception as exc:  # one failed request never stops the run
            return RequestRecord(
                False, 500, latency_s=time.perf_counter() - start, error=repr(exc)[:300]
            )
        end = time.perf_counter()
        return RequestRecord(
            True,
            200,
            ttft_s=(first or end) - start,
            latency_s=end - start,
            output_tokens=tokens,
            prompt_tokens=len(ids),
            cached_tokens=cached,
            itl_s=itl,
        )

    return send


async def run(job: dict[str, Any]) -> dict[str, Any]:
    from serve_app.config import AppConfig
    from serve_app.engine.vllm_engine import VLLMEngine
    from serve_app.models import resolve_model
    from serve_app.preprocess.preprocessor import Preprocessor

    config = AppConfig.model_validate(job["app_args"])
    os.environ.update(config.engine.runtime_env_vars())
    path = resolve_model(config.model.name)
    t0 = time.perf_counter()
    engine = VLLMEngine(config, path)
    startup_s = time.perf_counter() - t0
    try:
        phases = [Phase(**p) for p in job["phases"]]
        send = make_send(engine, Preprocessor(config, path))
        results = await run_phases(send, phases, job["model"], job["seed"], job["budget_s"])
    finally:
        engine.shutdown()
    return {"startup_s": startup_s, "engine_args": engine.resolved_args, "phases": results}


def main(argv: list[str] | None = None) -> int:
    job_path, out_path = (argv or sys.argv[1:])[:2]
    job = json.loads(Path(job_path).read_text())
    out = asyncio.run(run(job))
    Path(out_path).write_text(json.dumps(out, default=str))
    sys.stdout.flush()
    sys.stderr.flush()
    # vLLM can leave non-daemon threads behind after shutdown; the results are written.
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())

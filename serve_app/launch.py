"""Start a Serve config file locally, wait until it answers, print where it listens.

``python -m serve_app.launch serve_config.cpu.yaml`` is what ``make serve`` runs; tests use
``start`` with the same code path. The Ray dashboard binds to localhost only.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import yaml

from serve_app.config.cores import core_list
from serve_app.engine import cpu_pinning

# The cores init_local_ray confines its Ray cluster to once the apps answer (None: no split).
_ray_cores: list[int] | None = None


def load_serve_config(path: str | Path) -> dict[str, Any]:
    data = yaml.safe_load(Path(path).read_text())
    if not isinstance(data, dict) or not data.get("applications"):
        raise SystemExit(f"{path}: not a Serve config (needs an `applications:` list)")
    return data


def wait_ready(base_url: str, timeout_s: float = 600) -> dict[str, Any]:
    """Poll /v1/models until the whole graph (router → preprocessor) answers; then confine
    the Ray cluster this process started (if its engines split the cores) to its cores."""
    deadline = time.monotonic() + timeout_s
    last_error = "no answer yet"
    while time.monotonic() < deadline:
        try:
            response = httpx.get(f"{base_url}/v1/models", timeout=10)
            if response.status_code == 200:
                if _ray_cores:
                    _confine_when_running(_ray_cores, deadline)
                return dict(response.json())
            last_error = f"HTTP {response.status_code}: {response.text[:200]}"
        except httpx.HTTPError as exc:
            last_error = str(exc)
        time.sleep(1)
    raise TimeoutError(f"{base_url} not ready after {timeout_s:.0f} s: {last_error}")


def _confine_when_running(cores: list[int], deadline: float) -> None:
    """Confine Ray to ``cores`` once every app's replicas are up: an engine replica still
    starting runs vLLM's import and processes on every core until then."""
    from ray import serve

    while time.monotonic() < deadline:
        statuses = [app.status for app in serve.status().applications.values()]
        if all(status in ("RUNNING", "DEPLOY_FAILED", "UNHEALTHY") for status in statuses):
            break
        time.sleep(1)
    cpu_pinning.confine_ray(cores)


def start(
    serve_config: dict[str, Any],
    *,
    host: str | None = None,
    port: int | None = None,
    overrides: dict[str, Any] | None = None,
) -> list[str]:
    """Start Ray (if needed) and every application in the config; return their base URLs."""
    import ray
    from ray import serve

    from serve_app import build_app

    http = dict(serve_config.get("http_options") or {})
    host = host or http.get("host", "127.0.0.1")
    port = port or int(http.get("port", 8000))
    apps = [_merge(app.get("args") or {}, overrides or {}) for app in serve_config["applications"]]
    if not ray.is_initialized():
        init_local_ray(apps)
    serve.start(http_options={"host": host, "port": port})
    urls = []
    for app, args in zip(serve_config["applications"], apps, strict=True):
        prefix = app.get("route_prefix", "/")
        serve.run(
            build_app(args), name=app.get("name", "default"), route_prefix=prefix, blocking=False
        )
        urls.append(
            f"http://{'127.0.0.1' if host == '0.0.0.0' else host}:{port}{prefix.rstrip('/')}"
        )
    return urls


def init_local_ray(apps: list[dict[str, Any]], *, dashboard: bool = True) -> None:
    """A new single-machine Ray cluster tuned for serving these apps' args blocks."""
    import ray

    # Serve's data-plane fast path (gRPC between replicas, no extra thread hops); read by
    # every Ray process at start, so it must be in the environment Ray inherits.
    os.environ.setdefault("RAY_SERVE_THROUGHPUT_OPTIMIZED", "1")
    # Its direct ingress keeps a stopping router 30 s for an external load balancer to
    # notice; here Serve's own proxy is the only one, told at once.
    os.environ.setdefault("RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S", "2")
    from serve_app.config import AppConfig

    global _ray_cores
    _ray_cores = cpu_pinning.ray_cores([AppConfig.model_validate(args).engine for args in apps])
    if _ray_cores:  # Ray starts on every core; wait_ready confines it once the apps answer.
        os.environ[cpu_pinning.RAY_CORES_ENV] = core_list(_ray_cores)
    try:
        # address="local": always a new local cluster, never one some other process started.
        ray.init(
            address="local",
            include_dashboard=dashboard,
            dashboard_host="127.0.0.1",
            log_to_driver=False,
        )
    finally:  # Ray's processes have it; engines run in this process itself are not split.
        os.environ.pop(cpu_pinning.RAY_CORES_ENV, None)


def _merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in extra.items():
        out[key] = (
            _merge(out[key], value)
            if isinstance(value, dict) and isinstance(out.get(key), dict)
            else value
        )
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config", nargs="?", default="serve_config.cpu.yaml")
    parser.add_argument("--port", type=int, default=None)
    parser.add_argument("--host", default=None)
    args = parser.parse_args(argv)
    serve_config = load_serve_config(args.config)
    print(
        f"Starting {args.config} (first start prepares the model and the engine; ~1 min)…",
        flush=True,
    )
    urls = start(serve_config, host=args.host, port=args.port)
    for url in urls:
        models = wait_ready(url)
        names = ", ".join(m["id"] for m in models["data"])
        print(f"\nReady: OpenAI API at {url}/v1 (model: {names})", flush=True)
    print("Ray dashboard (localhost only): http://127.0.0.1:8265", flush=True)
    print("Press Ctrl-C to stop.", flush=True)
    stop = threading.Event()
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    stop.wait()
    print("Shutting down…", flush=True)
    from ray import serve

    serve.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Where start-up goes: our app from nothing to its first answer, next to ``vllm serve``.

``python -m loadtest.startup [--config serve_config.cpu.yaml] [--no-vllm]``

Ours runs in this process (the same ``serve_app.launch.start`` as ``make serve``), so each
phase is stamped where it happens: Ray's start, Serve's start, the app's submission, every
deployment's first RUNNING replica (polled every 0.2 s), the engine replica's own stamps (its
actor start, vLLM's import, the engine built: model load, KV cache, warm-up), the first
answer. ``vllm serve`` runs with the same engine arguments in a subprocess, timed from launch
to its first answer.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]


def _chat(url: str, model: str) -> bool:
    body = {"model": model, "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]}
    try:
        return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=30).status_code == 200
    except httpx.HTTPError:
        return False


def _watch_running(app: str, seen: dict[str, float], stop: threading.Event) -> None:
    """The first time each deployment of ``app`` has a RUNNING replica."""
    from ray import serve

    while not stop.is_set():
        try:
            status = serve.status().applications.get(app)
            for name, deployment in (status.deployments if status else {}).items():
                running = sum(
                    n for state, n in deployment.replica_states.items() if state == "RUNNING"
                )
                if running and name not in seen:
                    seen[name] = time.time()
        except Exception:  # Serve still starting: nothing to read yet.
            pass
        stop.wait(0.2)


def ours(config_path: str) -> tuple[float, list[tuple[str, float]], str]:
    """(seconds to first answer, [(phase, seconds since start)], model name)."""
    # Imported before Ray starts (as `launch.start` does): this driver's handles then call
    # synchronously, whatever data plane the replicas run.
    from ray import serve

    from serve_app.launch import init_local_ray, load_serve_config

    t0 = time.time()
    config = load_serve_config(config_path)
    app = config["applications"][0]
    args = app.get("args") or {}
    model = args.get("model", {}).get("name", "smollm2-135m-instruct")
    init_local_ray([args])
    stamps = [("ray.init", time.time())]
    from serve_app import build_app

    serve.start(http_options={"host": "127.0.0.1", "port": 8498})
    stamps.append(("serve.start (controller, proxy)", time.time()))
    name = app.get("name", "default")
    seen: dict[str, float] = {}
    stop = threading.Event()
    watcher = threading.Thread(target=_watch_running, args=(name, seen, stop), daemon=True)
    watcher.start()
    graph = build_app(args)
    stamps.append(("build_app (config checks)", time.time()))
    serve.run(graph, name=name, route_prefix="/", blocking=False)
    stamps.append(("serve.run returned (app running)", time.time()))
    url = "http://127.0.0.1:8498"
    while not _chat(url, model):
        time.sleep(0.2)
    first = time.time()
    stop.set()
    engine = serve.get_deployment_handle("Engine", app_name=name)
    for phase, at in engine.startup_stamps.remote().result(timeout_s=60).items():
        stamps.append((f"engine replica: {phase}", at))
    stamps += [(f"{deployment} running", at) for deployment, at in seen.items()]
    stamps.append(("first answer", first))
    serve.shutdown()
    import ray

    ray.shutdown()
    return first - t0, sorted(((p, at - t0) for p, at in stamps), key=lambda s: s[1]), model


def vllm_serve(config_path: str) -> float:
    from loadtest.targets import make_server
    from serve_app.launch import load_serve_config

    args = load_serve_config(config_path)["applications"][0].get("args") or {}
    server = make_server("vllm", args, 8499, Path(tempfile.mkdtemp(prefix="startup-")))
    try:
        return server.start()
    finally:
        server.stop()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default=str(ROOT / "serve_config.cpu.yaml"))
    p.add_argument("--no-vllm", action="store_true")
    ns = p.parse_args(argv)
    total, phases, _ = ours(ns.config)
    print("ours: start-up by phase (seconds since the launch)")
    for phase, at in phases:
        print(f"  {at:>7.1f}  {phase}")
    if not ns.no_vllm:
        theirs = vllm_serve(ns.config)
        print(
            f"\nfirst answer: ours {total:.1f} s, vllm serve {theirs:.1f} s "
            f"→ {total / theirs:.2f}x (goal ≤ 1.5x)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

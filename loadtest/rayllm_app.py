"""Ray's own LLM app (``ray.serve.llm.build_openai_app``) with our engine arguments.

``python -m loadtest.rayllm_app spec.json`` (the bench writes the spec: ``engine_args``,
``env``, ``port``); a fresh local Ray, loopback only, runs until SIGTERM.

On small CPU machines: the ingress gets a fractional CPU (``ingress_deployment_config``) and
the engine one CPU bundle (``placement_group_config``); ``accelerator_config`` is inferred as
CPU from a bundle without GPUs.
"""

from __future__ import annotations

import json
import signal
import sys
import threading
from pathlib import Path
from typing import Any


def llm_config(engine_args: dict[str, Any], env: dict[str, str]) -> dict[str, Any]:
    kwargs = {k: v for k, v in engine_args.items() if k not in ("model", "served_model_name")}
    return {
        "model_loading_config": {
            "model_id": engine_args.get("served_model_name") or engine_args["model"],
            "model_source": engine_args["model"],
        },
        "engine_kwargs": kwargs,
        "runtime_env": {"env_vars": dict(env)},
        "placement_group_config": {"bundles": [{"CPU": 1}], "strategy": "PACK"},
        "deployment_config": {
            "num_replicas": 1,
            "max_ongoing_requests": 512,
            "ray_actor_options": {"num_cpus": 0.1},
        },
    }


def builder_config(engine_args: dict[str, Any], env: dict[str, str]) -> dict[str, Any]:
    return {
        "llm_configs": [llm_config(engine_args, env)],
        "ingress_deployment_config": {
            "num_replicas": 1,
            "autoscaling_config": None,
            "ray_actor_options": {"num_cpus": 0.1},
        },
    }


def main(argv: list[str] | None = None) -> int:
    import ray
    from ray import serve
    from ray.serve.llm import build_openai_app

    spec = json.loads(Path((argv or sys.argv[1:])[0]).read_text())
    config = builder_config(spec["engine_args"], spec["env"])
    print("ray.serve.llm builder config:", json.dumps(config, indent=2), flush=True)
    ray.init(address="local", include_dashboard=False, log_to_driver=True)
    serve.start(http_options={"host": "127.0.0.1", "port": int(spec["port"])})
    serve.run(build_openai_app(config), name="rayllm", route_prefix="/", blocking=False)
    print(f"Ready: http://127.0.0.1:{spec['port']}/v1", flush=True)
    stop = threading.Event()
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    stop.wait()
    serve.shutdown()
    ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())

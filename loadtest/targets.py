"""The compared servers, each started and stopped by the harness on a loopback port.

All four get the same vLLM engine arguments, derived once from one ``AppConfig`` by
``serve_app.engine.engine_args.engine_args`` (what our engine replica passes to vLLM):

- ``ours``: ``python -m serve_app.launch <generated config> --port P`` (Router → Preprocessor →
  Engine on Ray Serve).
- ``vllm``: ``python -m vllm.entrypoints.openai.api_server`` with those args as CLI flags.
- ``rayllm``: ``ray.serve.llm.build_openai_app`` with an ``LLMConfig`` (``loadtest.rayllm_app``).
- ``asyncllm``: no server; ``loadtest.inproc`` drives ``AsyncLLM`` in its own process.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import yaml

from serve_app.config import AppConfig
from serve_app.engine.engine_args import engine_args

MODEL = "smollm2-135m-instruct"
TARGETS = ("ours", "vllm", "rayllm", "asyncllm")


def app_args(engine: dict[str, Any], model: str = MODEL, max_model_len: int = 4096) -> dict:
    """The ``args`` block of our Serve config: the pinned engine settings, small replicas."""
    return {
        "model": {"name": model, "max_model_len": max_model_len, "dtype": "auto"},
        "engine": {"device": "cpu", "cpu_threads_bind": "auto", "num_cpus": 0.5} | engine,
        "preprocessor": {
            "num_cpus": 0.1,
            "aggregation_window_s": 0.01,
            "aggregation_max_requests": 32,
        },
        "router": {"num_cpus": 0.1},
    }


def resolved(args: dict[str, Any]) -> tuple[AppConfig, dict[str, Any], dict[str, str]]:
    """(validated config, vLLM engine args, engine environment) every target uses."""
    from serve_app.models import resolve_model

    config = AppConfig.model_validate(args)
    path = resolve_model(config.model.name)
    return config, engine_args(config, path), config.engine.runtime_env_vars()


def vllm_cli_flags(args: dict[str, Any]) -> list[str]:
    """Engine args as ``vllm serve`` flags (dicts as JSON, bools as --x / --no-x)."""
    flags: list[str] = []
    for key, value in args.items():
        flag = "--" + key.replace("_", "-")
        if isinstance(value, bool):
            flags.append(flag if value else "--no-" + key.replace("_", "-"))
        elif isinstance(value, dict):
            flags += [flag, json.dumps(value)]
        else:
            flags += [flag, str(value)]
    return flags


class Server:
    """One OpenAI-compatible server in a subprocess of its own session (its own process group,
    so stopping it never touches anything the harness did not start)."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str], port: int, log: Path):
        self.name, self.argv, self.env, self.port, self.log = name, argv, env, port, log
        self.base_url = f"http://127.0.0.1:{port}"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout_s: float = 900) -> float:
        """Start and wait until ``/v1/models`` answers; return the seconds it took."""
        t0 = time.perf_counter()
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(
                self.argv,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=os.environ | self.env,
                start_new_session=True,
            )
        while time.perf_counter() - t0 < timeout_s:
            if self.proc.poll() is not None:
                code = self.proc.returncode
                raise RuntimeError(f"{self.name} exited with {code}; see {self.log}")
            with contextlib.suppress(httpx.HTTPError):
                # Ready = answers a 1-token chat (some ingresses list models before the engine
                # is up).
                if self._answers():
                    return time.perf_counter() - t0
            time.sleep(2)
        self.stop()
        raise TimeoutError(f"{self.name} not ready after {timeout_s:.0f} s; see {self.log}")

    def _answers(self) -> bool:
        if httpx.get(f"{self.base_url}/v1/models", timeout=5).status_code != 200:
            return False
        body = {"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]}
        url = f"{self.base_url}/v1/chat/completions"
        return httpx.post(url, json=body, timeout=60).status_code == 200

    def stop(self, grace_s: float = 60) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)  # our own session only
            self.proc.wait(10)
        # Children (Ray, the engine core) may outlive the leader; they are in its group.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)


def make_server(name: str, args: dict[str, Any], port: int, workdir: Path) -> Server:
    """A ``Server`` for ``ours``, ``vllm`` or ``rayllm`` with the pinned engine settings."""
    _, vargs, env = resolved(args)
    py = sys.executable
    log = workdir / f"{name}.log"
    if name == "ours":
        path = workdir / "ours-serve-config.yaml"
        serve_config = {
            "proxy_location": "HeadOnly",
            "http_options": {"host": "127.0.0.1", "port": port},
            "applications": [
                {
                    "name": "llm",
                    "route_prefix": "/",
                    "import_path": "serve_app:build_app",
                    "args": args,
                }
            ],
        }
        path.write_text(yaml.safe_dump(serve_config, sort_keys=False))
        argv = [py, "-m", "serve_app.launch", str(path), "--port", str(port)]
        return Server(name, argv, {}, port, log)
    if name == "vllm":
        argv = [
            py,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            *vllm_cli_flags(vargs),
        ]
        return Server(name, argv, env, port, log)
    if name == "rayllm":
        spec = workdir / "rayllm-spec.json"
        spec.write_text(json.dumps({"engine_args": vargs, "env": env, "port": port}, indent=2))
        argv = [py, "-m", "loadtest.rayllm_app", str(spec)]
        return Server(name, argv, {}, port, log)
    raise ValueError(f"{name!r} is not a server target ({', '.join(TARGETS[:3])})")


def resolved_config(name: str, args: dict[str, Any], server: Server | None) -> dict[str, Any]:
    """What gets logged and written to the results for one target."""
    _, vargs, env = resolved(args)
    out: dict[str, Any] = {"engine_args": vargs, "env": env}
    if server is not None:
        out["argv"] = server.argv
    if name == "ours":
        out["app_args"] = args
    return out

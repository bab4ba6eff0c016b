"""CPU per output token outside the model: each of our processes next to `vllm serve`'s API server.

The cost that transfers to any hardware: on a GPU box the model is fast and the frontend's CPU
per token sets the ceiling. For each target, started alone on the pinned engine settings, a
fixed load (``--requests`` streamed chats of ``--max-tokens`` tokens at ``--concurrency``) runs
after a warm-up, and the CPU time (user + system, from ``psutil``) every process of the target
spent during it is divided by the output tokens. Processes are grouped by role: for ours
Serve's proxy, our Router, Preprocessor and Engine replica actors (the Engine replica hosts
vLLM's AsyncLLM frontend), Serve's controller and Ray's own daemons; for ``vllm`` its API
server (AsyncLLM frontend plus HTTP). vLLM's engine core and model workers (descendants of the
process hosting AsyncLLM) are the model and are reported apart, not counted as frontend.

Each role's CPU rate with no load (``--idle-s`` just before) is reported too, and the cost per
token above it: Ray's and Serve's daemons poll at a fixed rate, which on this slow model is a
large share per token and on a GPU box streaming 100x the tokens a small one.

    python -m loadtest.cpu_cost [--targets ours,vllm] [--requests 192] [--concurrency 32]

``--profile`` also samples the busiest roles with ``py-spy`` during the load and prints where
their CPU goes (top functions, µs per output token; see ``loadtest.profiles``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path
from typing import Any

import psutil

from loadtest import profiles, workloads
from loadtest.bench import engine_settings
from loadtest.bench import parse_args as bench_args
from loadtest.client import RequestRecord, make_http, stream_chat
from loadtest.shapes import run_shape
from loadtest.targets import MODEL, Server, make_server

MODEL_PROCESSES = "vLLM engine core + workers (the model)"
# The roles whose CPU grows with tokens, sampled by --profile.
PROFILED = ("Router replica", "Engine replica", "Serve proxy", "vllm serve API server")


def role(process: psutil.Process) -> str:
    """What a process of a target does, from its title (Ray and vLLM set them)."""
    try:
        title = " ".join(process.cmdline()) or process.name()
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return "gone"
    for needle, name in (
        ("ServeReplica", "replica"),
        ("ProxyActor", "Serve proxy"),
        ("ServeController", "Serve controller"),
        ("gcs_server", "Ray GCS"),
        ("raylet", "Ray raylet"),
        ("DashboardAgent", "Ray dashboard agent"),
        ("dashboard/agent", "Ray dashboard agent"),
        ("ray-dashboard-", "Ray dashboard"),
        ("dashboard.py", "Ray dashboard"),
        ("RuntimeEnvAgent", "Ray runtime-env agent"),
        ("log_monitor", "Ray log monitor"),
        ("vllm.entrypoints", "vllm serve API server"),
        ("serve_app.launch", "our launcher (driver)"),
    ):
        if needle in title:
            if name == "replica":  # ray::ServeReplica:<app>:<Deployment>
                return title.split("ServeReplica:", 1)[1].split()[0].split(":")[-1] + " replica"
            return name
    return "other: " + process.name()


def processes(root: int) -> dict[int, tuple[str, psutil.Process]]:
    """Every live process of the target's tree, by pid, with its role; vLLM's engine core and
    model workers (descendants of the process hosting AsyncLLM) as the model."""
    try:
        tree = [psutil.Process(root), *psutil.Process(root).children(recursive=True)]
    except psutil.NoSuchProcess:
        return {}
    found = {p.pid: (role(p), p) for p in tree}
    hosts = [p for r, p in found.values() if r in ("Engine replica", "vllm serve API server")]
    for host in hosts:
        for child in host.children(recursive=True):
            found[child.pid] = (MODEL_PROCESSES, child)
    return found


def profiled_pids(root: int) -> dict[str, int]:
    """One process per profiled role (the first found: one replica of each here)."""
    pids: dict[str, int] = {}
    for pid, (name, _) in sorted(processes(root).items()):
        if name in PROFILED:
            pids.setdefault(name, pid)
    return pids


def cpu_seconds(process: psutil.Process) -> float:
    try:
        times = process.cpu_times()
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return 0.0
    return float(times.user + times.system)


async def load(url: str, bodies: list[dict[str, Any]], concurrency: int) -> list[RequestRecord]:
    async with make_http(concurrency + 8) as http:

        async def send(body: dict[str, Any]) -> RequestRecord:
            return await stream_chat(http, url, body)

        records, _ = await run_shape(send, bodies, "closed", concurrency, time_limit_s=900)
    return records


def cpu_by_role(
    root: int, before: dict[int, float] | None = None
) -> tuple[dict[str, float], dict[int, float]]:
    """CPU seconds per role since ``before`` (per pid; a process new since counts whole), and
    the per-pid totals now."""
    now = {pid: (name, cpu_seconds(p)) for pid, (name, p) in processes(root).items()}
    per_role: dict[str, float] = {}
    for pid, (name, seconds) in now.items():
        spent = seconds - (before or {}).get(pid, 0.0)
        per_role[name] = per_role.get(name, 0.0) + max(0.0, spent)
    return per_role, {pid: seconds for pid, (_, seconds) in now.items()}


def measure(server: Server, ns: argparse.Namespace, label: str) -> dict[str, Any]:
    """CPU seconds per role over the fixed load, the output tokens it produced, and each role's
    CPU while idle just before (Ray's and Serve's daemons poll whether or not tokens flow)."""
    bodies = workloads.build("random", MODEL, ns.requests, ns.max_tokens, ns.seed)
    asyncio.run(load(server.base_url, workloads.build("random", MODEL, 16, 16, 1), 8))  # Warm.
    assert server.proc is not None
    root = server.proc.pid
    _, before = cpu_by_role(root)
    time.sleep(ns.idle_s)
    idle, before = cpu_by_role(root, before)
    recording = profiles.record(profiled_pids(root), Path(ns.out), label) if ns.profile else None
    started = time.perf_counter()
    records = asyncio.run(load(server.base_url, bodies, ns.concurrency))
    load_s = time.perf_counter() - started
    per_role, _ = cpu_by_role(root, before)
    tokens = sum(r.output_tokens for r in records if r.ok)
    if recording is not None:
        recording.stop()
        for name, path in recording.files.items():
            print(f"\n[{label}] {name}: {profiles.summary(path, tokens)}", flush=True)
    return {
        "requests_ok": sum(r.ok for r in records),
        "output_tokens": tokens,
        "cpu_s": per_role,
        "load_s": load_s,
        "idle_cpu_per_s": {name: seconds / ns.idle_s for name, seconds in idle.items()},
    }


def table(results: dict[str, dict[str, Any]]) -> str:
    """Per role: CPU during the load, per output token and per request; and, where the idle
    rate was measured, the share above idle (what the tokens cost: the rest is the daemons'
    polling, which a faster model spreads over more tokens)."""
    lines = [
        f"{'target':<10}{'process (role)':<42}{'CPU s':>8}{'µs/token':>10}{'ms/request':>11}"
        f"{'idle %CPU':>10}{'µs/token above idle':>21}"
    ]
    for target, result in results.items():
        tokens, requests = result["output_tokens"], result["requests_ok"]
        idle_rates = result.get("idle_cpu_per_s", {})
        load_s = result.get("load_s", 0.0)
        frontend = above = 0.0
        for name, seconds in sorted(result["cpu_s"].items(), key=lambda kv: -kv[1]):
            busy = max(0.0, seconds - idle_rates.get(name, 0.0) * load_s)
            if name != MODEL_PROCESSES:
                frontend += seconds
                above += busy
            lines.append(
                f"{target:<10}{name:<42}{seconds:>8.1f}{seconds / tokens * 1e6:>10.0f}"
                f"{seconds / requests * 1e3:>11.1f}{idle_rates.get(name, 0.0) * 100:>10.1f}"
                f"{busy / tokens * 1e6:>21.0f}"
            )
        result["frontend_us_per_token"] = frontend / tokens * 1e6
        result["frontend_above_idle_us_per_token"] = above / tokens * 1e6
        lines.append(
            f"{target:<10}{'= frontend (all but the model)':<42}{frontend:>8.1f}"
            f"{result['frontend_us_per_token']:>10.0f}{frontend / requests * 1e3:>11.1f}"
            f"{'':>10}{result['frontend_above_idle_us_per_token']:>21.0f}"
        )
    if {"ours", "vllm"} <= results.keys():
        ours, vllm = results["ours"], results["vllm"]
        ratio = ours["frontend_us_per_token"] / vllm["frontend_us_per_token"]
        lines.append(f"\nfrontend CPU per output token, ours / vllm serve: {ratio:.2f}x")
        if vllm["frontend_above_idle_us_per_token"]:
            above_ratio = (
                ours["frontend_above_idle_us_per_token"] / vllm["frontend_above_idle_us_per_token"]
            )
            lines.append(f"the same above idle, ours / vllm serve: {above_ratio:.2f}x")
    return "\n".join(lines)


def parse_variant(spec: str) -> tuple[str, dict[str, Any]]:
    """``NAME:a.b=1,c=x`` -> (NAME, {"a.b": 1, "c": "x"}); values are JSON, else text."""
    name, _, assignments = spec.partition(":")
    overrides: dict[str, Any] = {}
    for assignment in filter(None, assignments.split(",")):
        key, _, value = assignment.partition("=")
        try:
            overrides[key] = json.loads(value)
        except json.JSONDecodeError:
            overrides[key] = value
    return name, overrides


def with_overrides(app: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    app = json.loads(json.dumps(app))
    for key, value in overrides.items():
        *path, last = key.split(".")
        node = app
        for part in path:
            node = node.setdefault(part, {})
        node[last] = value
    return app


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--targets", default="ours,vllm")
    parser.add_argument("--requests", type=int, default=192)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--port", type=int, default=8290)
    parser.add_argument(
        "--idle-s", type=float, default=20.0, help="idle time measured before the load"
    )
    parser.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="NAME:KEY=VALUE[,KEY=VALUE]",
        help="a target NAME: ours with these app args changed (dotted keys, JSON values), "
        "e.g. nochan:engine.output_channels=false; list NAME in --targets (A/B in one run)",
    )
    parser.add_argument(
        "--profile", action="store_true", help="sample the per-token roles with py-spy"
    )
    parser.add_argument("--out", default="results/cpu_cost")
    ns = parser.parse_args(argv)
    app = engine_settings(bench_args([]))  # The engine settings `make bench` pins.
    variants = dict(parse_variant(spec) for spec in ns.variant)
    out = Path(ns.out)
    out.mkdir(parents=True, exist_ok=True)
    results: dict[str, dict[str, Any]] = {}
    for i, target in enumerate(t.strip() for t in ns.targets.split(",") if t.strip()):
        label = target if target not in results else f"{target}#{i}"
        args = with_overrides(app, variants[target]) if target in variants else app
        server = make_server("ours" if target in variants else target, args, ns.port + i, out)
        try:
            started = time.perf_counter()
            server.start()
            print(f"[{label}] ready in {time.perf_counter() - started:.0f} s", flush=True)
            results[label] = measure(server, ns, label)
        finally:
            server.stop()
    print(
        f"\n{ns.requests} streamed chats x {ns.max_tokens} tokens at c={ns.concurrency}, "
        f"{MODEL}; CPU time per process role while the load ran, and above each role's idle rate "
        f"(measured over {ns.idle_s:g} s with no load just before):\n"
    )
    print(table(results))
    (out / "cpu_cost.json").write_text(json.dumps(results, indent=2))
    print(f"wrote {out / 'cpu_cost.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

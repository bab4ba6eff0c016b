"""CPU time per output token outside the model, per process role: ours vs ``vllm serve``.

``python -m loadtest.cpu_cost [--targets ours,vllm] [--requests 192] [--concurrency 32]``

Each target runs in a process session of its own; after a warm-up, the CPU time (user + system)
of every process in that session is read before and after a fixed workload (streamed chat
requests with ``ignore_eos``, so every target generates exactly the same number of tokens) and
split by role. vLLM's engine core and model worker are the model: they are listed but not
counted as frontend. Wall-clock time depends on what else the machine runs; CPU time per token
much less so, which makes this the figure that transfers to a GPU box: at N µs of frontend CPU
per token, one frontend process streams at most 1e6 / N tokens per second.

Each role's idle rate (CPU per second with no traffic: Serve's controller loop, metrics
pushes, health checks) is read over 15 s before the workload; "load µs/tok" subtracts it over
the workload's wall time, leaving what grows with tokens. On a GPU box streaming thousands of
tokens a second that fixed cost per second is a few µs per token; on two CPU cores at ~300
tok/s it is a large share. Both columns are printed, and with ``--repeats N`` the targets
alternate and the medians are reported.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import psutil

from loadtest import workloads
from loadtest.client import closed_loop
from loadtest.targets import MODEL, Server, app_args, make_server

# (role, substring of the process title/command line), first match wins.
ROLES = [
    ("model: engine core", "VLLM::EngineCore"),
    ("model: worker", "VLLM::Worker"),
    ("router replica", "ServeReplica:llm:Router"),
    ("preprocessor replica", "ServeReplica:llm:Preprocessor"),
    ("engine replica", "ServeReplica:llm:Engine"),
    ("serve proxy", "ProxyActor"),
    ("haproxy", "haproxy"),
    ("serve controller", "ServeController"),
    ("gcs", "gcs_server"),
    ("raylet", "raylet"),
    ("dashboard", "dashboard"),
    ("vllm api server", "vllm.entrypoints.openai.api_server"),
    ("launcher", "serve_app.launch"),
]
MODEL_ROLES = {"model: engine core", "model: worker"}


def role_of(proc: psutil.Process) -> str:
    try:
        text = " ".join([proc.name(), *proc.cmdline()])
    except psutil.Error:
        return "gone"
    return next((role for role, needle in ROLES if needle in text), "ray: other")


def session_cpu(session_id: int) -> dict[int, tuple[str, float]]:
    """pid → (role, CPU seconds so far) of every live process in the session."""
    out: dict[int, tuple[str, float]] = {}
    for proc in psutil.process_iter():
        try:
            if os.getsid(proc.pid) != session_id:
                continue
            times = proc.cpu_times()
            out[proc.pid] = (role_of(proc), times.user + times.system)
        except (psutil.Error, ProcessLookupError, PermissionError):
            continue
    return out


def cpu_by_role(
    before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]]
) -> dict[str, float]:
    """CPU seconds spent between two readings, summed per role (new processes count whole)."""
    spent: dict[str, float] = defaultdict(float)
    for pid, (role, total) in after.items():
        spent[role] += total - (before[pid][1] if pid in before else 0.0)
    return dict(spent)


def measure(
    server: Server, requests: int, concurrency: int, max_tokens: int, idle_s: float = 15
) -> dict[str, float]:
    """CPU seconds per role over the workload; ``_idle_<role>`` keys hold what the role spends
    per second with no traffic at all (control loops, metrics pushes, health checks), read
    over ``idle_s`` just before: a fixed cost per second, not per token."""
    assert server.proc is not None
    bodies = workloads.build("random", MODEL, requests, max_tokens, seed=1)
    for body in bodies:
        body["ignore_eos"] = True
    warm = [dict(b, max_tokens=8) for b in bodies[:concurrency]]
    asyncio.run(closed_loop(server.base_url, warm, concurrency))
    time.sleep(2)  # Let the warm-up's tail (metrics pushes, logs) settle.
    idle_from = session_cpu(server.proc.pid)
    time.sleep(idle_s)
    idle = cpu_by_role(idle_from, session_cpu(server.proc.pid))
    before = session_cpu(server.proc.pid)
    records, wall = asyncio.run(closed_loop(server.base_url, bodies, concurrency))
    after = session_cpu(server.proc.pid)
    failed = [r for r in records if not r.ok]
    if failed:
        raise RuntimeError(f"{len(failed)} requests failed, e.g. {failed[0].error}")
    tokens = sum(r.output_tokens for r in records)
    spent = cpu_by_role(before, after)
    spent["_tokens"], spent["_requests"], spent["_wall_s"] = tokens, len(records), wall
    spent |= {f"_idle_{role}": seconds / idle_s for role, seconds in idle.items()}
    return spent


def under_load(spent: dict[str, float]) -> dict[str, float]:
    """Per role, the CPU seconds the workload added: what it spent minus its idle rate over
    the same wall time (never below zero). This is the part that scales with tokens."""
    wall = spent["_wall_s"]
    return {
        role: max(0.0, seconds - spent.get(f"_idle_{role}", 0.0) * wall)
        for role, seconds in spent.items()
        if not role.startswith("_")
    }


def report(name: str, spent: dict[str, float]) -> tuple[float, float]:
    """Print the table; (frontend µs per token in all, of which under load)."""
    tokens, requests = spent["_tokens"], spent["_requests"]
    loaded = under_load(spent)
    roles = {r: s for r, s in spent.items() if not r.startswith("_")}
    print(
        f"\n[{name}] {int(requests)} requests, {int(tokens)} output tokens, "
        f"{spent['_wall_s']:.1f} s wall"
    )
    print(
        f"  {'role':<24}{'CPU s':>8}{'idle %':>8}{'µs/token':>10}{'load µs/tok':>12}"
        f"{'ms/request':>12}"
    )
    for role, seconds in sorted(roles.items(), key=lambda kv: -kv[1]):
        if seconds < 0.005:
            continue
        mark = "  (model)" if role in MODEL_ROLES else ""
        print(
            f"  {role:<24}{seconds:>8.2f}{spent.get(f'_idle_{role}', 0.0) * 100:>8.1f}"
            f"{seconds / tokens * 1e6:>10.0f}{loaded[role] / tokens * 1e6:>12.0f}"
            f"{seconds / requests * 1e3:>12.1f}{mark}"
        )
    total = sum(s for r, s in roles.items() if r not in MODEL_ROLES)
    load = sum(s for r, s in loaded.items() if r not in MODEL_ROLES)
    print(
        f"  {'frontend total':<24}{total:>8.2f}{'':>8}{total / tokens * 1e6:>10.0f}"
        f"{load / tokens * 1e6:>12.0f}{total / requests * 1e3:>12.1f}"
    )
    return total / tokens * 1e6, load / tokens * 1e6


def frontend_us_per_token(cpu: dict[str, float]) -> float:
    tokens = cpu.get("_tokens", 0.0)
    frontend = sum(s for r, s in cpu.items() if not r.startswith("_") and r not in MODEL_ROLES)
    return frontend / tokens * 1e6 if tokens else float("nan")


def cpu_lines(results: dict[str, Any]) -> list[str]:
    """Per target: frontend µs per output token in total and per role (``make bench``)."""
    lines, totals = [], {}
    for name, target in results["targets"].items():
        cpu = target.get("cpu")
        if not cpu or not cpu.get("_tokens"):
            continue
        totals[name] = frontend_us_per_token(cpu)
        roles = sorted(
            ((r, s) for r, s in cpu.items() if not r.startswith("_") and r not in MODEL_ROLES),
            key=lambda rs: -rs[1],
        )
        parts = ", ".join(f"{r} {s / cpu['_tokens'] * 1e6:.0f}" for r, s in roles if s > 0.01)
        lines.append(f"{name:<8}{totals[name]:>7.0f} µs/token ({parts})")
    if "ours" in totals and "vllm" in totals:
        lines.append(f"ours / vllm serve: {totals['ours'] / totals['vllm']:.2f}x (goal ≤ 2x)")
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--targets", default="ours,vllm")
    p.add_argument("--requests", type=int, default=192)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--port", type=int, default=8290)
    p.add_argument("--repeats", type=int, default=1, help="Runs per target (alternating).")
    p.add_argument("--out", default=None, help="Logs; default results/cpu-<timestamp>.")
    ns = p.parse_args(argv)
    out = Path(ns.out or f"results/cpu-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}")
    out.mkdir(parents=True, exist_ok=True)
    engine = {
        "max_num_seqs": 128,
        "max_num_batched_tokens": 4096,
        "enforce_eager": True,
        "block_size": 32,
        "kv_cache_space_gib": 2,
    }
    args = app_args(engine, MODEL, 4096)
    names = [t.strip() for t in ns.targets.split(",") if t.strip()]
    runs: dict[str, list[tuple[float, float]]] = {name: [] for name in names}
    for repeat in range(ns.repeats):
        order = names if repeat % 2 == 0 else names[::-1]
        for name in order:
            server = make_server(name, args, ns.port + names.index(name), out)
            try:
                print(f"[{name}] ready in {server.start():.0f} s", flush=True)
                spent = measure(server, ns.requests, ns.concurrency, ns.max_tokens)
                runs[name].append(report(name, spent))
            finally:
                server.stop()
    per_token = {
        name: (statistics.median(a for a, _ in got), statistics.median(b for _, b in got))
        for name, got in runs.items()
        if got
    }
    if ns.repeats > 1:
        for name, (gross, load) in per_token.items():
            print(f"{name}: median of {ns.repeats}: {gross:.0f} µs/token, {load:.0f} under load")
    if "ours" in per_token and "vllm" in per_token:
        (ours, ours_load), (vllm, vllm_load) = per_token["ours"], per_token["vllm"]
        print(
            f"\nfrontend CPU per output token, ours / vllm serve: {ours / vllm:.2f}x "
            f"({ours:.0f} vs {vllm:.0f} µs); under load, idle rates subtracted: "
            f"{ours_load / vllm_load:.2f}x ({ours_load:.0f} vs {vllm_load:.0f} µs)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Side-by-side benchmark: our app vs vllm serve vs ray.serve.llm vs raw AsyncLLM.

``python -m loadtest.bench [--suite default|big|smoke] [--targets ours,vllm,rayllm,asyncllm]
[--concurrency 1 8 32 64 128] [--rates 1 4] [--out results/bench-<timestamp>]``

Same model, same engine arguments (pinned below, logged per target), same seeded workloads and
load shapes. Each target is started on a loopback port, warmed up (discarded), measured, and
stopped before the next one starts, so they never compete for the CPUs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from loadtest import repeats, report, suite
from loadtest.client import RequestRecord, make_http, stream_chat
from loadtest.stats import SLO, summarize
from loadtest.targets import MODEL, TARGETS, app_args, make_server, resolved_config


def smoke_suite(concurrencies: list[int], rates: list[float]) -> list[suite.Phase]:
    """Proves start/stop and every shape in seconds: not a measurement."""
    return [
        suite.Phase("closed c=1", "sweep", "random", "closed", 1, 2, 16, 30),
        suite.Phase("closed c=4", "sweep", "random", "closed", 4, 8, 32, 60),
        suite.Phase("static batches of 4", "modes", "contracts", "static", 4, 4, 16, 60),
        suite.Phase("sentiment json c=2", "scenario", "sentiment", "closed", 2, 2, 32, 60),
        suite.Phase("poisson 2/s", "open", "random", "poisson", 2, 4, 16, 30),
    ]


SUITES = dict(suite.SUITES, smoke=smoke_suite)
MAX_MINUTES = {"default": 14.5}
STARTUP_ALLOWANCE_S = 75.0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--suite", choices=sorted(SUITES), default="default")
    p.add_argument("--targets", default=",".join(TARGETS), help="Comma list, run in this order.")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32, 64, 128])
    p.add_argument("--rates", type=float, nargs="+", default=None, help="Poisson req/s.")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--slo-ttft", type=float, default=1.0, help="Goodput SLO: TTFT s.")
    p.add_argument("--slo-tpot", type=float, default=0.1, help="Goodput SLO: TPOT s.")
    p.add_argument("--budget-s", type=float, default=None, help="Load seconds per target.")
    p.add_argument("--port", type=int, default=8190, help="First port; one per target.")
    p.add_argument(
        "--max-minutes",
        type=float,
        default=None,
        help="Whole run; shrinks the load budget of later targets (default suite: 14.5).",
    )
    p.add_argument("--out", default=None, help="Default: results/bench-<UTC timestamp>.")
    p.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="Run every target N times (order alternating) and report per-phase medians.",
    )
    # The engine settings every target gets.
    p.add_argument("--max-num-seqs", type=int, default=128)
    p.add_argument("--max-num-batched-tokens", type=int, default=4096)
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--kv-cache-gib", type=int, default=2, help="VLLM_CPU_KVCACHE_SPACE (CPU).")
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--block-size", type=int, default=32)
    p.add_argument("--device", choices=["cpu", "gpu"], default="cpu")
    return p.parse_args(argv)


def engine_settings(args: argparse.Namespace) -> dict[str, Any]:
    engine: dict[str, Any] = {
        "device": args.device,
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "enable_prefix_caching": not args.no_prefix_caching,
        "enforce_eager": args.device == "cpu",
        "block_size": args.block_size,
    }
    if args.device == "cpu":
        engine["kv_cache_space_gib"] = args.kv_cache_gib
    return app_args(engine, MODEL, args.max_model_len)


async def _http_phases(url: str, phases: list[suite.Phase], seed: int, budget: float) -> list:
    width = int(max((p.value for p in phases if p.shape != "poisson"), default=8)) + 64
    async with make_http(max(width, 256)) as http:

        async def send(body: dict[str, Any]) -> RequestRecord:
            return await stream_chat(http, url, body)

        return await suite.run_phases(send, phases, MODEL, seed, budget)


def run_target(
    name: str,
    app: dict[str, Any],
    phases: list[suite.Phase],
    port: int,
    out: Path,
    seed: int,
    budget_s: float,
) -> dict[str, Any]:
    """One target: start it, run every phase within ``budget_s`` seconds of load, stop it."""
    result: dict[str, Any] = {"status": "not run", "phases": []}
    if name == "asyncllm":
        job, res = out / "asyncllm-job.json", out / "asyncllm-out.json"
        job.write_text(
            json.dumps(
                {
                    "app_args": app,
                    "phases": [asdict(p) for p in phases],
                    "model": MODEL,
                    "seed": seed,
                    "budget_s": budget_s,
                }
            )
        )
        result["config"] = resolved_config(name, app, None)
        print(f"[asyncllm] engine args: {json.dumps(result['config'])}", flush=True)
        res.unlink(missing_ok=True)
        with (out / "asyncllm.log").open("ab") as log:
            # Its own session: the engine core child goes when this process goes.
            proc = subprocess.Popen(
                [sys.executable, "-m", "loadtest.inproc", str(job), str(res)],
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        try:
            code = proc.wait(timeout=budget_s * 3 + 900)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # our own session only
            code = proc.wait()
        if code != 0 or not res.exists():
            return result | {"status": f"failed: exit {code}, see asyncllm.log"}
        data = json.loads(res.read_text())
        result["config"]["engine_args"] = data["engine_args"]
        return result | {"status": "ok", "startup_s": data["startup_s"], "phases": data["phases"]}
    server = make_server(name, app, port, out)
    result["config"] = resolved_config(name, app, server)
    print(f"[{name}] engine args: {json.dumps(result['config']['engine_args'])}", flush=True)
    print(f"[{name}] argv: {' '.join(server.argv)}", flush=True)
    try:
        result["startup_s"] = server.start()
        print(f"[{name}] ready at {server.base_url} in {result['startup_s']:.0f} s", flush=True)
        result["phases"] = asyncio.run(_http_phases(server.base_url, phases, seed, budget_s))
        result["status"] = "ok"
    except Exception as exc:  # one broken target never loses the others' results
        result["status"] = f"failed: {exc!r}"[:500]
        print(f"[{name}] {result['status']}", flush=True)
    finally:
        server.stop()
    return result


def _fmt(x: float, scale: float = 1.0, digits: int = 0) -> str:
    return "-" if math.isnan(x) else f"{x * scale:.{digits}f}"


def print_summary(results: dict[str, Any]) -> None:
    print(
        f"\n{'target':<9}{'phase':<24}{'ok/n':>8}{'tok/s':>8}{'req/s':>7}{'good/s':>7}"
        f"{'TTFT50':>8}{'TTFT99':>8}{'TPOT50':>8}{'e2e50':>7}"
    )
    for name, t in results["targets"].items():
        if not t.get("phases"):
            print(f"{name:<9}{t['status']}")
        for p in t.get("phases", []):
            s = p.get("summary")
            if not s:
                print(f"{name:<9}{p['name']:<24}  skipped ({p.get('skipped')})")
                continue
            print(
                f"{name:<9}{p['name']:<24}{s['ok']:>4}/{s['requests']:<3}"
                f"{s['output_tok_per_s']:>8.1f}{s['req_per_s']:>7.2f}{s['goodput_req_per_s']:>7.2f}"
                f"{_fmt(s['ttft_s']['p50'], 1000):>8}{_fmt(s['ttft_s']['p99'], 1000):>8}"
                f"{_fmt(s['tpot_s']['p50'], 1000):>8}{_fmt(s['latency_s']['p50'], 1, 2):>7}"
            )
    print("\nRatios (ours vs …):")
    for key, value in report.ratios(results).items():
        print(f"  {key:<58}{_fmt(value, 1, 2):>8}")


def run_once(
    ns: argparse.Namespace,
    targets: list[str],
    phases: list[suite.Phase],
    app: dict[str, Any],
    meta: dict[str, Any],
    out: Path,
) -> dict[str, Any]:
    """Every target once, one after the other, within the suite's time box."""
    slo = SLO(ns.slo_ttft, ns.slo_tpot)
    results: dict[str, Any] = {"meta": meta | {"targets": targets}, "targets": {}}
    deadline = time.perf_counter() + 60 * (ns.max_minutes or MAX_MINUTES.get(ns.suite, 1e6))
    for i, name in enumerate(targets):
        t0 = time.perf_counter()
        # Leave each remaining target its start/stop time (~75 s on 2 cores) and a fair share.
        share = (deadline - t0) / (len(targets) - i) - STARTUP_ALLOWANCE_S
        budget = max(10.0, min(ns.load_budget_s, share))
        result = run_target(name, app, phases, ns.port + i, out, ns.seed, budget)
        result["load_budget_s"] = budget
        for p in result.get("phases", []):
            if p.get("records") or not p.get("skipped"):
                records = [RequestRecord.from_dict(r) for r in p.get("records", [])]
                p["summary"] = summarize(records, p.get("wall_s", 0.0), slo)
        result["total_s"] = time.perf_counter() - t0
        results["targets"][name] = result
        report.write(results, out)  # partial results survive a later crash
    return results


def main(argv: list[str] | None = None) -> int:
    ns = parse_args(argv)
    ns.rates = ns.rates or suite.DEFAULT_RATES.get(ns.suite, [2.0])
    ns.load_budget_s = ns.budget_s or suite.DEFAULT_BUDGET_S.get(ns.suite, 120.0)
    started = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    out = Path(ns.out or f"results/bench-{started}")
    out.mkdir(parents=True, exist_ok=True)
    phases = SUITES[ns.suite](ns.concurrency, ns.rates)
    app = engine_settings(ns)
    targets = [t.strip() for t in ns.targets.split(",") if t.strip()]
    for name in targets:
        if name not in TARGETS:
            raise SystemExit(f"unknown target {name!r}; choose from {', '.join(TARGETS)}")
    meta = {
        "started": started,
        "suite": ns.suite,
        "model": MODEL,
        "seed": ns.seed,
        "slo": asdict(SLO(ns.slo_ttft, ns.slo_tpot)),
        "phases": [asdict(p) for p in phases],
        "argv": sys.argv,
    }
    print(
        f"Results in {out}; {len(phases)} phases per target, ≤ {ns.load_budget_s:.0f} s load each."
    )
    runs, files = [], {}
    for repeat in range(ns.repeats):
        # Alternate the order, so no target always runs first on a cold machine.
        order = targets if repeat % 2 == 0 else targets[::-1]
        run_dir = out if ns.repeats == 1 else out / f"run-{repeat + 1}"
        run_dir.mkdir(parents=True, exist_ok=True)
        results = run_once(ns, order, phases, app, meta | {"repeat": repeat + 1}, run_dir)
        files = report.write(results, run_dir)
        runs.append(results)
        print_summary(results)
    print("\n" + repeats.table(runs))
    summary = out / "repeats.json"
    summary.write_text(json.dumps(repeats.combined(runs), indent=1))
    print("\n" + "\n".join(f"wrote {path}" for path in [*files.values(), summary]))
    return 0 if all(t["status"] == "ok" for run in runs for t in run["targets"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())

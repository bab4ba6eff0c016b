"""Start-up to first answer, phase by phase: ours vs ``vllm serve``, same engine args.

Each target starts ``--repeats`` times (order alternating) through ``loadtest.targets``; ready
means it answers a 1-token chat. The phases come from the timestamps in the logs each writes:
vLLM's own lines in both (engine config begun, EngineCore process up, model worker up, engine
initialized), and for ours Ray's and Serve's (Serve up, the engine replica's process up).
vLLM stamps whole seconds, so phases shorter than ~1 s read as 0 or 1.
Ours is read from ``/tmp/ray/session_latest``: run nothing else that starts Ray meanwhile.
``python -m loadtest.startup_breakdown [--repeats 2] [--targets ours,vllm]``
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import time
from datetime import datetime
from pathlib import Path
from typing import Any

from loadtest.targets import MODEL, app_args, make_server

# (phase, marker): a phase ends at the first log line holding its marker.
VLLM_MARKERS = [
    ("vLLM imported, engine config begun", "Resolved architecture"),
    ("EngineCore process up", "Initializing a V1 LLM engine"),
    ("model worker process up", "Starting to load model"),
    ("weights, KV cache, warm-up", "init engine (profile, create kv cache, warmup model)"),
]
SERVE_UP = "Started Serve in namespace"
REPLICA_UP = "Started initializing replica"
# vLLM: "INFO 12-07 03:32:54 [model.py:733] ..."; Ray/Serve: "INFO 2026-12-07 03:56:20,086 ...".
VLLM_STAMP = re.compile(r"(?:INFO|WARNING|DEBUG|ERROR) (\d\d-\d\d \d\d:\d\d:\d\d)")
RAY_STAMP = re.compile(r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3})")
RAY_SESSION = Path("/tmp/ray/session_latest/logs")


def stamp(line: str, year: int) -> float | None:
    """Epoch seconds of a vLLM or Ray log line (local time), or None."""
    if match := RAY_STAMP.search(line):
        when = datetime.strptime(match.group(1), "%Y-%m-%d %H:%M:%S")
        return when.timestamp() + int(match.group(2)) / 1000
    if match := VLLM_STAMP.search(line):
        return datetime.strptime(f"{year}-{match.group(1)}", "%Y-%m-%d %H:%M:%S").timestamp()
    return None


def first(lines: list[str], marker: str, year: int) -> float | None:
    return next((stamp(line, year) for line in lines if marker in line), None)


def engine_lines(name: str, log: Path) -> list[str]:
    """The log lines that hold the engine's start: vllm serve's own log; for ours the engine
    replica's worker output and Serve's replica log in Ray's session, after the launcher's."""
    lines = log.read_text(errors="replace").splitlines()
    if name != "ours":
        return lines
    for path in sorted(RAY_SESSION.glob("worker-*.out")):
        text = path.read_text(errors="replace")
        if ":actor_name:ServeReplica:" in text and ":Engine" in text.split("\n", 3)[1]:
            lines += text.splitlines()
    for path in (RAY_SESSION / "serve").glob("replica_*_Engine_*.log"):
        lines += path.read_text(errors="replace").splitlines()
    return lines


def phases(name: str, log: Path, started: float, ready: float) -> dict[str, Any]:
    """Seconds per phase, each from the end of the one before (a missing marker: None)."""
    year = time.localtime(started).tm_year
    lines = engine_lines(name, log)
    marks: list[tuple[str, float | None]] = []
    if name == "ours":
        marks += [("Ray + Serve up", first(lines, SERVE_UP, year))]
        marks += [("engine replica process up", first(lines, REPLICA_UP, year))]
    marks += [(phase, first(lines, marker, year)) for phase, marker in VLLM_MARKERS]
    marks += [("first answer", ready)]
    out: dict[str, Any] = {"total_s": ready - started, "phases": {}}
    previous = started
    for phase, at in marks:
        out["phases"][phase] = None if at is None else round(at - previous, 1)
        previous = at if at is not None else previous
    return out


def run(name: str, out: Path, port: int) -> dict[str, Any]:
    engine = {"device": "cpu", "enforce_eager": True, "kv_cache_space_gib": 1}
    server = make_server(name, app_args(engine, MODEL), port, out)
    server.log.unlink(missing_ok=True)
    started = time.time()
    try:
        server.start()
        return phases(name, server.log, started, time.time())
    finally:
        server.stop()
        time.sleep(3)  # Ports and Ray's session let go before the next start.


def table(runs: dict[str, list[dict[str, Any]]]) -> str:
    """Median seconds per phase and target; ``-``: the target has no such phase."""
    names = list(runs)
    order = list(dict.fromkeys(p for results in runs.values() for p in results[0]["phases"]))
    rows = [f"{'phase (median s)':<38}" + "".join(f"{n:>10}" for n in names)]
    for phase in order:
        cells = []
        for name in names:
            values = [r["phases"].get(phase) for r in runs[name]]
            known = [v for v in values if v is not None]
            cells.append(f"{statistics.median(known):>10.1f}" if known else f"{'-':>10}")
        rows.append(f"{phase:<38}" + "".join(cells))
    totals = {n: statistics.median(r["total_s"] for r in runs[n]) for n in names}
    rows.append(f"{'start to first answer':<38}" + "".join(f"{totals[n]:>10.1f}" for n in names))
    if len(names) == 2:
        rows.append(f"{names[0]}/{names[1]}: {totals[names[0]] / totals[names[1]]:.2f}x")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--targets", default="ours,vllm")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--port", type=int, default=8093)
    parser.add_argument("--out", default="results/startup")
    ns = parser.parse_args(argv)
    out = Path(ns.out)
    out.mkdir(parents=True, exist_ok=True)
    targets = [t.strip() for t in ns.targets.split(",") if t.strip()]
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in targets}
    for repeat in range(ns.repeats):
        for name in targets if repeat % 2 == 0 else targets[::-1]:
            runs[name].append(run(name, out, ns.port))
            print(f"[{name}] {json.dumps(runs[name][-1])}", flush=True)
    print("\n" + table(runs))
    (out / "startup.json").write_text(json.dumps(runs, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

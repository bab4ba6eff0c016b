"""Load-test harness logic: no Ray, no server, no engine."""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import time
from pathlib import Path
from typing import Any

import pytest

from loadtest import report, shapes, suite, workloads
from loadtest.client import RequestRecord, percentile
from loadtest.stats import SLO, ratio, summarize
from loadtest.targets import vllm_cli_flags


def rec(ttft: float, latency: float, tokens: int, ok: bool = True) -> RequestRecord:
    return RequestRecord(ok, 200 if ok else 500, ttft_s=ttft, latency_s=latency,
                         output_tokens=tokens, itl_s=[0.01] * max(tokens - 1, 0))  # fmt: skip


def test_percentile_interpolates_and_handles_edges() -> None:
    assert math.isnan(percentile([], 50))
    assert percentile([3.0], 99) == 3.0
    values = [float(v) for v in range(1, 101)]  # 1..100
    assert percentile(values, 50) == pytest.approx(50.5)
    assert percentile(values, 90) == pytest.approx(90.1)
    assert percentile(values, 99) == pytest.approx(99.01)
    assert percentile(values, 0) == 1.0
    assert percentile(values, 100) == 100.0
    assert percentile([5.0, 1.0, 3.0], 50) == 3.0  # unsorted input


def test_tpot_excludes_first_token() -> None:
    assert rec(0.5, 1.5, 11).tpot_s == pytest.approx(0.1)
    assert rec(0.5, 0.5, 1).tpot_s == 0.0
    assert RequestRecord.from_dict(rec(0.5, 1.5, 11).to_dict()).tpot_s == pytest.approx(0.1)


def test_summary_throughput_goodput_and_failures() -> None:
    records = [
        rec(0.2, 0.2 + 0.05 * 9, 10),  # good: TTFT 0.2 s, TPOT 50 ms
        rec(1.5, 1.5 + 0.05 * 9, 10),  # TTFT over 1 s
        rec(0.2, 0.2 + 0.2 * 9, 10),  # TPOT 200 ms over 100 ms
        rec(0.0, 0.1, 0, ok=False),
    ]
    records[3].error = "boom"
    s = summarize(records, wall_s=2.0)
    assert (s["requests"], s["ok"], s["failed"]) == (4, 3, 1)
    assert s["output_tokens"] == 30
    assert s["output_tok_per_s"] == pytest.approx(15.0)
    assert s["req_per_s"] == pytest.approx(1.5)
    assert s["goodput_req_per_s"] == pytest.approx(0.5)
    assert s["goodput_fraction"] == pytest.approx(0.25)
    assert s["errors"] == {"500: boom": 1}
    assert s["ttft_s"]["p50"] == pytest.approx(0.2)
    assert s["itl_s"]["p50"] == pytest.approx(0.01)
    # Looser SLOs make every successful request good.
    loose = summarize(records, wall_s=2.0, slo=SLO(ttft_s=2.0, tpot_s=0.5))
    assert loose["goodput_req_per_s"] == pytest.approx(1.5)
    assert loose["slo"] == {"ttft_s": 2.0, "tpot_s": 0.5}


def test_ratio_nan_safe() -> None:
    assert ratio(6.0, 3.0) == 2.0
    assert math.isnan(ratio(1.0, 0.0))
    assert math.isnan(ratio(float("nan"), 1.0))


def test_poisson_arrivals_seeded_and_bounded() -> None:
    a = shapes.poisson_arrivals(4.0, 200, seed=7)
    assert a == shapes.poisson_arrivals(4.0, 200, seed=7)
    assert a != shapes.poisson_arrivals(4.0, 200, seed=8)
    assert len(a) == 200 and all(x < y for x, y in itertools.pairwise(a))
    assert a[-1] / len(a) == pytest.approx(1 / 4.0, rel=0.25)  # mean gap ≈ 1/rate
    bounded = shapes.poisson_arrivals(4.0, 10_000, seed=7, time_limit_s=5.0)
    assert 0 < len(bounded) < 10_000 and bounded[-1] < 5.0
    assert bounded == a[: len(bounded)]  # the same process, cut at the limit
    with pytest.raises(ValueError):
        shapes.poisson_arrivals(0, 5, seed=0)


def test_batch_plan() -> None:
    assert shapes.batch_plan(20, 8) == [list(range(8)), list(range(8, 16)), [16, 17, 18, 19]]
    assert shapes.batch_plan(0, 8) == []
    with pytest.raises(ValueError):
        shapes.batch_plan(4, 0)


class FakeServer:
    """Records when each body was sent and how many were in flight; replies after ``delay``."""

    def __init__(self, delay: float = 0.02) -> None:
        self.delay, self.in_flight, self.peak = delay, 0, 0
        self.sent: list[tuple[float, int]] = []

    async def send(self, body: dict[str, Any]) -> RequestRecord:
        self.sent.append((time.perf_counter(), body["i"]))
        self.in_flight += 1
        self.peak = max(self.peak, self.in_flight)
        await asyncio.sleep(self.delay * (1 + body["i"] % 3))
        self.in_flight -= 1
        return rec(0.001, self.delay, 4)


def bodies(n: int) -> list[dict[str, Any]]:
    return [{"i": i} for i in range(n)]


def test_static_batches_wait_for_the_whole_batch() -> None:
    server = FakeServer()
    records, wall = asyncio.run(shapes.static_batches(server.send, bodies(20), 8))
    assert [r.index for r in records] == list(range(20))
    assert server.peak == 8
    order = [i for _, i in sorted(server.sent)]
    # Nothing of batch k+1 is sent before every request of batch k was sent (and finished).
    assert sorted(order[:8]) == list(range(8)) and sorted(order[8:16]) == list(range(8, 16))
    starts = {r.index: r.start_s for r in records}
    ends = {r.index: r.start_s + r.latency_s for r in records}
    assert min(starts[i] for i in range(8, 16)) >= max(ends[i] for i in range(8)) - 0.02
    assert wall > 0


def test_closed_loop_keeps_concurrency_and_count() -> None:
    server = FakeServer()
    records, _ = asyncio.run(shapes.closed_loop(server.send, bodies(30), 4))
    assert len(records) == 30 and server.peak == 4
    assert sorted(r.index for r in records) == list(range(30))


def test_time_limit_bounds_every_shape() -> None:
    server = FakeServer(delay=0.05)
    records, wall = asyncio.run(shapes.closed_loop(server.send, bodies(1000), 2, 0.2))
    assert 0 < len(records) < 1000 and wall < 1.0
    records, _ = asyncio.run(shapes.open_loop(server.send, bodies(1000), 50.0, 1, 0.3))
    assert 0 < len(records) < 1000
    records, _ = asyncio.run(shapes.static_batches(server.send, bodies(1000), 8, 0.2))
    assert 0 < len(records) < 1000 and len(records) % 8 == 0


def test_open_loop_follows_seeded_arrivals() -> None:
    server = FakeServer(delay=0.01)
    records, _ = asyncio.run(shapes.open_loop(server.send, bodies(10), 40.0, seed=3))
    expected = shapes.poisson_arrivals(40.0, 10, seed=3)
    assert len(records) == 10
    for r, offset in zip(records, expected, strict=True):
        assert r.start_s == pytest.approx(offset, abs=0.05)


@pytest.mark.parametrize("name", sorted(workloads.WORKLOADS))
def test_workloads_are_seeded_chat_bodies(name: str) -> None:
    a = workloads.build(name, "m", 5, 16, seed=1)
    assert a == workloads.build(name, "m", 5, 16, seed=1)
    assert len(a) == 5 and all(b["model"] == "m" and b["max_tokens"] == 16 for b in a)
    assert all(b["messages"][-1]["role"] == "user" for b in a)
    json.dumps(a)


def test_workload_specifics() -> None:
    s = workloads.build("sentiment", "m", 2, 32, 0)[0]
    assert s["response_format"]["type"] == "json_schema"
    assert len(workloads.build("contracts", "m", 100, 8, 0)) == 100
    shared = workloads.build("shared_prefix", "m", 3, 8, 0)
    assert len({b["messages"][0]["content"] for b in shared}) == 1
    assert len(workloads.build("longdoc", "m", 1, 8, 0)[0]["messages"][0]["content"]) > 5000
    assert all(b["ignore_eos"] for b in workloads.build("random", "m", 3, 8, 0))
    with pytest.raises(ValueError):
        workloads.build("nope", "m", 1, 1, 0)


def test_suites_are_bounded() -> None:
    for name, make in suite.SUITES.items():
        phases = make([1, 8, 32, 64, 128], [1.0, 4.0])
        assert {p.group for p in phases} == {"sweep", "modes", "scenario", "open"}, name
        assert all(p.requests > 0 and p.time_limit_s > 0 for p in phases)
    default = suite.default_suite([1, 8, 32, 64, 128], [1.0])
    assert [p.name for p in default[:2]] == ["closed c=1", "closed c=64"]
    assert all(p.max_tokens <= 64 for p in default)


def test_run_phases_skips_after_budget() -> None:
    server = FakeServer(delay=0.01)
    phases = [
        suite.Phase("a", "sweep", "random", "closed", 2, 4, 8, 5),
        suite.Phase("b", "sweep", "random", "closed", 2, 4, 8, 5),
    ]

    async def send(body: dict[str, Any]) -> RequestRecord:
        await asyncio.sleep(0.3)
        return rec(0.01, 0.3, 8)

    out = asyncio.run(suite.run_phases(send, phases, "m", 0, budget_s=1.5))
    assert len(out[0]["records"]) >= 2 and out[1]["skipped"]
    del server


def test_vllm_cli_flags() -> None:
    flags = vllm_cli_flags(
        {"model": "/m", "enable_prefix_caching": False, "enforce_eager": True,
         "max_num_seqs": 8, "structured_outputs_config": {"backend": "xgrammar"}}
    )  # fmt: skip
    assert flags == ["--model", "/m", "--no-enable-prefix-caching", "--enforce-eager",
                     "--max-num-seqs", "8", "--structured-outputs-config",
                     '{"backend": "xgrammar"}']  # fmt: skip


def synthetic_results() -> dict[str, Any]:
    def phase(name: str, group: str, value: float, ttft: float, tokens: int) -> dict[str, Any]:
        records = [rec(ttft * (1 + i / 10), 1.0 + i / 10, tokens) for i in range(10)]
        return {"name": name, "group": group, "shape": "closed", "value": value,
                "records": [r.to_dict() for r in records], "wall_s": 2.0,
                "summary": summarize(records, 2.0)}  # fmt: skip

    def target(scale: float) -> dict[str, Any]:
        return {"status": "ok", "startup_s": 30.0, "phases": [
            phase("closed c=1", "sweep", 1, 0.05 * scale, 16),
            phase("closed c=64", "sweep", 64, 0.4 * scale, int(64 / scale)),
            phase("single request", "modes", 1, 0.05, 16),
            phase("continuous c=64", "modes", 64, 0.3, 160),
            phase("poisson 2/s", "open", 2, 0.1, 16),
        ]}  # fmt: skip

    return {
        "meta": {"started": "t", "suite": "default", "model": "m", "seed": 0,
                 "slo": {"ttft_s": 1.0, "tpot_s": 0.1}},
        "targets": {"ours": target(1.25), "vllm": target(1.0), "asyncllm": target(0.8),
                    "rayllm": {"status": "failed: x", "phases": []}},
    }  # fmt: skip


def test_report_writes_markdown_png_json(tmp_path: Path) -> None:
    results = synthetic_results()
    files = report.write(results, tmp_path / "out")
    for key in ("json", "markdown", "throughput_vs_concurrency", "ttft_cdf", "latency_vs_load"):
        assert files[key].exists() and files[key].stat().st_size > 0, key
    assert files["throughput_vs_concurrency"].read_bytes()[:4] == b"\x89PNG"
    md = files["markdown"].read_text()
    assert "| ours | closed c=64 |" in md and "failed: x" in md
    data = json.loads(files["json"].read_text())
    r = data["ratios"]
    assert r["ours continuous c=64 / single-request tok/s (contracts)"] == pytest.approx(10.0)
    assert r["ours / vllm serve tok/s at c=64"] == pytest.approx(51 / 64)
    assert r["ours - AsyncLLM TTFT p50 at c=1 (ms)"] > 0
    assert r["ours / ray.serve.llm TTFT p50 at c=1"] is None or math.isnan(
        r["ours / ray.serve.llm TTFT p50 at c=1"]
    )


def test_lora_cost_phases_name_their_models() -> None:
    from loadtest.lora_cost import ADAPTERS, bodies

    mixed = bodies("mixed", "base", 6, 8, offset=0)
    assert [b["model"] for b in mixed] == ["base", *ADAPTERS] * 2
    assert {b["model"] for b in bodies("adapter", "base", 4, 8, 0)} == {ADAPTERS[0]}
    prompts = [b["messages"][0]["content"] for b in bodies("base", "base", 50, 8, 100)]
    assert len(set(prompts)) == 50 and all(b["ignore_eos"] for b in mixed)


def test_cpu_cost_counts_every_process_but_the_models_as_frontend() -> None:
    from loadtest.cpu_cost import MODEL_PROCESSES, table

    results = {
        "ours": {
            "requests_ok": 10,
            "output_tokens": 1000,
            "cpu_s": {MODEL_PROCESSES: 5.0, "Router replica": 0.3, "Serve proxy": 0.1},
        },
        "vllm": {
            "requests_ok": 10,
            "output_tokens": 1000,
            "cpu_s": {MODEL_PROCESSES: 5.0, "vllm serve API server": 0.1},
        },
    }
    text = table(results)
    assert results["ours"]["frontend_us_per_token"] == pytest.approx(400)
    assert results["vllm"]["frontend_us_per_token"] == pytest.approx(100)
    assert "ours / vllm serve: 4.00x" in text


def test_cpu_cost_above_idle_takes_each_roles_idle_rate_out() -> None:
    from loadtest.cpu_cost import MODEL_PROCESSES, table

    def result(cpu: dict[str, float], idle: dict[str, float]) -> dict[str, Any]:
        return {
            "requests_ok": 10,
            "output_tokens": 1000,
            "cpu_s": cpu,
            "load_s": 10.0,
            "idle_cpu_per_s": idle,
        }

    results = {
        # The controller polls at 2 % of a core: 0.2 s of its 0.25 s are idle cost.
        "ours": result(
            {MODEL_PROCESSES: 5.0, "Router replica": 0.3, "Serve controller": 0.25},
            {MODEL_PROCESSES: 0.5, "Router replica": 0.0, "Serve controller": 0.02},
        ),
        "vllm": result({"vllm serve API server": 0.12}, {"vllm serve API server": 0.002}),
    }
    text = table(results)
    assert results["ours"]["frontend_us_per_token"] == pytest.approx(550)
    assert results["ours"]["frontend_above_idle_us_per_token"] == pytest.approx(350)
    assert results["vllm"]["frontend_above_idle_us_per_token"] == pytest.approx(100)
    assert "above idle, ours / vllm serve: 3.50x" in text


def test_repeats_report_medians_per_phase_and_mark_the_slower_ones() -> None:
    from loadtest import repeats

    def run(ours: dict[str, float], vllm: dict[str, float], startup: float) -> dict[str, Any]:
        def phases(values: dict[str, float]) -> list[dict[str, Any]]:
            return [{"name": n, "summary": {"output_tok_per_s": v}} for n, v in values.items()]

        return {
            "targets": {
                "ours": {"phases": phases(ours), "startup_s": startup},
                "vllm": {"phases": phases(vllm), "startup_s": 20.0},
            }
        }

    runs = [
        run({"c=1": 10.0, "c=8": 50.0}, {"c=1": 10.0, "c=8": 40.0}, 30.0),
        run({"c=1": 9.0, "c=8": 5.0}, {"c=1": 10.0, "c=8": 40.0}, 34.0),  # One bad run at c=8.
        run({"c=1": 9.5, "c=8": 48.0}, {"c=1": 10.0, "c=8": 40.0}, 32.0),
    ]
    ratios = repeats.phase_ratios(runs)["vllm serve"]
    assert ratios == {"c=1": pytest.approx(0.95), "c=8": pytest.approx(1.2)}
    assert repeats.startup_s(runs) == {"ours": 32.0, "vllm": 20.0}
    text = repeats.table(runs)
    assert "c=1" in text and "0.95x  ◀ below" in text
    assert "1.20x" in text and "1.20x  ◀" not in text


def test_startup_breakdown_splits_the_start_at_the_logs_markers(tmp_path: Path) -> None:
    from datetime import datetime

    from loadtest import startup_breakdown as sb

    log = tmp_path / "vllm.log"
    log.write_text(
        "(APIServer pid=1) INFO 12-07 03:00:10 [model.py:733] Resolved architecture: X\n"
        "(EngineCore pid=2) INFO 12-07 03:00:18 [core.py:1] Initializing a V1 LLM engine\n"
        "(Worker pid=3) INFO 12-07 03:00:27 [r.py:1] Starting to load model /m...\n"
        "(EngineCore pid=2) INFO 12-07 03:00:33 [core.py:2] init engine (profile, create kv "
        "cache, warmup model) took 3.6 s\n"
    )
    started = datetime(2026, 12, 7, 3, 0, 2).timestamp()
    result = sb.phases("vllm", log, started, started + 35.5)
    assert list(result["phases"].values()) == [8.0, 8.0, 9.0, 6.0, 4.5]
    assert result["total_s"] == 35.5
    assert sb.stamp("INFO 2026-12-07 03:00:20,250 serve 9 -- Started Serve", 2026) == (
        datetime(2026, 12, 7, 3, 0, 20).timestamp() + 0.25
    )
    text = sb.table({"ours": [result | {"phases": {"Ray + Serve up": 5.0}}], "vllm": [result]})
    assert "Ray + Serve up" in text and "ours/vllm: 1.00x" in text


def test_cpu_cost_variants_change_dotted_app_args_only() -> None:
    from loadtest.cpu_cost import parse_variant, with_overrides

    name, overrides = parse_variant("nochan:engine.output_channels=false,router.num_cpus=0.2")
    assert name == "nochan"
    app = {"engine": {"device": "cpu"}, "model": {"name": "m"}}
    changed = with_overrides(app, overrides)
    assert changed == {
        "engine": {"device": "cpu", "output_channels": False},
        "model": {"name": "m"},
        "router": {"num_cpus": 0.2},
    }
    assert app == {"engine": {"device": "cpu"}, "model": {"name": "m"}}
    assert parse_variant("x:model.name=tiny-qwen2")[1] == {"model.name": "tiny-qwen2"}


def test_profiles_fold_counts_a_function_once_per_stack_and_leaves_as_self(tmp_path) -> None:
    from loadtest.profiles import RATE_HZ, fold, summary

    path = tmp_path / "r.folded"
    path.write_text(
        "process 1:x;thread (0x1): MainThread;run (a.py);step (b.py);run (a.py) 3\n"
        "run (a.py);dump (c.py) 1\n"
        "garbage\n"
    )
    total, inclusive, leaf = fold(path)
    assert total == 4
    assert inclusive == {"run (a.py)": 4, "step (b.py)": 3, "dump (c.py)": 1}
    assert leaf == {"run (a.py)": 3, "dump (c.py)": 1}
    text = summary(path, output_tokens=1)
    assert f"{4 * 1e6 / RATE_HZ:.0f} µs/token" in text and "75.0%" in text

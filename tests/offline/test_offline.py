"""Offline jobs end to end: Ray Data + the serving Preprocessor + vLLM CPU + the real SmolLM2.

A 1,000-row corpus (short prompts, max_tokens 4–8) runs in about a minute on 2 CPU cores.
"""

from __future__ import annotations

import collections
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from loadtest.batch_offline import bad_ids, corpus_rows, write_corpus
from serve_app.offline import JobConfig, JobSummary, run_job
from serve_app.offline.__main__ import app_config
from serve_app.offline.output import read_rows

pytestmark = pytest.mark.serve

ROOT = Path(__file__).resolve().parents[2]
CONFIG = str(ROOT / "serve_config.cpu.yaml")
ROWS = 1000
KILLED_ROWS = 400  # Enough for the kill to land mid-job (after 3 of 13 parts).


@pytest.fixture(scope="module")
def finished(tmp_path_factory: pytest.TempPathFactory) -> tuple[JobSummary, list[dict[str, Any]]]:
    import ray

    tmp = tmp_path_factory.mktemp("batch")
    corpus = write_corpus(tmp / "corpus.jsonl", ROWS, bad=True)
    started_ray = not ray.is_initialized()
    config = app_config(CONFIG)
    config.engine.kv_cache_space_gib = 1
    job = JobConfig(input=str(corpus), output=str(tmp / "out"), temperature=0.0, app_config=config)
    try:
        summary = run_job(job)
    finally:
        if started_ray:
            ray.shutdown()
    return summary, read_rows(str(tmp / "out"))


def test_every_id_exactly_once(finished: tuple[JobSummary, list[dict[str, Any]]]) -> None:
    summary, rows = finished
    counts = collections.Counter(row["id"] for row in rows)
    assert set(counts) == {row["id"] for row in corpus_rows(ROWS)}
    assert max(counts.values()) == 1
    assert summary.rows == ROWS and not summary.interrupted
    assert summary.rows_failed == len(bad_ids(ROWS))


def test_good_rows_have_output_and_usage(
    finished: tuple[JobSummary, list[dict[str, Any]]],
) -> None:
    summary, rows = finished
    limits = {row["id"]: row.get("max_tokens") for row in corpus_rows(ROWS)}
    good = [row for row in rows if row["error"] is None]
    assert len(good) == ROWS - len(bad_ids(ROWS))
    for row in good:
        assert row["output"] and row["prompt_tokens"] > 0
        assert 1 <= row["completion_tokens"] <= limits[row["id"]]
        assert row["finish_reason"] in ("stop", "length")
    assert summary.completion_tokens == sum(row["completion_tokens"] for row in good)


def test_bad_rows_land_in_the_error_column(
    finished: tuple[JobSummary, list[dict[str, Any]]],
) -> None:
    _, rows = finished
    errors = {row["id"]: row["error"] for row in rows if row["error"] is not None}
    assert set(errors) == bad_ids(ROWS)
    assert "missing column 'prompt'" in errors["row-00010"]
    assert "maximum context length" in errors["row-00020"]
    assert "temperature" in errors["row-00030"]
    assert "max_tokens" in errors["row-00040"]
    assert all(row["output"] is None for row in rows if row["error"] is not None)


def test_bad_input_lines_are_error_rows_and_the_rest_run(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """A malformed line and a non-UTF-8 line: two error rows with their line numbers."""
    import ray

    good = corpus_rows(6)
    lines = [json.dumps(row).encode() for row in good]
    lines[3:3] = [b"{broken"]  # line 4
    lines.append(b'{"id": "latin-1", "prompt": "caf\xe9"}')  # line 8: not UTF-8
    corpus = tmp_path / "bad-lines.jsonl"
    corpus.write_bytes(b"\n".join(lines) + b"\n")
    config = app_config(CONFIG)
    config.engine.kv_cache_space_gib = 1
    job = JobConfig(
        input=str(corpus), output=str(tmp_path / "out"), temperature=0.0, max_tokens=4,
        batch_size=8, app_config=config, progress=False,
    )  # fmt: skip
    started_ray = not ray.is_initialized()
    try:
        summary = run_job(job)
    finally:
        if started_ray:
            ray.shutdown()
    rows = {row["id"]: row for row in read_rows(str(tmp_path / "out"))}
    assert set(rows) == {row["id"] for row in good} | {"line:4", "line:8"}
    assert (summary.rows_ok, summary.rows_failed, summary.interrupted) == (6, 2, False)
    assert all(rows[row["id"]]["output"] and not rows[row["id"]]["error"] for row in good)
    assert rows["line:4"]["error"].startswith("input line 4 of bad-lines.jsonl: not valid JSON")
    assert rows["line:8"]["error"].startswith("input line 8 of bad-lines.jsonl: not UTF-8 text")
    assert rows["line:4"]["output"] is None and rows["line:8"]["output"] is None
    # One note per bad line on stderr, as the rows are written.
    err = capfd.readouterr().err  # capfd: Ray sees real file descriptors, as in the others
    assert "input line 4 of bad-lines.jsonl" in err and "input line 8 of bad-lines.jsonl" in err


def _cli(corpus: Path, out: Path, *extra: str) -> list[str]:
    return [
        sys.executable, "-m", "serve_app.offline", "run", "--input", str(corpus),
        "--output", str(out), "--temperature", "0", "--config", CONFIG,
        "--batch-size", "32", "--no-progress", "--summary-json", *extra,
    ]  # fmt: skip


def test_killed_job_resumes_without_loss_or_duplicates(tmp_path: Path) -> None:
    corpus = write_corpus(tmp_path / "corpus.jsonl", KILLED_ROWS)
    out = tmp_path / "out"
    env = os.environ | {"PYTHONPATH": str(ROOT)}
    # Own session: SIGKILL takes the driver, its local Ray cluster and the engine at once.
    # The killed run uses vLLM's separate engine processes (the GPU path), the re-run the
    # in-process CPU engine (the default here): both paths end to end on the real model.
    first = subprocess.Popen(
        _cli(corpus, out, "--no-in-process-engine"), cwd=ROOT, env=env, start_new_session=True,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 400
        while len(list(out.glob("part-*"))) < 3:
            assert first.poll() is None, "the job ended before it could be killed"
            assert time.monotonic() < deadline, "no part files after 400 s"
            time.sleep(0.2)
    finally:
        os.killpg(first.pid, signal.SIGKILL)
        first.wait()
    before = read_rows(str(out))
    assert 0 < len(before) < KILLED_ROWS, "kill the job midway"
    second = subprocess.run(
        _cli(corpus, out), cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )
    assert second.returncode == 0, second.stderr[-3000:]
    summary = json.loads(second.stdout.strip().splitlines()[-1])
    assert summary["rows_skipped"] == len(before)
    assert summary["rows_ok"] + summary["rows_failed"] == KILLED_ROWS - len(before)
    counts = collections.Counter(row["id"] for row in read_rows(str(out)))
    lost = {row["id"] for row in corpus_rows(KILLED_ROWS)} - set(counts)
    duplicated = [rid for rid, n in counts.items() if n > 1]
    assert (lost, duplicated) == (set(), [])
    # The rows finished before the kill are untouched.
    after = {row["id"]: row for row in read_rows(str(out))}
    assert all(after[row["id"]] == row for row in before)


def test_rows_run_with_the_lora_adapter_their_column_names(tmp_path: Path) -> None:
    """The CLI with an adapter built here: base rows and adapter rows share engine steps (the
    CPU LoRA fix keeps the adapter off the base rows); a row naming no adapter of the model is
    an error row, the rest run."""
    from serve_app.models import resolve_model
    from serve_app.models.lora_adapter import build_lora_adapter

    poet = build_lora_adapter(resolve_model("smollm2-135m-instruct"), tmp_path / "poet", seed=2)
    paris = "What is the capital of France? Answer in one word."
    rows = [{"id": f"base-{i}", "prompt": paris} for i in range(3)]
    rows += [{"id": f"poet-{i}", "prompt": paris, "lora": "poet"} for i in range(3)]
    rows += [{"id": "sonnet", "prompt": paris, "lora": "sonnet"}]
    corpus = tmp_path / "adapters.jsonl"
    corpus.write_text("".join(json.dumps(row) + "\n" for row in rows))
    out = tmp_path / "out"
    cli = _cli(corpus, out, "--lora-adapter", f"poet={poet}", "--adapter-column", "lora")
    env = os.environ | {"PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [*cli, "--max-tokens", "8"], cwd=ROOT, env=env, capture_output=True, text=True,
        timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    got = {row["id"]: row for row in read_rows(str(out))}
    assert set(got) == {row["id"] for row in rows}
    for i in range(3):
        assert "Paris" in got[f"base-{i}"]["output"], got
        assert got[f"poet-{i}"]["output"] and "Paris" not in got[f"poet-{i}"]["output"], got
    assert "'sonnet' is not an adapter of the model (it has poet)" in got["sonnet"]["error"]

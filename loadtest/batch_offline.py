"""Offline throughput on one corpus: our Ray Data job vs ``vllm.LLM.generate`` vs ``ray.data.llm``.

Same model, same engine arguments (``serve_app.engine.engine_args.engine_args``), same prompts and
per-row max_tokens, measured side by side in one run:
``python -m loadtest.batch_offline --rows 1000 --config serve_config.cpu.yaml --repeats 3``.

Each target runs in a fresh Python process, timed from its launch to its last output row: what
a user waits for (imports, Ray and engine start included for every target alike). Repeats
alternate the targets and the report gives each one's median.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

TOPICS = ["the sea", "a cat", "rain", "a city", "bread", "a robot", "the moon", "a river"]


def corpus_rows(count: int, bad: bool = False) -> list[dict[str, Any]]:
    """Short prompts, max_tokens 4–8; with ``bad`` a few rows each job must report as errors."""
    rows: list[dict[str, Any]] = [
        {
            "id": f"row-{i:05d}",
            "prompt": f"Name one fact about {TOPICS[i % len(TOPICS)]} (#{i}).",
            "max_tokens": 4 + i % 5,
        }
        for i in range(count)
    ]
    if bad:
        rows[10] = {"id": rows[10]["id"], "max_tokens": 4}  # no prompt
        rows[20]["prompt"] = "word " * 6000  # longer than the context window
        rows[30]["temperature"] = -1.0  # invalid
        rows[40]["max_tokens"] = 0  # invalid
    return rows


def bad_ids(count: int) -> set[str]:
    return {f"row-{i:05d}" for i in (10, 20, 30, 40) if i < count}


def write_corpus(path: str | Path, count: int, bad: bool = False) -> Path:
    path = Path(path)
    with path.open("w") as handle:
        for row in corpus_rows(count, bad):
            handle.write(json.dumps(row) + "\n")
    return path


@dataclass
class Result:
    name: str
    rows: int
    output_tokens: int
    seconds: float

    def line(self, base: Result | None) -> str:
        ratio = "" if base is None else f"  ({self.tok_s / base.tok_s:.2f}x of {base.name})"
        return (
            f"{self.name:<26} {self.rows:>6} rows {self.seconds:>8.1f} s "
            f"{self.rows / self.seconds:>8.2f} rows/s {self.tok_s:>8.1f} out tok/s{ratio}"
        )

    @property
    def tok_s(self) -> float:
        return self.output_tokens / self.seconds


def run_ours(corpus: Path, config_path: str | None, batch_size: int, launched: float) -> Result:
    from serve_app.offline import JobConfig, run_job
    from serve_app.offline.__main__ import app_config

    with tempfile.TemporaryDirectory() as out:
        job = JobConfig(
            input=str(corpus),
            output=out,
            temperature=0.0,
            batch_size=batch_size,
            app_config=app_config(config_path),
            progress=False,
        )
        summary = run_job(job)  # Starts its own local Ray, as `python -m serve_app.offline` does.
    seconds = time.time() - launched
    return Result("serve_app.offline", summary.rows, summary.completion_tokens, seconds)


def _engine_env(config_path: str | None) -> tuple[Any, dict[str, Any]]:
    from serve_app.engine.engine_args import engine_args
    from serve_app.models import resolve_model
    from serve_app.offline.__main__ import app_config

    config = app_config(config_path)
    os.environ.update(config.engine.runtime_env_vars())
    return config, engine_args(config, resolve_model(config.model.name))


def run_vllm(
    corpus: Path, config_path: str | None, launched: float, in_process: bool = False
) -> Result:
    """vLLM's offline API as documented; ``in_process``: with its engine core and model worker
    in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), the mode our CPU engine actors use."""
    if in_process:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams

    _, args = _engine_env(config_path)
    rows = [json.loads(line) for line in corpus.read_text().splitlines()]
    llm = LLM(**args)
    messages = [[{"role": "user", "content": row["prompt"]}] for row in rows]
    params = [SamplingParams(max_tokens=row["max_tokens"], temperature=0.0) for row in rows]
    outputs = llm.chat(cast(Any, messages), params, use_tqdm=False)
    seconds = time.time() - launched
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    name = "vllm.LLM.chat" + (" in-process" if in_process else "")
    return Result(name, len(rows), tokens, seconds)


def run_ray_data_llm(
    corpus: Path, config_path: str | None, batch_size: int, launched: float
) -> Result:
    import ray
    import ray.data
    from ray.data.llm import build_processor, vLLMEngineProcessorConfig

    ray.init(address="local", include_dashboard=False, log_to_driver=False)
    config, args = _engine_env(config_path)
    model = args.pop("model")
    args.pop("served_model_name", None)
    # CPU only: one engine actor with the same fractional CPU as ours (no GPU bundle), and
    # small CPU stages so that every stage fits on a 2-core machine.
    stage = {"num_cpus": 0.1, "concurrency": 1}
    processor_config = vLLMEngineProcessorConfig(
        model_source=model,
        engine_kwargs=args,
        batch_size=batch_size,
        concurrency=1,
        accelerator_type=None,
        runtime_env={"env_vars": config.engine.runtime_env_vars()},
        placement_group_config={"bundles": [{"CPU": config.engine.num_cpus}]},
        chat_template_stage=stage,
        tokenize_stage=stage,
        detokenize_stage=stage,
    )
    processor = build_processor(
        processor_config,
        preprocess=lambda row: {
            "messages": [{"role": "user", "content": row["prompt"]}],
            "sampling_params": {"max_tokens": int(row["max_tokens"]), "temperature": 0.0},
        },
        postprocess=lambda row: {"tokens": len(row.get("generated_tokens") or [])},
    )
    out = processor(ray.data.read_json(str(corpus))).take_all()
    seconds = time.time() - launched
    return Result("ray.data.llm", len(out), sum(r["tokens"] for r in out), seconds)


TARGETS = ("ours", "vllm", "vllm-inproc", "raydata")


def run_target(name: str, corpus: Path, args: argparse.Namespace) -> Result:
    """One target in this process (``--target``), timed from ``--launched``."""
    if name == "ours":
        return run_ours(corpus, args.config, args.batch_size, args.launched)
    if name in ("vllm", "vllm-inproc"):
        return run_vllm(corpus, args.config, args.launched, in_process=name == "vllm-inproc")
    return run_ray_data_llm(corpus, args.config, args.batch_size, args.launched)


def spawn_target(name: str, corpus: Path, args: argparse.Namespace) -> Result:
    """Run one target in a fresh interpreter, which writes its Result as JSON next to the corpus."""
    result_file = corpus.with_name(f"result-{name}.json")
    result_file.unlink(missing_ok=True)
    command = [sys.executable, "-m", "loadtest.batch_offline", "--target", name]
    command += ["--corpus", str(corpus), "--config", args.config, "--result", str(result_file)]
    command += ["--batch-size", str(args.batch_size), "--launched", repr(time.time())]
    # Files, not pipes: an engine process that outlives the child must not hold us up.
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile("w+") as err:
        child = subprocess.Popen(command, stdout=out, stderr=err, start_new_session=True)
        try:
            code = child.wait(timeout=args.timeout)
        finally:
            with contextlib.suppress(ProcessLookupError):  # Its engine and Ray processes too.
                os.killpg(child.pid, signal.SIGKILL)
        if not result_file.exists():
            err.seek(0)
            raise RuntimeError(f"exit {code}: {err.read().strip()[-2000:]}")
    return Result(**json.loads(result_file.read_text()))


def median_result(runs: list[Result]) -> Result:
    seconds = statistics.median(r.seconds for r in runs)
    return Result(runs[0].name, runs[0].rows, runs[0].output_tokens, seconds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1000)
    parser.add_argument("--config", default="serve_config.cpu.yaml")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=1, help="alternating runs per target")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per target run")
    parser.add_argument("--skip", nargs="*", default=[], choices=TARGETS)
    parser.add_argument("--target", choices=TARGETS, help=argparse.SUPPRESS)
    parser.add_argument("--corpus", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--launched", type=float, help=argparse.SUPPRESS)
    parser.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.target:  # A child: run one target, print its Result.
        result = run_target(args.target, args.corpus, args)
        args.result.write_text(json.dumps(result.__dict__))
        return
    runs: dict[str, list[Result]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        corpus = write_corpus(Path(tmp) / "corpus.jsonl", args.rows)
        for repeat in range(args.repeats):
            for name in TARGETS:
                if name in args.skip:
                    continue
                try:
                    result = spawn_target(name, corpus, args)
                except Exception as exc:  # Report and keep measuring the others.
                    print(f"{name} (run {repeat + 1}): failed: {exc}", flush=True)
                    continue
                runs.setdefault(name, []).append(result)
                print(f"run {repeat + 1}: {result.line(None)}", flush=True)
    results = [median_result(r) for r in runs.values()]
    print(
        "\nseconds from each process's launch to its last row (imports and engine start "
        f"included); median of {args.repeats} alternating run(s)"
    )
    base = next((r for r in results if r.name == "vllm.LLM.chat"), None)
    for result in results:
        print(result.line(base if result is not base else None))
    ours = next((r for r in results if r.name == "serve_app.offline"), None)
    for other in results:
        if ours is not None and other is not ours:
            print(f"serve_app.offline / {other.name}: {ours.tok_s / other.tok_s:.2f}x")


if __name__ == "__main__":
    main()

"""``run_job``: read a corpus with Ray Data, map it through engine actors, append part files.

The driver consumes the mapped dataset with ``iter_batches`` and writes each finished batch as
one part file, so output appears as batches finish and a re-run resumes where it stopped.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from dataclasses import asdict, dataclass
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from serve_app.offline.input_files import check_input, read_input
from serve_app.offline.input_rows import is_bad_line
from serve_app.offline.output import PartWriter
from serve_app.offline.rows import JobConfig

logger = logging.getLogger("serve_app.batch")
NOTED_LINES = 20  # Bad input lines named on stderr; the rest are counted (all are in the output).


@dataclass
class JobSummary:
    rows_ok: int = 0
    rows_failed: int = 0
    rows_skipped: int = 0  # Already in the output from an earlier run.
    prompt_tokens: int = 0
    completion_tokens: int = 0
    wall_s: float = 0.0
    interrupted: bool = False

    @property
    def rows(self) -> int:
        return self.rows_ok + self.rows_failed

    @property
    def rows_per_s(self) -> float:
        return self.rows / self.wall_s if self.wall_s else 0.0

    @property
    def output_tokens_per_s(self) -> float:
        return self.completion_tokens / self.wall_s if self.wall_s else 0.0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self) | {
            "rows_per_s": round(self.rows_per_s, 2),
            "output_tokens_per_s": round(self.output_tokens_per_s, 2),
        }

    def text(self) -> str:
        state = "interrupted" if self.interrupted else "done"
        return (
            f"{state}: {self.rows_ok} ok, {self.rows_failed} failed, {self.rows_skipped} already "
            f"done; {self.prompt_tokens} prompt + {self.completion_tokens} output tokens in "
            f"{self.wall_s:.1f} s ({self.rows_per_s:.1f} rows/s, "
            f"{self.output_tokens_per_s:.1f} output tok/s)"
        )


def drop_done(batch: pa.Table, id_column: str, done: list[str]) -> pa.Table:
    """Rows whose id is not in ``done`` (ids compared as strings; rows without id kept)."""
    if not done or id_column not in batch.column_names:
        return batch
    ids = pc.cast(batch.column(id_column), pa.string())
    seen = pc.is_in(ids, value_set=pa.array(done, pa.string()))
    return batch.filter(pc.invert(pc.fill_null(seen, False)))


def actor_options(job: JobConfig) -> dict[str, Any]:
    """Resources of one engine actor, from the same config as the serving engine."""
    engine = job.app_config.engine
    gpus = 0.0
    if engine.resolved_device() == "gpu":
        # TP/PP > 1: vLLM's Ray executor places its own GPU workers.
        gpus = 1.0 if engine.world_size == 1 else 0.0
    env = engine.runtime_env_vars()
    if job.engine_in_process():
        from serve_app.offline.inproc_engine import IN_PROCESS_ENV

        env |= IN_PROCESS_ENV
    options: dict[str, Any] = {
        "num_cpus": engine.num_cpus,
        "num_gpus": gpus,
        "runtime_env": {"env_vars": env},
    }
    if engine.resources:
        options["resources"] = dict(engine.resources)
    return options


def _init_ray(job: JobConfig) -> None:
    import ray

    if not ray.is_initialized():
        ray.init(address=job.ray_address, include_dashboard=False, log_to_driver=False)


def run_job(job: JobConfig) -> JobSummary:
    """Run (or resume) a job. A missing or unreadable input raises InputError before Ray starts."""
    spec = check_input(job.input)
    import ray.data

    from serve_app.offline.worker import EngineWorker

    started = time.perf_counter()
    writer = PartWriter(job.output, job.format)
    summary = JobSummary(rows_skipped=writer.resumed)
    _init_ray(job)
    context = ray.data.DataContext.get_current()
    context.enable_progress_bars = False
    ds = read_input(spec, job.id_column)
    done = sorted(writer.done_ids)
    todo = ds.map_batches(
        drop_done, batch_format="pyarrow", fn_kwargs={"id_column": job.id_column, "done": done}
    )
    # One block per engine batch: each finished batch reaches the driver (and a part file)
    # on its own instead of waiting for the rest of its input file.
    todo = todo.repartition(target_num_rows_per_block=job.batch_size)
    mapped = todo.map_batches(
        EngineWorker,
        fn_constructor_kwargs={"job": job},
        batch_size=job.batch_size,
        batch_format="pyarrow",
        compute=ray.data.ActorPoolStrategy(
            size=job.concurrency, max_concurrent_calls_per_actor=job.batches_in_flight
        ),
        **actor_options(job),
    )
    bar = _progress(ds, writer.resumed, job.progress)
    bad_lines = 0
    try:
        for batch in mapped.iter_batches(batch_size=None, batch_format="pyarrow"):
            written = writer.write(batch.to_pylist())
            for row in written:
                if row["error"] is None:
                    summary.rows_ok += 1
                else:
                    summary.rows_failed += 1
                if is_bad_line(row["error"]):
                    bad_lines += 1
                    if bad_lines <= NOTED_LINES:
                        _note(bar, row["error"])
                summary.prompt_tokens += row["prompt_tokens"] or 0
                summary.completion_tokens += row["completion_tokens"] or 0
            if bar is not None:
                elapsed = time.perf_counter() - started
                bar.update(len(written))
                bar.set_postfix(
                    failed=summary.rows_failed,
                    out_tok_s=f"{summary.completion_tokens / elapsed:.1f}",
                )
    except KeyboardInterrupt:
        summary.interrupted = True
    finally:
        if bad_lines > NOTED_LINES:
            _note(
                bar,
                f"{bad_lines - NOTED_LINES} more bad input lines: see the output's error column",
            )
        if bar is not None:
            bar.close()
        summary.wall_s = time.perf_counter() - started
    return summary


def _note(bar: Any, text: str) -> None:
    """One line on stderr, above the progress bar when there is one."""
    text = text if len(text) <= 300 else text[:297] + "..."
    if bar is not None:
        bar.write(text, file=sys.stderr)
    else:
        print(text, file=sys.stderr, flush=True)


def _progress(ds: Any, resumed: int, enabled: bool) -> Any:
    """A progress bar whose total arrives when a background count of the input finishes.

    Counting reads the input once more; the engine actors start meanwhile instead of after it.
    """
    if not enabled:
        return None
    from tqdm import tqdm

    bar = tqdm(unit="row", desc="batch", dynamic_ncols=True, smoothing=0.1)

    def count() -> None:
        try:
            bar.total = max(ds.count() - resumed, 0)
            bar.refresh()
        except Exception:  # A bar without a total still shows rows/s.
            logger.debug("counting the input failed", exc_info=True)

    threading.Thread(target=count, name="count-input", daemon=True).start()
    return bar

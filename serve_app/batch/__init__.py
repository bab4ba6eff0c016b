"""Offline batch jobs on Ray Data with the serving Preprocessor and vLLM engine.

``python -m serve_app.batch run --input corpus.jsonl --output out/`` or ``run_job(JobConfig)``.
"""

from __future__ import annotations

from serve_app.batch.rows import JobConfig
from serve_app.batch.runner import JobSummary, run_job

__all__ = ["JobConfig", "JobSummary", "run_job"]

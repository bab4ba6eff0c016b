"""Offline jobs over corpora on Ray Data, with the serving Preprocessor and vLLM engine.

``python -m serve_app.offline run --input corpus.jsonl --output out/`` or ``run_job(JobConfig)``.
"""

from __future__ import annotations

from serve_app.offline.rows import JobConfig
from serve_app.offline.runner import JobSummary, run_job

__all__ = ["JobConfig", "JobSummary", "run_job"]

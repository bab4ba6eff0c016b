"""Deprecated alias of :mod:`serve_app.offline` (offline Ray Data jobs), kept for one release."""

from __future__ import annotations

import warnings

from serve_app.offline import JobConfig, JobSummary, run_job

warnings.warn(
    "serve_app.batch is now serve_app.offline; the old name goes away in the next release",
    DeprecationWarning,
    stacklevel=2,
)

__all__ = ["JobConfig", "JobSummary", "run_job"]

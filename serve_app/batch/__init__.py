"""Old name of :mod:`serve_app.offline` (offline Ray Data jobs), kept for one release.

``from serve_app.batch import JobConfig, run_job`` and ``python -m serve_app.batch`` still work;
use ``serve_app.offline``.
"""

from __future__ import annotations

import warnings

from serve_app.offline import JobConfig, JobSummary, run_job

warnings.warn(
    "serve_app.batch is now serve_app.offline; the old name goes away in the next release",
    DeprecationWarning,
    stacklevel=2,
)

__all__ = ["JobConfig", "JobSummary", "run_job"]

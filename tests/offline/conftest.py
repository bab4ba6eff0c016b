"""Offline tier: Ray Data jobs and vLLM's engine in this very process (the in-process CPU engine).

vLLM's in-process engine leaves native threads behind; at interpreter teardown one of them
sometimes ends in ``std::terminate`` (seen once in a full run: "11 passed", then a native stack
trace and a non-zero exit). The job's own CLI is unaffected (its engines live in Ray actors; the
resume test checks its exit status). So once pytest has reported, this process leaves with
pytest's own status and skips the teardown, where no test runs any more.
"""

from __future__ import annotations

import os
import sys

import pytest

_status: list[int] = []


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    _status.append(int(exitstatus))


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config: pytest.Config) -> None:
    if _status:
        ray = sys.modules.get("ray")
        if ray is not None and ray.is_initialized():
            ray.shutdown()  # os._exit skips Ray's own atexit hook: no cluster outlives the tier.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(_status[-1])

"""The core split and the affinity helpers (this process only; no Ray, no vLLM)."""

from __future__ import annotations

import os

import pytest

from serve_app.config import cores
from serve_app.engine import cpu_pinning


def test_split_keeps_the_last_core_for_ray() -> None:
    assert cpu_pinning.split_cores({0, 1}) == ([0], [1])
    assert cpu_pinning.split_cores([3, 1, 2, 0]) == ([0, 1, 2], [3])
    assert cpu_pinning.split_cores({5}) is None
    assert cores.core_list([0, 1, 2]) == "0,1,2"


def test_engine_isolation_leaves_an_unconfined_process_alone() -> None:
    before = os.sched_getaffinity(0)
    bind = os.environ.get("VLLM_CPU_OMP_THREADS_BIND")
    for threads_bind in ("auto", "0", "nobind"):
        with cpu_pinning.engine_isolation(threads_bind):
            assert os.sched_getaffinity(0) == before
        assert os.environ.get("VLLM_CPU_OMP_THREADS_BIND") == bind


def test_ranks_get_a_core_list_each() -> None:
    assert cpu_pinning.per_rank([0, 1, 2, 3], 1) == "0,1,2,3"
    assert cpu_pinning.per_rank([0, 1, 2, 3], 2) == "0,1|2,3"
    assert cpu_pinning.per_rank([0, 1, 2, 3, 4], 2) == "0,1|2,3,4"
    assert cpu_pinning.per_rank([4, 5, 6, 7], 4) == "4|5|6|7"
    assert cpu_pinning.per_rank([1], 2) == "1|1"  # Fewer cores than ranks: shared.
    for text in ("0,1|2,3", "1|1"):
        assert cores.check_threads_bind(text) == text  # The form vLLM takes.


def test_several_ranks_on_an_unconfined_process_get_an_explicit_split(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """vLLM's 'auto' wants one NUMA node per rank: two ranks get '<cores>|<cores>' instead."""
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    before = os.sched_getaffinity(0)
    with cpu_pinning.engine_isolation("auto", ranks=2):
        assert os.sched_getaffinity(0) == before
        bind = os.environ["VLLM_CPU_OMP_THREADS_BIND"]
    assert bind == cpu_pinning.per_rank(sorted(before), 2) and "|" in bind


def test_core_lists_parse_like_vllm_and_bad_ones_are_refused() -> None:
    assert cores.parse_core_list("0-2,5") == [0, 1, 2, 5]
    assert cores.parse_core_list("3") == [3]
    for bad in ("", "a-b", "2-1", "-1", "0-"):
        with pytest.raises(ValueError, match="core list"):
            cores.parse_core_list(bad)


def test_in_process_model_uses_every_allowed_core_unless_bound() -> None:
    allowed = sorted(os.sched_getaffinity(0))
    assert cpu_pinning.in_process_cores("auto") == (allowed, False)
    assert cpu_pinning.in_process_cores("nobind") == (allowed, False)
    assert cpu_pinning.in_process_cores("0-1") == ([0, 1], True)


def test_confine_ray_pins_rays_processes_and_leaves_the_rest() -> None:
    import subprocess
    import sys
    import time

    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("one core: nothing to split")
    before = os.sched_getaffinity(0)
    target = [max(before)]
    sleep = "import time; time.sleep(60)"
    ray_like = subprocess.Popen([sys.executable, "-c", sleep, "ray-ish"])
    other = subprocess.Popen([sys.executable, "-c", sleep, "not-it"])
    try:
        time.sleep(0.5)
        assert cpu_pinning.confine_ray(target) == 1
        assert os.sched_getaffinity(ray_like.pid) == set(target)
        assert os.sched_getaffinity(other.pid) == before
        assert os.sched_getaffinity(0) == before  # The launcher itself stays.
    finally:
        for proc in (ray_like, other):
            proc.kill()
            proc.wait()


def test_engine_isolation_reads_the_launchers_split_before_ray_is_confined() -> None:
    """A replica started while Ray still runs on every core: the model gets the cores the
    launcher keeps off Ray, and the replica ends on Ray's."""
    import subprocess
    import sys

    allowed = sorted(os.sched_getaffinity(0))
    if len(allowed) < 2:
        pytest.skip("one core: nothing to split")
    script = (
        "import os\n"
        "from serve_app.engine import cpu_pinning\n"
        "with cpu_pinning.engine_isolation('auto'):\n"
        "    print(os.environ['VLLM_CPU_OMP_THREADS_BIND'])\n"
        "print(sorted(os.sched_getaffinity(0)))\n"
    )
    env = os.environ | {cpu_pinning.RAY_CORES_ENV: str(allowed[-1])}
    out = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True
    ).stdout.split("\n")
    assert out[0] == cores.core_list(allowed[:-1])
    assert out[1] == str([allowed[-1]])

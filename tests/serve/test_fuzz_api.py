"""Schemathesis against our own /openapi.json on the shared app: no 5xx, schema-conformant.

Positive and negative (schema-violating) cases for every operation; bodies keep the engine's
work tiny (max_tokens ≤ 4, n ≤ 2) so well over 1,000 cases run in a few minutes on CPU.
Failures are collected, not raised at the first one, so one run reports every distinct bug.
The seed is fixed, so CI sends the same cases every run and a red run is a change's doing,
not the draw's; ``SERVE_APP_FUZZ_SEED=random`` explores new ones (the seed is printed, and in
every failure message), ``SERVE_APP_FUZZ_SEED=<seed>`` reruns one.
"""

from __future__ import annotations

import json
import os
import secrets
import sys
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import Case, GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from tests.serve.conftest import MODEL

EXAMPLES = {GenerationMode.POSITIVE: 150, GenerationMode.NEGATIVE: 90}
_SEED_ENV = os.environ.get("SERVE_APP_FUZZ_SEED", "")
SEED = secrets.randbits(32) if _SEED_ENV == "random" else int(_SEED_ENV or 11)
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
]


def _bound(case: Case) -> Case:
    """Keep generation cheap and requests aimed at our model; invalid values stay invalid."""
    body = case.body
    if not isinstance(body, dict):
        return case
    positive = case.meta is None or case.meta.generation.mode == GenerationMode.POSITIVE
    if positive and "model" in body:
        body["model"] = MODEL  # Otherwise nearly everything stops at 404 model_not_found.
    for field in ("max_tokens", "max_completion_tokens"):
        value = body.get(field)
        if isinstance(value, int) and not isinstance(value, bool) and value > 4:
            body[field] = 4
    if body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
        body["max_tokens"] = 2  # Unset means "the rest of the context window": 4K tokens.
    n = body.get("n")
    if isinstance(n, int) and n > 2:
        body["n"] = 2
    return case


@pytest.fixture(scope="module")
def api_schema(base_url: str) -> Any:
    schema = schemathesis.openapi.from_url(f"{base_url}/openapi.json")
    schema.config.update(base_url=base_url)

    @schema.hook
    def map_case(context: schemathesis.HookContext, case: Case) -> Case:
        return _bound(case)

    return schema


def _sse_events(text: str) -> list[Any]:
    # SSE lines end at \n (str.splitlines would also split inside a text holding U+2028).
    events = [line[6:] for line in text.split("\n") if line.startswith("data: ")]
    assert events and events[-1] == "[DONE]", text[-500:]
    return [json.loads(event) for event in events[:-1]]


class Run:
    def __init__(self) -> None:
        self.calls = 0
        self.statuses: dict[int, int] = {}
        self.failures: list[str] = []
        self.hung = False

    def case(self, case: Case) -> None:
        if self.hung:  # After a hang every request would wait out its timeout.
            return
        self.calls += 1
        where = f"{case.method} {case.path} body={json.dumps(case.body, default=str)[:2000]}"
        try:
            response = case.call(timeout=120)
        except Exception as exc:
            self.hung = True
            self.failures.append(f"{where}\n  -> no answer: {exc!r}")
            return
        status = response.status_code
        self.statuses[status] = self.statuses.get(status, 0) + 1
        try:
            content_type = (response.headers.get("content-type") or [""])[0]  # Lists of values.
            if content_type.startswith("text/event-stream"):
                # The documented 200 body is the JSON response; streams are checked by hand.
                assert status == 200
                for event in _sse_events(response.text):
                    assert "error" not in event or set(event["error"]) >= {"message", "type"}
            else:
                case.validate_response(response, checks=CHECKS)
            if 400 <= status < 500:
                error = response.json()["error"]
                assert set(error) == {"message", "type", "param", "code"}, error
        except (Exception, BaseExceptionGroup) as exc:  # Collected: report every failure.
            self.failures.append(f"{where}\n  -> {status} {response.text[:1000]}\n  {exc}")


def test_fuzz_openapi_no_5xx_and_conformant(api_schema: Any) -> None:
    rerun = f"schemathesis seed {SEED} (rerun: SERVE_APP_FUZZ_SEED={SEED})"
    print(f"\n{rerun}", file=sys.stderr)  # Shown at once with -s, and on failure.
    run = Run()
    for number, result in enumerate(api_schema.get_all_operations()):
        operation = result.ok()
        for offset, (mode, examples) in enumerate(EXAMPLES.items()):

            @seed(SEED + 2 * number + offset)
            @settings(
                max_examples=examples,
                deadline=None,
                database=None,
                phases=[Phase.explicit, Phase.generate],  # No shrinking: report as found.
                suppress_health_check=list(HealthCheck),
            )
            @given(case=operation.as_strategy(generation_mode=mode))
            def one(case: Case) -> None:
                run.case(case)

            try:
                one()
            except Unsatisfiable:
                # No parameters and no body (GET /health): nothing to make invalid.
                assert mode == GenerationMode.NEGATIVE, operation.label
    print(f"\nschemathesis: {run.calls} cases, statuses {dict(sorted(run.statuses.items()))}")
    failures = "\n\n".join(run.failures[:20])
    assert not run.failures, f"{rerun}: {len(run.failures)} failures:\n\n{failures}"
    assert run.calls >= 1000, (rerun, run.calls)
    assert not any(status >= 500 for status in run.statuses), (rerun, run.statuses)

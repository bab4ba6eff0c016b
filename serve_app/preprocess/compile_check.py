"""Checks of structured-output constraints and tool schemas, done on the CPU before engine time.

vLLM compiles constraints with xgrammar by default; compiling them here first turns a bad schema,
regex or grammar into a 400 that names the field, instead of an engine-side failure.
"""

from __future__ import annotations

import functools
import json
import re
from typing import Any

from serve_app.errors import APIError
from serve_app.hops import StructuredSpec

COMPILED_KEPT = 1024  # Distinct constraints whose verdict is remembered ...
KEPT_SOURCE_CHARS = 16 * 1024  # ... each at most this long: 16 MiB of keys in all.


def check_structured(spec: StructuredSpec) -> None:
    """Raise a 400 naming ``spec.param`` when the constraint cannot be compiled."""
    if spec.kind == "json":
        schema = _schema_text(spec.value, spec.param) if isinstance(spec.value, str) else spec.value
        check_json_schema(schema, spec.param)
        problem = _problem("json", json.dumps(schema, sort_keys=True))
    elif spec.kind in ("regex", "grammar"):
        problem = _problem(spec.kind, spec.value)
    elif spec.kind == "choice" and not all(isinstance(c, str) and c for c in spec.value):
        problem = "choices must be non-empty strings"
    else:
        problem = None
    if problem is not None:
        raise APIError(
            f"Invalid {spec.kind} constraint in {spec.param}: {problem}", param=spec.param
        )


def _schema_text(text: str, param: str) -> Any:
    """A schema sent as JSON text (vLLM accepts both forms); text that is not JSON is a 400."""
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as exc:  # RecursionError: nesting deeper than Python's.
        raise APIError(
            f"{param} must be a JSON Schema object or its JSON text; the text is not JSON "
            f"({_first_line(exc)})",
            param=param,
        ) from exc


def _problem(kind: str, source: str) -> str | None:
    """Verdicts cached by the constraint's text (clients send the same schema with every
    request, and compiling it costs milliseconds); large ones are not kept (bounded memory)."""
    if len(source) > KEPT_SOURCE_CHARS:
        return _compile_problem(kind, source)
    return _cached_problem(kind, source)


def _compile_problem(kind: str, source: str) -> str | None:
    """Why xgrammar cannot compile ``source`` (None: it can)."""
    import xgrammar

    try:
        if kind == "json":
            xgrammar.Grammar.from_json_schema(source)
        elif kind == "regex":
            re.compile(source)
            xgrammar.Grammar.from_regex(source)
        else:
            xgrammar.Grammar.from_ebnf(source)
    except (ValueError, RuntimeError, re.error) as exc:
        return _first_line(exc)
    return None


def check_json_schema(schema: Any, param: str) -> None:
    """A JSON Schema must itself validate against its meta-schema."""
    import jsonschema

    if not isinstance(schema, dict):
        raise APIError(f"{param} must be a JSON Schema object", param=param)
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as exc:
        where = "/".join(str(p) for p in exc.path)
        raise APIError(
            f"Invalid JSON Schema in {param}{' at ' + where if where else ''}: {exc.message}",
            param=param,
        ) from exc


def check_tools(tools: list[dict[str, Any]] | None) -> None:
    for i, tool in enumerate(tools or []):
        parameters = tool.get("function", {}).get("parameters")
        if parameters is not None:
            check_json_schema(parameters, f"tools[{i}].function.parameters")


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    line = text[-1] if text else type(exc).__name__
    # xgrammar prefixes messages with a timestamp and a C++ source location.
    return re.sub(r"^\[[\d:]+\] [^ ]+:\d+: ", "", line)


_cached_problem = functools.lru_cache(maxsize=COMPILED_KEPT)(_compile_problem)

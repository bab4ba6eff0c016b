"""Checks of structured-output constraints and tool schemas, done on the CPU before engine time.

vLLM compiles constraints with xgrammar by default; compiling them here first turns a bad schema,
regex or grammar into a 400 that names the field, instead of an engine-side failure.
"""

from __future__ import annotations

import json
import re
from typing import Any

from serve_app.errors import APIError
from serve_app.hops import StructuredSpec


def check_structured(spec: StructuredSpec) -> None:
    """Raise a 400 naming ``spec.param`` when the constraint cannot be compiled."""
    import xgrammar

    try:
        if spec.kind == "json":
            schema = json.loads(spec.value) if isinstance(spec.value, str) else spec.value
            check_json_schema(schema, spec.param)
            xgrammar.Grammar.from_json_schema(json.dumps(schema))
        elif spec.kind == "regex":
            re.compile(spec.value)
            xgrammar.Grammar.from_regex(spec.value)
        elif spec.kind == "grammar":
            xgrammar.Grammar.from_ebnf(spec.value)
        elif spec.kind == "choice" and not all(isinstance(c, str) and c for c in spec.value):
            raise ValueError("choices must be non-empty strings")
    except APIError:
        raise
    except (ValueError, RuntimeError, re.error) as exc:
        raise APIError(
            f"Invalid {spec.kind} constraint in {spec.param}: {_first_line(exc)}", param=spec.param
        ) from exc


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

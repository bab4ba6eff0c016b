"""Pure row logic of offline jobs (no Ray, no engine): job settings, prompts, sampling, ids.

Everything here is a plain function of one input row, so a bad row becomes an error value with
its id instead of failing the batch it travels in.
"""

from __future__ import annotations

import json
import string
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

from pydantic import ValidationError

from serve_app.config import AppConfig
from serve_app.config.model import ModelConfig, check_adapter
from serve_app.errors import APIError
from serve_app.hops import LoraAdapter, PreprocessRequest, SamplingSpec, StructuredSpec

# Per-row sampling columns: a non-null value in one of these columns overrides the job's.
SAMPLING_COLUMNS = (
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "stop",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "min_tokens",
    "ignore_eos",
)

OUTPUT_COLUMNS = (
    "id",
    "output",
    "prompt_tokens",
    "completion_tokens",
    "finish_reason",
    "error",
)


class RowError(Exception):
    """A row that cannot become a request; its message lands in the error column."""


@dataclass
class JobConfig:
    """One offline job. Exactly one of prompt_column, messages_column, template."""

    input: str
    output: str
    format: Literal["jsonl", "parquet"] = "jsonl"
    id_column: str = "id"
    prompt_column: str | None = None
    messages_column: str | None = None
    template: str | None = None
    system: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    json_schema: dict[str, Any] | None = None
    concurrency: int = 1
    batch_size: int = 64
    # Batches one engine actor works on at once: > 1 keeps the engine full through each
    # batch's tail; unfinished batches are redone on resume, so more in flight = more redone.
    batches_in_flight: int = 3
    # Engine core and model worker inside the engine actor's own process (see
    # serve_app/offline/inproc_engine.py); None: on single-worker CPU engines, where it is faster.
    in_process_engine: bool | None = None
    app_config: AppConfig = field(default_factory=AppConfig)
    ray_address: str | None = "local"
    progress: bool = True
    # LoRA adapters of app_config's model (model.lora_adapters), by name: ``adapter`` runs every
    # row; ``adapter_column`` names each row's (a null there: ``adapter``, else the base model).
    adapter: str | None = None
    adapter_column: str | None = None

    def __post_init__(self) -> None:
        sources = [self.prompt_column, self.messages_column, self.template]
        given = sum(s is not None for s in sources)
        if given > 1:
            raise ValueError("give only one of prompt_column, messages_column, template")
        if given == 0:
            self.prompt_column = "prompt"
        if self.template is not None:
            template_fields(self.template)
        if min(self.concurrency, self.batch_size, self.batches_in_flight) < 1:
            raise ValueError("concurrency, batch_size and batches_in_flight must be at least 1")
        if self.adapter is not None and self.adapter not in self.adapters():
            raise ValueError(f"adapter {self.adapter!r}: {self._served_adapters()}")
        for name, source in self.adapters().items():
            check_adapter(name, source)

    def adapters(self) -> dict[str, str]:
        """The model's LoRA adapters: name -> where vLLM loads it from."""
        return self.app_config.model.lora_adapters

    def _served_adapters(self) -> str:
        names = ", ".join(sorted(self.adapters()))
        return (
            f"not an adapter of the model (it has {names})"
            if names
            else (
                "the model has no LoRA adapters (give model.lora_adapters in --config, or "
                "--lora-adapter NAME=PATH)"
            )
        )

    def lora(self, name: str | None) -> LoraAdapter | None:
        """The engine's adapter for a row's adapter name (None: the base model)."""
        return None if name is None else LoraAdapter(name, self.adapters()[name])

    def engine_in_process(self) -> bool:
        """Whether engine actors run vLLM in-process (``in_process_engine``, resolved)."""
        engine = self.app_config.engine
        if self.in_process_engine is not None:
            return self.in_process_engine
        return engine.resolved_device() == "cpu" and engine.world_size == 1

    def structured(self) -> StructuredSpec | None:
        if self.json_schema is None:
            return None
        return StructuredSpec("json", self.json_schema, "json_schema")

    def job_params(self) -> dict[str, Any]:
        params: dict[str, Any] = {}
        if self.max_tokens is not None:
            params["max_tokens"] = self.max_tokens
        if self.temperature is not None:
            params["temperature"] = self.temperature
        return params


def with_adapters(config: AppConfig, pairs: list[str]) -> AppConfig:
    """``config`` with more LoRA adapters, each ``NAME=PATH`` (validated as in a config file)."""
    if not pairs:
        return config
    adapters = dict(config.model.lora_adapters)
    for pair in pairs:
        name, sep, source = pair.partition("=")
        if not (sep and name and source):
            raise ValueError(f"--lora-adapter {pair!r}: give NAME=PATH (or NAME=org/hub-id)")
        adapters[name] = source
    data = config.model.model_dump(exclude_unset=True) | {"lora_adapters": adapters}
    try:
        model = ModelConfig.model_validate(data)
    except ValidationError as exc:
        raise ValueError(f"--lora-adapter: {exc.errors()[0]['msg']}") from exc
    return config.model_copy(update={"model": model})


def load_json_schema(path: str | Path) -> dict[str, Any]:
    """Read and check a JSON Schema once, before any row runs (raises ValueError)."""
    from serve_app.preprocess.constraints import check_structured

    try:
        schema = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"--json-schema {path}: {exc}") from exc
    try:
        check_structured(StructuredSpec("json", schema, "json_schema"))
    except APIError as exc:
        raise ValueError(f"--json-schema {path}: {exc}") from exc
    return dict(schema)


def template_fields(template: str) -> list[str]:
    """Column names a template uses; only plain names (no attribute or index access)."""
    names: list[str] = []
    try:
        parsed = list(string.Formatter().parse(template))
    except ValueError as exc:
        raise ValueError(f"template: {exc}") from exc
    for _, name, _, _ in parsed:
        if name is None:
            continue
        if not name.isidentifier():
            raise ValueError(f"template: field {{{name}}} must be a plain column name")
        names.append(name)
    return names


def fill_template(template: str, row: dict[str, Any]) -> str:
    values = {}
    for name in template_fields(template):
        value = row.get(name)
        if value is None:
            raise RowError(f"missing column {name!r} (used by the template)")
        values[name] = value
    return template.format_map(values)


def row_id(row: dict[str, Any], id_column: str) -> str | None:
    value = row.get(id_column)
    return None if value is None else str(value)


def row_messages(job: JobConfig, row: dict[str, Any]) -> list[dict[str, Any]]:
    """The chat of one row: system prompt (if any) plus the user turn or the given messages."""
    if job.messages_column is not None:
        value = row.get(job.messages_column)
        if value is None:
            raise RowError(f"missing column {job.messages_column!r}")
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as exc:
                raise RowError(f"{job.messages_column}: not a JSON list of messages") from exc
        if not isinstance(value, list):
            raise RowError(f"{job.messages_column}: expected a list of messages")
        messages = list(value)
    elif job.template is not None:
        messages = [{"role": "user", "content": fill_template(job.template, row)}]
    else:
        assert job.prompt_column is not None
        prompt = row.get(job.prompt_column)
        if prompt is None:
            raise RowError(f"missing column {job.prompt_column!r}")
        messages = [{"role": "user", "content": str(prompt)}]
    if job.system is not None and not (messages and messages[0].get("role") == "system"):
        messages = [{"role": "system", "content": job.system}, *messages]
    return messages


def row_adapter(job: JobConfig, row: dict[str, Any]) -> str | None:
    """The row's adapter name (None: the base model, also when the column names the model)."""
    name = job.adapter
    if job.adapter_column is not None:
        value = row.get(job.adapter_column)
        if value is not None and value != "":
            name = str(value)
    if name is None or name == job.app_config.model.public_name:
        return None
    if name not in job.adapters():
        raise RowError(f"{job.adapter_column or 'adapter'}: {name!r} is {job._served_adapters()}")
    return name


def row_params(job: JobConfig, row: dict[str, Any]) -> dict[str, Any]:
    params = job.job_params()
    for column in SAMPLING_COLUMNS:
        if row.get(column) is not None:
            params[column] = row[column]
    return params


def build_request(job: JobConfig, row: dict[str, Any], request_id: str) -> PreprocessRequest:
    """The same PreprocessRequest /v1/chat/completions builds, validated the same way.

    Raises RowError with a message for the error column.
    """
    from serve_app.openai.protocol import ChatCompletionRequest

    config = job.app_config
    adapter = row_adapter(job, row)
    body = {
        "model": adapter or config.model.public_name,
        "messages": row_messages(job, row),
        **row_params(job, row),
    }
    try:
        # Lax types here: columns arrive as numpy scalars (np.int64 max_tokens), not JSON.
        request = ChatCompletionRequest.model_validate(body, strict=False)
        sampling: SamplingSpec = request.to_sampling_spec(config.model.generation_defaults)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ()))
        raise RowError(f"{where}: {first.get('msg')}" if where else str(first.get("msg"))) from exc
    except APIError as exc:
        raise RowError(str(exc)) from exc
    if request.n != 1:
        raise RowError("n: only n=1 is supported in offline jobs")
    if (structured := job.structured()) is not None:
        sampling = replace(sampling, structured=structured)
    return PreprocessRequest(
        request_id=request_id,
        kind="chat",
        sampling=sampling,
        messages=[m.to_template_dict() for m in request.messages],
        chat_template_kwargs=request.chat_template_kwargs or {},
        max_tokens_param=request.max_tokens_param,
        adapter=adapter,
    )


def error_row(rid: str | None, message: str) -> dict[str, Any]:
    return {
        "id": rid,
        "output": None,
        "prompt_tokens": 0,
        "completion_tokens": 0,
        "finish_reason": None,
        "error": message,
    }

"""CLI: ``python -m serve_app.offline run --input corpus.jsonl --output out/ [options]``."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from serve_app.config import AppConfig
from serve_app.offline.rows import JobConfig, load_json_schema, with_adapters


def app_config(path: str | None, model: str | None = None) -> AppConfig:
    """The ``args`` of the first application in a Serve config file (or the defaults); of a
    multi-model app, the model named ``model`` (required there). Without a file, ``model`` is
    the checkpoint (an embedded alias, a directory or a hub id)."""
    if path is None:
        return AppConfig.model_validate({"model": {"name": model}} if model else {})
    from serve_app.launch import load_serve_config

    apps = load_serve_config(path)["applications"]
    config = AppConfig.model_validate(apps[0].get("args") or {})
    singles = {single.model.public_name: single for single in config.per_model()}
    if model is None and len(singles) == 1:
        return config
    if model not in singles:
        raise ValueError(
            f"--model {model!r}: {path} serves {', '.join(singles)}; name one with --model"
            if model is not None
            else f"{path} serves several models ({', '.join(singles)}); name one with --model"
        )
    return singles[model]


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="python -m serve_app.offline", description=__doc__)
    commands = top.add_subparsers(dest="command", required=True)
    run = commands.add_parser("run", help="run (or resume) an offline job")
    run.add_argument("--input", required=True, help="JSONL, CSV or Parquet; path or URI")
    run.add_argument("--output", required=True, help="output directory of part files")
    run.add_argument("--format", choices=["jsonl", "parquet"], default="jsonl")
    run.add_argument("--id-column", default="id")
    source = run.add_mutually_exclusive_group()
    source.add_argument("--prompt-column", help="user message column (default: prompt)")
    source.add_argument("--messages-column", help="column holding a list of chat messages")
    source.add_argument("--template", help='user message template, e.g. "Summarize {text}"')
    run.add_argument("--system", help="system prompt for every row")
    run.add_argument("--max-tokens", type=int)
    run.add_argument("--temperature", type=float)
    run.add_argument("--json-schema", help="JSON Schema file: structured output for every row")
    run.add_argument("--concurrency", type=int, default=1, help="engine actors")
    run.add_argument("--batch-size", type=int, default=64, help="rows per engine call")
    run.add_argument(
        "--batches-in-flight", type=int, default=3, help="batches one engine actor runs at once"
    )
    run.add_argument(
        "--in-process-engine",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="vLLM's engine core and model worker inside each engine actor's process "
        "(default: on single-worker CPU engines)",
    )
    run.add_argument("--config", help="Serve config file whose app args configure the engine")
    run.add_argument(
        "--model",
        help="the model: of a --config serving several, the one to run; else a checkpoint",
    )
    run.add_argument(
        "--lora-adapter",
        action="append",
        default=[],
        metavar="NAME=PATH",
        help="a LoRA adapter of the model (PEFT directory or hub id); repeatable; adds to the "
        "--config's model.lora_adapters",
    )
    run.add_argument("--adapter", help="run every row with this LoRA adapter (by name)")
    run.add_argument(
        "--adapter-column",
        help="column naming each row's LoRA adapter (null: --adapter, else the base model; "
        "the model's own name: the base model)",
    )
    run.add_argument("--address", default="local", help="Ray address (default: a new local one)")
    run.add_argument("--no-progress", action="store_true")
    run.add_argument("--summary-json", action="store_true", help="print the summary as JSON")
    return top


def job_from_args(args: argparse.Namespace) -> JobConfig:
    kwargs: dict[str, Any] = {
        "input": args.input,
        "output": args.output,
        "format": args.format,
        "id_column": args.id_column,
        "prompt_column": args.prompt_column,
        "messages_column": args.messages_column,
        "template": args.template,
        "system": args.system,
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "concurrency": args.concurrency,
        "batch_size": args.batch_size,
        "batches_in_flight": args.batches_in_flight,
        "in_process_engine": args.in_process_engine,
        "app_config": with_adapters(app_config(args.config, args.model), args.lora_adapter),
        "adapter": args.adapter,
        "adapter_column": args.adapter_column,
        "ray_address": args.address,
        "progress": not args.no_progress,
    }
    if args.json_schema:
        kwargs["json_schema"] = load_json_schema(args.json_schema)
    return JobConfig(**kwargs)


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        job = job_from_args(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    from serve_app.offline.input_files import InputError
    from serve_app.offline.runner import run_job

    try:
        summary = run_job(job)
    except InputError as exc:  # Missing file, unknown format: say so, without a traceback.
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(summary.as_dict()) if args.summary_json else summary.text(), flush=True)
    return 130 if summary.interrupted else 0


if __name__ == "__main__":
    sys.exit(main())

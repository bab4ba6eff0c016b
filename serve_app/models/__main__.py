"""CLI: ``python -m serve_app.models {list,prepare} ...``.

``prepare`` is meant for image builds / CI warm-up so that serving replicas
find the models already in the cache; ``lora`` writes a trial LoRA adapter.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence

from . import (
    EMBEDDED_MODELS,
    ModelSourceMissingError,
    UnknownModelError,
    cache_dir,
    is_prepared,
    model_path,
    prepare,
    resolve_model,
)
from .lora_adapter import ALL_TARGETS, build_lora_adapter


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m serve_app.models",
        description=f"Embedded models, cached under {cache_dir()} ($SERVE_APP_CACHE).",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("list", help="list embedded model aliases")
    prep = sub.add_parser("prepare", help="build embedded models into the cache")
    prep.add_argument("aliases", nargs="*", metavar="ALIAS", help="default: all")
    prep.add_argument("--force", action="store_true", help="rebuild even if prepared")
    lora = sub.add_parser(
        "lora", help="write a seeded random LoRA adapter (PEFT format) for a model, for trials"
    )
    lora.add_argument("base", metavar="MODEL", help="an embedded alias or a checkpoint directory")
    lora.add_argument("out", metavar="DIR", help="the adapter directory to write")
    lora.add_argument("--seed", type=int, default=1, help="different seeds, different adapters")
    lora.add_argument("--rank", type=int, default=8, help="LoRA rank (vLLM's max_lora_rank: 16)")
    lora.add_argument(
        "--all-layers",
        action="store_true",
        help="change every linear layer (attention and MLP), as most fine-tunes do; default: "
        "v_proj and o_proj",
    )
    return parser


def _list() -> int:
    for alias, description in EMBEDDED_MODELS.items():
        state = "prepared" if is_prepared(alias) else "not prepared"
        print(f"{alias}\t{state}\t{model_path(alias)}\n    {description}")
    return 0


def _prepare(aliases: Sequence[str], force: bool) -> int:
    for alias in aliases or list(EMBEDDED_MODELS):
        started = time.monotonic()
        path = prepare(alias, force=force)
        print(f"{alias}\t{path}\t{time.monotonic() - started:.1f}s", flush=True)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "list":
            return _list()
        if args.command == "lora":
            base = resolve_model(args.base)
            targets = ALL_TARGETS if args.all_layers else ("v_proj", "o_proj")
            out = build_lora_adapter(
                base, args.out, seed=args.seed, rank=args.rank, targets=targets
            )
            print(out)
            return 0
        return _prepare(args.aliases, args.force)
    except (UnknownModelError, ModelSourceMissingError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())

"""``engine.vllm_args``: any vLLM engine argument, checked against vLLM's own ``EngineArgs``.

What serve_app derives from its own fields, or fixes for its own design, is not passthrough:
a second way to set it would silently override one of the two.
``serve_app.engine.engine_args`` emits exactly the names below (a unit test holds them together).
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import functools
import importlib.util
from pathlib import Path
from typing import Any

# vLLM EngineArgs name -> the serve_app field that sets it.
DERIVED: dict[str, str] = {
    "model": "model.name",
    "served_model_name": "model.served_model_name",
    "dtype": "model.dtype",
    "max_model_len": "model.max_model_len",
    "trust_remote_code": "model.trust_remote_code",
    "hf_overrides": "model.rope_scaling",
    "tensor_parallel_size": "engine.tensor_parallel_size",
    "pipeline_parallel_size": "engine.pipeline_parallel_size",
    "block_size": "engine.block_size",
    "enable_prefix_caching": "engine.enable_prefix_caching",
    "max_num_seqs": "engine.max_num_seqs",
    "max_num_batched_tokens": "engine.max_num_batched_tokens",
    "enforce_eager": "engine.enforce_eager",
    "seed": "engine.seed",
    "enable_lora": "model.lora_adapters and model.max_runtime_adapters",
    "gpu_memory_utilization": "engine.gpu_memory_utilization",
    "structured_outputs_config": "engine.structured_output_backend and engine.compact_json",
}

# vLLM EngineArgs name -> why serve_app fixes it.
FIXED: dict[str, str] = {
    "scheduling_policy": "'priority' lets interactive requests overtake background ones",
    "generation_config": "'vllm': the server's defaults are model.generation_defaults only",
    "distributed_executor_backend": "'ray' for multi-GPU replicas, in-process for offline jobs",
    "tokenizer": "the engine must detokenize with the tokenizer the preprocessor encodes with",
    "skip_tokenizer_init": "the engine detokenizes what the preprocessor tokenized",
}


def check_vllm_args(args: dict[str, Any]) -> dict[str, Any]:
    """``args`` unchanged, or a ValueError naming every bad key and its fix."""
    known = engine_arg_names()
    problems = []
    for name in args:
        if name in DERIVED:
            problems.append(f"set {DERIVED[name]}, not engine.vllm_args.{name}")
        elif name in FIXED:
            problems.append(f"{name} is set by serve_app ({FIXED[name]}); remove it")
        elif known is not None and name not in known:
            problems.append(_unknown(name, known))
    if problems:
        raise ValueError("; ".join(problems))
    return args


def _unknown(name: str, known: frozenset[str]) -> str:
    message = f"unknown vLLM engine argument {name!r}"
    close = difflib.get_close_matches(name.replace("-", "_"), sorted(known), n=1)
    if not close:
        return f"{message}; see the field names of vLLM's EngineArgs (`vllm serve --help`)"
    message += f"; did you mean {close[0]!r}?"
    if close[0] in DERIVED:
        message += f" (set {DERIVED[close[0]]})"
    return message


@functools.cache
def engine_arg_names() -> frozenset[str] | None:
    """The field names of vLLM's ``EngineArgs``; None where vLLM is not installed (no check).

    Read from vLLM's source rather than imported: importing vLLM pulls in torch (seconds and
    hundreds of MB), and every replica, the router's too, validates the config it is given.
    """
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        return None
    source = Path(next(iter(spec.submodule_search_locations)), "engine", "arg_utils.py")
    try:
        tree = ast.parse(source.read_text())
    except (OSError, SyntaxError, UnicodeDecodeError):
        tree = ast.Module(body=[], type_ignores=[])
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == "EngineArgs":
            return frozenset(
                field.target.id
                for field in node.body
                if isinstance(field, ast.AnnAssign)
                and isinstance(field.target, ast.Name)
                and "ClassVar" not in ast.unparse(field.annotation)
            )
    return _imported_names()  # Another vLLM layout: ask the class itself.


def _imported_names() -> frozenset[str] | None:
    try:
        from vllm.engine.arg_utils import EngineArgs
    except ImportError:
        return None
    return frozenset(field.name for field in dataclasses.fields(EngineArgs))

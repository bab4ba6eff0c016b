"""The one place the graph is wired: Router(Preprocessor, Engine), with options from config."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from ray.serve import Application

from serve_app.batch_api.deployment import BatchCoordinatorDeployment
from serve_app.config import AppConfig
from serve_app.engine.deployment import EngineDeployment
from serve_app.engine.routing.options import request_router_config
from serve_app.engine.vllm_args import check_vllm_arg_names
from serve_app.ingress.router import Router
from serve_app.models import UnknownModelError, resolve_model
from serve_app.preprocess.deployment import PreprocessorDeployment


def _with_env(options: dict[str, Any], env: dict[str, str]) -> dict[str, Any]:
    # OTEL_* settings of the process that builds the app reach every replica.
    otel = {key: value for key, value in os.environ.items() if key.startswith("OTEL_")}
    options["ray_actor_options"]["runtime_env"] = {"env_vars": otel | env}
    return options


def engine_options(config: AppConfig) -> dict[str, Any]:
    engine = config.engine
    options = _with_env(engine.deployment_options(), engine.runtime_env_vars())
    placement = engine.placement()
    if placement is not None:
        bundles, strategy = placement
        bundles[0] |= dict(engine.resources)  # The replica actor lives in bundle 0.
        # The replica actor lives in bundle 0; it needs the CPU, not the GPU.
        options["ray_actor_options"] |= {"num_cpus": bundles[0].get("CPU", 1), "num_gpus": 0}
        options["placement_group_bundles"] = bundles
        options["placement_group_strategy"] = strategy
    callers = config.router.num_replicas
    router = request_router_config(engine.routing, callers if callers != "auto" else None)
    if router is not None:
        options["request_router_config"] = router
    return options


def check_model(config: AppConfig) -> None:
    """Fail at build time, with the fix in the message, on an unknown model or a context
    window the model cannot support (checked when the checkpoint is on this machine)."""
    try:
        path = resolve_model(config.model.name)
    except UnknownModelError as exc:
        raise ValueError(f"model.name: {exc}") from exc
    if config.model.chat_template is not None:
        check_chat_template(config.model.chat_template)
    if Path(path).is_dir():
        config.model.context_window(checkpoint_positions(Path(path)))


# Names checkpoints give their context length under (transformers maps them all to this one).
POSITION_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length")


def checkpoint_positions(path: Path) -> int:
    """The checkpoint's native context length from its config.json, read as JSON: transformers'
    AutoConfig costs its import (seconds of start-up, before any replica starts) and may run a
    repository's code, for one number. 0 when it names none (the preprocessor checks again
    with AutoConfig when it starts)."""
    try:
        data = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return 0
    blocks = [data, data.get("text_config")] if isinstance(data, dict) else []
    for block in (b for b in blocks if isinstance(b, dict)):
        for key in POSITION_KEYS:
            if isinstance(block.get(key), int):
                return int(block[key])
    return 0


def check_chat_template(text: str) -> None:
    """model.chat_template compiles in the sandbox requests are rendered in."""
    from jinja2 import TemplateSyntaxError

    from serve_app.preprocess.templates import compile_template

    try:
        compile_template(text)
    except TemplateSyntaxError as exc:
        raise ValueError(
            f"model.chat_template: line {exc.lineno}: {exc.message}; fix the template"
        ) from exc


def check_models(config: AppConfig) -> None:
    """``check_model`` and the vllm_args names of every model, errors prefixed with the
    model's place in ``models`` when there are several."""
    for i, block in enumerate(config.models):
        where = f"models[{i}]." if len(config.models) > 1 else ""
        try:
            check_model(config.for_model(i))
            if block.engine.vllm_args:
                check_vllm_arg_names(block.engine.vllm_args)
        except ValueError as exc:
            raise ValueError(f"{where}{exc}") from exc


def check_placement(config: AppConfig, nodes: list[dict[str, Any]] | None = None) -> None:
    """Fail at start, with the numbers, when the engine's placement group cannot be placed on
    the connected cluster (e.g. TP=8 on 4 GPUs). ``nodes``: ``ray.nodes()``; skipped when Ray is
    not connected or SERVE_APP_SKIP_PLACEMENT_CHECK=1 (clusters that add GPU nodes on demand)."""
    placement = config.engine.placement()
    if placement is None or os.environ.get("SERVE_APP_SKIP_PLACEMENT_CHECK") == "1":
        return
    if nodes is None:
        import ray

        if not ray.is_initialized():
            return
        nodes = ray.nodes()
    gpus = [float(n.get("Resources", {}).get("GPU", 0)) for n in nodes if n.get("Alive", True)]
    bundles, strategy = placement
    need = sum(bundle.get("GPU", 0) for bundle in bundles)
    per_replica = max(gpus, default=0) if strategy == "STRICT_PACK" else sum(gpus)
    if need > per_replica:
        where, has = (
            ("one node", "the largest node")
            if strategy == "STRICT_PACK"
            else ("the cluster", "the cluster")
        )
        raise ValueError(
            f"engine: tensor_parallel_size {config.engine.tensor_parallel_size} x "
            f"pipeline_parallel_size {config.engine.pipeline_parallel_size} needs {need:g} GPUs "
            f"on {where} ({strategy} placement group), but {has} has {per_replica:g} "
            f"(GPUs per node: {gpus}); lower the parallel sizes or add GPUs"
        )


def build_app(args: dict[str, Any] | AppConfig | None = None) -> Application:
    """Build the Serve application from a Serve config's ``args`` (validated as AppConfig):
    one Preprocessor and one Engine per model, one Router in front of them all."""
    config = args if isinstance(args, AppConfig) else AppConfig.model_validate(args or {})
    check_models(config)
    models = []
    for i, block in enumerate(config.models):
        view = config.for_model(i)
        check_placement(view)
        plain = view.model_dump(mode="json")
        names = block.deployment_names(first=i == 0)
        preprocessor = PreprocessorDeployment.options(  # type: ignore[attr-defined]
            name=names[0], **_with_env(view.preprocessor.deployment_options(), {})
        ).bind(plain)
        engine = EngineDeployment.options(  # type: ignore[attr-defined]
            name=names[1], **engine_options(view)
        ).bind(plain)
        models.append((preprocessor, engine))
    router = Router.options(**_with_env(config.router.deployment_options(), {}))  # type: ignore[attr-defined]
    (preprocessor, engine), *others = models
    plain = config.model_dump(mode="json")
    coordinator = batch_coordinator(config, models)
    return router.bind(
        preprocessor, engine, plain, other_models=others or None, batch_coordinator=coordinator
    )


def batch_coordinator(config: AppConfig, models: list[tuple[Any, Any]]) -> Any:
    """The BatchCoordinator (None when the Batch API is off): the same preprocessor and engine
    deployments as the router's, every model's, one replica pinned next to its store."""
    if not config.batch_api.enabled:
        return None
    (preprocessor, engine), *others = models
    options = _with_env(config.batch_api.deployment_options(), {})
    return BatchCoordinatorDeployment.options(**options).bind(  # type: ignore[attr-defined]
        preprocessor, engine, config.model_dump(mode="json"), other_models=others or None
    )

"""The one place the graph is wired: Router({model: (Preprocessor, Engine)}), with options from
config."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from ray.serve import Application

from serve_app.batch_api.deployment import BatchCoordinator
from serve_app.config import AppConfig
from serve_app.config.app import GRPC_MESSAGE_ENV, deployment_suffix
from serve_app.config.model import check_adapter
from serve_app.engine.deployment import EngineDeployment
from serve_app.engine.routing.options import request_router_config
from serve_app.ingress.router import Router
from serve_app.models import UnknownModelError, checkpoint_config, resolve_model
from serve_app.preprocess.deployment import PreprocessorDeployment
from serve_app.preprocess.preprocessor import derive_max_model_len

# Large buffers (upload parts, request bodies Serve's proxy hands over in batches) are mapped
# and unmapped, not kept in the heap: glibc otherwise raises its mmap threshold after the first
# large free, and a router's memory stays grown after every upload.
BUFFER_ENV = {"MALLOC_MMAP_THRESHOLD_": "262144", "MALLOC_TRIM_THRESHOLD_": "262144"}


# Ray Serve's throughput mode, read by each replica process at start (AppConfig
# serve_throughput_mode). Direct ingress would need the proxy and controller in the mode too;
# replica logs stay on the console.
THROUGHPUT_ENV = {
    "RAY_SERVE_THROUGHPUT_OPTIMIZED": "1",
    "RAY_SERVE_ENABLE_DIRECT_INGRESS": "0",
    "RAY_SERVE_LOG_TO_STDERR": "1",
} | GRPC_MESSAGE_ENV


def _with_env(options: dict[str, Any], env: dict[str, str], config: AppConfig) -> dict[str, Any]:
    # OTEL_* settings of the process that builds the app reach every replica.
    otel = {key: value for key, value in os.environ.items() if key.startswith("OTEL_")}
    serve = THROUGHPUT_ENV if config.serve_throughput_mode else {}
    options["ray_actor_options"]["runtime_env"] = {"env_vars": otel | serve | env}
    return options


def engine_options(config: AppConfig) -> dict[str, Any]:
    engine = config.engine
    options = _with_env(engine.deployment_options(), engine.runtime_env_vars(), config)
    placement = engine.placement()
    if placement is not None:
        bundles, strategy = placement
        bundles[0] |= dict(engine.resources)  # The replica actor lives in bundle 0.
        # The replica actor lives in bundle 0; it needs the CPU, not the GPU.
        options["ray_actor_options"] |= {"num_cpus": 1, "num_gpus": 0}
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
    for name, source in config.model.lora_adapters.items():
        check_adapter(name, source)
    if Path(path).is_dir():
        hf_config = checkpoint_config(path, config.model.trust_remote_code)
        derive_max_model_len(config, hf_config)


def check_chat_template(text: str) -> None:
    """model.chat_template compiles in the sandbox requests are rendered in: a broken template
    fails the build, with its line, instead of every chat request."""
    from jinja2 import TemplateSyntaxError

    from serve_app.preprocess.templates import compile_template

    try:
        compile_template(text)
    except TemplateSyntaxError as exc:
        raise ValueError(
            f"model.chat_template: line {exc.lineno}: {exc.message}; fix the template"
        ) from exc


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
    a router over one preprocessor and one engine deployment per served model, and the batch
    coordinator (the Batch API) over the same ones."""
    config = args if isinstance(args, AppConfig) else AppConfig.model_validate(args or {})
    singles = config.per_model()
    backends: dict[str, dict[str, Application]] = {}
    for single in singles:
        where = f"models[{singles.index(single)}]: " if config.models else ""
        try:
            check_model(single)
            check_placement(single)
        except ValueError as exc:
            raise ValueError(f"{where}{exc}") from exc
        # One model keeps the plain names that dashboards and alerts already use.
        suffix = f"-{deployment_suffix(single.model.public_name)}" if config.models else ""
        plain = single.as_args()
        preprocessor = PreprocessorDeployment.options(  # type: ignore[attr-defined]
            name=f"Preprocessor{suffix}",
            **_with_env(single.preprocessor.deployment_options(), {}, single),
        ).bind(plain)
        engine = EngineDeployment.options(  # type: ignore[attr-defined]
            name=f"Engine{suffix}", **engine_options(single)
        ).bind(plain)
        backends[single.model.public_name] = {"preprocessor": preprocessor, "engine": engine}
    coordinator = None
    if config.batch_api.enabled:
        coordinator = BatchCoordinator.options(  # type: ignore[attr-defined]
            **_with_env(config.batch_api.coordinator_options(), BUFFER_ENV, config)
        ).bind(backends, config.as_args())
    router_options = _with_env(config.router.deployment_options(), BUFFER_ENV, config)
    router = Router.options(**router_options)  # type: ignore[attr-defined]
    return router.bind(backends, coordinator, config.as_args())

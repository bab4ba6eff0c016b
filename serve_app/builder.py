"""The one place the graph is wired: Router(Preprocessor, Engine), with options from config."""

from __future__ import annotations

from typing import Any

from ray.serve import Application

from serve_app.config import AppConfig
from serve_app.deployments import EngineDeployment, PreprocessorDeployment
from serve_app.models import UnknownModelError, is_embedded, resolve_model
from serve_app.router import Router


def engine_options(config: AppConfig) -> dict[str, Any]:
    engine = config.engine
    options = engine.deployment_options()
    options["ray_actor_options"]["runtime_env"] = {"env_vars": engine.runtime_env_vars()}
    placement = engine.placement()
    if placement is not None:
        bundles, strategy = placement
        # The replica actor lives in bundle 0; it needs the CPU, not the GPU.
        options["ray_actor_options"] |= {"num_cpus": 1, "num_gpus": 0}
        options["placement_group_bundles"] = bundles
        options["placement_group_strategy"] = strategy
    return options


def build_app(args: dict[str, Any] | AppConfig | None = None) -> Application:
    """Build the Serve application from a Serve config's ``args`` (validated as AppConfig)."""
    config = args if isinstance(args, AppConfig) else AppConfig.model_validate(args or {})
    name = config.model.name
    if not is_embedded(name):
        try:
            resolve_model(name)  # Fails fast, at build time, on an unknown alias.
        except UnknownModelError as exc:
            raise ValueError(f"model.name: {exc}") from exc
    plain = config.model_dump(mode="json")
    preprocessor = PreprocessorDeployment.options(  # type: ignore[attr-defined]
        **config.preprocessor.deployment_options()
    ).bind(plain)
    engine = EngineDeployment.options(**engine_options(config)).bind(plain)  # type: ignore[attr-defined]
    router = Router.options(**config.router.deployment_options())  # type: ignore[attr-defined]
    return router.bind(preprocessor, engine, plain)

"""The BatchCoordinator deployment: a thin Serve adapter over the plain ``Coordinator``.

It reaches the models through the same preprocess → engine handles and the same dispatch on
`model` as the Router (``ModelHandles``, ``served_models``: a line may name any model or LoRA
adapter the app serves), and keeps its store under ``batch_api.root`` on the node it is pinned to.
Errors travel back to the routers as values (exceptions crossing Ray lose their fields).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from ray import serve
from ray.serve.handle import DeploymentHandle

from serve_app.batch_api.coordinator import Coordinator
from serve_app.batch_api.db import default_root
from serve_app.batch_api.store import BatchStore
from serve_app.config import AppConfig
from serve_app.errors import APIError, ErrorInfo
from serve_app.graph.model_handles import ModelHandles, adapter_registry, served_models

logger = logging.getLogger("serve_app.batch_api")

INTERNAL = ErrorInfo(
    "Internal error in the batch coordinator; see its log.",
    status=500,
    type="server_error",
    code="internal_error",
)
# What routers may call (each takes the caller's tenant first).
VERBS = frozenset(
    {
        "upload_start",
        "upload_write",
        "upload_finish",
        "upload_abort",
        "get_file",
        "list_files",
        "delete_file",
        "create_batch",
        "get_batch",
        "list_batches",
        "cancel_batch",
    }
)


@serve.deployment(name="BatchCoordinator")
class BatchCoordinatorDeployment:
    async def __init__(  # type: ignore[misc]  # Serve awaits async constructors.
        self,
        preprocessor: DeploymentHandle,
        engine: DeploymentHandle,
        config: dict[str, Any],
        *,
        other_models: list[tuple[DeploymentHandle, DeploymentHandle]] | None = None,
    ) -> None:
        self.config = AppConfig.model_validate(config)
        self._engine = engine
        app_name = serve.get_replica_context().app_name
        root = self.config.batch_api.root
        # One store per application: two apps' coordinators must never lease each other's
        # batches (their lines name models only one of them serves).
        store = BatchStore(Path(root).expanduser() if root else default_root() / app_name)
        handles = [
            ModelHandles(self.config.for_model(i), pre, eng)
            for i, (pre, eng) in enumerate([(preprocessor, engine), *(other_models or [])])
        ]
        serving = served_models(handles, adapter_registry(self.config, app_name)).primary
        self.coordinator = Coordinator(self.config, serving, store)
        logger.info("Batch coordinator %s on %s", self.coordinator.owner_id, store.db.root)
        self.coordinator.start()

    async def call(self, verb: str, owner: str, *args: Any) -> Any:
        if verb not in VERBS:
            return ErrorInfo(f"Unknown Batch API call {verb!r}.", status=500, type="server_error")
        try:
            return await getattr(self.coordinator, verb)(owner, *args)
        except APIError as exc:
            return exc.info
        except Exception:
            logger.exception("Batch API call %s failed", verb)
            return INTERNAL

    async def file_content(self, owner: str, file_id: str) -> AsyncIterator[bytes | ErrorInfo]:
        try:
            async for chunk in self.coordinator.file_chunks(owner, file_id):
                yield chunk
        except APIError as exc:
            yield exc.info
        except Exception:
            logger.exception("Reading file %s failed", file_id)
            yield INTERNAL

    def owner_id(self) -> str:
        """This replica's lease owner id (tests, logs)."""
        return self.coordinator.owner_id

    async def __del__(self) -> None:
        coordinator = getattr(self, "coordinator", None)
        if coordinator is not None:
            await coordinator.stop()

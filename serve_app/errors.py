"""OpenAI-style errors: one exception type, rendered as ``{"error": {...}}`` by the router."""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class ErrorInfo:
    """A client-facing error; plain data so it can cross deployment hops by value."""

    message: str
    status: int = 400
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None

    def body(self) -> dict[str, Any]:
        fields = asdict(self)
        fields.pop("status")
        return {"error": fields}


class APIError(Exception):
    """Raised anywhere below the router; the router turns it into a JSON response."""

    def __init__(
        self,
        message: str,
        *,
        status: int = 400,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.info = ErrorInfo(message, status, type, param, code)

    @classmethod
    def from_info(cls, info: ErrorInfo) -> APIError:
        return cls(
            info.message, status=info.status, type=info.type, param=info.param, code=info.code
        )


def model_not_found(model: str, available: list[str]) -> APIError:
    return APIError(
        f"The model `{model}` does not exist. Available models: {', '.join(available)}.",
        status=404,
        param="model",
        code="model_not_found",
    )


def context_length_exceeded(
    *, prompt_tokens: int, max_tokens: int | None, max_model_len: int, param: str
) -> APIError:
    if max_tokens is None:
        detail = f"your prompt has {prompt_tokens} tokens"
        fix = "Shorten the prompt."
    else:
        detail = (
            f"you requested {prompt_tokens + max_tokens} tokens "
            f"({prompt_tokens} in the prompt, {max_tokens} for the completion)"
        )
        fix = "Reduce the length of the prompt or max_tokens."
    return APIError(
        f"This model's maximum context length is {max_model_len} tokens. However, {detail}. {fix}",
        param=param,
        code="context_length_exceeded",
    )


def server_error(message: str, *, status: int = 500) -> APIError:
    return APIError(message, status=status, type="server_error", code="internal_error")


BACKEND_UNAVAILABLE = ErrorInfo(
    "The model backend is unavailable; retry shortly.",
    status=503,
    type="server_error",
    code="backend_unavailable",
)


def backend_error(exc: BaseException) -> ErrorInfo | None:
    """503 for failures of the graph itself (a replica died, is restarting or is full); None
    for a bug (the caller answers 500 ``internal_error``, which clients do not retry)."""
    from ray.exceptions import RayError, RayTaskError
    from ray.serve.exceptions import RayServeException

    if isinstance(exc, APIError):
        return exc.info
    if isinstance(exc, RayTaskError):
        # Raised by our code inside a replica: judged by what was raised (an APIError, a call
        # to a dead replica, or a bug), not as an outage of the replica that raised it.
        cause = getattr(exc, "cause", None)
        return backend_error(cause) if isinstance(cause, BaseException) else None
    if isinstance(exc, RayError | RayServeException):
        return BACKEND_UNAVAILABLE
    return None


def stream_error(exc: BaseException) -> ErrorInfo:
    """What a stream whose headers are sent reports as its last event: the backend's error, or
    for a bug a 500 ``internal_error`` (logged with its traceback; the stream still ends)."""
    info = backend_error(exc)
    if info is not None:
        return info
    logging.getLogger("serve_app.errors").error("Stream failed", exc_info=exc)
    return ErrorInfo(
        f"Internal error: {type(exc).__name__}",
        status=500,
        type="server_error",
        code="internal_error",
    )


def replica_lost(exc: object) -> bool:
    """Whether ``exc`` (raised, or an engine's error item) says the engine under a request
    went away (its replica died or became unreachable, or its engine core died or hung): the
    request may be resubmitted elsewhere."""
    from ray.exceptions import RayActorError, RayTaskError

    if isinstance(exc, ErrorInfo):
        return exc.code == "engine_unavailable"
    if isinstance(exc, RayTaskError):
        cause = getattr(exc, "cause", None)
        return isinstance(cause, BaseException) and replica_lost(cause)
    if isinstance(exc, APIError):
        return exc.info.code == "engine_unavailable"
    return isinstance(exc, RayActorError)


def cancelled_here() -> bool:
    """Whether the running task itself is being cancelled (not a callee's CancelledError)."""
    import asyncio

    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


def cancelled_by_callee(exc: BaseException | None = None) -> APIError:
    """A call cancelled on the other side (Serve raises a replica-side cancel in the caller as
    CancelledError): passed on as is, it would end a stream with no error and no [DONE], and
    Serve's proxy would log it as the client gone. Logged with where it came from."""
    logging.getLogger("serve_app.errors").warning("A callee cancelled the request", exc_info=exc)
    return engine_unavailable("The model replica cancelled the request; retry shortly.")


def engine_unavailable(message: str) -> APIError:
    """503 ``engine_unavailable``: the engine under a request went away; resubmitted when no
    token went out yet (``ingress.handles.resubmitted_once``, ``replica_lost``)."""
    return APIError(message, status=503, type="server_error", code="engine_unavailable")

"""OpenAI-style errors: one exception type, rendered as ``{"error": {...}}`` by the router."""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass
from typing import Any

logger = logging.getLogger("serve_app.errors")


@dataclass(frozen=True)
class ErrorInfo:
    """A client-facing error; plain data so it can cross deployment hops by value."""

    message: str
    status: int = 400
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None
    # Sent as Retry-After (429/503); None: 1 s. Not part of the body.
    retry_after_s: float | None = None

    def body(self) -> dict[str, Any]:
        fields = asdict(self)
        fields.pop("status")
        fields.pop("retry_after_s")
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
        retry_after_s: float | None = None,
    ) -> None:
        super().__init__(message)
        self.info = ErrorInfo(message, status, type, param, code, retry_after_s)

    @classmethod
    def from_info(cls, info: ErrorInfo) -> APIError:
        return cls(
            info.message,
            status=info.status,
            type=info.type,
            param=info.param,
            code=info.code,
            retry_after_s=info.retry_after_s,
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


def internal_error(exc: BaseException) -> ErrorInfo:
    """A bug (ours, in some replica): 500, which clients do not retry; details go to the log."""
    from ray.exceptions import RayTaskError

    cause = exc.cause if isinstance(exc, RayTaskError) and exc.cause is not None else exc
    return ErrorInfo(
        f"Internal error ({type(cause).__name__}); the server log has the details.",
        status=500,
        type="server_error",
        code="internal_error",
    )


def backend_error(exc: BaseException) -> ErrorInfo | None:
    """The client-facing error for a failure met on a handle or actor call, by its cause.

    - ``APIError`` (also raised in a replica): its own status and fields;
    - a full queue (``BackPressureError``): its status (503/429) and Retry-After;
    - a replica that died or cannot be reached: 503 ``backend_unavailable`` (retryable);
    - any other exception raised by code in a replica (``RayTaskError``): 500
      ``internal_error`` — a bug, which clients must not retry as if the server were busy;
    - any other Ray or Serve failure (no replica, controller gone): 503;
    - anything else: None (a bug in this process; the caller logs it and answers 500).
    """
    from ray.exceptions import RayActorError, RayError, RayTaskError
    from ray.serve.exceptions import BackPressureError, RayServeException

    if isinstance(exc, RayTaskError):
        cause = exc.cause
        if isinstance(cause, APIError | RayError | RayServeException):
            return backend_error(cause)
        return internal_error(exc)
    if isinstance(exc, APIError):
        return exc.info
    if isinstance(exc, BackPressureError):
        return ErrorInfo(
            f"The model backend is at capacity ({exc.message.rstrip('.')}); retry shortly.",
            status=exc.status_code,
            type="server_error",
            code="overloaded",
            retry_after_s=exc.retry_after_s,
        )
    if isinstance(exc, RayActorError | RayError | RayServeException):
        return BACKEND_UNAVAILABLE
    return None


def logged_error(exc: BaseException) -> ErrorInfo:
    """``backend_error`` of ``exc``, or a 500 for a local bug; a bug is logged with its
    traceback (a replica's traceback is part of a ``RayTaskError``'s message)."""
    info = backend_error(exc)
    if info is None or (info.status == 500 and info.code == "internal_error"):
        logger.error("Internal error", exc_info=exc)
        return info or internal_error(exc)
    if info.status >= 500 or info.status == 429:
        logger.warning("Backend unavailable: %r", exc)
    return info


def replica_lost(exc: BaseException) -> bool:
    """The callee's process died while it held the call (not an error its code raised).

    Only a confirmed death counts: ``ActorUnavailableError`` (the actor may still be running)
    does not, so a re-submitted request can never run twice.
    """
    from ray.exceptions import ActorDiedError, RayTaskError

    if isinstance(exc, RayTaskError):
        return isinstance(exc.cause, ActorDiedError)
    return isinstance(exc, ActorDiedError)


FAULT_MARKER = "serve_app-fault:"


def inject_fault(enabled: bool, stop: tuple[str, ...] | list[str], stage: str) -> None:
    """Tests only (``fault_injection: true``): a request whose stop strings include
    ``serve_app-fault:<stage>`` raises an unexpected exception in that stage, as a bug would."""
    if enabled and f"{FAULT_MARKER}{stage}" in stop:
        raise RuntimeError(f"fault injected in {stage} (fault_injection is on)")

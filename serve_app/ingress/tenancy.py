"""Who sent a request (the API key's name) and the priority that key may run at."""

from __future__ import annotations

from fastapi import Request

from serve_app.config.security import SecurityConfig
from serve_app.openai.protocol import ChatCompletionRequest, CompletionRequest


def tenant_of(request: Request) -> str:
    """The key name the security middleware matched ("" when no keys are configured)."""
    return str(getattr(request.state, "api_key_name", "") or "")


def clamp_priority(
    body: ChatCompletionRequest | CompletionRequest, tenant: str, security: SecurityConfig
) -> None:
    """Raise the requested priority to the key's floor (0 unless security.key_priorities says
    otherwise): lower runs first in vLLM, so a client choosing it would jump every queue."""
    body.priority = max(body.priority, security.min_priority(tenant))

"""Who sent a request (the API key's name) and the priority that key's requests run at."""

from __future__ import annotations

from starlette.requests import Request

from serve_app.config.security import SecurityConfig


def tenant_of(request: Request) -> str:
    """The key name the security middleware matched ("" when no keys are configured)."""
    return str(getattr(request.state, "api_key_name", "") or "")


def allowed_priority(priority: int, tenant: str, security: SecurityConfig) -> int:
    """The priority a client's request runs at: what it asked, raised to its key's floor (0
    unless security.key_priorities says otherwise).

    vLLM schedules lower values first and preempts for them under KV pressure, so a client
    choosing its own would jump every queue. Only client requests come here: the Batch API and
    other internal callers set their (higher, background) priorities themselves.
    """
    return max(priority, security.min_priority(tenant))

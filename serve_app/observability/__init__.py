"""Tracing (OpenTelemetry) and metrics (Ray's metrics API) shared by every deployment."""

"""Traces (OpenTelemetry, W3C context carried in the hops) and metrics (Ray's metrics API)."""

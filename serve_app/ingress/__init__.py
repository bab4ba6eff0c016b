"""The ingress: the Router deployment (OpenAI routes over HTTP) and everything in front of it —
API keys, rate limits, size limits, OpenAI-shaped errors, readiness, LoRA admin routes."""

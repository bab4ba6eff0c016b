"""The engine: ``VLLMEngine`` (one vLLM AsyncLLM) and its Serve deployment, with what keeps it
honest — the dead-core watchdog, the admission gate for background work, queue-depth autoscaling
and CPU pinning."""

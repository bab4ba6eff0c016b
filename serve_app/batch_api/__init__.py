"""The OpenAI Batch API: /v1/files and /v1/batches routes, the service that runs batches, and
their store."""

"""The OpenAI Batch API (``/v1/files``, ``/v1/batches``): routes, the service and its store."""

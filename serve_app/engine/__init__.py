"""The engine: the plain ``VLLMEngine`` and its deployment, with what keeps a replica healthy."""

"""How a deployment calls the next: what the Router and the batch coordinator share to reach a
model's preprocessor and engine (bounded and re-submitted handle calls, the step channel, the
handles of one model, the registry of LoRA adapters)."""

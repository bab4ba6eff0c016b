"""The ingress: the Router deployment (HTTP), API keys, rate limits, handle calls, HTTP errors."""

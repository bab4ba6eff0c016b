"""Cache-aware routing across engine replicas.

``index`` (what each replica probably caches) and ``policy`` (the choice) are plain Python: the
simulator and the unit tests drive them directly. ``serve_router`` adapts the policy to Ray
Serve's ``RequestRouter`` extension API; ``options`` turns ``engine.routing`` into the Engine
deployment's ``RequestRouterConfig``.
"""

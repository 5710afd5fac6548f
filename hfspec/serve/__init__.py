"""``hfspec serve``: an OpenAI-compatible HTTP server over one engine that owns the models.

Floors, bottom up: ``events`` (what a request asks and what comes back; no torch), the engine (continuous
batching over the speculative loop), the HTTP layer (routes, errors, streaming, metrics, the page).
"""

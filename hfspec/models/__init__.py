"""Loading models and their files: the forward adapter, weights, GGUF, sources, presets, caches."""

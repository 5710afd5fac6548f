"""Draft heads: small modules that draft from the target's own hidden states, and their checkpoints.

A head is not a causal LM and is never loaded as one. It is kept in three modules, by
concern: ``files`` recognises a head's directory (the model loader asks it, so it
needs nothing but the files), ``eagle3`` holds the EAGLE-3 modules, and ``checkpoint``
reads and writes the published layouts. None of them knows a cache or a drafter, so
the package sits below the model loader; the drafter that runs a head at generation
time is ``hfspec.drafters.eagle3``, and training builds on the same modules.
"""

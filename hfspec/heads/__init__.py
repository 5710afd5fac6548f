"""Draft heads: small modules that draft from the target's own hidden states, and their checkpoints.

A head is not a causal LM and is never loaded as one. It lives here in three rooms, by
concern, so that each can be imported without the others' weight: ``files`` recognises a
head's directory (the model loader asks it, from the floor below the caches), ``eagle3``
holds the EAGLE-3 modules, and ``checkpoint`` reads and writes the published layouts.
The drafter that runs a head at generation time is ``hfspec.drafters.eagle3``.
"""

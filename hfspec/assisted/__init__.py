"""hfspec behind transformers' ``model.generate(..., custom_generate=...)``: the folder and the callable form.

``CUSTOM_GENERATE`` is the folder to pass (it holds ``custom_generate/generate.py``); ``SpeculativeDecoding(draft)``
is the callable (``hfspec.custom_generate(draft)`` at the top; not exported here, where ``custom_generate`` names
the folder). ``arguments`` maps transformers' arguments onto hfspec's, ``reuse`` keeps one generator per
target and draft, ``run`` decodes and returns what transformers returns.
"""

from __future__ import annotations

from hfspec.assisted.reuse import forget
from hfspec.assisted.run import CUSTOM_GENERATE, SpeculativeDecoding, SpeculativeOutput, generate

__all__ = ["CUSTOM_GENERATE", "SpeculativeDecoding", "SpeculativeOutput", "forget", "generate"]

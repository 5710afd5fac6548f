"""hfspec: lossless speculative decoding for Hugging Face causal LMs.

The public names load on first use (PEP 562): ``import hfspec`` alone imports neither torch nor transformers,
so the command line answers ``--help`` and a bad flag at once.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from hfspec.errors import HfspecError, NumericalFault

__version__ = "0.1.0"

# Public name -> the module that defines it, imported when the name is first read.
_LAZY = {
    "CUSTOM_GENERATE": "hfspec.assisted.run",
    "custom_generate": "hfspec.assisted.run",  # model.generate(..., custom_generate=...)
    "CostModelGamma": "hfspec.policy",
    "FixedGamma": "hfspec.policy",
    "GammaPolicy": "hfspec.policy",
    "GenerateOutput": "hfspec.generator",
    "generate": "hfspec.api",
    "HeuristicGamma": "hfspec.policy",
    "RowStats": "hfspec.stats",
    "SpeculativeGenerator": "hfspec.generator",
    "Stats": "hfspec.stats",
}

__all__ = [
    "CUSTOM_GENERATE",
    "custom_generate",
    "CostModelGamma",
    "FixedGamma",
    "fast",
    "GammaPolicy",
    "GenerateOutput",
    "generate",
    "HeuristicGamma",
    "HfspecError",
    "NumericalFault",
    "RowStats",
    "SpeculativeGenerator",
    "Stats",
    "__version__",
]

if TYPE_CHECKING:  # what the lazy names are, for type checkers and editors
    from hfspec import fast
    from hfspec.api import generate
    from hfspec.assisted.run import CUSTOM_GENERATE, custom_generate
    from hfspec.generator import GenerateOutput, SpeculativeGenerator
    from hfspec.policy import CostModelGamma, FixedGamma, GammaPolicy, HeuristicGamma
    from hfspec.stats import RowStats, Stats


def __getattr__(name: str) -> Any:
    if name == "fast":  # hfspec.fast: the CPU kernel's public face (hfspec/fast.py makes it hfspec.cpu.fast)
        return importlib.import_module("hfspec.fast")
    if name not in _LAZY:
        raise AttributeError(f"module 'hfspec' has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value  # read once; later reads do not come back here
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))

"""hfspec: lossless speculative decoding for Hugging Face causal LMs."""

from __future__ import annotations

from hfspec.api import generate
from hfspec.assisted.run import CUSTOM_GENERATE, custom_generate  # model.generate(..., custom_generate=...)
from hfspec.cpu import fast  # hfspec.fast: the CPU kernel's public face
from hfspec.errors import HfspecError, NumericalFault
from hfspec.generator import GenerateOutput, SpeculativeGenerator
from hfspec.policy import CostModelGamma, FixedGamma, GammaPolicy, HeuristicGamma
from hfspec.stats import RowStats, Stats

__version__ = "0.1.0"

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

"""hfspec: lossless speculative decoding for Hugging Face causal LMs."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from hfspec._version import __version__

if TYPE_CHECKING:  # what the names below are, for readers and type checkers
    from hfspec.api import generate
    from hfspec.assisted.run import CUSTOM_GENERATE, custom_generate
    from hfspec.cpu import fast
    from hfspec.decoding.stats import RowStats, Stats
    from hfspec.errors import HfspecError, NumericalFault
    from hfspec.generator import GenerateOutput, SpeculativeGenerator
    from hfspec.policy import CostModelGamma, FixedGamma, GammaPolicy, HeuristicGamma, Plan, Step
    from hfspec.settings import SamplingParams

# The public names, by the module that defines them. They are imported on first use (PEP 562), not by
# ``import hfspec``: torch and transformers take seconds to import, and ``hfspec --version`` needs neither.
_EXPORTS = {
    "generate": "hfspec.api",
    "CUSTOM_GENERATE": "hfspec.assisted.run",  # model.generate(..., custom_generate=hfspec.CUSTOM_GENERATE)
    "custom_generate": "hfspec.assisted.run",
    "fast": "hfspec.cpu.fast",  # a module: the CPU kernel's public face
    "HfspecError": "hfspec.errors",
    "NumericalFault": "hfspec.errors",
    "GenerateOutput": "hfspec.generator",
    "SpeculativeGenerator": "hfspec.generator",
    "CostModelGamma": "hfspec.policy",
    "FixedGamma": "hfspec.policy",
    "GammaPolicy": "hfspec.policy",
    "HeuristicGamma": "hfspec.policy",
    "Plan": "hfspec.policy",  # what a policy's gamma() returns
    "Step": "hfspec.policy",  # what its update() learns from
    "RowStats": "hfspec.decoding.stats",
    "Stats": "hfspec.decoding.stats",
    "SamplingParams": "hfspec.settings",  # one call's sampling settings: SpeculativeGenerator.generate(sampling_params=)
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
    "Plan",
    "RowStats",
    "SamplingParams",
    "SpeculativeGenerator",
    "Stats",
    "Step",
    "__version__",
]


def __getattr__(name: str) -> object:
    """A public name, imported from its module the first time it is asked for (then kept here)."""
    if name not in _EXPORTS:  # a submodule (``from hfspec import tree``) is imported by Python itself
        raise AttributeError(f"module 'hfspec' has no attribute {name!r}")
    module = importlib.import_module(_EXPORTS[name])
    value = module if module.__name__.endswith(f".{name}") else getattr(module, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})

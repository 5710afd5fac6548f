"""How many tokens to draft next (γ): the interface and simple policies (``simple``) and ``gamma="auto"`` (``auto``)."""

from hfspec.policy.auto import AutoGamma, Calibration, Tuning, as_policy
from hfspec.policy.simple import (
    CostModelGamma,
    FixedGamma,
    GammaPolicy,
    HeuristicGamma,
    Plan,
    Step,
    alpha_from_tokens_per_pass,
    best_gamma,
    predicted_speedup,
)

__all__ = [
    "AutoGamma",
    "Calibration",
    "CostModelGamma",
    "FixedGamma",
    "GammaPolicy",
    "HeuristicGamma",
    "Plan",
    "Step",
    "Tuning",
    "alpha_from_tokens_per_pass",
    "as_policy",
    "best_gamma",
    "predicted_speedup",
]

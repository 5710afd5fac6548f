"""How many tokens to draft next (γ): small pluggable policies.

A policy only chooses γ; acceptance stays min(1, p/q), so every policy is lossless.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


def predicted_speedup(alpha: float, gamma: int, cost: float, verify_cost: float = 1.0) -> float:
    """Expected speedup of Leviathan et al. (arXiv 2211.17192, Thm 3.8), with a verification cost.

    ``alpha`` is the acceptance rate, ``cost`` (c) a draft step ÷ a target step and
    ``verify_cost`` (v) a target forward over γ+1 new tokens ÷ one over a single token:
    (1 - α^(γ+1)) / ((1 - α)(γc + v)). With v = 1 this is the paper's formula.
    """
    if alpha >= 1.0:
        expected_tokens = gamma + 1.0
    else:
        expected_tokens = (1 - alpha ** (gamma + 1)) / (1 - alpha)
    return expected_tokens / (gamma * cost + verify_cost)


def alpha_from_tokens_per_pass(tokens_per_pass: float, gamma: int) -> float:
    """The per-token acceptance rate α whose expected tokens per pass at this γ is the one measured.

    Leviathan et al.'s α is the probability that one draft is accepted, so a pass
    of γ drafts commits (1 - α^(γ+1)) / (1 - α) tokens on average. The share of
    drafts accepted is a different, smaller number (α(1 - α^γ) / ((1 - α)γ) in
    expectation): feeding it to the speed-up formula underestimates the speed-up.
    Solved by bisection; tokens per pass are clipped to [1, γ + 1].
    """
    if gamma < 1:
        raise ValueError(f"gamma must be at least 1, got {gamma}")
    target = min(max(tokens_per_pass, 1.0), gamma + 1.0)
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if sum(mid ** i for i in range(gamma + 1)) < target:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def best_gamma(alpha: float, cost: float, verify_cost: dict[int, float] | None = None,
               maximum: int = 8) -> tuple[int, float]:
    """The γ in 1..maximum with the highest predicted speedup, and that speedup."""
    verify_cost = verify_cost or {}
    return max(((g, predicted_speedup(alpha, g, cost, verify_cost.get(g, 1.0))) for g in range(1, maximum + 1)),
               key=lambda pair: pair[1])


class GammaPolicy:
    """Interface: ``gamma()`` before a step, ``stop(i, confidence)`` while drafting, ``update(drafted, accepted)``
    after it."""

    def gamma(self) -> int:
        raise NotImplementedError

    def stop(self, drafted: int, confidence: Any) -> bool:
        """True ends this step's drafting after ``drafted`` drafts; ``confidence`` (B,) is the drafter's
        probability of each row's last draft."""
        return False

    def update(self, drafted: int, accepted: list[int]) -> None:
        """``accepted`` holds the accepted count of each row that took part in the step."""


@dataclass
class FixedGamma(GammaPolicy):
    value: int

    def gamma(self) -> int:
        return self.value

    def __str__(self) -> str:
        return f"fixed({self.value})"


@dataclass
class HeuristicGamma(GammaPolicy):
    """transformers' schedule: +2 after a fully accepted block, -1 otherwise (never below 1)."""

    value: int = 5
    maximum: int = 16

    def gamma(self) -> int:
        return self.value

    def update(self, drafted: int, accepted: list[int]) -> None:
        if drafted and all(a == drafted for a in accepted):
            self.value = min(self.maximum, self.value + 2)
        else:
            self.value = max(1, self.value - 1)

    def __str__(self) -> str:
        return "heuristic"


@dataclass
class CostModelGamma(GammaPolicy):
    """Pick the γ that maximises the predicted speedup from running estimates.

    α is estimated per drafted token from exponentially decayed counts of accepted
    drafts and Bernoulli trials; c and v(γ) are given (measured by the caller, e.g.
    ``hfspec bench``). The prior α, worth ``prior_weight`` trials, keeps the first
    steps sensible before evidence accrues.
    """

    cost: float
    verify_cost: dict[int, float] = field(default_factory=dict)
    maximum: int = 8
    prior_alpha: float = 0.6
    prior_weight: float = 2.0
    decay: float = 0.98
    _accepted: float = 0.0
    _trials: float = 0.0

    def __post_init__(self) -> None:
        # The prior is pseudo-evidence: it decays like real evidence as steps accrue.
        self._accepted = self.prior_alpha * self.prior_weight
        self._trials = self.prior_weight

    @property
    def alpha(self) -> float:
        return self._accepted / self._trials

    def gamma(self) -> int:
        return best_gamma(min(self.alpha, 0.999), self.cost, self.verify_cost, self.maximum)[0]

    def update(self, drafted: int, accepted: list[int]) -> None:
        # A run of n accepts then a rejection is n successes in n+1 Bernoulli trials;
        # n == drafted is drafted successes and no failure.
        for n in accepted:
            self._accepted = self.decay * self._accepted + n
            self._trials = self.decay * self._trials + n + (1 if n < drafted else 0)

    def __str__(self) -> str:
        return "cost-model"


def as_policy(gamma: int | GammaPolicy) -> GammaPolicy:
    from hfspec.config import check_gamma

    if isinstance(gamma, GammaPolicy):
        return gamma
    return FixedGamma(check_gamma(gamma))

"""How many tokens to draft next (γ): the policy interface, what a step reports to it, and the simple policies.

A policy only chooses γ; acceptance stays min(1, p/q), so every policy is lossless. ``gamma="auto"``,
the policy that measures what pays where it runs, is ``hfspec.policy.auto``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from hfspec.errors import HfspecError, HfspecTypeError
from hfspec.measure.alpha import AlphaEstimate
from hfspec.measure.costs import Price
from hfspec.tree.proposal import Sources


def check_gamma(gamma: Any) -> int:
    """A fixed γ as given by a caller, checked: a positive integer."""
    if isinstance(gamma, bool) or not isinstance(gamma, int):
        raise HfspecTypeError(
            f"gamma (γ, drafts per step) must be a positive integer, 'auto' or a GammaPolicy, got {gamma!r}"
        )
    if gamma < 1:
        raise HfspecError(f"gamma (γ, drafts per step) must be >= 1, got {gamma}")
    return gamma


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
        if sum(mid**i for i in range(gamma + 1)) < target:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def best_gamma(
    alpha: float, cost: float, verify_cost: dict[int, float] | None = None, maximum: int = 8
) -> tuple[int, float]:
    """The γ in 1..maximum with the highest predicted speedup, and that speedup."""
    verify_cost = verify_cost or {}
    return max(
        ((g, predicted_speedup(alpha, g, cost, verify_cost.get(g, 1.0))) for g in range(1, maximum + 1)),
        key=lambda pair: pair[1],
    )


@dataclass(frozen=True)
class Plan:
    """What a policy chose for one step (``GammaPolicy.gamma``); handed back to its ``stop`` and ``update``."""

    gamma: int  # drafts to ask for (a tree: its depth); the loop cuts it to the rows' budgets
    nodes: int = 0  # a tree's node budget; 0: a chain
    price: Price | None = None  # how the step was priced, for a drafter that can take cheaper steps (None: by
    # expected tokens alone)


@dataclass(frozen=True)
class Step:
    """What one step did, for the policy to learn from: a chain's or a tree's (``hfspec.tree``). Tensors are CPU,
    one row per active row."""

    rows: torch.Tensor  # (B,) long: each row's index in the call's batch
    plan: Plan  # what the policy chose for the step
    gamma: int  # the proposal's depth: drafts one row can keep at most (0: a plain step)
    drafted: torch.Tensor  # (B,) long: drafts (a tree: real nodes) each row really proposed
    accepted: torch.Tensor  # (B,) long: drafts each row kept
    confidence: torch.Tensor | None  # (B, picks) the drafter's probability of each chain draft, if it gave one
    draft_seconds: float  # wall time of drafting (catching up included)
    verify_seconds: float  # wall time of the verification forward, acceptance and rollback
    path: torch.Tensor | None = None  # (B, D) long: the kept nodes, -1 past accepted[b]
    parents: torch.Tensor | None = None  # (B, N) long: a tree's parents, -1 for the root's children; None: a chain
    real: torch.Tensor | None = None  # (B, N) bool: False for padding nodes (None: every node is real)
    sources: Sources | None = None  # which of the drafter's sources drafted each row, and what the step paid

    @property
    def tree(self) -> bool:
        return self.parents is not None


class GammaPolicy:
    """Chooses γ: ``begin(batch)`` once per call, ``gamma(rows)`` before a step returns its ``Plan``, which
    ``stop(plan, confidence)`` reads while drafting and ``update(step)`` after it (``Step.plan``). A plan may
    answer a step with a tree instead of a chain (``Plan.nodes``, γ its depth), and say how it priced the step,
    for the drafter (``Plan.price``). The policy's own state is what it learnt; a step's choice is the plan's."""

    def begin(self, batch: int) -> None:
        """A generate call of ``batch`` rows starts."""

    def admit(self, row: int) -> None:
        """Row ``row`` (a new index) joins the running batch (a server's, between steps)."""

    def forget(self, row: int) -> None:
        """Row ``row`` left the batch for good."""

    def gamma(self, rows: torch.Tensor) -> Plan:
        """The next step's plan; ``rows`` (B,) are the active rows' indices in the batch."""
        raise NotImplementedError

    def stop(self, plan: Plan, confidence: list[torch.Tensor]) -> bool:
        """True ends the drafting of the step ``plan`` chose after ``len(confidence)`` drafts; ``confidence[j]``
        (B,) is the drafter's probability of each row's draft j."""
        return False

    def update(self, step: Step) -> None:
        """Learn from the step just taken (a chain's or a tree's)."""


@dataclass
class FixedGamma(GammaPolicy):
    value: int

    def gamma(self, rows: torch.Tensor) -> Plan:
        return Plan(self.value)

    def __str__(self) -> str:
        return f"fixed({self.value})"


@dataclass
class HeuristicGamma(GammaPolicy):
    """transformers' schedule: +2 after a fully accepted block, -1 otherwise (never below 1)."""

    value: int = 5
    maximum: int = 16

    def gamma(self, rows: torch.Tensor) -> Plan:
        return Plan(self.value)

    def update(self, step: Step) -> None:
        if step.tree:  # the schedule is a chain's
            return
        if step.gamma and bool((step.accepted == step.drafted).all()):
            self.value = min(self.maximum, self.value + 2)
        else:
            self.value = max(1, self.value - 1)

    def __str__(self) -> str:
        return "heuristic"


@dataclass
class CostModelGamma(GammaPolicy):
    """Pick the γ that maximises the predicted speedup from running estimates.

    α is estimated per drafted token from decayed counts (``AlphaEstimate``); c and v(γ)
    are given (measured by the caller, e.g. ``hfspec bench``). The prior α, worth
    ``prior_weight`` trials, keeps the first steps sensible before evidence accrues.
    ``gamma="auto"`` (``AutoGamma``) measures c and v(γ) itself and may choose γ = 0.
    """

    cost: float
    verify_cost: dict[int, float] = field(default_factory=dict)
    maximum: int = 8
    prior_alpha: float = 0.6
    prior_weight: float = 2.0
    decay: float = 0.98

    def __post_init__(self) -> None:
        self.evidence = AlphaEstimate(self.prior_alpha, self.prior_weight, self.decay)

    @property
    def alpha(self) -> float:
        return self.evidence.alpha

    def gamma(self, rows: torch.Tensor) -> Plan:
        return Plan(best_gamma(min(self.alpha, 0.999), self.cost, self.verify_cost, self.maximum)[0])

    def update(self, step: Step) -> None:
        if step.tree:  # α is a chain's acceptance
            return
        for d, n in zip(step.drafted.tolist(), step.accepted.tolist()):
            self.evidence.add_step(d, n)

    def __str__(self) -> str:
        return "cost-model"

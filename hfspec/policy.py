"""How many tokens to draft next (γ): small pluggable policies.

A policy only chooses γ; acceptance stays min(1, p/q), so every policy is lossless.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from hfspec.acceptance import Acceptance
from hfspec.config import check_gamma
from hfspec.costs import Costs


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


@dataclass(frozen=True)
class Step:
    """What one step did, for the policy to learn from. Tensors are CPU, one entry per active row."""

    rows: torch.Tensor  # (B,) long: each row's index in the call's batch
    gamma: int  # the proposal's width: drafts per row at most (0: a plain step)
    drafted: torch.Tensor  # (B,) long: drafts each row really proposed (≤ γ)
    accepted: torch.Tensor  # (B,) long: drafts each row kept
    confidence: torch.Tensor | None  # (B, drafted.max()) the drafter's probability of each draft, if it gave one
    draft_seconds: float  # wall time of drafting (catching up included)
    verify_seconds: float  # wall time of the verification forward, acceptance and rollback


class GammaPolicy:
    """Chooses γ: ``begin(batch)`` once per call, ``gamma(rows)`` before a step, ``stop(i, confidence)``
    while drafting, ``update(step)`` after it."""

    def begin(self, batch: int) -> None:
        """A generate call of ``batch`` rows starts."""

    def gamma(self, rows: torch.Tensor) -> int:
        """Drafts to ask for in the next step; ``rows`` (B,) are the active rows' indices in the batch."""
        raise NotImplementedError

    def stop(self, drafted: int, confidence: torch.Tensor) -> bool:
        """True ends this step's drafting after ``drafted`` drafts; ``confidence`` (B,) is the drafter's
        probability of each row's last draft."""
        return False

    def update(self, step: Step) -> None:
        """Learn from the step just taken."""


@dataclass
class FixedGamma(GammaPolicy):
    value: int

    def gamma(self, rows: torch.Tensor) -> int:
        return self.value

    def __str__(self) -> str:
        return f"fixed({self.value})"


@dataclass
class HeuristicGamma(GammaPolicy):
    """transformers' schedule: +2 after a fully accepted block, -1 otherwise (never below 1)."""

    value: int = 5
    maximum: int = 16

    def gamma(self, rows: torch.Tensor) -> int:
        return self.value

    def update(self, step: Step) -> None:
        if step.gamma and bool((step.accepted == step.drafted).all()):
            self.value = min(self.maximum, self.value + 2)
        else:
            self.value = max(1, self.value - 1)

    def __str__(self) -> str:
        return "heuristic"


@dataclass
class CostModelGamma(GammaPolicy):
    """Pick the γ that maximises the predicted speedup from running estimates.

    α is estimated per drafted token from decayed counts (``Acceptance``); c and v(γ)
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
        self.evidence = Acceptance(self.prior_alpha, self.prior_weight, self.decay)

    @property
    def alpha(self) -> float:
        return self.evidence.alpha

    def gamma(self, rows: torch.Tensor) -> int:
        return best_gamma(min(self.alpha, 0.999), self.cost, self.verify_cost, self.maximum)[0]

    def update(self, step: Step) -> None:
        for d, n in zip(step.drafted.tolist(), step.accepted.tolist()):
            self.evidence.add_step(d, n)

    def __str__(self) -> str:
        return "cost-model"


def as_policy(gamma: int | str | GammaPolicy, tuning: Tuning | None = None) -> GammaPolicy:
    """A policy from what a caller passes as ``gamma``: a number, ``"auto"`` or a policy."""
    if isinstance(gamma, GammaPolicy):
        return gamma
    if isinstance(gamma, str) and gamma == "auto":
        if tuning is None:
            raise ValueError("gamma='auto' needs the generator's measured costs; pass it to SpeculativeGenerator.generate")
        return AutoGamma(tuning)
    return FixedGamma(check_gamma(gamma))


# -- auto: speculation that pays on the machine at hand -------------------------------------------


class Calibration:
    """How often a draft is accepted, by the drafter's own probability of it (decayed counts in bins).

    A drafter's confidence is a hint, not a probability of acceptance: the bins learn
    what it is worth. Until a bin has evidence, an estimate takes the overall α, or the
    confidence itself where that is lower (a drafter that says it is unsure is believed).
    Plain Python numbers: a step asks for a handful of them, and tiny tensors would cost more.
    """

    def __init__(self, bins: int = 10, weight: float = 4.0, decay: float = 0.999):
        self.bins, self.weight, self.decay = bins, weight, decay
        self.accepted = [0.0] * bins
        self.trials = [0.0] * bins

    def index(self, confidence: float) -> int:
        return min(self.bins - 1, max(0, int(confidence * self.bins)))

    def predict(self, confidence: list[float], fallback: list[float]) -> list[float]:
        """Estimated acceptance of drafts with ``confidence``, one per row; ``fallback`` is each row's α."""
        out = []
        for c, a in zip(confidence, fallback):
            i = self.index(c)
            out.append((self.accepted[i] + self.weight * min(a, c)) / (self.trials[i] + self.weight))
        return out

    def add(self, confidence: list[list[float]], reached: list[int], accepted: list[int]) -> None:
        """Row b's drafts with ``confidence[b]``: the first ``reached[b]`` were decided, the first
        ``accepted[b]`` of those kept."""
        decay = self.decay ** sum(reached)
        self.accepted = [x * decay for x in self.accepted]
        self.trials = [x * decay for x in self.trials]
        for conf, n, kept in zip(confidence, reached, accepted):
            for j, c in enumerate(conf[:n]):
                i = self.index(c)
                self.trials[i] += 1.0
                self.accepted[i] += 1.0 if j < kept else 0.0


@dataclass
class Tuning:
    """What a generator learns across calls: its measured costs and how well its drafter does.

    ``memory`` holds acceptance evidence per sampling setting (greedy and each
    temperature accept differently); a call starts each prompt from it.
    """

    costs: Costs | None = None
    memory: dict[Any, Acceptance] = field(default_factory=dict)
    calibration: dict[Any, Calibration] = field(default_factory=dict)
    probes: dict[Any, list[int]] = field(default_factory=dict)  # [plain steps since the last probe, interval]
    setting: Any = None  # the current call's sampling setting, the key of memory and calibration
    maximum: int = 8  # largest γ considered; costs are measured for 1..maximum+1 new tokens

    def evidence(self) -> Acceptance:
        return self.memory.setdefault(self.setting, Acceptance(prior=0.5, weight=2.0, decay=0.995))

    def calibrated(self) -> Calibration:
        return self.calibration.setdefault(self.setting, Calibration())

    def probe_state(self, first_interval: int) -> list[int]:
        return self.probes.setdefault(self.setting, [0, first_interval])


class AutoGamma(GammaPolicy):
    """``gamma="auto"``: the γ in 0..K with the best expected tokens per second, step by step.

    For each step it maximises, over γ, the expected committed tokens of the active rows
    (Leviathan et al., arXiv 2211.17192: (1 - α^(γ+1)) / (1 - α) per row, with each row's
    own running α) divided by the time the step will take (γ drafting steps plus a target
    forward over γ+1 tokens, from the measured and refined ``Costs``). γ = 0 is plain
    decoding. While plain decoding wins, a probe step with drafts now and then (ever rarer
    while probes fail) notices when acceptance rises again.

    Within a step, drafting stops early when the drafter's probabilities, calibrated by
    what was accepted before, say that drafting on can no longer raise the step's
    expected tokens per second (the threshold is that comparison, not a constant).
    Only γ is chosen here; acceptance stays min(1, p/q), so every choice is lossless.
    """

    row_weight = 4.0  # trials' worth of the generator's memory a new prompt starts from
    row_decay = 0.95
    probe_every = 8  # plain steps before the first probe
    probe_max = 256  # plain steps between probes at most

    def __init__(self, tuning: Tuning):
        if tuning.costs is None:
            raise ValueError("AutoGamma needs measured costs (Tuning.costs)")
        self.tuning, self.costs = tuning, tuning.costs
        self.maximum = min(tuning.maximum, self.costs.max_gamma)
        self.calibration = tuning.calibrated()
        # Plain steps since the last probe, and the probe interval: kept across calls, so short calls probe too.
        self.probe = tuning.probe_state(self.probe_every)
        self.probing = False
        self.after_plain = True  # the next drafting step also catches up on every token since

    def begin(self, batch: int) -> None:
        # Each prompt accepts at its own rate: it starts from the generator's memory and learns apart.
        memory = self.tuning.evidence()
        self.by_row = [Acceptance(memory.alpha, self.row_weight, self.row_decay) for _ in range(batch)]

    def alphas(self, rows: torch.Tensor) -> list[float]:
        return [min(0.99, self.by_row[r].alpha) for r in rows.tolist()]

    def gamma(self, rows: torch.Tensor) -> int:
        self.batch, self.alpha = rows.numel(), self.alphas(rows)
        self.reach = [1.0] * self.batch  # P(every draft so far is accepted), per row
        self.expected = float(self.batch)  # expected tokens of the step with the drafts so far
        gamma = self.best(0)
        self.probing = False
        if gamma == 0:
            self.probe[0] += 1
            if self.probe[0] >= self.probe[1]:  # probe: draft anyway, to learn whether it pays again
                self.probe[:] = [0, min(2 * self.probe[1], self.probe_max)]
                self.probing = True
                gamma = self.best(0, at_least=1)
        else:
            self.probe[:] = [0, self.probe_every]
        self.chosen = gamma
        return gamma

    def best(self, drafted: int, at_least: int = 0) -> int:
        """The γ ≥ ``drafted`` (and ≥ ``at_least``) with the best expected tokens per second."""
        t_draft = self.costs.draft_seconds(self.batch)
        best, rate, future = drafted, -1.0, 0.0
        powers = list(self.reach)  # reach · α^k for the k-th draft after these
        for g in range(drafted, self.maximum + 1):
            if g > drafted:
                powers = [p * a for p, a in zip(powers, self.alpha)]
                future += sum(powers)
            if g < at_least:
                continue
            r = (self.expected + future) / (g * t_draft + self.costs.verify_seconds(self.batch, g + 1))
            if r > rate:
                best, rate = g, r
        return best

    def stop(self, drafted: int, confidence: torch.Tensor) -> bool:
        accept = self.calibration.predict(confidence.tolist(), self.alpha)
        self.reach = [r * a for r, a in zip(self.reach, accept)]
        self.expected += sum(self.reach)
        return drafted >= self.chosen or self.best(drafted) == drafted

    def update(self, step: Step) -> None:
        memory = self.tuning.evidence()
        drafted, accepted = step.drafted.tolist(), step.accepted.tolist()
        if self.probing and any(d and n == d for d, n in zip(drafted, accepted)):
            self.probe[1] = self.probe_every  # a probe that paid: look again soon
        for row, d, n in zip(step.rows.tolist(), drafted, accepted):
            self.by_row[row].add_step(d, n)
            memory.add_step(d, n)
        if step.confidence is not None and step.confidence.numel():
            # Draft j of a row was decided if the drafts before it were accepted; it was kept if j < accepted.
            reached = [min(n + 1, d) for d, n in zip(drafted, accepted)]
            self.calibration.add(step.confidence.tolist(), reached, accepted)
        batch = step.rows.numel()
        self.costs.record_verify(batch, step.gamma + 1, step.verify_seconds)
        if step.gamma and not self.after_plain:  # after plain steps, drafting began with a long catch-up
            self.costs.record_draft(batch, step.draft_seconds / step.gamma)
        self.after_plain = step.gamma == 0

    def __str__(self) -> str:
        return "auto"

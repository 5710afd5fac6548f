"""A running estimate of the per-token acceptance rate α, from decayed Bernoulli counts.

Leviathan et al. (arXiv 2211.17192) model each draft as accepted with probability α,
independently, so a step of k drafts whose first n are accepted is n successes and, if
n < k, one failure; drafts after the first rejection were never tried. Old steps fade
with a decay, so that the estimate follows a drafter whose acceptance drifts (a new
topic, a new prompt), and a prior worth a few trials keeps the first steps sensible.

One class serves the γ policies (``hfspec.policy``: a generator's memory, each row of a
call) and the hybrid drafter (``hfspec.drafters.hybrid``: n-gram against model drafts).
It imports nothing of hfspec's, so every floor may use it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class AlphaEstimate:
    """α as decayed counts: ``accepted`` successes in ``trials`` trials, the prior included."""

    prior: float = 0.5  # α before any evidence
    weight: float = 2.0  # the prior is worth this many trials
    decay: float = 0.98  # each new run multiplies older evidence by this

    def __post_init__(self) -> None:
        self.accepted = self.prior * self.weight
        self.trials = self.weight

    @property
    def alpha(self) -> float:
        return self.accepted / self.trials if self.trials > 0 else 0.0

    def add(self, accepted: int, failed: bool) -> None:
        """A run of ``accepted`` successes, then one failure if ``failed``; older evidence decays even when
        the run is empty (a comparison that ran out before its first draft)."""
        self.accepted = self.decay * self.accepted + accepted
        self.trials = self.decay * self.trials + accepted + failed

    def add_step(self, drafted: int, accepted: int) -> None:
        """A step that drafted ``drafted`` tokens and kept the first ``accepted``; a step without drafts
        says nothing about α and changes nothing."""
        if drafted:
            self.add(accepted, accepted < drafted)

    def expected(self, drafts: int) -> float:
        """Expected accepted drafts of ``drafts`` proposed: α + α² + … + α^drafts."""
        a = min(self.alpha, 0.999)  # α = 1 would divide by zero, and no drafter is perfect
        return a * (1 - a**drafts) / (1 - a)

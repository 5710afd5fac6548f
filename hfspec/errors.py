"""Errors hfspec raises for problems a user can fix."""
from __future__ import annotations


class HfspecError(ValueError):
    """A problem with the user's input or setup; the message says what to do."""


class NumericalFault(RuntimeError):
    """A model produced logits or probabilities that cannot be sampled from (NaN, inf)."""

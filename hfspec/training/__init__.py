"""Training drafts for a target: a small draft model (:mod:`~hfspec.training.draft_model`) or an EAGLE-3 head
(:mod:`~hfspec.training.eagle3`), on text the target generates (:mod:`~hfspec.training.staging`).

The two kinds share the staging of text, the optimiser and its loop (:mod:`~hfspec.training.optim`),
the run's settings (:mod:`~hfspec.training.settings`), the target (:mod:`~hfspec.training.target`)
and the report (:mod:`~hfspec.training.report`); ``hfspec distill`` is :mod:`~hfspec.training.command`.
"""

from hfspec.training.command import add_parser, run
from hfspec.training.draft_model import DraftModelReport, train_draft_model
from hfspec.training.eagle3 import Eagle3Report, model_card, train_eagle3_head

__all__ = [
    "DraftModelReport",
    "Eagle3Report",
    "add_parser",
    "model_card",
    "run",
    "train_draft_model",
    "train_eagle3_head",
]

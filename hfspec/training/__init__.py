"""Training drafts for a target: a small draft model (:mod:`~hfspec.training.draft_model`) or an EAGLE-3 head
(:mod:`~hfspec.training.eagle3`: its head and training-time test in :mod:`~hfspec.training.eagle3_ttt`, its held-out
evaluation in :mod:`~hfspec.training.eagle3_eval`, its model card in :mod:`~hfspec.training.eagle3_card`), on text
the target generates (:mod:`~hfspec.training.staging`).

The two kinds share the staging of text, the optimiser and its loop (:mod:`~hfspec.training.optim`),
the run's settings (:mod:`~hfspec.training.settings`), the target (:mod:`~hfspec.training.target`)
and the report (:mod:`~hfspec.training.report`); ``hfspec distill`` is :mod:`~hfspec.training.command`.
"""

from hfspec.training.command import add_parser, run
from hfspec.training.draft_model import DraftModelReport, train_draft_model
from hfspec.training.eagle3 import Eagle3Report, train_eagle3_head
from hfspec.training.eagle3_card import model_card

__all__ = [
    "DraftModelReport",
    "Eagle3Report",
    "add_parser",
    "model_card",
    "run",
    "train_draft_model",
    "train_eagle3_head",
]

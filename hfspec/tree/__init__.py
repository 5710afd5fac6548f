"""Draft proposals, chains and trees: the representation (``proposal``), growing trees (``build``), accepting along
a proposal (``verify``), how well a drafter's trees fare (``acceptance``) and whether a target reads them exactly
(``probe``).

The pure tensor math is handed on here; ``acceptance`` and ``probe`` are imported by their own names.
"""

from hfspec.tree.build import NextLevel, expand, graft, grow, shape
from hfspec.tree.proposal import Proposal, Sources, ancestry, chain_path, depths, path_tokens
from hfspec.tree.verify import verify, verify_greedy

__all__ = [
    "NextLevel",
    "Proposal",
    "Sources",
    "ancestry",
    "chain_path",
    "depths",
    "expand",
    "graft",
    "grow",
    "path_tokens",
    "shape",
    "verify",
    "verify_greedy",
]

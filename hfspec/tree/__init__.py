"""Draft trees: the representation (``proposal``), growing them (``build``), accepting along them (``verify``),
how well a drafter's trees fare (``acceptance``) and whether a target reads them exactly (``probe``).

The pure tensor math is handed on here; ``acceptance`` and ``probe`` are imported by their own names.
"""

from hfspec.tree.build import NextLevel, expand, graft, grow, shape
from hfspec.tree.proposal import TreeProposal, ancestry, depths, path_tokens
from hfspec.tree.verify import verify_tree, verify_tree_greedy

__all__ = [
    "NextLevel",
    "TreeProposal",
    "ancestry",
    "depths",
    "expand",
    "graft",
    "grow",
    "path_tokens",
    "shape",
    "verify_tree",
    "verify_tree_greedy",
]

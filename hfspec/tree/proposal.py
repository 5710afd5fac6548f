"""Draft trees: several candidates per depth, verified in one target forward.

A chain of drafts stops at its first wrong token; a tree keeps several children per
node, so that when the target rejects one candidate another may still match. As in
SafeAILab/EAGLE (``eagle/model/utils.py``), a tree is a few tensors per row: the node
tokens, each node's parent, and the distribution ``q`` each node was drawn from at its
parent. Nodes are numbered parents first (a parent's index is below its children's), and
the children of one node in the order they were drawn. Parent ``-1`` is the root: the
pending token, which the target reads first.

This module is the representation and its index math; ``build`` grows trees and
``verify`` accepts along them. p is the target's distribution and q the draft's, as in the
papers. Nothing here touches a model or a cache.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TreeProposal:
    """Draft tokens for one step, as a tree per row (rows padded to the same node count).

    ``tokens`` (B, N) long; ``parents`` (B, N) long, ``-1`` for a child of the root;
    ``q`` (B, N, V) the distribution each node was drawn from at its parent (all siblings
    share it when they were drawn without replacement), or ``None`` when every node was
    picked deterministically (one-hot q); ``real`` (B, N) bool, False for padding nodes,
    which are never accepted; ``forwards`` the draft forwards it took.
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    q: torch.Tensor | None = None
    real: torch.Tensor | None = None
    forwards: int | None = None

    @property
    def nodes(self) -> int:
        return self.tokens.shape[1]

    @property
    def gamma(self) -> int:
        """The deepest path's length: the most drafts one step can accept."""
        return int(depths(self.parents).max()) if self.nodes else 0

    def draft_forwards(self) -> int:
        return self.gamma if self.forwards is None else self.forwards

    def drafted(self) -> torch.Tensor:
        """(B,) real nodes per row."""
        return self.mask().sum(dim=1)

    def mask(self) -> torch.Tensor:
        return self.real if self.real is not None else torch.ones_like(self.tokens, dtype=torch.bool)


def depths(parents: torch.Tensor) -> torch.Tensor:
    """(B, N) depth of each node: 1 for a child of the root, one more per generation."""
    depth = torch.zeros_like(parents)
    for i in range(parents.shape[1]):  # parents come first, so their depth is known
        par = parents[:, i]
        depth[:, i] = 1 + torch.where(par >= 0, depth.gather(1, par.clamp(min=0)[:, None])[:, 0], 0)
    return depth


def ancestry(parents: torch.Tensor) -> torch.Tensor:
    """(B, N, N) bool: ``[b, i, j]`` when node j is node i or one of its ancestors (what node i attends to)."""
    batch, n = parents.shape
    seen = torch.zeros(batch, n, n, dtype=torch.bool, device=parents.device)
    rows = torch.arange(batch, device=parents.device)
    for i in range(n):
        par = parents[:, i]
        inherited = seen[rows, par.clamp(min=0)] & (par >= 0)[:, None]
        seen[:, i] = inherited
        seen[:, i, i] = True
    return seen


def path_tokens(tokens: torch.Tensor, path: torch.Tensor) -> torch.Tensor:
    """(B, D) the tokens of the nodes ``path`` (B, D) lists (entries ``-1`` read as node 0; callers cut them)."""
    return tokens.gather(1, path.clamp(min=0))

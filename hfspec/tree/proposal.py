"""A step's drafts: one proposal type for chains and trees, and its index math.

As in SafeAILab/EAGLE (``eagle/model/utils.py``) and SGLang, a proposal is a few tensors per
row: the node tokens, each node's parent, and the distribution ``q`` each node was drawn
from at its parent. A chain is the tree whose node i has parent i − 1; a tree keeps several
children per node, so that when the target rejects one candidate another may still match.
Nodes are numbered parents first (a parent's index is below its children's), and the
children of one node in the order they were drawn. Parent ``-1`` is the root: the pending
token, which the target reads first.

A proposal also says, per row, which of a drafter's sources drafted it (``Sources``), for a
γ policy that prices them apart; what the target kept is the verdict's (``verify``).

This module is the representation and its index math; ``build`` grows trees and
``verify`` accepts along them. p is the target's distribution and q the draft's, as in the
papers. Nothing here touches a model or a cache.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Sources:
    """Per row, where a proposal came from, for a γ policy that prices a drafter's sources apart (a hybrid:
    n-gram lookup beside a draft model). Tensors are CPU, one entry per row."""

    lookup: torch.Tensor  # (B,) long: the lookup's drafts in the row (0: it found no match)
    matched: torch.Tensor  # (B,) long: the length of the lookup's match (0: none)
    took_lookup: torch.Tensor  # (B,) bool: the row's drafts are the lookup's; else the model's, where it ran
    agree: torch.Tensor  # (B,) long: how many leading lookup drafts equal the model's (rows where both drafted)
    model_gamma: int  # drafts the model was asked for: what the step paid for (0: the model did not run)


@dataclass(frozen=True)
class Proposal:
    """Draft tokens for one step, as a tree per row (rows padded to the same node count).

    ``tokens`` (B, N) long; ``q`` (B, N, V) the distribution each node was drawn from at its
    parent (all siblings share it when they were drawn without replacement), or ``None`` when
    every node was picked deterministically (one-hot q); ``parents`` (B, N) long, ``-1`` for a
    child of the root, or ``None`` for a chain (node i's parent is i − 1); ``real`` (B, N)
    bool, False for padding nodes, which are never accepted (a chain's real nodes are a
    prefix of each row); ``forwards`` the draft forwards it took (``None``: one per level);
    ``sources`` which of the drafter's sources drafted each row (``None``: it has one).
    """

    tokens: torch.Tensor
    q: torch.Tensor | None = None
    parents: torch.Tensor | None = None
    real: torch.Tensor | None = None
    forwards: int | None = None
    sources: Sources | None = None

    @classmethod
    def chain(
        cls,
        tokens: torch.Tensor,
        q: torch.Tensor | None = None,
        counts: torch.Tensor | None = None,
        forwards: int | None = None,
    ) -> Proposal:
        """A chain of drafts (B, γ); ``counts`` (B,) the drafts of each row, ≤ γ (``None``: γ in every row)."""
        real = None
        if counts is not None:
            real = torch.arange(tokens.shape[1], device=tokens.device)[None, :] < counts[:, None]
        return cls(tokens, q, None, real, forwards)

    @classmethod
    def empty(cls, batch: int, device: torch.device) -> Proposal:
        return cls(torch.zeros(batch, 0, dtype=torch.long, device=device))

    @property
    def is_chain(self) -> bool:
        return self.parents is None

    @property
    def nodes(self) -> int:
        return self.tokens.shape[1]

    @property
    def gamma(self) -> int:
        """The deepest path's length: the most drafts one step can accept (a chain's width)."""
        if self.parents is None or not self.nodes:
            return self.nodes
        return int(depths(self.parents).max())

    def draft_forwards(self) -> int:
        return self.gamma if self.forwards is None else self.forwards

    def drafted(self) -> torch.Tensor:
        """(B,) real nodes per row."""
        if self.real is None:
            return torch.full((self.tokens.shape[0],), self.nodes, dtype=torch.long, device=self.tokens.device)
        return self.real.sum(dim=1)

    def mask(self) -> torch.Tensor:
        return self.real if self.real is not None else torch.ones_like(self.tokens, dtype=torch.bool)

    def parent_ids(self) -> torch.Tensor:
        """(B, N) each node's parent (a chain's: i − 1)."""
        if self.parents is not None:
            return self.parents
        return (torch.arange(self.nodes, device=self.tokens.device) - 1).expand_as(self.tokens)

    def with_sources(self, sources: Sources) -> Proposal:
        return Proposal(self.tokens, self.q, self.parents, self.real, self.forwards, sources)


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


def chain_path(accepted: torch.Tensor, width: int) -> torch.Tensor:
    """(B, width) a chain's accepted nodes: 0, 1, … up to ``accepted[b]``, then -1."""
    columns = torch.arange(width, device=accepted.device)[None, :]
    return torch.where(columns < accepted[:, None], columns, -1)


def path_tokens(tokens: torch.Tensor, path: torch.Tensor) -> torch.Tensor:
    """(B, D) the tokens of the nodes ``path`` (B, D) lists (entries ``-1`` read as node 0; callers cut them)."""
    return tokens.gather(1, path.clamp(min=0))

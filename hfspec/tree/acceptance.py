"""How well a drafter's trees fare: acceptance by sibling rank and by depth, and a tree's expected tokens.

A chain step keeps its drafts while each is the target's choice (α per draft, Leviathan et al.,
arXiv 2211.17192). A tree (``hfspec.tree``) offers several children at a node, and the target
keeps one if any matches. Decayed counts learn from tree steps what that is worth:

* by rank among siblings: β_j, the probability that a node's j-th child (in the order drafted:
  the drafter's j-th guess) is accepted when its elder siblings were rejected. Before evidence
  β_1 = α, the chain's rate, and β_j = α / (j + 1) beyond, a cautious guess that evidence replaces;
* by depth, per node budget N: a_N(d), the probability that a step whose path reached depth d - 1
  keeps a node at depth d. Before evidence (and as the prior blended with it) the ranks say: a node
  with c children keeps one with probability 1 - Π_{j≤c} (1 - β_j).

The prior's shape of a tree of N nodes is ``hfspec.tree.shape(N) = (w, D)``: w new nodes per level,
D levels; the root has w children, and each deeper node on the path is taken to have ⌈w/2⌉ (a
dynamic tree gives its likeliest node most of a level's slots, not all). A tree step's expected
tokens are then 1 + Σ_{d≤D} Π_{i≤d} a_N(i): the target's own token plus each depth reached.
Plain Python numbers: a step asks for a handful of them.
"""

from __future__ import annotations

import math

from hfspec.tree.build import shape

RANKS = 8  # sibling ranks learnt apart; later ones count as never accepted (a cautious price)


class TreeAcceptance:
    """β_j by sibling rank and a_N(d) by depth for each node budget N, as decayed counts."""

    def __init__(self, weight: float = 4.0, decay: float = 0.98):
        self.weight, self.decay = weight, decay
        self.rank_hits, self.rank_trials = [0.0] * RANKS, [0.0] * RANKS
        self.depth_hits: dict[int, list[float]] = {}
        self.depth_trials: dict[int, list[float]] = {}

    def rank(self, j: int, alpha: float) -> float:
        """β_j (j from 0: the first child) with its prior from the chain's ``alpha``."""
        prior = alpha if j == 0 else alpha / (j + 2)
        return (self.rank_hits[j] + self.weight * prior) / (self.rank_trials[j] + self.weight)

    def level(self, children: int, alpha: float) -> float:
        """The probability that one of a node's ``children`` is accepted, from the ranks."""
        return 1.0 - math.prod(1.0 - self.rank(j, alpha) for j in range(min(children, RANKS)))

    def depth(self, nodes: int, d: int, alpha: float) -> float:
        """a_N(d) for a tree of ``nodes`` (d from 1): the depth counts blended with the ranks' prior."""
        width = shape(nodes)[0]
        prior = self.level(width if d == 1 else -(-width // 2), alpha)
        hits, trials = self.depth_hits.get(nodes, []), self.depth_trials.get(nodes, [])
        if d > len(trials):
            return prior
        return (hits[d - 1] + self.weight * prior) / (trials[d - 1] + self.weight)

    def expected_tokens(self, nodes: int, alpha: float) -> float:
        """Expected tokens a step with a tree of ``nodes`` commits in one row whose chain rate is ``alpha``."""
        total, reach = 1.0, 1.0
        for d in range(1, shape(nodes)[1] + 1):
            reach *= self.depth(nodes, d, alpha)
            total += reach
        return total

    def add(self, nodes: int, parents: list[int], real: list[bool], path: list[int], accepted: int) -> None:
        """One row of a tree step of budget ``nodes``: node i's parent ``parents[i]`` (-1: the root), ``real[i]``
        False for padding, the kept nodes ``path[:accepted]``."""
        self.fade()
        hits = _grown(self.depth_hits.setdefault(nodes, []), accepted + 1)
        trials = _grown(self.depth_trials.setdefault(nodes, []), accepted + 1)
        parent = -1
        for d in range(accepted + 1):
            siblings = [i for i, (p, r) in enumerate(zip(parents, real)) if p == parent and r]
            if not siblings:  # a leaf: the path could not go deeper, so nothing was tried
                break
            kept = siblings.index(path[d]) if d < accepted else len(siblings)
            for j in range(min(kept + 1, len(siblings), RANKS)):  # elder siblings rejected, then the kept one
                self.rank_trials[j] += 1.0
                self.rank_hits[j] += 1.0 if j == kept else 0.0
            trials[d] += 1.0
            hits[d] += 1.0 if d < accepted else 0.0
            if d < accepted:
                parent = path[d]

    def fade(self) -> None:
        """Older evidence weighs less, so that the estimates follow a drafter whose acceptance drifts."""
        for counts in [self.rank_hits, self.rank_trials, *self.depth_hits.values(), *self.depth_trials.values()]:
            counts[:] = [x * self.decay for x in counts]


def first_children(parents: list[int], real: list[bool], path: list[int], accepted: int) -> tuple[int, int]:
    """The chain inside one row of a tree step: ``(drafted, kept)``, the length of the path that takes each
    node's first child (the drafter's first guess, drawn as a chain draft is) and how many of its leading
    nodes the step kept. A chain step's acceptance, observed in a tree step: the rank-0 child is drafted
    and tried exactly as a chain's draft at that depth, so chain estimates may learn from it."""
    first: dict[int, int] = {}
    for i, (p, r) in enumerate(zip(parents, real)):
        if r:
            first.setdefault(p, i)  # children are numbered in the order they were drafted
    drafted, node = 0, -1
    while node in first:
        node = first[node]
        drafted += 1
    kept, node = 0, -1
    while kept < accepted and path[kept] == first.get(node):
        node = path[kept]
        kept += 1
    return drafted, kept


def _grown(counts: list[float], size: int) -> list[float]:
    counts.extend([0.0] * (size - len(counts)))
    return counts

"""Draft trees: several candidates per depth, verified in one target forward.

A chain of drafts stops at its first wrong token; a tree keeps several children per
node, so that when the target rejects one candidate another may still match. As in
SafeAILab/EAGLE (``eagle/model/utils.py``), a tree is a few tensors per row: the node
tokens, each node's parent, and the distribution ``q`` each node was drawn from at its
parent. Nodes are numbered parents first (a parent's index is below its children's), and
the children of one node in the order they were drawn. Parent ``-1`` is the root: the
pending token, which the target reads first.

Acceptance (pure functions below) generalises Leviathan et al. (arXiv 2211.17192) to many
candidates per position, as SpecInfer (arXiv 2305.09781) and recursive speculative
decoding (Jeon et al., arXiv 2402.14160) do: at a node, try its children in order; child x
is accepted with probability min(1, p'(x)/q'(x)); on a rejection p' ← norm(max(0, p' − q'))
and the next child's q' is its own q with every token tried so far removed and
renormalised. This is exact (the accepted path, then the next token, are distributed as
the target's own sampling) when each child is drawn from q' given the earlier children,
that is, *without replacement* from its parent's q, or deterministically (a one-hot q,
which removal leaves as it is); how many children a node gets may depend on anything
drawn before them, never on their own values. Greedy decoding walks the tree following
the target's argmax, which is exact for any tree.

p is the target's distribution and q the draft's, as in the papers. Nothing here touches
a model or a cache.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from hfspec import sampling


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


def verify_tree_greedy(tree: TreeProposal, target_argmax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor,
                                                                                   torch.Tensor]:
    """Exact greedy verification of a tree: from the root, follow the child equal to the target's argmax.

    ``target_argmax`` (B, N+1): the target's argmax after the root (column 0) and after each
    node (column 1 + node). Returns ``(path, accepted, next_token)``: the accepted nodes (B, D)
    padded with -1, their count (B,), and the target's argmax after the last of them. Siblings
    carry different tokens, so at most one child matches; the output is the target's own greedy.
    """
    batch = tree.tokens.shape[0]
    depth = tree.gamma
    path = torch.full((batch, max(depth, 1)), -1, dtype=torch.long, device=tree.tokens.device)
    current = torch.full((batch,), -1, dtype=torch.long, device=tree.tokens.device)
    alive = torch.ones(batch, dtype=torch.bool, device=tree.tokens.device)
    real = tree.mask()
    for d in range(depth):
        want = target_argmax.gather(1, (current + 1)[:, None])  # (B, 1) the target's token after `current`
        match = (tree.parents == current[:, None]) & (tree.tokens == want) & real
        found = match.any(dim=1) & alive
        child = match.long().argmax(dim=1)
        path[:, d] = torch.where(found, child, -1)
        current = torch.where(found, child, current)
        alive = found
    accepted = (path >= 0).sum(dim=1)
    next_token = target_argmax.gather(1, (current + 1)[:, None]).squeeze(1)
    return path, accepted, next_token


def verify_tree(tree: TreeProposal, p: torch.Tensor, generator: torch.Generator | None = None,
                residual_update: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Multi-draft speculative sampling over a tree (module docstring): exact at any temperature.

    ``p`` (B, N+1, V): the target's distribution after the root (column 0) and after each node
    (column 1 + node). Returns ``(path, accepted, next_token)`` as ``verify_tree_greedy``: the
    next token comes from the last residual when every child of the last accepted node was
    rejected, or is the bonus token from p after an accepted leaf. ``residual_update=False``
    drops the residual step (a deliberately wrong rule, for tests that must detect it).
    """
    batch, n = tree.tokens.shape
    vocab = p.shape[-1]
    q = tree.q if tree.q is not None else sampling.one_hot(tree.tokens, vocab)
    if q.shape != (batch, n, vocab) or p.shape[:2] != (batch, n + 1):
        raise ValueError(f"verify_tree expects tokens (B, N), q (B, N, V), p (B, N+1, V); got "
                         f"{tuple(tree.tokens.shape)}, {tuple(q.shape)}, {tuple(p.shape)}")
    real = tree.mask()
    if bool(real.any()):
        sampling.check_distribution(q[real], "q (draft)")
    sampling.check_distribution(p, "p (target)")
    path = torch.full((batch, max(tree.gamma, 1)), -1, dtype=torch.long, device=tree.tokens.device)
    next_token = torch.empty(batch, dtype=torch.long, device=tree.tokens.device)
    for b in range(batch):  # a walk per row; at most a few dozen small steps
        nodes, token = _walk(tree.parents[b].tolist(), tree.tokens[b], q[b], p[b], real[b].tolist(), generator,
                             residual_update)
        path[b, : len(nodes)] = torch.tensor(nodes, dtype=torch.long)
        next_token[b] = token
    return path, (path >= 0).sum(dim=1), next_token


def _walk(parents: list[int], tokens: torch.Tensor, q: torch.Tensor, p: torch.Tensor, real: list[bool],
          generator: torch.Generator | None, residual_update: bool) -> tuple[list[int], torch.Tensor]:
    """One row of ``verify_tree``: the accepted nodes and the next token."""
    children: dict[int, list[int]] = {}
    for i, par in enumerate(parents):
        if real[i]:
            children.setdefault(par, []).append(i)
    path, current = [], -1
    while True:
        target = p[current + 1]  # p' at this node
        tried = torch.zeros_like(target, dtype=torch.bool)
        accepted = None
        for child in children.get(current, []):
            q_child = q[child].masked_fill(tried, 0.0)  # drawn without replacement: the earlier children removed
            if not bool(q_child.sum() > 0):  # a deterministic child repeating a tried token: nothing to try
                continue
            q_child = q_child / q_child.sum()
            x = tokens[child]
            u = torch.rand((), generator=generator, device=p.device, dtype=q_child.dtype)
            if bool(u * q_child[x] <= target[x]):  # P = min(1, p'(x) / q'(x)), no division
                accepted = child
                break
            if residual_update:
                target = sampling.residual(target, q_child)
            tried[x] = True
        if accepted is None:  # every child rejected (or a leaf reached): the residual, or the bonus from p
            return path, sampling.sample(target[None], generator)[0]
        path.append(accepted)
        current = accepted


def shape(nodes: int) -> tuple[int, int]:
    """(width, depth) of a tree of ``nodes``: ``width`` new nodes per level, as many levels as the budget allows.

    About 1.25·√nodes wide: on the offline pair this got more tokens per target pass than narrower trees of
    the same budget, with fewer draft forwards (``scripts/tree_counts.py``).
    """
    if nodes < 1:
        raise ValueError(f"a draft tree needs at least one node, got {nodes}")
    width = max(1, round(1.25 * nodes ** 0.5))
    return width, -(-nodes // width)


def expand(cum: torch.Tensor, alive: torch.Tensor, q: torch.Tensor, width: int, sample: bool,
           generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One level of an EAGLE-2 dynamic tree (Li et al., arXiv 2406.16858): the ``width`` best new children.

    ``cum`` (B, F): the frontier nodes' cumulative draft probability; ``alive`` (B, F) bool: real
    nodes; ``q`` (B, F, V): each one's next-token distribution. A node's j-th child is worth
    ``cum · (j-th largest q)``; the ``width`` best slots are taken. Greedy: the children are
    the top-j tokens. Sampling: a node's n children are drawn *without replacement* from its q
    (Gumbel top-n, which draws them in sequence), and n depends only on q and the frontier,
    never on the draws, so verification stays exact (module docstring).

    Returns ``(frontier, tokens, cum, real)``, each (B, width): the parent's frontier index, the
    child's token, its cumulative probability, and whether it is a real node; siblings are
    contiguous, in the order they were drawn.
    """
    batch, nodes, vocab = q.shape
    k = min(width, vocab)
    values = q.topk(k, dim=-1).values  # (B, F, k) sorted, descending
    worth = (cum * alive)[:, :, None] * values
    slots = worth.flatten(1).topk(min(width, nodes * k), dim=-1).indices  # (B, w)
    frontier = (slots // k).sort(dim=-1).values  # siblings contiguous
    # Rank of each child among its siblings: slots are a node's best, so ranks 0..n-1.
    first = torch.searchsorted(frontier, frontier, right=False)
    rank = torch.arange(frontier.shape[1], device=q.device)[None, :] - first
    if sample:
        u = torch.rand(q.shape, generator=generator, dtype=torch.float64, device=q.device)
        keys = q.double().log() - (-u.clamp_min(1e-300).log()).log()  # log q + Gumbel: top-n is a draw in order
        order = keys.topk(k, dim=-1).indices
    else:
        order = q.topk(k, dim=-1).indices
    rows = torch.arange(batch, device=q.device)[:, None]
    tokens = order[rows, frontier, rank]
    q_token = q[rows, frontier, tokens]
    real = alive.gather(1, frontier) & (q_token > 0)
    return frontier, tokens, cum.gather(1, frontier) * q_token, real


# next_level(new, frontier, parents, depth): a drafter's forward over a level's new nodes (B, w) at ``depth``,
# ``frontier`` their parents' index in the level before and ``parents`` (B, N) every node's parent so far;
# returns the next-token distributions (B, w, V) of the new nodes.
NextLevel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int], torch.Tensor]


def grow(q: torch.Tensor, alive: torch.Tensor, nodes: int, depth: int, sample: bool,
         generator: torch.Generator | None, next_level: NextLevel) -> TreeProposal:
    """An EAGLE-2 dynamic tree of at most ``nodes`` nodes in at most ``depth`` levels, from the root's draft
    distribution ``q`` (B, 1, V): each level the ``shape(nodes)`` width of best new children (``expand``), one
    ``next_level`` call (one draft forward) between levels. ``alive`` (B, 1): rows that may draft at all."""
    batch, device = q.shape[0], q.device
    width, _ = shape(nodes)
    worth = torch.ones(batch, 1, device=device)
    ids = torch.full((batch, 1), -1, dtype=torch.long, device=device)  # the frontier's node numbers
    parts: list[tuple[torch.Tensor, ...]] = []  # (tokens, parents, q, real) per level
    for level in range(depth):
        used = sum(part[0].shape[1] for part in parts)
        frontier, new, worth, alive = expand(worth, alive, q, min(width, nodes - used), sample, generator)
        parts.append((new, ids.gather(1, frontier), q.gather(1, frontier[..., None].expand(-1, -1, q.shape[-1])),
                      alive))
        ids = torch.arange(used, used + new.shape[1], device=device).expand(batch, -1)
        if level + 1 == depth or used + new.shape[1] >= nodes:
            break
        q = next_level(new, frontier, torch.cat([part[1] for part in parts], 1), level + 1)
    tokens, parents, real = (torch.cat([part[i] for part in parts], 1) for i in (0, 1, 3))
    return TreeProposal(tokens, parents, torch.cat([part[2] for part in parts], 1) if sample else None, real,
                        forwards=len(parts))


def graft(main: TreeProposal, extra: TreeProposal) -> TreeProposal:
    """``main`` with the deterministic nodes of ``extra`` (q one-hot) added: each under the node of ``main`` that
    ends the same path, after its own children (so they are tried last), a path ``main`` has already not repeated.

    Exact with ``verify_tree``: an added child is deterministic, so its q is one-hot whatever was drawn before it.
    """
    batch = main.tokens.shape[0]
    rows = []
    for b in range(batch):
        keys: dict[tuple[int, ...], int] = {(): -1}
        path_of: list[tuple[int, ...]] = []
        for i, (token, parent, real) in enumerate(zip(main.tokens[b].tolist(), main.parents[b].tolist(),
                                                      main.mask()[b].tolist())):
            path_of.append((path_of[parent] if parent >= 0 else ()) + (token,))
            if real:
                keys.setdefault(path_of[-1], i)
        added: list[tuple[int, int]] = []
        extra_paths: list[tuple[int, ...]] = []
        for token, parent, real in zip(extra.tokens[b].tolist(), extra.parents[b].tolist(), extra.mask()[b].tolist()):
            extra_paths.append((extra_paths[parent] if parent >= 0 else ()) + (token,))
            key = extra_paths[-1]
            if not real or key in keys or key[:-1] not in keys:
                continue
            keys[key] = main.nodes + len(added)
            added.append((token, keys[key[:-1]]))
        rows.append(added)
    width = max((len(r) for r in rows), default=0)
    device = main.tokens.device
    tokens = torch.zeros(batch, width, dtype=torch.long, device=device)
    parents = torch.full((batch, width), -1, dtype=torch.long, device=device)
    real = torch.zeros(batch, width, dtype=torch.bool, device=device)
    for b, added in enumerate(rows):
        if added:
            tokens[b, : len(added)] = torch.tensor([t for t, _ in added], device=device)
            parents[b, : len(added)] = torch.tensor([p for _, p in added], device=device)
            real[b, : len(added)] = True
    q = None if main.q is None else torch.cat([main.q, sampling.one_hot(tokens, main.q.shape[-1])], dim=1)
    return TreeProposal(torch.cat([main.tokens, tokens], 1), torch.cat([main.parents, parents], 1), q,
                        torch.cat([main.mask(), real], 1), main.forwards)

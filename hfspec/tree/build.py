"""Growing draft trees (``hfspec.tree.proposal``): EAGLE-2 dynamic trees and grafted lookup nodes.

How many children a node gets depends only on what was drawn before them, and siblings are
drawn without replacement from their parent's q (or deterministically), which is what
``hfspec.tree.verify`` needs to stay exact.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from hfspec.decoding import sampling
from hfspec.tree.proposal import Proposal


def shape(nodes: int) -> tuple[int, int]:
    """(width, depth) of a tree of ``nodes``: ``width`` new nodes per level, as many levels as the budget allows.

    About 1.25·√nodes wide: on the offline pair this got more tokens per target pass than narrower trees of
    the same budget, with fewer draft forwards (``scripts/tree_counts.py``).
    """
    if nodes < 1:
        raise ValueError(f"a draft tree needs at least one node, got {nodes}")
    width = max(1, round(1.25 * nodes**0.5))
    return width, -(-nodes // width)


def expand(
    cum: torch.Tensor,
    alive: torch.Tensor,
    q: torch.Tensor,
    width: int,
    sample: bool,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
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
        dtype = sampling.draw_dtype(q.device)  # float64, or float32 where the device has no float64 (MPS)
        u = torch.rand(q.shape, generator=generator, dtype=dtype, device=q.device)
        keys = q.to(dtype).log() - (-u.clamp_min(torch.finfo(dtype).tiny).log()).log()  # log q + Gumbel: in order
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


def grow(
    q: torch.Tensor,
    alive: torch.Tensor,
    nodes: int,
    depth: int,
    sample: bool,
    generator: torch.Generator | None,
    next_level: NextLevel,
) -> Proposal:
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
        parts.append(
            (new, ids.gather(1, frontier), q.gather(1, frontier[..., None].expand(-1, -1, q.shape[-1])), alive)
        )
        ids = torch.arange(used, used + new.shape[1], device=device).expand(batch, -1)
        if level + 1 == depth or used + new.shape[1] >= nodes:
            break
        q = next_level(new, frontier, torch.cat([part[1] for part in parts], 1), level + 1)
    tokens, parents, real = (torch.cat([part[i] for part in parts], 1) for i in (0, 1, 3))
    q = torch.cat([part[2] for part in parts], 1) if sample else None
    return Proposal(tokens, q, parents, real, forwards=len(parts))


def graft(main: Proposal, extra: Proposal) -> Proposal:
    """``main`` with the deterministic nodes of ``extra`` (q one-hot) added: each under the node of ``main`` that
    ends the same path, after its own children (so they are tried last), a path ``main`` has already not repeated.

    Exact with ``verify``: an added child is deterministic, so its q is one-hot whatever was drawn before it.
    """
    batch = main.tokens.shape[0]
    rows = []
    for b in range(batch):
        keys: dict[tuple[int, ...], int] = {(): -1}
        path_of: list[tuple[int, ...]] = []
        for i, (token, parent, real) in enumerate(
            zip(main.tokens[b].tolist(), main.parent_ids()[b].tolist(), main.mask()[b].tolist())
        ):
            path_of.append((path_of[parent] if parent >= 0 else ()) + (token,))
            if real:
                keys.setdefault(path_of[-1], i)
        added: list[tuple[int, int]] = []
        extra_paths: list[tuple[int, ...]] = []
        for token, parent, real in zip(
            extra.tokens[b].tolist(), extra.parent_ids()[b].tolist(), extra.mask()[b].tolist()
        ):
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
    return Proposal(
        torch.cat([main.tokens, tokens], 1),
        q,
        torch.cat([main.parent_ids(), parents], 1),
        torch.cat([main.mask(), real], 1),
        main.forwards,
    )

"""Accepting along a draft tree (``hfspec.tree.proposal``): pure functions on tensors.

Acceptance generalises Leviathan et al. (arXiv 2211.17192) to many candidates per
position, as SpecInfer (arXiv 2305.09781) and recursive speculative decoding (Jeon et al.,
arXiv 2402.14160) do: at a node, try its children in order; child x is accepted with
probability min(1, p'(x)/q'(x)); on a rejection p' ← norm(max(0, p' − q')) and the next
child's q' is its own q with every token tried so far removed and renormalised. This is
exact (the accepted path, then the next token, are distributed as the target's own
sampling) when each child is drawn from q' given the earlier children, that is, *without
replacement* from its parent's q, or deterministically (a one-hot q, which removal leaves
as it is); how many children a node gets may depend on anything drawn before them, never
on their own values. Greedy decoding walks the tree following the target's argmax, which
is exact for any tree.
"""

from __future__ import annotations

import torch

from hfspec.decoding import sampling
from hfspec.tree.proposal import TreeProposal


def verify_tree_greedy(
    tree: TreeProposal, target_argmax: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
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


def verify_tree(
    tree: TreeProposal, p: torch.Tensor, generator: torch.Generator | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Multi-draft speculative sampling over a tree (module docstring): exact at any temperature.

    ``p`` (B, N+1, V): the target's distribution after the root (column 0) and after each node
    (column 1 + node). Returns ``(path, accepted, next_token)`` as ``verify_tree_greedy``: the
    next token comes from the last residual when every child of the last accepted node was
    rejected, or is the bonus token from p after an accepted leaf.
    """
    batch, n = tree.tokens.shape
    vocab = p.shape[-1]
    q = tree.q if tree.q is not None else sampling.one_hot(tree.tokens, vocab)
    if q.shape != (batch, n, vocab) or p.shape[:2] != (batch, n + 1):
        raise ValueError(
            f"verify_tree expects tokens (B, N), q (B, N, V), p (B, N+1, V); got "
            f"{tuple(tree.tokens.shape)}, {tuple(q.shape)}, {tuple(p.shape)}"
        )
    real = tree.mask()
    if bool(real.any()):
        sampling.check_distribution(q[real], "q (draft)")
    sampling.check_distribution(p, "p (target)")
    path = torch.full((batch, max(tree.gamma, 1)), -1, dtype=torch.long, device=tree.tokens.device)
    next_token = torch.empty(batch, dtype=torch.long, device=tree.tokens.device)
    for b in range(batch):  # a walk per row; at most a few dozen small steps
        nodes, token = _walk(tree.parents[b].tolist(), tree.tokens[b], q[b], p[b], real[b].tolist(), generator)
        path[b, : len(nodes)] = torch.tensor(nodes, dtype=torch.long)
        next_token[b] = token
    return path, (path >= 0).sum(dim=1), next_token


def _walk(
    parents: list[int],
    tokens: torch.Tensor,
    q: torch.Tensor,
    p: torch.Tensor,
    real: list[bool],
    generator: torch.Generator | None,
) -> tuple[list[int], torch.Tensor]:
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
            if bool(sampling.accept(q_child[x], target[x], generator)):  # P = min(1, p'(x) / q'(x))
                accepted = child
                break
            target = sampling.residual(target, q_child)
            tried[x] = True
        if accepted is None:  # every child rejected (or a leaf reached): the residual, or the bonus from p
            return path, sampling.sample(target[None], generator)[0]
        path.append(accepted)
        current = accepted

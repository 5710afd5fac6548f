"""Accepting along a proposal (``hfspec.tree.proposal``), chain or tree: pure functions on tensors.

Acceptance generalises Leviathan et al. (arXiv 2211.17192) to many candidates per
position, as SpecInfer (arXiv 2305.09781) and recursive speculative decoding (Jeon et al.,
arXiv 2402.14160) do: at a node, try its children in order; child x is accepted with
probability min(1, p'(x)/q'(x)); on a rejection p' ← norm(max(0, p' − q')) and the next
child's q' is its own q with every token tried so far removed and renormalised; when every
child is rejected the next token is drawn from p', and after an accepted leaf it is the
bonus token from p. This is exact (the accepted path, then the next token, are distributed
as the target's own sampling) when each child is drawn from q' given the earlier children,
that is, *without replacement* from its parent's q, or deterministically (a one-hot q,
which removal leaves as it is); how many children a node gets may depend on anything drawn
before them, never on their own values. A chain (one child per node) is Leviathan et al.'s
rule itself, run by ``hfspec.decoding.sampling.verify`` in one vectorised pass. Greedy decoding walks
the proposal following the target's argmax, which is exact for any tree.

Both return ``(path, accepted, next_token)``: the accepted nodes (B, D) padded with -1 (a
chain's are 0, 1, …), their count (B,), and the next token (B,).
"""

from __future__ import annotations

import torch

from hfspec.decoding import sampling
from hfspec.tree.proposal import Proposal, chain_path


def verify_greedy(proposal: Proposal, target_argmax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Exact greedy verification: from the root, follow the child equal to the target's argmax.

    ``target_argmax`` (B, N+1): the target's argmax after the root (column 0) and after each
    node (column 1 + node). The next token is the target's argmax after the last accepted node.
    Siblings carry different tokens, so at most one child matches; the output is the target's own greedy.
    """
    if proposal.is_chain:
        counts = None if proposal.real is None else proposal.drafted()
        accepted, next_token = sampling.verify_greedy(proposal.tokens, target_argmax, counts)
        return chain_path(accepted, proposal.nodes), accepted, next_token
    tokens, parents, real = proposal.tokens, proposal.parents, proposal.mask()
    batch, depth = tokens.shape[0], proposal.gamma
    path = torch.full((batch, max(depth, 1)), -1, dtype=torch.long, device=tokens.device)
    current = torch.full((batch,), -1, dtype=torch.long, device=tokens.device)
    alive = torch.ones(batch, dtype=torch.bool, device=tokens.device)
    for d in range(depth):
        want = target_argmax.gather(1, (current + 1)[:, None])  # (B, 1) the target's token after `current`
        match = (parents == current[:, None]) & (tokens == want) & real
        found = match.any(dim=1) & alive
        child = match.long().argmax(dim=1)
        path[:, d] = torch.where(found, child, -1)
        current = torch.where(found, child, current)
        alive = found
    accepted = (path >= 0).sum(dim=1)
    next_token = target_argmax.gather(1, (current + 1)[:, None]).squeeze(1)
    return path, accepted, next_token


def verify(
    proposal: Proposal, p: torch.Tensor, generator: torch.Generator | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Multi-draft speculative sampling over a proposal (module docstring): exact at any temperature.

    ``p`` (B, N+1, V): the target's distribution after the root (column 0) and after each node
    (column 1 + node).
    """
    tokens = proposal.tokens
    batch, n = tokens.shape
    vocab = p.shape[-1]
    q = proposal.q if proposal.q is not None else sampling.one_hot(tokens, vocab)
    if q.shape != (batch, n, vocab) or p.shape[:2] != (batch, n + 1):
        raise ValueError(
            f"verify expects tokens (B, N), q (B, N, V), p (B, N+1, V); got "
            f"{tuple(tokens.shape)}, {tuple(q.shape)}, {tuple(p.shape)}"
        )
    if proposal.is_chain:
        counts = None if proposal.real is None else proposal.drafted()
        accepted, next_token = sampling.verify(tokens, q, p, generator, counts)
        return chain_path(accepted, n), accepted, next_token
    real = proposal.mask()
    if bool(real.any()):
        sampling.check_distribution(q[real], "q (draft)")
    sampling.check_distribution(p, "p (target)")
    return _walk(proposal, q, p, generator)


def _walk(
    proposal: Proposal, q: torch.Tensor, p: torch.Tensor, generator: torch.Generator | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``verify`` on a tree, every row at once: one pass per (depth, sibling rank), over the rows that still have a
    child to try there, each at its own node (so the work is the children tried, as a walk per row would do)."""
    tokens, parents, real = proposal.tokens, proposal.parents, proposal.mask()
    batch, device = tokens.shape[0], tokens.device
    path = torch.full((batch, max(proposal.gamma, 1)), -1, dtype=torch.long, device=device)
    next_token = torch.zeros(batch, dtype=torch.long, device=device)
    current = torch.full((batch,), -1, dtype=torch.long, device=device)
    target = p[:, 0].clone()  # (B, V) p' at each row's current node
    tried = torch.zeros_like(target, dtype=torch.bool)  # tokens rejected at the current node
    live = torch.ones(batch, dtype=torch.bool, device=device)  # rows still walking
    for depth in range(path.shape[1] + 1):
        children = (parents == current[:, None]) & real & live[:, None]  # (B, N), in the order drawn
        rank = children.long().cumsum(dim=1)
        moved = torch.zeros_like(live)
        for j in range(int(children.sum(dim=1).max()) if depth < path.shape[1] else 0):
            this = children & (rank == j + 1)
            rows = (this.any(dim=1) & ~moved).nonzero().flatten()  # rows with a j-th child to try
            child = this[rows].long().argmax(dim=1)
            x = tokens[rows, child]
            q_child = q[rows, child].masked_fill_(tried[rows], 0.0)  # drawn without replacement: tried ones removed
            mass = q_child.sum(dim=1)
            trying = mass > 0  # a deterministic child repeating a tried token has nothing left to try
            mass = mass.clamp_min(torch.finfo(mass.dtype).tiny)
            q_x = q_child.gather(1, x[:, None]).squeeze(1) / mass  # q'(x), renormalised
            kept = sampling.accept(q_x, target[rows, x], generator) & trying  # P = min(1, p'(x) / q'(x))
            rejected = trying & ~kept
            if bool(rejected.any()):
                out = rows[rejected]
                target[out] = sampling.residual(target[out], q_child[rejected] / mass[rejected, None])
            tried[rows[rejected], x[rejected]] = True
            path[rows[kept], depth] = child[kept]
            current[rows[kept]] = child[kept]
            moved[rows[kept]] = True
        done = live & ~moved  # every child rejected (or a leaf reached): the residual, or the bonus from p
        if bool(done.any()):
            next_token[done] = sampling.sample(target[done], generator)
        live = moved
        if not bool(live.any()):
            break
        target[live] = p[live.nonzero().flatten(), current[live] + 1]
        tried[live] = False
    return path, (path >= 0).sum(dim=1), next_token

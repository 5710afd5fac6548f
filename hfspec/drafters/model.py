"""The independent draft: a small causal LM sharing the target's tokenizer.

The draft's cache holds the committed tokens it has been fed (``fed`` per row).
Before drafting, it catches up on the rest in one forward: the pending token, the
last draft of a fully accepted step, or every token of steps that drafted nothing.
Its last output gives the first draft, so catching up costs no extra forward.
After verification it keeps what it was fed of the accepted drafts; the last draft
of a step is never fed, so after a fully accepted step one token waits for the next
catch-up. No token is ever fed to its cache twice.
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from hfspec import tree
from hfspec.cpu import draft_linear
from hfspec.drafters import Context, Drafter, Proposal, Stop, draft_chain, kept_drafts
from hfspec.measure.costs import Price, forward_seconds
from hfspec.models.adapter import check_causal_lm, check_tree_attention, forward, model_vocab_size, sliding_window
from hfspec.models.kv_cache import KVState


class ModelDrafter(Drafter):
    kind = "model"

    def __init__(self, model: PreTrainedModel):
        check_causal_lm(model, "draft")
        self.model = model.eval()
        self.vocab_size = model_vocab_size(model)
        self.kv: KVState | None = None
        self.fed = torch.zeros(0, dtype=torch.long)  # committed tokens in the cache, per row
        self.drafts: torch.Tensor | None = None  # (B, N) the last proposal's tokens, until it is committed
        self.drafts_fed = 0  # how many of its nodes the cache holds (a chain's all but the last; a tree's every
        # level but the last), at columns start_col + node

    @property
    def recurrent(self) -> bool:
        return KVState.is_recurrent(self.model)

    def start(self, batch: int, device: torch.device) -> None:
        self.kv = KVState(batch, device, self.model)
        self.fed = torch.zeros(batch, dtype=torch.long, device=device)
        self.drafts = None

    def _unfed(self, ctx: Context) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The committed tokens not yet fed, right-aligned in a (B, K) block: (ids, valid, positions)."""
        width = int((ctx.lengths - self.fed).max())
        positions = ctx.lengths[:, None] - width + torch.arange(width, device=ctx.lengths.device)
        valid = positions >= self.fed[:, None]
        positions = positions.clamp(min=0)
        return ctx.tokens.gather(1, positions), valid.long(), positions

    def propose(self, ctx: Context, gamma: int, stop: Stop | None = None, price: Price | None = None) -> Proposal:
        def step(i: int, token: torch.Tensor | None) -> torch.Tensor:
            if i:  # draft i - 1, one position after the committed tokens and the drafts before it
                logits = self._forward(
                    token[:, None], torch.ones_like(token)[:, None], (ctx.lengths + (i - 1))[:, None]
                )
                return logits.to(ctx.tokens.device)
            logits = self._forward(*self._unfed(ctx))
            # Caught up: everything from here on is a draft, and may be rolled back.
            self.fed = ctx.lengths.clone()
            self.start_col = self.kv.length
            self.kv.snapshot()
            return logits.to(ctx.tokens.device)

        tokens, qs = draft_chain(step, ctx.pick, gamma, stop)
        self.drafts = torch.stack(tokens, dim=1)
        self.drafts_fed = self.drafts.shape[1] - 1
        return Proposal.chain(self.drafts, torch.stack(qs, dim=1) if ctx.sample else None)

    def propose_tree(self, ctx: Context, nodes: int, depth: int) -> Proposal:
        """An EAGLE-2 dynamic tree (``tree.expand``), one draft forward per level over that level's nodes,
        each attending to the committed tokens and its own ancestors. Every level but the last is fed,
        so the cache's tree columns are the nodes in order, up to the last level."""
        if self.kv.serial or self.recurrent:  # a recurrent state reads one path only: the chain
            return self.propose(ctx, depth)
        check_tree_attention(self.model, "draft")
        logits = self._forward(*self._unfed(ctx))
        self.fed, self.start_col = ctx.lengths.clone(), self.kv.length
        q = ctx.dists(logits[:, None].to(ctx.tokens.device))  # (B, 1, V) at the root
        self.drafts_fed = 0

        def next_level(new: torch.Tensor, frontier: torch.Tensor, parents: torch.Tensor, level: int) -> torch.Tensor:
            self.drafts_fed += new.shape[1]
            return ctx.dists(self._tree_forward(ctx, parents, new, level).to(q.device))

        alive = torch.ones(q.shape[0], 1, dtype=torch.bool, device=q.device)
        proposal = tree.grow(q, alive, nodes, depth, ctx.sample, ctx.generator, next_level)
        self.drafts = proposal.tokens
        return proposal

    def _tree_forward(self, ctx: Context, parents: torch.Tensor, new: torch.Tensor, depth: int) -> torch.Tensor:
        """Logits (B, w, V) after the ``new`` (B, w) nodes at ``depth``, the last of the tree so far."""
        positions = (ctx.lengths - 1 + depth)[:, None].expand_as(new)
        self.kv.extend_mask(torch.ones_like(new))
        visible = tree.ancestry(parents)[:, -new.shape[1] :]  # (B, w, nodes so far): themselves and ancestors
        tree_positions = ctx.lengths[:, None] - 1 + tree.depths(parents)
        mask = self.kv.tree_attention(self.model, visible, positions, tree_positions, sliding_window(self.model))
        return forward(self.model, new, mask, positions, self.kv.cache)

    def _forward(self, feed: torch.Tensor, valid: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Last-position logits (B, V) after feeding (B, k) tokens; a cache that can only continue its
        state one token at a time (``KVState.serial``) takes them one by one once it holds any."""
        step = 1 if self.kv.serial and self.kv.length else feed.shape[1]
        for s in range(0, feed.shape[1], step):
            cols = slice(s, s + step)
            logits = forward(
                self.model,
                feed[:, cols],
                self.kv.extend_mask(valid[:, cols]),
                positions[:, cols],
                self.kv.cache,
                logits_to_keep=1,
            )
        return logits[:, -1]

    def commit(self, ctx: Context, path: torch.Tensor) -> None:
        # The kept path's nodes that were fed (a chain's all but its last draft; a tree's all but a last-level leaf)
        # stay, gathered in order; a tree's other nodes and the rejected drafts go.
        if self.drafts is None:
            return
        kept = kept_drafts(ctx, self.drafts, path, self.drafts_fed)
        self.kv.keep(kept, self.start_col, self.drafts[:, : self.drafts_fed], path)
        self.fed = self.fed + kept
        self.drafts = None

    def select_rows(self, keep: torch.Tensor) -> None:
        self.kv.select_rows(keep)
        self.fed = self.fed[keep]

    def prefill(self, ctx: Context) -> None:
        feed, valid, positions = self._unfed(ctx)
        if feed.shape[1] > 1:  # all but the pending token, which the next proposal feeds
            self._forward(feed[:, :-1], valid[:, :-1], positions[:, :-1])
            self.fed = torch.maximum(self.fed, ctx.lengths - 1)

    def merge(self, other: Drafter) -> None:
        assert isinstance(other, ModelDrafter) and self.drafts is None and other.drafts is None
        self.kv.merge(other.kv)
        self.fed = torch.cat([self.fed, other.fed])

    def check(self, ctx: Context) -> None:
        self.kv.check(self.fed, "draft")

    def step_seconds(self, context: list[int], device: torch.device, repeats: int = 5) -> float:
        """Median seconds of one cached single-token forward after ``context``."""
        return forward_seconds(self.model, context, (1,), repeats, device, all_logits=False)[1]

    @property
    def parameters(self) -> int:
        return draft_linear.weights(self.model)

    def describe(self) -> dict:
        return {"kind": self.kind, "model": type(self.model).__name__, "parameters": self.parameters}

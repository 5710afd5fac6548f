"""The EAGLE-3 drafter: drafting with a head (``hfspec.heads.eagle3``) from the target's own hidden states.

The head (Li et al., arXiv 2503.01840) reads target features that the loop hands over
in ``observe`` from target forwards it runs anyway, so a drafting step costs one head
layer and its small vocabulary, not a draft model. This module only runs a head: its
modules live in ``hfspec.heads.eagle3`` and its checkpoints in ``hfspec.heads.checkpoint``.
The head's cached forward (``cached_step``) is here, because the cache is the drafter's
state: the head's modules take keys and values from whoever calls them.

Exactness: draft logits go into a full-vocabulary row whose other entries are
-1e30, so after the float32 softmax q is exactly 0 outside the draft vocabulary and
the residual max(0, p - q) of Leviathan et al. (arXiv 2211.17192) stays exact.

Head cache invariant: the head's KV holds one entry per context position j < fed[b],
each built from target features. The fused features of committed positions not yet
fed (fed .. lengths - 2) wait in ``pending`` and are fed in the first head forward of
the next ``propose``, whose last output gives the first draft. Entries of later draft
steps (built from the head's own outputs) are rolled back at ``commit``; the accepted
positions come back from target features. No position is fed twice.
"""

from __future__ import annotations

import functools
import statistics
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel

from hfspec import tree
from hfspec.cpu import attention as cpu_attention
from hfspec.cpu import fast
from hfspec.cpu.quant import QuantEmbedding
from hfspec.decoding.sampling import OUTSIDE
from hfspec.drafters import Context, Drafter, Features, Proposal, Stop, draft_chain
from hfspec.errors import HfspecError
from hfspec.heads.checkpoint import load_head
from hfspec.heads.eagle3 import Eagle3Head, default_layer_ids
from hfspec.measure.costs import Price
from hfspec.measure.timing import timed
from hfspec.models.adapter import decoder_layers, model_vocab_size
from hfspec.models.kv_cache import KVState

__all__ = ["Eagle3Drafter", "cached_step"]


def cached_step(
    head: Eagle3Head,
    embeds: torch.Tensor,
    hidden: torch.Tensor,
    positions: torch.Tensor,
    kv: KVState,
    valid: torch.Tensor,
    tree_visible: torch.Tensor | None = None,
) -> torch.Tensor:
    """One head forward over k new columns (B, k) appended to ``kv``; returns their pre-norm outputs (B, k, H).

    ``valid`` (B, k): columns that are not holes. A column sees the cache's valid
    entries and the valid new columns up to itself, and always itself (so a hole
    stays finite). ``tree_visible`` (B, k, T): the new columns are tree nodes, the
    cache's last T columns the tree so far; each sees the committed entries and the
    nodes it marks (itself and its ancestors).
    """
    cos, sin = head.rope(hidden, positions)
    q, k, v = head.layer.qkv(embeds, hidden, cos, sin)
    old = kv.length
    mask = kv.extend_mask(valid).bool()  # (B, S)
    keys, values = kv.append(k, v)
    if tree_visible is not None:
        allowed = kv.tree_mask(tree_visible, positions, positions, None)[:, None]
    else:
        cols = torch.arange(mask.shape[1], device=mask.device)
        rows = old + torch.arange(k.shape[2], device=mask.device)
        allowed = ((mask[:, None, :] & (cols[None, :] <= rows[:, None])) | (cols[None, :] == rows[:, None]))[:, None]
    # A head whose linears run hfspec's kernel attends on it too: a row's bits then depend neither on the rows beside
    # it nor on the holes in its cache (hfspec.cpu.attention), as the target's do.
    on_kernel = fast.is_accelerated(head.layer.self_attn) and cpu_attention.serves(q, keys, values, allowed)
    return head.layer.finish(hidden, q, keys, values, allowed, cpu_attention.attention if on_kernel else None)


class Eagle3Drafter(Drafter):
    """Drafts with an EAGLE-3 head on ``target``'s hidden states (see the module docstring)."""

    kind = "eagle3"

    def __init__(self, head: Eagle3Head, target: PreTrainedModel):
        self.head = head.eval()
        self.target = target
        c = head.config
        text = target.config.get_text_config()
        blocks = decoder_layers(target)
        num_layers = len(blocks) if blocks is not None else int(text.num_hidden_layers)
        if c.layer_ids is None and num_layers < 3:
            raise HfspecError(
                f"the target has {num_layers} decoder layers; EAGLE-3's default features need 3 or "
                "more (or a head with eagle_aux_hidden_state_layer_ids)"
            )
        layers = c.layer_ids or default_layer_ids(num_layers)
        if not all(0 <= i < num_layers for i in layers):
            raise HfspecError(
                f"the head reads target layers {list(layers)} but the target has {num_layers} "
                "decoder layers (ids count from 0, the input of each layer); pick the head trained "
                "for this target"
            )
        self.feature_layers = tuple(layers)
        width = len(layers) * int(text.hidden_size)
        if width != c.feature_width:
            raise HfspecError(
                f"the head's fc reads {c.feature_width} features but {len(layers)} target layers of width "
                f"{text.hidden_size} give {width} (layers {list(layers)}); pick the head trained for this target"
            )
        source = head.embed_tokens if head.embed_tokens is not None else target.get_input_embeddings()
        # A GGUF target's embedding holds blocks, not rows (hfspec.cpu.quant): it is looked up through its module.
        embedding = source if isinstance(source, QuantEmbedding) else source.weight
        count, width = (source.num_embeddings, source.embedding_dim) if embedding is source else embedding.shape
        if width != c.hidden_size:
            raise HfspecError(
                f"the head has hidden size {c.hidden_size} but uses the target's embedding of width "
                f"{width}; such a head must carry its own embed_tokens.weight"
            )
        self.embedding = embedding
        rows = model_vocab_size(target)
        ids = head.target_ids()
        if int(ids.min()) < 0 or int(ids.max()) >= rows or ids.unique().numel() != ids.numel():
            raise HfspecError(
                f"the head's d2t maps draft ids outside the target's {rows} ids or two draft ids "
                "to one target id; pick the head trained for this target"
            )
        self.vocab_size = min(rows, count)
        # Draft ids whose target id the run can score (a padded-embedding id is never one).
        kept = ids < self.vocab_size
        self.ids, self.kept = ids[kept], (None if bool(kept.all()) else kept)
        self.kv: KVState | None = None
        self.start_col: int | None = None  # first cache column of this step's own-output entries
        self.verified: torch.Tensor | None = None  # fused features of the last verification, until commit

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        target: PreTrainedModel,
        *,
        dtype: torch.dtype | None = None,
        device: str | torch.device | None = None,
    ) -> Eagle3Drafter:
        """Load the head at ``path`` for ``target`` (dtype: the target's; device: its embedding's)."""
        device = device if device is not None else target.get_input_embeddings().weight.device
        return cls(load_head(path, dtype=dtype or target.dtype, device=device), target)

    @property
    def module(self) -> torch.nn.Module:
        return self.head

    @property
    def device(self) -> torch.device:
        return self.head.fc.weight.device

    def start(self, batch: int, device: torch.device) -> None:
        dev = self.device
        self.kv = KVState(batch, dev)
        self.fed = torch.zeros(batch, dtype=torch.long, device=dev)  # context positions in the cache, per row
        self.pending = torch.zeros(batch, dtype=torch.long, device=dev)  # committed positions waiting, per row
        self.features = torch.zeros(
            batch, 0, self.head.config.hidden_size, dtype=self.head.fc.weight.dtype, device=dev
        )  # (B, K, H) left-aligned: row b's first pending[b] columns
        self.start_col, self.verified = None, None

    def _embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """Raw embedding rows (no model-specific scaling), as the head was trained with."""
        if isinstance(self.embedding, QuantEmbedding):
            rows = self.embedding(tokens.to(self.embedding.weight.device))
        else:
            rows = F.embedding(tokens.to(self.embedding.device), self.embedding)
        return rows.to(device=self.device, dtype=self.head.fc.weight.dtype)

    def _append(self, new: torch.Tensor, count: torch.Tensor) -> None:
        """Add each row's first ``count[b]`` columns of ``new`` (B, k, H) after its pending features."""
        both = torch.cat([self.features, new], dim=1)
        total = self.pending + count
        cols = torch.arange(int(total.max()), device=self.device)[None]
        idx = torch.where(cols < self.pending[:, None], cols, self.features.shape[1] + cols - self.pending[:, None])
        idx = idx.clamp(max=both.shape[1] - 1)
        self.features = both.gather(1, idx[..., None].expand(-1, -1, both.shape[2]))
        self.pending = total

    def observe(self, ctx: Context, features: Features) -> None:
        fused = self.head.fuse(features.values.to(device=self.device, dtype=self.head.fc.weight.dtype))
        if features.verification:
            self.verified = fused  # the pending column and the kept path are committed at commit
            return
        valid = features.valid.to(self.device)
        order = torch.sort((~valid).long(), dim=1, stable=True).indices  # valid columns first, in order
        self._append(fused.gather(1, order[..., None].expand_as(fused)), valid.sum(dim=1))

    def _unfed(self, ctx: Context) -> tuple[torch.Tensor, ...]:
        """The pending context pairs, right-aligned in a (B, K) block: (fused, tokens, positions, valid)."""
        width = max(1, int(self.pending.max()))
        offset = torch.arange(width, device=self.device)[None] - (width - self.pending[:, None])
        valid = offset >= 0
        positions = (self.fed[:, None] + offset).clamp(min=0)
        tokens = ctx.tokens.gather(1, (positions + 1).to(ctx.tokens.device))  # position j pairs with token j + 1
        if self.features.shape[1] == 0:
            fused = self.features.new_zeros(offset.shape[0], width, self.features.shape[2])
        else:
            idx = offset.clamp(min=0, max=self.features.shape[1] - 1)
            fused = self.features.gather(1, idx[..., None].expand(-1, -1, self.features.shape[2]))
        return fused, tokens, positions, valid

    def _full(self, logits: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits (..., Vd) scattered to target ids (..., V), OUTSIDE elsewhere."""
        full = torch.full((*logits.shape[:-1], self.vocab_size), OUTSIDE, dtype=torch.float32, device=self.device)
        full[..., self.ids] = logits.float() if self.kept is None else logits.float()[..., self.kept]
        return full

    def _pick(
        self, ctx: Context, logits: torch.Tensor, i: int
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """Draft i from draft-vocabulary logits (B, Vd)."""
        return ctx.pick(self._full(logits).to(ctx.tokens.device), i)

    @torch.inference_mode()
    def propose(self, ctx: Context, gamma: int, stop: Stop | None = None, price: Price | None = None) -> Proposal:
        hidden, tokens, positions, valid = self._unfed(ctx)
        # A row's first draft needs one context pair (a one-token prompt has none yet).
        can_draft = self.pending > 0
        embeds, lengths = self._embed(tokens), ctx.lengths.to(self.device)

        def step(i: int, token: torch.Tensor | None) -> torch.Tensor:
            nonlocal hidden, embeds, positions, valid
            if i:  # draft i reads the head's pre-norm output and draft i - 1, one position further
                embeds, positions = self._embed(token[:, None]), (lengths + (i - 2))[:, None]
                valid = torch.ones_like(positions, dtype=torch.bool)
            hidden = cached_step(self.head, embeds, hidden, positions, self.kv, valid.long())[:, -1:]  # (B, 1, H)
            if not i:  # the context is fed: from here on, entries are built from the head's own outputs
                self.fed = (lengths - 1).clamp(min=0)
                self.pending = torch.zeros_like(self.pending)
                self.features = self.features[:, :0]
                self.kv.snapshot()
                self.start_col = self.kv.length
            return self.head.logits(hidden[:, 0])

        drafts, qs = draft_chain(step, functools.partial(self._pick, ctx), gamma, stop)
        tokens_out = torch.stack(drafts, dim=1)
        counts = None
        if not bool(can_draft.all()):
            counts = torch.where(can_draft, len(drafts), 0).to(tokens_out.device)
        return Proposal.chain(tokens_out, torch.stack(qs, dim=1) if ctx.sample else None, counts)

    @torch.inference_mode()
    def propose_tree(self, ctx: Context, nodes: int, depth: int) -> Proposal:
        """An EAGLE-2 dynamic tree (``tree.expand``): one head forward per level, each node reading its parent's
        pre-norm output and its own token, and attending to the context and its ancestors. Every entry built
        here is dropped at ``commit``; the accepted path returns as target features."""
        hidden, tokens, positions, valid = self._unfed(ctx)
        can_draft = (self.pending > 0).to(ctx.tokens.device)
        h = cached_step(self.head, self._embed(tokens), hidden, positions, self.kv, valid.long())[:, -1:]  # (B, 1, H)
        self.fed = (ctx.lengths.to(self.device) - 1).clamp(min=0)
        self.pending = torch.zeros_like(self.pending)
        self.features = self.features[:, :0]
        self.start_col = self.kv.length
        q = ctx.dists(self._full(self.head.logits(h)).to(ctx.tokens.device))  # (B, 1, V) at the root

        def next_level(new: torch.Tensor, frontier: torch.Tensor, parents: torch.Tensor, level: int) -> torch.Tensor:
            nonlocal h  # each node reads its parent's pre-norm output
            positions = (ctx.lengths[:, None] - 2 + level).expand_as(new).to(self.device)
            parent_h = h.gather(1, frontier.to(self.device)[..., None].expand(-1, -1, h.shape[-1]))
            h = cached_step(
                self.head,
                self._embed(new),
                parent_h,
                positions,
                self.kv,
                torch.ones_like(new, device=self.device),
                tree.ancestry(parents)[:, -new.shape[1] :].to(self.device),
            )
            return ctx.dists(self._full(self.head.logits(h)).to(q.device))

        return tree.grow(q, can_draft[:, None], nodes, depth, ctx.sample, ctx.generator, next_level)

    def commit(self, ctx: Context, path: torch.Tensor) -> None:
        if self.start_col is not None:  # own-output entries go; accepted positions return from target features
            self.kv.keep(torch.zeros_like(self.fed), self.start_col)
            self.start_col = None
        if self.verified is not None:  # the target features of the pending token and the kept path
            columns = torch.cat([torch.zeros_like(path[:, :1]), path + 1], dim=1).clamp(min=0).to(self.device)
            kept = self.verified.gather(1, columns[..., None].expand(-1, -1, self.verified.shape[-1]))
            self._append(kept, (path >= 0).sum(dim=1).to(self.device) + 1)
            self.verified = None

    def select_rows(self, keep: torch.Tensor) -> None:
        keep = keep.to(self.device)
        self.kv.select_rows(keep)
        self.fed, self.pending, self.features = self.fed[keep], self.pending[keep], self.features[keep]
        width = int(self.pending.max()) if self.pending.numel() else 0
        self.features = self.features[:, :width]

    @torch.inference_mode()
    def prefill(self, ctx: Context) -> None:
        hidden, tokens, positions, valid = self._unfed(ctx)
        if hidden.shape[1] < 2:
            return
        # Every pending context pair but each row's last goes into the head's cache; the last opens the next step.
        cached_step(
            self.head, self._embed(tokens[:, :-1]), hidden[:, :-1], positions[:, :-1], self.kv, valid[:, :-1].long()
        )
        early = (self.pending - 1).clamp(min=0)
        last = self.features.gather(1, early[:, None, None].expand(-1, 1, self.features.shape[2]))
        self.fed, self.pending = self.fed + early, (self.pending > 0).long()
        self.features = last[:, : int(self.pending.max())]

    def merge(self, other: Drafter) -> None:
        assert isinstance(other, Eagle3Drafter) and self.start_col is None and other.start_col is None
        self.kv.merge(other.kv)
        width = max(self.features.shape[1], other.features.shape[1])
        self.features = torch.cat([F.pad(f, (0, 0, 0, width - f.shape[1])) for f in (self.features, other.features)])
        self.fed, self.pending = torch.cat([self.fed, other.fed]), torch.cat([self.pending, other.pending])

    def check(self, ctx: Context) -> None:
        self.kv.check(self.fed, "EAGLE-3 head")
        expected = ctx.lengths.to(self.device) - 1 - self.fed
        assert torch.equal(self.pending, expected), (
            f"EAGLE-3 head: pending positions {self.pending.tolist()}, expected {expected.tolist()}"
        )

    @torch.inference_mode()
    def step_seconds(self, context: list[int], device: torch.device, repeats: int = 5) -> float:
        """Median seconds of one cached head step (logits included) after ``context``."""
        dev = self.device
        ids = torch.tensor([list(context) or [0]], device=dev).clamp(max=self.vocab_size - 1)
        n = ids.shape[1]
        kv = KVState(1, dev)
        hidden = torch.zeros(1, n, self.head.config.hidden_size, dtype=self.head.fc.weight.dtype, device=dev)
        cached_step(self.head, self._embed(ids), hidden, torch.arange(n, device=dev)[None], kv, torch.ones_like(ids))
        start, times = kv.length, []

        def step() -> torch.Tensor:
            h = cached_step(
                self.head,
                self._embed(ids[:, -1:]),
                hidden[:, :1],
                torch.tensor([[n]], device=dev),
                kv,
                torch.ones(1, 1, dtype=torch.long, device=dev),
            )
            return self.head.logits(h)

        for i in range(repeats + 1):
            _, seconds = timed(step, dev)
            if i:  # the first call warms up allocators and kernels
                times.append(seconds)
            kv.keep(torch.zeros(1, dtype=torch.long, device=dev), start)  # not timed: the next step starts clean
        return statistics.median(times)

    @property
    def parameters(self) -> int:
        return sum(p.numel() for p in self.head.parameters())

    def describe(self) -> dict[str, Any]:
        c = self.head.config
        return {
            "kind": self.kind,
            "feature_layers": list(self.feature_layers),
            "draft_vocab": c.draft_vocab_size,
            "parameters": self.parameters,
        }

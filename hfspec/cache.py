"""One model's key/value cache and the attention mask that goes with it.

This is the only module that touches the ``transformers`` cache API.

Rows of a batch advance at different speeds: after each verification every row
keeps its own number of drafts. The cache stays one rectangular tensor per layer:
it is cut back to the longest row's accepted prefix, and the positions that a
shorter row rejected stay behind as *holes*, masked out with a 0 in the attention
mask. Position ids are passed explicitly (each row counts only its real tokens),
so a hole changes neither what a row attends to nor where its next token sits.
With one row there are never holes, and the cache holds exactly the committed
tokens.

Invariant, checked after every step: the number of unmasked cached positions of a
row equals the number of its committed tokens that have been fed to the model.
"""
from __future__ import annotations

from typing import Any

import torch
from transformers import DynamicCache


class KVState:
    """A ``DynamicCache`` plus its 2-D attention mask (B, L), kept in step."""

    def __init__(self, batch: int, device: torch.device, model: Any = None):
        self.cache = DynamicCache()
        self.mask = torch.zeros(batch, 0, dtype=torch.long, device=device)

    @staticmethod
    def is_recurrent(model: Any) -> bool:
        """True when ``model``'s cache keeps a recurrent state (which masked holes cannot skip)."""
        return False

    def snapshot(self) -> None:
        """Remember the state that ``rollback`` may have to return to (key/value caches need nothing)."""

    @property
    def length(self) -> int:
        return self.mask.shape[1]

    def extend_mask(self, valid: torch.Tensor) -> torch.Tensor:
        """Append the (B, k) validity of k new columns; returns the mask for the forward."""
        self.mask = torch.cat([self.mask, valid.to(self.mask.dtype)], dim=1)
        return self.mask

    def append(self, key: torch.Tensor, value: torch.Tensor, layer: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Add new (B, heads, k, D) key/value columns to ``layer`` of a hand-written attention; returns all of them.

        For modules that run their own attention over this cache (``extend_mask`` keeps the mask in step).
        """
        return self.cache.update(key, value, layer)

    def rollback(self, keep: torch.Tensor, start: int, ids: torch.Tensor | None = None) -> None:
        """Keep, per row, only the first ``keep[b]`` columns written since ``start``.

        The cache is cut back to ``start + max(keep)``; shorter rows' extra columns
        become holes. ``ids`` (B, k) are the tokens those columns read, for caches
        that must replay them.
        """
        new_length = start + int(keep.max()) if keep.numel() else start
        removed = self.cache.get_seq_length() - new_length
        if removed > 0:
            # transformers' crop takes a negative count of positions to remove.
            self.cache.crop(-removed)
        self.mask = self.mask[:, :new_length]
        cols = torch.arange(new_length - start, device=self.mask.device)
        self.mask[:, start:] *= (cols[None, :] < keep[:, None]).to(self.mask.dtype)

    def select_rows(self, rows: torch.Tensor) -> None:
        """Keep only ``rows`` (1-D long) of the batch, e.g. after others finished."""
        self.cache.batch_select_indices(rows)
        self.mask = self.mask[rows]

    def check(self, fed: torch.Tensor, name: str) -> None:
        """Assert the invariant: unmasked positions per row == tokens fed per row."""
        cached = self.cache.get_seq_length()
        assert cached == self.length, f"{name} cache holds {cached} positions but its mask {self.length}"
        real = self.mask.sum(dim=1)
        assert torch.equal(real, fed), f"{name} cache rows hold {real.tolist()} tokens, expected {fed.tolist()}"

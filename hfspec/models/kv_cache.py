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

Key/value layers live in preallocated buffers (``hfspec.models.kv_buffer``): a step writes its columns in place
and a crop only moves the length, instead of every step copying the whole cache.

A model whose cache keeps a recurrent state (Mamba, hybrids) gets its own layout and
a ``RecurrentState`` that snapshots and replays it (see ``hfspec.models.recurrent``); such a
state cannot skip a hole, so its rows run one at a time.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from hfspec.models.adapter import tree_attention
from hfspec.models.kv_buffer import BufferLayer, buffered_cache
from hfspec.models.recurrent import RecurrentState, is_recurrent

# Leading columns that are holes in every row are dropped once there are this many (and a quarter of the cache).
_TRIM_AT_LEAST = 32


class KVState:
    """A ``DynamicCache`` (of ``BufferLayer``\\ s) plus its 2-D attention mask (B, L), kept in step.

    ``adapter=False`` rolls a recurrent cache back on the generic path (see ``hfspec.models.recurrent``).
    ``reserve``: the most positions the job will cache (prompt, budget and drafts), when known: it bounds how far
    the buffers grow ahead of what they hold.
    """

    def __init__(
        self, batch: int, device: torch.device, model: Any = None, adapter: bool = True, reserve: int | None = None
    ):
        self.recurrent = RecurrentState(model, adapter) if model is not None and is_recurrent(model) else None
        # Attention-only models keep whole key/value caches, also for sliding-window layers: the mask
        # does the windowing, and a whole cache can always be cropped.
        self.cache = self.recurrent.cache if self.recurrent is not None else buffered_cache(reserve)
        self.mask = torch.zeros(batch, 0, dtype=torch.long, device=device)

    @staticmethod
    def is_recurrent(model: Any) -> bool:
        """True when ``model``'s cache keeps a recurrent state (which masked holes cannot skip)."""
        return is_recurrent(model)

    @property
    def serial(self) -> bool:
        """True when the model can only continue its cached state one token at a time."""
        return self.recurrent is not None and self.recurrent.serial

    def snapshot(self) -> None:
        """Remember the state that ``keep`` may have to return to (key/value caches need nothing)."""
        if self.recurrent is not None:
            self.recurrent.snapshot()

    @property
    def length(self) -> int:
        return self.mask.shape[1]

    def extend_mask(self, valid: torch.Tensor) -> torch.Tensor:
        """Append the (B, k) validity of k new columns; returns the mask for the forward."""
        self.mask = torch.cat([self.mask, valid.to(self.mask.dtype)], dim=1)
        if self.recurrent is not None and not self.recurrent.attends:
            return self.mask[:, -valid.shape[1] :]  # without attention, a model reads only the new columns' mask
        return self.mask

    def append(self, key: torch.Tensor, value: torch.Tensor, layer: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Add new (B, heads, k, D) key/value columns to ``layer`` of a hand-written attention; returns all of them.

        For modules that run their own attention over this cache (``extend_mask`` keeps the mask in step).
        """
        return self.cache.update(key, value, layer)

    def keep(
        self, keep: torch.Tensor, start: int, ids: torch.Tensor | None = None, path: torch.Tensor | None = None
    ) -> None:
        """Keep, per row, only the columns ``start + path[b, :keep[b]]`` of those written since ``start``: a chain's
        first ``keep[b]`` (``path`` None: 0, 1, …), or a tree's accepted path.

        The cache is cut back to ``start + max(keep)``; shorter rows' extra columns become holes. A path
        that is not already in place is gathered to the front of the block first (``gather`` per row along
        the sequence), so the cache again reads as a chain. ``ids`` (B, k) are the tokens the columns
        since ``start`` read, for caches that must replay them.
        """
        width = int(keep.max()) if keep.numel() else 0
        kept = torch.arange(width, device=keep.device)[None, :] < keep[:, None]
        if path is not None:
            in_place = torch.arange(width, device=path.device)
            path = torch.where(kept, path[:, :width], in_place)
            if bool((path == in_place).all()):
                path = None  # a chain's path: the kept columns are in place already
        if self.recurrent is not None:
            # One row at a time (no holes); snapshot() was called at ``start``.
            assert path is None, "a recurrent state cannot keep a tree's path (trees are refused for it)"
            assert self.mask.shape[0] <= 1, "a recurrent cache holds one row"
            self.recurrent.rollback(width, start, self.mask, ids)
            self.mask = self.mask[:, : start + width]
            return
        if path is not None:
            self._gather(start, path)
        removed = self.cache.get_seq_length() - (start + width)
        if removed > 0:
            # transformers' crop takes a negative count of positions to remove.
            self.cache.crop(-removed)
        self.mask = torch.cat([self.mask[:, :start], self.mask[:, start : start + width] * kept.to(self.mask)], 1)

    def _gather(self, start: int, path: torch.Tensor) -> None:
        """Move the columns ``start + path`` (B, W) to ``start .. start + W`` in every layer."""
        cols = path + start
        for layer in self.cache.layers:
            if layer.get_seq_length() == 0:
                continue
            index = cols[:, None, :, None].expand(-1, layer.keys.shape[1], -1, layer.keys.shape[-1])
            kept_keys, kept_values = layer.keys.gather(2, index), layer.values.gather(2, index)  # copies
            # Written over the tree's own columns in place (cut after): copying the whole cache would cost more
            # than the tree's forward gains on long prompts. A layer's keys and values are public tensors (views).
            layer.keys[:, :, start : start + cols.shape[1]] = kept_keys
            layer.values[:, :, start : start + cols.shape[1]] = kept_values

    def tree_mask(
        self, visible: torch.Tensor, query_positions: torch.Tensor, tree_positions: torch.Tensor, window: int | None
    ) -> torch.Tensor:
        """(B, k, L) bool: what k new columns (already in ``extend_mask``) may attend to.

        The cached columns before the last T ones are the committed tokens (as the 2-D mask says);
        the last T are tree nodes at ``tree_positions`` (B, T), of which query i sees those
        ``visible`` (B, k, T) marks (itself and its ancestors). ``window``: a sliding-window
        layer's reach, counted in positions (query − key < window), holes excluded.
        """
        tree = visible.shape[-1]
        committed = self.mask[:, : self.length - tree].bool()
        allowed = torch.cat([committed[:, None, :].expand(-1, visible.shape[1], -1), visible], dim=2)
        if window is None:
            return allowed
        key_positions = torch.cat([self.mask[:, : self.length - tree].cumsum(dim=1) - 1, tree_positions], dim=1)
        return allowed & (query_positions[:, :, None] - key_positions[:, None, :] < window)

    def tree_attention(
        self,
        model: Any,
        visible: torch.Tensor,
        query_positions: torch.Tensor,
        tree_positions: torch.Tensor,
        window: int | None,
    ) -> torch.Tensor | dict[str, torch.Tensor]:
        """What ``model``'s forward takes as the mask of k new columns seeing ``visible`` of the tree (as in
        ``tree_mask``) and every valid cached column: full attention, plus, with ``window``, the sliding-window
        layers' mask counted in positions (``models.tree_attention``)."""
        full = self.tree_mask(visible, query_positions, tree_positions, None)
        sliding = self.tree_mask(visible, query_positions, tree_positions, window) if window else None
        return tree_attention(model, full, sliding)

    def select_rows(self, rows: torch.Tensor) -> None:
        """Keep only ``rows`` (1-D long) of the batch, e.g. after others finished."""
        if self.recurrent is not None:  # linear layers select rows through reorder_cache only
            self.cache.reorder_cache(rows)
        else:
            self.cache.batch_select_indices(rows)
        self.mask = self.mask[rows]
        self._trim()

    def _trim(self) -> None:
        """Drop the leading columns that are holes in every row, once they are many: in a running batch rows join
        left-padded to the batch's length and leave, so without this the cache would grow with every step the
        batch has ever taken, and every later step and merge would carry it. Nothing attends to a hole, and each
        row's positions are counted from its tokens, so no row's result changes."""
        if self.recurrent is not None or self.mask.shape[0] == 0:
            return
        held = self.mask.any(dim=0)
        if not bool(held.any()):
            return
        first = int(held.int().argmax())
        if first < max(_TRIM_AT_LEAST, self.length // 4):  # a copy of the cache: only when it pays for itself
            return
        for layer in self.cache.layers:
            if not layer.get_seq_length():
                continue
            if isinstance(layer, BufferLayer):
                layer.drop_front(first)
            else:
                layer.keys, layer.values = layer.keys[:, :, first:], layer.values[:, :, first:]
        self.mask = self.mask[:, first:]

    def merge(self, other: KVState) -> None:
        """Append ``other``'s rows after these (a row prefilled alone joining a running batch).

        The shorter side is left-padded with holes (zero columns, masked out), so each row keeps its own columns
        in their order and nothing it attends to changes; the cache is as long as the longer side. With no rows
        here, this state becomes ``other``'s.
        """
        assert self.recurrent is None and other.recurrent is None, "a recurrent state holds one row"
        if self.mask.shape[0] == 0:
            self.cache, self.mask = other.cache, other.mask
            return
        length = max(self.length, other.length)
        mine, theirs = self.cache.layers, other.cache.layers
        for i in range(max(len(mine), len(theirs))):
            pair = [side[i] if i < len(side) and side[i].get_seq_length() else None for side in (mine, theirs)]
            like = pair[0] if pair[0] is not None else pair[1]
            if like is None:  # neither side holds this layer yet
                continue
            keys = [_padded(layer, "keys", like, rows, length) for layer, rows in zip(pair, (self, other))]
            values = [_padded(layer, "values", like, rows, length) for layer, rows in zip(pair, (self, other))]
            while len(mine) <= i:
                mine.append(type(like)())
            if not mine[i].is_initialized:
                mine[i].lazy_initialization(keys[0], values[0])
            mine[i].keys, mine[i].values = torch.cat(keys), torch.cat(values)
        self.mask = torch.cat([F.pad(m, (length - m.shape[1], 0)) for m in (self.mask, other.mask)])

    def check(self, fed: torch.Tensor, name: str) -> None:
        """Assert the invariant: unmasked positions per row == tokens fed per row."""
        cached = self.recurrent.seq_length(self.length) if self.recurrent is not None else self.cache.get_seq_length()
        assert cached == self.length, f"{name} cache holds {cached} positions but its mask {self.length}"
        real = self.mask.sum(dim=1)
        assert torch.equal(real, fed), f"{name} cache rows hold {real.tolist()} tokens, expected {fed.tolist()}"


def _padded(layer: Any, name: str, like: Any, state: KVState, length: int) -> torch.Tensor:
    """``layer``'s keys or values (``name``) for ``state``'s rows, left-padded with zero columns to ``length``;
    zeros shaped like ``like``'s where ``layer`` holds nothing yet."""
    rows = state.mask.shape[0]
    reference = getattr(like, name)
    if layer is None or not layer.get_seq_length():
        return reference.new_zeros(rows, reference.shape[1], length, reference.shape[3])
    tensor = getattr(layer, name)
    return F.pad(tensor, (0, 0, length - tensor.shape[2], 0))

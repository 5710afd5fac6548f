"""A key/value cache layer that writes new tokens into a preallocated buffer instead of concatenating.

transformers' ``DynamicLayer`` grows by ``torch.cat``: every forward copies the whole cache of every layer,
so a decoding step costs more the longer the context. :class:`BufferLayer` keeps each layer's keys and values
(B, heads, capacity, D) in a buffer with room to spare, writes the new columns in place and hands out views of
the filled part (strided along the sequence: hfspec's attention kernel and torch's read them in place). ``crop``
only moves the length. When the buffer is full it is replaced by one twice as long (one copy now and then), never
longer than a ``reserve`` hint (the job's whole budget) when one is given: a short job on a long-context model
gets a short buffer.

The arithmetic is untouched: the keys a query sees are the same bits, only where they live changes. Everything
else ``DynamicLayer`` does (``batch_select_indices``, ``reorder_cache``, assigning ``keys``/``values``) works on
the filled part; an assigned tensor becomes the new buffer, filled to its end.
"""

from __future__ import annotations

from functools import partial

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

# Buffers grow in whole blocks of positions, so short prompts and single tokens do not each start a copy.
BLOCK = 64


def capacity(needed: int, current: int, reserve: int | None = None) -> int:
    """How many positions a buffer of ``current`` that must hold ``needed`` grows to: twice as many, at least
    ``needed`` rounded up to a block, and no more than ``reserve`` while that is enough (past it, a hint that
    fell short, it doubles again rather than grow by a copy per step)."""
    grown = max(-(-needed // BLOCK) * BLOCK, 2 * current)
    return min(grown, reserve) if reserve is not None and needed <= reserve else grown


def _filled(tensor: torch.Tensor | None) -> int:
    """The positions an assigned keys or values tensor holds: all of it (none for None or an empty placeholder)."""
    return 0 if tensor is None or tensor.dim() < 2 else tensor.shape[-2]


class BufferLayer(DynamicLayer):
    """A ``DynamicLayer`` whose keys and values are the filled part of preallocated buffers (see module doc)."""

    def __init__(self, reserve: int | None = None, **kwargs):
        self.reserve = reserve  # the most positions this layer is expected to hold, or None: not known
        self._keys: torch.Tensor | None = None  # (B, Hkv, capacity, D)
        self._values: torch.Tensor | None = None  # (B, Hkv, capacity, Dv)
        self._length = 0
        super().__init__(**kwargs)

    @property
    def keys(self) -> torch.Tensor | None:
        return None if self._keys is None else self._keys[:, :, : self._length]

    @keys.setter
    def keys(self, tensor: torch.Tensor | None) -> None:
        self._keys = tensor
        self._length = _filled(tensor)

    @property
    def values(self) -> torch.Tensor | None:
        return None if self._values is None else self._values[:, :, : self._length]

    @values.setter
    def values(self, tensor: torch.Tensor | None) -> None:
        self._values = tensor
        self._length = _filled(tensor)

    @property
    def capacity(self) -> int:
        return 0 if self._keys is None else self._keys.shape[-2]

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self._keys = key_states.new_empty(*key_states.shape[:2], 0, key_states.shape[-1])
        self._values = value_states.new_empty(*value_states.shape[:2], 0, value_states.shape[-1])
        self._length = 0
        self.is_initialized = True

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the new (B, Hkv, k, D) columns after the filled part; returns views of all filled columns."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        start = self._length
        end = start + key_states.shape[-2]
        if end > self.capacity:
            self._grow(end)
        self._keys[:, :, start:end] = key_states
        self._values[:, :, start:end] = value_states
        self._length = end
        return self.keys, self.values

    def room(self, count: int) -> tuple[torch.Tensor, torch.Tensor, int] | None:
        """The key and value buffers (B, Hkv, capacity, D) with room for ``count`` more columns, and the first of
        them, for a caller that writes them itself and then calls :meth:`advance`; None before the first update."""
        if not self.is_initialized or self._keys is None:
            return None
        end = self._length + count
        if end > self.capacity:
            self._grow(end)
        return self._keys, self._values, self._length

    def advance(self, count: int) -> None:
        """Count ``count`` columns written after the filled ones (into the buffers :meth:`room` returned) as filled."""
        self._length += count

    def _grow(self, needed: int) -> None:
        """Move the filled part into buffers long enough for ``needed`` positions."""
        size = capacity(needed, self.capacity, self.reserve)
        keys, values = self._keys, self._values
        self._keys = keys.new_empty(*keys.shape[:2], size, keys.shape[-1])
        self._values = values.new_empty(*values.shape[:2], size, values.shape[-1])
        self._keys[:, :, : self._length] = keys[:, :, : self._length]
        self._values[:, :, : self._length] = values[:, :, : self._length]

    def get_seq_length(self) -> int:
        return self._length if self.is_initialized else 0

    def crop(self, tokens_to_remove: int) -> None:
        """Forget the last ``-tokens_to_remove`` positions (a negative count, as ``DynamicLayer.crop`` takes)."""
        if tokens_to_remove > 0:
            raise ValueError(f"crop takes a negative count of positions to remove, got {tokens_to_remove}")
        if self.is_initialized:
            self._length = max(0, self._length + tokens_to_remove)

    def drop_front(self, count: int) -> None:
        """Forget the first ``count`` positions, the rest moved to the front of buffers of the same capacity."""
        if count <= 0 or not self.is_initialized or self._keys is None:
            return
        keys, values, length = self._keys, self._values, self._length - count
        self._keys, self._values = keys.new_empty(keys.shape), values.new_empty(values.shape)
        self._keys[:, :, :length] = keys[:, :, count : self._length]
        self._values[:, :, :length] = values[:, :, count : self._length]
        self._length = length

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep the rows ``indices``, with the buffers' spare room (one copy, as ``DynamicLayer`` makes)."""
        if self.get_seq_length() > 0:
            length = self._length
            self._keys, self._values = self._keys[indices], self._values[indices]
            self._length = length


def buffered_cache(reserve: int | None = None) -> DynamicCache:
    """A ``DynamicCache`` whose layers, created as the model first writes them, are :class:`BufferLayer`\\ s;
    ``reserve``: the most positions the job will hold, when known (a bound on the buffers, not their size)."""
    cache = DynamicCache()
    cache.layer_class_to_replicate = partial(BufferLayer, reserve)
    return cache

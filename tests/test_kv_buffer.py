"""Preallocated key/value buffers: the same cache as concatenation through every operation, written in place,
bounded in size, and the same attention bits on hfspec's kernel."""

from __future__ import annotations

import tiny
import torch
from transformers import AutoModelForCausalLM, DynamicCache

from hfspec.cpu import attention as cpu_attention
from hfspec.models.kv_buffer import BLOCK, BufferLayer, buffered_cache, capacity
from hfspec.models.kv_cache import KVState

HEADS, DIM = 2, 3


def columns(batch: int, k: int, g: torch.Generator) -> torch.Tensor:
    return torch.randn(batch, HEADS, k, DIM, generator=g)


def same(a: KVState, b: KVState) -> None:
    assert torch.equal(a.mask, b.mask)
    assert len(a.cache.layers) == len(b.cache.layers)
    for mine, theirs in zip(a.cache.layers, b.cache.layers):
        assert mine.get_seq_length() == theirs.get_seq_length()
        assert torch.equal(mine.keys, theirs.keys) and torch.equal(mine.values, theirs.values)


def concatenating(batch: int) -> KVState:
    kv = KVState(batch, torch.device("cpu"))
    kv.cache = DynamicCache()  # transformers' own layers, which grow by torch.cat
    return kv


def step(kv: KVState, keys: torch.Tensor, keep: torch.Tensor, path: torch.Tensor | None) -> None:
    """Write k columns to two layers, then keep ``keep`` of them per row (along ``path``)."""
    start = kv.length
    for layer in range(2):
        kv.append(keys + layer, -keys, layer)
    kv.extend_mask(torch.ones(keys.shape[0], keys.shape[2], dtype=torch.long))
    kv.keep(keep, start, path=path)


def test_buffers_hold_what_concatenation_holds_through_steps_trees_row_changes_and_merges():
    g = torch.Generator().manual_seed(0)
    ours, theirs = KVState(2, torch.device("cpu")), concatenating(2)
    assert all(isinstance(layer, BufferLayer) for layer in ours.cache.layers) or not ours.cache.layers
    plan = [
        (5, [5, 5], None),  # a prefill
        (4, [2, 4], None),  # a chain: holes in row 0
        (6, [3, 1], [[0, 2, 5], [0, -1, -1]]),  # a tree's path, gathered
        (70, [70, 70], None),  # past the first block: the buffers grow
        (3, [0, 1], None),
    ]
    for k, keep, path in plan:
        keys = columns(2, k, g)
        paths = None if path is None else torch.tensor(path)
        for kv in (ours, theirs):
            step(kv, keys, torch.tensor(keep), paths)
        same(ours, theirs)
    for kv in (ours, theirs):
        kv.select_rows(torch.tensor([1]))
    same(ours, theirs)
    joining = [KVState(1, torch.device("cpu")), concatenating(1)]
    keys = columns(1, 9, g)
    for kv, part in zip((ours, theirs), joining):
        step(part, keys, torch.tensor([9]), None)
        kv.merge(part)
    same(ours, theirs)
    keys = columns(2, 2, g)
    for kv in (ours, theirs):
        step(kv, keys, torch.tensor([2, 1]), None)
    same(ours, theirs)
    ours.check(ours.mask.sum(dim=1), "buffered")


def test_columns_left_as_holes_in_every_row_are_dropped_when_rows_leave():
    # A running batch: a row joins left-padded to the batch's length, the old row leaves. Without the trim the
    # cache would keep every column the batch ever held; with it, the joined row's own columns are what remain.
    g = torch.Generator().manual_seed(1)
    for kv in (KVState(1, torch.device("cpu")), concatenating(1)):
        step(kv, columns(1, 80, g), torch.tensor([80]), None)
        part = KVState(1, torch.device("cpu"))
        keys = columns(1, 5, g)
        step(part, keys, torch.tensor([5]), None)
        kv.merge(part)
        assert kv.length == 80  # the joined row left-padded with 75 holes
        kv.select_rows(torch.tensor([1]))
        assert kv.length == 5 and torch.equal(kv.mask, torch.ones(1, 5, dtype=torch.long))
        for layer in range(2):
            assert torch.equal(kv.cache.layers[layer].keys, keys + layer)
            assert torch.equal(kv.cache.layers[layer].values, -keys)
        step(kv, columns(1, 3, g), torch.tensor([3]), None)  # the trimmed cache goes on
        kv.check(torch.tensor([8]), "trimmed")
    few = KVState(2, torch.device("cpu"))  # a few leading holes: not worth a copy of the cache
    step(few, columns(2, 40, g), torch.tensor([40, 40]), None)
    step(few, columns(2, 10, g), torch.tensor([10, 10]), None)
    few.mask[1, :20] = 0
    few.select_rows(torch.tensor([1]))
    assert few.length == 50


def test_steps_write_in_place_and_crops_only_move_the_length():
    layer = BufferLayer()
    g = torch.Generator().manual_seed(1)
    keys, _ = layer.update(columns(1, 10, g), columns(1, 10, g))
    buffer = keys.data_ptr()
    assert layer.capacity == BLOCK and keys.shape[2] == 10
    for _ in range(20):
        layer.update(columns(1, 3, g), columns(1, 3, g))
        layer.crop(-1)
    assert layer.keys.data_ptr() == buffer and layer.get_seq_length() == 50 and layer.capacity == BLOCK
    layer.update(columns(1, BLOCK - 50 + 1, g), columns(1, BLOCK - 50 + 1, g))
    assert layer.capacity == 2 * BLOCK and layer.get_seq_length() == BLOCK + 1


def test_buffers_double_from_what_they_hold_and_stay_within_a_known_budget():
    assert capacity(10, 0) == BLOCK and capacity(BLOCK + 1, BLOCK) == 2 * BLOCK
    assert capacity(1000, 0) == 1024 and capacity(1025, 1024) == 2048
    assert capacity(1025, 1024, reserve=1100) == 1100  # the budget bounds the doubling
    assert capacity(20, 0, reserve=32_768) == BLOCK  # a long context's bound is not an allocation
    assert capacity(1101, 1100, reserve=1100) == 2200  # a budget that fell short: doubling again
    layer = buffered_cache(reserve=100).layer_class_to_replicate()
    g = torch.Generator().manual_seed(2)
    layer.update(columns(1, 70, g), columns(1, 70, g))
    layer.update(columns(1, 30, g), columns(1, 30, g))
    assert layer.capacity == 100


def test_the_kernel_reads_buffered_keys_in_place_with_the_bits_of_concatenated_ones(library):
    config = tiny.make_config("llama", 64, hidden=32, layers=2)  # grouped key/value heads
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    assert cpu_attention.use(model, library)
    seen = []
    kernel = cpu_attention.attention

    def spy(query, key, *args, **kwargs):
        seen.append(key.is_contiguous())
        return kernel(query, key, *args, **kwargs)

    ids = torch.randint(4, 64, (1, 12), generator=torch.Generator().manual_seed(3))
    logits = []
    for cache in (DynamicCache(), buffered_cache()):
        out = []
        with torch.inference_mode():
            out.append(model(ids[:, :7], cache=cache, use_cache=True).logits)
            for i in range(7, 12):
                cpu_attention.attention = spy if isinstance(cache.layers[0], BufferLayer) else kernel
                try:
                    out.append(model(ids[:, i : i + 1], cache=cache, use_cache=True).logits)
                finally:
                    cpu_attention.attention = kernel
            cache.crop(-3)
            out.append(model(ids[:, 9:12], cache=cache, use_cache=True).logits)  # a verification
        logits.append(torch.cat(out, dim=1))
    assert torch.equal(logits[0], logits[1])
    assert seen and not any(seen)  # views of the filled part, not copies

"""Where a row's bits depend on the rows computed with it: one prefix through five schedules, every module hooked.

A target forward is row-count invariant when a query row's values are the same bits whether it runs alone (a
decoding step), in a verification block of k, in one prefill of the whole prompt, as a node of a tree, or as a
row of a left-padded batch. :func:`schedules` feeds the same prefix those ways; :func:`record` hooks every module
(its first input and its output) and keeps each prefix position's row; :func:`first_difference` names the first
module, in forward order, whose rows differ from the decoding steps' in any bit. Used by
``tests/test_row_invariance.py`` and ``scripts/invariance_report.py``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import nn
from transformers import DynamicCache

from hfspec.models.adapter import cache_kwarg, sliding_window, tree_attention, window_in_columns

# One call: what a forward reads, and which (batch row, column) holds which prefix position.
Rows = list[tuple[int, int, int]]


@dataclass(frozen=True)
class Feed:
    ids: torch.Tensor  # (B, k)
    mask: torch.Tensor | None  # 2-D (B, cached + k), or a prepared 4-D mask (a tree's)
    positions: torch.Tensor  # (B, k)
    rows: Rows  # (b, column, prefix position) to keep


Schedule = Callable[[], Iterator[Feed]]


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bit pattern (so that -0.0 and 0.0, or two NaNs, are told apart or matched exactly)."""
    kinds = {2: torch.int16, 4: torch.int32, 8: torch.int64}
    return t.contiguous().view(kinds[t.element_size()]) if t.is_floating_point() else t


@contextlib.contextmanager
def _hooks(model: nn.Module, seen: dict[str, torch.Tensor]) -> Iterator[None]:
    """Record each module's first tensor input (``name:in``) and first tensor output (``name:out``) of a forward."""

    def first(x):
        if isinstance(x, torch.Tensor):
            return x
        if isinstance(x, (tuple, list)):
            return next((t for t in x if isinstance(t, torch.Tensor)), None)
        return getattr(x, "logits", None) if hasattr(x, "logits") else None

    def pre(name, module, args, kwargs):
        x = first(args) if args else first(kwargs.get("hidden_states"))
        if x is not None:
            seen.setdefault(f"{name or 'model'}:in", x.detach().clone())

    def post(name, module, args, kwargs, out):
        x = first(out)
        if x is not None:
            seen.setdefault(f"{name or 'model'}:out", x.detach().clone())

    handles = []
    for name, module in model.named_modules():
        handles.append(module.register_forward_pre_hook(lambda m, a, k, n=name: pre(n, m, a, k), with_kwargs=True))
        handles.append(module.register_forward_hook(lambda m, a, k, o, n=name: post(n, m, a, k, o), with_kwargs=True))
    try:
        yield
    finally:
        for h in handles:
            h.remove()


@torch.inference_mode()
def record(
    model: nn.Module, schedule: Schedule, cache: DynamicCache
) -> tuple[list[str], dict[str, dict[int, torch.Tensor]]]:
    """Run ``schedule``'s forwards with ``cache``; per hooked name, the row of each prefix position it computed.
    Tensors whose first two dimensions are not the call's (batch, new columns) are not rows and are left out."""
    order: list[str] = []
    rows: dict[str, dict[int, torch.Tensor]] = {}
    for feed in schedule():
        seen: dict[str, torch.Tensor] = {}
        with _hooks(model, seen):
            model(
                input_ids=feed.ids,
                attention_mask=feed.mask,
                position_ids=feed.positions,
                **{cache_kwarg(type(model)): cache},
                use_cache=True,
            )
        batch, k = feed.ids.shape
        for name, t in seen.items():
            if t.dim() < 2 or tuple(t.shape[:2]) != (batch, k):
                if not (t.dim() >= 2 and t.shape[0] == 1 and t.shape[1] == k):  # broadcast over the batch (rotary)
                    continue
            if name not in rows:
                order.append(name)
                rows[name] = {}
            for b, column, position in feed.rows:
                rows[name][position] = t[min(b, t.shape[0] - 1), column]
    return order, rows


def first_difference(
    order: list[str], want: dict[str, dict[int, torch.Tensor]], got: dict[str, dict[int, torch.Tensor]]
) -> tuple[str, list[int]] | None:
    """The first hooked name, in forward order, where a position's row differs in any bit; with those positions."""
    for name in order:
        if name not in got:
            continue
        differ = [
            p for p, row in got[name].items() if p in want[name] and not torch.equal(_bits(want[name][p]), _bits(row))
        ]
        if differ:
            return name, sorted(differ)
    return None


# -- the schedules ---------------------------------------------------------------------------------


def _ones(batch: int, length: int) -> torch.Tensor:
    return torch.ones(batch, length, dtype=torch.long)


def decode(ids: list[int]) -> Schedule:
    """One token per forward (the model's own decoding steps)."""

    def run():
        for t, token in enumerate(ids):
            yield Feed(torch.tensor([[token]]), _ones(1, t + 1), torch.tensor([[t]]), [(0, 0, t)])

    return run


def blocks(ids: list[int], k: int, first: int = 0) -> Schedule:
    """A prefill of ``first`` tokens (if any), then blocks of ``k`` (verifications of k - 1 drafts)."""

    def run():
        start = 0
        for size in ([first] if first else []) + [k] * len(ids):
            if start >= len(ids):
                return
            chunk = ids[start : start + size]
            positions = torch.arange(start, start + len(chunk))[None]
            yield Feed(
                torch.tensor([chunk]),
                _ones(1, start + len(chunk)),
                positions,
                [(0, i, start + i) for i in range(len(chunk))],
            )
            start += len(chunk)

    return run


def prefill(ids: list[int]) -> Schedule:
    """The whole prefix in one forward."""
    return blocks(ids, len(ids))


def tree(model: nn.Module, ids: list[int], start: int, distractors: list[int]) -> Schedule:
    """A prefill of ``ids[:start]``, then one tree forward: the rest of ``ids`` as a chain from the root
    ``ids[start]``, and a wrong sibling (from ``distractors``) beside each chain node."""

    def run():
        if start:
            yield Feed(torch.tensor([ids[:start]]), _ones(1, start), torch.arange(start)[None], [])
        chain = ids[start:]
        tokens, parents, keep = [chain[0]], [-1], [(0, 0, start)]
        for depth, token in enumerate(chain[1:], 1):
            parent = 2 * (depth - 1)  # the previous chain node
            tokens += [distractors[depth % len(distractors)], token]
            parents += [parent, parent]
            keep.append((0, len(tokens) - 1, start + depth))
        n = len(tokens)
        depth = torch.zeros(n, dtype=torch.long)
        visible = torch.zeros(n, start + n, dtype=torch.bool)
        visible[:, :start] = True
        for i, p in enumerate(parents):
            visible[i, start + i] = True
            while p >= 0:
                visible[i, start + p] = True
                depth[i] += 1
                p = parents[p]
        positions = start + depth
        window = sliding_window(model)
        sliding = None
        if window:  # the sliding layers' mask, the window counted in positions as hfspec counts it
            columns = torch.cat([torch.arange(start), positions])
            sliding = (visible & (positions[:, None] - columns[None, :] < window))[None]
        yield Feed(torch.tensor([tokens]), tree_attention(model, visible[None], sliding), positions[None], keep)

    return run


def padded(ids: list[int], pad: int, other: list[int], first: int, k: int) -> Schedule:
    """A batch of two: ``ids`` left-padded by ``pad`` columns beside ``other`` (``pad`` tokens longer), a prefill
    of ``first`` columns of ``ids``, then blocks of ``k``: what a ragged batch's verifications feed."""
    assert len(other) >= len(ids) + pad

    def run():
        real = torch.tensor([[0] * pad + [1] * len(ids), [1] * (pad + len(ids))])
        both = torch.tensor([[0] * pad + ids, other[: pad + len(ids)]])
        positions = (real.cumsum(1) - 1).clamp(min=0)
        start = 0
        for stop in [pad + first] + list(range(pad + first + k, pad + len(ids) + k, k)):
            stop = min(stop, pad + len(ids))
            if stop <= start:
                continue
            keep = [(0, c - start, c - pad) for c in range(max(start, pad), stop)]
            yield Feed(both[:, start:stop], real[:, :stop], positions[:, start:stop], keep)
            start = stop

    return run


def schedules(model: nn.Module, ids: list[int], *, other: list[int], k: int = 4) -> dict[str, Schedule]:
    """The schedules a prefix goes through, by name ("decode" first: the reference). A model whose sliding window
    counts cache columns (Mistral) gets no tree and no padded batch: hfspec runs neither for it."""
    half = len(ids) // 2
    runs = {
        "decode": decode(ids),
        f"blocks of {k}": blocks(ids, k),
        "prefill": prefill(ids),
        f"prefill {half - 1}, then blocks of {k}": blocks(ids, k, half - 1),
        "tree": tree(model, ids, half, other),
        f"left-padded batch, blocks of {k}": padded(ids, 3, other, half, k),
    }
    if window_in_columns(model):
        del runs["tree"], runs[f"left-padded batch, blocks of {k}"]
    return runs


def report(
    model: nn.Module, ids: list[int], *, other: list[int], k: int = 4
) -> dict[str, tuple[str, list[int]] | None]:
    """Per schedule, the first hooked name (``module:in`` or ``module:out``) whose rows differ from the decoding
    steps' in any bit, with the positions where they do; None where every row is the same bits."""
    runs = schedules(model, ids, other=other, k=k)
    # The decoding steps with generate()'s cache (sliding-window layers keep only their window), the others with
    # hfspec's (whole caches; the mask does the windowing).
    order, want = record(model, runs.pop("decode"), DynamicCache(config=model.config))
    return {name: first_difference(order, want, record(model, run, DynamicCache())[1]) for name, run in runs.items()}

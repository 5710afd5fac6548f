"""The lookup stores of n-gram and hybrid drafters: outputs of other prompts only.

An n-gram drafter keeps the outputs of its finished rows and drafts from them later
(``hfspec.drafters.ngram.History``), as a user's generator would after answering other
questions. Left to itself in the bench, that store would hold the warm-up outputs of the
very prompts it then measures, and in the sample mode their greedy outputs: a measured
prompt would copy its own answer, and lookup would look better than it is.

So the bench keeps the store for it. Every output of an hfspec call with a drafter that
has a store is logged with its prompt; the log starts empty in each mode. Before every
hfspec call the store is rebuilt from that log: exactly the outputs of the drafter's
earlier calls in this mode (warm-up calls included), oldest first, of every prompt other
than those being generated. A prompt thus never meets its own answer, from whatever run,
and meets those of the prompts before it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from hfspec.drafters import Drafter
from hfspec.drafters.ngram import NgramDrafter
from hfspec.generator import SpeculativeGenerator


def lookup_of(drafter: Drafter) -> NgramDrafter | None:
    """The n-gram drafter whose store of earlier outputs ``drafter`` drafts from; None when it has none."""
    lookup = drafter.lookup
    return lookup if isinstance(lookup, NgramDrafter) else None


class LookupStores:
    """The stores of a bench's drafters, by drafter name, and the log they are rebuilt from."""

    def __init__(self, specs: Mapping[str, SpeculativeGenerator]):
        self.lookups = {name: lookup for name, spec in specs.items() if (lookup := lookup_of(spec.drafter))}
        self.log: dict[str, list[tuple[tuple[int, ...], list[int]]]] = {name: [] for name in self.lookups}

    def forget(self) -> None:
        """Start a mode: no output of another mode may be drafted from."""
        for entries in self.log.values():
            entries.clear()

    def prepare(self, name: str, prompts: Sequence[Sequence[int]]) -> None:
        """Rebuild ``name``'s store from the logged outputs of prompts other than ``prompts``."""
        lookup = self.lookups.get(name)
        if lookup is None:
            return
        excluded = {tuple(p) for p in prompts}
        lookup.clear_history()
        for prompt, output in self.log[name]:
            if prompt not in excluded:
                lookup.finished(0, torch.tensor(output, dtype=torch.long))  # as if that row had just finished

    def record(self, name: str, prompts: Sequence[Sequence[int]], outputs: Sequence[Sequence[int]]) -> None:
        """Log the outputs of one call with drafter ``name``, one per prompt."""
        if name in self.log:
            self.log[name] += [(tuple(p), list(o)) for p, o in zip(prompts, outputs)]

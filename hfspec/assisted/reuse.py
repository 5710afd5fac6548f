"""One ``SpeculativeGenerator`` per target, draft and tokenizers, reused by later ``model.generate`` calls.

A generator keeps what its first calls learnt (the costs measured for ``gamma="auto"``, the acceptance seen, the
n-gram lookup's store of earlier outputs, whether the target reads trees), as ``hfspec.generate``'s cached pairs do.
The generators live on the target model itself, in a private attribute, so they live and die with it: no table
here keeps a model alive after its user lets it go, and no entry outlives its model to be found again by a new
object at the same address, as an ``id()`` key would be. The other parts of a key are weak references, which
never equal a new object once their own is gone. A copied or pickled model starts with none.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from pathlib import Path
from typing import Any

from transformers import PreTrainedModel, PreTrainedTokenizerBase

from hfspec.generator import SpeculativeGenerator

ATTRIBUTE = "_hfspec_generators"
KEEP = 4  # generators per target; each holds its draft model, so a target that meets many drafts keeps the latest


class Generators:
    """The generators built for one target, by draft and tokenizers, the least recently used first."""

    def __init__(self) -> None:
        self.entries: OrderedDict[tuple, SpeculativeGenerator] = OrderedDict()

    def __deepcopy__(self, memo: dict) -> Generators:
        return Generators()  # a copied model has models of its own: nothing built for the original fits it

    def __reduce__(self) -> tuple:
        return Generators, ()  # nor does a pickled one carry the original's

    def __len__(self) -> int:
        return len(self.entries)


def _part(value: Any) -> Any:
    """One part of a key: names and paths by value, objects by a weak reference."""
    if value is None or isinstance(value, (str, bool)):
        return value
    if isinstance(value, Path):
        return str(value)
    return weakref.ref(value)


def _alive(key: tuple) -> bool:
    return all(not isinstance(part, weakref.ref) or part() is not None for part in key)


def generators(target: PreTrainedModel) -> Generators:
    """The generators kept on ``target`` (created empty on first use)."""
    held = getattr(target, ATTRIBUTE, None)
    if not isinstance(held, Generators):
        held = Generators()
        setattr(target, ATTRIBUTE, held)
    return held


def generator_for(
    target: PreTrainedModel,
    draft: Any,
    tokenizer: PreTrainedTokenizerBase | None,
    draft_tokenizer: PreTrainedTokenizerBase | None,
    ngram: bool,
) -> SpeculativeGenerator:
    """The generator for this target, draft (as ``SpeculativeGenerator`` takes it) and tokenizers; built once.
    The models are used as they are: nothing here switches hfspec's CPU kernel on (``hfspec.fast.accelerate``)."""
    held = generators(target)
    for key in [k for k in held.entries if not _alive(k)]:
        del held.entries[key]
    key = (_part(draft), _part(tokenizer), _part(draft_tokenizer), ngram)
    if key in held.entries:
        held.entries.move_to_end(key)
        return held.entries[key]
    gen = SpeculativeGenerator(target, draft, tokenizer, ngram=ngram, draft_tokenizer=draft_tokenizer)
    held.entries[key] = gen
    while len(held.entries) > KEEP:
        held.entries.popitem(last=False)
    return gen


def forget(target: PreTrainedModel) -> None:
    """Drop the generators kept on ``target``, and with them their hold on the draft models."""
    if isinstance(getattr(target, ATTRIBUTE, None), Generators):
        delattr(target, ATTRIBUTE)

"""Switching a model's modules to a kernel-backed class and back, in place.

A module keeps its state (weights, config, hooks); only its ``__class__`` changes, to a subclass-like stand-in whose
forward runs hfspec's kernel. The module's own class is kept in ``hfspec_original`` so that :func:`switch_back`
restores it, with any other ``hfspec_*`` attributes the switch stored removed again.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

__all__ = ["switch", "switch_back"]


def switch(model: nn.Module, cls: type, state: Callable[[nn.Module], dict[str, Any] | None]) -> int:
    """Switch every module of ``model`` for which ``state`` gives the attributes to keep on it (None: leave it) to
    ``cls``; how many modules run ``cls`` now, those switched before included."""
    count = 0
    for module in model.modules():
        if type(module) is cls:
            count += 1  # switched before
            continue
        attributes = state(module)
        if attributes is None:
            continue
        module.__dict__.update(attributes, hfspec_original=type(module))
        module.__class__ = cls
        count += 1
    return count


def switch_back(model: nn.Module, cls: type) -> int:
    """Switch ``model``'s modules of class ``cls`` back to their own classes; how many were switched."""
    count = 0
    for module in model.modules():
        if type(module) is cls:
            module.__class__ = module.__dict__.pop("hfspec_original")
            for name in [name for name in module.__dict__ if name.startswith("hfspec_")]:
                del module.__dict__[name]
            count += 1
    return count

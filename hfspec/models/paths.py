"""Where hfspec keeps what it fetches, builds and measures (``$HFSPEC_CACHE``, else ``~/.cache/hfspec``), and where
the files it ships beside its code are (``hfspec/data``: the presets, the shipped draft and head, the prompt sets).

It imports nothing but the standard library, so that ``hfspec cache`` lists the cache without loading torch.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["DATA", "cache_dir"]

DATA = Path(__file__).resolve().parent.parent / "data"  # in the package, read only


def cache_dir() -> Path:
    """The hfspec cache root: ``$HFSPEC_CACHE`` if set, else ``~/.cache/hfspec``."""
    env = os.environ.get("HFSPEC_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "hfspec"

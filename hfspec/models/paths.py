"""Where hfspec keeps what it fetches, builds and measures: ``$HFSPEC_CACHE``, else ``~/.cache/hfspec``.

It imports nothing but the standard library, so that ``hfspec cache`` lists the cache without loading torch.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["cache_dir"]


def cache_dir() -> Path:
    """The hfspec cache root: ``$HFSPEC_CACHE`` if set, else ``~/.cache/hfspec``."""
    env = os.environ.get("HFSPEC_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "hfspec"

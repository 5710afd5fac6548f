"""``hfspec.fast`` is :mod:`hfspec.cpu.fast`: ``import hfspec.fast`` and ``from hfspec import fast`` give that module
itself (one module object, so what is set on one is seen through the other)."""

from __future__ import annotations

import sys

from hfspec.cpu import fast

sys.modules[__name__] = fast

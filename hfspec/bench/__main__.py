"""``python -m hfspec.bench``: the same as ``hfspec bench``."""

from __future__ import annotations

import logging
import sys

from hfspec.bench.command import main

logging.basicConfig(level=logging.WARNING)
sys.exit(main())

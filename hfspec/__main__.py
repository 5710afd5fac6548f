"""``python -m hfspec``: the same as the ``hfspec`` command."""

from __future__ import annotations

import sys

from hfspec.cli import main

sys.exit(main())

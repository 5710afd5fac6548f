"""``python -m hfspec.training ...``: the ``hfspec distill`` command on its own."""

from hfspec.training.command import main

raise SystemExit(main())

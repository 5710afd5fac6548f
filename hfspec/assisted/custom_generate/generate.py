"""What transformers runs for ``model.generate(..., custom_generate=hfspec.CUSTOM_GENERATE, trust_remote_code=True)``.

transformers copies it into its cache of remote code and calls its ``generate(model, ...)`` with every argument of
the call; the code that runs is the installed hfspec's (``hfspec.assisted.run.generate``), so it is the same code,
tested and versioned with the package, whichever copy transformers holds.
"""

from hfspec.assisted.run import generate

__all__ = ["generate"]

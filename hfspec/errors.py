"""Errors hfspec raises for problems a user can fix.

Every check at a boundary (arguments, files, settings, the machine's setup) raises one of these, so that whoever
calls hfspec can tell a mistake to fix from a bug: the command line prints these as one line (exit status 2), and
anything else that escapes is shown with its traceback and a request to report it.
"""

from __future__ import annotations


class HfspecError(ValueError):
    """A problem with the user's input or setup; the message says what to do."""


class HfspecTypeError(HfspecError, TypeError):
    """An argument of the wrong type: a ``TypeError`` as well, as Python's own would be."""


class SetupError(HfspecError, RuntimeError):
    """Something this machine lacks that hfspec needs (pip, a package index): a ``RuntimeError`` as well."""


class NumericalFault(RuntimeError):
    """A model produced logits or probabilities that cannot be sampled from (NaN, inf)."""

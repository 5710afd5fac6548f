"""hfspec's version, in one place: ``hfspec.__version__``, ``hfspec --version`` and the package metadata
(``pyproject.toml`` reads it) all take it from here. No imports, so that reading it costs nothing."""

__version__ = "0.1.0"

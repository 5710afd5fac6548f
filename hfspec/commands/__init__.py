"""The command line's commands, one module each (``hfspec.cli`` builds the parser and runs them)."""

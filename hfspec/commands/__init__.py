"""The command line's commands, one module each (``hfspec.commands.cli`` builds the parser and runs them)."""

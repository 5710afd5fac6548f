"""``hfspec`` and ``python -m hfspec``: the command line's entry point.

``--version`` is answered here, before anything heavy is imported (torch and transformers take seconds); every
other command goes to :mod:`hfspec.commands.cli`.
"""

from __future__ import annotations

import sys

from hfspec._version import __version__

VERSION_LINE = f"hfspec {__version__}"


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args == ["--version"]:
        print(VERSION_LINE)
        return 0
    from hfspec.commands import cli  # imported only now: it pulls in torch and transformers (see the docstring)

    return cli.main(args)


if __name__ == "__main__":
    sys.exit(main())

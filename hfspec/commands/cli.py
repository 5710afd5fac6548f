"""The ``hfspec`` command line: ``generate``, plus ``distill`` and ``bench`` when installed.

Every user error (``hfspec.errors``: a bad flag, file, setting or setup) ends as one line ``hfspec: error: ...``
on stderr and exit status 2; anything else is a bug in hfspec (or below it) and shows its traceback, a line asking
for a report, and exit status 1. Ctrl-C ends with status 130 after printing what was already generated.

The parser is built from light modules only: torch and transformers are imported by the command that runs a
model, so ``--help`` and a bad flag answer at once. An optional command's module is imported only when that
command is the one run. Each command is a module of its own (``hfspec.commands.generate``, ``hfspec.commands.cache``,
the optional ones in ``OPTIONAL_COMMANDS``) with its flags and its run; ``hfspec.commands.common`` holds what they
share (the model flags, exit statuses).
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
import traceback
from importlib.util import find_spec
from typing import NoReturn

from hfspec import __version__
from hfspec.commands import cache, generate
from hfspec.commands.common import (
    EXIT_BUG,
    EXIT_INTERRUPTED,
    EXIT_USAGE,
    add_model_flags,
    load_kwargs,
    quiet_transformers,
)
from hfspec.errors import HfspecError, NumericalFault

__all__ = [
    "EXIT_BUG",
    "EXIT_INTERRUPTED",
    "EXIT_USAGE",
    "OPTIONAL_COMMANDS",
    "OPTIONAL_HELP",
    "USER_ERRORS",
    "add_model_flags",
    "build_parser",
    "main",
]

log = logging.getLogger(__name__)

# Errors a user can fix: hfspec's own, which its checks raise at every boundary (a model that gives NaN, memory
# that runs out included; torch's CUDA out-of-memory too, see _user_errors). Anything else is a bug and keeps its
# traceback: a ValueError from deep inside is no bad flag.
USER_ERRORS = (HfspecError, NumericalFault, MemoryError)
# Commands whose modules may be absent from an installation: command name -> module.
OPTIONAL_COMMANDS = {"distill": "hfspec.training", "bench": "hfspec.bench", "serve": "hfspec.serve.command"}
# Their line in 'hfspec --help', which lists them without importing their modules.
OPTIONAL_HELP = {
    "distill": "train a small draft model or an EAGLE-3 head for a target model",
    "bench": "measure hfspec against generate() and transformers assisted generation",
    "serve": "serve a pair over HTTP with OpenAI's API (chat, completions, streaming, metrics, a page)",
}
_load_kwargs = load_kwargs  # its name before it moved to hfspec.commands.common


class _Parser(argparse.ArgumentParser):
    """argparse that reports a bad flag in one line instead of usage plus message."""

    def error(self, message: str) -> NoReturn:
        _error(f"{message} (see '{self.prog} --help')")
        raise SystemExit(EXIT_USAGE)


def _error(message: str) -> None:
    lines = [line.strip() for line in str(message).splitlines() if line.strip()]
    sys.stderr.write(f"hfspec: error: {lines[0] if lines else 'unknown error'}\n")


# -- the parser ---------------------------------------------------------------------------------


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The command line's parser. The optional commands get their own flags only where ``command`` names them
    (their modules import torch); the others are listed by name and help line."""
    parser = _Parser(
        prog="hfspec",
        description="Lossless speculative decoding for Hugging Face causal language models: a small draft "
        "model proposes tokens, the target model verifies them in one pass, and the output is distributed "
        "exactly as the target's own sampling (greedy output is the target's own generate(), token for token, on "
        "hfspec's CPU kernels).",
        epilog="Run 'hfspec COMMAND --help' for the flags of a command.",
    )
    parser.add_argument("--version", action="version", version=f"hfspec {__version__}")
    parser.add_argument(
        "-v", "--verbose", action="store_true", help="log progress to stderr and show full tracebacks on errors"
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    generate.add_parser(sub)
    cache.add_parser(sub)
    for name in OPTIONAL_COMMANDS:
        if name == command:
            _add_optional(sub, name)
        elif find_spec(OPTIONAL_COMMANDS[name]) is not None:
            _add_listed(sub, name)
    return parser


def _add_optional(sub, name: str) -> None:
    """Register ``hfspec NAME`` from its module in :data:`OPTIONAL_COMMANDS` if it is there and imports."""
    try:
        module = importlib.import_module(OPTIONAL_COMMANDS[name])
    except ModuleNotFoundError as exc:
        if exc.name == OPTIONAL_COMMANDS[name]:
            return  # not part of this installation
        reason = f"it needs the missing package {exc.name!r}; install it with pip"
        _add_unavailable(sub, name, reason)
        return
    except Exception as exc:  # a broken optional command must not take the others down
        _add_unavailable(sub, name, f"{type(exc).__name__}: {exc}")
        return
    module.add_parser(sub)
    sub.choices[name].set_defaults(func=module.run)


def _add_listed(sub, name: str) -> None:
    """List ``hfspec NAME`` without importing its module; main builds the parser again with it when it runs."""
    p = sub.add_parser(name, help=OPTIONAL_HELP[name], add_help=False)
    p.set_defaults(accepts_extra=True)


def _add_unavailable(sub, name: str, reason: str) -> None:
    p = sub.add_parser(name, help=f"(unavailable: {reason})", add_help=False)
    p.set_defaults(accepts_extra=True)  # whatever flags follow, the answer is the same

    def unavailable(args: argparse.Namespace) -> int:
        raise HfspecError(f"'hfspec {name}' is unavailable: {reason}")

    p.set_defaults(func=unavailable)


# -- entry point ----------------------------------------------------------------------------------


def _user_errors() -> tuple[type[BaseException], ...]:
    """USER_ERRORS, and torch's CUDA out-of-memory where torch is imported (where it is not, none was raised)."""
    torch = sys.modules.get("torch")
    return USER_ERRORS if torch is None else (*USER_ERRORS, torch.cuda.OutOfMemoryError)


def main(argv: list[str] | None = None) -> int:
    """Run the command line; returns the exit status."""
    parser = build_parser()
    try:
        args, extra = parser.parse_known_args(argv)
        if args.command in OPTIONAL_COMMANDS:  # read again, with that command's own flags
            parser = build_parser(args.command)
            args, extra = parser.parse_known_args(argv)
        if extra and not getattr(args, "accepts_extra", False):
            where = f"hfspec {args.command}" if args.command else "hfspec"
            _error(f"unrecognized arguments: {' '.join(extra)} (see '{where} --help')")
            return EXIT_USAGE
    except SystemExit as exc:  # --help, --version, or a bad flag (already reported)
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE
    if args.command is None:
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="hfspec: %(levelname)s: %(message)s",
        stream=sys.stderr,
    )
    quiet_transformers(args.verbose)  # an optional command's module has imported it
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        sys.stderr.write("hfspec: interrupted\n")
        return EXIT_INTERRUPTED
    except _user_errors() as exc:
        if args.verbose:
            raise
        _error(str(exc) or type(exc).__name__)
        return EXIT_USAGE
    except Exception:
        traceback.print_exc()
        torch = sys.modules.get("torch")
        sys.stderr.write(
            f"hfspec: internal error (hfspec {__version__}, torch {torch.__version__ if torch else '-'}); this is a bug: "
            "please report it with the traceback above and the command that gave it\n"
        )
        return EXIT_BUG


if __name__ == "__main__":
    sys.exit(main())

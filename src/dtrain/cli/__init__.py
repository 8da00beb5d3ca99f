"""The ``dtrain`` command. One module per subcommand; argument parsing only, no training logic."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from ..errors import DtrainError

#: Subcommand modules, each with ``add_parser(subparsers)`` that sets ``func``.
COMMANDS = ("run", "train", "bench", "plan", "ckpt", "doctor", "submit", "report")


class Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line and exit status 2, and flags are never abbreviated."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> None:  # type: ignore[override]
        print(f"dtrain: error: {message}; see `{self.prog} --help`.", file=sys.stderr)
        sys.exit(2)


def build_parser() -> Parser:
    import importlib

    from .._version import __version__

    parser = Parser(prog="dtrain", description="Train PyTorch models on many processes and machines, and measure how.")
    parser.add_argument("--version", action="version", version=f"dtrain {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)
    sub.required = True
    for name in COMMANDS:
        importlib.import_module(f"{__name__}.{name}").add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except DtrainError as exc:
        print(f"dtrain: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("dtrain: interrupted.", file=sys.stderr)
        return 130

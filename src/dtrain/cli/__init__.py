"""The ``dtrain`` command. One module per subcommand; argument parsing only, no training logic."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from .._check import Parser
from ..errors import DtrainError

#: Subcommand modules, each with ``add_parser(subparsers)`` that sets ``func``.
COMMANDS = ("run", "train", "bench", "plan", "dryrun", "ckpt", "doctor", "submit", "report")


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

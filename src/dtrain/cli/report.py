"""`dtrain report RUN_DIR`: plots (loss, throughput, each rank's breakdown, memory) and a markdown summary of a run."""

from __future__ import annotations

import argparse


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("report", help="plot a run's metrics (PNG) and summarise it (markdown)", description=__doc__)
    p.add_argument("run_dir", metavar="RUN_DIR", help="folder with the run's metrics.jsonl (and result.json, if saved)")
    p.add_argument("--out", default=None, help="folder for the report (default RUN_DIR/report)")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    from .._log import configure_cli_logging
    from ..metrics.report import render

    configure_cli_logging(0)  # its warnings (lines left out) as dtrain: lines
    paths = render(args.run_dir, args.out)
    print(paths["markdown"])
    return 0

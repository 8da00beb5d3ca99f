"""``--parallel LAYOUT`` for `dtrain train`, `dtrain run` (handed to the workers as
``$DTRAIN_PARALLEL``, which ``dtrain.init`` reads) and `dtrain bench`."""

from __future__ import annotations

import argparse

from ..options import hand_over
from ..parallel import parse

HELP = ("how ranks split, e.g. dp_shard=2,tp=2 (names: dp_replicate, dp_shard, tp, pp; their product is the "
        "number of processes); replaces --strategy. dtrain train also takes auto: the layout `dtrain plan` picks for this node")


def add_parallel_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--parallel", default=None, metavar="LAYOUT", help=HELP)


def export_parallel(args: argparse.Namespace, world_size: int) -> None:
    """`dtrain run`: check the layout against ``world_size`` here (one line before any worker
    starts; `dtrain train` checks its own in ``ParallelConfig``), then hand it to the workers."""
    if getattr(args, "parallel", None) is None:
        return
    dims = parse(args.parallel)
    dims.check_world(world_size)
    hand_over(layout={"parallel": str(dims)})

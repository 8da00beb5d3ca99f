"""The flags of ``dtrain train`` that say what to observe: the step breakdown, stragglers."""

from __future__ import annotations

import argparse
from typing import Any


def add_observe_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("observing the run")
    g.add_argument("--no-breakdown", dest="breakdown", action="store_false",
                   help="do not time each step's phases (data wait, forward, backward, exposed communication, optimizer)")
    g.add_argument("--tensorboard", default=None, metavar="DIR",
                   help="write TensorBoard event files here: loss, lr, samples/s, each rank's breakdown and memory, bytes communicated")
    g.add_argument("--trace", default=None, metavar="START:END",
                   help="write steps START to END-1 of every rank as one Chrome/Perfetto trace JSON, on rank 0's clock")
    g.add_argument("--trace-file", default=None, metavar="PATH", help="where --trace writes (default dtrain-trace.json)")
    g.add_argument("--straggler-window", type=int, default=None, metavar="STEPS",
                   help="steps compared across ranks to name a straggler (default 50; checked at log intervals)")
    g.add_argument("--straggler-threshold", type=float, default=None, metavar="RATIO",
                   help="name a rank whose own step time is this many times the others' median (default 1.3)")


def observe_options(args: argparse.Namespace) -> dict[str, Any]:
    """ObserveConfig fields from the flags (the straggler settings validate themselves). A flag
    that another one makes do nothing is refused here, rather than ignored."""
    from ..errors import ConfigError
    from ..metrics.stragglers import StragglerConfig

    if args.trace_file is not None and args.trace is None:
        raise ConfigError(f"--trace-file {args.trace_file} without --trace writes nothing; add --trace START:END "
                          "(e.g. --trace 20:25), or drop --trace-file.")
    given = [f for f, v in (("--straggler-window", args.straggler_window), ("--straggler-threshold", args.straggler_threshold))
             if v is not None]
    if given and not args.breakdown:
        raise ConfigError(f"{' and '.join(given)} with --no-breakdown: straggler detection reads the step breakdown, "
                          "which --no-breakdown turns off; drop one or the other.")
    defaults = StragglerConfig()
    stragglers = StragglerConfig(window=defaults.window if args.straggler_window is None else args.straggler_window,
                                 threshold=defaults.threshold if args.straggler_threshold is None else args.straggler_threshold)
    return {"breakdown": args.breakdown, "tensorboard": args.tensorboard, "trace": args.trace,
            "trace_file": "dtrain-trace.json" if args.trace_file is None else args.trace_file, "stragglers": stragglers}

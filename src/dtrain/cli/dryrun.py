"""`dtrain dry-run`: check a configuration for a large world before booking it: one of its ranks
runs for real on this machine, torch's fake process group stands in for the others; prints its
peak memory, whether it fits, and the collectives of a step, with `dtrain plan`'s prediction."""

from __future__ import annotations

import argparse
import json

from .. import _check as check
from .._log import configure_cli_logging
from ..errors import ConfigError
from ..train.config import BatchConfig, OptimConfig, ParallelConfig, RuntimeConfig, TaskConfig
from .common import parse_nnodes
from .parallel import add_parallel_arg
from .sharding import add_sharding_args, strategy_options
from .train import add_task_args, parse_task_args


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("dry-run", help="run one rank of a large world here, with a fake process group for the rest",
                       description=__doc__)
    g = p.add_argument_group("what to train (as dtrain train)")
    add_task_args(g)
    g.add_argument("--lr", type=float, default=None, help="learning rate (default: the task's)")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--compile", action="store_true", help="torch.compile the model, as dtrain train --compile")
    w = p.add_argument_group("the world it is meant for")
    w.add_argument("-n", "--nproc", type=int, default=1, metavar="NPROC", help="processes per node (default 1)")
    w.add_argument("--nnodes", default="1", metavar="N", help="nodes (default 1); the world is -n x --nnodes")
    w.add_argument("--strategy", default="auto", help="ddp, zero1, fsdp or hsdp (default: ddp on several processes)")
    add_parallel_arg(w)
    r = p.add_argument_group("the dry run")
    r.add_argument("--rank", type=int, default=0, help="the rank run here (default 0)")
    r.add_argument("--steps", type=int, default=3, help="training steps: forward, backward, optimizer (default 3)")
    r.add_argument("--device", default=None, help="cpu or cuda: this machine's device the rank runs on (default: cuda when available)")
    r.add_argument("--device-memory", type=float, default=None, metavar="GIB",
                   help="memory of the device the world will run on, GiB (default: this device's)")
    r.add_argument("--no-predict", action="store_true", help="leave out dtrain plan's memory prediction")
    r.add_argument("--json", action="store_true", help="print the result as one JSON object")
    r.add_argument("-v", "--verbose", action="store_true", help="show dtrain's log")
    add_sharding_args(p)
    p.set_defaults(func=main)


def config_from_args(args: argparse.Namespace):  # -> DryRunConfig (imported late: torch's distributed modules)
    from ..dryrun import DryRunConfig
    from ..dryrun.config import GIB

    nnodes, max_nodes = parse_nnodes(args.nnodes)
    if max_nodes is not None:
        raise ConfigError(f"--nnodes {args.nnodes}: a dry run checks a fixed world; give a number of nodes (e.g. --nnodes {max_nodes}).")
    check.integer("--nnodes", nnodes, minimum=1)
    check.integer("-n", args.nproc, minimum=1)
    memory = None if args.device_memory is None else check.number("--device-memory (GiB)", args.device_memory, positive=True) * GIB
    return DryRunConfig(
        task=TaskConfig(name=args.task, args=parse_task_args(args.task_arg), data_dir=args.data_dir),
        batch=BatchConfig(size=args.batch_size, grad_accum=args.grad_accum),
        optim=OptimConfig(name=args.optimizer, lr=args.lr),
        parallel=ParallelConfig(strategy=args.strategy, strategy_options=strategy_options(args), layout=args.parallel),
        runtime=RuntimeConfig(device=args.device, precision=args.precision or "fp32", compile=args.compile,
                              activation_checkpointing=args.activation_checkpointing),
        world_size=args.nproc * nnodes, local_size=args.nproc, rank=args.rank, steps=args.steps,
        device_memory=memory, seed=args.seed,
    )


def main(args: argparse.Namespace) -> int:
    configure_cli_logging(0, verbose=args.verbose)
    cfg = config_from_args(args)
    from ..dryrun import dry_run, lines

    rec = dry_run(cfg, with_prediction=not args.no_predict)
    if args.json:
        print(json.dumps(rec), flush=True)
    else:
        print("\n".join(lines(rec)), flush=True)
    return 0 if rec["fits"] else 1

"""`dtrain run [-n NPROC] [node flags] script.py [ARGS...]`: start a script on N processes."""

from __future__ import annotations

import argparse
import os

from .._log import configure_cli_logging
from ..errors import ConfigError
from ..launch import launch_script
from ..launch.runner import run_script
from .parallel import add_parallel_arg, export_parallel
from .common import add_comm_args, add_launch_args, export_comm, export_diagnostics, launch_spec, slurm_step


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("run", help="run a training script on N processes (torchrun or spawn)", description=__doc__)
    add_launch_args(p)
    add_comm_args(p)
    add_parallel_arg(p)
    p.add_argument("script", help="the Python script every worker runs")
    p.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the script")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    configure_cli_logging(0, verbose=args.verbose)
    export_comm(args)
    if not os.path.isfile(args.script):
        raise ConfigError(f"script {args.script} does not exist; give the path of the training script to run.")
    step = slurm_step(args)
    if step is not None and step.ntasks > 1 and args.nproc is None:
        # `srun -n 8 dtrain run train.py`: one task per process; this task is the worker and
        # dtrain.init() reads its rank from SLURM (as under `srun python train.py`).
        export_diagnostics(args)
        export_parallel(args, step.ntasks)
        run_script(args.script, list(args.args))
        return 0
    spec = launch_spec(args)
    export_parallel(args, spec.world_size)
    return launch_script(spec, args.script, list(args.args))

"""`dtrain run [-n NPROC] [node flags] script.py [ARGS...]`: start a script on N processes."""

from __future__ import annotations

import argparse
import os
import sys

from .._log import configure_cli_logging
from ..errors import ConfigError
from ..launch import launch_script
from ..launch.preflight import check_ranks_fit
from ..launch.runner import run_script
from .parallel import add_parallel_arg, export_parallel
from .common import add_comm_args, add_launch_args, export_comm, export_diagnostics, launch_spec, slurm_step


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("run", help="run a training script on N processes (torchrun or spawn)", description=__doc__)
    add_launch_args(p)
    add_comm_args(p)
    add_parallel_arg(p)
    p.add_argument("--local-rank-arg", nargs="?", const="--local_rank", default=None, metavar="FLAG",
                   help="pass --local_rank=N to the script as torch.distributed.launch did (FLAG: the spelling, "
                        "default --local_rank; 'none': never; default: when the script declares it)")
    p.add_argument("script", help="the Python script every worker runs")
    p.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the script")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    configure_cli_logging(0, verbose=args.verbose)
    export_comm(args)
    if not os.path.isfile(args.script):
        raise ConfigError(f"script {args.script} does not exist; give the path of the training script to run.")
    _local_rank_arg(args)
    step = slurm_step(args)
    if step is not None and step.ntasks > 1 and args.nproc is None:
        # `srun -n 8 dtrain run train.py`: one task per process; this task is the worker and
        # dtrain.init() reads its rank from SLURM (as under `srun python train.py`).
        export_diagnostics(args)
        export_parallel(args, step.ntasks)
        run_script(args.script, list(args.args))
        return 0
    spec = launch_spec(args)
    # dtrain.init puts each rank on the GPU of its local rank when there is one.
    check_ranks_fit(spec.nproc, cpu_fix="CUDA_VISIBLE_DEVICES= (no GPU: dtrain.init then uses the CPU)")
    export_parallel(args, spec.world_size)
    return launch_script(spec, args.script, list(args.args))


def _local_rank_arg(args: argparse.Namespace) -> None:
    """Hand --local_rank=N to the workers (launch/dropin.py) when asked, or when the script declares it."""
    from ..launch.dropin import ENV_FLAG, declared_local_rank_flag

    flag = args.local_rank_arg
    if flag is None:
        flag = declared_local_rank_flag(args.script)
        if flag is not None:
            print(f"dtrain: {args.script} declares {flag} (torch.distributed.launch style); passing {flag}=N to "
                  "each worker (--local-rank-arg none: don't)", file=sys.stderr)
    if flag is not None and flag != "none":
        if not flag.startswith("--"):
            raise ConfigError(f"--local-rank-arg {flag!r} is not an option name; give e.g. --local_rank or --local-rank, or none.")
        os.environ[ENV_FLAG] = flag

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
from ..options import hand_over
from .common import add_comm_args, add_launch_args, export_comm, export_diagnostics, launch_spec, slurm_step
from .parallel import add_parallel_arg, export_parallel
from .train_ft import add_ft_args, refuse_without_ft


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("run", help="run a training script on N processes (torchrun or spawn)", description=__doc__)
    add_launch_args(p)
    add_comm_args(p)
    add_parallel_arg(p)
    add_ft_args(p)  # each replica group runs the script; dtrain.init(fault_tolerance=True) joins the job
    p.add_argument("--local-rank-arg", nargs="?", const="--local_rank", default=None, metavar="FLAG", type=_flag_spelling,
                   help="pass --local_rank=N to the script as torch.distributed.launch did (FLAG, written with '=': the "
                        "spelling, e.g. --local-rank-arg=--local-rank, default --local_rank; =none: never; default: when "
                        "the script declares it)")
    p.add_argument("script", help="the Python script every worker runs")
    p.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the script")
    p.set_defaults(func=main)


def _flag_spelling(value: str) -> str:
    """``--local-rank-arg``'s value: ``none`` or an option name. A FLAG starts with '-', so it only
    arrives written with '=' (--local-rank-arg=--local-rank); anything else is the next word of
    the command line taken by mistake, most often the script's path."""
    if value == "none" or value.startswith("--"):
        return value
    raise argparse.ArgumentTypeError(
        f"{value!r} is not an option name (--local-rank-arg took the word after it; is it the script?); "
        "give the spelling with '=' (--local-rank-arg=--local_rank, --local-rank-arg=none), "
        "or put --local-rank-arg after another flag, not right before the script")


def main(args: argparse.Namespace) -> int:
    configure_cli_logging(0, verbose=args.verbose)
    if not os.path.isfile(args.script):
        raise ConfigError(f"script {args.script} does not exist; give the path of the training script to run.")
    if args.fault_tolerance is not None:  # before --comm is handed over: it refuses the flags a group would ignore
        from .train_ft import start_script

        return start_script(args)
    refuse_without_ft(args)
    export_comm(args)
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
    code = launch_script(spec, args.script, list(args.args))
    _explain_local_rank_refusal(args, code)
    return code


def _explain_local_rank_refusal(args: argparse.Namespace, code: int) -> None:
    """The workers failed, the script declares --local_rank and --local-rank-arg=none kept it from
    them: the script's own argparse error (from every rank) is likely about that; say so."""
    from ..launch.dropin import declared_local_rank_flag

    if code == 0 or args.local_rank_arg != "none":
        return
    flag = declared_local_rank_flag(args.script)
    if flag is None:
        return
    why = (f"the script declares {flag}, which --local-rank-arg none keeps from the workers: if it requires {flag}, "
           f"drop --local-rank-arg none (or give --local-rank-arg={flag})")
    if code == 2:  # argparse's status: the workers printed only their usage error, dtrain nothing yet
        raise ConfigError(f"the workers of {args.script} stopped with a usage error (status 2); {why}.")
    print(f"dtrain: note: {why}.", file=sys.stderr)  # after the launcher's own error line


def _local_rank_arg(args: argparse.Namespace) -> None:
    """Hand --local_rank=N to the workers (launch/dropin.py) when asked, or when the script declares it."""
    from ..launch.dropin import declared_local_rank_flag

    flag = args.local_rank_arg
    if flag is None:
        flag = declared_local_rank_flag(args.script)
        if flag is not None:
            print(f"dtrain: {args.script} declares {flag} (torch.distributed.launch style); passing {flag}=N to "
                  "each worker (--local-rank-arg none: don't)", file=sys.stderr)
    if flag is not None and flag != "none":
        hand_over(link={"local_rank_arg": flag})

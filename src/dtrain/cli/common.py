"""Flags shared by the subcommands that start workers (`run`, `train`)."""

from __future__ import annotations

import argparse
import os

from .. import _check as check
from ..errors import ConfigError
from ..launch import LaunchSpec
from ..launch.srun import spec_for_step
from ..options import hand_over
from ..world.reach import check_not_wildcard
from ..world.slurm import SlurmStep


def add_launch_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("where to run")
    g.add_argument("-n", "--nproc", type=int, default=None, metavar="NPROC", help="worker processes on this node (default 1)")
    g.add_argument("--nnodes", default=None, metavar="N|MIN:MAX",
                   help="number of nodes (default 1; under srun: the step's tasks); MIN:MAX: nodes may leave and join "
                        "(c10d rendezvous on --master-addr, the first node, which must stay up)")
    g.add_argument("--node-rank", type=int, default=None, help="index of this node, 0..nnodes-1 (default 0; under srun: the task's index)")
    g.add_argument("--master-addr", default=None, help="address of node 0 (default 127.0.0.1 on one node)")
    g.add_argument("--master-port", type=int, default=None, help="rendezvous port (default: a free port on one node, 29500 on several)")
    g.add_argument("--local-addr", default=None, metavar="ADDR",
                   help="this node's address as the other nodes reach it (default: the address of the interface that "
                        "routes to --master-addr; never what the host name resolves to)")
    g.add_argument("--startup-timeout", type=_bound_arg, default=120.0, metavar="SECONDS",
                   help="bound on each start-up wait: waiting for the other nodes, store connect, process-group init, "
                        "first collective (default 120; at least 1)")
    g.add_argument("--launcher", default="torchrun",
                   help="torchrun (torch's elastic agent, default), spawn (torch.multiprocessing.spawn) or ray (a Ray cluster "
                        "places the workers: -n per node, --nnodes nodes; docs/ray.md)")
    g.add_argument("--ray-address", default=None, metavar="HOST:PORT|auto|local",
                   help="--launcher ray: the cluster's head (default: RAY_ADDRESS, else the cluster running on this machine; "
                        "local: start one for this job)")
    g.add_argument("--max-restarts", type=int, default=None,
                   help="restart failed workers up to K times (torchrun launcher; default 0, with --nnodes MIN:MAX 10)")
    g.add_argument("--rdzv-id", default="dtrain", help="with --nnodes MIN:MAX: the job's name in the rendezvous (default dtrain)")
    g.add_argument("--rdzv-timeout", type=_bound_arg, default=None, metavar="SECONDS",
                   help="with --nnodes MIN:MAX: how long a rendezvous waits for MIN nodes (default: --startup-timeout)")
    g.add_argument("--rdzv-last-call", type=float, default=5.0, metavar="SECONDS",
                   help="with --nnodes MIN:MAX: once MIN nodes are in, how long to wait for more (default 5)")
    g.add_argument("-v", "--verbose", action="store_true", help="show the launcher's own log")
    d = parser.add_argument_group("diagnostics")
    d.add_argument("--stall-timeout", type=float, default=None, metavar="SECONDS",
                   help="report and stop the job when a rank makes no progress this long (default 900; 0: off)")
    d.add_argument("--debug", action="store_true", help="check every dtrain collective across ranks (slower)")
    d.add_argument("--run-dir", default=None, help="where stall reports and stack dumps go (default ./dtrain-run)")


def _bound_arg(text: str) -> float:
    """--startup-timeout, --rdzv-timeout: refused while the arguments are read, before anything
    starts (see ``check.startup_seconds``)."""
    try:
        return check.startup_seconds("it", float(text))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds; give e.g. 120 (the default)") from None
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc).rstrip(".")) from None


def add_comm_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("communication (ddp)")
    g.add_argument("--comm", default=None, metavar="METHOD",
                   help="how gradients travel: none (all-reduce, default), fp16, bf16, powersgd[:RANK], localsgd[:H], auto")
    g.add_argument("--comm-warmup", type=int, default=None, metavar="STEPS",
                   help="plain all-reduce steps before compression / local steps start (default 10; auto: 8, it measures during them: 2 plain, then PowerSGD)")


def export_comm(args: argparse.Namespace) -> None:
    """Hand --comm to the workers of `dtrain run` (dtrain.init reads $DTRAIN_COMM); checked here first."""
    from ..comm import CommSpec

    spec = CommSpec.parse(args.comm, warmup=args.comm_warmup)
    given = {"method": str(spec)} if args.comm is not None else {}
    if args.comm_warmup is not None:
        given["warmup"] = spec.warmup
    hand_over(comm=given)


def export_diagnostics(args: argparse.Namespace) -> None:
    """Hand the diagnostics flags to the workers (they inherit this environment)."""
    given: dict[str, object] = {}
    if args.stall_timeout is not None:
        check.number("--stall-timeout (seconds; 0 turns the watchdog off)", args.stall_timeout)
        given["stall_timeout"] = args.stall_timeout
    if args.debug:
        given["debug"] = True
    if args.run_dir:
        check.output_dir("--run-dir", args.run_dir)
        given["run_dir"] = os.path.abspath(args.run_dir)
    hand_over(diag=given)


def slurm_step(args: argparse.Namespace) -> SlurmStep | None:
    """The srun step this command runs as a task of, unless the node flags say where it runs."""
    if any(v is not None for v in (args.nnodes, args.node_rank, args.master_addr)):
        return None
    return SlurmStep.from_env()


def launch_spec(args: argparse.Namespace) -> LaunchSpec:
    export_diagnostics(args)
    check.number("--rdzv-last-call", args.rdzv_last_call)
    if args.master_addr is not None:
        check.host("--master-addr", args.master_addr)
    if args.local_addr is not None:
        check.host("--local-addr", args.local_addr)
        check_not_wildcard("--local-addr", args.local_addr)
    # --startup-timeout and --rdzv-timeout (None: --startup-timeout) were checked as they were read (_bound_arg).
    startup = args.startup_timeout
    hand_over(startup={"timeout": startup})
    nproc = 1 if args.nproc is None else args.nproc
    nnodes, max_nodes = parse_nnodes(args.nnodes)
    restarts = args.max_restarts if args.max_restarts is not None else (ELASTIC_RESTARTS if max_nodes is not None else 0)
    step = slurm_step(args)
    if step is not None:
        return spec_for_step(step, nproc=nproc, master_port=args.master_port,
                             launcher=args.launcher, max_restarts=restarts)
    return LaunchSpec(
        nproc=nproc,
        nnodes=nnodes,
        node_rank=0 if args.node_rank is None else args.node_rank,
        master_addr=args.master_addr,
        master_port=args.master_port,
        launcher=args.launcher,
        max_restarts=restarts,
        max_nodes=max_nodes,
        rdzv_id=args.rdzv_id,
        join_timeout=startup if args.rdzv_timeout is None else args.rdzv_timeout,
        local_addr=args.local_addr,
        startup_timeout=startup,
        last_call_s=args.rdzv_last_call,
        ray_address=args.ray_address,
    )


#: With --nnodes MIN:MAX, each node lost costs the survivors one restart (their collectives fail).
ELASTIC_RESTARTS = 10


def parse_nnodes(text: str | None) -> tuple[int, int | None]:
    """``--nnodes``: N (a fixed set of nodes) or MIN:MAX (elastic); returns (MIN, MAX or None)."""
    if text is None:
        return 1, None
    lo, sep, hi = str(text).partition(":")
    try:
        return (int(lo), int(hi)) if sep else (int(lo), None)
    except ValueError:
        raise ConfigError(f"--nnodes {text!r} is not a number of nodes or MIN:MAX; write e.g. --nnodes 2 or --nnodes 1:3.") from None

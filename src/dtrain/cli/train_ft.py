"""`dtrain train --fault-tolerance`: the flags of a fault-tolerant job (dtrain.ft) and its start."""

from __future__ import annotations

import argparse
from typing import Any

from ..errors import ConfigError
from ..train.config import TrainConfig
from .common import add_launch_args, parse_nnodes


def add_ft_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("fault tolerance (torchft; pip install 'dtrain[ft]')")
    g.add_argument("--fault-tolerance", nargs="?", const="", default=None, metavar="min=M,...",
                   help="per-step fault tolerance: replica groups (one process each, --nproc N per node; with --strategy fsdp or --parallel "
                        "one group of the node's N processes) that go on when "
                        "one is lost and heal one that comes back from a live peer; min=M: the fewest replica groups that "
                        "may step (default 1); also heartbeat=S, join=S, timeout=S, step-timeout=S (docs/fault-tolerance.md)")
    g.add_argument("--lighthouse", default=None, metavar="HOST:PORT",
                   help="with --fault-tolerance: join this running Lighthouse (default: start one on node 0, port 29510 on several nodes)")
    g.add_argument("--replica-id", default=None, metavar="ID",
                   help="with --fault-tolerance: this node's replica group name (default: the node rank); keep it when restarting one")


def refuse_without_ft(args: argparse.Namespace) -> None:
    """``--lighthouse`` and ``--replica-id`` name a fault-tolerant job's parts: without ``--fault-tolerance``
    nothing reads them."""
    for flag, value in (("--lighthouse", args.lighthouse), ("--replica-id", args.replica_id)):
        if value is not None:
            raise ConfigError(f"{flag} {value} applies to a fault-tolerant job only; add --fault-tolerance, or drop {flag}.")


def start(cfg: TrainConfig, args: argparse.Namespace) -> int:
    """Start this node's part of a fault-tolerant job; returns the exit status."""
    from ..ft import FaultTolerance
    from ..train.ft_check import group_size, preflight, refuse_unsupported
    from ..train.ft_groups import TrainGroups

    ft = FaultTolerance.parse(args.fault_tolerance)
    refuse_unsupported(cfg, args.elastic_batch)
    _refuse_launch_flags(args)
    groups = TrainGroups(cfg, ft, group_size(cfg, args.nproc or 1))
    preflight(cfg)  # what every group's processes would refuse at their start: one line, before any starts
    return _start(ft, groups, args)


def start_script(args: argparse.Namespace) -> int:
    """``dtrain run --fault-tolerance script.py``: each replica group runs the script (``dtrain.init`` joins the job)."""
    from ..ft import FaultTolerance
    from ..ft.launch import ScriptGroups
    from ..train.ft_check import refuse_given

    ft = FaultTolerance.parse(args.fault_tolerance)
    script_flags = [("--comm", args.comm, "a script's replica group is one process and runs no DDP, whose gradient hooks --comm "
                     "sets (the groups average their gradients with torchft's all-reduce, uncompressed)"),
                    ("--comm-warmup", args.comm_warmup, "it goes with --comm"),
                    ("--parallel", args.parallel, "a script's replica group is one process (--parallel applies to dtrain train's "
                     "groups)"),
                    ("--local-rank-arg", args.local_rank_arg, "a script's replica group is one process, of local rank 0")]
    refuse_given(script_flags)
    _refuse_launch_flags(args)
    return _start(ft, ScriptGroups(ft, args.script, list(args.args)), args)


def _refuse_launch_flags(args: argparse.Namespace) -> None:
    """The launch and diagnostics flags a fault-tolerant job has no part for (its groups meet at the
    Lighthouse, not in a rendezvous): one line each, not ignored. A flag counts as given where it
    differs from its default, as ``add_launch_args`` declares it."""
    from ..train.ft_check import refuse_given

    declared = argparse.ArgumentParser(add_help=False)
    add_launch_args(declared)

    def given(dest: str) -> Any:
        value = getattr(args, dest)
        return None if value == declared.get_default(dest) else value

    rendezvous = "the replica groups meet at the Lighthouse (--lighthouse HOST:PORT, or node 0's at --master-addr), not in a rendezvous"
    refuse_given([
        ("--master-port", given("master_port"), rendezvous), ("--local-addr", given("local_addr"), rendezvous),
        ("--startup-timeout", given("startup_timeout"), rendezvous + "; a group waits `timeout` for a quorum "
         "(--fault-tolerance timeout=S)"),
        ("--rdzv-id", given("rdzv_id"), rendezvous), ("--rdzv-timeout", given("rdzv_timeout"), rendezvous),
        ("--rdzv-last-call", given("rdzv_last_call"), rendezvous),
        ("--launcher", given("launcher"), "dtrain starts and restarts the replica groups itself"),
        ("--ray-address", given("ray_address"), "dtrain starts and restarts the replica groups itself"),
        ("--stall-timeout", given("stall_timeout"), "a replica group's steps are bounded by --fault-tolerance step-timeout=S"),
        ("--debug", given("debug"), "the replica groups run no collective checker"),
        ("--run-dir", given("run_dir"), "the replica groups write no stall reports"),
    ])


def _start(ft: Any, groups: Any, args: argparse.Namespace) -> int:
    from ..ft import start as ft_start

    nnodes, max_nodes = parse_nnodes(args.nnodes)
    if max_nodes is not None:
        raise ConfigError(f"--fault-tolerance with --nnodes {args.nnodes}: replica groups come and go without a rendezvous; "
                          "give --nnodes N (the nodes started with the job) and restart lost ones with the same --replica-id.")
    if nnodes > 1 and args.master_addr is None and args.lighthouse is None:
        raise ConfigError(f"--fault-tolerance --nnodes {nnodes} needs --master-addr (node 0, where the Lighthouse runs) or --lighthouse HOST:PORT.")
    return ft_start(ft, groups, nproc=args.nproc or 1, nnodes=nnodes, node_rank=args.node_rank or 0, master_addr=args.master_addr,
                    lighthouse=args.lighthouse, replica_id=args.replica_id, max_restarts=args.max_restarts or 0)

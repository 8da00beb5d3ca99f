"""`dtrain doctor`: preflight checks, one line each; `dtrain env`: versions for a bug report."""

from __future__ import annotations

import argparse

from .. import _check as check
from ..errors import ConfigError
from ..launch.lifecycle import exit_now
from . import doctor_probe
from .doctor_checks import DoctorConfig, environment_report, run_doctor


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("doctor", help="check this machine (and the nodes of a job) before training", description=__doc__)
    p.add_argument("--nnodes", type=int, default=1, help="nodes of the job (run the doctor on each)")
    p.add_argument("--node-rank", type=int, default=0, help="index of this node")
    p.add_argument("--master-addr", default=None, help="address of node 0 (default 127.0.0.1 on one node)")
    p.add_argument("--master-port", type=int, default=None, help="rendezvous port")
    p.add_argument("--no-probe", action="store_true", help="skip the all-reduce probe")
    p.add_argument("--timeout", type=float, default=30.0, help="seconds to wait for the other nodes (default 30)")
    p.add_argument("--links-out", default=None, metavar="JSON", help="also time all-gather, reduce-scatter, broadcast and "
                   "send/recv at a few sizes and write every collective's times here, for `dtrain plan --links` (node 0 writes)")
    p.set_defaults(func=main)
    e = sub.add_parser("env", help="print versions and distributed settings (paste into a bug report)")
    e.set_defaults(func=env_main)


def main(args: argparse.Namespace) -> int:
    if args.nnodes < 1 or not 0 <= args.node_rank < args.nnodes:
        raise ConfigError(f"--node-rank {args.node_rank} must be in 0..{args.nnodes - 1} for --nnodes {args.nnodes}.")
    if args.nnodes > 1 and not args.master_addr:
        raise ConfigError(f"--nnodes {args.nnodes} needs --master-addr, the address of node 0.")
    if args.nnodes > 1 and args.master_port is None:
        raise ConfigError("--nnodes > 1 needs --master-port, the rendezvous port every node uses.")
    if args.master_port is not None and not 0 < args.master_port < 65536:
        raise ConfigError(f"--master-port {args.master_port} is not a TCP port; use 1024..65535.")
    check.seconds("--timeout", args.timeout)
    if args.master_addr is not None:
        check.host("--master-addr", args.master_addr)
    if args.links_out is not None and args.no_probe:
        raise ConfigError("--links-out measures in the probe, which --no-probe skips; drop one of them.")
    if args.links_out is not None and args.node_rank == 0:  # node 0 writes it, after minutes of probing: one line now, not a traceback then
        check.output_file("--links-out", args.links_out)
    cfg = DoctorConfig(nnodes=args.nnodes, node_rank=args.node_rank, master_addr=args.master_addr,
                       master_port=args.master_port, probe=not args.no_probe, timeout_s=args.timeout, links_out=args.links_out)
    checks = run_doctor(cfg, echo=lambda line: print(line, flush=True))
    failed = [c.name for c in checks if c.status == "FAIL"]
    print(f"\n{len(checks)} checks: " + (f"{len(failed)} failed ({', '.join(failed)})" if failed else "all passed"))
    if doctor_probe.abandoned_probe:  # a probe thread still in gloo's connect: leave without finalizing
        exit_now(1)
    return 1 if failed else 0


def env_main(args: argparse.Namespace) -> int:
    print(environment_report())
    return 0

"""`dtrain plan`: predict step time, throughput, scaling efficiency and memory per rank of every
layout x comm method for your task on a cluster you describe (or this machine, profiled), and
name the fastest that fits. Nothing is trained; see docs/plan.md."""

from __future__ import annotations

import argparse
import dataclasses

from .. import _check as check
from ..errors import ConfigError
from .common import parse_nnodes
from .train import add_task_args, parse_task_args


def add_parser(sub: argparse._SubParsersAction) -> None:
    from ..strategies.pipeline import PipelineConfig

    p = sub.add_parser("plan", help="predict speed and memory of each layout at any scale, and pick one", description=__doc__)
    g = p.add_argument_group("what to train (as `dtrain train`)")
    add_task_args(g)
    w = p.add_argument_group("where (the job you plan)")
    w.add_argument("-n", "--nproc", type=int, default=None, metavar="NPROC", help="processes (GPUs) per node (default 1)")
    w.add_argument("--nnodes", default=None, metavar="N", help="number of nodes (default 1)")
    c = p.add_argument_group("the cluster (a preset, a file, flags; flags win)")
    c.add_argument("--cluster", default=None, metavar="FILE", help="JSON (or YAML) with keys such as device, nodes, procs_per_node, "
                   "peak_tflops, memory_gib, achieved_fraction, intra_gbit, inter_gbit, intra_latency_us, inter_latency_us")
    c.add_argument("--device", default=None, help="h100, h200, a100, a100-40, v100, p100 (from FLOPs x --mfu), cuda (this machine's GPU, its step "
                   "timed here), or cpu (default: cpu, profiled here)")
    c.add_argument("--peak-tflops", type=float, default=None, help="the device's peak TFLOP/s at --precision")
    c.add_argument("--mfu", type=float, default=None, metavar="FRACTION", help="achieved fraction of the peak (default 0.4; cpu: measured)")
    c.add_argument("--mem-gib", type=float, default=None, help="memory per device, GiB")
    c.add_argument("--intra-gbit", type=float, default=None, help="bandwidth between two processes of a node, Gbit/s one way")
    c.add_argument("--intra-latency-us", type=float, default=None)
    c.add_argument("--inter-gbit", type=float, default=None, help="what one node sends to the others, Gbit/s (all its NICs); "
                   "`dtrain doctor` on two nodes prints the bus bandwidth in GB/s: x8")
    c.add_argument("--inter-latency-us", type=float, default=None, help="per message between nodes (`dtrain doctor`'s all-reduce latency / 2)")
    c.add_argument("--shared-cores", type=int, default=None, help="all processes share this many cores (a test bed on one machine)")
    c.add_argument("--links", action="append", default=[], metavar="JSON", help="collectives measured by `dtrain doctor --links-out` "
                   "(between nodes: the figures between nodes; between local processes: inside a node); repeatable")
    c.add_argument("--measure-links", action="store_true", help="time the collectives between 2 processes on this machine "
                   "now, for the figures inside a node (a few seconds)")
    o = p.add_argument_group("what to compare, and the output")
    o.add_argument("--comm-methods", default="none,bf16,powersgd:2,localsgd:16", metavar="LIST", help="--comm methods tried on ddp")
    o.add_argument("--layouts", default=None, metavar="LIST", help="only these layouts, ';'-separated as `dtrain train` takes them "
                   "(e.g. 'ddp;fsdp;dp_shard=4,tp=2')")
    o.add_argument("--microbatches", type=int, default=PipelineConfig.microbatches, help="pipeline micro-batches (as dtrain train)")
    o.add_argument("--log-every", type=int, default=20, metavar="N", help="as dtrain train: each log step's collectives "
                   "(the loss, the preemption check, the breakdown) cost their latency every N steps")
    o.add_argument("--pipeline-schedule", default=PipelineConfig.schedule, choices=("gpipe", "1f1b"))
    o.add_argument("--profile-threads", type=int, default=None, metavar="N",
                   help="torch threads while timing the model here (default: this machine's cores / processes per node)")
    o.add_argument("--profile-seconds", type=float, default=10.0, metavar="S", help="seconds of steps when timing each layout's "
                   "own CPU cost in a world of one process (cpu; default 10)")
    o.add_argument("--no-layout-profile", action="store_true", help="cpu: time only the plain step, not each layout's machinery "
                   "(faster; the layouts' own CPU costs are then left out)")
    o.add_argument("--margin", type=float, default=None, metavar="PCT", help="layouts predicted within PCT%% of the best are a "
                   "close call: named, with the command that measures them (default 10, about the plan's own error)")
    o.add_argument("--top", type=int, default=None, metavar="N", help="show the N fastest only")
    o.add_argument("--json", action="store_true", help="print one JSON object: {layouts: [...], best: {...}, ...}")
    o.add_argument("--chart", default=None, metavar="PNG", help="also write a bar chart (needs matplotlib)")
    p.set_defaults(func=main)


def cluster_from_args(args: argparse.Namespace, nproc: int, nnodes: int):
    from ..plan import cluster

    settings = cluster.load_file(args.cluster) if args.cluster else {}
    flags = {"device": args.device, "peak_tflops": args.peak_tflops, "achieved_fraction": args.mfu, "memory_gib": args.mem_gib,
             "intra_gbit": args.intra_gbit, "intra_latency_us": args.intra_latency_us, "inter_gbit": args.inter_gbit,
             "inter_latency_us": args.inter_latency_us, "shared_cores": args.shared_cores}
    settings.update({k: v for k, v in flags.items() if v is not None})
    if args.nproc is not None or "procs_per_node" not in settings:
        settings["procs_per_node"] = nproc
    if args.nnodes is not None or "nodes" not in settings:
        settings["nodes"] = nnodes
    return cluster.with_links(cluster.build(settings), measured_links(args))


def measured_links(args: argparse.Namespace) -> dict:
    """``--links`` files and ``--measure-links``, by where they were measured (``intra``/``inter``)."""
    from ..plan import links

    out = {}
    for path in args.links:
        got = links.load(path)
        out["inter" if got.between == "nodes" else "intra"] = got
    if args.measure_links:
        out["intra"] = links.measure_local()
    return out


def _positive(name: str, value: int | None) -> None:
    if value is not None:
        check.integer(name, value, minimum=1)


def main(args: argparse.Namespace) -> int:
    from ..data.loader import usable_cores
    from ..plan import plan_task, report
    from ..plan.layouts import COMMS
    from ..precision import PRESETS
    from ..tasks import load_task

    for name, value in (("--nproc", args.nproc), ("--batch-size", args.batch_size), ("--grad-accum", args.grad_accum),
                        ("--microbatches", args.microbatches), ("--profile-threads", args.profile_threads), ("--top", args.top),
                        ("--log-every", args.log_every)):
        _positive(name, value)
    check.seconds("--profile-seconds", args.profile_seconds)
    if args.margin is not None and not 0 <= args.margin < 100:
        raise ConfigError(f"--margin {args.margin:g}: a percentage of the best's speed from 0 to under 100 (e.g. --margin 10).")
    if args.precision not in (*PRESETS, None, "auto"):
        raise ConfigError(f"unknown precision {args.precision!r}; choose one of: {', '.join(PRESETS)}.")
    nnodes, max_nodes = parse_nnodes(args.nnodes)
    if max_nodes is not None or nnodes < 1:
        raise ConfigError(f"--nnodes {args.nnodes!r}: a plan is for a fixed number of nodes >= 1; write e.g. --nnodes 4.")
    clu = cluster_from_args(args, args.nproc or 1, nnodes)
    if args.precision in (None, "auto"):  # as train: fp32 unless asked; auto is bf16 on a GPU cluster
        args.precision = "bf16-mixed" if args.precision == "auto" and clu.is_gpu else "fp32"
    task = load_task(args.task, data_dir=args.data_dir, options=parse_task_args(args.task_arg))
    batch = args.batch_size or task.batch_size
    if batch % args.grad_accum:
        raise ConfigError(f"--batch-size {batch} is not divisible by --grad-accum {args.grad_accum}; use a multiple of {args.grad_accum}.")
    comms = tuple(c.strip() for c in args.comm_methods.split(",") if c.strip()) or COMMS
    _check_comms(comms)
    layouts = _layouts(args.layouts, clu, comms) if args.layouts else None  # checked before the profile's cost
    threads = args.profile_threads or max(1, usable_cores() // clu.procs_per_node)
    spec = None if args.no_layout_profile else (args.task, args.data_dir, parse_task_args(args.task_arg))
    plan = plan_task(task, clu, batch=batch, precision=args.precision, optimizer=args.optimizer, grad_accum=args.grad_accum,
                     activation_checkpointing=args.activation_checkpointing, microbatches=args.microbatches,
                     schedule=args.pipeline_schedule, threads=threads, layouts=layouts, comms=comms, task_spec=spec,
                     profile_s=args.profile_seconds, log_every=args.log_every)
    if args.margin is not None:
        plan = dataclasses.replace(plan, margin=args.margin / 100)
    if args.chart:
        report.chart(plan, args.chart)
    if args.json:
        print(report.to_json(plan))
    else:
        report.print_table(plan, top=args.top, task_flags=_task_flags(args, batch))
        if args.chart:
            print(f"chart: {args.chart}")
    return 0


def _task_flags(args: argparse.Namespace, batch: int) -> tuple[str, ...]:
    """The task as `dtrain bench` and `dtrain train` take it, for the command a close call prints."""
    flags = ["--task", args.task, *(f for kv in args.task_arg for f in ("--task-arg", kv))]
    if args.data_dir:
        flags += ["--data-dir", args.data_dir]
    return (*flags, "--batch-size", str(batch))


def _check_comms(comms: tuple[str, ...]) -> None:
    from ..comm import CommSpec

    for text in comms:
        spec = CommSpec.parse(text)
        if spec.kind == "auto":
            raise ConfigError("--comm-methods auto: auto chooses at run time; list the methods to compare (e.g. none,bf16,powersgd:2).")


def _layouts(text: str, clu, comms: tuple[str, ...]) -> list:
    """``--layouts``: names as `dtrain train` takes them (checked against the world size)."""
    from ..parallel.dims import ParallelDims, parse
    from ..plan import Layout

    world, out = clu.world_size, []
    for name in (t.strip() for t in text.split(";") if t.strip()):
        if name in ("ddp", "zero1"):
            dims = ParallelDims(dp_replicate=world)
            out += [Layout(name, dims, comm=c) for c in comms] if name == "ddp" else [Layout(name, dims, zero1=True)]
        elif name == "fsdp":
            out.append(Layout(name, ParallelDims(dp_shard=world)))
        elif name == "hsdp":
            out.append(Layout(name, ParallelDims(dp_replicate=clu.nodes, dp_shard=clu.procs_per_node)))
        elif name == "single" and world == 1:
            out.append(Layout(name, ParallelDims()))
        elif "=" in name:
            dims = parse(name)
            dims.check_world(world)
            out.append(Layout(str(dims), dims))
        else:
            raise ConfigError(f"--layouts {name!r} is not ddp, zero1, fsdp, hsdp or a --parallel layout such as dp_shard=2,tp=2.")
    return out

"""`dtrain plan`: predict step time, throughput, scaling efficiency and memory per rank of every
layout x comm method for your task on a cluster you describe (or this machine, profiled), and
name the fastest that fits. Nothing is trained; see docs/plan.md."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

from .. import _check as check
from ..errors import ConfigError
from ..precision import auto_name
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
    o.add_argument("--fsdp-reduce", default=None, metavar="DTYPE", help="as dtrain train: fsdp/hsdp reduce-scatter gradients in "
                   "fp32 (default), bf16 or fp16 (half the bytes)")
    o.add_argument("--verify", action="store_true", help="dry-run the pick (and each layout of --layouts) here: rank 0 of the "
                   "planned world on this machine's device, the other ranks a fake process group (as dtrain dry-run); its "
                   "measured peak and state beside the plan's, and whether it fits by the measured peak")
    p.set_defaults(func=main)


def cluster_from_args(args: argparse.Namespace, nproc: int, nnodes: int):
    """The cluster from ``--cluster``, the flags (each checked: ``plan.inputs``) and the links."""
    from ..plan import cluster, inputs

    settings = cluster.load_file(args.cluster) if args.cluster else {}
    flags = {"device": args.device, "peak_tflops": args.peak_tflops, "achieved_fraction": args.mfu, "memory_gib": args.mem_gib,
             "intra_gbit": args.intra_gbit, "intra_latency_us": args.intra_latency_us, "inter_gbit": args.inter_gbit,
             "inter_latency_us": args.inter_latency_us, "procs_per_node": args.nproc,
             "nodes": nnodes if args.nnodes is not None else None}
    settings.update(inputs.cluster_settings(flags))
    settings.setdefault("procs_per_node", nproc)
    settings.setdefault("nodes", nnodes)
    inputs.world(settings["nodes"], settings["procs_per_node"])
    clu = cluster.build(settings)
    return cluster.with_links(clu, measured_links(args, clu))


def measured_links(args: argparse.Namespace, clu) -> dict:
    """``--links`` files by where they were measured (``intra``/``inter``); a warning for each
    measured on other hardware than ``clu``'s."""
    from ..plan import costs

    out = {}
    for path in args.links:
        got = costs.load(path)
        _warn_foreign(f"--links {path!r}", got, clu)
        out["inter" if got.between == "nodes" else "intra"] = got
    return out


def measure_links(clu):
    """``--measure-links``: ``clu`` with the collectives timed between 2 processes here, for the
    figures inside a node (after every input is checked: it takes a few seconds)."""
    from ..plan import cluster, costs

    got = costs.measure_local()
    _warn_foreign("--measure-links", got, clu)
    return cluster.with_links(clu, {"intra": got})


def _warn_foreign(what: str, got, clu) -> None:
    """One line where links were timed with another backend or device than the plan's cluster
    uses (gloo on this CPU for an H100 cluster): their figures still replace the cluster's."""
    if clu is None:
        return
    device = "cuda" if clu.is_gpu else "cpu"
    if (got.backend, got.device) != (clu.backend, device):
        print(f"dtrain: warning: {what} measured {got.backend} on {got.device}, but the plan is for {clu.device.name} "
              f"({clu.backend} on {device}): its times replace the cluster's figures as they are; measure on that hardware "
              f"(`dtrain doctor --links-out FILE` there) or leave them out.", file=sys.stderr, flush=True)


def main(args: argparse.Namespace) -> int:
    from ..data.loader import usable_cores
    from ..plan import make_plan, plan_task, report
    from ..plan.float8 import with_float8
    from ..plan.layouts import COMMS
    from ..precision import FLOAT8, PRESETS
    from ..tasks import load_task

    for name, value in (("--batch-size", args.batch_size), ("--grad-accum", args.grad_accum),
                        ("--microbatches", args.microbatches), ("--profile-threads", args.profile_threads), ("--top", args.top),
                        ("--log-every", args.log_every)):
        if value is not None:
            check.integer(name, value, minimum=1)
    if args.batch_size is not None:
        _batch_bound(args.batch_size)
    check.seconds("--profile-seconds", args.profile_seconds)
    if args.margin is not None and not 0 <= args.margin < 100:
        raise ConfigError(f"--margin {args.margin:g}: a percentage of the best's speed from 0 to under 100 (e.g. --margin 10).")
    if args.precision not in (*PRESETS, FLOAT8, None, "auto"):
        raise ConfigError(f"unknown precision {args.precision!r}; choose one of: {', '.join(PRESETS)}, {FLOAT8}, auto.")
    grad_bytes = _reduce_bytes(args.fsdp_reduce)
    nnodes, max_nodes = parse_nnodes(args.nnodes)
    if max_nodes is not None or nnodes < 1:
        raise ConfigError(f"--nnodes {args.nnodes!r}: a plan is for a fixed number of nodes >= 1; write e.g. --nnodes 4.")
    if args.chart is not None:
        _chart_path(args.chart)
    clu = cluster_from_args(args, args.nproc or 1, nnodes)
    float8 = args.precision == FLOAT8
    if float8:  # planned as the bf16-mixed run it is, then its float8 linears (plan.float8)
        _float8_device(clu)
        args.precision = "bf16-mixed"
    if args.precision in (None, "auto"):  # as train: fp32 unless asked; auto is precision.auto_name's (no float8 rates)
        args.precision = auto_name(gpu=clu.is_gpu, bf16=clu.device.bf16) if args.precision == "auto" else "fp32"
    task = load_task(args.task, data_dir=args.data_dir, options=parse_task_args(args.task_arg))
    batch = args.batch_size or task.batch_size
    _batch_bound(batch, task)
    if batch % args.grad_accum:
        raise ConfigError(f"--batch-size {batch} is not divisible by --grad-accum {args.grad_accum}; use a multiple of {args.grad_accum}.")
    comms = tuple(c.strip() for c in args.comm_methods.split(",") if c.strip()) or COMMS
    _check_comms(comms)
    layouts = _layouts(args.layouts, clu, comms) if args.layouts else None  # checked before the profile's cost
    if args.measure_links:
        clu = measure_links(clu)
    threads = args.profile_threads or max(1, usable_cores() // clu.procs_per_node)
    spec = None if args.no_layout_profile else (args.task, args.data_dir, parse_task_args(args.task_arg))
    plan = plan_task(task, clu, batch=batch, precision=args.precision, optimizer=args.optimizer, grad_accum=args.grad_accum,
                     activation_checkpointing=args.activation_checkpointing, microbatches=args.microbatches,
                     schedule=args.pipeline_schedule, threads=threads, layouts=layouts, comms=comms, task_spec=spec,
                     profile_s=args.profile_seconds, log_every=args.log_every)
    if float8:
        plan = with_float8(plan, task, batch)
    if grad_bytes is not None:  # --fsdp-reduce: the same profile and layouts with fsdp's gradient bytes
        plan = make_plan(plan.profile, plan.cluster, dataclasses.replace(plan.settings, grad_comm_bytes=grad_bytes),
                         layouts=[p.layout for p in plan.predictions])
    if args.margin is not None:
        plan = dataclasses.replace(plan, margin=args.margin / 100)
    if args.chart:
        _write_chart(plan, args.chart)
    verified = _verify(args, plan, layouts, batch) if args.verify else None
    if args.json:
        print(json.dumps(plan.as_dict() if verified is None else {**plan.as_dict(), "verify": verified}))
    else:
        report.print_table(plan, top=args.top, task_flags=_task_flags(args, batch))
        if args.chart:
            print(f"chart: {args.chart}")
        if verified is not None:
            from ..dryrun.verify import lines

            print("\n".join(lines(verified, plan.cluster.world_size)))
    return 0


def _reduce_bytes(name: str | None) -> int | None:
    """``--fsdp-reduce``: bytes per gradient element fsdp/hsdp reduce-scatter (checked as train checks it)."""
    if name is None:
        return None
    from ..parallel.fsdp import REDUCE_DTYPES, FSDPConfig

    FSDPConfig(reduce_dtype=name)
    return REDUCE_DTYPES[name].itemsize


def _float8_device(clu) -> None:
    """``--precision float8`` is planned from a GPU preset's float8 peak: one line elsewhere."""
    from ..plan.float8 import float8_peak

    if not clu.is_gpu:
        raise ConfigError("--precision float8: the plan's device is this CPU, which has no float8; plan a GPU preset with "
                          "float8 (--device h100 or h200).")
    if clu.device.profiled:
        raise ConfigError("--precision float8 with --device cuda: the plan times this GPU's step in bf16 only; plan the "
                          "float8 run from a preset's peaks (--device h100 or h200).")
    float8_peak(clu.device)


def _verify(args: argparse.Namespace, plan, layouts: list | None, batch: int) -> list[dict]:
    """``--verify``: the dry run of the pick (the fastest predicted where none fits) and of each
    layout ``--layouts`` named (its exact ``--comm none`` prediction; one per layout)."""
    from ..dryrun.verify import Job, verify
    from ..train.config import TaskConfig

    pick = plan.best or (plan.predictions[0] if plan.predictions else None)
    preds = [pick] if pick is not None else []
    for lay in layouts or []:
        if all(p.layout.name != lay.name for p in preds):
            same = [p for p in plan.predictions if p.layout.name == lay.name]
            preds.append(next((p for p in same if p.layout.comm == "none"), same[0]))
    job = Job(task=TaskConfig(name=args.task, args=parse_task_args(args.task_arg), data_dir=args.data_dir), batch=batch,
              grad_accum=args.grad_accum, optimizer=plan.settings.optimizer, precision=plan.settings.precision,
              activation_checkpointing=args.activation_checkpointing,
              fsdp_options={"reduce_dtype": args.fsdp_reduce} if args.fsdp_reduce else {})
    clu = plan.cluster
    return verify(preds, job, clu.world_size, clu.procs_per_node, clu.device.memory_bytes)


MAX_BATCH = 1 << 16
"""Samples per process: the profile builds one batch of real samples (a million of digits' took
30 s and 2.3 GB before any plan)."""
MAX_BATCH_BYTES = 1 << 30


def _batch_bound(batch: int, task=None) -> None:
    """``--batch-size`` (or the task's own batch) within what the profile can build: at most
    ``MAX_BATCH`` samples and, with ``task``, ``MAX_BATCH_BYTES`` of them (one sample's tensors)."""
    if batch > MAX_BATCH:
        raise ConfigError(f"--batch-size {batch:,} is per process, and the plan builds one batch of real samples to profile "
                          f"it; at most {MAX_BATCH:,} (e.g. --batch-size 256).")
    if task is not None:
        import torch
        from torch.utils._pytree import tree_leaves

        if len(task.train_set) == 0:
            return  # the profile says so
        sample = task.train_set[0]
        size = sum(t.nbytes if isinstance(t, torch.Tensor) else 8 for t in tree_leaves(sample)) + 512  # + Python's own per sample
        if batch * size > MAX_BATCH_BYTES:
            raise ConfigError(f"--batch-size {batch:,}: one batch of task {task.name!r} holds {batch * size / 2**30:.1f} GiB of "
                              f"samples, which the plan builds to profile it; at most {MAX_BATCH_BYTES >> 30} GiB "
                              f"(--batch-size {max(1, MAX_BATCH_BYTES // size):,} or less).")


def _chart_path(path: str) -> None:
    """``--chart``: matplotlib importable, a format it writes, a path this user can write; checked
    before the profile's minutes (the chart is drawn after them)."""
    check.output_file("--chart", path)
    try:
        from matplotlib.backend_bases import FigureCanvasBase
    except ImportError:
        raise ConfigError("--chart needs matplotlib; pip install 'dtrain[plot]' (or matplotlib), or leave out --chart.") from None
    ext = os.path.splitext(path)[1].lstrip(".").lower()
    formats = FigureCanvasBase.get_supported_filetypes()
    if ext and ext not in formats:
        raise ConfigError(f"--chart {path}: matplotlib writes no .{ext} files; end the name with one of "
                          f"{', '.join('.' + f for f in sorted(formats))} (e.g. plan.png).")


def _write_chart(plan, path: str) -> None:
    """The chart, in the folders ``_chart_path`` found could be made."""
    from ..plan import report

    try:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        report.chart(plan, path)
    except OSError as exc:  # the disk filled, or the folder changed, during the profile
        raise ConfigError(f"--chart {path} could not be written ({exc.strerror or exc}); pick another path.") from None


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
    from ..plan.layouts import NAMED, named

    world, out = clu.world_size, []
    for name in (t.strip() for t in text.split(";") if t.strip()):
        if name in NAMED:
            out += named(name, world, clu.procs_per_node, comms)
        elif name == "single" and world == 1:
            out.append(Layout(name, ParallelDims()))
        elif "=" in name:
            dims = parse(name)
            dims.check_world(world)
            out.append(Layout(str(dims), dims))
        else:
            raise ConfigError(f"--layouts {name!r} is not ddp, zero1, fsdp, hsdp or a --parallel layout such as dp_shard=2,tp=2.")
    return out

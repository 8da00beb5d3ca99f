"""`dtrain bench`: run one task under each method and report which is fastest, and why."""

from __future__ import annotations

import argparse
import dataclasses
import os

from .. import _check as check
from .._log import configure_cli_logging
from ..bench import parse_methods
from ..bench.fit import fit_methods
from ..bench.methods import comm_methods, layout_methods
from ..bench.report import build_report, markdown, write_report
from ..bench.runner import BenchConfig, run_bench
from ..errors import ConfigError
from ..tasks import load_task
from ..world import check_device
from .train import parse_task_args


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="compare the data-parallel methods on your task", description=__doc__)
    p.add_argument("--task", default="digits", help="digits (default), images, lm, mnist, synthetic, or MODULE:FUNCTION")
    p.add_argument("--task-arg", action="append", default=[], metavar="KEY=VALUE", help="option for the task function (repeatable)")
    p.add_argument("--data-dir", default=None, help="folder with the task's data files (mnist: the IDX files; images: DIR/train/CLASS/*.jpg; lm: a text file or folder, default the Python stdlib)")
    p.add_argument("--methods", default=None, help="comma-separated (default: reference,dp,ddp,ddp-spawn,ddp-bf16,ddp-fp16 on GPU,hvd)")
    p.add_argument("--parallel", action="append", default=[], metavar="LAYOUT",
                   help="also measure this --parallel layout (repeatable), e.g. --parallel dp_shard=2,tp=2 --parallel tp=4 (with --methods ddp: a baseline)")
    p.add_argument("--comm", action="append", default=[], metavar="METHOD",
                   help="also measure ddp with this --comm method (repeatable), e.g. --comm powersgd:2 --comm localsgd:16 (as `dtrain plan` ranks them)")
    p.add_argument("-n", "--nproc", type=int, default=None, metavar="NPROC",
                   help="processes per multi-process method (default 2; on GPUs at most one per GPU)")
    p.add_argument("--steps", type=int, default=20, help="measured steps per repeat (default 20)")
    p.add_argument("--warmup", type=int, default=5, help="steps before measuring, not counted (default 5)")
    p.add_argument("--repeats", type=int, default=3, help="measured repeats per run (default 3)")
    p.add_argument("--rounds", type=int, default=1, help="runs of every method, alternating methods (default 1)")
    p.add_argument("--batch-size", type=int, default=None, help="batch of one process (default: the task's)")
    p.add_argument("--num-workers", type=int, default=None, help="DataLoader workers per process, every method alike (default: as dtrain train)")
    p.add_argument("--threads", type=int, default=None, help="torch threads per process (default: cores / NPROC)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--out", default="bench-out", help="folder for report.md, report.json, chart.png (default bench-out)")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds one method may run before it counts as failed")
    p.set_defaults(func=main)


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    if args.nproc is None:
        args.nproc = DEFAULT_NPROC
    for flag, low in (("nproc", 1), ("steps", 1), ("repeats", 1), ("rounds", 1), ("num_workers", 0), ("warmup", 0),
                      ("batch_size", 1)):
        value = getattr(args, flag)
        if value is not None and value < low:
            raise ConfigError(f"--{flag.replace('_', '-')} must be >= {low}, got {value}.")
    if args.device is not None:
        check_device(args.device)
    check.seconds("--timeout", args.timeout)
    check.output_dir("--out", args.out)
    threads = args.threads if args.threads is not None else max(1, (os.cpu_count() or 1) // args.nproc)
    if threads < 1:
        raise ConfigError(f"--threads must be >= 1, got {threads}.")
    return BenchConfig(
        task=args.task, task_args=tuple(args.task_arg), data_dir=args.data_dir, nproc=args.nproc,
        warmup=args.warmup, steps=args.steps, repeats=args.repeats, rounds=args.rounds,
        batch_size=args.batch_size, num_workers=args.num_workers, device=args.device, threads=threads, out=args.out, timeout_s=args.timeout,
    )


DEFAULT_NPROC = 2


def main(args: argparse.Namespace) -> int:
    configure_cli_logging(0, verbose=False)
    given = args.nproc is not None
    cfg = config_from_args(args)
    fit = fit_methods(parse_methods(args.methods, device=cfg.device) + comm_methods(args.comm, cfg.warmup), cfg.nproc, cfg.device,
                      nproc_given=given)
    if fit.nproc != cfg.nproc:
        cfg = dataclasses.replace(cfg, nproc=fit.nproc, threads=args.threads or max(1, (os.cpu_count() or 1) // fit.nproc))
    for line in fit.notes + [f"skipped {s['method']}: {s['why']}" for s in fit.skipped]:
        print(f"dtrain bench: {line}", flush=True)
    methods = fit.methods + layout_methods(args.parallel, cfg.nproc)
    task = load_task(cfg.task, data_dir=cfg.data_dir, options=parse_task_args(list(cfg.task_args)))  # fail fast
    batch = cfg.batch_size or task.batch_size
    if len(task.train_set) < batch * cfg.nproc:
        raise ConfigError(f"task {task.name!r} has {len(task.train_set)} samples, fewer than one batch of {batch} per process; lower --batch-size.")
    runs = run_bench(cfg, methods, echo=lambda s: print(s, flush=True))
    report = build_report(cfg, runs, skipped=fit.skipped, notes=fit.notes)
    files = write_report(report, cfg.out)
    print()
    print(markdown(report))
    written = ", ".join(path for path in files.values() if path)
    print(f"wrote {written}" + ("" if files["chart.png"] else " (no chart.png: install matplotlib, `pip install dtrain[plot]`)"))
    failed = [m["method"] for m in report["methods"] if "error" in m]
    if failed:
        print(f"dtrain: error: method(s) {', '.join(failed)} failed; their output is in {cfg.out}/<method>.log.")
        return 1
    return 0

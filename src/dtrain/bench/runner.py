"""Run every method of a bench in its own processes, round after round, and collect records."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from ..launch.store import free_port
from .methods import Method


@dataclass(frozen=True, kw_only=True)
class BenchConfig:
    task: str = "digits"
    task_args: tuple[str, ...] = ()
    data_dir: str | None = None
    nproc: int = 2
    warmup: int = 5
    steps: int = 20
    repeats: int = 3
    rounds: int = 1
    batch_size: int | None = None
    num_workers: int | None = None
    """DataLoader workers per process; None: ``dtrain.data.default_num_workers``."""
    seed: int = 0
    device: str | None = None
    threads: int = 1
    """torch threads per process, the same for every method (so "one process" is one rank's share)."""
    out: str = "bench-out"
    timeout_s: float = 600.0


@dataclass
class MethodRun:
    method: Method
    nproc: int
    records: list[list[dict[str, Any]]] = field(default_factory=list)
    """Per round, every rank's record."""
    error: str | None = None
    wall_s: list[float] = field(default_factory=list)


def worker_args(cfg: BenchConfig, method: Method, folder: str) -> list[str]:
    args = ["--method", method.name, "--task", cfg.task, "--strategy", method.strategy, "--precision", method.precision,
            "--warmup", str(cfg.warmup), "--steps", str(cfg.steps), "--repeats", str(cfg.repeats),
            "--seed", str(cfg.seed), "--out", folder]
    for pair in cfg.task_args:
        args += ["--task-arg", pair]
    if method.parallel:
        args += ["--parallel", method.parallel]
    if method.comm:
        args += ["--comm", method.comm]
    if method.batch_split:
        args += ["--batch-split", method.batch_split]
    for flag, value in (("--data-dir", cfg.data_dir), ("--batch-size", cfg.batch_size), ("--device", cfg.device),
                        ("--num-workers", cfg.num_workers)):
        if value is not None:
            args += [flag, str(value)]
    return args


def command(cfg: BenchConfig, method: Method, nproc: int, folder: str) -> list[str]:
    here = os.path.dirname(os.path.abspath(__file__))
    wargs = worker_args(cfg, method, folder)
    if method.kind == "reference":
        return [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--node-rank", "0",
                "--nproc-per-node", str(nproc), "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
                os.path.join(here, "reference.py"), *wargs]
    worker = os.path.join(here, "worker.py")
    if method.launcher == "none":
        return [sys.executable, worker, *wargs]
    return [sys.executable, "-m", "dtrain", "run", "-n", str(nproc), "--launcher", method.launcher, worker, *wargs]


def round_order(runs: list[MethodRun], rnd: int) -> list[MethodRun]:
    """As given in even rounds, reversed in odd ones, so a drift in the machine's load does not
    always favour the same methods."""
    return list(runs) if rnd % 2 == 0 else list(reversed(runs))


def run_bench(cfg: BenchConfig, methods: list[Method], echo=print) -> list[MethodRun]:
    """Every method once per round, the order reversed every other round; records land in ``cfg.out``."""
    runs = [MethodRun(method=m, nproc=1 if m.single_process else cfg.nproc) for m in methods]
    env = {**os.environ, "OMP_NUM_THREADS": str(cfg.threads), "PYTHONUNBUFFERED": "1"}
    for rnd in range(cfg.rounds):
        for run in round_order(runs, rnd):
            if run.error:
                continue
            folder = os.path.join(cfg.out, "runs", f"{run.method.name}-round{rnd}")
            shutil.rmtree(folder, ignore_errors=True)
            echo(f"[round {rnd + 1}/{cfg.rounds}] {run.method.name} ({run.nproc} process{'es' if run.nproc > 1 else ''}) ...")
            t0 = time.perf_counter()
            try:
                proc = subprocess.run(command(cfg, run.method, run.nproc, folder), capture_output=True, text=True,
                                      env=env, timeout=cfg.timeout_s, stdin=subprocess.DEVNULL)
            except subprocess.TimeoutExpired:
                run.error = f"timed out after {cfg.timeout_s:.0f} s"
                continue
            run.wall_s.append(time.perf_counter() - t0)
            records = _read(folder, run.nproc)
            if proc.returncode != 0 or records is None:
                run.error = _last_error(proc) or f"exit status {proc.returncode}, no records"
                _keep_log(cfg.out, run.method.name, proc)
                continue
            run.records.append(records)
    return runs


def _read(folder: str, nproc: int) -> list[dict[str, Any]] | None:
    try:
        return [json.load(open(os.path.join(folder, f"rank{r}.json"))) for r in range(nproc)]
    except (OSError, ValueError):
        return None


# An exception line of a Python traceback, as a worker prints it (torch prefixes "[rank0]:").
_EXCEPTION = re.compile(r"^(?:\[rank\d+\]:\s*)?((?:[A-Za-z_][\w.]*\.)?[A-Z]\w*(?:Error|Exception|Exit|Interrupt)\b(?::.*)?)$")
_LAUNCHER = ("ChildFailedError", "SignalException")


def _last_error(proc: subprocess.CompletedProcess) -> str:
    """The failure's cause in one line: a worker's ``dtrain: error:`` line, else its first exception
    (torchrun's ChildFailedError names no cause), else the last line that mentions an error."""
    lines = [ln.strip() for ln in ((proc.stderr or "") + "\n" + (proc.stdout or "")).splitlines() if ln.strip()]
    for ln in lines:
        if "dtrain: error:" in ln:
            return ln[ln.index("dtrain: error:"):][:300]
    for ln in lines:
        m = _EXCEPTION.match(ln)
        if m and not any(name in ln for name in _LAUNCHER):
            return m.group(1)[:300]
    for ln in reversed(lines):
        if "error" in ln.lower():
            return ln[:300]
    return lines[-1][:300] if lines else ""


def _keep_log(out: str, name: str, proc: subprocess.CompletedProcess) -> None:
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, f"{name}.log"), "w") as fh:
        fh.write(proc.stdout or "")
        fh.write(proc.stderr or "")

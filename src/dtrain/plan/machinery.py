"""What each layout's own machinery costs on this CPU: the model's step run plainly and under each
layout's wrapping (as `dtrain train` builds it), in a fresh process of a world of one, where every
collective is a local no-op, so what a layout adds to the plain step is its CPU work (DDP's
reducer, PowerSGD's products, FSDP's hooks, DTensor's dispatch, a schedule's bookkeeping); the
link's part is the link model's. The kinds run in turn, round after round (medians kept). The same
process reports a worker's memory: before any model, with a pipeline's modules, at the step's peak.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from .timing import Runner
from .timing import timed_step as _step

MIB = 2**20


@dataclass(frozen=True)
class Phases:
    """Median seconds of one step's phases."""

    forward: float
    backward: float
    optimizer: float

    @property
    def total(self) -> float:
        return self.forward + self.backward + self.optimizer


@dataclass(frozen=True, kw_only=True)
class Machinery:
    """The measurements (seconds, bytes) of one profile; see the module's docstring."""

    batch: int
    microbatches: int
    steps: dict[str, Phases]
    """By kind: ``plain``, ``micro`` (one micro-batch of ``batch / microbatches``, no optimizer),
    ``ddp:<comm>``, ``zero1``, ``fsdp``, ``tp``, ``pp`` (the whole step through a one-stage schedule)."""
    average_s: float | None = None
    """Local SGD's averaging of every parameter, once (torch's ``average_parameters``)."""
    rounds: int = 0
    rss: dict[str, float] = field(default_factory=dict)
    """Bytes: ``baseline`` (a worker before its model), ``pipelining`` (importing torch's
    pipelining adds), ``plain_peak`` (the peak of plain steps above the baseline)."""
    threads: int = 1

    def extra(self, kind: str) -> Phases:
        """What ``kind`` adds to the plain step, per phase (0 where noise made it negative)."""
        base, got = self.steps["plain"], self.steps.get(kind)
        if got is None:
            return Phases(0.0, 0.0, 0.0)
        return Phases(max(0.0, got.forward - base.forward), max(0.0, got.backward - base.backward),
                      max(0.0, got.optimizer - base.optimizer))

    def describe(self) -> dict[str, Any]:
        return {"rounds": self.rounds, "threads": self.threads, "batch": self.batch, "microbatches": self.microbatches,
                "steps_ms": {k: {"forward": round(v.forward * 1e3, 3), "backward": round(v.backward * 1e3, 3),
                                 "optimizer": round(v.optimizer * 1e3, 3)} for k, v in self.steps.items()},
                "average_ms": None if self.average_s is None else round(self.average_s * 1e3, 3),
                "rss_mib": {k: round(v / MIB, 1) for k, v in self.rss.items()}}


def kinds_of(layout: Any) -> list[str]:
    """The measured kinds whose extra cost ``layout`` pays (a pipeline's are its own: ``micro``, ``pp``)."""
    d = layout.dims
    if d.pp > 1:
        return []
    out = ["tp"] if d.tp > 1 else []
    if d.dp_shard > 1:
        out.append("fsdp")
    elif d.tp == 1 and layout.zero1:
        out.append("zero1")
    elif d.tp == 1 and d.dp_replicate > 1:
        out.append(f"ddp:{layout.comm}")
    return out


def kinds_for(layouts: list[Any]) -> list[str]:
    """The kinds a list of ``Layout`` needs measured."""
    out: list[str] = []
    for lay in layouts:
        out += ["micro", "pp"] if lay.dims.pp > 1 else kinds_of(lay)
    return list(dict.fromkeys(out))


def measure(task_spec: tuple[str, str | None, dict[str, str]], *, batch: int, precision: str, optimizer: str, kinds: list[str],
            microbatches: int = 4, schedule: str = "1f1b", threads: int = 1, budget_s: float = 10.0) -> Machinery:
    """Run the profile in a fresh process (a world of one) and return its measurements."""
    from ..launch.local import run_distributed

    spec = {"task": task_spec, "batch": batch, "precision": precision, "optimizer": optimizer, "kinds": kinds,
            "microbatches": microbatches, "schedule": schedule, "threads": threads, "budget_s": budget_s}
    raw = run_distributed(body, spec, world_size=1, timeout=120 + 4 * budget_s, env={"OMP_NUM_THREADS": str(threads)})[0]
    return Machinery(batch=batch, microbatches=microbatches, steps={k: Phases(*v) for k, v in raw["steps"].items()},
                     average_s=raw["average_s"], rounds=raw["rounds"], rss=raw["rss"], threads=threads)


def body(spec: dict[str, Any]) -> dict[str, Any]:
    """The profile, in a fresh process of a world of one."""
    import torch.distributed as dist

    from ..tasks import load_task
    from ..train import loop  # noqa: F401 - a worker's imports, for its baseline memory
    from .profile import count
    from .timing import sample_batch

    torch.set_num_threads(spec["threads"])
    dist.init_process_group("gloo")
    name, data_dir, options = spec["task"]
    task = load_task(name, data_dir=data_dir, options=options)
    x, y = sample_batch(task, spec["batch"])
    count(task.build_model, x, y, task.loss_fn, blocks=task.blocks, autocast_dtype=None)  # as a worker counts its FLOPs
    rss = {"baseline": _status("VmRSS")}
    if "pp" in spec["kinds"]:
        __import__("torch.distributed.pipelining")  # what a pipeline's worker imports besides

        rss["pipelining"] = max(0.0, _status("VmRSS") - rss["baseline"])
    runners = {"plain": build_runner("plain", task, x, y, spec)} | {k: build_runner(k, task, x, y, spec) for k in spec["kinds"]}
    peak_known = _reset_peak()
    before = _status("VmRSS")
    for _ in range(2):
        runners["plain"]()
    if peak_known:
        rss["plain_peak"] = max(0.0, _status("VmHWM") - before)
    steps, rounds = _rounds(runners, spec["budget_s"])
    average = _average_s(task) if any(k.startswith("ddp:localsgd") for k in spec["kinds"]) else None
    dist.destroy_process_group()
    return {"steps": steps, "rounds": rounds, "average_s": average, "rss": rss}


MAX_ROUNDS = 60
"""At most this many rounds within the budget: enough to span it and meet a shared machine's slower moments."""


def _rounds(runners: dict[str, Callable[[], tuple[float, float, float]]], budget_s: float) -> tuple[dict[str, tuple], int]:
    """Every runner once per round (3 warm-up rounds: PowerSGD compresses from its third step),
    then rounds until ``budget_s`` is spent (at least 3, at most ``MAX_ROUNDS``); per-phase medians."""
    for _ in range(3):
        for run in runners.values():
            run()
    times: dict[str, list[tuple[float, float, float]]] = {k: [] for k in runners}
    order, start, rounds = list(runners), time.perf_counter(), 0
    while rounds < MAX_ROUNDS and (rounds < 3 or time.perf_counter() - start < budget_s):
        for k in order[rounds % len(order):] + order[:rounds % len(order)]:  # each kind first in turn
            times[k].append(runners[k]())
        rounds += 1
    return {k: tuple(statistics.median(t[i] for t in v) for i in range(3)) for k, v in times.items()}, rounds


def _average_s(task: Any) -> float:
    """Median seconds of one averaging of every parameter (post-local SGD's, every H steps)."""
    from torch.distributed.algorithms.model_averaging.utils import average_parameters_or_parameter_groups

    torch.manual_seed(0)
    params = [p for p in task.new_model().parameters() if p.requires_grad]
    for p in params:  # torch averages only parameters that have a gradient
        p.grad = torch.zeros_like(p)
    times = []
    for _ in range(7):
        t0 = time.perf_counter()
        average_parameters_or_parameter_groups(params, None)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[2:])


def _status(key: str) -> float:
    """``key`` (VmRSS, VmHWM) of /proc/self/status, in bytes."""
    with open("/proc/self/status") as fh:
        return next(float(line.split()[1]) * 1024 for line in fh if line.startswith(key + ":"))


def _reset_peak() -> bool:
    """Set VmHWM to the current RSS (Linux >= 4.0: ``5`` to ``/proc/self/clear_refs``)."""
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
        return True
    except OSError:
        return False


def build_runner(kind: str, task: Any, x: Any, y: Any, spec: dict[str, Any]) -> Runner:
    """The step of ``kind`` (see ``Machinery.steps``), built as `dtrain train` builds the layout."""
    from ..tasks import make_optimizer

    mixed = spec["precision"] in ("bf16-mixed", "fp16-mixed")
    cast = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if mixed else contextlib.nullcontext
    torch.manual_seed(0)
    model = task.new_model()
    opt = lambda m: make_optimizer(spec["optimizer"], m.parameters(), task.lr)  # noqa: E731
    if kind == "micro":
        return _micro(model, task, x, y, spec, cast)
    if kind == "pp":
        return _pipeline(model, opt(model), task, x, y, spec, cast)
    if kind.startswith("ddp:") or kind == "zero1":
        return _ddp(model, kind, task, x, y, spec, cast)
    if kind in ("fsdp", "tp"):
        from torch.distributed.device_mesh import init_device_mesh

        from ..parallel.apply import apply_tp
        from ..parallel.fsdp import FSDPConfig, apply_fully_shard

        mesh, blocks = init_device_mesh("cpu", (1,)), list(task.blocks(model)) if task.blocks else []
        if kind == "tp":
            model = apply_tp(model, mesh, task.tp_plan(model, 1))
        else:  # as training: the mixed-precision policy casts, no autocast
            model = apply_fully_shard(model, mesh, FSDPConfig(), torch.device("cpu"), blocks,
                                      param_dtype=torch.bfloat16 if mixed else None)
            cast = contextlib.nullcontext
    elif kind != "plain":
        raise ValueError(f"unknown machinery kind {kind!r}")
    return _step(model, opt(model), task, x, y, cast)


def _ddp(model: nn.Module, kind: str, task: Any, x: Any, y: Any, spec: dict[str, Any], cast: Callable) -> Runner:
    from torch.nn.parallel import DistributedDataParallel

    from ..comm import CommSpec, attach, bucket_mb
    from ..strategies.ddp import DDPConfig
    from ..strategies.zero1 import shard_optimizer
    from ..tasks import make_optimizer

    comm = CommSpec.parse(kind.partition(":")[2] or "none", warmup=2)
    ddp = DistributedDataParallel(model, bucket_cap_mb=bucket_mb(model, comm, DDPConfig().bucket_cap_mb), gradient_as_bucket_view=True)
    method = attach(ddp, comm)
    opt = make_optimizer(spec["optimizer"], ddp.parameters(), task.lr)
    if kind == "zero1":
        opt = shard_optimizer(opt)
    return _step(ddp, opt, task, x, y, cast, (lambda: method.after_step(opt)) if method is not None else None)


def _micro(model: nn.Module, task: Any, x: Any, y: Any, spec: dict[str, Any], cast: Callable) -> Runner:
    """Forward and backward of one micro-batch (what a pipeline stage computes per slot)."""
    size = max(1, spec["batch"] // spec["microbatches"])
    xm, ym = x[:size], y[:size]

    def run() -> tuple[float, float, float]:
        t0 = time.perf_counter()
        with cast():
            loss = task.loss_fn(model(xm), ym)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        model.zero_grad(set_to_none=True)
        return t1 - t0, t2 - t1, 0.0
    return run


def _pipeline(model: nn.Module, opt: Any, task: Any, x: Any, y: Any, spec: dict[str, Any], cast: Callable) -> Runner:
    """torch's schedule (as ``parallel.stages.Pipe`` builds it) over one stage: the micro-batch
    split, the per-micro-batch loss and bookkeeping, no transfers (the whole schedule is its forward)."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    m = spec["microbatches"]
    cls = ScheduleGPipe if spec["schedule"] == "gpipe" else Schedule1F1B
    schedule = cls(PipelineStage(model, 0, 1, torch.device("cpu")), n_microbatches=m,
                   loss_fn=lambda out, t: task.loss_fn(out, t) / m, scale_grads=False)

    def run() -> tuple[float, float, float]:
        t0 = time.perf_counter()
        with cast():
            schedule.step(x, target=y, losses=[])
        t1 = time.perf_counter()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return t1 - t0, 0.0, time.perf_counter() - t1
    return run

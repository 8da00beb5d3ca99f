"""Timing steps here: the plain step on the device at hand (``measure``), and each layout's own
machinery on this CPU (``measure_layouts``): the step under each layout's wrapping in a fresh process
of a world of one, where every collective is a no-op, so what a layout adds is its CPU work; the
same process reports a worker's memory (before any model, at the peak)."""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
from torch import nn

from ..errors import ConfigError

MIB = 2**20


@dataclass(frozen=True, kw_only=True)
class Timing:
    """Medians of one batch's phases on the profiling device."""

    batch: int
    fwd_s: float
    bwd_s: float
    opt_s: float
    threads: int
    device: str
    data_s: float = 0.0  # fetching and collating one batch from the (in-memory) data set
    checkpointed: bool = False  # the blocks checkpointed: the backward holds their recomputation


NoCast = contextlib.nullcontext


def sample_batch(task: Any, batch: int) -> tuple[Any, Any]:
    from torch.utils.data import default_collate

    n = len(task.train_set)
    if n == 0:
        raise ConfigError(f"task {task.name!r} has an empty training set; nothing to profile.")
    return default_collate([task.train_set[i % n] for i in range(batch)])


Runner = Callable[[], tuple[float, float, float]]
WARMUP_GPU = 5  # untimed steps before a GPU's timed ones: the allocator and cuBLAS's choices settle


def timed_step(model: nn.Module, opt: Any, task: Any, x: Any, y: Any, cast: Callable, after: Callable[[], None] | None = None,
               gpu: bool = False) -> Runner:
    """A runner of one step on (x, y) returning its forward, backward, optimizer (with ``after``; none: ``opt`` None) seconds.
    ``gpu``: on CUDA events with one wait, at the step's end, so the host queues ahead as in training."""
    def mark() -> Any:  # the host's clock, or a CUDA event
        if not gpu:
            return time.perf_counter()
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    def run() -> tuple[float, float, float]:
        t0 = mark()
        with cast():
            loss = task.loss_fn(model(x), y)
        t1 = mark()
        loss.backward()
        t2 = mark()
        if opt is None:  # a pipeline's micro-batch: forward and backward only
            model.zero_grad(set_to_none=True)
        else:
            opt.step()
            if after is not None:
                after()
            opt.zero_grad(set_to_none=True)
        t3 = mark()
        if not gpu:
            return t1 - t0, t2 - t1, t3 - t2
        t3.synchronize()
        return t0.elapsed_time(t1) / 1e3, t1.elapsed_time(t2) / 1e3, t2.elapsed_time(t3) / 1e3
    return run


def measure(task: Any, x: Any, y: Any, *, optimizer: str, lr: float, autocast_dtype: torch.dtype | None,
            threads: int, repeats: int = 15, budget_s: float = 5.0, device: str = "cpu",
            checkpointed: bool = False) -> Timing:
    """Median phases of up to ``repeats`` steps (at least 5; fewer once ``budget_s`` is spent) after a
    warm-up, with ``threads`` torch threads; on ``device="cuda"`` no data time (its loader works ahead)."""
    from ..parallel.transforms import apply_activation_checkpointing
    from ..tasks import make_optimizer

    gpu = device == "cuda"
    old = torch.get_num_threads()
    torch.set_num_threads(max(1, threads))
    try:
        torch.manual_seed(0)
        model = task.new_model()
        checkpointed = bool(checkpointed and task.blocks is not None
                            and apply_activation_checkpointing(task.blocks(model)))
        if gpu:
            from ..data.loader import to_device

            model, x, y = model.to("cuda"), to_device(x, torch.device("cuda")), to_device(y, torch.device("cuda"))
        opt = make_optimizer(optimizer, model.parameters(), lr, device=torch.device(device))
        cast = (lambda: torch.autocast(device, dtype=autocast_dtype)) if autocast_dtype is not None else NoCast
        steps, _ = _rounds({"step": timed_step(model, opt, task, x, y, cast, gpu=gpu)}, budget_s, warm=WARMUP_GPU if gpu else 2,
                           least=5, most=repeats)
    finally:
        torch.set_num_threads(old)
    batch = len(y) if hasattr(y, "__len__") else 1
    fwd, bwd, opt_s = steps["step"]
    return Timing(batch=batch, fwd_s=fwd, bwd_s=bwd, opt_s=opt_s, threads=threads, device=device,
                  data_s=0.0 if gpu else data_time(task, batch), checkpointed=checkpointed)


def data_time(task: Any, batch: int) -> float:
    """Median seconds to fetch and collate one batch from the task's training set."""
    def once() -> float:
        t0 = time.perf_counter()
        sample_batch(task, batch)
        return time.perf_counter() - t0
    return statistics.median(once() for _ in range(5))


class Phases(NamedTuple):
    """Median seconds of one step's phases."""

    forward: float
    backward: float
    optimizer: float


@dataclass(frozen=True, kw_only=True)
class Machinery:
    """The measurements (seconds, bytes) of one profile."""

    batch: int
    microbatches: int
    steps: dict[str, Phases]
    """By kind: ``plain``, ``micro`` (one micro-batch, no optimizer), ``ddp:<comm>``, ``zero1``, ``fsdp``,
    ``tp``, ``pp`` (the step through a one-stage schedule)."""
    rounds: int = 0
    rss: dict[str, float] = field(default_factory=dict)
    """Bytes: ``baseline`` (a worker before its model), ``plain_peak`` (the plain steps' peak above it)."""
    threads: int = 1

    def extra(self, kind: str) -> Phases:
        """What ``kind`` adds to the plain step, per phase (0 where noise made it negative)."""
        return Phases(*(max(0.0, g - b) for g, b in zip(self.steps.get(kind, self.steps["plain"]), self.steps["plain"])))

    def describe(self) -> dict[str, Any]:
        return {"rounds": self.rounds, "threads": self.threads, "batch": self.batch, "microbatches": self.microbatches,
                "steps_ms": {k: {n: round(t * 1e3, 3) for n, t in v._asdict().items()} for k, v in self.steps.items()},
                "rss_mib": {k: round(v / MIB, 1) for k, v in self.rss.items()}}


def kinds_of(layout: Any) -> list[str]:
    """The measured kinds whose extra cost ``layout`` pays (a pipeline's own are ``micro`` and ``pp``)."""
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
    return list(dict.fromkeys(k for lay in layouts for k in (["micro", "pp"] if lay.dims.pp > 1 else kinds_of(lay))))


def measure_layouts(task_spec: tuple[str, str | None, dict[str, str]], *, batch: int, precision: str, optimizer: str, kinds: list[str],
            microbatches: int = 4, schedule: str = "1f1b", threads: int = 1, budget_s: float = 10.0) -> Machinery:
    """The profile, run in a fresh process of a world of one."""
    from ..launch.local import run_distributed

    spec = {"task": task_spec, "batch": batch, "precision": precision, "optimizer": optimizer, "kinds": kinds,
            "microbatches": microbatches, "schedule": schedule, "threads": threads, "budget_s": budget_s}
    raw = run_distributed(body, spec, world_size=1, timeout=120 + 4 * budget_s, env={"OMP_NUM_THREADS": str(threads)})[0]
    return Machinery(batch=batch, microbatches=microbatches, steps={k: Phases(*v) for k, v in raw["steps"].items()},
                     rounds=raw["rounds"], rss=raw["rss"], threads=threads)


def body(spec: dict[str, Any]) -> dict[str, Any]:
    """The profile, in a fresh process of a world of one."""
    import torch.distributed as dist

    from ..tasks import load_task
    from ..train import loop  # noqa: F401 - a worker's imports, for its baseline memory
    from .profile import count

    torch.set_num_threads(spec["threads"])
    dist.init_process_group("gloo")
    name, data_dir, options = spec["task"]
    task = load_task(name, data_dir=data_dir, options=options)
    x, y = sample_batch(task, spec["batch"])
    count(task.build_model, x, y, task.loss_fn, blocks=task.blocks, autocast_dtype=None)  # as a worker counts its FLOPs
    rss = {"baseline": _status("VmRSS")}
    runners = {"plain": build_runner("plain", task, x, y, spec)} | {k: build_runner(k, task, x, y, spec) for k in spec["kinds"]}
    peak_known, before = _reset_peak(), _status("VmRSS")
    for _ in range(2):
        runners["plain"]()
    if peak_known:
        rss["plain_peak"] = max(0.0, _status("VmHWM") - before)
    steps, rounds = _rounds(runners, spec["budget_s"])
    dist.destroy_process_group()
    return {"steps": steps, "rounds": rounds, "rss": rss}


MAX_ROUNDS = 60  # within the budget: enough to meet a shared machine's slower moments


def _rounds(runners: dict[str, Runner], budget_s: float, *, warm: int = 3, least: int = 3,
            most: int = MAX_ROUNDS) -> tuple[dict[str, tuple], int]:
    """Every runner once a round (``warm`` rounds first: PowerSGD compresses from its third step) until
    ``budget_s`` is spent (``least`` to ``most`` rounds); per-phase medians."""
    for _ in range(warm):
        for run in runners.values():
            run()
    times: dict[str, list[tuple[float, float, float]]] = {k: [] for k in runners}
    order, start, rounds = list(runners), time.perf_counter(), 0
    while rounds < most and (rounds < least or time.perf_counter() - start < budget_s):
        for k in order[rounds % len(order):] + order[:rounds % len(order)]:  # each kind first in turn
            times[k].append(runners[k]())
        rounds += 1
    return {k: tuple(statistics.median(t[i] for t in v) for i in range(3)) for k, v in times.items()}, rounds


def _status(key: str) -> float:
    """``key`` (VmRSS, VmHWM) of /proc/self/status, in bytes."""
    with open("/proc/self/status") as fh:
        return next(float(line.split()[1]) * 1024 for line in fh if line.startswith(key + ":"))


def _reset_peak() -> bool:
    """Set VmHWM to the current RSS (Linux >= 4.0: ``5`` to ``/proc/self/clear_refs``)."""
    with contextlib.suppress(OSError), open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")
        return True
    return False


def build_runner(kind: str, task: Any, x: Any, y: Any, spec: dict[str, Any]) -> Runner:
    """The step of ``kind`` (see ``Machinery.steps``), built as `dtrain train` builds the layout."""
    from ..tasks import make_optimizer

    mixed = spec["precision"] in ("bf16-mixed", "fp16-mixed")
    cast = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if mixed else contextlib.nullcontext
    torch.manual_seed(0)
    model = task.new_model()
    opt = lambda m: make_optimizer(spec["optimizer"], m.parameters(), task.lr)  # noqa: E731
    if kind == "micro":  # one micro-batch: a pipeline stage's slot
        size = max(1, spec["batch"] // spec["microbatches"])
        return timed_step(model, None, task, x[:size], y[:size], cast)
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
    return timed_step(model, opt(model), task, x, y, cast)


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
    opt = shard_optimizer(opt) if kind == "zero1" else opt
    return timed_step(ddp, opt, task, x, y, cast, (lambda: method.after_step(opt)) if method is not None else None)


def _pipeline(model: nn.Module, opt: Any, task: Any, x: Any, y: Any, spec: dict[str, Any], cast: Callable) -> Runner:
    """torch's schedule over one stage (as ``parallel.stages.Pipe`` builds it): its split, losses and
    bookkeeping, no transfers; all of it counted as forward."""
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

"""The steps ``machinery`` times, one per kind, each built the way `dtrain train` builds the
layout (dtrain's own wrapping functions and defaults) on a process group of one rank (or two:
``machinery.measure``'s second world; TP then splits by two): DDP with
25 MiB buckets and the ``--comm`` method's hook (``dtrain.comm.attach``), ZeRO's rebuilt
optimizer (``strategies.zero1.shard_optimizer``), ``fully_shard`` of the task's blocks then the
root (``parallel.fsdp.apply_fully_shard``), the task's tensor-parallel plan
(``parallel.apply.apply_tp``), and torch's pipeline schedule on one stage (in the world of two:
dtrain's ``Pipe`` over two real stages, the model cut as ``apply_pp`` cuts it).

A runner does one step and returns (forward, backward, optimizer) seconds; a pipeline's whole
schedule is its forward (a schedule does not tell its phases apart).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .timing import Runner
from .timing import timed_step as _step


def _autocast(precision: str) -> Callable[[], contextlib.AbstractContextManager]:
    if precision in ("bf16-mixed", "fp16-mixed"):
        return lambda: torch.autocast("cpu", dtype=torch.bfloat16)
    return contextlib.nullcontext


def _fresh(task: Any) -> nn.Module:
    torch.manual_seed(0)
    return task.new_model()


def _optimizer(name: str, params: Any, lr: float) -> torch.optim.Optimizer:
    from ..tasks import make_optimizer

    return make_optimizer(name, params, lr)


def build_runner(kind: str, task: Any, x: Any, y: Any, spec: dict[str, Any]) -> Runner:
    """The step of ``kind`` (see ``machinery.Machinery.steps``)."""
    cast, opt_name = _autocast(spec["precision"]), spec["optimizer"]
    model = _fresh(task)
    if kind == "plain":
        return _step(model, _optimizer(opt_name, model.parameters(), task.lr), task, x, y, cast)
    if kind == "micro":
        return _micro(model, task, x, y, spec, cast)
    if kind.startswith("ddp:") or kind == "zero1":
        return _ddp(model, kind, task, x, y, spec, cast)
    blocks = list(task.blocks(model)) if task.blocks else []
    mesh = _mesh()
    if kind == "fsdp":
        from ..parallel.fsdp import FSDPConfig, apply_fully_shard

        mixed = spec["precision"] in ("bf16-mixed", "fp16-mixed")  # as training: the policy casts, no autocast
        model = apply_fully_shard(model, mesh, FSDPConfig(), torch.device("cpu"), blocks, param_dtype=torch.bfloat16 if mixed else None)
        return _step(model, _optimizer(opt_name, model.parameters(), task.lr), task, x, y, contextlib.nullcontext if mixed else cast)
    if kind == "tp":
        from ..parallel.apply import apply_tp

        model = apply_tp(model, mesh, task.tp_plan(model, _world()))
        return _step(model, _optimizer(opt_name, model.parameters(), task.lr), task, x, y, cast)
    if kind == "pp":
        if _world() > 1:
            return _stages(model, task, x, y, spec, blocks)
        return _pipeline(model, task, x, y, spec, cast)
    raise ValueError(f"unknown machinery kind {kind!r}")


def _world() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_initialized() else 1


def _mesh() -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (_world(),))


def _ddp(model: nn.Module, kind: str, task: Any, x: Any, y: Any, spec: dict[str, Any], cast: Callable) -> Runner:
    from torch.nn.parallel import DistributedDataParallel

    from ..comm import CommSpec, attach, bucket_mb
    from ..strategies.ddp import DDPConfig
    from ..strategies.zero1 import shard_optimizer

    comm = CommSpec.parse(kind.partition(":")[2] or "none", warmup=2)
    ddp = DistributedDataParallel(model, bucket_cap_mb=bucket_mb(model, comm, DDPConfig().bucket_cap_mb), gradient_as_bucket_view=True)
    method = attach(ddp, comm)
    opt = _optimizer(spec["optimizer"], ddp.parameters(), task.lr)
    if kind == "zero1":
        opt = shard_optimizer(opt)
    after = (lambda: method.after_step(opt)) if method is not None else None
    return _step(ddp, opt, task, x, y, cast, after, compute_end=_world() > 1)


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


def _pipeline(model: nn.Module, task: Any, x: Any, y: Any, spec: dict[str, Any], cast: Callable) -> Runner:
    """torch's schedule (as ``dtrain.parallel.stages.Pipe`` builds it) over one stage: the
    micro-batch split, the per-micro-batch loss and bookkeeping, no transfers."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    m = spec["microbatches"]
    stage = PipelineStage(model, 0, 1, torch.device("cpu"))
    cls = ScheduleGPipe if spec["schedule"] == "gpipe" else Schedule1F1B
    schedule = cls(stage, n_microbatches=m, loss_fn=lambda out, t: task.loss_fn(out, t) / m, scale_grads=False)
    opt = _optimizer(spec["optimizer"], model.parameters(), task.lr)

    def run() -> tuple[float, float, float]:
        t0 = time.perf_counter()
        with cast():
            schedule.step(x, target=y, losses=[])
        t1 = time.perf_counter()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return t1 - t0, 0.0, time.perf_counter() - t1
    return run


class _Quiet:
    """The collectives' labelling ``Pipe`` asks for, as a no-op (no watchdog in a profile)."""

    @contextlib.contextmanager
    def labelled(self, *_: Any) -> Any:
        yield


def _stages(model: nn.Module, task: Any, x: Any, y: Any, spec: dict[str, Any], blocks: list[nn.Module]) -> Runner:
    """A pipeline over the world's ranks, one stage each, run as `dtrain train` runs ``pp``:
    the model cut by ``split_stage`` (between its blocks), dtrain's ``Pipe`` (torch's schedule,
    its sends and receives between the stages, the loss broadcast from the last stage)."""
    import torch.distributed as dist

    from ..errors import ConfigError
    from ..parallel.pipeline import PipelineConfig, split_stage
    from ..parallel.stages import Pipe, Stages
    from ..precision import Precision

    rank, world = dist.get_rank(), _world()
    if len(x) % spec["microbatches"]:
        raise ConfigError(f"a batch of {len(x)} cannot be split into {spec['microbatches']} micro-batches")
    config = PipelineConfig(schedule=spec["schedule"], microbatches=spec["microbatches"])
    stage = split_stage(model, rank, world, config, blocks or None)
    pipe = Pipe(Stages(index=rank, ranks=tuple(range(world))), config, torch.device("cpu"))
    # a pipeline refuses fp16's loss scaling; the world of one's schedule runs it as bf16 too
    name = "bf16-mixed" if spec["precision"] == "fp16-mixed" else spec["precision"]
    precision = Precision.resolve(name, torch.device("cpu"))
    opt = _optimizer(spec["optimizer"], stage.parameters(), task.lr)

    def run() -> tuple[float, float, float]:
        t0 = time.perf_counter()
        pipe.forward_backward(stage, x, y, task.loss_fn, accumulation_steps=1, precision=precision, collectives=_Quiet())
        t1 = time.perf_counter()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return t1 - t0, 0.0, time.perf_counter() - t1
    return run

"""What ``dtrain train --fault-tolerance``'s launcher checks before any replica group starts.

A mistake that every process of every replica group would meet at its start (the device, the
precision, the task and its arguments, the optimizer, the checkpoint folder, the ``--parallel``
layout against the task's model) is one line and exit status 2 here, before the Lighthouse and the groups start:
found by the groups, it printed once per process, then once per group from the launcher.
"""

from __future__ import annotations

import torch

from .. import _check as check
from ..errors import ConfigError, DtrainError
from ..parallel import ParallelDims
from ..parallel import parse as parse_layout
from ..parallel.pipeline import PipelineConfig, split_stage
from ..precision import Precision
from ..tasks import Task, check_optimizer, load_task
from ..world import World
from .config import TrainConfig


def preflight(cfg: TrainConfig) -> None:
    """Refuse, with one line, what each replica group's processes would refuse at their start
    (``train.ft_replica.run_replica`` builds the same things, in the same order)."""
    world = World.detect(device=cfg.runtime.device)  # an unknown or absent device
    refuse_other_launcher(world)
    precision = Precision.resolve(cfg.runtime.precision_spec(), world.device)  # float8 where the device has none
    if cfg.checkpoint.dir:  # each group writes DIR/replica-ID under it
        check.output_dir("--checkpoint-dir", cfg.checkpoint.dir)
    task = load_task(cfg.task.name, data_dir=cfg.task.data_dir, options=cfg.task.args)
    check_optimizer(cfg.optim.name or task.optimizer)
    if cfg.parallel.layout:
        check_layout(cfg, task, parse_layout(cfg.parallel.layout), precision)


def refuse_other_launcher(world: World) -> None:
    """A fault-tolerant job's processes are started by its own launcher (one group each, or a group's)."""
    if world.distributed:
        raise ConfigError(f"--fault-tolerance starts the processes of each replica group itself, got {world.size} processes "
                          "from another launcher; run dtrain train --fault-tolerance directly (--nproc N: N replica groups, "
                          "or with --strategy fsdp one group of N processes).")


def check_layout(cfg: TrainConfig, task: Task, dims: ParallelDims, precision: Precision) -> None:
    """The layout's stages and tensor-parallel split against the task's model, built on the meta
    device (no memory, no weights): what ``parallel.apply`` refuses in every process of a group."""
    if dims.pp == 1 and dims.tp == 1:
        return
    if dims.tp > 1 and task.tp_plan is None:
        raise ConfigError(f"--parallel {cfg.parallel.layout}: the task has no tensor-parallel plan; set Task.tp_plan "
                          "(e.g. the lm task's gpt_tp_plan), or drop tp.")
    try:
        with torch.device("meta"):
            model = task.new_model()
    except DtrainError:
        raise
    except Exception:  # a task's model that needs real tensors to be built (a value read back): its groups check it
        return
    if dims.pp > 1:
        pipeline = PipelineConfig()  # a replica group's layout takes no pipeline options
        split_stage(model, 0, dims.pp, pipeline, task.blocks(model) if task.blocks else None)  # checks every stage's cut
        if precision.scale_loss:
            raise ConfigError("pipeline does not support fp16-mixed (loss scaling); use --precision bf16-mixed or fp32.")
        _check_microbatches(cfg.batch.size or task.batch_size, cfg.batch.grad_accum, pipeline.microbatches)
    if dims.tp > 1:
        task.tp_plan(model, dims.tp)  # the plan's own checks (lm: heads that tp divides)


def _check_microbatches(batch: int, grad_accum: int, microbatches: int) -> None:
    """Each of the ``grad_accum`` pieces of a process's batch (the replica's ``x.chunk(k)``) is cut
    into the schedule's micro-batches."""
    for piece in {len(c) for c in torch.arange(batch).chunk(grad_accum)}:
        if piece % microbatches:
            per = f" (--batch-size {batch} over --grad-accum {grad_accum})" if grad_accum > 1 else ""
            raise ConfigError(f"pipeline: a batch of {piece} samples{per} cannot be split into {microbatches} micro-batches; "
                              f"use a batch size that is a multiple of {microbatches * grad_accum}.")

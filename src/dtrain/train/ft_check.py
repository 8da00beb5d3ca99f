"""What ``dtrain train --fault-tolerance``'s launcher checks before any replica group starts.

A mistake that every process of every replica group would meet at its start (the device, the
precision, the task and its arguments, the optimizer, the checkpoint folder, the ``--parallel``
layout against the task's model) is one line and exit status 2 here, before the Lighthouse and the groups start:
found by the groups, it printed once per process, then once per group from the launcher.
"""

from __future__ import annotations

from typing import Any

import torch

from .. import _check as check
from .. import strategies
from ..errors import ConfigError, DtrainError
from ..metrics.stragglers import StragglerConfig
from ..parallel import ParallelDims
from ..parallel import parse as parse_layout
from ..parallel.convnets import check_channels_last
from ..parallel.pipeline import PipelineConfig, split_stage
from ..parallel.stages import check_batch
from ..parallel.transforms import check_options
from ..precision import Precision
from ..tasks import Task, check_optimizer, load_task
from ..world import World
from .config import TrainConfig


def refuse_unsupported(cfg: TrainConfig, elastic_batch: str = "per-process") -> None:
    """What ``--fault-tolerance`` does not combine with: one line, before any process starts."""
    layout, par = cfg.parallel.layout, cfg.parallel
    # --parallel: the layout is one group's (its TP ranks, FSDP shards, pipeline stages)
    if layout == "auto" or par.strategy not in ("auto", "single", "ddp", "fsdp", "composed"):
        raise ConfigError(f"--fault-tolerance replicates the model across replica groups, got "
                          f"--strategy {par.strategy}{' --parallel ' + layout if layout else ''}; "
                          "use --strategy fsdp, or --parallel tp=N / pp=N (with dp_shard / dp_replicate: the layout of one "
                          "group's --nproc processes) inside a group, or drop it (other --strategy values and --parallel auto "
                          "inside a replica group are not supported yet).")
    if cfg.batch.global_batch or cfg.batch.micro is not None or elastic_batch != "per-process":
        raise ConfigError("--fault-tolerance keeps each replica group's --batch-size (the global batch follows the quorum); "
                          "--elastic-batch global and --micro-batch auto are not supported with it yet (--grad-accum K is).")
    if par.comm is not None:  # its hooks are DDP's, and a replica group runs no DDP
        raise ConfigError(f"--comm {par.comm} (warm-up {par.comm.warmup} steps) does not apply under --fault-tolerance: the replica groups average their gradients "
                          "with torchft's fault-tolerant all-reduce, uncompressed; drop --comm (and --comm-warmup).")
    if cfg.runtime.sync_bn:
        raise ConfigError("--sync-bn does not apply under --fault-tolerance: BatchNorm cannot share statistics across replica "
                          "groups in forward (the groups average their running statistics after each step instead); drop --sync-bn.")
    if cfg.runtime.channels_last and par.strategy == "fsdp":
        check_channels_last(strategies.build("fsdp", distributed=True, **par.strategy_options))
    refuse_unread(cfg)


# option (--parallel with --fsdp-* or pipeline flags) -> its flag
_LAYOUT_FLAGS = {"wrap": "--fsdp-wrap", "offload": "--fsdp-offload", "reduce_dtype": "--fsdp-reduce",
                 "schedule": "--pipeline-schedule", "microbatches": "--microbatches", "split_points": "--split-points"}


def refuse_unread(cfg: TrainConfig) -> None:
    """Flags the replica groups' loop (``ft_replica``) has no part for: refused, not ignored."""
    batch, seen, par = cfg.batch, cfg.observe, cfg.parallel
    if batch.num_workers:  # 0 is what a group does
        raise ConfigError(f"--num-workers {batch.num_workers} does not apply under --fault-tolerance: a replica group reads "
                          "each step's samples in its training process once the step's quorum says which (a worker would read "
                          "ahead samples of a step that may not be committed); drop --num-workers.")
    if batch.split != "even":
        raise ConfigError(f"--batch-split {batch.split} does not apply under --fault-tolerance: each replica group takes an equal "
                          "slice of the step's samples (--batch-size each); drop --batch-split.")
    given, default = seen.stragglers, StragglerConfig()
    unread = [("--trace", seen.trace, "the groups' loop times no step phases to draw"),
              ("--warmup-steps", seen.warmup_steps, "the groups' results have no rates (samples/s, MFU) to leave steps out of"),
              ("--straggler-window", None if given.window == default.window else given.window, "no step breakdown to compare ranks with"),
              ("--straggler-threshold", None if given.threshold == default.threshold else given.threshold,
               "no step breakdown to compare ranks with")]
    refuse_given(unread)
    options = [_LAYOUT_FLAGS.get(k, k) for k in par.strategy_options] if par.layout else []
    if options:  # a group's layout is built without them (and checked without them: check_layout)
        raise ConfigError(f"{', '.join(options)} with --parallel {par.layout} does not apply under --fault-tolerance: a "
                          "replica group's layout takes its default units and schedule; drop "
                          f"{'it' if len(options) == 1 else 'them'} (or use --strategy fsdp with --fsdp-* flags).")


def refuse_given(flags: list[tuple[str, Any, str]]) -> None:
    """One line for the first of ``(flag, value, why)`` given (value not None) that a fault-tolerant job has no part for."""
    for flag, value, why in flags:
        if value is not None:
            shown = flag if value is True else f"{flag} {value}"
            raise ConfigError(f"{shown} does not apply under --fault-tolerance: {why}; drop {flag}.")


def group_size(cfg: TrainConfig, nproc: int) -> int:
    """One replica group's processes: ``--nproc`` under fsdp or ``--parallel`` (its layout fills them), else 1."""
    if cfg.parallel.layout:
        parse_layout(cfg.parallel.layout).check_world(nproc)
        return nproc
    return nproc if cfg.parallel.strategy == "fsdp" else 1


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
    run = cfg.runtime
    check_options(compile=run.compile, activation_checkpointing=run.activation_checkpointing, has_blocks=task.blocks is not None)
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
        batch, k = cfg.batch.size or task.batch_size, cfg.batch.grad_accum
        # each of the k pieces of a process's batch (the replica's x.chunk(k)) goes through the schedule
        for piece in {len(c) for c in torch.arange(batch).chunk(k)}:
            check_batch(precision, piece, pipeline.microbatches, accum=(batch, k))
    if dims.tp > 1:
        task.tp_plan(model, dims.tp)  # the plan's own checks (lm: heads that tp divides)

"""Start ``dtrain train`` from the launching process: check the whole config against the launch (one
line and exit status 2, before any worker starts), then train here or launch the workers."""

from __future__ import annotations

import dataclasses

from .. import strategies
from ..errors import ConfigError
from ..launch import LaunchSpec, launch_function
from ..launch.preflight import check_ranks_fit
from ..parallel import parse as parse_layout
from ..strategies import Strategy
from ..tasks import Task, load_task
from ..world import World
from .config import TrainConfig
from .elastic import global_batch
from .loop import worker_main


def start(cfg: TrainConfig, spec: LaunchSpec, world: World, *, elastic_batch: str = "per-process") -> int:
    """Check ``cfg`` for the job ``spec`` describes, then run it in this process or launch its
    workers; returns the exit status. ``world``: this process's, detected once."""
    if spec.needs_launch:
        check_ranks_fit(spec.nproc, cfg.runtime.device)  # one line now, not NCCL's "Duplicate GPU" after the start
    if cfg.parallel.layout is not None:
        parse_layout(cfg.parallel.layout).check_world(spec.world_size)
    # Built here to check the input; a run in this process uses them (a launched worker builds its own).
    strategy, task = check(cfg, world, distributed=spec.needs_launch and spec.world_size > 1 or world.distributed)
    if spec.elastic:
        cfg = elastic_config(cfg, spec, elastic_batch)
    elif elastic_batch != "per-process":
        raise ConfigError("--elastic-batch global needs --nnodes MIN:MAX (a job whose world size can change).")
    if cfg.checkpoint.dir:  # a file, an unwritable place or another job's folder: one line now, not after training
        from ..checkpoint import lock

        # Only rank 0's node takes the lock; another node cannot tell whether a holder there is alive.
        # A node joining an elastic job finds the lock held by the job it joins.
        lock.preflight(cfg.checkpoint.dir, check_holder=spec.node_rank == 0 and not spec.elastic)
    if not spec.needs_launch:
        worker_main(cfg, world=world, strategy=strategy, task=task)
        return 0
    return launch_function(spec, worker_main, cfg)


def check(cfg: TrainConfig, world: World, *, distributed: bool) -> tuple[Strategy | None, Task]:
    """Fail on bad input here, once, before any worker starts; returns the strategy and the task
    it built, for a run in this process (``distributed``: whether the job has several processes)."""
    from ..parallel.convnets import check_channels_last
    from ..parallel.transforms import check_options
    from ..precision import Precision

    par, run = cfg.parallel, cfg.runtime
    if par.comm is not None and par.strategy != "auto":  # a strategy named with a --comm it cannot take is a
        strategies.comm_options(par.strategy, par.comm, distributed=True)  # mistake at any size: the rule's error
    # --parallel: the layout was checked against the job's size; each process builds its strategy.
    strategy = None if par.layout else strategies.build(par.strategy, comm=par.comm, distributed=distributed, **par.strategy_options)
    if run.channels_last and strategy is not None:
        check_channels_last(strategy)
    Precision.resolve(run.precision_spec(), world.device)  # float8 where the device has none: one line here
    task = load_task(cfg.task.name, data_dir=cfg.task.data_dir, options=cfg.task.args)
    check_options(compile=run.compile, activation_checkpointing=run.activation_checkpointing, has_blocks=task.blocks is not None)
    return strategy, task


def elastic_config(cfg: TrainConfig, spec: LaunchSpec, semantics: str) -> TrainConfig:
    """``--nnodes MIN:MAX``: every attempt resumes from the checkpoint folder (a node that joins
    starts its first attempt), and ``--elastic-batch global`` fixes the global batch."""
    if not cfg.checkpoint.dir:
        raise ConfigError(f"--nnodes {spec.nnodes}:{spec.max_nodes} needs --checkpoint-dir (and --save-every): "
                          "after a node leaves or joins, the workers resume from the newest checkpoint.")
    fixed = None
    if semantics == "global":
        batch = cfg.batch.size or load_task(cfg.task.name, data_dir=cfg.task.data_dir, options=cfg.task.args).batch_size
        fixed = global_batch(batch, spec.nproc, spec.nnodes, spec.max_nodes)
    return dataclasses.replace(cfg, checkpoint=dataclasses.replace(cfg.checkpoint, resume=True),
                               batch=dataclasses.replace(cfg.batch, global_batch=fixed))

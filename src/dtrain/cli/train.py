"""`dtrain train`: the ready job, on a built-in task or your own (MODULE:FUNCTION)."""

from __future__ import annotations

import argparse

from .. import strategies
from .._log import configure_cli_logging
from ..comm import CommSpec
from ..errors import ConfigError
from ..launch import launch_function
from ..launch.preflight import check_ranks_fit
from ..strategies import Strategy
from ..tasks import Task, load_task
from ..train import TrainConfig, worker_main
from ..world import World
from ..world.fastpath import compile_pays
from .common import add_comm_args, add_launch_args, export_diagnostics, launch_spec
from .observe import add_observe_args, observe_options
from .parallel import add_parallel_arg, check_layout
from .sharding import add_sharding_args, strategy_options


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train", help="train a built-in or your own task", description=__doc__)
    g = p.add_argument_group("what to train")
    add_task_args(g)
    g.add_argument("--strategy", default="auto", help="single, ddp, dp, hvd, zero1, fsdp, hsdp or pipeline (default: ddp on several processes)")
    g.add_argument("--fast", action="store_true",
                   help="the fast path (docs/performance.md): --precision auto, and on CUDA --compile and channels-last for conv nets; "
                        "fused optimizers and pinned memory are on for CUDA anyway")
    g.add_argument("--epochs", type=int, default=None, help="passes over the data (default: the task's)")
    g.add_argument("--max-steps", type=int, default=None, help="stop after this many optimizer steps")
    g.add_argument("--lr", type=float, default=None, help="learning rate (default: the task's)")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--device", default=None, help="cpu or cuda (default: cuda:<local rank> when available)")
    g.add_argument("--num-workers", type=int, default=None, help="DataLoader worker processes per rank (default: 0 for in-memory data, else from the cores per process)")
    g.add_argument("--channels-last", action="store_true", help="model and image batches in channels-last (NHWC) layout; conv nets")
    g.add_argument("--sync-bn", action="store_true", help="BatchNorm statistics across ranks (SyncBatchNorm, GPU only)")
    g.add_argument("--log-every", type=int, default=20, help="steps between progress lines / metrics records")
    g.add_argument("--warmup-steps", type=int, default=5,
                   help="first steps left out of every rate (samples/s, tokens/s, MFU); their time is warmup_s (default 5)")
    g.add_argument("--metrics-file", default=None, help="append one JSON line per log interval to this file")
    g.add_argument("--checkpoint-dir", default=None, help="save the full training state here (at the end, and every --save-every steps)")
    g.add_argument("--save-every", type=int, default=None, help="also save every N steps")
    g.add_argument("--keep", type=int, default=3, help="checkpoints to keep, newest first (default 3)")
    g.add_argument("--resume", action="store_true", help="continue from the newest valid checkpoint in --checkpoint-dir")
    g.add_argument("--async-save", action="store_true", help="write checkpoints in the background (the copy to host memory blocks)")
    g.add_argument("--elastic-batch", default="per-process", choices=("per-process", "global"),
                   help="with --nnodes MIN:MAX, when the world size changes: keep each process's --batch-size (default), "
                        "or keep the full job's global batch with gradient accumulation")
    g.add_argument("--ledger", default=None, metavar="DIR",
                   help="record the samples of every committed step here (a file per rank); check with `dtrain ckpt ledger DIR`")
    g.add_argument("--compile", action="store_true", help="torch.compile the model (whole; per block under fsdp, pipeline or activation checkpointing); its time is warmup_s")
    add_parallel_arg(g)
    add_observe_args(p)
    add_sharding_args(p)
    add_comm_args(p)
    add_launch_args(p)
    p.set_defaults(func=main)


def add_task_args(g: argparse._ActionsContainer) -> None:
    """The flags that say what is trained and how heavy a step is; `dtrain plan` takes them too."""
    g.add_argument("--task", default="digits", help="digits (default), images, lm, mnist, synthetic, or MODULE:FUNCTION")
    g.add_argument("--task-arg", action="append", default=[], metavar="KEY=VALUE", help="option for the task function (repeatable)")
    g.add_argument("--data-dir", default=None, help="folder with the task's data files (mnist: the IDX files; images: DIR/train/CLASS/*.jpg; lm: a text file or folder, default the Python stdlib)")
    g.add_argument("--precision", default=None, help="fp32 (default), bf16-mixed, fp16-mixed, or auto (bf16-mixed where the GPU has bf16, else fp32)")
    g.add_argument("--batch-size", type=int, default=None, help="batch of one process (default: the task's)")
    g.add_argument("--optimizer", default=None, help="sgd, adam, adamw or adadelta (default: the task's)")
    g.add_argument("--grad-accum", type=int, default=1, help="micro-batches per batch; gradients sync once per batch")
    g.add_argument("--activation-checkpointing", action="store_true",
                   help="recompute each block's activations in backward: less memory, ~1/3 more compute (tasks with blocks, e.g. lm)")


def parse_task_args(pairs: list[str]) -> dict[str, str]:
    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ConfigError(f"--task-arg {pair!r} is not KEY=VALUE; write e.g. --task-arg hidden=256.")
        out[key] = value
    return out


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    return TrainConfig(
        task=args.task, task_args=parse_task_args(args.task_arg), data_dir=args.data_dir,
        strategy=args.strategy, strategy_options=strategy_options(args),
        precision=args.precision or ("auto" if args.fast else "fp32"), fast=args.fast, epochs=args.epochs, max_steps=args.max_steps,
        batch_size=args.batch_size, lr=args.lr, optimizer=args.optimizer, grad_accum=args.grad_accum,
        seed=args.seed, log_every=args.log_every, warmup_steps=args.warmup_steps, metrics_file=args.metrics_file,
        checkpoint_dir=args.checkpoint_dir, save_every=args.save_every, device=args.device,
        num_workers=args.num_workers, channels_last=args.channels_last, sync_bn=args.sync_bn, keep=args.keep, resume=args.resume, async_save=args.async_save,
        comm=args.comm, comm_warmup=args.comm_warmup, compile=args.compile or (args.fast and compile_pays(args.device)),
        activation_checkpointing=args.activation_checkpointing, parallel=args.parallel, ledger=args.ledger, **observe_options(args),
    )


def validate(cfg: TrainConfig, world: World, *, distributed: bool) -> tuple[Strategy | None, Task]:
    """Fail on bad input here, once, before any worker starts; returns the strategy and the task
    it built, for a run in this process (``distributed``: whether the job has several processes)."""
    from ..parallel.convnets import check_channels_last
    from ..parallel.transforms import check_options
    from ..precision import Precision

    comm = cfg.comm if isinstance(cfg.comm, CommSpec) else None  # TrainConfig parsed --comm
    if comm is not None and cfg.strategy != "auto":  # a strategy named with a --comm it cannot take is a
        strategies.comm_options(cfg.strategy, comm, distributed=True)  # mistake at any size: the rule's error
    # --parallel: the layout was checked against the job's size; each process builds its strategy.
    strategy = None if cfg.parallel else strategies.build(cfg.strategy, comm=comm, distributed=distributed, **cfg.strategy_options)
    if cfg.channels_last and strategy is not None:
        check_channels_last(strategy)
    Precision.resolve(cfg.precision, world.device)
    task = load_task(cfg.task, data_dir=cfg.data_dir, options=cfg.task_args)
    check_options(compile=cfg.compile, activation_checkpointing=cfg.activation_checkpointing, has_blocks=task.blocks is not None)
    return strategy, task


def main(args: argparse.Namespace) -> int:
    configure_cli_logging(0, verbose=args.verbose)
    cfg = config_from_args(args)
    export_diagnostics(args)
    world = World.detect(device=cfg.device)  # once per process; a worker's run() reuses it
    if world.distributed and args.nproc is None:  # under torchrun/srun: this process is a worker
        worker_main(cfg, world=world)
        return 0
    spec = launch_spec(args)
    if spec.needs_launch:
        check_ranks_fit(spec.nproc, cfg.device)  # one line now, not NCCL's "Duplicate GPU" after the start
    check_layout(cfg.parallel, spec.world_size, cfg.strategy)
    # Built here to check the input; a run in this process uses them (a launched worker builds its own).
    strategy, task = validate(cfg, world, distributed=spec.needs_launch and spec.world_size > 1 or world.distributed)
    if spec.elastic:
        cfg = elastic_config(cfg, spec, args.elastic_batch)
    elif args.elastic_batch != "per-process":
        raise ConfigError("--elastic-batch global needs --nnodes MIN:MAX (a job whose world size can change).")
    if cfg.checkpoint_dir:  # a file, an unwritable place or another job's folder: one line now, not after training
        from ..checkpoint import lock

        # Only rank 0's node takes the lock; another node cannot tell whether a holder there is alive.
        # A node joining an elastic job finds the lock held by the job it joins.
        lock.preflight(cfg.checkpoint_dir, check_holder=spec.node_rank == 0 and not spec.elastic)
    if not spec.needs_launch:
        worker_main(cfg, world=world, strategy=strategy, task=task)
        return 0
    return launch_function(spec, worker_main, cfg)


def elastic_config(cfg: TrainConfig, spec, semantics: str) -> TrainConfig:
    """``--nnodes MIN:MAX``: every attempt resumes from the checkpoint folder (a node that joins
    starts its first attempt), and ``--elastic-batch global`` fixes the global batch."""
    import dataclasses

    from ..train.elastic import global_batch

    if not cfg.checkpoint_dir:
        raise ConfigError(f"--nnodes {spec.nnodes}:{spec.max_nodes} needs --checkpoint-dir (and --save-every): "
                          "after a node leaves or joins, the workers resume from the newest checkpoint.")
    fixed = None
    if semantics == "global":
        batch = cfg.batch_size or load_task(cfg.task, data_dir=cfg.data_dir, options=cfg.task_args).batch_size
        fixed = global_batch(batch, spec.nproc, spec.nnodes, spec.max_nodes)
    return dataclasses.replace(cfg, resume=True, global_batch=fixed)

"""`dtrain train`: the ready job, on a built-in task or your own (MODULE:FUNCTION)."""

from __future__ import annotations

import argparse
import dataclasses

from .._log import configure_cli_logging
from ..comm import CommSpec
from ..errors import ConfigError
from ..train import start, worker_main
from ..train.config import (
    BatchConfig,
    CheckpointConfig,
    ObserveConfig,
    OptimConfig,
    ParallelConfig,
    RuntimeConfig,
    ScheduleConfig,
    TaskConfig,
    TrainConfig,
)
from ..world import World
from ..world.fastpath import compile_pays
from .common import add_comm_args, add_launch_args, export_diagnostics, launch_spec
from .microbatch import add_micro_batch_arg, micro_from_args, with_proposal
from .observe import add_observe_args, observe_options
from .parallel import add_parallel_arg
from .sharding import add_sharding_args, strategy_options
from .train_ft import add_ft_args, refuse_without_ft


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train", help="train a built-in or your own task", description=__doc__)
    g = p.add_argument_group("what to train")
    add_task_args(g)
    g.add_argument("--strategy", default="auto", help="single, ddp, dp, hvd, zero1, fsdp, hsdp or pipeline (default: ddp on several processes)")
    g.add_argument("--fast", action="store_true",
                   help="the fast path (docs/performance.md): --precision auto, and on CUDA --compile and channels-last for conv nets; "
                        "fused optimizers and pinned memory are on for CUDA anyway")
    g.add_argument("--float8-recipe", default=None, choices=("tensorwise", "rowwise"),
                   help="float8's scaling: tensorwise (default; the fastest, float8 all-gathers under fsdp) or rowwise (more accurate)")
    g.add_argument("--float8-emulate", action="store_true",
                   help="float8 emulated in high precision (torchao), for tests on a CPU or an older GPU; converts every linear of the blocks")
    g.add_argument("--epochs", type=int, default=None, help="passes over the data (default: the task's)")
    g.add_argument("--max-steps", type=int, default=None, help="stop after this many optimizer steps")
    g.add_argument("--lr", type=float, default=None, help="learning rate (default: the task's)")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--device", default=None, help="cpu or cuda (default: cuda:<local rank> when available)")
    g.add_argument("--num-workers", type=int, default=None, help="DataLoader worker processes per rank (default: 0 for in-memory data, else from the cores per process)")
    g.add_argument("--channels-last", action="store_true", help="model and image batches in channels-last (NHWC) layout; conv nets")
    g.add_argument("--sync-bn", action="store_true", help="BatchNorm statistics across ranks (SyncBatchNorm, GPU only)")
    g.add_argument("--log-every", type=int, default=20, help="steps between progress lines / metrics records")
    g.add_argument("--warmup-steps", type=int, default=None,
                   help="first steps left out of every rate (samples/s, tokens/s, MFU); their time is warmup_s "
                        "(default 5, at most half the run; more than half the run: a warning, and half the run)")
    g.add_argument("--metrics-file", default=None, help="append one JSON line per log interval to this file")
    g.add_argument("--checkpoint-dir", default=None, help="save the full training state here (at the end, and every --save-every steps)")
    g.add_argument("--save-every", type=int, default=None, help="also save every N steps")
    g.add_argument("--keep", type=int, default=3, help="checkpoints to keep, newest first (default 3)")
    g.add_argument("--resume", action="store_true", help="continue from the newest valid checkpoint in --checkpoint-dir")
    g.add_argument("--init-from", default=None, metavar="DIR",
                   help="--task hf:PATH: start from the weights of this Hugging Face folder (e.g. one `dtrain ckpt export --hf` wrote), any layout")
    g.add_argument("--async-save", action="store_true", help="write checkpoints in the background (the copy to host memory blocks)")
    g.add_argument("--elastic-batch", default="per-process", choices=("per-process", "global"),
                   help="with --nnodes MIN:MAX, when the world size changes: keep each process's --batch-size (default), "
                        "or keep the full job's global batch with gradient accumulation")
    g.add_argument("--batch-split", default="even", metavar="even|speed|N,N,...",
                   help="how the global batch is split between ranks: even (default); speed: by each rank's measured compute "
                        "rate, re-measured when a rank drifts; or samples per rank (e.g. 40,24); the update stays the even split's")
    g.add_argument("--ledger", default=None, metavar="DIR",
                   help="record the samples of every committed step here (a file per rank); check with `dtrain ckpt ledger DIR`")
    g.add_argument("--compile", action="store_true", help="torch.compile the model (whole; per block under fsdp, pipeline or activation checkpointing); its time is warmup_s")
    add_parallel_arg(g)
    add_micro_batch_arg(g)
    add_observe_args(p)
    add_sharding_args(p)
    add_comm_args(p)
    add_launch_args(p)
    add_ft_args(p)
    p.set_defaults(func=main)


def add_task_args(g: argparse._ActionsContainer) -> None:
    """The flags that say what is trained and how heavy a step is; `dtrain plan` takes them too."""
    g.add_argument("--task", default="digits", help="digits (default), images, lm, mnist, synthetic, hf:PATH (a transformers model's folder), or MODULE:FUNCTION")
    g.add_argument("--task-arg", action="append", default=[], metavar="KEY=VALUE", help="option for the task function (repeatable)")
    g.add_argument("--data-dir", default=None, help="folder with the task's data files (mnist: the IDX files; images: DIR/train/CLASS/*.jpg; lm: a text file or folder, default the Python stdlib)")
    g.add_argument("--precision", default=None,
                   help="fp32 (default), bf16-mixed, fp16-mixed, float8 (train: bf16 with the blocks' large linears in float8, torchao; "
                        "a GPU of compute capability >= 8.9), or auto (float8 where the GPU has it and torchao is installed, "
                        "else bf16-mixed where the GPU has bf16, else fp32)")
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
    """The flags as a TrainConfig; each section checks its own values (one ConfigError line)."""
    task_args, sharding, observed = parse_task_args(args.task_arg), strategy_options(args), observe_options(args)
    if args.init_from:  # the hf task loads it into the model it builds (dtrain.tasks.hf)
        if not args.task.startswith("hf:"):
            raise ConfigError(f"--init-from {args.init_from} needs --task hf:PATH (a transformers model's folder), not --task {args.task}; "
                              "to continue a dtrain run, use --checkpoint-dir with --resume.")
        task_args["init_from"] = args.init_from
    schedule = ScheduleConfig(epochs=args.epochs, max_steps=args.max_steps, seed=args.seed)
    batch = BatchConfig(size=args.batch_size, grad_accum=args.grad_accum, num_workers=args.num_workers,
                        micro=micro_from_args(args.micro_batch))
    batch = dataclasses.replace(batch, split=args.batch_split)  # --batch-split (dtrain.data.split)
    optim = OptimConfig(name=args.optimizer, lr=args.lr)
    checkpoint = CheckpointConfig(dir=args.checkpoint_dir, save_every=args.save_every, keep=args.keep, resume=args.resume,
                                  async_save=args.async_save)
    comm = None if args.comm is None and args.comm_warmup is None else CommSpec.parse(args.comm, warmup=args.comm_warmup)
    return TrainConfig(
        task=TaskConfig(name=args.task, args=task_args, data_dir=args.data_dir),
        batch=batch, optim=optim, schedule=schedule, checkpoint=checkpoint,
        parallel=ParallelConfig(strategy=args.strategy, strategy_options=sharding, layout=args.parallel, comm=comm),
        runtime=RuntimeConfig(device=args.device, precision=args.precision or ("auto" if args.fast else "fp32"), fast=args.fast,
                              float8_recipe=args.float8_recipe, float8_emulate=args.float8_emulate,
                              compile=args.compile or (args.fast and compile_pays(args.device)),
                              activation_checkpointing=args.activation_checkpointing, channels_last=args.channels_last,
                              sync_bn=args.sync_bn),
        observe=ObserveConfig(log_every=args.log_every, warmup_steps=args.warmup_steps, metrics_file=args.metrics_file,
                              ledger=args.ledger, **observed),
    )


def main(args: argparse.Namespace) -> int:
    configure_cli_logging(0, verbose=args.verbose)
    cfg = config_from_args(args)
    if args.fault_tolerance is not None:  # replica groups on torchft (dtrain.ft), not one process group
        from . import train_ft

        return train_ft.start(cfg, args)
    refuse_without_ft(args)
    export_diagnostics(args)
    world = World.detect(device=cfg.runtime.device)  # once per process; a worker's run() reuses it
    launched = world.distributed and args.nproc is None  # under torchrun/srun: this process is a worker
    spec = None if launched else launch_spec(args)
    if cfg.parallel.layout == "auto":
        from ..launch import autopick
        from . import train_auto as auto

        auto.refuse(cfg, nnodes=spec.nnodes if spec else 1, elastic=bool(spec and spec.elastic), launches=spec is not None)
        if autopick.plans_here(spec):  # node 0 plans for every node and posts its pick in the rendezvous store
            nodes = autopick.planned_nodes(spec)  # an elastic job's MAX
            cfg = auto.resolve(cfg, nodes * spec.nproc, spec.nproc, cfg.runtime.device, nnodes=nodes, every_size=spec.elastic)
            spec = autopick.post(spec, cfg)
        else:
            cfg = autopick.receive(cfg, spec)
    if cfg.batch.micro is not None:  # the plan's proposal; the workers confirm it (dtrain.train.microbatch)
        cfg = with_proposal(cfg, spec.world_size if spec else world.size, str(world.device),
                            local_size=spec.nproc if spec else world.local_size)
    if launched:
        worker_main(cfg, world=world)
        return 0
    return start(cfg, spec, world, elastic_batch=args.elastic_batch)

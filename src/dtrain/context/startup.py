"""``dtrain.init``: detect the world, read the ``DTRAIN_*`` options, build the strategy (with
``--comm``), join the process group, and hand back a ``Context``."""

from __future__ import annotations

import random
import sys
from typing import Any

import numpy as np
import torch

from .. import _check as check
from .. import strategies
from ..comm import CommSpec
from ..diag import Watchdog
from ..diag.startwatch import DEFAULT_STARTUP_S, start_watch
from ..errors import DtrainError
from ..options import current
from ..precision import Precision
from ..strategies.base import Strategy
from ..world import World, init_process_group
from . import replicas
from .core import Context


def init(
    strategy: str | Strategy = "auto",
    precision: str | Precision = "fp32",
    *,
    seed: int | None = None,
    device: str | torch.device | None = None,
    world: World | None = None,
    timeout_s: float = 1800.0,
    stall_timeout: float | None = None,
    debug: bool | None = None,
    run_dir: str | None = None,
    comm: str | None = None,
    comm_warmup: int | None = None,
    compile: bool = False,
    activation_checkpointing: bool = False,
    parallel: str | dict[str, int] | Any | None = None,
    fault_tolerance: bool | str | Any | None = None,
    **strategy_options: Any,
) -> Context:
    """Detect the world, join the process group and build the strategy.

    Collective: call on every rank. ``strategy="auto"`` is ``ddp`` with several processes and
    ``single`` with one. ``seed`` seeds Python, NumPy and torch on every rank alike.
    ``stall_timeout`` (seconds; 0 turns it off; default ``$DTRAIN_STALL_TIMEOUT`` or 900): the
    watchdog reports and stops a job in which some rank made no progress that long.
    ``debug`` (default ``$DTRAIN_DEBUG``): check every dtrain collective across ranks.
    ``run_dir`` (default ``$DTRAIN_RUN_DIR`` or ``./dtrain-run``): where stall dumps go.
    ``comm`` (default ``$DTRAIN_COMM`` or ``none``): how DDP's gradients travel, one of
    ``none, fp16, bf16, powersgd[:RANK], localsgd[:H], auto`` (see ``dtrain.comm``), after
    ``comm_warmup`` plain steps (default ``$DTRAIN_COMM_WARMUP``, else 10; auto: 8 measured steps).
    ``compile``: ``torch.compile`` the model in ``ctx.setup`` (whole; per block under fsdp, pipeline or activation checkpointing).
    ``activation_checkpointing``: recompute each block's activations in backward (needs
    ``ctx.setup(..., blocks=...)``). See ``dtrain.parallel.transforms`` for the order they are applied in.
    ``parallel`` (default ``$DTRAIN_PARALLEL``): how ranks split, e.g. ``{"dp_shard": 2, "tp": 2}``
    or ``"dp_shard=2,tp=2"`` (see ``dtrain.parallel``); ``tp_plan=`` then gives the TP plan.
    ``fault_tolerance`` (default: on in a process ``dtrain run --fault-tolerance`` started): this
    process is one replica group of a job on torchft; steps end with ``ctx.should_commit()``
    (``dtrain.context.replicas``, docs/fault-tolerance.md). ``True``, or settings ``"min=2,..."``.
    """
    _install_excepthook()
    _check_init_args(strategy, precision, seed, world, timeout_s, stall_timeout, debug, run_dir)
    for name, flag in (("compile", compile), ("activation_checkpointing", activation_checkpointing)):
        check.instance(f"dtrain.init({name}=...)", flag, bool, "give True or False")  # 'no' would be true
    if comm is not None:
        check.instance("dtrain.init(comm=...)", comm, (str, CommSpec), "give a name such as none, fp16, powersgd:2 or auto")
    if comm_warmup is not None:
        check.integer("dtrain.init(comm_warmup=...)", comm_warmup, minimum=0)
    env = current()
    world = world or World.detect(device=device)
    ft = replicas.requested(fault_tolerance, env.ft)
    if ft is not None:
        replicas.check(world, strategy)
    spec = CommSpec.parse(comm if comm is not None else env.comm.method,
                          warmup=comm_warmup if comm_warmup is not None else env.comm.warmup)  # fails on every strategy
    parallel = parallel if parallel is not None else env.layout.parallel
    if parallel is None:
        strategy_options.pop("tp_plan", None)  # a plan is used by layouts with tp only
    strat = strategies.build(strategy, comm=spec, distributed=world.distributed, parallel=parallel, **strategy_options)
    if parallel is not None:
        strat.layout(world)  # a layout that does not fill the world: one line, before the group forms
    prec = Precision.resolve(precision, world.device)
    stall = check.number("stall timeout (seconds; 0 turns the watchdog off)", env.diag.stall_timeout if stall_timeout is None else stall_timeout)
    startup_s = env.startup.timeout or DEFAULT_STARTUP_S
    with start_watch(world, env.link.elastic, startup_s):  # a node lost while the group forms ends this wait in seconds
        owns_group = init_process_group(world, timeout_s=timeout_s, startup_s=startup_s)
    if seed is not None:
        seed_everything(seed)
    ctx = Context(world=world, strategy=strat, precision=prec, seed=seed or 0, owns_group=owns_group,
                  debug=env.diag.debug if debug is None else debug)
    ctx.compile, ctx.activation_checkpointing = compile, activation_checkpointing
    if ft is not None:
        ctx._replicas = replicas.Replicas(ft, env.ft, seed=seed or 0, device=world.device)
    if world.distributed and stall > 0:
        ctx._watchdog = Watchdog(
            ctx.tracker, rank=world.rank, size=world.size, timeout_s=stall, run_dir=run_dir or env.diag.run_dir,
            master_addr=world.master_addr, master_port=world.master_port, attempt=world.restart_count,
        ).start()
    return ctx


def _check_init_args(strategy: Any, precision: Any, seed: Any, world: Any, timeout_s: Any,
                     stall_timeout: Any, debug: Any, run_dir: Any) -> None:
    """dtrain.init's arguments have the types it documents (one ConfigError line each)."""
    check.instance("dtrain.init(strategy=...)", strategy, (str, Strategy), f"give a name, one of: auto, {', '.join(strategies.available())}")
    check.instance("dtrain.init(precision=...)", precision, (str, Precision), "give a name such as fp32, bf16-mixed or fp16-mixed")
    if seed is not None:
        check.seed("dtrain.init(seed=...)", seed)
    if world is not None:
        check.instance("dtrain.init(world=...)", world, World, "give a dtrain.World (or leave it out to detect one)")
    check.number("dtrain.init(timeout_s=...)", timeout_s, positive=True)
    if stall_timeout is not None:
        check.number("dtrain.init(stall_timeout=...)", stall_timeout)
    if debug is not None:
        check.instance("dtrain.init(debug=...)", debug, bool, "give True or False")
    if run_dir is not None:
        check.output_dir("dtrain.init(run_dir=...)", run_dir)


def _install_excepthook() -> None:
    """An uncaught DtrainError in a user's script ends with its one-line message, not a traceback."""
    if getattr(sys.excepthook, "_dtrain", False):
        return
    previous = sys.excepthook

    def hook(kind, value, tb):  # type: ignore[no-untyped-def]
        if isinstance(value, DtrainError):
            print(f"dtrain: error: {value}", file=sys.stderr, flush=True)
        else:
            previous(kind, value, tb)

    hook._dtrain = True  # type: ignore[attr-defined]
    sys.excepthook = hook


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy and torch (CPU and every CUDA device)."""
    check.seed("seed_everything(seed)", seed)
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)

"""``dtrain train --parallel auto``: the launching process profiles the task and trains the plan's fastest
layout that fits and averages the exact gradients (``Plan.best_exact``); on several nodes node 0 plans for the
whole world and hands its pick to the others (launch/autopick.py)."""

from __future__ import annotations

import dataclasses
import sys
from typing import Any

from ..errors import ConfigError

AUTO = "auto"
#: Seconds of steps for each layout's machinery in a world of one (``dtrain plan``: 10 by default).
PROFILE_S = 3.0


def refuse(cfg: Any, *, nnodes: int, elastic: bool, launches: bool) -> None:
    """One line for what ``--parallel auto`` cannot do (before any profile is paid for)."""
    par = cfg.parallel
    if not launches:
        raise ConfigError("--parallel auto needs dtrain train to start the workers (-n N): under torchrun or srun each "
                          "worker would plan on its own; run `dtrain plan` once and pass its pick (--strategy or --parallel).")
    if elastic and not cfg.checkpoint.dir:  # train.start's rule for elastic jobs, asked before the plan is paid for
        raise ConfigError(f"--nnodes {nnodes}:MAX needs --checkpoint-dir (and --save-every): after a node leaves or joins, "
                          "the workers resume from the newest checkpoint.")
    if par.comm is not None:
        raise ConfigError(f"--parallel auto picks among layouts that average the exact gradients; --comm {par.comm} "
                          "is a choice of yours: drop one of them (`dtrain plan` ranks the comm methods too).")
    if par.strategy_options:
        given = ", ".join(sorted(par.strategy_options))
        raise ConfigError(f"--parallel auto chooses the layout, so its options ({given}) may not apply: drop them, "
                          "or pick the layout yourself (`dtrain plan` shows the table).")


def resolve(cfg: Any, world_size: int, nproc: int, device: str | None, *, nnodes: int = 1, every_size: bool = False) -> Any:
    """``cfg`` with the plan's pick for ``nnodes`` x ``nproc`` processes (``every_size``: among the layouts that
    run at any number of nodes, for an elastic job); prints one line naming the pick and the runner-up."""
    from ..data.loader import usable_cores
    from ..plan import plan_task
    from ..plan.cluster import DEVICES, build
    from ..precision import auto_name
    from ..tasks import load_task

    if world_size == 1:
        print("dtrain: --parallel auto: one process, nothing to split (single).", file=sys.stderr, flush=True)
        return _with(cfg, strategy="auto", layout=None)
    kind, gpu = _device_kind(device)
    precision = cfg.runtime.precision
    # auto is asked without float8: a float8 run is planned as the bf16 it runs around
    if precision == "auto":
        precision = auto_name(gpu=gpu, bf16=gpu and DEVICES[kind].bf16)
    clu = build({"device": kind, "procs_per_node": nproc, "nodes": nnodes})
    task = load_task(cfg.task.name, data_dir=cfg.task.data_dir, options=cfg.task.args)
    plan = plan_task(task, clu, batch=cfg.batch.size or task.batch_size, precision=precision, optimizer=cfg.optim.name,
                     grad_accum=cfg.batch.grad_accum, activation_checkpointing=cfg.runtime.activation_checkpointing,
                     threads=max(1, usable_cores() // nproc), comms=("none",),
                     task_spec=(cfg.task.name, cfg.task.data_dir, dict(cfg.task.args)), profile_s=PROFILE_S,
                     log_every=cfg.observe.log_every, layouts=any_size_layouts(world_size, nproc, nnodes) if every_size else None)
    pick = plan.best_exact
    if pick is None:
        raise ConfigError(f"--parallel auto: no layout of {world_size} processes fits in memory by the plan; "
                          "run `dtrain plan` for the table (memory per rank) and a smaller --batch-size or more processes.")
    print(pick_line(plan, pick) + nodes_note(nnodes, nproc, elastic=every_size), file=sys.stderr, flush=True)
    if pick.layout.is_strategy:
        return _with(cfg, strategy=pick.layout.name, layout=None)
    return _with(cfg, strategy="auto", layout=pick.layout.name)


def pick_line(plan: Any, pick: Any) -> str:
    """The one line ``--parallel auto`` prints: the pick, the runner-up, and whether it is a close call."""
    rest = [p for p in plan.predictions if p.fits and p.layout.comm == "none" and p is not pick]
    runner = f"; next: {rest[0].layout.label()} at {rest[0].step_s * 1e3:.1f} ms" if rest else ""
    close = plan.close_to(pick, exact=True)
    if close:
        runner += (f"; a close call: {len(close)} other layout(s) within {plan.margin:.0%}, about the plan's own error "
                   "(`dtrain plan` prints the `dtrain bench` that measures them)")
    return (f"dtrain: --parallel auto: the plan picked {pick.layout.label()} ({pick.step_s * 1e3:.1f} ms a step predicted, "
            f"{pick.samples_per_s:,.0f} samples/s{runner}; `dtrain plan` shows the table).")


def nodes_note(nnodes: int, nproc: int, *, elastic: bool = False) -> str:
    """What the pick line adds on several nodes: the world it was planned for, and who trains it."""
    if nnodes == 1 and not elastic:
        return ""
    world = f"{nnodes} nodes x {nproc} process{'es' if nproc > 1 else ''} (world {nnodes * nproc})"
    if elastic:
        return (f" Planned for {world}, the most of --nnodes MIN:MAX, among the layouts that run at any size; kept at every "
                "size the job runs at (no re-plan when nodes leave or join); every node trains it (the first node posts "
                "it in the rendezvous store).")
    return f" Planned for {world}; every node trains this pick (node 0 posts it in the rendezvous store)."


def any_size_layouts(world: int, nproc: int, nnodes: int) -> list[Any]:
    """The named strategies (ddp, zero1, fsdp; hsdp on several nodes of several processes): their
    layouts follow the world (``strategies.preset``), so an elastic job's pick runs at every size."""
    from ..plan.layouts import named

    names = ("ddp", "zero1", "fsdp", "hsdp") if nnodes > 1 and nproc > 1 else ("ddp", "zero1", "fsdp")
    return [x for name in names for x in named(name, world, nproc)]


def _with(cfg: Any, **parallel: Any) -> Any:
    return dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, **parallel))


def _device_kind(device: str | None) -> tuple[str, bool]:
    """The plan's device preset for this machine's device ('cpu' is profiled here)."""
    import torch

    from ..plan.cluster import DEVICES, preset_for

    if device == "cpu" or not torch.cuda.is_available():
        return "cpu", False
    name = torch.cuda.get_device_name()
    kind = preset_for(name, float(torch.cuda.get_device_properties(0).total_memory))
    if kind is not None:
        return kind, True
    raise ConfigError(f"--parallel auto: no plan preset for the GPU {name!r} (known: {', '.join(DEVICES)}); run `dtrain plan "
                      "--peak-tflops T --mem-gib M -n P ...` and pass its pick (--strategy or --parallel).")

"""The program of one rank, as `dtrain train` runs it, with its memory and collectives recorded.
``materialize="meta"`` (the dry run) allocates only what this rank keeps, filled with stand-in
values (a dry run checks memory and communication, not learning); ``"eager"`` builds the model as
`dtrain train` does: the real run a dry run is compared with.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils.data import DataLoader

from ..context.core import Context
from ..context.startup import init
from ..errors import ConfigError
from ..parallel.apply import retie, tied_groups
from ..parallel.dims import DIMS
from ..tasks import Task, load_task, make_optimizer
from ..train.config import check_accum
from ..world import World
from .config import DryRunConfig
from .fake import fake_ddp_hook
from .track import Call, CollectiveLog, TensorMemory


@dataclass
class RankRun:
    """What one rank's steps held and sent."""

    peak_bytes: int
    peak_kind: str
    """``tensors`` (live tensor storages, ``TensorMemory``) or ``cuda_max_allocated``."""
    state: dict[str, int]
    """params, grads, optimizer: this rank's bytes after a step (local shards)."""
    steps: list[list[Call]] = field(default_factory=list)
    """The collectives of each step."""
    setup: list[Call] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    layout: str = ""
    reserved_bytes: int | None = None
    """On a GPU, ``torch.cuda.max_memory_reserved``: what the caching allocator took."""
    dims: dict[str, int] = field(default_factory=dict)
    batch: int = 0
    params_local: int = 0
    """Parameter elements this rank holds."""
    empty_params: list[str] = field(default_factory=list)
    """Parameters of which this rank holds no element (fewer rows than the ranks sharding them)."""


class KeepMeta(TorchFunctionMode):
    """``tensor.to(device)`` of a meta tensor leaves it on meta: the apply path's ``model.to(device)``
    before sharding cannot move a meta model, and ``fully_shard`` takes meta parameters as they are."""

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func in (torch.Tensor.to, torch.Tensor.cuda, torch.Tensor.cpu) and args and isinstance(args[0], torch.Tensor) \
                and args[0].is_meta:
            return args[0]
        return func(*args, **(kwargs or {}))


@torch.no_grad()
def stand_in_values(model: nn.Module, device: torch.device) -> None:
    """Allocate the meta model's local shards on ``device`` and fill them; ``to_empty`` would untie
    a head tied to its embedding (more memory than the real run), so ties are restored after it."""
    ties = tied_groups(model)
    model.to_empty(device=device)
    for names in ties:
        retie(model, names)
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        local = t.to_local() if hasattr(t, "to_local") else t
        if not local.is_floating_point():
            local.zero_()
        elif local.dim() >= 2:
            local.normal_(0.0, 0.02)
        elif name.endswith(("weight", "running_var")):
            local.fill_(1.0)
        else:
            local.zero_()


def build(ctx: Context, task: Task, cfg: DryRunConfig, materialize: str) -> tuple[nn.Module, Any]:
    """The task's model and optimizer, set up by ``ctx`` for the layout. Collective."""
    optim = cfg.optim.name or task.optimizer
    lr = cfg.optim.lr or task.lr

    def blocks(m: nn.Module) -> list[nn.Module] | None:
        return task.blocks(m) if task.blocks else None

    if materialize == "eager":  # as dtrain train: built whole on the CPU, optimizer first
        model = task.new_model()
        optimizer = make_optimizer(optim, model.parameters(), lr, device=ctx.device)
        return ctx.setup(model, optimizer, blocks=blocks(model))
    with torch.device("meta"):
        model = task.new_model()
    dims = ctx.strategy.layout(ctx.world)
    if dims.dp_shard == 1 and dims.tp == 1 and ctx.strategy.fsdp is None:  # a whole replica: allocate it as it is
        stand_in_values(model, ctx.device)
        wrapped = ctx.setup(model, blocks=blocks(model))
    else:
        with KeepMeta():
            wrapped = ctx.setup(model, blocks=blocks(model))
        stand_in_values(wrapped, ctx.device)
    optimizer = make_optimizer(optim, wrapped.parameters(), lr, device=ctx.device)
    return wrapped, ctx.setup_optimizer(optimizer, wrapped)


def first_batch(task: Task, batch: int) -> tuple[Any, Any]:
    loader = DataLoader(task.train_set, batch_size=batch, shuffle=False, drop_last=True)
    try:
        return next(iter(loader))
    except StopIteration:
        raise ConfigError(f"task {task.name!r} has {len(task.train_set)} training samples, fewer than one batch of {batch}; "
                          "lower --batch-size.") from None


def group_dims(ctx: Context) -> dict[str, str]:
    """{process group name: the mesh dimension it is}; the default group is the layout's one
    dimension that spans the world (``world`` where none does)."""
    import torch.distributed as dist

    place = ctx.strategy.placement
    dims = ctx.strategy.layout(ctx.world)
    spans = [d for d in DIMS if getattr(dims, d) == ctx.world.size and ctx.world.size > 1]
    out = {dist.group.WORLD.group_name: spans[0] if spans else "world"} if dist.is_initialized() else {}
    if place is not None and not spans:  # a mesh of several dimensions: the apply path built it already
        for d in DIMS:
            if getattr(dims, d) > 1:
                out.setdefault(place.mesh.get_group(d).group_name, d)
    return out


def run_rank(cfg: DryRunConfig, world: World, *, materialize: str = "meta", task: Task | None = None) -> RankRun:
    """Set up and run ``cfg.steps`` steps of this rank. Collective: every rank of ``world``'s
    process group (already joined: the fake one in a dry run, gloo or nccl in a real run)."""
    task = task or load_task(cfg.task.name, data_dir=cfg.task.data_dir, options=cfg.task.args)
    batch = cfg.batch.size or task.batch_size
    check_accum(batch, cfg.batch.grad_accum)
    par = cfg.parallel
    built: dict[str, Any] = {"strategy": par.strategy, "comm": par.comm, **par.strategy_options}
    if par.layout:
        built.update(parallel=par.layout, tp_plan=task.tp_plan)
    ctx = init(precision=cfg.runtime.precision_spec(), seed=cfg.seed, world=world, stall_timeout=0,
               activation_checkpointing=cfg.runtime.activation_checkpointing, compile=cfg.runtime.compile, **built)
    try:
        return _steps(ctx, cfg, task, batch, materialize)
    finally:
        ctx.close()


def _steps(ctx: Context, cfg: DryRunConfig, task: Task, batch: int, materialize: str) -> RankRun:
    log = CollectiveLog(lambda: group_dims(ctx))
    with log.span() as setup, log:
        model, optimizer = build(ctx, task, cfg, materialize)
    fake_ddp_hook(model)
    params_local, empty_params = _check_shards(ctx, model)
    x, y = (t.to(ctx.device) for t in first_batch(task, batch))
    k = cfg.batch.grad_accum
    cuda = ctx.device.type == "cuda"
    memory = TensorMemory()
    if cuda:
        torch.cuda.synchronize(ctx.device)
        torch.cuda.reset_peak_memory_stats(ctx.device)
    memory.hold(_held(model, optimizer))
    run = RankRun(peak_bytes=0, peak_kind="cuda_max_allocated" if cuda else "tensors", state={}, setup=setup, batch=batch,
                  params_local=params_local, empty_params=empty_params)
    model.train()
    with memory if not cuda else contextlib.nullcontext(), log:
        for step in range(cfg.steps):
            with log.span() as calls:
                loss = torch.zeros((), device=ctx.device)
                for xm, ym in zip(x.chunk(k), y.chunk(k)):
                    with ctx.accumulate(model, steps=k):
                        loss += ctx.forward_backward(model, xm, ym, task.loss_fn).float() / k
                optimizer.step()
                if step == cfg.steps - 1:  # before zero_grad: gradients and optimizer state both exist
                    report = ctx.memory_report(model, optimizer)
                optimizer.zero_grad(set_to_none=True)
            run.steps.append(calls)
            run.losses.append(float(loss))
    if cuda:
        torch.cuda.synchronize(ctx.device)
    run.peak_bytes = int(torch.cuda.max_memory_allocated(ctx.device)) if cuda else memory.peak
    run.reserved_bytes = int(torch.cuda.max_memory_reserved(ctx.device)) if cuda else None
    run.state = {"params": report.params_bytes, "grads": report.grads_bytes, "optimizer": report.optimizer_bytes}
    dims = ctx.strategy.layout(ctx.world)
    run.layout, run.dims = ctx.strategy.name if ctx.strategy.name != "composed" else str(dims), \
        {d: getattr(dims, d) for d in DIMS}
    return run


def _check_shards(ctx: Context, model: nn.Module) -> tuple[int, list[str]]:
    """Elements of this rank's parameter shards, and the parameters it holds none of; a rank that
    holds no element of any parameter cannot train: one line naming the sizes."""
    total, empty = 0, []
    for name, p in model.named_parameters():
        n = (p.to_local() if hasattr(p, "to_local") else p).numel()
        total += n
        if n == 0 and p.numel() > 0:
            empty.append(name)
    if total == 0:
        biggest = max((p.shape[0] for p in model.parameters() if p.dim()), default=0)
        raise ConfigError(f"rank {ctx.rank} of {ctx.world_size} holds no element of any parameter: the model's largest "
                          f"first dimension is {biggest}, fewer rows than ranks shard it; use at most {biggest} sharding "
                          "ranks (dp_shard x tp), or check rank 0.")
    return total, empty


def _held(model: nn.Module, optimizer: Any) -> Iterator[torch.Tensor]:
    """The tensors this rank holds before its steps: parameters, buffers, gradients, optimizer state."""
    from ..metrics.memory import inner_optimizer

    yield from model.parameters()
    yield from model.buffers()
    yield from (p.grad for p in model.parameters() if p.grad is not None)
    for state in inner_optimizer(optimizer).state.values():
        yield from (v for v in state.values() if torch.is_tensor(v))

"""Evaluation with every sample counted exactly once across ranks (``ctx.evaluate``)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from .. import _check as check
from ..comm.collectives import Collectives
from ..data.loader import to_device
from ..data.sampler import EvalShardSampler
from ..errors import ConfigError
from ..precision import Precision
from ..strategies.base import Strategy

Metric = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def check_args(dataset: Dataset, metric: Metric, batch_size: int) -> None:
    if not hasattr(dataset, "__len__") or not hasattr(dataset, "__getitem__"):
        raise ConfigError(f"ctx.evaluate(model, dataset, ...) got {check.type_name(dataset)}; give a map-style Dataset (with __len__ and __getitem__).")
    if not callable(metric):
        raise ConfigError(f"ctx.evaluate(model, dataset, metric) got {check.type_name(metric)}; give a function (outputs, targets) -> one score per sample.")
    check.integer("ctx.evaluate(batch_size=...)", batch_size, minimum=1)


@torch.no_grad()
def evaluate(net: nn.Module, dataset: Dataset, metric: Metric, *, batch_size: int, loss_fn: Metric | None,
             strategy: Strategy, precision: Precision, collectives: Collectives) -> dict[str, float]:
    """Score ``net`` (the user's module, unwrapped: ranks may run different numbers of batches,
    so no DDP forward) on ``dataset``. Collective: call on every rank."""
    world = collectives.world
    device = world.device
    was_training = net.training
    net.eval()
    rank, size = strategy.data_parallel(world)  # pipeline: every stage sees every batch
    sampler = EvalShardSampler(len(dataset), rank=rank, world_size=size)
    loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler)
    totals = torch.zeros(3, dtype=torch.float64, device=device)  # metric, loss, count
    # fsdp/hsdp/composed: every forward communicates, so every rank must run as many; a rank
    # with fewer batches runs a one-sample batch (through the strategy: under pp, every stage)
    # whose output is not scored.
    collective = strategy.capabilities.collective_forward and world.distributed
    rounds = int(collectives.all_reduce(torch.tensor(len(loader), device=device), op="max").item()) if collective else 0
    for x, y in loader:
        rounds -= 1
        collectives.tracker.beat()
        x, y = to_device(x, device), to_device(y, device)
        with precision.autocast():
            out = strategy.forward_only(net, x)  # None where another rank scores it (pipeline, TP)
        if out is None:
            continue
        out = out.float()
        totals[0] += metric(out, y).double().sum()
        if loss_fn is not None:
            totals[1] += loss_fn(out, y).double() * len(y)
        totals[2] += len(y)
    if rounds > 0:
        pad = to_device(next(iter(DataLoader(dataset, batch_size=1)))[0], device)
        for _ in range(rounds):
            with precision.autocast():
                strategy.forward_only(net, pad)
    net.train(was_training)
    collectives.all_reduce(totals, op="sum")
    count = totals[2].item()
    return {
        "metric": totals[0].item() / max(count, 1),
        "loss": totals[1].item() / max(count, 1) if loss_fn is not None else float("nan"),
        "count": int(count),
    }

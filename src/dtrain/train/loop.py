"""The training loop of ``dtrain train``, written against the public Context API."""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

import torch
from torch.utils.data import DataLoader

from .. import init
from .._log import configure_cli_logging, logger
from ..checkpoint import atomic_save
from ..context import Context
from ..errors import ConfigError, DtrainError
from ..metrics import JsonlSink, ProgressSink, Throughput, render_summary
from ..tasks import Task, load_task, make_optimizer
from ..world import World
from .config import TrainConfig, check_accum


def worker_main(cfg: TrainConfig) -> None:
    """Entry point of one worker: run, print the result line on rank 0, exit with a clean
    one-line error (status 2) on bad input."""
    world = World.detect(device=cfg.device)
    configure_cli_logging(world.rank)
    try:
        result = run(cfg, world=world)
    except DtrainError as exc:
        print(f"dtrain: error: {exc}", file=sys.stderr, flush=True)
        sys.exit(exc.exit_code)
    if world.is_main:
        print(json.dumps(result), flush=True)


def run(cfg: TrainConfig, world: World | None = None) -> dict[str, Any]:
    """Train ``cfg`` on this rank. Collective: call on every rank. Returns the result record."""
    t0 = time.perf_counter()
    task = load_task(cfg.task, data_dir=cfg.data_dir, options=cfg.task_args)  # bad input fails before any rendezvous
    batch = cfg.batch_size or task.batch_size
    check_accum(batch, cfg.grad_accum)
    ctx = init(cfg.strategy, cfg.precision, seed=cfg.seed, world=world)
    try:
        return _train(ctx, cfg, task, batch, t0)
    finally:
        ctx.close()


def _train(ctx: Context, cfg: TrainConfig, task: Task, batch: int, t0: float) -> dict[str, Any]:
    model = task.build_model()
    if ctx.is_main:
        print(render_summary(model), flush=True)
    optimizer = make_optimizer(cfg.optimizer or task.optimizer, model.parameters(), cfg.lr or task.lr)
    model, optimizer = ctx.setup(model, optimizer)
    loader = ctx.setup_dataloader(
        DataLoader(task.train_set, batch_size=batch, shuffle=True, drop_last=True, num_workers=cfg.num_workers)
    )
    if len(loader) == 0:
        raise_small(task, batch, ctx.world_size)
    epochs = cfg.epochs or task.epochs
    total = len(loader) * epochs if cfg.max_steps is None else min(cfg.max_steps, len(loader) * epochs)
    logger.info(
        f"{task.name}: {ctx.world_size} process(es), strategy {ctx.strategy.name}, precision {ctx.precision.effective}, "
        f"batch {batch}/process, {total} steps on {ctx.device}"
    )
    progress = ProgressSink(total) if ctx.is_main else None
    sink = JsonlSink(cfg.metrics_file) if cfg.metrics_file and ctx.is_main else None
    meter = Throughput()
    window_loss = torch.zeros((), device=ctx.device)
    window_steps, step, last_loss = 0, 0, float("nan")
    k = cfg.grad_accum
    model.train()
    meter.start()
    for epoch in range(epochs):
        for x, y in loader:
            for xm, ym in zip(x.chunk(k), y.chunk(k)):
                with ctx.accumulate(model, steps=k):
                    loss = task.loss_fn(model(xm), ym)
                    ctx.backward(loss)
                    window_loss += loss.detach().float() / k
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            window_steps += 1
            if step % cfg.log_every == 0 or step == total:
                last_loss = ctx.all_reduce(window_loss / window_steps, op="mean").item()
                window_loss.zero_()
                window_steps = 0
                record = {"step": step, "epoch": epoch, "train_loss": last_loss, "samples_per_s": _rate(meter, step, batch, ctx), "wall_s": round(time.perf_counter() - t0, 3)}
                if progress:
                    progress.update(step, {"loss": last_loss, "samples_per_s": record["samples_per_s"]})
                if sink:
                    sink.write(record)
            if cfg.save_every and step % cfg.save_every == 0:
                save_checkpoint(ctx, cfg.checkpoint_dir, model, optimizer, step, epoch)
            if step >= total:
                break
        if step >= total:
            break
    if ctx.device.type == "cuda":
        torch.cuda.synchronize(ctx.device)
    meter.stop(step * batch * ctx.world_size)
    if progress:
        progress.close()
    if cfg.checkpoint_dir:
        save_checkpoint(ctx, cfg.checkpoint_dir, model, optimizer, step, epoch)
    test_acc = None
    if task.test_set is not None:
        test_acc = ctx.evaluate(model, task.test_set, task.metric, batch_size=max(256, batch))["metric"]
    if sink:
        sink.close()
    return {
        "task": task.name,
        "world_size": ctx.world_size,
        "strategy": ctx.strategy.name,
        "precision": ctx.precision.effective,
        "steps": step,
        "samples_per_s": round(meter.samples_per_s, 2) if meter.samples_per_s else None,
        "train_loss": round(last_loss, 6),
        "test_acc": round(test_acc, 6) if test_acc is not None else None,
        "wall_s": round(time.perf_counter() - t0, 3),
    }


def _rate(meter: Throughput, step: int, batch: int, ctx: Context) -> float | None:
    rate = meter.rate_now(step * batch * ctx.world_size)
    return round(rate, 2) if rate else None


def raise_small(task: Task, batch: int, world_size: int) -> None:
    raise ConfigError(
        f"task {task.name!r} has {len(task.train_set)} training samples, fewer than one batch of {batch} "
        f"for each of {world_size} processes; lower --batch-size."
    )


def save_checkpoint(ctx: Context, folder: str, model, optimizer, step: int, epoch: int) -> str:
    """Write model, optimizer and counters to ``folder/step-NNNNNNNN.pt`` from rank 0, then
    point ``folder/latest`` at it. Collective: call on every rank."""
    path = os.path.join(folder, f"step-{step:08d}.pt")
    ctx.save(path, {"model": model, "optimizer": optimizer, "step": step, "epoch": epoch})
    if ctx.is_main:
        tmp = os.path.join(folder, ".latest.tmp")
        with open(tmp, "w") as fh:
            fh.write(os.path.basename(path) + "\n")
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, os.path.join(folder, "latest"))
    return path

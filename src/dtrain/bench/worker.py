"""One method of ``dtrain bench`` through dtrain's own API (each rank runs this file)."""

from __future__ import annotations

import sys

import torch
from torch.utils.data import DataLoader

import dtrain
from dtrain.bench.measure import Recorder, forever, task_options, worker_parser
from dtrain.data import loader_options
from dtrain.data.plan import plan_input
from dtrain.errors import DtrainError
from dtrain.tasks import load_task, make_optimizer
from dtrain.train.listeners import LoopState
from dtrain.train.observe import comm_bytes_per_step


def main(argv: list[str] | None = None) -> None:
    args = worker_parser().parse_args(argv)
    try:
        task = load_task(args.task, data_dir=args.data_dir, options=task_options(args.task_arg))
        layout = {"parallel": args.parallel, "tp_plan": task.tp_plan} if args.parallel else {}
        if args.comm:  # from the first measured step on
            layout.update(comm=args.comm, comm_warmup=args.warmup)
        ctx = dtrain.init(args.strategy, args.precision, seed=args.seed, device=args.device, **layout)
    except DtrainError as exc:
        print(f"dtrain: error: {exc}", file=sys.stderr)
        sys.exit(exc.exit_code)
    try:
        rec = measure(ctx, task, args)
        rec.write(args.out)
    finally:
        ctx.close()


def measure(ctx: dtrain.Context, task, args) -> Recorder:
    batch = args.batch_size or task.batch_size
    model = task.new_model()
    optimizer = make_optimizer(task.optimizer, model.parameters(), args.lr or task.lr, device=ctx.device)
    model, optimizer = ctx.setup(model, optimizer, blocks=task.blocks(model) if task.blocks else None)
    plan = plan_input(task.train_set, local_size=ctx.world.local_size, device=ctx.device, batch_size=batch, workers=args.num_workers)
    loader = ctx.setup_dataloader(DataLoader(task.train_set, batch_size=batch, shuffle=True, drop_last=True,
                                             **loader_options(plan.workers, ctx.device, plan.prefetch_factor or 2)))
    loss_fn, splitter = task.loss_fn, None
    if args.batch_split:
        loader, loss_fn, splitter = _batch_split(ctx, loader, task, batch)
    batches = forever(loader)
    inner = optimizer.optimizer
    synchronize = getattr(inner, "synchronize", None)  # hvd: gradients are waited for here
    rec = Recorder(rank=ctx.rank, world_size=ctx.world_size, method=args.method, batch_size=batch, device=str(ctx.device),
                   metric_name=task.metric_name, tokens_per_sample=task.tokens_per_sample,
                   train_samples=len(task.train_set), replicas=ctx.data_parallel_size)
    model.train()

    def step(measured: bool) -> None:
        t0 = rec.clock()
        ctx.breakdown.step_starts()
        x, y = next(batches)
        ctx.breakdown.got_batch()
        t_data = rec.clock()
        loss = ctx.forward_backward(model, x, y, loss_fn)  # pipeline: micro-batches through the stages
        t_fb = rec.clock()
        if synchronize is not None:
            synchronize()
        t_comm = rec.clock()
        optimizer.step()
        if rec.state_bytes is None:  # gradients and optimizer state both exist now
            r = ctx.memory_report(model, optimizer)
            rec.state_bytes = {"params": r.params_bytes, "grads": r.grads_bytes, "optimizer": r.optimizer_bytes}
        optimizer.zero_grad(set_to_none=True)
        rec.add_step(t0, t_data, t_fb, t_comm, rec.clock(), loss.item(), measured)
        if splitter is not None:
            state.step += 1
            splitter.on_step(state)

    state = LoopState(step=0, total=0)
    if splitter is not None:
        splitter.on_start(state)

    def measured_steps_only() -> None:
        # The split is measured after its own warm-up and used from a step no sampler has built
        # yet: the measured steps start once every rank trains with the measured shares.
        while splitter is not None and not splitter.settled(state.step):
            step(False)
        ctx.breakdown.finish()
        ctx.breakdown.reset()  # the breakdown of the measured steps only

    rec.time_repeats(step, args, ctx.barrier, after_warmup=measured_steps_only)
    ctx.breakdown.finish()
    rec.breakdown = ctx.breakdown.summary()
    if splitter is not None:
        rec.batch_split = splitter.changes
    # forward+backward alone: the same steps without gradient communication, no update.
    # (Not for pipeline: a stage cannot run forward and backward alone.)
    staged = ctx.strategy.capabilities.staged_step and ctx.world.distributed
    for _ in range(0 if staged else args.compute_steps):
        x, y = next(batches)
        with ctx.strategy.no_sync(model.module):
            t0 = rec.clock()
            ctx.backward(task.loss_fn(model(x), y))
            rec.compute_only_ms.append((rec.clock() - t0) * 1e3)
        inner.zero_grad(set_to_none=True)
    rec.comm_bytes_per_step = _comm_bytes(ctx, model, inner, args.warmup + args.steps * args.repeats)
    tail = [loss for _, loss in rec.loss_curve[-max(1, args.steps):]]
    rec.final_loss = ctx.all_reduce(torch.tensor(sum(tail) / len(tail), dtype=torch.float64), op="mean").item()
    if task.test_set is not None:
        rec.test_acc = ctx.evaluate(model, task.test_set, task.metric, batch_size=max(256, batch))["metric"]
    rec.finish()
    return rec


def _batch_split(ctx: dtrain.Context, loader, task, batch: int):
    """``--batch-split speed`` as ``dtrain train`` does it: the split loader, the weighted loss and
    the listener that measures the ranks' speed."""
    from dtrain.data.split import SplitSpec, weighted
    from dtrain.data.split_sampler import split_loader
    from dtrain.metrics.stragglers import StragglerConfig
    from dtrain.train.listeners.batch_split import BatchSplit, refuse

    world = ctx.data_parallel_size
    refuse(ctx, SplitSpec("speed"), world, breakdown=True)
    if world == 1:
        return loader, task.loss_fn, None
    split = split_loader(loader)
    loss_fn = weighted(task.loss_fn, lambda: 1, world_size=world, global_batch=batch * world)
    return split, loss_fn, BatchSplit(ctx, split, measure=True, unit=1, warmup_steps=None, stragglers=StragglerConfig())


def _comm_bytes(ctx: dtrain.Context, model, inner, steps: int) -> float | None:
    counted = getattr(inner, "bytes_communicated", None)  # hvd counts what it hands to all-reduce
    if counted is not None and ctx.world.distributed:
        return counted / steps
    return comm_bytes_per_step(ctx, model)  # the strategy's own count, as dtrain train records it


if __name__ == "__main__":
    main()

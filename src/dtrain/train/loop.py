"""The training loop of ``dtrain train``, written against the public Context API."""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from typing import Any

import torch
from torch.utils.data import DataLoader

from .._log import configure_cli_logging, logger
from ..context import preempt
from ..context.core import Context
from ..context.startup import init
from ..data import loader_options, usable_cores
from ..data.ledger import SampleLedger
from ..data.plan import plan_input
from ..errors import ConfigError, DtrainError
from ..metrics import DataWait, JsonlSink, ProgressSink, render_summary
from ..metrics.throughput import SteadyRate
from ..options import current, launch_link
from ..strategies import Strategy
from ..tasks import Task, load_task, make_optimizer
from ..world import World
from ..world.fastpath import auto_channels_last
from .config import TrainConfig, check_accum
from .elastic import split
from .listeners import Listener, Listeners, LoopState, batch_split
from .listeners.checkpoints import Checkpoints
from .listeners.divergence import Diverged, DivergenceCheck
from .listeners.ledger import LedgerListener
from .listeners.plugin import plugin_listeners
from .listeners.preemption import Preemption
from .listeners.report import LossWindow, Report
from .microbatch import Fitter, budget_for, refuse_strategy
from .microretry import Guard
from .observe import Observer


def worker_main(cfg: TrainConfig, *, world: World | None = None, strategy: Strategy | None = None,
                task: Task | None = None) -> None:
    """Entry point of one worker: run, print the result line on rank 0, exit with a clean
    one-line error (status 2) on bad input. ``world``, ``strategy``, ``task``: already built by
    this process (``dtrain train`` without a launch), so nothing is detected or built twice."""
    if world is None:
        try:
            world = World.detect(device=cfg.runtime.device)
        except DtrainError as exc:
            print(f"dtrain: error: {exc}", file=sys.stderr, flush=True)
            sys.exit(exc.exit_code)
    configure_cli_logging(world.rank)
    try:
        result = run(cfg, world=world, strategy=strategy, task=task)
    except DtrainError as exc:
        if launch_link().launch_dir:
            # Started by dtrain's launcher: it shows the earliest rank's error once (every
            # rank raises the same one for a setting all of them check, e.g. pipeline's model).
            raise
        if world.is_main or not isinstance(exc, Diverged):
            print(f"dtrain: error: {exc}", file=sys.stderr, flush=True)
        else:  # every rank raised it alike: rank 0 says it once, and exits first
            time.sleep(1.0)
        sys.exit(exc.exit_code)
    from ..launch.lifecycle import exit_now

    if result.get("rejoin"):  # an elastic job whose other node(s) leave: go on in the next round
        exit_now(preempt.REJOIN_EXIT)
    if world.is_main:
        print(json.dumps(result), flush=True)
    if result.get("preempted") and launch_link().elastic:
        # Saved; leave now. Returning would hand the result to torch's agent, which reads it only
        # while it watches its workers: while it restarts them for a node that joins it does not,
        # and each worker waited the agent's 30 s grace for SIGKILL (seen on the test bed).
        exit_now(0)


def run(cfg: TrainConfig, world: World | None = None, *, strategy: Strategy | None = None,
        task: Task | None = None) -> dict[str, Any]:
    """Train ``cfg`` on this rank. Collective: call on every rank. Returns the result record.
    ``strategy`` and ``task``: built from ``cfg`` already (otherwise built here)."""
    try:
        return _run(cfg, world, strategy, task)
    finally:
        preempt.uninstall()


def _run(cfg: TrainConfig, world: World | None, strategy: Strategy | None, task: Task | None) -> dict[str, Any]:
    t0 = time.perf_counter()
    preempt.install()
    if task is None:
        task = load_task(cfg.task.name, data_dir=cfg.task.data_dir, options=cfg.task.args)  # bad input fails before any rendezvous
    batch = cfg.batch.size or task.batch_size
    check_accum(batch, cfg.batch.grad_accum)
    if cfg.batch.global_batch:  # --elastic-batch global: this world size's share, in micro-batches
        batch, accum = split(cfg.batch.global_batch, world.size if world is not None else World.detect().size, batch)
        cfg = dataclasses.replace(cfg, batch=dataclasses.replace(cfg.batch, size=batch, grad_accum=accum))
    # A strategy built already carries its options and --comm.
    par = cfg.parallel
    built = {"strategy": strategy} if strategy is not None else {
        "strategy": par.strategy, "comm": par.comm, **par.strategy_options}  # a CommSpec holds its warm-up
    if strategy is None and par.layout:
        built.update(parallel=par.layout, tp_plan=task.tp_plan)
    ctx = init(precision=cfg.runtime.precision_spec(), seed=cfg.schedule.seed, world=world, compile=cfg.runtime.compile,
               activation_checkpointing=cfg.runtime.activation_checkpointing, **built)
    try:
        return _train(ctx, cfg, task, batch, t0)
    finally:
        ctx.close()


def _train(ctx: Context, cfg: TrainConfig, task: Task, batch: int, t0: float) -> dict[str, Any]:
    model, optimizer, loader, workers = _setup(ctx, cfg, task, batch)
    loader, task, splitter = batch_split.attach(ctx, cfg, task, loader, batch)  # --batch-split: its loader, weighted loss
    fit = _fitter(ctx, cfg, task, model, optimizer, batch)
    saving = cfg.checkpoint
    ckpt = ctx.checkpoints(saving.dir, keep=saving.keep, async_save=saving.async_save) if saving.dir else None
    step = _resume(ctx, cfg, ckpt, model, optimizer, loader)
    # The steps still to run follow from the data position, not from the step count: after a
    # resume on another world size the steps already done were of another global batch.
    total = step + _steps_left(loader, loader.full_epoch_len(), cfg.schedule.epochs or task.epochs)
    if cfg.schedule.max_steps is not None:
        total = min(total, max(cfg.schedule.max_steps, step))
    logger.info(
        f"{task.name}: {ctx.world_size} process(es), strategy {ctx.strategy.name}, precision {ctx.precision.effective}, "
        f"batch {batch}/process, {total} steps on {ctx.device}, {workers} data worker(s)/process"
    )
    state = LoopState(step=step, total=total, start_step=step, window_loss=torch.zeros((), device=ctx.device))
    rate = steady_rate(ctx, cfg, batch, total - step)  # rates after warm-up (dtrain.metrics.throughput)
    listeners, report, preemption = _listeners(ctx, cfg, task, batch, t0, state, ckpt, model, optimizer, loader, rate, splitter)
    obs = report.obs
    listeners.on_start(state)
    k = cfg.batch.grad_accum
    model.train()
    rate.start()
    ctx.breakdown.step_starts()
    while state.step < total and not state.stop:
        state.epoch = loader.next_epoch
        for x, y in loader:
            ctx.breakdown.got_batch()
            if fit is not None:  # --micro-batch auto: found on the first batch, any step retried smaller after an OOM
                state.window_loss += fit.step(state.step, x, y, lambda xm, ym, k: _micro_step(ctx, model, task, xm, ym, k))
            else:
                for xm, ym in zip(x.chunk(k), y.chunk(k)):
                    state.window_loss += _micro_step(ctx, model, task, xm, ym, k).float() / k
            optimizer.step()
            if state.step == state.start_step:  # before zero_grad: gradients and optimizer state both exist
                _log_memory(ctx, model, optimizer)
                obs.count_flops(task.new_model, x, y, task.loss_fn, batch)
            optimizer.zero_grad(set_to_none=True)
            state.step += 1
            rate.step_done()
            state.window_steps += 1
            listeners.on_step(state)  # ledger, faults, loss window, divergence, report, preemption, checkpoints
            if state.stop or state.step >= total:
                break
            ctx.breakdown.step_starts()
    if ctx.device.type == "cuda":
        torch.cuda.synchronize(ctx.device)
    rate.finish()
    ctx.breakdown.finish()  # closes the last step
    listeners.on_end(state)
    if state.stop:
        rejoin = preemption.elastic and _peers_leave(ctx, state.step, preemption.signalled_here)
        return _stopped(ctx, task, state.step, rate, state.last_loss, t0, rejoin=rejoin)
    return {**_result(ctx, task, model, state, rate, report, workers, batch, t0), **(fit.record() if fit is not None else {})}


def _micro_step(ctx: Context, model: Any, task: Task, xm: Any, ym: Any, k: int) -> torch.Tensor:
    """Forward and backward of one of the batch's ``k`` micro-batches; its loss."""
    with ctx.accumulate(model, steps=k):
        return ctx.forward_backward(model, xm, ym, task.loss_fn)  # pipeline: micro-batches through the stages


def _fitter(ctx: Context, cfg: TrainConfig, task: Task, model: Any, optimizer: Any, batch: int) -> Guard | None:
    """``--micro-batch auto``'s search and retries (``train/microbatch.py``, ``train/microretry.py``); None without it."""
    if cfg.batch.micro is None:
        return None
    refuse_strategy(ctx.strategy.capabilities, ctx.strategy.name, ctx.strategy.comm_record().get("comm"))
    inject = current().testing.oom_inject
    fitter = Fitter(ctx, model, optimizer, task.loss_fn, batch, cfg.batch.micro, budget_for(ctx.rank, inject))
    return Guard(ctx, model, optimizer, fitter, budget_for(ctx.rank, inject, steps=True), inject[2] or 0 if inject else 0)


def _setup(ctx: Context, cfg: TrainConfig, task: Task, batch: int) -> tuple[Any, Any, Any, int]:
    """The task's model and optimizer set up for the strategy, and its sharded loader."""
    model = task.new_model()
    if ctx.is_main:
        print(render_summary(model), flush=True)
    optimizer = make_optimizer(cfg.optim.name or task.optimizer, model.parameters(), cfg.optim.lr or task.lr, device=ctx.device)
    run = cfg.runtime
    channels_last = run.channels_last or (run.fast and auto_channels_last(model, ctx.device, ctx.strategy))
    model, optimizer = ctx.setup(model, optimizer, channels_last=channels_last, sync_bn=run.sync_bn,
                                 blocks=task.blocks(model) if task.blocks else None)
    if task.load_weights is not None:  # after the split: each rank reads only its shards (hf:PATH --init-from)
        task.load_weights(model)
    plan = plan_input(task.train_set, local_size=ctx.world.local_size, device=ctx.device, batch_size=batch, workers=cfg.batch.num_workers)
    workers = plan.workers
    loader = ctx.setup_dataloader(DataLoader(task.train_set, batch_size=batch, shuffle=True, drop_last=True,
                                             **loader_options(workers, ctx.device, plan.prefetch_factor or 2)))
    if loader.full_epoch_len() == 0:
        raise_small(task, batch, ctx.world_size)
    return model, optimizer, loader, workers


def _resume(ctx: Context, cfg: TrainConfig, ckpt: Any, model: Any, optimizer: Any, loader: Any) -> int:
    """The step to start at: the newest checkpoint's with --resume, after an elastic restart or
    a requeue; else 0."""
    restarts = ctx.world.restart_count
    if ckpt is None or not (cfg.checkpoint.resume or restarts > 0 or ctx.world.requeue_count > 0):
        return 0
    meta = ckpt.resume(model=model, optimizer=optimizer, loader=loader)
    if meta is not None:
        why = f"; elastic restart {restarts} after a worker failed" if restarts else ""
        logger.info(f"resumed from {meta['path']} at step {meta['step']} (saved by {meta['world_size']} process(es){why})")
        return meta["step"]
    if cfg.checkpoint.resume:
        logger.info(f"--resume: no checkpoint in {cfg.checkpoint.dir} yet; starting from step 0")
    return 0


def _listeners(ctx: Context, cfg: TrainConfig, task: Task, batch: int, t0: float, state: LoopState, ckpt: Any,
               model: Any, optimizer: Any, loader: Any, rate: SteadyRate,
               splitter: Listener | None = None) -> tuple[Listeners, Report, Preemption]:
    """The loop's listeners, in the order they hear each step (dtrain.train.listeners)."""
    options, seen = current(), cfg.observe
    ledger = SampleLedger(seen.ledger, loader, ctx) if seen.ledger else None
    progress = ProgressSink(state.total, start=state.step) if ctx.is_main else None
    sink = JsonlSink(seen.metrics_file) if seen.metrics_file and ctx.is_main else None
    obs = Observer(ctx, model, optimizer, seen.stragglers, enabled=seen.breakdown, tensorboard=seen.tensorboard,
                   trace=seen.trace, trace_file=seen.trace_file, first_step=state.step, total=state.total)
    objects = {"model": model, "optimizer": optimizer, "loader": loader}
    saves = Checkpoints(ckpt, save_every=cfg.checkpoint.save_every, objects=objects, breakdown=ctx.breakdown, is_main=ctx.is_main,
                        async_save=cfg.checkpoint.async_save) if ckpt is not None else None
    preemption = Preemption(ctx, seen.log_every, elastic=options.link.elastic is not None,
                            save=(lambda step: ckpt.save(step, **objects)) if ckpt is not None else None)
    report = Report(observer=obs, wait=ctx.breakdown.data, t0=t0, rate=lambda steps: _round(rate.window()),
                    extra=lambda sps: _tokens(task, sps), progress=progress, sink=sink)
    listeners = [
        LedgerListener(ledger) if ledger is not None else None,
        *plugin_listeners(options.testing.plugin, ctx),  # DTRAIN_PLUGIN's (the tests' fault and slowness drivers)
        LossWindow(ctx, seen.log_every),
        DivergenceCheck(ctx, lr=cfg.optim.lr or task.lr, checkpoint_dir=cfg.checkpoint.dir, save_due=saves.due if saves else lambda s: False),
        report,
        splitter,  # before the saves: a checkpoint holds the split's changes made at its step
        preemption,
        saves,
    ]
    return Listeners([li for li in listeners if li is not None]), report, preemption


def _result(ctx: Context, task: Task, model: Any, state: LoopState, rate: SteadyRate, report: Report,
            workers: int, batch: int, t0: float) -> dict[str, Any]:
    """The result record of a finished run, after the final evaluation. Collective: every rank."""
    score = None
    if task.test_set is not None:
        score = ctx.evaluate(model, task.test_set, task.metric, batch_size=max(256, batch))["metric"]
    if report.sink:
        report.sink.close()
    data = _data_record(ctx, task, ctx.breakdown.data, rate, workers)
    sps = _round(rate.samples_per_s)  # steady state: warm-up apart (warmup_s)
    observed = report.obs.result(sps)
    return {
        "task": task.name,
        "world_size": ctx.world_size,
        "strategy": ctx.strategy.name,
        "precision": ctx.precision.effective,
        **ctx.strategy.comm_record(),  # comm (asked) and comm_choice (what ran: auto's pick)
        "steps": state.step,
        "samples_per_s": sps,
        **_tokens(task, sps),
        **rate.record(),
        "train_loss": round(state.last_loss, 6),
        **_scores(task, score),
        **data,
        **observed,
        "wall_s": round(time.perf_counter() - t0, 3),
    }


def _data_record(ctx: Context, task: Task, wait: DataWait, rate: SteadyRate, workers: int) -> dict[str, Any]:
    """``data_wait_ms`` (median per step, the first batch apart), ``data_wait_share`` (of the training time, the
    largest over ranks: the slowest rank's input holds every rank at the next all-reduce),
    and images skipped as unreadable; says on rank 0 when input was the bottleneck.
    Collective: call on every rank."""
    share = wait.total_s / rate.elapsed_s if rate.elapsed_s > 0 else 0.0
    skipped = getattr(task.train_set, "skipped", None)  # images: unreadable files replaced (skip_bad)
    skipped_all = ctx.all_reduce(torch.tensor(float(skipped or 0), dtype=torch.float64, device=ctx.device), op="sum")
    worst = ctx.all_reduce(torch.tensor(share, dtype=torch.float64, device=ctx.device), op="max").item()
    if ctx.is_main and worst >= INPUT_BOUND_SHARE:
        logger.warning(f"input was the bottleneck: waited for data {worst:.0%} of the time; {_worker_hint(workers)}")
    record: dict[str, Any] = {"data_wait_ms": wait.median_ms(), "data_wait_share": round(worst, 4), "num_workers": workers,
                              "data_first_wait_ms": wait.first_ms}
    if skipped is not None:
        record["images_skipped"] = int(skipped_all.item())
    return record


INPUT_BOUND_SHARE = 0.10
"""Waiting for data longer than this share of the training time is reported as a bottleneck."""


def _worker_hint(workers: int) -> str:
    cpus = usable_cores()
    more = max(2, workers * 2)
    if more > cpus:
        return f"--num-workers is {workers} and this machine has {cpus} cores: more decoding cores (or a smaller --task-arg size) would help"
    return f"try --num-workers {more}"


def _tokens(task: Task, samples_per_s: float | None) -> dict[str, Any]:
    """``tokens_per_s`` for sequence tasks (``Task.tokens_per_sample``); nothing for others."""
    if task.tokens_per_sample is None:
        return {}
    return {"tokens_per_s": round(samples_per_s * task.tokens_per_sample, 1) if samples_per_s else None}


def _scores(task: Task, score: float | None) -> dict[str, Any]:
    """The metric under its name (``test_acc``, ``val_loss``) and the figures derived from it (perplexity)."""
    out: dict[str, Any] = {task.metric_name: round(score, 6) if score is not None else None}
    if task.derived_metrics is not None and score is not None:
        out.update({k: round(v, 6) for k, v in task.derived_metrics(score).items()})
    return out


def _log_memory(ctx: Context, model: Any, optimizer: Any) -> None:
    """Every rank's parameter, gradient and optimizer-state bytes, after the first step (when
    gradients and optimizer state exist), logged by rank 0. Collective: call on every rank."""
    reports = ctx.gather_object(ctx.memory_report(model, optimizer))
    if ctx.is_main:
        for report in reports:
            logger.info(f"memory after the first step: {report.line()}")


def _steps_left(loader: Any, per_epoch: int, epochs: int) -> int:
    """Batches this rank's loader still yields until ``epochs`` epochs are complete."""
    if loader.next_epoch >= epochs:
        return 0
    return len(loader) + per_epoch * (epochs - loader.next_epoch - 1)


def _peers_leave(ctx: Context, step: int, here: bool) -> bool:
    """An elastic job stopped by a signal: True on the ranks that were not signalled themselves
    (their peers' node leaves; they restart into the next rendezvous round), False on those that
    were (their node leaves, or every node stops, or torch's agent makes room for a node that
    joins). Collective: call on every rank."""
    signalled = int(ctx.all_reduce(torch.tensor(float(here), device=ctx.device), op="sum").item())
    if ctx.is_main:
        if signalled == ctx.world_size:
            logger.info(f"elastic: every rank was told to stop (a node joins, or the job stops); saved step {step}")
        else:
            logger.info(f"elastic: {signalled} of {ctx.world_size} rank(s) were told to stop and leave; saved step {step}; "
                        "the others go on in a new rendezvous round")
    return not here


def _stopped(ctx: Context, task: Task, step: int, rate: SteadyRate, last_loss: float, t0: float, *,
             rejoin: bool = False) -> dict[str, Any]:
    """The result of a run stopped by a preemption signal (no final evaluation); ``rejoin``: an
    elastic job's worker that goes on in the next round (its peers' node left)."""
    return {
        "task": task.name, "world_size": ctx.world_size, "strategy": ctx.strategy.name, "precision": ctx.precision.effective,
        "steps": step, "samples_per_s": _round(rate.samples_per_s),
        "train_loss": round(last_loss, 6), task.metric_name: None, "wall_s": round(time.perf_counter() - t0, 3), "preempted": True,
        **({"rejoin": True} if rejoin else {}),
    }


def _round(rate: float | None) -> float | None:
    return round(rate, 2) if rate else None


def steady_rate(ctx: Context, cfg: TrainConfig, batch: int, steps: int) -> SteadyRate:
    """The rate meter of this run: ``cfg.observe.warmup_steps`` steps of warm-up, then steady state;
    on CUDA the end of warm-up waits for the device once, so its queued work counts as warm-up."""
    device = ctx.device
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else None
    return SteadyRate(batch * ctx.data_parallel_size, steps=steps, warmup_steps=cfg.observe.warmup_steps, sync=sync)


def raise_small(task: Task, batch: int, world_size: int) -> None:
    raise ConfigError(
        f"task {task.name!r} has {len(task.train_set)} training samples, fewer than one batch of {batch} "
        f"for each of {world_size} processes; lower --batch-size."
    )

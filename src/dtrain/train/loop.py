"""The training loop of ``dtrain train``, written against the public Context API."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import signal
import sys
import time
from typing import Any

import torch
from torch.utils.data import DataLoader

from .. import init, preempt
from .._log import configure_cli_logging, logger
from ..context import Context
from ..strategies import Strategy
from ..data import loader_options, usable_cores
from ..data.plan import plan_input
from ..data.ledger import SampleLedger
from ..errors import ConfigError, DtrainError
from ..fastpath import auto_channels_last
from ..options import Options, launcher_link
from ..metrics import DataWait, JsonlSink, ProgressSink, Throughput, render_summary
from ..metrics.throughput import SteadyRate
from ..tasks import Task, load_task, make_optimizer
from ..world import World
from .config import TrainConfig, check_accum
from .elastic import split
from .observe import Observer


def worker_main(cfg: TrainConfig, *, world: World | None = None, strategy: Strategy | None = None,
                task: Task | None = None) -> None:
    """Entry point of one worker: run, print the result line on rank 0, exit with a clean
    one-line error (status 2) on bad input. ``world``, ``strategy``, ``task``: already built by
    this process (``dtrain train`` without a launch), so nothing is detected or built twice."""
    if world is None:
        try:
            world = World.detect(device=cfg.device)
        except DtrainError as exc:
            print(f"dtrain: error: {exc}", file=sys.stderr, flush=True)
            sys.exit(exc.exit_code)
    configure_cli_logging(world.rank)
    try:
        result = run(cfg, world=world, strategy=strategy, task=task)
    except DtrainError as exc:
        if launcher_link()[1]:
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
    if result.get("preempted") and Options.from_env().elastic:
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
        task = load_task(cfg.task, data_dir=cfg.data_dir, options=cfg.task_args)  # bad input fails before any rendezvous
    batch = cfg.batch_size or task.batch_size
    check_accum(batch, cfg.grad_accum)
    if cfg.global_batch:  # --elastic-batch global: this world size's share, in micro-batches
        batch, accum = split(cfg.global_batch, world.size if world is not None else World.detect().size, batch)
        cfg = dataclasses.replace(cfg, batch_size=batch, grad_accum=accum)
    # A strategy built already carries its options and --comm.
    built = {"strategy": strategy} if strategy is not None else {
        "strategy": cfg.strategy, "comm": cfg.comm, **cfg.strategy_options}  # a CommSpec holds its warm-up
    if strategy is None and cfg.parallel:
        built.update(parallel=cfg.parallel, tp_plan=task.tp_plan)
    ctx = init(precision=cfg.precision, seed=cfg.seed, world=world, compile=cfg.compile,
               activation_checkpointing=cfg.activation_checkpointing, **built)
    try:
        return _train(ctx, cfg, task, batch, t0)
    finally:
        ctx.close()


def _train(ctx: Context, cfg: TrainConfig, task: Task, batch: int, t0: float) -> dict[str, Any]:
    model = task.new_model()
    if ctx.is_main:
        print(render_summary(model), flush=True)
    optimizer = make_optimizer(cfg.optimizer or task.optimizer, model.parameters(), cfg.lr or task.lr, device=ctx.device)
    channels_last = cfg.channels_last or (cfg.fast and auto_channels_last(model, ctx.device, ctx.strategy))
    model, optimizer = ctx.setup(model, optimizer, channels_last=channels_last, sync_bn=cfg.sync_bn,
                                 blocks=task.blocks(model) if task.blocks else None)
    plan = plan_input(task.train_set, local_size=ctx.world.local_size, device=ctx.device, batch_size=batch, workers=cfg.num_workers)
    workers = plan.workers
    loader = ctx.setup_dataloader(DataLoader(task.train_set, batch_size=batch, shuffle=True, drop_last=True,
                                             **loader_options(workers, ctx.device, plan.prefetch_factor or 2)))
    per_epoch = loader.full_epoch_len()
    if per_epoch == 0:
        raise_small(task, batch, ctx.world_size)
    epochs = cfg.epochs or task.epochs
    ckpt = ctx.checkpoints(cfg.checkpoint_dir, keep=cfg.keep, async_save=cfg.async_save) if cfg.checkpoint_dir else None
    step = 0
    restarts = ctx.world.restart_count
    if ckpt is not None and (cfg.resume or restarts > 0 or ctx.world.requeue_count > 0):
        meta = ckpt.resume(model=model, optimizer=optimizer, loader=loader)
        if meta is not None:
            step = meta["step"]
            why = f"; elastic restart {restarts} after a worker failed" if restarts else ""
            logger.info(f"resumed from {meta['path']} at step {step} (saved by {meta['world_size']} process(es){why})")
        elif cfg.resume:
            logger.info(f"--resume: no checkpoint in {cfg.checkpoint_dir} yet; starting from step 0")
    # The steps still to run follow from the data position, not from the step count: after a
    # resume on another world size the steps already done were of another global batch.
    total = step + _steps_left(loader, per_epoch, epochs)
    if cfg.max_steps is not None:
        total = min(total, max(cfg.max_steps, step))
    logger.info(
        f"{task.name}: {ctx.world_size} process(es), strategy {ctx.strategy.name}, precision {ctx.precision.effective}, "
        f"batch {batch}/process, {total} steps on {ctx.device}, {workers} data worker(s)/process"
    )
    fault = _fault_injection(ctx.rank, restarts)
    ledger = SampleLedger(cfg.ledger, loader, ctx) if cfg.ledger else None
    if ledger is not None:
        ledger.begin(step)  # after the resume: the steps after `step` of earlier attempts no longer count
    progress = ProgressSink(total, start=step) if ctx.is_main else None
    sink = JsonlSink(cfg.metrics_file) if cfg.metrics_file and ctx.is_main else None
    meter = Throughput()  # the whole training time (the data wait's share)
    rate = steady_rate(ctx, cfg, batch, total - step)  # rates after warm-up (dtrain.metrics.throughput)
    wait = ctx.breakdown.data  # the breakdown's data wait (the loop marks each step's start and batch)
    obs = Observer(ctx, model, optimizer, cfg.stragglers, enabled=cfg.breakdown, tensorboard=cfg.tensorboard,
                   trace=cfg.trace, trace_file=cfg.trace_file, first_step=step)
    window_loss = torch.zeros((), device=ctx.device)
    window_steps, last_loss, start_step, save_block_s = 0, float("nan"), step, 0.0
    k = cfg.grad_accum
    # SIGUSR1/SIGTERM (caught from run()'s start): every rank saves at the next log interval,
    # then the job is requeued (dtrain.preempt); the hook reads `step` when it runs.
    if ckpt is not None:
        preempt.register(lambda: ckpt.save(step, model=model, optimizer=optimizer, loader=loader))
    preempted, signalled_here, elastic = False, False, Options.from_env().elastic is not None
    model.train()
    meter.start()
    rate.start()
    ctx.breakdown.step_starts()
    epoch = loader.next_epoch
    while step < total and not preempted:
        epoch = loader.next_epoch
        for x, y in loader:
            obs.slow.input()
            ctx.breakdown.got_batch()
            for xm, ym in zip(x.chunk(k), y.chunk(k)):
                with ctx.accumulate(model, steps=k):
                    loss = ctx.forward_backward(model, xm, ym, task.loss_fn)  # pipeline: micro-batches through the stages
                    window_loss += loss.float() / k
            optimizer.step()
            if step == start_step:  # before zero_grad: gradients and optimizer state both exist
                _log_memory(ctx, model, optimizer)
                obs.count_flops(task.new_model, x, y, task.loss_fn, batch)
            optimizer.zero_grad(set_to_none=True)
            step += 1
            rate.step_done()
            window_steps += 1
            if ledger is not None:
                ledger.commit(step)
            if fault is not None and step == fault:
                os.kill(os.getpid(), signal.SIGKILL)  # DTRAIN_FAULT_INJECT: a crash, for fault-tolerance tests
            if step % cfg.log_every == 0 or step == total:
                last_loss = ctx.all_reduce(window_loss / window_steps, op="mean").item()
                _stop_if_diverged(last_loss, step, cfg, task)
                window_loss.zero_()
                window_steps = 0
                record = {"step": step, "epoch": epoch, "train_loss": last_loss, "samples_per_s": _round(rate.window()),
                          "data_wait_ms": wait.window_median_ms(), "wall_s": round(time.perf_counter() - t0, 3)}
                record.update(_tokens(task, record["samples_per_s"]))
                record.update(obs.interval(step, record["samples_per_s"]))
                if progress:
                    progress.update(step, {"loss": last_loss, **{k: record.get(k) for k in ("samples_per_s", "tokens_per_s", "mfu")}})
                if sink:
                    sink.write(record)
                obs.write(record)
            obs.tick(step)
            if step % cfg.log_every == 0 and step < total and preempt.check(ctx, announce=not elastic):
                preempted, signalled_here = True, preempt.received() != 0
                break
            if ckpt is not None and cfg.save_every and step % cfg.save_every == 0 and step < total:
                if window_steps:  # never save a diverged model over the last good checkpoint
                    _stop_if_diverged(ctx.all_reduce(window_loss.clone(), op="max").item(), step, cfg, task)
                ckpt.save(step, model=model, optimizer=optimizer, loader=loader)
                save_block_s += ckpt.last_blocking_s or 0.0
                ctx.breakdown.lap("checkpoint")
            if step >= total:
                break
            ctx.breakdown.step_starts()
    if ctx.device.type == "cuda":
        torch.cuda.synchronize(ctx.device)
    meter.stop((step - start_step) * batch * ctx.data_parallel_size)
    rate.finish()
    ctx.breakdown.finish()  # closes the last step
    obs.close()
    preempt.uninstall()
    if progress:
        progress.close()
    if preempted:
        return _stopped(ctx, task, ckpt, step, rate, last_loss, t0, rejoin=elastic and _peers_leave(ctx, step, signalled_here))
    if ckpt is not None:
        ckpt.save(step, model=model, optimizer=optimizer, loader=loader)
        save_block_s += ckpt.last_blocking_s or 0.0
        ckpt.wait()
        if ctx.is_main:
            logger.info(f"checkpoints: training was held {save_block_s:.3f} s by saves ({'asynchronous' if cfg.async_save else 'synchronous'})")
    score = None
    if task.test_set is not None:
        score = ctx.evaluate(model, task.test_set, task.metric, batch_size=max(256, batch))["metric"]
    if sink:
        sink.close()
    data = _data_record(ctx, task, wait, meter, workers)
    sps = _round(rate.samples_per_s)  # steady state: warm-up apart (warmup_s)
    observed = obs.result(sps)
    return {
        "task": task.name,
        "world_size": ctx.world_size,
        "strategy": ctx.strategy.name,
        "precision": ctx.precision.effective,
        **_comm_record(ctx),
        "steps": step,
        "samples_per_s": sps,
        **_tokens(task, sps),
        **rate.record(),
        "train_loss": round(last_loss, 6),
        **_scores(task, score),
        **data,
        **observed,
        "wall_s": round(time.perf_counter() - t0, 3),
    }


class Diverged(ConfigError):
    """The training loss became NaN or infinite (every rank raises it at the same step)."""


def _stop_if_diverged(loss: float, step: int, cfg: TrainConfig, task: Task) -> None:
    """A NaN or infinite training loss stops the job (every rank sees the same reduced value),
    before anything is saved: the newest checkpoint stays the last good one."""
    if math.isfinite(loss):
        return
    kept = f"; nothing saved after it, {cfg.checkpoint_dir} keeps the last good checkpoint" if cfg.checkpoint_dir else ""
    raise Diverged(
        f"the training loss became {loss} at step {step} (lr {cfg.lr or task.lr:g}){kept}; "
        "lower --lr (or use gradient clipping / --precision fp32)."
    )


def _data_record(ctx: Context, task: Task, wait: DataWait, meter: Throughput, workers: int) -> dict[str, Any]:
    """``data_wait_ms`` (median per step, the first batch apart), ``data_wait_share`` (of the training time, the
    largest over ranks: the slowest rank's input holds every rank at the next all-reduce),
    and images skipped as unreadable; says on rank 0 when input was the bottleneck.
    Collective: call on every rank."""
    share = wait.total_s / meter.elapsed if meter.elapsed > 0 else 0.0
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

def _comm_record(ctx: Context) -> dict[str, Any]:
    """``comm`` (what was asked) and ``comm_choice`` (what ran: auto's pick), when the strategy has one."""
    return ctx.strategy.comm_record()


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


def _stopped(ctx: Context, task: Task, ckpt: Any, step: int, rate: SteadyRate, last_loss: float, t0: float, *,
             rejoin: bool = False) -> dict[str, Any]:
    """The result of a run stopped by a preemption signal (no final evaluation); ``rejoin``: an
    elastic job's worker that goes on in the next round (its peers' node left)."""
    if ckpt is None:
        logger.warning("preemption: no --checkpoint-dir, so a requeued job starts again from step 0")
    else:
        ckpt.wait()
    return {
        "task": task.name, "world_size": ctx.world_size, "strategy": ctx.strategy.name, "precision": ctx.precision.effective,
        "steps": step, "samples_per_s": _round(rate.samples_per_s),
        "train_loss": round(last_loss, 6), task.metric_name: None, "wall_s": round(time.perf_counter() - t0, 3), "preempted": True,
        **({"rejoin": True} if rejoin else {}),
    }


def _fault_injection(rank: int, restarts: int) -> int | None:
    """``DTRAIN_FAULT_INJECT=RANK:STEP``: that rank kills itself (SIGKILL) right after that step,
    on the first attempt only (restarts then resume normally). For fault-tolerance tests."""
    fault = Options.from_env().fault_inject
    if fault is None or restarts > 0:
        return None
    return fault[1] if fault[0] == rank else None


def _round(rate: float | None) -> float | None:
    return round(rate, 2) if rate else None


def steady_rate(ctx: Context, cfg: TrainConfig, batch: int, steps: int) -> SteadyRate:
    """The rate meter of this run: ``cfg.warmup_steps`` steps of warm-up, then steady state;
    on CUDA the end of warm-up waits for the device once, so its queued work counts as warm-up."""
    device = ctx.device
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else None
    return SteadyRate(batch * ctx.data_parallel_size, steps=steps, warmup_steps=cfg.warmup_steps, sync=sync)


def raise_small(task: Task, batch: int, world_size: int) -> None:
    raise ConfigError(
        f"task {task.name!r} has {len(task.train_set)} training samples, fewer than one batch of {batch} "
        f"for each of {world_size} processes; lower --batch-size."
    )

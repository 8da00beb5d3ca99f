"""One replica group of a fault-tolerant job, on torchft: one process, or the node's processes
under fsdp or a ``--parallel`` layout (``dtrain.ft.group``).

Each step: a quorum (a group that is behind heals from a live peer first), this group's slice of
the global order (``dtrain.ft.order``), forward and backward, the gradients averaged over the
quorum, then ``should_commit``: only a committed step moves the optimizer, the step count and the
data position; a step a lost peer failed is taken again by the next quorum.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import torch
from torch.utils.data import default_collate

from .._log import logger
from ..checkpoint import newest_valid
from ..context import preempt
from ..context.startup import init
from ..ft.ledger import FtLedger
from ..ft.order import GlobalOrder, StepPlan
from ..ft.overlap import Overlap
from ..ft.session import (
    Session,
    first_quorum,
    load_optimizer_snapshot,
    load_snapshot,
    model_digest,
    optimizer_snapshot,
    snapshot,
)
from ..ft.spec import FaultTolerance, FaultToleranceStopped, require_torchft
from ..metrics import JsonlSink
from ..metrics.tensorboard import TensorBoardSink
from ..parallel.clip import settle_grads
from ..tasks import load_task, make_optimizer
from ..world import World
from ..world.fastpath import auto_channels_last
from .config import TrainConfig
from .ft_check import refuse_other_launcher


def run_replica(cfg: TrainConfig, ft: FaultTolerance, *, replica_id: str, lighthouse: str, host: str,
                in_group: bool = False, restart: bool = False) -> dict[str, Any]:
    """Train ``cfg`` as replica group ``replica_id`` of the job whose Lighthouse is ``lighthouse``;
    ``host``: the address peers reach this process at; ``in_group``: this process is one of its
    group's (``dtrain.ft.group``; its environment says which); ``restart``: its launcher started
    it again after it died. Returns the result record (``ended``: the job had ended, nothing done)."""
    t0 = time.perf_counter()
    require_torchft()
    preempt.install()  # SIGTERM/SIGUSR1 only set a flag: the loop leaves at the next step boundary
    task = load_task(cfg.task.name, data_dir=cfg.task.data_dir, options=cfg.task.args)
    world = World.detect(device=cfg.runtime.device)
    if not in_group:
        refuse_other_launcher(world)
    ctx = replica_context(cfg, task, world)
    try:
        group = (world.rank, world.size, world.master_port) if in_group else None
        return _Replica(ctx, cfg, ft, task, replica_id, group, restart=restart).train(lighthouse, host, t0)
    finally:
        ctx.close()


def replica_context(cfg: TrainConfig, task: Any, world: World) -> Any:
    """A replica group's Context: one process, fsdp over the group, or its ``--parallel`` layout (the
    same in every group: rank i of each holds the same slices). Compile and activation checkpointing
    keep the parameters' names, so a peer's state still loads."""
    strategy, options = ("fsdp", cfg.parallel.strategy_options) if cfg.parallel.strategy == "fsdp" else ("single", {})
    if cfg.parallel.layout:
        strategy, options = "auto", {"parallel": cfg.parallel.layout, "tp_plan": task.tp_plan}
    run = cfg.runtime
    return init(strategy=strategy, precision=run.precision_spec(), seed=cfg.schedule.seed, world=world, compile=run.compile,
                activation_checkpointing=run.activation_checkpointing, **options)


class _Replica:
    overlap: Overlap | None = None
    """The average over the quorum overlapped with backward (set by ``train``); None: one all-reduce after it."""

    def __init__(self, ctx: Any, cfg: TrainConfig, ft: FaultTolerance, task: Any, replica_id: str,
                 group: tuple[int, int, int] | None = None, *, restart: bool = False) -> None:
        self.ctx, self.cfg, self.ft, self.task, self.replica_id = ctx, cfg, ft, task, replica_id
        self.group, self.restart = group, restart
        self.from_disk: str | None = None
        """The checkpoint this group resumed from; ``done``: the job's epochs were complete in it (or here)."""
        self.done = False
        self.rank, self.size = group[:2] if group is not None else (0, 1)
        """This process's rank in its replica group, and the group's processes (FSDP's shards)."""
        self.dp_rank, self.dp = ctx.strategy.data_parallel(ctx.world)
        """Which batch of the group's share this process reads, of how many (TP's ranks read the same)."""
        self.batch = cfg.batch.size or task.batch_size
        """One process's batch; the group's share of a step is ``dp`` of them."""
        model = task.new_model()
        optimizer = make_optimizer(cfg.optim.name or task.optimizer, model.parameters(), cfg.optim.lr or task.lr, device=ctx.device)
        run = cfg.runtime
        channels_last = run.channels_last or (run.fast and auto_channels_last(model, ctx.device, ctx.strategy))
        self.model, self.optimizer = ctx.setup(model, optimizer, channels_last=channels_last,
                                               blocks=task.blocks(model) if task.blocks else None)
        if task.load_weights is not None:  # --init-from, after the split (FSDP: each process reads its shards);
            task.load_weights(self.model)  # every group from the same weights, before a heal or a resume replaces them
        self.order = GlobalOrder(len(task.train_set), seed=cfg.schedule.seed, epochs=cfg.schedule.epochs or task.epochs)
        saving = cfg.checkpoint
        # One folder per replica group: each holds the whole state (the groups are replicas), and
        # no group waits on another's lock; after a whole-job loss the groups resume from their
        # own folders and the quorum heals the ones behind from the one ahead.
        self.ckpt = (ctx.checkpoints(os.path.join(saving.dir, f"replica-{replica_id}"), keep=saving.keep, async_save=saving.async_save)
                     if saving.dir else None)
        self.session: Any = None
        self.sinks: list[Any] = []
        """The metrics records' sinks (the group's rank 0; set by ``_loop``, closed by ``train``)."""

    # -- the state a returning replica group heals from (torchft's checkpoint transport) --
    # (under FSDP: this process's shards; the peer it heals from is the other group's same rank)
    def state_dict(self) -> dict[str, Any]:
        return {"model": snapshot(self.model), "optimizer": optimizer_snapshot(self.optimizer), "order": self.order.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        load_snapshot(self.model, state["model"])
        load_optimizer_snapshot(self.optimizer, state["optimizer"])
        self.order.load_state_dict(state["order"])

    def _objects(self) -> dict[str, Any]:
        return {"model": self.model, "optimizer": self.optimizer, "order": self.order}

    def save(self, step: int) -> None:
        if self.ckpt is not None:
            # epochs_done: the job's last save, so a group that comes back later reads that the job has ended
            # (its order alone cannot say: a step of fewer groups may still fit in the epoch's rest); a
            # count, so a --resume with more --epochs goes on
            done = self.order.epochs if self.done else None
            self.ckpt.save(step, extra={"torchft": self.manager.state_dict(), "epochs_done": done}, **self._objects())

    def _resume(self) -> None:
        """A group that comes back (restarted by its launcher, or ``--resume``) takes the job's newest
        checkpoint, its own or another group's: with no live peer (the others finished or died), that
        is where the job is; a live peer ahead of it heals it further at the first quorum."""
        if self.ckpt is None or not (self.restart or self.cfg.checkpoint.resume):
            return
        path = self._newest_of_job()
        if path is None or path == self.from_disk:
            return
        meta = self.ckpt.resume(path=path, **self._objects())
        self.manager.load_state_dict(meta["extra"]["torchft"])
        self.from_disk, self.done = path, (meta["extra"].get("epochs_done") or 0) >= self.order.epochs
        if self.rank == 0:  # one line per group
            logger.info(f"replica group {self.replica_id}: resumed from {meta['path']} at step {meta['step']}")

    def _newest_of_job(self) -> str | None:
        """The newest valid checkpoint of any replica group's folder (``--checkpoint-dir DIR/replica-*``);
        the group's rank 0 picks it, so its processes load the same."""
        best: tuple[int, str | None] = (-1, None)
        if self.rank == 0:
            root = self.cfg.checkpoint.dir
            for name in sorted(os.listdir(root)) if os.path.isdir(root) else []:
                if name.startswith("replica-") and os.path.isdir(os.path.join(root, name)):
                    path, _ = newest_valid(os.path.join(root, name))
                    if path is not None:
                        best = max(best, (int(os.path.basename(path).rpartition("-")[2]), path))
        return self.ckpt.run.collectives.broadcast_object(best[1]) if self.size > 1 else best[1]

    def _ended(self) -> bool:
        """The job's steps are complete in the state this group resumed: one line, and no training."""
        step, max_steps = self.manager.current_step(), self.cfg.schedule.max_steps
        why = ("its epochs were done" if self.done or self.order.plan(0, 1, self.batch * self.dp).done else
               f"--max-steps {max_steps} reached" if max_steps is not None and step >= max_steps else None)
        if why is not None and self.rank == 0:
            logger.warning(f"replica group {self.replica_id}: the job has ended ({why} at step {step}, in "
                           f"{self.from_disk}); not training it again")
        return why is not None

    def _join(self) -> tuple[int, int] | None:
        """The first quorum; None: the job has ended. A restarted group alone there reads the job's
        newest checkpoint again (the others' last saves): it goes on from there, or stops; never does
        it train the job again from step 0 alone (a second, different result)."""
        joined, alone = first_quorum(self.session, self.ft, self.restart, self._stop_saved)
        if not alone:
            return joined
        self._resume()
        if self._ended():
            return None
        if self.from_disk is None:
            raise FaultToleranceStopped(
                f"restarted, but alone in its quorum for {self.ft.quorum_timeout_s:g} s at step 0: no live replica group "
                "to heal from and no checkpoint of the job (--checkpoint-dir); the others have finished or are gone, and "
                "it does not train the job again from step 0 alone; restart the whole job (with --checkpoint-dir and --resume "
                "to go on from its checkpoints).")
        return joined

    def train(self, lighthouse: str, host: str, t0: float) -> dict[str, Any]:
        self.session = Session(self.ft, replica_id=self.replica_id, lighthouse=lighthouse, host=host,
                               state_dict=self.state_dict, load_state_dict=self.load_state_dict, group=self.group)
        self.manager = self.session.manager
        if self.cfg.parallel.strategy != "fsdp" and not self.cfg.parallel.layout:  # FSDP, TP, pp: the group's
            self.overlap = Overlap(self.manager, self.model.parameters())  # collectives make the gradient after backward
        self._joined_at: float | None = time.perf_counter()  # until the first commit: how long joining took
        try:
            self._resume()
            if self.from_disk is not None and self._ended():
                return {"ended": True, "left": None, "rank": self.rank}
            return self._loop(t0)
        finally:
            for sink in self.sinks:
                sink.close()
            self.session.shutdown()

    def _stop_saved(self, step: int) -> str:
        """A checkpoint before a stop (no quorum, a stop signal), and what the stop's line says of it."""
        self.save(step)
        return f"; saved step {step} to {self.ckpt.folder}" if self.ckpt is not None else ""

    def _loop(self, t0: float) -> dict[str, Any]:
        cfg, manager = self.cfg, self.manager
        seen = cfg.observe
        main = self.rank == 0  # one writer per group: its processes commit the same steps
        joined = self._join()
        if joined is None:
            return {"ended": True, "left": None, "rank": self.rank}
        # the ledger's header after the first quorum: it says where this group began (healed, or from disk)
        ledger = FtLedger(seen.ledger, self.replica_id, self.order.n) if seen.ledger and main else None
        if ledger is not None:
            ledger.begin(manager.current_step(), healed=bool(self.session.healed))
        self.sinks = self._sinks() if main else []
        stats = {"not_committed": 0, "participants": set()}
        loss = torch.zeros(())
        plan = None
        while not self._stop_signal():  # a stop signal: leave between steps, the others' next quorum goes on without us
            self.optimizer.zero_grad(set_to_none=True)
            rank, participants = joined or self.session.quorum(self._stop_saved)
            joined = None
            plan = self.order.plan(rank, participants, self.batch * self.dp)
            if plan.done or (cfg.schedule.max_steps is not None and manager.current_step() >= cfg.schedule.max_steps):
                self.done = plan.done  # --max-steps is read from the command line again by a later start
                break
            loss = self._forward_backward(plan)
            if not self.session.should_commit(participants):  # a peer lost mid-step, or too few groups: nobody moves
                stats["not_committed"] += 1
                continue
            self.optimizer.step()
            self.order.commit(plan)
            stats["participants"].add(participants)
            self._committed(plan, participants, loss, ledger, t0)
        step, left = manager.current_step(), self._stop_signal()
        if ledger is not None:
            if not left:  # the last plan's leftovers: the epoch's end (after a leave, the job goes on)
                ledger.end(step, plan)
            ledger.close()
        saved = self._stop_saved(step)
        if left and self.rank == 0:
            logger.warning(f"replica group {self.replica_id}: {signal.Signals(left).name} received; left the job after "
                           f"step {step}{saved} (the other groups go on)")
        return {**self._result(step, loss, stats, t0), "left": signal.Signals(left).name if left else None, "rank": self.rank}

    def _stop_signal(self) -> int:
        """The stop signal this process received (0: none), agreed by the group's processes: they
        leave at the same step boundary, or the one that stays would wait for the others' quorum."""
        left = int(preempt.received() or 0)
        if self.size == 1:
            return left
        flag = torch.tensor([left])
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
        return int(flag.item())

    def _sinks(self) -> list[Any]:
        """Where the group's metrics records go: ``--metrics-file`` (shared by the groups, each record
        names its replica) and ``--tensorboard DIR``'s ``replica-ID`` folder (one TensorBoard run a group)."""
        seen = self.cfg.observe
        sinks: list[Any] = [JsonlSink(seen.metrics_file)] if seen.metrics_file else []
        if seen.tensorboard:
            sinks.append(TensorBoardSink(os.path.join(seen.tensorboard, f"replica-{self.replica_id}")))
        return sinks

    def _committed(self, plan: StepPlan, participants: int, loss: torch.Tensor, ledger: FtLedger | None, t0: float) -> None:
        """A committed step's records: the ledger, the metrics, the first commit's line, a due checkpoint."""
        step, cfg = self.manager.current_step(), self.cfg
        if ledger is not None:
            ledger.commit(step, plan)
        if self.sinks and step % cfg.observe.log_every == 0:
            record = {"step": step, "epoch": plan.epoch, "train_loss": round(loss.item(), 6), "replica": self.replica_id,
                      "participants": participants, "global_batch": participants * self.batch * self.dp,
                      "wall_s": round(time.perf_counter() - t0, 3), "time": round(time.time(), 3)}
            for sink in self.sinks:
                sink.write(record)
        if self._joined_at is not None and self.rank == 0:
            healed = self.session.healed
            healed = f", healed from a peer to step {healed[-1]}" if healed else ""
            logger.info(f"replica group {self.replica_id}: committed step {step} with {participants} group(s){healed}, "
                        f"{time.perf_counter() - self._joined_at:.2f} s after reaching the Lighthouse")
            self._joined_at = None
        if cfg.checkpoint.save_every and step % cfg.checkpoint.save_every == 0:
            self.save(step)

    def _forward_backward(self, plan: StepPlan) -> torch.Tensor:
        """This process's part of its group's share of the step: ``--grad-accum K`` micro-batches (each
        loss over K, so the gradient is the mean over the share; FSDP averages it over the group's
        processes), then the average over the quorum: overlapped with the last micro-batch's backward
        (``self.overlap``), else one all-reduce after it."""
        mine = plan.mine[self.dp_rank * self.batch:(self.dp_rank + 1) * self.batch]
        x, y = default_collate([self.task.train_set[i] for i in mine])
        x, y = x.to(self.ctx.device), y.to(self.ctx.device)
        k = self.cfg.batch.grad_accum
        loss = torch.zeros((), device=self.ctx.device)
        staged = self.ctx.strategy.capabilities.staged_step  # pp: the schedule runs forward and backward in one call
        for i, (xm, ym) in enumerate(zip(x.chunk(k), y.chunk(k))):
            if staged:
                loss += self.ctx.forward_backward(self.model, xm, ym, self.task.loss_fn) / k
                continue
            if self.overlap is not None and i == k - 1:
                self.overlap.arm()  # the window's last backward sends each bucket as it completes
            micro = self.task.loss_fn(self.model(xm), ym) / k
            micro.backward()
            loss += micro.detach()
        for p in self.model.parameters() if staged and k > 1 else ():
            if p.grad is not None:
                p.grad.div_(k)  # the schedule's loss is each micro-batch's mean: the window's mean as above
        if self.cfg.parallel.layout:  # TP's sequence parallelism leaves a LayerNorm's gradient Partial (a sum
            settle_grads(self.model.parameters())  # over TP ranks still to take): the true one is averaged, stepped, saved
        if self.overlap is not None:  # its buckets left during backward: wait for them
            self.overlap.finish(self.model.buffers())
        else:
            self.session.average_gradients(self.model.parameters(), self.model.buffers())
        return loss

    def _result(self, step: int, loss: torch.Tensor, stats: dict[str, Any], t0: float) -> dict[str, Any]:
        task = self.task
        score = None
        if task.test_set is not None:
            score = self.ctx.evaluate(self.model, task.test_set, task.metric, batch_size=max(256, self.batch))["metric"]
        sizes = sorted(stats["participants"])
        return {
            "task": task.name, "replica": self.replica_id, "steps": step, "train_loss": round(float(loss), 6),
            task.metric_name: round(score, 6) if score is not None else None,
            "fault_tolerance": {
                "min_replicas": self.ft.min_replicas, "batch_rule": "per-replica", "processes_per_replica": self.size,
                "batch_per_replica": self.batch * self.dp, "participants_min": sizes[0] if sizes else None,
                "participants_max": sizes[-1] if sizes else None, "steps_not_committed": stats["not_committed"],
                "healed_at_steps": self.session.healed, "epoch": self.order.epoch,
                "model_digest": model_digest(self.model),
            },
            "wall_s": round(time.perf_counter() - t0, 3),
        }


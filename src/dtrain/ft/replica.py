"""One replica group of a fault-tolerant job (one process for now), on torchft.

Each step: a quorum from the Lighthouse (torchft's Manager; a replica group that is behind heals
from a live peer's memory before the step), this group's slice of the global order
(``order.py``), forward and backward, the gradients averaged over the quorum (torchft's
fault-tolerant all-reduce, on a gloo group torchft reconfigures in place), then ``should_commit``:
only a committed step moves the optimizer, the step count and the data position. A peer lost
mid-step fails the step's collective; nobody commits it and the next quorum, without the lost
peer, takes the same samples again.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
import warnings
from datetime import timedelta
from typing import Any

import torch
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from torch.utils.data import default_collate

from .._log import configure_cli_logging, logger
from ..context.startup import init
from ..errors import ConfigError, DtrainError
from ..metrics import JsonlSink
from ..tasks import load_task, make_optimizer
from ..train.config import TrainConfig
from ..world import World
from .ledger import FtLedger
from .order import GlobalOrder, StepPlan
from .spec import FaultTolerance, FaultToleranceStopped, require_torchft

CONNECT_TIMEOUT = timedelta(seconds=10)
"""How long a replica group tries to reach the Lighthouse when it starts."""


def replica_main(cfg: TrainConfig, ft: FaultTolerance, replica_id: str, lighthouse: str, host: str) -> None:
    """Entry point of one replica group's process: train, print its result line, or one line and exit status."""
    os.environ.setdefault("RUST_LOG", "warn")  # read when torchft loads: else its servers log every quorum
    # torchft logs a failed all-reduce with its traceback; the loop says it in one line instead.
    logging.getLogger("torchft").setLevel(logging.CRITICAL)
    # torch's loader of a peer's state (torchft's HTTP transport) warns that its buffer is read-only.
    warnings.filterwarnings("ignore", message="The given buffer is not writable")
    configure_cli_logging(0)
    try:
        result = run_replica(cfg, ft, replica_id=replica_id, lighthouse=lighthouse, host=host)
    except DtrainError as exc:
        print(f"dtrain: error: replica group {replica_id}: {exc}", file=sys.stderr, flush=True)
        sys.exit(exc.exit_code)
    print(json.dumps(result), flush=True)


def run_replica(cfg: TrainConfig, ft: FaultTolerance, *, replica_id: str, lighthouse: str, host: str) -> dict[str, Any]:
    """Train ``cfg`` as replica group ``replica_id`` of the job whose Lighthouse is ``lighthouse``;
    ``host``: the address peers reach this process at. Returns the result record."""
    t0 = time.perf_counter()
    require_torchft()
    task = load_task(cfg.task.name, data_dir=cfg.task.data_dir, options=cfg.task.args)
    world = World.detect(device=cfg.runtime.device)
    if world.distributed:
        raise ConfigError(f"--fault-tolerance runs each replica group as one process for now, got {world.size} processes "
                          "in this group; start one process per replica group (--nproc N gives N replica groups).")
    ctx = init(strategy="single", precision=cfg.runtime.precision_spec(), seed=cfg.schedule.seed, world=world)
    try:
        return _Replica(ctx, cfg, ft, task, replica_id).train(lighthouse, host, t0)
    finally:
        ctx.close()


class _Replica:
    def __init__(self, ctx: Any, cfg: TrainConfig, ft: FaultTolerance, task: Any, replica_id: str) -> None:
        self.ctx, self.cfg, self.ft, self.task, self.replica_id = ctx, cfg, ft, task, replica_id
        self.batch = cfg.batch.size or task.batch_size
        model = task.new_model()
        optimizer = make_optimizer(cfg.optim.name or task.optimizer, model.parameters(), cfg.optim.lr or task.lr, device=ctx.device)
        self.model, self.optimizer = ctx.setup(model, optimizer)
        self.order = GlobalOrder(len(task.train_set), seed=cfg.schedule.seed, epochs=cfg.schedule.epochs or task.epochs)
        saving = cfg.checkpoint
        # One folder per replica group: each holds the whole state (the groups are replicas), and
        # no group waits on another's lock; after a whole-job loss the groups resume from their
        # own folders and the quorum heals the ones behind from the one ahead.
        self.ckpt = ctx.checkpoints(os.path.join(saving.dir, f"replica-{replica_id}"), keep=saving.keep) if saving.dir else None
        self.healed: list[int] = []
        """The steps this group healed to from a peer (step 0: the initial sync of a fresh job)."""
        self.manager: Any = None

    # -- the state a returning replica group heals from (torchft's checkpoint transport) --
    def state_dict(self) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(), "order": self.order.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.order.load_state_dict(state["order"])
        self.healed.append(self.manager.current_step())  # torchft set the step before it hands us the state

    def _objects(self) -> dict[str, Any]:
        return {"model": self.model, "optimizer": self.optimizer, "order": self.order}

    def save(self, step: int) -> None:
        if self.ckpt is not None:
            self.ckpt.save(step, extra={"torchft": self.manager.state_dict()}, **self._objects())

    def _resume(self) -> None:
        if self.ckpt is None or not self.cfg.checkpoint.resume:
            return
        meta = self.ckpt.resume(**self._objects())
        if meta is not None:
            self.manager.load_state_dict(meta["extra"]["torchft"])
            logger.info(f"replica group {self.replica_id}: resumed from {meta['path']} at step {meta['step']}")

    def _manager(self, lighthouse: str, host: str) -> Any:
        from torch.distributed import TCPStore
        from torchft import Manager, ProcessGroupGloo

        ft = self.ft
        step_timeout = timedelta(seconds=ft.step_timeout_s)
        self._store = TCPStore(host, 0, is_master=True, wait_for_workers=False)  # this group's own store
        try:
            return Manager(pg=ProcessGroupGloo(timeout=step_timeout), load_state_dict=self.load_state_dict,
                           state_dict=self.state_dict, min_replica_size=ft.min_replicas,
                           # the quorum (and any healing) before the step: the step's samples depend on it
                           use_async_quorum=False, rank=0, world_size=1, store_addr=host, store_port=self._store.port,
                           lighthouse_addr=lighthouse, replica_id=self.replica_id, hostname=host, timeout=step_timeout,
                           quorum_timeout=timedelta(seconds=ft.quorum_timeout_s), connect_timeout=CONNECT_TIMEOUT,
                           checkpoint_transport=_transport(host, step_timeout))
        except RuntimeError as exc:  # torchft's server could not reach the Lighthouse
            reason = str(exc).rsplit(": ", 1)[-1].strip()[:80]
            raise ConfigError(f"cannot reach the Lighthouse at {lighthouse} within {CONNECT_TIMEOUT.seconds} s ({reason}); "
                              "check --lighthouse (or --master-addr), and that node 0's job is up.") from None

    def train(self, lighthouse: str, host: str, t0: float) -> dict[str, Any]:
        self.manager = manager = self._manager(lighthouse, host)
        self._joined_at: float | None = time.perf_counter()  # until the first commit: how long joining took
        try:
            self._resume()
            return self._loop(t0)
        finally:
            manager.shutdown(wait=False)

    def _quorum(self) -> tuple[int, int]:
        """The quorum of the next step (and healing, if this group is behind): (our rank, participants)."""
        try:
            self.manager.start_quorum()
            rank, participants = self.manager.participating_rank(), self.manager.num_participants()
        except Exception as exc:  # torchft raises what its RPC raised: a timeout, a refused connection
            step = self.manager.current_step()
            self.save(step)
            saved = f"; saved step {step} to {self.ckpt.folder}" if self.ckpt is not None else ""
            raise FaultToleranceStopped(
                f"no quorum within {self.ft.quorum_timeout_s:g} s at step {step} (the Lighthouse is gone, or fewer than "
                f"min={self.ft.min_replicas} replica group(s) are up: {str(exc).splitlines()[0][:160]}){saved}; "
                "restart the job (with --resume to continue from the checkpoints).") from None
        if rank is None:
            raise FaultToleranceStopped("this replica group is not a participant of its quorum (a spare); "
                                        "spares are not supported yet.")
        return rank, participants

    def _loop(self, t0: float) -> dict[str, Any]:
        cfg, manager = self.cfg, self.manager
        seen = cfg.observe
        ledger = FtLedger(seen.ledger, self.replica_id, self.order.n) if seen.ledger else None
        sink = JsonlSink(seen.metrics_file) if seen.metrics_file else None
        stats = {"not_committed": 0, "participants": set()}
        loss = torch.zeros(())
        first, plan = True, None
        while True:
            self.optimizer.zero_grad(set_to_none=True)
            rank, participants = self._quorum()
            if first and ledger is not None:
                ledger.begin(manager.current_step(), healed=bool(self.healed))
            first = False
            plan = self.order.plan(rank, participants, self.batch)
            if plan.done or (cfg.schedule.max_steps is not None and manager.current_step() >= cfg.schedule.max_steps):
                break
            loss = self._forward_backward(plan)
            if not manager.should_commit():  # a peer lost mid-step, or too few replica groups: nobody moves
                stats["not_committed"] += 1
                self._not_committed(participants)
                continue
            self.optimizer.step()
            self.order.commit(plan)
            stats["participants"].add(participants)
            self._committed(plan, participants, loss, ledger, sink, t0)
        step = manager.current_step()
        if ledger is not None:
            ledger.end(step, plan)
            ledger.close()
        self.save(step)
        return self._result(step, loss, stats, t0)

    def _committed(self, plan: StepPlan, participants: int, loss: torch.Tensor, ledger: FtLedger | None, sink: Any,
                   t0: float) -> None:
        """A committed step's records: the ledger, the metrics, the first commit's line, a due checkpoint."""
        step, cfg = self.manager.current_step(), self.cfg
        if ledger is not None:
            ledger.commit(step, plan)
        if sink is not None and step % cfg.observe.log_every == 0:
            sink.write({"step": step, "epoch": plan.epoch, "train_loss": round(loss.item(), 6), "replica": self.replica_id,
                        "participants": participants, "global_batch": participants * self.batch,
                        "wall_s": round(time.perf_counter() - t0, 3), "time": round(time.time(), 3)})
        if self._joined_at is not None:
            healed = f", healed from a peer to step {self.healed[-1]}" if self.healed else ""
            logger.info(f"replica group {self.replica_id}: committed step {step} with {participants} group(s){healed}, "
                        f"{time.perf_counter() - self._joined_at:.2f} s after reaching the Lighthouse")
            self._joined_at = None
        if cfg.checkpoint.save_every and step % cfg.checkpoint.save_every == 0:
            self.save(step)

    def _not_committed(self, participants: int) -> None:
        error = self.manager.errored()
        why = (str(error.original_exception).strip().splitlines() or ["?"])[0][:160] if error is not None else (
            f"{participants} replica group(s), fewer than min={self.ft.min_replicas}")
        logger.warning(f"replica group {self.replica_id}: step {self.manager.current_step() + 1} not committed ({why}); "
                       "the next quorum takes its samples again")

    def _forward_backward(self, plan: StepPlan) -> torch.Tensor:
        x, y = default_collate([self.task.train_set[i] for i in plan.mine])
        x, y = x.to(self.ctx.device), y.to(self.ctx.device)
        loss = self.task.loss_fn(self.model(x), y)
        loss.backward()
        average_gradients(self.manager, self.model)
        return loss.detach()

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
                "min_replicas": self.ft.min_replicas, "batch_rule": "per-replica",
                "batch_per_replica": self.batch, "participants_min": sizes[0] if sizes else None,
                "participants_max": sizes[-1] if sizes else None, "steps_not_committed": stats["not_committed"],
                "healed_at_steps": self.healed, "epoch": self.order.epoch,
            },
            "wall_s": round(time.perf_counter() - t0, 3),
        }


def average_gradients(manager: Any, model: torch.nn.Module) -> None:
    """The gradients averaged over the quorum by torchft's fault-tolerant all-reduce, as one flat
    buffer. A failed all-reduce (a peer lost mid-step) is reported to the manager, so the step is
    not committed. torchft 0.2.0's DistributedDataParallel is not used for this: when a peer dies
    during its all-reduce, its comm hook fails an assertion instead (benchmarks/ft_ddp_peer_loss.py)."""
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        if p.grad is None:  # unused this step: every group must still send the same buffer
            p.grad = torch.zeros_like(p)
    grads = [p.grad for p in params]
    flat = _flatten_dense_tensors(grads)
    manager.allreduce(flat).wait()
    for grad, averaged in zip(grads, _unflatten_dense_tensors(flat, grads)):
        grad.copy_(averaged)


def _transport(host: str, timeout: timedelta) -> Any:
    """torchft's HTTP checkpoint transport (a healing peer fetches this group's state from it),
    advertised at ``host``: torchft's own advertises ``socket.gethostname()``, which on hosts that
    share one name (or whose name resolves to loopback) sends the peer to itself."""
    from torchft.checkpointing import HTTPTransport

    class _AtHost(HTTPTransport):
        def address(self) -> str:
            return f"http://{_url_host(host)}:{self._server.socket.getsockname()[1]}/checkpoint/"

    return _AtHost(timeout=timeout, num_chunks=0)


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host

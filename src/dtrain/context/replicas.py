"""A user's own loop as one replica group of a fault-tolerant job (``dtrain.init(fault_tolerance=True)``,
started by ``dtrain run --fault-tolerance``): the torchft session of ``dtrain.ft.session`` behind
the Context's calls (docs/fault-tolerance.md, "Your own loop").

Fetching a batch forms the step's quorum (a group that is behind heals there from a live peer:
the models, the optimizers and the data position) and plans this group's slice of the global
order (``dtrain.ft.order``); only ``should_commit() == True`` moves the data position, so a step
not committed is trained again by the next quorum. Under ``ctx.accumulate(model, steps=K)`` the
window's K batches share one quorum and vote once, after the last; an epoch's end cuts a window
short. A stop signal only sets a flag (``dtrain.context.preempt``): the step in flight votes, the
loader's passes end, and ``ctx.close()`` exits with ``LEFT_EXIT`` (its launcher does not restart it).
"""

from __future__ import annotations

import dataclasses
import signal
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, RandomSampler, SequentialSampler

from .._log import logger
from ..data.loader import to_device
from ..errors import ConfigError
from ..ft.launch import reach
from ..ft.ledger import FtLedger
from ..ft.order import GlobalOrder, StepPlan
from ..ft.session import Session, first_quorum, quiet_torchft, snapshot
from ..ft.spec import LEFT_EXIT, FaultTolerance, FaultToleranceStopped, lighthouse_address
from ..options import FaultToleranceLink

_NO_JOB = ("dtrain.init(fault_tolerance=True) needs the job's Lighthouse and this group's id (DTRAIN_FT_LIGHTHOUSE, "
           "DTRAIN_FT_REPLICA); start the script with dtrain run --fault-tolerance script.py (add --lighthouse HOST:PORT "
           "--replica-id ID to join a running job).")


def requested(fault_tolerance: Any, link: FaultToleranceLink) -> FaultTolerance | None:
    """The settings ``dtrain.init(fault_tolerance=...)`` asks for (None, the default: whether the
    launcher started this process as a replica group), or None for a job without fault tolerance."""
    if fault_tolerance is None:
        fault_tolerance = link.spec is not None
    if isinstance(fault_tolerance, FaultTolerance):
        return fault_tolerance
    if fault_tolerance is False:
        return None
    if fault_tolerance is True:
        return FaultTolerance.parse(link.spec)
    if isinstance(fault_tolerance, str):
        return FaultTolerance.parse(fault_tolerance)
    raise ConfigError(f"dtrain.init(fault_tolerance=...) got {type(fault_tolerance).__name__} {fault_tolerance!r}; "
                      "give True, False, or settings such as 'min=2,heartbeat=1'.")


def check(world: Any, strategy: Any) -> None:
    """A replica group is one process for now, and replicates the whole model."""
    if world.distributed:
        raise ConfigError(f"dtrain.init(fault_tolerance=True) runs each replica group as one process for now, got "
                          f"{world.size} processes in this group; start one process per group (dtrain run --fault-tolerance "
                          "-n N: N groups).")
    if strategy not in ("auto", "single"):
        raise ConfigError(f"dtrain.init(fault_tolerance=True) replicates the whole model across replica groups, got "
                          f"strategy={strategy!r}; leave strategy out (sharding inside a group is not supported yet).")


class Replicas:
    """This process's replica group: its session, the objects a peer heals from, the data's position."""

    def __init__(self, ft: FaultTolerance, link: FaultToleranceLink, *, seed: int, device: torch.device) -> None:
        if link.lighthouse is None or link.replica_id is None:
            raise ConfigError(_NO_JOB)
        quiet_torchft()
        lighthouse = lighthouse_address(link.lighthouse)
        self.replica_id, self.seed, self.device = link.replica_id, seed, device
        self.ft, self.restart = ft, link.restart
        self.models: list[nn.Module] = []
        self.optimizers: list[torch.optim.Optimizer] = []
        self.order: GlobalOrder | None = None
        self.batch = 1
        self.ledger: FtLedger | None = None
        self.pending: tuple[int, int] | None = None
        """A quorum taken and not yet used by a step: (our rank, participants)."""
        self.plan: StepPlan | None = None
        """The step whose batch was handed out, until ``should_commit``."""
        self.session = Session(ft, replica_id=link.replica_id, lighthouse=lighthouse, host=reach(lighthouse),
                               state_dict=self.state_dict, load_state_dict=self.load_state_dict)
        from . import preempt  # here, not at the top: preempt names the Context, which imports this module

        preempt.install()  # a stop signal only sets a flag: the group leaves between steps (see the module)

    # -- what a returning group heals from --------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"models": [snapshot(m) for m in self.models], "optimizers": [o.state_dict() for o in self.optimizers],
                "order": self.order.state_dict() if self.order is not None else None}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if len(state["models"]) != len(self.models) or len(state["optimizers"]) != len(self.optimizers):
            raise ConfigError(f"replica group {self.replica_id} set up {len(self.models)} model(s) and {len(self.optimizers)} "
                              f"optimizer(s), its peer {len(state['models'])} and {len(state['optimizers'])}; every group "
                              "must run the same script.")
        for obj, saved in [*zip(self.models, state["models"]), *zip(self.optimizers, state["optimizers"])]:
            obj.load_state_dict(saved)
        if self.order is not None and state["order"] is not None:
            self.order.load_state_dict(state["order"])

    # -- the Context's calls ----------------------------------------------------------------
    def add(self, model: nn.Module | None = None, optimizer: torch.optim.Optimizer | None = None) -> None:
        if self.order is not None:
            raise ConfigError("under fault tolerance, set up every model and optimizer before ctx.setup_dataloader "
                              "(its first quorum heals this group from a peer: they must all be there).")
        if model is not None:
            self.models.append(model)
        if optimizer is not None:
            self.optimizers.append(optimizer)

    def loader(self, loader: DataLoader, *, ledger: str | None, move_to_device: bool,
               window_open: Callable[[], bool] = lambda: False, on_last: Callable[[bool], None] = lambda last: None) -> FtLoader:
        """``window_open()``: the last batch was a micro-step that does not end its ``ctx.accumulate``
        window; ``on_last(flag)``: this batch ends the epoch (a window ends with it), as ``DeviceLoader``'s."""
        if self.order is not None:
            raise ConfigError("under fault tolerance a job has one data set; call ctx.setup_dataloader once.")
        if not self.models:
            raise ConfigError("under fault tolerance, call ctx.setup(model, optimizer) before ctx.setup_dataloader "
                              "(its first quorum heals this group from a peer).")
        if loader.batch_size is None or not isinstance(loader.sampler, (RandomSampler, SequentialSampler)):
            raise ConfigError("under fault tolerance setup_dataloader needs a DataLoader built with batch_size= and no "
                              "sampler of its own (the samples follow the job's global order); e.g. "
                              "DataLoader(dataset, batch_size=32, shuffle=True).")
        self.order = GlobalOrder(len(loader.dataset), seed=self.seed, epochs=2**31)  # the user's loop says how many
        self.batch = loader.batch_size
        self._window_open = window_open
        self.left = 0
        """The stop signal this group left the job on (0: none)."""
        self.pending = self._join()  # heals a group that is behind now: loader.next_epoch is the job's
        if ledger is not None:  # after the first quorum: a group that stops in _join leaves no file
            self.ledger = FtLedger(ledger, self.replica_id, self.order.n)
            self.ledger.begin(self.session.step, healed=bool(self.session.healed))
        device = self.device if move_to_device else torch.device("cpu")
        return FtLoader(self, loader, device, on_last)

    def _join(self) -> tuple[int, int]:
        """The first quorum; a restarted group alone there stops with one line: it never trains the
        job again from step 0 alone (a second, different result)."""
        joined, alone = first_quorum(self.session, self.ft, self.restart)
        if not alone:
            return joined
        self.session.shutdown()
        raise FaultToleranceStopped(
            f"replica group {self.replica_id}: restarted, but alone in its quorum for {self.ft.quorum_timeout_s:g} s at step 0: "
            "no live replica group to heal from; the others have finished or are gone, and it does not train the job "
            "again from step 0 alone; restart the whole job (resuming from your script's checkpoints).")

    def next_plan(self, batch: int) -> StepPlan:
        if self.plan is not None and self._window_open():
            return self._extend(self.plan, batch)  # the window's next micro-batch: the same step and quorum
        if self.plan is not None:
            raise ConfigError("under fault tolerance every step ends with ctx.should_commit() (then optimizer.step() when "
                              "it is True); this loop fetched the next batch without it.")
        if self.pending is None:
            self.pending = self.session.quorum()
        assert self.order is not None
        return self.order.plan(*self.pending, batch)

    def _extend(self, window: StepPlan, batch: int) -> StepPlan:
        """``window`` and the next ``participants x batch`` samples of its epoch's order (this group's
        slice of them added to ``mine``): one step of several micro-batches, as one step of the sum."""
        assert self.pending is not None and self.order is not None
        rank, participants = self.pending
        pos, width = window.start + len(window.step_indices), participants * batch
        more = self.order.order(window.epoch)[pos:pos + width]
        if len(more) < width:  # on_last cut the window at the epoch's end: only a loop that ignores it gets here
            raise ConfigError("under fault tolerance an accumulation window ends with its epoch; enter "
                              "ctx.accumulate(model, steps=K) for every batch of the loader, then ctx.should_commit().")
        return dataclasses.replace(window, step_indices=window.step_indices + more,
                                   mine=window.mine + more[rank * batch:(rank + 1) * batch])

    def remaining_after(self, plan: StepPlan, batch: int) -> bool:
        """Whether another micro-batch of ``plan``'s quorum fits in its epoch after ``plan``."""
        assert self.pending is not None and self.order is not None
        return self.order.n - (plan.start + len(plan.step_indices)) >= self.pending[1] * batch

    def should_commit(self) -> bool:
        """Collective over the quorum (see ``Context.should_commit``)."""
        plan = self.plan
        if plan is None:
            raise ConfigError("ctx.should_commit() ends a step: call it after the backward of a batch from the loader "
                              "ctx.setup_dataloader returned, once per batch.")
        if self._window_open():
            return False  # a micro-step inside its window: the step goes on with the next batch
        assert self.pending is not None and self.order is not None
        participants = self.pending[1]
        self.plan = self.pending = None  # the next step asks for its own quorum
        self.session.average_gradients((p for m in self.models for p in m.parameters()), (b for m in self.models for b in m.buffers()))
        if not self.session.should_commit(participants):
            return False
        self.order.commit(plan)
        if self.ledger is not None:
            self.ledger.commit(self.session.step, plan)
        return True

    def leaving(self) -> bool:
        """Whether a stop signal came (checked between steps: the group leaves there)."""
        from . import preempt

        self.left = self.left or preempt.received()
        return bool(self.left)

    def close(self) -> None:
        """After a leave: ``SystemExit(LEFT_EXIT)`` once everything is closed (see the module)."""
        left = getattr(self, "left", 0)
        if self.ledger is not None:
            if not left and self.pending is not None and self.order is not None:  # what the last epoch left out
                self.ledger.end(self.session.step, self.order.plan(*self.pending, self.batch))
            self.ledger.close()  # after a leave the job goes on: its end is the others' to write
        self.session.shutdown()
        if left:
            logger.warning(f"replica group {self.replica_id}: {signal.Signals(left).name} received; left the job after "
                           f"step {self.session.step} (the other groups go on)")
            raise SystemExit(LEFT_EXIT)  # not a failure, and not the job's end: its launcher does not restart it


class FtLoader:
    """The loader ``ctx.setup_dataloader`` returns under fault tolerance: one pass is the rest of
    the current epoch of the global order; each batch is this group's share of the next step."""

    def __init__(self, replicas: Replicas, loader: DataLoader, device: torch.device,
                 on_last: Callable[[bool], None] = lambda last: None) -> None:
        self._replicas, self.loader, self.device, self._on_last = replicas, loader, device, on_last
        self._ended_at: int | None = None
        """The epoch of the step that ended the last pass (the next pass is that epoch's)."""

    @property
    def next_epoch(self) -> int:
        """The epoch the next pass will run (a group that healed from a peer: the peer's), as
        ``DeviceLoader.next_epoch``."""
        order = self._replicas.order
        assert order is not None
        return order.epoch + (1 if order.n - order.pos < self._width() else 0)

    def _width(self) -> int:
        pending = self._replicas.pending
        return (pending[1] if pending is not None else 1) * self.loader.batch_size  # type: ignore[operator]

    def __iter__(self) -> Iterator[Any]:
        replicas, batch = self._replicas, self.loader.batch_size
        assert batch is not None
        epoch = self._ended_at
        self._on_last(False)  # a new pass starts a new accumulation window
        while True:
            window = replicas.plan
            if window is None and replicas.leaving():
                return  # a stop signal: leave between steps (this pass and every later one end here)
            plan = replicas.next_plan(batch)
            if plan.done or (epoch is not None and plan.epoch > epoch):
                self._ended_at = plan.epoch
                return  # the quorum stays pending: the next pass (or ctx.close) uses it
            # An earlier epoch inside this pass: the step that began this epoch was not committed, and the
            # next quorum (fewer groups) still fits a step in the previous epoch's rest. It is trained in this
            # pass, so the passes (the script's epochs) keep counting the data's epochs.
            epoch = plan.epoch if epoch is None else epoch
            replicas.plan = plan
            # this batch's samples: the window's new slice (the whole plan for a window's first batch)
            new = plan.mine[len(window.mine):] if window is not None else plan.mine
            last = not replicas.remaining_after(plan, batch)
            if window is None or last:  # a window's first batch: not the epoch's end unless it is (a retried
                self._on_last(last)     # window after one cut at the end may now fit more batches)
            samples = self.loader.collate_fn([self.loader.dataset[i] for i in new])
            yield to_device(samples, self.device)

    def __len__(self) -> int:
        """Steps in a whole epoch at the current quorum's size."""
        order = self._replicas.order
        assert order is not None
        return order.n // self._width()

"""A user's own loop as one replica group of a fault-tolerant job (``dtrain.init(fault_tolerance=True)``,
started by ``dtrain run --fault-tolerance``): the same torchft session as ``dtrain train
--fault-tolerance`` (``dtrain.ft.session``), behind the Context's own calls.

    ctx = dtrain.init(fault_tolerance=True)
    model, optimizer = ctx.setup(model, optimizer)      # what a returning group heals from
    loader = ctx.setup_dataloader(DataLoader(train_set, batch_size=32, shuffle=True))
    for epoch in range(loader.next_epoch, 3):                # a group that healed starts at its peers' epoch
        for x, y in loader:                              # each batch: the step's quorum, then this group's share
            optimizer.zero_grad()
            ctx.backward(loss_fn(model(x), y))
            if ctx.should_commit():                      # gradients averaged over the quorum, then torchft's vote
                optimizer.step()

Fetching a batch forms the step's quorum (a group that is behind heals there, from a live peer's
memory: the models, the optimizers and the data position) and plans the step from the global
order (``dtrain.ft.order``): this group's slice of ``participants x batch_size`` samples. Only
``should_commit() == True`` moves the data position, so a step that is not committed is trained
again, by whoever is in the next quorum. ``setup_dataloader`` takes the first quorum at once, so
``loader.next_epoch`` is the healed group's epoch before its loop starts.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, RandomSampler, SequentialSampler

from ..data.loader import to_device
from ..errors import ConfigError
from ..ft.launch import reach
from ..ft.ledger import FtLedger
from ..ft.order import GlobalOrder, StepPlan
from ..ft.session import Session, quiet_torchft, snapshot
from ..ft.spec import FaultTolerance, lighthouse_address
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

    def loader(self, loader: DataLoader, *, ledger: str | None, move_to_device: bool) -> FtLoader:
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
        if ledger is not None:
            self.ledger = FtLedger(ledger, self.replica_id, self.order.n)
        self.pending = self.session.quorum()  # heals a group that is behind now: loader.next_epoch is the job's
        if self.ledger is not None:
            self.ledger.begin(self.session.step, healed=bool(self.session.healed))
        device = self.device if move_to_device else torch.device("cpu")
        return FtLoader(self, loader, device)

    def next_plan(self, batch: int) -> StepPlan:
        if self.plan is not None:
            raise ConfigError("under fault tolerance every step ends with ctx.should_commit() (then optimizer.step() when "
                              "it is True); this loop fetched the next batch without it.")
        if self.pending is None:
            self.pending = self.session.quorum()
        assert self.order is not None
        return self.order.plan(*self.pending, batch)

    def should_commit(self) -> bool:
        """Collective over the quorum (see ``Context.should_commit``)."""
        plan = self.plan
        if plan is None:
            raise ConfigError("ctx.should_commit() ends a step: call it after the backward of a batch from the loader "
                              "ctx.setup_dataloader returned, once per batch.")
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

    def close(self) -> None:
        if self.ledger is not None:
            if self.pending is not None and self.order is not None:  # what the last epoch left out
                self.ledger.end(self.session.step, self.order.plan(*self.pending, self.batch))
            self.ledger.close()
        self.session.shutdown()


class FtLoader:
    """The loader ``ctx.setup_dataloader`` returns under fault tolerance: one pass is the rest of
    the current epoch of the global order; each batch is this group's share of the next step."""

    def __init__(self, replicas: Replicas, loader: DataLoader, device: torch.device) -> None:
        self._replicas, self.loader, self.device = replicas, loader, device

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
        epoch = None
        while True:
            plan = replicas.next_plan(batch)
            if plan.done or (epoch is not None and plan.epoch != epoch):
                return  # the quorum stays pending: the next pass (or ctx.close) uses it
            epoch = plan.epoch
            replicas.plan = plan
            samples = self.loader.collate_fn([self.loader.dataset[i] for i in plan.mine])
            yield to_device(samples, self.device)

    def __len__(self) -> int:
        """Steps in a whole epoch at the current quorum's size."""
        order = self._replicas.order
        assert order is not None
        return order.n // self._width()

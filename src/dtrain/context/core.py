"""The object a training script holds: ``ctx = dtrain.init(...)``.

    ctx = dtrain.init(strategy="ddp", precision="bf16-mixed")
    model, optimizer = ctx.setup(model, optimizer)
    loader = ctx.setup_dataloader(loader)
    for x, y in loader:
        with ctx.accumulate(model, steps=4):
            ctx.backward(loss_fn(model(x), y))
            optimizer.step()          # a no-op until the 4th micro-step
            optimizer.zero_grad()
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from ..checkpoint import CheckpointManager, RunState
from ..comm.collectives import Collectives
from ..data.loader import DeviceLoader
from ..diag import Tracker, Watchdog
from ..errors import ConfigError
from ..metrics.memory import MemoryReport, memory_report
from ..parallel.apply import parallelize
from ..precision import Precision
from ..strategies.base import Strategy
from ..world import World, WorldView, destroy_process_group
from . import evaluation, saving
from .closed import refused_after_close
from .replicas import Replicas
from .setup import check_loader, check_model, check_optimizer, prepare_model, shard_loader
from .step import DtrainModule, DtrainOptimizer, Step

__all__ = ["Context", "DtrainModule", "DtrainOptimizer"]


@refused_after_close
class Context(WorldView):
    """What a training script holds: the world, the strategy, the precision and their helpers.

    A face over its parts: ``collectives`` (labelled collectives), the set-up of a script's objects
    (``dtrain.context.setup``), the step (``dtrain.context.step``: wrappers, accumulation, backward,
    clipping), evaluation (``dtrain.context.evaluation``) and its files (``dtrain.context.saving``)."""

    def __init__(self, *, world: World, strategy: Strategy, precision: Precision, seed: int = 0, owns_group: bool = False,
                 debug: bool = False) -> None:
        self.world = world
        self.collectives = Collectives(world, Tracker(), debug=debug)
        """Every collective this context issues, labelled for the watchdog and the checker."""
        self._step = Step(strategy=strategy, precision=precision, collectives=self.collectives)
        self.breakdown = self._step.breakdown
        """Where this rank's step time goes (dtrain.metrics.breakdown); the loop marks the step's start and its batch."""
        self._watchdog: Watchdog | None = None
        self.seed = seed
        self._owns_group = owns_group
        self._checkpoint_managers: list[CheckpointManager] = []
        self._replicas: Replicas | None = None
        """This process's replica group of a fault-tolerant job (``dtrain.init(fault_tolerance=True)``)."""
        self._closed = False
        self.compile = False
        """``torch.compile`` models in ``setup`` (``dtrain.init(compile=True)``)."""
        self.activation_checkpointing = False
        """Recompute blocks' activations in backward (``dtrain.init(activation_checkpointing=True)``)."""

    # -- topology and parts -----------------------------------------------------------------
    # rank, world_size, is_main: WorldView's
    @property
    def local_rank(self) -> int:
        return self.world.local_rank

    @property
    def device(self) -> torch.device:
        return self.world.device

    @property
    def precision(self) -> Precision:
        """The run's precision (``--precision auto``'s float8 becomes bf16-mixed at ``setup`` where
        no linear of the model gains from float8)."""
        return self._step.precision

    @property
    def strategy(self) -> Strategy:
        return self._step.strategy

    @strategy.setter
    def strategy(self, value: Strategy) -> None:
        self._step.strategy = value

    @property
    def tracker(self) -> Tracker:
        """Heartbeat and recent collectives of this rank (read by the stall watchdog)."""
        return self.collectives.tracker

    @tracker.setter
    def tracker(self, value: Tracker) -> None:
        self.collectives.tracker = value

    @property
    def debug(self) -> bool:
        return self.collectives.debug

    @property
    def scaler(self) -> torch.amp.GradScaler | None:
        return self._step.scaler

    def __repr__(self) -> str:
        return f"Context(world={self.world}, strategy={self.strategy.name!r}, precision={self.precision.effective!r})"

    # -- setup ------------------------------------------------------------------------------
    def setup(self, model: nn.Module, *optimizers: torch.optim.Optimizer, channels_last: bool = False, sync_bn: bool = False,
              blocks: Sequence[nn.Module] | None = None) -> Any:
        """Wrap the model (and optimizers) for the strategy and precision.

        Collective: call on every rank (DDP broadcasts rank 0's parameters). Returns the model
        alone, or ``(model, optimizer, ...)`` when optimizers are given. Build the optimizer
        from the original model's parameters before calling this. ``channels_last``: the model
        and its 4-D inputs in NHWC layout (conv nets); ``sync_bn``: BatchNorm statistics over
        every rank's batch (SyncBatchNorm; GPU only, see ``dtrain.parallel.convnets``); ``blocks``: the
        model's repeated blocks (transformer blocks, ResNet stages), the units of activation
        checkpointing, compilation, fsdp wrapping and pipeline splitting.
        """
        check_model("ctx.setup", model)
        for i, opt in enumerate(optimizers):
            check_optimizer(f"ctx.setup(model, ...) argument {i + 2}", opt)
        wrapped = self.setup_model(model, channels_last=channels_last, sync_bn=sync_bn, blocks=blocks)
        if not optimizers:
            return wrapped
        return (wrapped, *(self.setup_optimizer(o, wrapped) for o in optimizers))

    def setup_model(self, model: nn.Module, *, channels_last: bool = False, sync_bn: bool = False,
                    blocks: Sequence[nn.Module] | None = None) -> DtrainModule:
        """Collective: call on every rank."""
        model, blocks = prepare_model(model, strategy=self.strategy, collectives=self.collectives, channels_last=channels_last,
                                      sync_bn=sync_bn, blocks=blocks, compile=self.compile,
                                      activation_checkpointing=self.activation_checkpointing)
        # One order for every strategy (dtrain.parallel.apply.parallelize): its cuts, activation
        # checkpointing, compile, its wrap (fsdp/hsdp wrap and pipeline splits at the blocks when
        # the user chose no policy of their own).
        setup = self.collectives.labelled("setup (parameter broadcast)") if self.world.distributed else contextlib.nullcontext()
        with setup:  # DDP broadcasts rank 0's parameters: a rank can wait here
            inner = parallelize(model, self.strategy, self.world, blocks=blocks, precision=self.precision,
                                activation_checkpointing=self.activation_checkpointing, compile=self.compile)
        wrapped = self._step.wrap_model(inner, channels_last)
        if self._replicas is not None:  # what a returning replica group heals from
            self._replicas.add(model=wrapped.original)
        return wrapped

    def setup_optimizer(self, optimizer: torch.optim.Optimizer, model: nn.Module | None = None) -> DtrainOptimizer:
        check_optimizer("ctx.setup_optimizer", optimizer)
        if self._replicas is not None:
            self._replicas.add(optimizer=optimizer)
        return self._step.wrap_optimizer(optimizer, model)

    def setup_dataloader(self, loader: DataLoader, *, shuffle: bool | None = None, move_to_device: bool = True,
                         ledger: str | None = None) -> DeviceLoader:
        """Shard ``loader`` by rank; every new pass over it is a new, reshuffled epoch.

        ``shuffle`` defaults to whether the loader shuffled (``shuffle=True``). Under fault
        tolerance each batch is this replica group's share of the next step (``dtrain.context.replicas``),
        and ``ledger`` names a folder for the committed steps' samples (``dtrain ckpt ledger`` checks it).
        """
        check_loader(loader, shuffle)
        if self._replicas is not None:
            step = self._step
            return self._replicas.loader(loader, ledger=ledger, move_to_device=move_to_device,  # type: ignore[return-value]
                                         window_open=lambda: not step.sync, on_last=step.set_end_of_data)
        if ledger is not None:
            raise ConfigError("ctx.setup_dataloader(ledger=...) is kept under fault tolerance only "
                              "(dtrain.init(fault_tolerance=True)); for other jobs use dtrain train --ledger DIR.")
        return shard_loader(loader, strategy=self.strategy, collectives=self.collectives, seed=self.seed, shuffle=shuffle,
                            device=self.device if move_to_device else torch.device("cpu"), on_last=self._step.set_end_of_data)

    @property
    def data_parallel_size(self) -> int:
        """Model replicas that each read their own share of the data (1 under ``pipeline``)."""
        return self.strategy.data_parallel(self.world)[1]

    def unwrap(self, model: nn.Module) -> nn.Module:
        """The user's own module inside the wrappers ``setup`` added."""
        return model.original if isinstance(model, DtrainModule) else self.strategy.unwrap(model)

    # -- the step (dtrain.context.step) ---------------------------------------------------------------
    @property
    def sync_gradients(self) -> bool:
        """True when the current micro-step ends an accumulation window (always outside one)."""
        return self._step.sync

    def accumulate(self, model: nn.Module, steps: int = 1) -> contextlib.AbstractContextManager[None]:
        """One micro-step of a window of ``steps``: gradients are only communicated on the last
        micro-step of the window (or the last batch of the epoch); ``backward`` divides the loss
        by ``steps`` so the window's gradient is the mean over its micro-batches."""
        return self._step.accumulate(model, steps)

    def should_commit(self) -> bool:
        """Whether this step counts: call it after backward, and ``optimizer.step()`` only when True.

        Under fault tolerance (collective over the quorum of replica groups): the gradients are
        averaged over the groups, then torchft's vote; False when a group was lost during the step
        (nobody commits it; its samples are trained again). Otherwise True. Inside ``accumulate``,
        on a micro-step that does not end its window: False, and nothing is communicated (the
        window's last micro-step ends the step)."""
        if self._replicas is not None:
            return self._replicas.should_commit()
        return self._step.sync

    @property
    def accumulation_steps(self) -> int:
        """The window of the current ``accumulate`` block (1 outside one)."""
        return self._step.accum_steps

    def forward_backward(self, model: nn.Module, inputs: Any, target: Any,
                         loss_fn: Callable[[Any, Any], torch.Tensor]) -> torch.Tensor:
        """``ctx.backward(loss_fn(model(inputs), target))``; returns the loss, detached.

        Collective: call on every rank. The step every strategy supports, and the only one
        ``pipeline`` does: there the batch is split into micro-batches that flow through the
        stages, and the returned loss (the mean over micro-batches, from the last stage) is
        the same on every rank."""
        return self._step.forward_backward(model, inputs, target, loss_fn)

    def memory_report(self, model: nn.Module, *optimizers: torch.optim.Optimizer) -> MemoryReport:
        """Bytes this rank holds in parameters, gradients and optimizer state (local shards
        only), and its peak memory so far."""
        return memory_report(model, optimizers or tuple(self._step.optimizers), self.device, rank=self.rank)

    def autocast(self) -> contextlib.AbstractContextManager:
        """The precision's autocast, for computations outside the model's forward (e.g. the loss)."""
        return self.precision.autocast()

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """``loss.backward()``, divided by the accumulation window and scaled for fp16."""
        self._step.backward(loss, **kwargs)

    def heartbeat(self) -> None:
        """Tell the stall watchdog that this rank is making progress. dtrain's own calls (batches
        of a set-up loader, backward, optimizer step, collectives) already do; call it in long
        loops of your own that make none of them (e.g. a custom evaluation)."""
        self.tracker.beat()

    def clip_grad_norm_(self, model: nn.Module, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip gradients by their global norm (after unscaling fp16 gradients); returns the norm
        before clipping. Under sharded strategies the norm is over every rank's shard.

        Collective under fsdp, hsdp and pipeline: call on every rank."""
        check_model("ctx.clip_grad_norm_", model)
        return self._step.clip_grad_norm_(model, max_norm, norm_type)

    # -- collectives (dtrain.comm.collectives) -------------------------------------------------------
    def all_reduce(self, tensor: torch.Tensor, op: str = "mean") -> torch.Tensor:
        """Reduce ``tensor`` over all ranks in place and return it.

        Collective: call on every rank. ``op`` is one of mean, sum, max, min.
        """
        return self.collectives.all_reduce(tensor, op)

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Collective: call on every rank. Every rank's ``tensor`` (same shape on all ranks)."""
        return self.collectives.all_gather(tensor)

    def gather_object(self, obj: Any, dst: int | None = None) -> list[Any] | None:
        """Collective: call on every rank. Every rank's picklable ``obj``, by rank, on every rank
        (``dst=None``) or only on rank ``dst`` (the others get None)."""
        return self.collectives.gather_object(obj, dst)

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Collective: call on every rank. Copy rank ``src``'s tensor to all ranks, in place."""
        return self.collectives.broadcast(tensor, src)

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        """Collective: call on every rank. Rank ``src``'s picklable object, on every rank."""
        return self.collectives.broadcast_object(obj, src)

    def barrier(self) -> None:
        """Collective: call on every rank. Wait until every rank gets here."""
        self.collectives.barrier()

    @contextlib.contextmanager
    def main_process_first(self) -> Iterator[None]:
        """Collective: call on every rank. Rank 0 runs the block first (e.g. to prepare a cache)."""
        if not self.is_main:
            self.barrier()
        yield
        if self.is_main:
            self.barrier()

    def print(self, *args: Any, **kwargs: Any) -> None:
        """``print`` on rank 0 only."""
        if self.is_main:
            kwargs.setdefault("flush", True)
            print(*args, **kwargs)

    # -- evaluation (dtrain.context.evaluation) ---------------------------------------------------------
    def evaluate(
        self,
        model: nn.Module,
        dataset: Dataset,
        metric: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        *,
        batch_size: int = 256,
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
    ) -> dict[str, float]:
        """Score ``model`` on ``dataset`` with every sample counted exactly once across ranks.

        Collective: call on every rank. ``metric(outputs, targets)`` returns one value per
        sample (e.g. 1.0 where the prediction is right); the result is their mean over the whole
        data set, with ``loss`` the mean loss and ``count`` the number of samples scored.
        """
        check_model("ctx.evaluate", model)
        evaluation.check_args(dataset, metric, batch_size)
        return evaluation.evaluate(self.unwrap(model), dataset, metric, batch_size=batch_size, loss_fn=loss_fn,
                                   strategy=self.strategy, precision=self.precision, collectives=self.collectives)

    # -- checkpoints ------------------------------------------------------------------------
    def _run_state(self) -> RunState:
        return RunState(self.collectives, self.strategy, self.scaler, self.seed)

    def checkpoints(self, folder: str, *, keep: int = 3, async_save: bool = False) -> CheckpointManager:
        """A manager of full-state checkpoints in ``folder`` (model, optimizer, scheduler, data
        position, grad scaler, communication state, every rank's RNG); see ``CheckpointManager``."""
        saving.check_checkpoints_args(folder, keep, async_save)
        manager = CheckpointManager(self._run_state(), folder, keep=keep, async_save=async_save)
        self._checkpoint_managers.append(manager)  # ctx.close gives their folders' locks back
        return manager

    def save(self, path: str, state: dict[str, Any]) -> None:
        """Save ``state`` to ``path`` from rank 0, atomically.

        Collective: call on every rank. Values with a ``state_dict()`` (model, optimizer,
        scheduler) are stored as their state dict.
        """
        saving.save(self.collectives, path, state)

    def load(self, path: str, state: dict[str, Any]) -> dict[str, Any]:
        """Load ``path`` (safely: no arbitrary unpickling) into the objects of ``state``.

        A file (``ctx.save``'s): objects with ``load_state_dict`` are restored in place; the
        returned dict holds every stored value (plain values such as ``step`` included). A
        checkpoint folder, or a folder of them (``ctx.checkpoints``'s; its newest valid one), is
        verified first and loaded as ``CheckpointManager.resume`` does, which returns
        ``{"step", "extra", "path", "world_size"}``; collective then.
        """
        return saving.load(self._run_state(), self.device, path, state)

    # -- life cycle -------------------------------------------------------------------------
    def close(self) -> None:
        """Leave the process group if ``init`` created it. The models ``setup`` returned keep
        working afterwards, as plain local modules.

        Collective: call on every rank.
        """
        self._closed = True
        if self._watchdog is not None:
            self._watchdog.stop()
            self._watchdog = None
        for manager in self._checkpoint_managers:
            manager.close()
        self._checkpoint_managers = []
        if self._replicas is not None:
            self._replicas.close()
            self._replicas = None
        if not self._owns_group:
            return
        # Free the strategy's wrappers (DDP) before the group: a DDP object that outlives its
        # group can abort the process at exit (see world._register_exit_cleanup).
        self._step.release_modules()
        gc.collect()
        destroy_process_group()
        self._owns_group = False

    def __enter__(self) -> Context:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


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
import os
import random
import sys
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, Dataset

from . import _check as check
from . import strategies, transforms
from ._log import note_once
from .comm import CommSpec
from .checkpoint import CheckpointManager, atomic_save, load_into, resolve, safe_load
from .data.loader import DeviceLoader, reshard, to_device
from .data.sampler import EvalShardSampler
from .diag import Tracker, Watchdog
from .diag.checker import check_call, check_same
from .errors import CheckpointError, ConfigError, DtrainError
from .metrics.memory import MemoryReport, memory_report
from .metrics.breakdown import StepBreakdown
from .convnets import apply_channels_last, apply_sync_bn, to_channels_last
from .precision import Precision
from .strategies.base import ForwardingOptimizer, Strategy
from .world import World, destroy_process_group, init_process_group

_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN, "mean": dist.ReduceOp.SUM}


def init(
    strategy: str | Strategy = "auto",
    precision: str | Precision = "fp32",
    *,
    seed: int | None = None,
    device: str | torch.device | None = None,
    world: World | None = None,
    timeout_s: float = 1800.0,
    stall_timeout: float | None = None,
    debug: bool | None = None,
    run_dir: str | None = None,
    comm: str | None = None,
    comm_warmup: int | None = None,
    compile: bool = False,
    activation_checkpointing: bool = False,
    **strategy_options: Any,
) -> Context:
    """Detect the world, join the process group and build the strategy.

    Collective: call on every rank. ``strategy="auto"`` is ``ddp`` with several processes and
    ``single`` with one. ``seed`` seeds Python, NumPy and torch on every rank alike.
    ``stall_timeout`` (seconds; 0 turns it off; default ``$DTRAIN_STALL_TIMEOUT`` or 900): the
    watchdog reports and stops a job in which some rank made no progress that long.
    ``debug`` (default ``$DTRAIN_DEBUG``): check every dtrain collective across ranks.
    ``run_dir`` (default ``$DTRAIN_RUN_DIR`` or ``./dtrain-run``): where stall dumps go.
    ``comm`` (default ``$DTRAIN_COMM`` or ``none``): how DDP's gradients travel, one of
    ``none, fp16, bf16, powersgd[:RANK], localsgd[:H], auto`` (see ``dtrain.comm``), after
    ``comm_warmup`` plain steps (default ``$DTRAIN_COMM_WARMUP``, else 10; auto: 8 measured steps).
    ``compile``: ``torch.compile`` the model in ``ctx.setup`` (per block when blocks are given).
    ``activation_checkpointing``: recompute each block's activations in backward (needs
    ``ctx.setup(..., blocks=...)``). See ``dtrain.transforms`` for the order they are applied in.
    """
    _install_excepthook()
    _check_init_args(strategy, precision, seed, world, timeout_s, stall_timeout, debug, run_dir)
    if comm is not None:
        check.instance("dtrain.init(comm=...)", comm, (str, CommSpec), "give a name such as none, fp16, powersgd:2 or auto")
    if comm_warmup is not None:
        check.integer("dtrain.init(comm_warmup=...)", comm_warmup, minimum=0)
    world = world or World.detect(device=device)
    if strategy == "auto":
        strategy = "ddp" if world.distributed else "single"
    strategy_options.update(comm_options(strategy, world, comm, comm_warmup))
    strat = strategies.build(strategy, **strategy_options)
    prec = Precision.resolve(precision, world.device)
    stall = _env_float("DTRAIN_STALL_TIMEOUT", 900.0) if stall_timeout is None else stall_timeout
    stall = check.number("stall timeout (seconds; 0 turns the watchdog off)", stall)
    debug = os.environ.get("DTRAIN_DEBUG", "") not in ("", "0") if debug is None else debug
    owns_group = init_process_group(world, timeout_s=timeout_s)
    if seed is not None:
        seed_everything(seed)
    ctx = Context(world=world, strategy=strat, precision=prec, seed=seed or 0, owns_group=owns_group, debug=debug)
    ctx.compile, ctx.activation_checkpointing = bool(compile), bool(activation_checkpointing)
    if world.distributed and stall > 0:
        ctx._watchdog = Watchdog(
            ctx.tracker, rank=world.rank, size=world.size, timeout_s=stall,
            run_dir=run_dir or os.environ.get("DTRAIN_RUN_DIR") or "dtrain-run",
            master_addr=world.master_addr, master_port=world.master_port, attempt=world.restart_count,
        ).start()
    return ctx


def _check_init_args(strategy: Any, precision: Any, seed: Any, world: Any, timeout_s: Any,
                     stall_timeout: Any, debug: Any, run_dir: Any) -> None:
    """dtrain.init's arguments have the types it documents (one ConfigError line each)."""
    check.instance("dtrain.init(strategy=...)", strategy, (str, Strategy), f"give a name, one of: auto, {', '.join(strategies.available())}")
    check.instance("dtrain.init(precision=...)", precision, (str, Precision), "give a name such as fp32, bf16-mixed or fp16-mixed")
    if seed is not None:
        check.seed("dtrain.init(seed=...)", seed)
    if world is not None:
        check.instance("dtrain.init(world=...)", world, World, "give a dtrain.World (or leave it out to detect one)")
    check.number("dtrain.init(timeout_s=...)", timeout_s, positive=True)
    if stall_timeout is not None:
        check.number("dtrain.init(stall_timeout=...)", stall_timeout)
    if debug is not None:
        check.instance("dtrain.init(debug=...)", debug, bool, "give True or False")
    if run_dir is not None:
        check.output_dir("dtrain.init(run_dir=...)", run_dir)


def comm_options(strategy: str | Strategy, world: World, comm: str | None, warmup: int | None) -> dict[str, Any]:
    """The strategy options that carry ``--comm`` (``dtrain run --comm`` hands it over as
    ``$DTRAIN_COMM``); a method other than ``none`` needs the ddp strategy."""
    comm = comm if comm is not None else os.environ.get("DTRAIN_COMM") or None
    if warmup is None and os.environ.get("DTRAIN_COMM_WARMUP"):
        raw = os.environ["DTRAIN_COMM_WARMUP"]
        try:
            warmup = int(raw)
        except ValueError:
            raise ConfigError(f"DTRAIN_COMM_WARMUP={raw!r} is not a number of steps.") from None
    spec = CommSpec.parse(comm, warmup=warmup)  # a bad value fails here, on every strategy
    if spec.kind == "none":
        return {}
    if strategy == "ddp":
        return {"comm": spec}
    if not world.distributed:
        note_once(f"--comm {spec} has no effect with one process (nothing to communicate).")
        return {}
    name = strategy if isinstance(strategy, str) else getattr(strategy, "name", type(strategy).__name__)
    raise ConfigError(f"--comm {spec} works with the ddp strategy, not {name!r}; use --strategy ddp or --comm none.")


def _install_excepthook() -> None:
    """An uncaught DtrainError in a user's script ends with its one-line message, not a traceback."""
    if getattr(sys.excepthook, "_dtrain", False):
        return
    previous = sys.excepthook

    def hook(kind, value, tb):  # type: ignore[no-untyped-def]
        if isinstance(value, DtrainError):
            print(f"dtrain: error: {value}", file=sys.stderr, flush=True)
        else:
            previous(kind, value, tb)

    hook._dtrain = True  # type: ignore[attr-defined]
    sys.excepthook = hook


def _env_float(name: str, default: float) -> float:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return float(raw)
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not a number of seconds; set it to e.g. 900, or unset it.") from None


def _check_model(what: str, model: Any) -> None:
    check.instance(what, model, nn.Module, "give the torch.nn.Module to train (e.g. ctx.setup(model, optimizer))")


def _check_optimizer(what: str, optimizer: Any) -> None:
    check.instance(what, optimizer, torch.optim.Optimizer,
                   "give a torch.optim.Optimizer built from the model's parameters (e.g. torch.optim.SGD(model.parameters(), lr=0.1))")
    if isinstance(optimizer, DtrainOptimizer):
        raise ConfigError(f"{what}: this optimizer was already set up; pass the torch optimizer to ctx.setup once.")


def _check_tensor(what: str, tensor: Any) -> None:
    check.instance(what, tensor, torch.Tensor, "give a torch.Tensor (e.g. torch.tensor(loss_value))")


def _check_path_state(what: str, path: Any, state: Any) -> None:
    check.instance(f"{what}(path, ...)", path, (str, os.PathLike), "give the checkpoint file's path")
    check.instance(f"{what}(path, state)", state, dict, 'give a dict such as {"model": model, "optimizer": optimizer}')


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy and torch (CPU and every CUDA device)."""
    check.seed("seed_everything(seed)", seed)
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


class DtrainModule(nn.Module):
    """The model as ``ctx.setup`` returns it: the strategy's wrapper, run under the precision's
    autocast. ``state_dict`` and ``load_state_dict`` are the user's module's own, so checkpoints
    carry no wrapper prefixes."""

    def __init__(self, wrapped: nn.Module, original: nn.Module, precision: Precision, channels_last: bool = False) -> None:
        super().__init__()
        self.module = wrapped
        object.__setattr__(self, "original", original)  # not a submodule: no duplicate state
        object.__setattr__(self, "_precision", precision)
        object.__setattr__(self, "_channels_last", channels_last)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self._channels_last:
            args = to_channels_last(args)
        with self._precision.autocast():
            return self.module(*args, **kwargs)

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        return self.original.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        return self.original.load_state_dict(state_dict, strict=strict, assign=assign)


class DtrainOptimizer(ForwardingOptimizer):
    """The optimizer as ``ctx.setup`` returns it. ``step`` and ``zero_grad`` do nothing on
    micro-steps inside ``ctx.accumulate`` that are not the last of their window, and go through
    the GradScaler when the precision uses one."""

    def __init__(self, optimizer: torch.optim.Optimizer, ctx: Context) -> None:
        super().__init__(optimizer)
        self._ctx = ctx

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        if not self._ctx.sync_gradients:
            return None
        tracker = self._ctx.tracker
        tracker.beat(tracker.step + 1)
        self._ctx.breakdown.lap("rest")
        scaler = self._ctx.scaler
        if scaler is not None:
            # An optimizer that communicates (hvd) must finish before the scaler unscales.
            synchronize = getattr(self.optimizer, "synchronize", None)
            if synchronize is not None:
                synchronize()
            out = scaler.step(self.optimizer, closure) if closure else scaler.step(self.optimizer)
            scaler.update()
        else:
            out = self.optimizer.step(closure) if closure else self.optimizer.step()
        after = getattr(self._ctx.strategy, "after_optimizer_step", None)
        if after is not None:  # e.g. local SGD averages the parameters every H steps (a collective)
            after(self.optimizer)
        self._ctx.breakdown.lap("optimizer")
        return out

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self._ctx.sync_gradients:
            self.optimizer.zero_grad(set_to_none=set_to_none)

    def __repr__(self) -> str:
        return f"DtrainOptimizer({self.optimizer!r})"


class Context:
    """What a training script holds: the world, the strategy, the precision and their helpers."""

    def __init__(self, *, world: World, strategy: Strategy, precision: Precision, seed: int = 0, owns_group: bool = False,
                 debug: bool = False) -> None:
        self.world = world
        self.debug = debug
        self.tracker = Tracker()
        self.breakdown = StepBreakdown(world.device)
        """Where this rank's step time goes (dtrain.metrics.breakdown); the loop marks the step's start and its batch."""
        """Heartbeat and recent collectives of this rank (read by the stall watchdog)."""
        self._watchdog: Watchdog | None = None
        self.strategy = strategy
        self.precision = precision
        self.seed = seed
        self.scaler = precision.grad_scaler()
        self._owns_group = owns_group
        self._checkpoint_managers: list[CheckpointManager] = []
        self._accum_steps = 1
        self._micro_step = 0
        self._sync = True
        self._end_of_data = False
        self._optimizers: list[DtrainOptimizer] = []
        self._modules: list[weakref.ref[DtrainModule]] = []
        self.compile = False
        """``torch.compile`` models in ``setup`` (``dtrain.init(compile=True)``)."""
        self.activation_checkpointing = False
        """Recompute blocks' activations in backward (``dtrain.init(activation_checkpointing=True)``)."""

    # -- topology ---------------------------------------------------------------------------
    @property
    def rank(self) -> int:
        return self.world.rank

    @property
    def local_rank(self) -> int:
        return self.world.local_rank

    @property
    def world_size(self) -> int:
        return self.world.size

    @property
    def is_main(self) -> bool:
        return self.world.is_main

    @property
    def device(self) -> torch.device:
        return self.world.device

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
        every rank's batch (SyncBatchNorm; GPU only, see ``dtrain.convnets``); ``blocks``: the
        model's repeated blocks (transformer blocks, ResNet stages), the units of activation
        checkpointing, compilation, fsdp wrapping and pipeline splitting.
        """
        _check_model("ctx.setup", model)
        for i, opt in enumerate(optimizers):
            _check_optimizer(f"ctx.setup(model, ...) argument {i + 2}", opt)
        wrapped = self.setup_model(model, channels_last=channels_last, sync_bn=sync_bn, blocks=blocks)
        if not optimizers:
            return wrapped
        return (wrapped, *(self.setup_optimizer(o, wrapped) for o in optimizers))

    def setup_model(self, model: nn.Module, *, channels_last: bool = False, sync_bn: bool = False,
                    blocks: Sequence[nn.Module] | None = None) -> DtrainModule:
        """Collective: call on every rank."""
        _check_model("ctx.setup_model", model)
        if isinstance(model, DtrainModule):
            raise ConfigError("this model was already set up; call ctx.setup once per model.")
        if sync_bn:
            model = apply_sync_bn(model, self.world, self.data_parallel_size)
        if channels_last:
            model = apply_channels_last(model, self.strategy)
        blocks = list(blocks) if blocks is not None else []
        transforms.check_options(self.strategy.name, compile=self.compile,
                                 activation_checkpointing=self.activation_checkpointing, has_blocks=bool(blocks))
        if self.activation_checkpointing:
            transforms.apply_activation_checkpointing(blocks)
        if self.compile and blocks:
            transforms.compile_blocks(blocks)
        if self.debug and self.world.distributed:
            with torch.no_grad():
                checksum = float(sum(p.detach().double().sum().item() for p in model.parameters()))
            check_same(self, "parameter checksum at setup", round(checksum, 6),
                       fix="build the model after dtrain.init(seed=...) so every rank starts alike")
        # fsdp/hsdp wrap, pipeline splits at the blocks when the user chose no policy of their own.
        kwargs = {"blocks": blocks} if blocks and getattr(self.strategy, "uses_blocks", False) else {}
        if self.world.distributed:  # DDP broadcasts rank 0's parameters: a rank can wait here
            with self._collective("setup (parameter broadcast)"):
                inner = self.strategy.setup_model(model, self.world, **kwargs)
        else:
            inner = self.strategy.setup_model(model, self.world, **kwargs)
        if self.compile and not blocks:
            inner.compile()  # the wrapped model whole (DDP: its graph split at buckets by DDPOptimizer)
        wrapped = DtrainModule(inner, self.strategy.unwrap(inner), self.precision, channels_last=channels_last)
        self._modules.append(weakref.ref(wrapped))
        return wrapped

    def setup_optimizer(self, optimizer: torch.optim.Optimizer, model: nn.Module | None = None) -> DtrainOptimizer:
        _check_optimizer("ctx.setup_optimizer", optimizer)
        inner = model.module if isinstance(model, DtrainModule) else model
        wrapped = DtrainOptimizer(self.strategy.setup_optimizer(optimizer, inner), self)
        self._optimizers.append(wrapped)
        return wrapped

    def setup_dataloader(self, loader: DataLoader, *, shuffle: bool | None = None, move_to_device: bool = True) -> DeviceLoader:
        """Shard ``loader`` by rank; every new pass over it is a new, reshuffled epoch.

        ``shuffle`` defaults to whether the loader shuffled (``shuffle=True``).
        """
        check.instance("ctx.setup_dataloader", loader, DataLoader,
                       "give a torch.utils.data.DataLoader (e.g. DataLoader(dataset, batch_size=32, shuffle=True))")
        if shuffle is not None:
            check.instance("ctx.setup_dataloader(shuffle=...)", shuffle, bool, "give True, False or None")
        if self.debug and self.world.distributed:
            check_same(self, "dataset length", len(loader.dataset), fix="give every rank the same data set")
        rank, size = self._data_parallel()
        sharded = reshard(loader, rank=rank, world_size=size, seed=self.seed, shuffle=shuffle)
        device = self.device if move_to_device else torch.device("cpu")
        return DeviceLoader(sharded, device, on_last=self._set_end_of_data, world_size=size,
                            on_batch=self.tracker.beat)

    def _data_parallel(self) -> tuple[int, int]:
        own = getattr(self.strategy, "data_parallel", None)  # pipeline: one replica over all ranks
        return own(self.world) if own is not None else (self.rank, self.world_size)

    @property
    def data_parallel_size(self) -> int:
        """Model replicas that each read their own share of the data (1 under ``pipeline``)."""
        return self._data_parallel()[1]

    def unwrap(self, model: nn.Module) -> nn.Module:
        """The user's own module inside the wrappers ``setup`` added."""
        return model.original if isinstance(model, DtrainModule) else self.strategy.unwrap(model)

    # -- the step ---------------------------------------------------------------------------
    @property
    def sync_gradients(self) -> bool:
        """True when the current micro-step ends an accumulation window (always outside one)."""
        return self._sync

    def _set_end_of_data(self, last: bool) -> None:
        self._end_of_data = last
        if not last:
            self._micro_step = 0  # a new epoch starts a new accumulation window

    @contextlib.contextmanager
    def accumulate(self, model: nn.Module, steps: int = 1) -> Iterator[None]:
        """One micro-step of a window of ``steps``: gradients are only communicated on the last
        micro-step of the window (or the last batch of the epoch); ``backward`` divides the loss
        by ``steps`` so the window's gradient is the mean over its micro-batches."""
        check.integer("ctx.accumulate(model, steps=...)", steps, minimum=1)
        self._accum_steps = steps
        self._micro_step += 1
        # A window cut short by the end of the epoch still syncs, so no gradient is left behind.
        self._sync = self._micro_step % steps == 0 or self._end_of_data
        inner = model.module if isinstance(model, DtrainModule) else model
        try:
            with contextlib.nullcontext() if self._sync else self.strategy.no_sync(inner):
                yield
        finally:
            if self._sync:
                self._micro_step = 0

    @property
    def accumulation_steps(self) -> int:
        """The window of the current ``accumulate`` block (1 outside one)."""
        return self._accum_steps

    def forward_backward(self, model: nn.Module, inputs: Any, target: Any,
                         loss_fn: Callable[[Any, Any], torch.Tensor]) -> torch.Tensor:
        """``ctx.backward(loss_fn(model(inputs), target))``; returns the loss, detached.

        Collective: call on every rank. The step every strategy supports, and the only one
        ``pipeline`` does: there the batch is split into micro-batches that flow through the
        stages, and the returned loss (the mean over micro-batches, from the last stage) is
        the same on every rank."""
        own = getattr(self.strategy, "forward_backward", None)
        if own is not None and self.world.distributed:
            return own(self, model.module if isinstance(model, DtrainModule) else model, inputs, target, loss_fn)
        loss = loss_fn(model(inputs), target)
        self.backward(loss)
        return loss.detach()

    def memory_report(self, model: nn.Module, *optimizers: torch.optim.Optimizer) -> MemoryReport:
        """Bytes this rank holds in parameters, gradients and optimizer state (local shards
        only), and its peak memory so far."""
        return memory_report(model, optimizers or tuple(self._optimizers), self.device, rank=self.rank)

    def autocast(self) -> contextlib.AbstractContextManager:
        """The precision's autocast, for computations outside the model's forward (e.g. the loss)."""
        return self.precision.autocast()

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """``loss.backward()``, divided by the accumulation window and scaled for fp16."""
        if self._accum_steps > 1:
            loss = loss / self._accum_steps
        if self.scaler is not None:
            loss = self.scaler.scale(loss)
        self.breakdown.backward_starts(loss)
        if self.world.distributed and self._sync:
            # Gradients are communicated inside backward (DDP buckets, hvd hooks): record it as
            # a collective for the watchdog, and check it against the other ranks in debug mode.
            with self._collective("backward (gradient all-reduce)", loss):
                loss.backward(**kwargs)
        else:
            self.tracker.beat()
            loss.backward(**kwargs)
            self.tracker.beat()
        self.breakdown.backward_done()

    def heartbeat(self) -> None:
        """Tell the stall watchdog that this rank is making progress. dtrain's own calls (batches
        of a set-up loader, backward, optimizer step, collectives) already do; call it in long
        loops of your own that make none of them (e.g. a custom evaluation)."""
        self.tracker.beat()

    def clip_grad_norm_(self, model: nn.Module, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip gradients by their global norm (after unscaling fp16 gradients); returns the norm
        before clipping. Under sharded strategies the norm is over every rank's shard.

        Collective under fsdp, hsdp and pipeline: call on every rank."""
        _check_model("ctx.clip_grad_norm_", model)
        check.instance("ctx.clip_grad_norm_(model, max_norm)", max_norm, (int, float), "give a number > 0")
        if not max_norm > 0:  # inf is allowed: torch's idiom for "measure the norm, clip nothing"
            raise ConfigError(f"ctx.clip_grad_norm_(model, max_norm) must be > 0, got {max_norm}.")
        if self.scaler is not None:
            for opt in self._optimizers:
                self.scaler.unscale_(opt.optimizer)
        own = getattr(self.strategy, "clip_grad_norm_", None)  # e.g. pipeline: a norm over every stage
        if own is not None:
            return own(model.parameters(), max_norm, norm_type)
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, norm_type=norm_type)
        # Sharded gradients (fsdp: DTensors) give a DTensor norm, already over all shards.
        return norm.full_tensor() if hasattr(norm, "full_tensor") else norm

    # -- collectives ------------------------------------------------------------------------
    def all_reduce(self, tensor: torch.Tensor, op: str = "mean") -> torch.Tensor:
        """Reduce ``tensor`` over all ranks in place and return it.

        Collective: call on every rank. ``op`` is one of mean, sum, max, min.
        """
        _check_tensor("ctx.all_reduce", tensor)
        if op not in _OPS:
            raise ConfigError(f"unknown reduce op {op!r}; choose one of: {', '.join(_OPS)}.")
        if self.world.distributed:
            with self._collective(f"all_reduce({op})", tensor):
                dist.all_reduce(tensor, op=_OPS[op])
            if op == "mean":
                tensor.div_(self.world_size)
        return tensor

    def _check_rank(self, what: str, rank: Any) -> None:
        check.integer(what, rank, minimum=0)
        if rank >= self.world_size:
            raise ConfigError(f"{what} is {rank}, outside ranks 0..{self.world_size - 1}; give a rank of this job.")

    @contextlib.contextmanager
    def _collective(self, op: str, *tensors: Any) -> Iterator[None]:
        """Record (for the watchdog) and, in debug mode, check a collective before issuing it."""
        call = self.tracker.enter(op, *tensors)
        try:
            if self.debug:
                check_call(self, call)
            yield
        finally:
            self.tracker.leave(call)

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Collective: call on every rank. Every rank's ``tensor`` (same shape on all ranks)."""
        _check_tensor("ctx.all_gather", tensor)
        if not self.world.distributed:
            return [tensor]
        out = [torch.empty_like(tensor) for _ in range(self.world_size)]
        with self._collective("all_gather", tensor):
            dist.all_gather(out, tensor)
        return out

    def gather_object(self, obj: Any, dst: int | None = None) -> list[Any] | None:
        """Collective: call on every rank. Every rank's picklable ``obj``, by rank, on every rank
        (``dst=None``) or only on rank ``dst`` (the others get None)."""
        if dst is not None:
            self._check_rank("ctx.gather_object(obj, dst=...)", dst)
        if not self.world.distributed:
            return [obj]
        out: list[Any] = [None] * self.world_size
        if dst is None:
            with self._collective("all_gather_object"):
                dist.all_gather_object(out, obj)
            return out
        with self._collective(f"gather_object(dst={dst})"):
            dist.gather_object(obj, out if self.rank == dst else None, dst=dst)
        return out if self.rank == dst else None

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Collective: call on every rank. Copy rank ``src``'s tensor to all ranks, in place."""
        _check_tensor("ctx.broadcast", tensor)
        self._check_rank("ctx.broadcast(tensor, src=...)", src)
        if self.world.distributed:
            with self._collective(f"broadcast(src={src})", tensor):
                dist.broadcast(tensor, src=src)
        return tensor

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        """Collective: call on every rank. Rank ``src``'s picklable object, on every rank."""
        self._check_rank("ctx.broadcast_object(obj, src=...)", src)
        if not self.world.distributed:
            return obj
        box = [obj]
        with self._collective(f"broadcast_object(src={src})"):
            dist.broadcast_object_list(box, src=src)
        return box[0]

    def barrier(self) -> None:
        """Collective: call on every rank. Wait until every rank gets here."""
        if self.world.distributed:
            with self._collective("barrier"):
                dist.barrier()

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

    # -- evaluation -------------------------------------------------------------------------
    @torch.no_grad()
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
        _check_model("ctx.evaluate", model)
        if not hasattr(dataset, "__len__") or not hasattr(dataset, "__getitem__"):
            raise ConfigError(f"ctx.evaluate(model, dataset, ...) got {check.type_name(dataset)}; give a map-style Dataset (with __len__ and __getitem__).")
        if not callable(metric):
            raise ConfigError(f"ctx.evaluate(model, dataset, metric) got {check.type_name(metric)}; give a function (outputs, targets) -> one score per sample.")
        check.integer("ctx.evaluate(batch_size=...)", batch_size, minimum=1)
        net = self.unwrap(model)  # no DDP forward: ranks may run different numbers of batches
        was_training = net.training
        net.eval()
        # pipeline: every stage sees every batch; only the last stage has outputs to score.
        staged = getattr(self.strategy, "forward_only", None) if self.world.distributed else None
        rank, size = self._data_parallel()
        sampler = EvalShardSampler(len(dataset), rank=rank, world_size=size)
        loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler)
        totals = torch.zeros(3, dtype=torch.float64, device=self.device)  # metric, loss, count
        # fsdp/hsdp: every forward all-gathers parameters, so every rank must run as many; a
        # rank with fewer batches runs a one-sample batch whose output is not scored.
        collective = bool(getattr(self.strategy, "collective_forward", False)) and self.world.distributed
        rounds = int(self.all_reduce(torch.tensor(len(loader), device=self.device), op="max").item()) if collective else 0
        for x, y in loader:
            rounds -= 1
            self.tracker.beat()
            x, y = to_device(x, self.device), to_device(y, self.device)
            with self.precision.autocast():
                out = net(x) if staged is None else staged(net, x)
            if out is None:
                continue
            out = out.float()
            totals[0] += metric(out, y).double().sum()
            if loss_fn is not None:
                totals[1] += loss_fn(out, y).double() * len(y)
            totals[2] += len(y)
        if rounds > 0:
            pad = to_device(next(iter(DataLoader(dataset, batch_size=1)))[0], self.device)
            for _ in range(rounds):
                with self.precision.autocast():
                    net(pad)
        net.train(was_training)
        self.all_reduce(totals, op="sum")
        count = totals[2].item()
        return {
            "metric": totals[0].item() / max(count, 1),
            "loss": totals[1].item() / max(count, 1) if loss_fn is not None else float("nan"),
            "count": int(count),
        }

    # -- checkpoints ------------------------------------------------------------------------
    def checkpoints(self, folder: str, *, keep: int = 3, async_save: bool = False) -> CheckpointManager:
        """A manager of full-state checkpoints in ``folder`` (model, optimizer, scheduler, data
        position, grad scaler, communication state, every rank's RNG); see ``CheckpointManager``."""
        check.output_dir("ctx.checkpoints(folder)", os.fspath(folder) if isinstance(folder, os.PathLike) else folder)
        check.integer("ctx.checkpoints(keep=...)", keep, minimum=1)
        manager = CheckpointManager(self, folder, keep=keep, async_save=async_save)
        self._checkpoint_managers.append(manager)  # ctx.close gives their folders' locks back
        return manager

    def save(self, path: str, state: dict[str, Any]) -> None:
        """Save ``state`` to ``path`` from rank 0, atomically.

        Collective: call on every rank. Values with a ``state_dict()`` (model, optimizer,
        scheduler) are stored as their state dict.
        """
        _check_path_state("ctx.save", path, state)
        if self.is_main:
            atomic_save({k: _state_of(v) for k, v in state.items()}, path)
        self.barrier()

    def load(self, path: str, state: dict[str, Any]) -> dict[str, Any]:
        """Load ``path`` (safely: no arbitrary unpickling) into the objects of ``state``.

        A file (``ctx.save``'s): objects with ``load_state_dict`` are restored in place; the
        returned dict holds every stored value (plain values such as ``step`` included). A
        checkpoint folder, or a folder of them (``ctx.checkpoints``'s; its newest valid one), is
        verified first and loaded as ``CheckpointManager.resume`` does, which returns
        ``{"step", "extra", "path", "world_size"}``; collective then.
        """
        _check_path_state("ctx.load", path, state)
        if os.path.isdir(path):
            return load_into(self, resolve(path), {k: v for k, v in state.items() if hasattr(v, "load_state_dict")})
        stored = safe_load(path, map_location=self.device)
        if not isinstance(stored, dict):
            raise CheckpointError(f"checkpoint {path} holds a {type(stored).__name__}, not the dict ctx.save writes.")
        for key, obj in state.items():
            if hasattr(obj, "load_state_dict") and key in stored:
                obj.load_state_dict(stored[key])
        return stored

    # -- life cycle -------------------------------------------------------------------------
    def close(self) -> None:
        """Leave the process group if ``init`` created it. The models ``setup`` returned keep
        working afterwards, as plain local modules.

        Collective: call on every rank.
        """
        if self._watchdog is not None:
            self._watchdog.stop()
            self._watchdog = None
        for manager in self._checkpoint_managers:
            manager.close()
        self._checkpoint_managers = []
        if not self._owns_group:
            return
        # Free the strategy's wrappers (DDP) before the group: a DDP object that outlives its
        # group can abort the process at exit (see world._register_exit_cleanup).
        for ref in self._modules:
            module = ref()
            if module is not None and module.module is not module.original:
                module.module = module.original
        self._modules.clear()
        gc.collect()
        destroy_process_group()
        self._owns_group = False

    def __enter__(self) -> Context:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _state_of(value: Any) -> Any:
    if isinstance(value, DtrainModule):
        return value.original.state_dict()
    if hasattr(value, "state_dict") and callable(value.state_dict):
        return value.state_dict()
    return value

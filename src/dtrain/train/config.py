"""What ``dtrain train`` runs, as one frozen value in sections, each of which validates itself.

    TrainConfig(task=TaskConfig(name="mnist"), batch=BatchConfig(size=64, grad_accum=2),
                checkpoint=CheckpointConfig(dir="ckpt", save_every=100))

Each section's errors name the ``dtrain train`` flag behind the field (``--grad-accum must be >= 1``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .. import _check as check
from ..comm import CommSpec
from ..data.split import SplitSpec
from ..errors import ConfigError
from ..metrics.stragglers import StragglerConfig
from ..metrics.tensorboard import check_tensorboard
from ..metrics.trace import parse_steps
from ..parallel import parse as parse_layout
from ..precision import Precision
from .microbatch import AutoMicro, refuse_accum


def _at_least(minimum: int, **flags: int | None) -> None:
    for flag, value in flags.items():
        if value is not None and value < minimum:
            raise ConfigError(f"--{flag.replace('_', '-')} must be >= {minimum}, got {value}.")


@dataclass(frozen=True, kw_only=True)
class TaskConfig:
    name: str = "digits"
    """Built-in task name or MODULE:FUNCTION (``--task``)."""
    args: dict[str, str] = field(default_factory=dict)
    """Keyword options for the task function (``--task-arg KEY=VALUE``)."""
    data_dir: str | None = None
    """Folder with the task's data files (``--data-dir``)."""


@dataclass(frozen=True, kw_only=True)
class BatchConfig:
    size: int | None = None
    """Batch of one process, what its DataLoader yields (``--batch-size``); the task's default when None."""
    grad_accum: int = 1
    """Split each batch into this many micro-batches and step once per batch (``--grad-accum``)."""
    global_batch: int | None = None
    """Keep this global batch whatever the world size (``--elastic-batch global``): each process
    takes its share and accumulates micro-batches of ``size`` (``train/elastic.py``)."""
    split: str = "even"
    """How the global batch is split between ranks (``--batch-split``): even, speed (measured) or
    samples per rank (``40,24``); ``dtrain.data.split``."""
    num_workers: int | None = None
    """DataLoader worker processes per rank (``--num-workers``); None: ``dtrain.data.default_num_workers``
    (0 for data already in memory, else from the cores available per process)."""
    micro: AutoMicro | None = None
    """``--micro-batch auto``: the accumulation is found on the first batch, the largest micro-batch
    that fits every rank's device (``train/microbatch.py``); None: ``grad_accum`` as given."""

    def __post_init__(self) -> None:
        _at_least(1, batch_size=self.size, grad_accum=self.grad_accum)
        if self.micro is not None:
            check.instance("BatchConfig(micro=...)", self.micro, AutoMicro, "give an AutoMicro() or None")
            if self.global_batch:
                raise ConfigError("--micro-batch auto and --elastic-batch global both choose the accumulation; drop one.")
            refuse_accum(self.grad_accum)
        _at_least(0, num_workers=self.num_workers)
        if self.size is not None:
            check_accum(self.size, self.grad_accum)
        SplitSpec.parse(self.split)
        if self.micro is not None and self.split != "even":  # both size each rank's micro-batches
            raise ConfigError(f"--batch-split {self.split} with --micro-batch auto: both size each rank's micro-batches; drop one "
                              "(--micro-batch auto with the even split, or --batch-split with --grad-accum).")


@dataclass(frozen=True, kw_only=True)
class OptimConfig:
    name: str | None = None
    """sgd, adam, adamw or adadelta (``--optimizer``); the task's when None."""
    lr: float | None = None
    """Learning rate (``--lr``); the task's when None."""

    def __post_init__(self) -> None:
        if self.lr is not None:
            check.number("--lr", self.lr, positive=True)


@dataclass(frozen=True, kw_only=True)
class ScheduleConfig:
    epochs: int | None = None
    """Passes over the training set (``--epochs``); the task's default when None."""
    max_steps: int | None = None
    """Stop after this many optimizer steps, across epochs (``--max-steps``)."""
    seed: int = 0
    """Seeds Python, NumPy and torch on every rank alike (``--seed``)."""

    def __post_init__(self) -> None:
        _at_least(1, epochs=self.epochs, max_steps=self.max_steps)
        check.seed("--seed", self.seed)


@dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    dir: str | None = None
    """Save the full training state here (``--checkpoint-dir``); nothing is saved without it."""
    save_every: int | None = None
    """Also save every N steps (``--save-every``)."""
    keep: int = 3
    """Checkpoints kept in ``dir``, the newest (``--keep``)."""
    resume: bool = False
    """Continue from the newest valid checkpoint in ``dir`` (``--resume``; also done by itself
    after an elastic restart)."""
    async_save: bool = False
    """Write checkpoints in a background thread after copying the state to host memory (``--async-save``)."""

    def __post_init__(self) -> None:
        _at_least(1, save_every=self.save_every)
        if self.save_every is not None and not self.dir:
            raise ConfigError("--save-every needs --checkpoint-dir, the folder to write checkpoints to.")
        if self.async_save and not self.dir:
            raise ConfigError("--async-save needs --checkpoint-dir, the folder to write checkpoints to (without it nothing is saved).")
        if self.resume and not self.dir:
            raise ConfigError("--resume needs --checkpoint-dir, the folder holding the checkpoints to resume from.")
        _at_least(1, keep=self.keep)


@dataclass(frozen=True, kw_only=True)
class ParallelConfig:
    strategy: str = "auto"
    """single, ddp, dp, hvd, zero1, fsdp, hsdp or pipeline (``--strategy``; auto: ddp on several processes)."""
    strategy_options: dict[str, object] = field(default_factory=dict)
    """Options for the strategy's config (e.g. fsdp ``wrap``, pipeline ``schedule``)."""
    layout: str | None = None
    """How ranks split (``--parallel dp_shard=2,tp=2``; see ``dtrain.parallel``); replaces ``strategy``.
    ``auto``: the plan's pick for the world at hand (``dtrain.cli.train_auto``), resolved before launch."""
    comm: CommSpec | None = None
    """How DDP's gradients travel and after how many plain steps (``--comm``, ``--comm-warmup``,
    parsed by ``CommSpec.parse``); None: ``$DTRAIN_COMM`` or none."""

    def __post_init__(self) -> None:
        check.instance("the comm setting", self.comm, (CommSpec, type(None)), "give a CommSpec (CommSpec.parse('fp16'))")
        if self.layout == "auto":  # the plan picks (dtrain.cli.train_auto), in the launching process
            if self.strategy not in ("auto", "composed"):
                raise ConfigError(f"--parallel auto and --strategy {self.strategy} both say how to split the ranks; drop one.")
        elif self.layout is not None:
            dims = parse_layout(self.layout)
            if self.strategy not in ("auto", "composed"):
                raise ConfigError(f"--parallel {dims} and --strategy {self.strategy} both say how to split the ranks; drop --strategy "
                                  "(a strategy name is a layout: ddp = all dp_replicate, fsdp = all dp_shard, pipeline = pp).")


@dataclass(frozen=True, kw_only=True)
class RuntimeConfig:
    device: str | None = None
    """cpu or cuda (``--device``); None: cuda:<local rank> when available."""
    precision: str = "fp32"
    """fp32, bf16-mixed, fp16-mixed, float8 or auto (``--precision``)."""
    float8_recipe: str | None = None
    """float8's scaling recipe, tensorwise (default) or rowwise (``--float8-recipe``)."""
    float8_emulate: bool = False
    """float8 emulated by torchao, for a test where the device has no float8 (``--float8-emulate``)."""
    fast: bool = False
    """``--fast``: also channels-last for a conv net on CUDA (``dtrain.world.fastpath.auto_channels_last``)."""
    compile: bool = False
    """``torch.compile`` the model (``--compile``; whole, or per block where ``transforms.compile_per_block`` says)."""
    activation_checkpointing: bool = False
    """Recompute each block's activations in backward (``--activation-checkpointing``)."""
    channels_last: bool = False
    """Model and 4-D inputs in channels-last (NHWC) memory layout (``--channels-last``; conv nets)."""
    sync_bn: bool = False
    """BatchNorm statistics over every rank's batch (``--sync-bn``; SyncBatchNorm, GPU only)."""

    def __post_init__(self) -> None:
        given = [flag for flag, on in (("--float8-recipe", self.float8_recipe is not None), ("--float8-emulate", self.float8_emulate)) if on]
        if given and self.precision != "float8":
            one = len(given) == 1
            raise ConfigError(f"{' and '.join(given)} appl{'ies' if one else 'y'} to --precision float8, not {self.precision!r}; "
                              f"add --precision float8 or drop {'it' if one else 'them'}.")
        self.precision_spec()  # a bad recipe: one line here

    def precision_spec(self) -> str | Precision:
        """What ``dtrain.init(precision=...)`` takes: the name, or float8 with its recipe and emulation."""
        if self.precision == "float8":
            return Precision.with_float8(recipe=self.float8_recipe or "tensorwise", emulate=self.float8_emulate)
        return self.precision


@dataclass(frozen=True, kw_only=True)
class ObserveConfig:
    log_every: int = 20
    """Steps between progress lines and metrics records (``--log-every``)."""
    warmup_steps: int | None = None
    """Steps left out of every rate: compilation, autotuning, first batches (``--warmup-steps``;
    ``dtrain.metrics.throughput``). None: 5, at most half the run; a number given that is more than
    half the run is shrunk with a warning."""
    metrics_file: str | None = None
    """Append one JSON line per log interval to this file (``--metrics-file``)."""
    ledger: str | None = None
    """Folder of the samples ledger (``--ledger``): every rank appends the samples of each step
    it commits, for ``dtrain ckpt ledger`` to check exactly-once (``dtrain.data.ledger``)."""
    breakdown: bool = True
    """Time each step's phases on every rank (``--no-breakdown`` turns it off)."""
    stragglers: StragglerConfig = field(default_factory=StragglerConfig)
    """When a rank is named a straggler (``--straggler-window``, ``--straggler-threshold``)."""
    tensorboard: str | None = None
    """Write TensorBoard event files to this folder (``--tensorboard DIR``; rank 0)."""
    trace: str | None = None
    """Steps START:END (END not included) to write as one Chrome/Perfetto trace of every rank (``--trace``)."""
    trace_file: str = "dtrain-trace.json"
    """Where rank 0 writes that trace (``--trace-file``)."""

    def __post_init__(self) -> None:
        _at_least(1, log_every=self.log_every)
        if self.metrics_file is not None:
            check.output_file("--metrics-file", self.metrics_file)
        if self.warmup_steps is not None and self.warmup_steps < 0:
            raise ConfigError(f"--warmup-steps must be >= 0, got {self.warmup_steps}; 0 counts every step in the rates.")
        if self.ledger is not None:
            check.output_dir("--ledger", self.ledger)
        if self.tensorboard is not None:
            check_tensorboard(self.tensorboard)
        if self.trace is not None:
            parse_steps(self.trace)
            check.output_file("--trace-file", self.trace_file)
            if not self.breakdown:
                raise ConfigError("--trace draws the breakdown's spans; drop --no-breakdown.")


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    task: TaskConfig = field(default_factory=TaskConfig)
    batch: BatchConfig = field(default_factory=BatchConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    observe: ObserveConfig = field(default_factory=ObserveConfig)

    def __post_init__(self) -> None:
        for name, kind in SECTIONS.items():
            check.instance(f"TrainConfig({name}=...)", getattr(self, name), kind, f"give a {kind.__name__}")
        trace, max_steps = self.observe.trace, self.schedule.max_steps  # the one check across sections
        if trace is not None and max_steps is not None:
            start, _ = parse_steps(trace)
            if start > max_steps:
                raise ConfigError(f"--trace {trace}: --max-steps {max_steps} ends the run before step {start}, so "
                                  f"nothing would be traced; pick steps inside 1..{max_steps}.")


SECTIONS: dict[str, type] = {"task": TaskConfig, "batch": BatchConfig, "optim": OptimConfig, "schedule": ScheduleConfig,
                             "checkpoint": CheckpointConfig, "parallel": ParallelConfig, "runtime": RuntimeConfig,
                             "observe": ObserveConfig}


def check_accum(batch_size: int, grad_accum: int) -> None:
    if batch_size % grad_accum:
        lo = batch_size // grad_accum * grad_accum
        hint = f"{lo} or {lo + grad_accum}" if lo else f"{grad_accum}"
        raise ConfigError(
            f"--batch-size {batch_size} is not divisible by --grad-accum {grad_accum}; "
            f"use a multiple of {grad_accum} (e.g. {hint})."
        )

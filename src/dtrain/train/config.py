"""What ``dtrain train`` runs, as one frozen, self-validating value."""

from __future__ import annotations

from dataclasses import dataclass, field

from .. import _check as check
from ..comm import CommSpec
from ..errors import ConfigError
from ..metrics.stragglers import StragglerConfig
from ..metrics.tensorboard import check_tensorboard
from ..metrics.trace import parse_steps


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    task: str = "digits"
    """Built-in task name or MODULE:FUNCTION."""
    task_args: dict[str, str] = field(default_factory=dict)
    """Keyword options for the task function (``--task-arg KEY=VALUE``)."""
    data_dir: str | None = None
    strategy: str = "auto"
    strategy_options: dict[str, object] = field(default_factory=dict)
    """Options for the strategy's config (e.g. fsdp ``wrap``, pipeline ``schedule``)."""
    precision: str = "fp32"
    epochs: int | None = None
    """Passes over the training set; the task's default when None."""
    max_steps: int | None = None
    """Stop after this many optimizer steps (across epochs)."""
    batch_size: int | None = None
    """Batch of one process, what its DataLoader yields; the task's default when None."""
    lr: float | None = None
    optimizer: str | None = None
    grad_accum: int = 1
    """Split each batch into this many micro-batches and step once per batch."""
    seed: int = 0
    log_every: int = 20
    warmup_steps: int = 5
    fast: bool = False
    """``--fast``: also channels-last for a conv net on CUDA (``dtrain.world.fastpath.auto_channels_last``)."""
    """Steps left out of every rate (compilation, autotuning, first batches; ``dtrain.metrics.throughput``)."""
    metrics_file: str | None = None
    checkpoint_dir: str | None = None
    save_every: int | None = None
    device: str | None = None
    num_workers: int | None = None
    """DataLoader worker processes per rank; None: ``dtrain.data.default_num_workers`` (0 for
    data already in memory, else from the cores available per process)."""
    channels_last: bool = False
    """Model and 4-D inputs in channels-last (NHWC) memory layout (conv nets)."""
    sync_bn: bool = False
    """BatchNorm statistics over every rank's batch (SyncBatchNorm; GPU only)."""
    keep: int = 3
    """Checkpoints kept in ``checkpoint_dir`` (the newest)."""
    resume: bool = False
    """Continue from the newest valid checkpoint in ``checkpoint_dir`` (also done by itself after
    an elastic restart)."""
    async_save: bool = False
    """Write checkpoints in a background thread after copying the state to host memory."""
    comm: str | CommSpec | None = None
    """How DDP's gradients travel (``--comm``): none, fp16, bf16, powersgd[:RANK], localsgd[:H], auto;
    parsed here, once, into a ``CommSpec`` (None: ``$DTRAIN_COMM`` or none)."""
    comm_warmup: int | None = None
    """Plain all-reduce steps before the ``comm`` method starts (``--comm-warmup``; default 10)."""
    compile: bool = False
    """``torch.compile`` the model (``--compile``; whole, or per block where ``transforms.compile_per_block`` says)."""
    activation_checkpointing: bool = False
    """Recompute each block's activations in backward (``--activation-checkpointing``)."""
    parallel: str | None = None
    """How ranks split (``--parallel dp_shard=2,tp=2``; see ``dtrain.parallel``); replaces ``strategy``."""
    global_batch: int | None = None
    """Keep this global batch whatever the world size (``--elastic-batch global``): each process
    takes its share and accumulates micro-batches of ``batch_size`` (``train/elastic.py``)."""
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
        positive = {"--epochs": self.epochs, "--max-steps": self.max_steps, "--batch-size": self.batch_size,
                    "--grad-accum": self.grad_accum, "--log-every": self.log_every, "--save-every": self.save_every}
        for flag, value in positive.items():
            if value is not None and value < 1:
                raise ConfigError(f"{flag} must be >= 1, got {value}.")
        if self.lr is not None:
            check.number("--lr", self.lr, positive=True)
        check.seed("--seed", self.seed)
        if self.metrics_file is not None:
            check.output_file("--metrics-file", self.metrics_file)
        if self.num_workers is not None and self.num_workers < 0:
            raise ConfigError(f"--num-workers must be >= 0, got {self.num_workers}.")
        if self.warmup_steps < 0:
            raise ConfigError(f"--warmup-steps must be >= 0, got {self.warmup_steps}; 0 counts every step in the rates.")
        if self.batch_size is not None:
            check_accum(self.batch_size, self.grad_accum)
        if self.save_every is not None and not self.checkpoint_dir:
            raise ConfigError("--save-every needs --checkpoint-dir, the folder to write checkpoints to.")
        if self.async_save and not self.checkpoint_dir:
            raise ConfigError("--async-save needs --checkpoint-dir, the folder to write checkpoints to (without it nothing is saved).")
        if self.resume and not self.checkpoint_dir:
            raise ConfigError("--resume needs --checkpoint-dir, the folder holding the checkpoints to resume from.")
        if self.ledger is not None:
            check.output_dir("--ledger", self.ledger)
        if self.keep < 1:
            raise ConfigError(f"--keep must be >= 1, got {self.keep}.")
        if self.comm is not None or self.comm_warmup is not None:
            object.__setattr__(self, "comm", CommSpec.parse(self.comm, warmup=self.comm_warmup))
        if self.tensorboard is not None:
            check_tensorboard(self.tensorboard)
        if self.trace is not None:
            start, end = parse_steps(self.trace)
            if self.max_steps is not None and start > self.max_steps:
                raise ConfigError(f"--trace {self.trace}: --max-steps {self.max_steps} ends the run before step {start}, so "
                                  f"nothing would be traced; pick steps inside 1..{self.max_steps}.")
            check.output_file("--trace-file", self.trace_file)
            if not self.breakdown:
                raise ConfigError("--trace draws the breakdown's spans; drop --no-breakdown.")


def check_accum(batch_size: int, grad_accum: int) -> None:
    if batch_size % grad_accum:
        lo = batch_size // grad_accum * grad_accum
        hint = f"{lo} or {lo + grad_accum}" if lo else f"{grad_accum}"
        raise ConfigError(
            f"--batch-size {batch_size} is not divisible by --grad-accum {grad_accum}; "
            f"use a multiple of {grad_accum} (e.g. {hint})."
        )

"""`dtrain plan --verify`: the plan's memory for a layout beside a dry run of rank 0 of it, so a pick
is checked before the cluster is booked.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..errors import ConfigError
from ..train.config import BatchConfig, OptimConfig, ParallelConfig, RuntimeConfig, TaskConfig
from .config import DryRunConfig

MIB = 2**20
UNMODELLED = ("fixed", "baseline")
"""The plan's memory terms that are not tensors of the step (``plan.model.memory``): what a dry
run's tensors' peak leaves out and ``fits`` adds back."""
STEPS = 2
"""Dry-run steps per layout: the second holds the optimizer's state from the first (the steady peak)."""


@dataclass(frozen=True, kw_only=True)
class Job:
    """What the plan was asked for, as a dry run takes it (the layout aside)."""

    task: TaskConfig
    batch: int
    grad_accum: int = 1
    optimizer: str | None = None
    precision: str = "fp32"
    float8_recipe: str | None = None
    activation_checkpointing: bool = False
    fsdp_options: dict[str, Any] = field(default_factory=dict)
    """Options of the fsdp/hsdp strategies (``reduce_dtype``), given where the layout shards."""
    device: str | None = None
    """This machine's device the rank runs on (None: cuda when there is one)."""


def config_for(layout: Any, job: Job, world_size: int, procs_per_node: int) -> DryRunConfig:
    """The dry run of ``layout`` (a ``plan.Layout``): its strategy or ``--parallel`` string, rank 0."""
    shards = layout.dims.dp_shard > 1 or layout.name in ("fsdp", "hsdp")
    if layout.is_strategy:
        parallel = ParallelConfig(strategy="auto" if layout.name == "single" else layout.name,
                                  strategy_options=dict(job.fsdp_options) if shards else {})
    else:
        parallel = ParallelConfig(layout=layout.name, strategy_options=dict(job.fsdp_options) if shards else {})
    runtime = RuntimeConfig(device=job.device, precision=job.precision, activation_checkpointing=job.activation_checkpointing,
                            float8_recipe=job.float8_recipe if job.precision == "float8" else None)
    return DryRunConfig(task=job.task, batch=BatchConfig(size=job.batch, grad_accum=job.grad_accum),
                        optim=OptimConfig(name=job.optimizer), parallel=parallel, runtime=runtime,
                        world_size=world_size, local_size=procs_per_node, rank=0, steps=STEPS)


def planned(pred: Any) -> dict[str, float]:
    """The plan's tensors at the peak and its state, MiB (a ``plan.Prediction``)."""
    peak = sum(v for k, v in pred.memory.items() if k not in UNMODELLED)
    return {"peak_mib": round(peak / MIB, 2), "state_mib": round(pred.state_bytes / MIB, 2)}


def verify(preds: list[Any], job: Job, world_size: int, procs_per_node: int, capacity: float) -> list[dict[str, Any]]:
    """Dry-run each prediction's layout; one entry each: the plan's and the dry run's peak and state,
    the plan's relative error and ``fits``, or ``impossible`` (the dry run's own ConfigError)."""
    from . import dry_run

    out = []
    for pred in preds:
        _progress(pred.layout.name, job, world_size)
        entry: dict[str, Any] = {"layout": pred.layout.name, "train_args": pred.layout.train_args(),
                                 "planned": {**planned(pred), "fits": pred.fits}}
        try:
            rec = dry_run(config_for(pred.layout, job, world_size, procs_per_node), with_prediction=False)
        except ConfigError as exc:
            entry["impossible"] = str(exc)
            out.append(entry)
            continue
        extra = sum(pred.memory.get(k, 0.0) for k in UNMODELLED)
        entry["measured"] = {"peak_mib": rec["peak_mib"], "state_mib": rec["state_mib"], "peak_kind": rec["peak_kind"],
                             "device": rec["device"], "fits": rec["peak_mib"] * MIB + extra <= capacity,
                             "collectives": rec["collectives"], "wall_s": rec["wall_s"]}
        entry["plan_error"] = {k: _rel(entry["planned"][k], rec[k]) for k in ("peak_mib", "state_mib")}
        out.append(entry)
    return out


def _progress(layout: str, job: Job, world_size: int) -> None:
    """One line on stderr before each dry run (it runs the rank's real steps: seconds to minutes)."""
    import sys

    import torch

    on_cpu = job.device == "cpu" or (job.device is None and not torch.cuda.is_available())
    slow = (f" ({job.precision} on a CPU: its bf16 matmuls run at the CPU's bf16 speed, on a CPU without bf16 "
            "instructions many times slower than fp32; minutes for a model of tens of millions of parameters)"
            if on_cpu and job.precision != "fp32" else "")
    print(f"dtrain plan --verify: dry-running {layout}, rank 0 of {world_size}{slow}", file=sys.stderr, flush=True)


def _rel(plan: float, measured: float) -> float | None:
    return None if not measured else round((plan - measured) / measured, 4)


def lines(entries: list[dict[str, Any]], world_size: int) -> list[str]:
    """The entries for a reader: one line per layout."""
    out = []
    for e in entries:
        head = f"verify {e['layout']} (rank 0 of {world_size}, dry run):"
        if "impossible" in e:
            out.append(f"{head} cannot run: {e['impossible']}")
            continue
        m, p, err = e["measured"], e["planned"], e["plan_error"]
        kind = "tensors' peak" if m["peak_kind"] == "tensors" else "max_memory_allocated"
        out.append(f"{head} peak {_mib(m['peak_mib'])} ({kind} on {m['device']}), plan {_mib(p['peak_mib'])} "
                   f"({_pct(err['peak_mib'])}); state {_mib(m['state_mib'])}, plan {_mib(p['state_mib'])} "
                   f"({_pct(err['state_mib'])}); {'fits' if m['fits'] else 'does NOT fit'} by the measured peak")
    return out


def _mib(x: float) -> str:
    return f"{x:,.1f} MiB" if x >= 10 else f"{x:.3g} MiB"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"plan {x:+.1%}"

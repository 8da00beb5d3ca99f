"""``--micro-batch auto`` for `dtrain train`: the flag, and the plan's proposal made before the
workers start (the search that confirms it runs in the workers: ``dtrain.train.microbatch``)."""

from __future__ import annotations

import argparse
import dataclasses
import time
from typing import Any

from ..errors import ConfigError
from ..train.microbatch import AUTO, AutoMicro, propose, refuse_strategy

MIB = 2**20
HELP = ("auto: the largest micro-batch per process that fits the device (proposed by the plan's memory model, confirmed "
        "by a trial forward and backward on every rank, smaller after an out-of-memory on any rank); each --batch-size "
        "batch is split into micro-batches and accumulated, so the global batch stays --batch-size x processes")


def add_micro_batch_arg(g: argparse._ActionsContainer) -> None:
    g.add_argument("--micro-batch", default=None, metavar="auto", help=HELP)


def micro_from_args(value: str | None) -> AutoMicro | None:
    if value is None:
        return None
    if value != AUTO:
        raise ConfigError(f"--micro-batch takes auto, got {value!r}; for a micro-batch of your own choice give "
                          "--grad-accum K (each --batch-size batch split into K micro-batches).")
    return AutoMicro()


def with_proposal(cfg: Any, world_size: int, device: str | None, capacity_bytes: float | None = None,
                  local_size: int = 1) -> Any:
    """``cfg`` (a TrainConfig with ``--micro-batch auto``) with the plan's proposal: the largest divisor
    of the batch whose predicted memory per rank fits this device (``capacity_bytes``; default the
    GPU's share, or the machine's memory shared by the node's ``local_size`` processes)."""
    from ..parallel.dims import ParallelDims
    from ..plan import Layout, Settings, make_plan
    from ..plan.cluster import GIB, build, preset_for
    from ..plan.profile import profile_task
    from ..tasks import load_task

    refuse_layout(cfg, world_size)  # before the plan is paid for; the workers ask the strategy they built too
    t0 = time.perf_counter()
    task = load_task(cfg.task.name, data_dir=cfg.task.data_dir, options=cfg.task.args)
    batch = cfg.batch.size or task.batch_size
    gpu, name, capacity = _device(device)
    capacity = capacity_bytes or capacity
    # The memory model does not use a GPU's FLOPs: a preset of the same kind, with this device's memory.
    settings = {"device": (preset_for(name, capacity) or "h100") if gpu else "cpu", "procs_per_node": world_size, "nodes": 1,
                **({"memory_gib": capacity / GIB} if capacity else {})}
    precision = cfg.runtime.precision
    if precision in ("auto", "float8"):  # planned as the bf16 a float8 run wraps (as --parallel auto)
        precision = "bf16-mixed" if gpu else "fp32"
    zero1 = cfg.parallel.strategy == "zero1"
    layout = Layout("zero1" if zero1 else "ddp" if world_size > 1 else "single",
                    ParallelDims(dp_replicate=world_size) if world_size > 1 else ParallelDims(), zero1=zero1)
    # Memory alone is asked: the model counted on the meta device, no step timed (plan_task would time one).
    prof = profile_task(task, batch=batch, precision=precision, gpu=gpu)
    cluster, predictions = build(settings), {}
    if not gpu and capacity_bytes is None:  # the node's processes share its memory
        cluster = dataclasses.replace(cluster, device=dataclasses.replace(cluster.device, memory_bytes=cluster.device.memory_bytes / local_size))

    def fits(m: int) -> bool:
        s = Settings(batch=batch, precision=precision, optimizer=cfg.optim.name or task.optimizer, grad_accum=batch // m,
                     activation_checkpointing=cfg.runtime.activation_checkpointing)
        predictions[m] = make_plan(prof, cluster, s, layouts=[layout], comms=("none",)).predictions[0]
        return predictions[m].fits

    m = propose(batch, fits)
    if m is None:
        one = predictions[1]
        raise ConfigError(f"--micro-batch auto: one sample per micro-step does not fit by the plan: {one.mem_bytes / MIB:,.1f} MiB "
                          f"predicted per process on a device of {one.capacity / MIB:,.1f} MiB; shard the model (--strategy fsdp), "
                          "use a smaller model, or a larger device.")
    pick = predictions[m]
    note = (f"proposed {m} by the plan in {time.perf_counter() - t0:.2f} s: {pick.mem_bytes / MIB:,.1f} MiB predicted "
            f"of {pick.capacity / MIB:,.1f} MiB")
    auto = AutoMicro(proposal=m, reserve_bytes=pick.memory.get("optimizer", 0.0), note=note)
    return dataclasses.replace(cfg, batch=dataclasses.replace(cfg.batch, micro=auto))


def refuse_layout(cfg: Any, world_size: int) -> None:
    """One line, before any worker starts, for a strategy or layout that communicates in its forward."""
    from .. import strategies
    from ..parallel import parse

    par = cfg.parallel
    comm = str(par.comm) if par.comm is not None else None
    if par.layout is not None and par.layout != "auto":
        dims = parse(par.layout)
        if max(dims.dp_shard, dims.tp, dims.pp) > 1:
            raise ConfigError(f"--micro-batch auto retries a micro-step that ran out of memory, which --parallel {dims} cannot "
                              "do (its forward communicates, so a rank that failed would leave the others waiting); use "
                              "replicas alone (ddp, zero1), or set --grad-accum yourself.")
        refuse_strategy(strategies.declared("ddp", distributed=world_size > 1), str(dims), comm)
        return
    refuse_strategy(strategies.declared(par.strategy, distributed=world_size > 1), par.strategy, comm)


def _device(device: str | None) -> tuple[bool, str, float | None]:
    """(a GPU?, its name, the bytes this process may allocate on it: total x the process's fraction)."""
    import torch

    if device == "cpu" or not torch.cuda.is_available():
        return False, "cpu", None
    index = torch.device(device).index if device and ":" in device else 0
    props = torch.cuda.get_device_properties(index)
    return True, props.name, float(props.total_memory) * torch.cuda.get_per_process_memory_fraction(index)

"""A dry run's result: the rank's measured peak and state, whether it fits the device, the
collectives of a step, and `dtrain plan`'s memory prediction of the same configuration beside them."""

from __future__ import annotations

import os
from typing import Any

import torch

from ..errors import ConfigError
from ..parallel.dims import ParallelDims
from ..tasks import Task
from .config import DryRunConfig
from .rank import RankRun
from .track import summarise

MIB = 2**20
CUDA_FIXED = 1.5 * 2**30
"""Memory a GPU process takes beyond its tensors (the CUDA context, the allocator's slack), which
``max_memory_allocated`` leaves out: `dtrain plan`'s GPU presets count the same (``fixed_bytes``)."""


def device_memory(cfg: DryRunConfig, device: torch.device) -> tuple[float, str]:
    """Bytes the device has, and where that figure came from."""
    if cfg.device_memory is not None:
        return cfg.device_memory, "--device-memory"
    if device.type == "cuda":
        return float(torch.cuda.get_device_properties(device).total_memory), torch.cuda.get_device_name(device)
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")), "this machine's RAM"


def predicted(task: Task, cfg: DryRunConfig, run: RankRun, device: torch.device, capacity: float) -> dict[str, Any] | None:
    """`dtrain plan`'s memory model (``dtrain.plan.model.memory``) for this layout and batch, by
    kind, with the figures a measured peak compares with; None where the plan cannot profile the model."""
    from ..plan.cluster import Cluster, cpu_device, local_gpu
    from ..plan.layouts import Layout
    from ..plan.model import Settings, memory
    from ..plan.profile import profile_task

    precision = cfg.runtime.precision if cfg.runtime.precision != "auto" else "fp32"
    optimizer = cfg.optim.name or task.optimizer
    try:
        prof = profile_task(task, batch=run.batch, precision=precision, gpu=device.type == "cuda")
    except ConfigError:
        return None
    dev = cpu_device(None, capacity) if device.type != "cuda" else local_gpu()[0]
    nodes = max(1, cfg.world_size // cfg.local_size)
    cluster = Cluster(nodes=nodes, procs_per_node=cfg.world_size // nodes, device=dev)
    layout = Layout(run.layout, ParallelDims(**run.dims), zero1=run.layout == "zero1")
    settings = Settings(batch=run.batch, precision=precision, optimizer=optimizer, grad_accum=cfg.batch.grad_accum,
                        activation_checkpointing=cfg.runtime.activation_checkpointing)
    mem = memory(prof, cluster, layout, settings)
    peak = sum(v for k, v in mem.items() if k not in ("fixed", "baseline"))
    state = sum(mem.get(k, 0.0) for k in ("params", "grads", "optimizer"))
    return {"peak_mib": round(peak / MIB, 2), "state_mib": round(state / MIB, 2),
            "memory_mib": {k: round(v / MIB, 2) for k, v in mem.items()}}


def result(cfg: DryRunConfig, task: Task, run: RankRun, device: torch.device, wall_s: float,
           with_prediction: bool = True) -> dict[str, Any]:
    """The dry run's record (``--json``: this object)."""
    capacity, where = device_memory(cfg, device)
    steady = run.steps[-1]
    per_step = summarise(steady)
    alike = all(summarise(s) == per_step for s in run.steps[1:])
    state = sum(run.state.values())
    fixed = CUDA_FIXED if device.type == "cuda" else 0.0
    return {
        "task": task.name, "world_size": cfg.world_size, "procs_per_node": cfg.local_size, "rank": cfg.rank,
        "layout": run.layout, "dims": run.dims, "device": str(device), "precision": cfg.runtime.precision,
        "batch_size": run.batch, "grad_accum": cfg.batch.grad_accum, "steps": cfg.steps,
        "peak_mib": round(run.peak_bytes / MIB, 2), "peak_kind": run.peak_kind,
        "state_mib": round(state / MIB, 2), "state_mib_by_kind": {k: round(v / MIB, 2) for k, v in run.state.items()},
        "device_memory_mib": round(capacity / MIB, 1), "device_memory_from": where,
        "fixed_mib": round(fixed / MIB, 1), "fits": run.peak_bytes + fixed <= capacity,
        "reserved_mib": None if run.reserved_bytes is None else round(run.reserved_bytes / MIB, 2),
        "collectives": per_step, "collectives_same_every_step": alike,
        "collectives_first_step": summarise(run.steps[0]), "setup_collectives": summarise(run.setup),
        "empty_params": run.empty_params, "params_local": run.params_local,
        "predicted": predicted(task, cfg, run, device, capacity) if with_prediction else None,
        "losses": [round(v, 6) for v in run.losses], "wall_s": round(wall_s, 2),
    }


def _mib(x: float | None) -> str:
    return "unknown" if x is None else f"{x:,.1f} MiB"


def lines(rec: dict[str, Any]) -> list[str]:
    """The record for a reader, a few lines."""
    pred = rec["predicted"] or {}
    kind = "tensors' peak" if rec["peak_kind"] == "tensors" else "torch.cuda.max_memory_allocated"
    fit = "fits" if rec["fits"] else "does NOT fit"
    out = [
        f"dry run: {rec['task']}, rank {rec['rank']} of {rec['world_size']} ({rec['procs_per_node']}/node), layout {rec['layout']}, "
        f"{rec['precision']}, batch {rec['batch_size']}/process, {rec['steps']} step(s) on {rec['device']}",
        f"peak: {_mib(rec['peak_mib'])} ({kind}); plan predicts {_mib(pred.get('peak_mib'))}",
        f"state (params+grads+optimizer): {_mib(rec['state_mib'])}; plan predicts {_mib(pred.get('state_mib'))}",
        f"device memory: {_mib(rec['device_memory_mib'])} ({rec['device_memory_from']}): {fit}"
        + (f" (with {_mib(rec['fixed_mib'])} for the CUDA context; the allocator reserved {_mib(rec['reserved_mib'])})"
           if rec["fixed_mib"] else ""),
        "collectives per step:" + ("" if rec["collectives"] else " none"),
    ]
    for c in rec["collectives"]:
        out.append(f"  {c['kind']:<15} over {c['dim']:<13} {c['count']:>5} call(s)  {c['bytes'] / MIB:,.2f} MiB")
    if not rec["collectives_same_every_step"]:
        out.append("  (the steps issued different collectives; the last step's are shown)")
    if rec["empty_params"]:
        out.append(f"note: {len(rec['empty_params'])} parameter(s) have no element on rank {rec['rank']} "
                   f"(fewer rows than the ranks that shard them), e.g. {rec['empty_params'][0]}")
    return out

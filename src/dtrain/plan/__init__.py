"""``dtrain plan``: step time, throughput and memory per rank of each layout x comm method on a
cluster, from a profile of the model (``profile.profile_task``, or ``profile.transformer`` as data):
``make_plan(prof, cluster.build({...}), Settings(batch=32)).best.layout.train_args()``."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch

from . import machinery
from .cluster import Cluster, cpu_device
from .layouts import COMMS, Layout, candidates
from .model import ASSUMPTIONS, Prediction, Settings, fsdp_param_bytes, predict
from .profile import ModelProfile, add_timing, profile_task

MARGIN = 0.10
"""Predictions this close (a fraction of the best's samples/s) are too close to call: the plan's own error."""


@dataclass(frozen=True)
class Plan:
    predictions: list[Prediction]  # fastest first; those that fit before those that do not
    cluster: Cluster
    profile: ModelProfile
    settings: Settings
    margin: float = MARGIN  # ``close_to`` counts a prediction this close to another (``dtrain plan --margin``)

    @property
    def best(self) -> Prediction | None:
        """The fastest layout that fits in memory (None: none fits)."""
        return next((p for p in self.predictions if p.fits), None)

    @property
    def best_exact(self) -> Prediction | None:
        """The fastest that fits with ``--comm none`` (compression and local SGD change the update)."""
        return next((p for p in self.predictions if p.fits and p.layout.comm == "none"), None)

    def close_to(self, pick: Prediction | None, *, exact: bool = False) -> list[Prediction]:
        """The other layouts that fit (``exact``: with ``--comm none``) within ``margin`` of ``pick``'s samples/s."""
        if pick is None:
            return []
        return [p for p in self.predictions if p is not pick and p.fits and (not exact or p.layout.comm == "none")
                and p.samples_per_s * (1 + self.margin) >= pick.samples_per_s]

    def as_dict(self) -> dict[str, Any]:
        world, best, exact, s = self.cluster.world_size, self.best, self.best_exact, self.settings
        return {"layouts": [p.as_dict(world) for p in self.predictions],
                "best": best.as_dict(world) if best else None,
                "best_exact": exact.as_dict(world) if exact else None,
                "margin": self.margin, "close_to_best": [p.as_dict(world) for p in self.close_to(best)],
                "close_to_best_exact": [p.as_dict(world) for p in self.close_to(exact, exact=True)],
                "world_size": world, "cluster": self.cluster.describe(), "model": self.profile.as_dict(),
                "settings": {"batch_size": s.batch, "precision": s.precision, "optimizer": s.optimizer,
                             "grad_accum": s.grad_accum, "activation_checkpointing": s.activation_checkpointing,
                             "microbatches": s.microbatches, "threads_per_proc": s.threads_per_proc},
                "assumptions": list(ASSUMPTIONS) + list(self.profile.notes)}


def make_plan(prof: ModelProfile, cluster: Cluster, settings: Settings, *, layouts: list[Layout] | None = None,
              comms: tuple[str, ...] = COMMS, tp_ok: bool = True, pp_ok: bool = True) -> Plan:
    """Predict every candidate layout (or ``layouts``) and rank them."""
    layouts = _layouts(prof, cluster, comms, tp_ok, pp_ok) if layouts is None else layouts
    preds = sorted((predict(prof, cluster, lay, settings) for lay in layouts), key=lambda p: (not p.fits, -p.samples_per_s))
    return Plan(preds, cluster, prof, settings)


def plan_task(task: Any, cluster: Cluster, *, batch: int, precision: str = "fp32", optimizer: str | None = None,
              grad_accum: int = 1, activation_checkpointing: bool = False, microbatches: int = 4, schedule: str = "1f1b",
              threads: int = 1, layouts: list[Layout] | None = None, comms: tuple[str, ...] = COMMS,
              task_spec: tuple[str, str | None, dict[str, str]] | None = None, profile_s: float = 10.0,
              log_every: int = 20) -> Plan:
    """Profile ``task`` and plan it on ``cluster`` (`dtrain plan`, `--parallel auto`): a GPU preset from
    FLOPs, a CPU timed here (``task_spec``: each layout's machinery too), ``--device cuda`` timed on it."""
    with torch.device("meta"):
        model = task.build_model()
    # a parameter shared between modules (tied weights) cannot be split between pipeline stages
    tp_ok, pp_ok = task.tp_plan is not None, len(list(model.named_parameters(remove_duplicate=False))) == len(list(model.parameters()))
    optimizer = optimizer or task.optimizer
    prof = profile_task(task, batch=batch, precision=precision, gpu=cluster.is_gpu)
    layouts = _layouts(prof, cluster, comms, tp_ok, pp_ok) if layouts is None else layouts
    if not cluster.is_gpu:  # this machine's CPU: the profile's achieved rate is the device's
        mach = None if task_spec is None else machinery.measure_layouts(
            task_spec, batch=batch, precision=precision, optimizer=optimizer, kinds=machinery.kinds_for(layouts),
            microbatches=microbatches, schedule=schedule, threads=threads, budget_s=profile_s)
        prof = add_timing(prof, task, batch=batch, optimizer=optimizer, threads=threads, machinery=mach,
                          checkpointed=activation_checkpointing)
        cluster = replace(cluster, device=cpu_device(prof.achieved_flops, cluster.device.memory_bytes))
    elif cluster.device.profiled:  # this machine's GPU: its step timed, its achieved fraction of the peak kept
        prof = add_timing(prof, task, batch=batch, optimizer=optimizer, threads=threads, device="cuda",
                          checkpointed=activation_checkpointing)
        dev, achieved, peak = cluster.device, prof.achieved_flops or 0.0, cluster.device.flops(precision)
        cluster = replace(cluster, device=replace(dev, achieved=min(1.0, achieved / peak)) if peak
                          else replace(dev, peak_flops=dict.fromkeys(dev.peak_flops, achieved)))
    settings = Settings(batch=batch, precision=precision, optimizer=optimizer, grad_accum=grad_accum,
                        activation_checkpointing=activation_checkpointing, microbatches=microbatches, schedule=schedule,
                        threads_per_proc=threads, log_every=log_every, param_comm_bytes=fsdp_param_bytes(precision),
                        data_s_per_sample=prof.timing.data_s / prof.timing.batch if prof.timing else 0.0)
    return make_plan(prof, cluster, settings, layouts=layouts, comms=comms, tp_ok=tp_ok, pp_ok=pp_ok)


def _layouts(prof: ModelProfile, c: Cluster, comms: tuple[str, ...], tp_ok: bool, pp_ok: bool) -> list[Layout]:
    return candidates(c.world_size, c.procs_per_node, c.nodes, blocks=len(prof.blocks), tp_ok=tp_ok and bool(prof.blocks),
                      pp_ok=pp_ok, comms=comms)


__all__ = ["MARGIN", "Cluster", "Layout", "ModelProfile", "Plan", "Prediction", "Settings", "make_plan", "plan_task", "predict"]

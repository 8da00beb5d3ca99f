"""``dtrain plan``: predict step time, throughput, scaling efficiency and memory per rank of each
layout x comm method on a cluster, from a profile of the model, and pick the fastest that fits.

    prof = profile.profile_task(task, batch=32)             # or profile.transformer(...) as data
    plan = make_plan(prof, cluster, Settings(batch=32))
    plan.best.layout.train_args()                          # ['--strategy', 'fsdp'] for `dtrain train`
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .cluster import Cluster
from .layouts import COMMS, Layout, candidates
from .model import ASSUMPTIONS, Prediction, Settings, predict
from .profile import ModelProfile


@dataclass(frozen=True)
class Plan:
    predictions: list[Prediction]
    """Fastest first; those that fit before those that do not."""
    cluster: Cluster
    profile: ModelProfile
    settings: Settings

    @property
    def best(self) -> Prediction | None:
        """The fastest layout that fits in memory (None: none fits)."""
        return next((p for p in self.predictions if p.fits), None)

    @property
    def best_exact(self) -> Prediction | None:
        """The fastest that fits among layouts that average the exact fp32 gradients every step
        (``--comm none``): compression and local SGD change the update, which a user opts into."""
        return next((p for p in self.predictions if p.fits and p.layout.comm == "none"), None)

    def as_dict(self) -> dict[str, Any]:
        world = self.cluster.world_size
        best, exact = self.best, self.best_exact
        s = self.settings
        return {"layouts": [p.as_dict(world) for p in self.predictions],
                "best": best.as_dict(world) if best else None,
                "best_exact": exact.as_dict(world) if exact else None,
                "world_size": world, "cluster": self.cluster.describe(), "model": self.profile.as_dict(),
                "settings": {"batch_size": s.batch, "precision": s.precision, "optimizer": s.optimizer,
                             "grad_accum": s.grad_accum, "activation_checkpointing": s.activation_checkpointing,
                             "microbatches": s.microbatches, "threads_per_proc": s.threads_per_proc},
                "assumptions": list(ASSUMPTIONS) + list(self.profile.notes)}


def make_plan(prof: ModelProfile, cluster: Cluster, settings: Settings, *, layouts: list[Layout] | None = None,
              comms: tuple[str, ...] = COMMS, tp_ok: bool = True, pp_ok: bool = True) -> Plan:
    """Predict every candidate layout (or ``layouts``) and rank them."""
    if layouts is None:
        layouts = candidates(cluster.world_size, cluster.procs_per_node, cluster.nodes, blocks=len(prof.blocks),
                             tp_ok=tp_ok and bool(prof.blocks), pp_ok=pp_ok, comms=comms)
    preds = [predict(prof, cluster, lay, settings) for lay in layouts]
    preds.sort(key=lambda p: (not p.fits, -p.samples_per_s))
    return Plan(preds, cluster, prof, settings)


__all__ = ["Cluster", "Layout", "ModelProfile", "Plan", "Prediction", "Settings", "make_plan", "predict"]

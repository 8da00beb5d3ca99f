"""Fit ``dtrain bench``'s methods to this machine before any process starts: the processes against
the GPUs NCCL can use, and the methods that cannot run here, each with the reason."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..launch.preflight import check_ranks_fit
from ..strategies import declared
from .methods import Method


@dataclass(frozen=True)
class Fit:
    methods: list[Method]
    nproc: int
    skipped: list[dict[str, str]] = field(default_factory=list)
    """``{"method": name, "why": reason}`` of each method left out."""
    notes: list[str] = field(default_factory=list)
    """What was changed to fit (e.g. ``-n`` sized to the GPUs), for the report."""


def fit_methods(methods: list[Method], nproc: int, device: str | None, *, nproc_given: bool, gpus: int | None = None) -> Fit:
    """The methods that run here and with how many processes: a given ``-n`` too large for the GPUs
    is an error line, the default is sized down with a note. ``gpus``: default counted."""
    from ..launch import preflight

    gpus = preflight.cuda_device_count() if gpus is None else gpus
    cuda = gpus > 0 and (device is None or str(device).startswith("cuda"))
    notes: list[str] = []
    if cuda and nproc > gpus:
        if nproc_given:
            check_ranks_fit(nproc, device, gpus=gpus)  # raises: the user asked for it
        notes.append(f"-n sized from the default {nproc} to {gpus}: {gpus} GPU(s) visible and NCCL needs one per process "
                     f"(--device cpu compares {nproc} processes on gloo)")
        nproc = gpus
    keep, skipped = [], []
    for m in methods:
        why = _why_not(m, nproc, cuda)
        if why:
            skipped.append({"method": m.name, "why": why})
        else:
            keep.append(m)
    return Fit(keep, nproc, skipped, notes)


def _why_not(m: Method, nproc: int, cuda: bool) -> str | None:
    if m.gpu_only and not cuda:
        return f"{m.name} needs CUDA (fp16 loss scaling); this bench runs on the CPU"
    if m.comm and nproc < 2:
        return f"{m.name} needs at least 2 processes (one has no gradients to send); this bench runs 1"
    if declared(m.strategy).staged_step and nproc < 2 and not m.single_process:
        return f"{m.strategy} needs at least 2 processes (a stage each); this bench runs 1"
    return None

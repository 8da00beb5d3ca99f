"""A script's files, as ``Context`` writes and reads them: ``ctx.save`` / ``ctx.load`` of one file
(rank 0 writes it atomically; no arbitrary unpickling when it is read) and the arguments of
``ctx.checkpoints`` (the full-state manager itself is ``dtrain.checkpoint.CheckpointManager``).
"""

from __future__ import annotations

import os
from typing import Any

import torch

from .. import _check as check
from ..checkpoint import RunState, atomic_save, load_into, resolve, safe_load
from ..comm.collectives import Collectives
from ..errors import CheckpointError
from .step import DtrainModule


def check_checkpoints_args(folder: Any, keep: Any, async_save: Any) -> None:
    """``ctx.checkpoints``' arguments: a folder dtrain can create and write, ``keep`` >= 1."""
    check.output_dir("ctx.checkpoints(folder)", os.fspath(folder) if isinstance(folder, os.PathLike) else folder)
    check.integer("ctx.checkpoints(keep=...)", keep, minimum=1)
    check.instance("ctx.checkpoints(async_save=...)", async_save, bool, "give True or False")


def save(collectives: Collectives, path: str, state: dict[str, Any]) -> None:
    """``ctx.save``: ``state`` to ``path`` from rank 0, atomically; a failure is every rank's one
    line. Collective: call on every rank."""
    _check_path_state("ctx.save", path, state)
    problem = None
    if collectives.world.is_main:
        try:
            atomic_save({k: _state_of(v) for k, v in state.items()}, path)
        except CheckpointError as exc:
            problem = str(exc)
    problem = collectives.broadcast_object(problem)  # every rank stops with rank 0's line, none waits
    if problem is not None:
        raise CheckpointError(problem)


def load(run: RunState, device: torch.device, path: str, state: dict[str, Any]) -> dict[str, Any]:
    """``ctx.load``: a file into ``state``'s objects, or a checkpoint folder as
    ``CheckpointManager.resume`` loads one (collective then)."""
    _check_path_state("ctx.load", path, state)
    if os.path.isdir(path):
        return load_into(run, resolve(path), {k: v for k, v in state.items() if hasattr(v, "load_state_dict")})
    stored = safe_load(path, map_location=device)
    if not isinstance(stored, dict):
        raise CheckpointError(f"checkpoint {path} holds a {type(stored).__name__}, not the dict ctx.save writes.")
    for key, obj in state.items():
        if hasattr(obj, "load_state_dict") and key in stored:
            obj.load_state_dict(stored[key])
    return stored


def _check_path_state(what: str, path: Any, state: Any) -> None:
    check.instance(f"{what}(path, ...)", path, (str, os.PathLike), "give the checkpoint file's path")
    check.instance(f"{what}(path, state)", state, dict, 'give a dict such as {"model": model, "optimizer": optimizer}')


def _state_of(value: Any) -> Any:
    if isinstance(value, DtrainModule):
        return value.original.state_dict()
    if hasattr(value, "state_dict") and callable(value.state_dict):
        return value.state_dict()
    return value

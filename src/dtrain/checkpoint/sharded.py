"""Sharded checkpoints through ``torch.distributed.checkpoint`` (DCP): each rank writes what it holds
into ``sharded/`` and loads the slices its own layout holds, so any world size can load them. Keys
are fully qualified names, so pipeline stages never collide."""

from __future__ import annotations

import contextlib
import os
import shutil
import warnings
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ..errors import CheckpointError, first_line
from ..metrics.memory import inner_optimizer
from . import dcp_safe

if TYPE_CHECKING:
    from ..comm.collectives import Collectives

SHARDED_DIR = "sharded"


def _options() -> Any:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(flatten_optimizer_state_dict=True)


def _split(objects: dict[str, Any]) -> tuple[tuple[str, nn.Module] | None, dict[str, torch.optim.Optimizer]]:
    """The one model and the optimizers among ``objects`` (both as the user's torch objects)."""
    models = {k: getattr(v, "original", v) for k, v in objects.items() if isinstance(v, nn.Module)}
    optims = {k: inner_optimizer(v) for k, v in objects.items() if isinstance(v, torch.optim.Optimizer)}
    if len(models) > 1:
        raise CheckpointError(f"a sharded checkpoint holds one model; got {len(models)} ({', '.join(models)}); save them in separate checkpoints.")
    if optims and not models:
        raise CheckpointError("a sharded checkpoint needs the model next to its optimizer (save(model=..., optimizer=...)).")
    return (next(iter(models.items())) if models else None), optims


def sharded_names(objects: dict[str, Any]) -> list[str]:
    """Names of the objects a sharded checkpoint stores through DCP (the model, its optimizers)."""
    model, optims = _split(objects)
    return ([model[0]] if model else []) + sorted(optims)


def state_dicts(objects: dict[str, Any]) -> dict[str, Any]:
    """This rank's part of the model's and optimizers' state dicts, keyed by object name."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    model, optims = _split(objects)
    if model is None:
        return {}
    name, module = model
    out: dict[str, Any] = {name: _plain(get_model_state_dict(module, options=_options()))}
    for key, opt in optims.items():
        out[key] = _plain(get_optimizer_state_dict(module, opt, options=_options()))
    return out


def _plain(value: Any) -> Any:
    """``value`` with each DTensor whose shard is a wrapper subclass (torchao's float8 weight)
    holding its plain inner tensor (the same memory): a reader without torchao refuses the subclass."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    local = getattr(value, "_local_tensor", None)
    if local is None or not hasattr(local, "__tensor_flatten__"):
        return value
    names, _ = local.__tensor_flatten__()
    if len(names) != 1:
        return value
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(getattr(local, names[0]), value.device_mesh, value.placements, run_check=False,
                              shape=value.shape, stride=value.stride())


def save_sharded(coll: Collectives, staging: str, objects: dict[str, Any]) -> list[str]:
    """Write every rank's part of ``objects`` into the folder ``staging``; returns the names
    stored. Collective: call on every rank."""
    import torch.distributed.checkpoint as dcp

    if coll.is_main:
        shutil.rmtree(staging, ignore_errors=True)  # a killed save's leftovers (another world size)
        os.makedirs(staging, exist_ok=True)
    coll.barrier()
    state = state_dicts(objects)
    with coll.labelled("sharded checkpoint save (torch.distributed.checkpoint)"), _quiet(coll):
        dcp.save(state, checkpoint_id=staging)
    return sorted(state)


def load_sharded(coll: Collectives, path: str, objects: dict[str, Any], names: list[str]) -> None:
    """Load the objects named in ``names`` from checkpoint ``path``'s ``sharded/`` folder, each
    rank reading the slices its own layout holds (through ``dcp_safe``). Collective."""
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    wanted = {k: v for k, v in objects.items() if k in names and v is not None}
    model, optims = _split(wanted)
    if model is None:
        return
    folder = os.path.join(path, SHARDED_DIR)
    dcp_safe.read_metadata(folder)  # a refused or missing .metadata: its own line, before any collective
    state = state_dicts(wanted)
    try:
        with coll.labelled("sharded checkpoint load (torch.distributed.checkpoint)"), _quiet(coll):
            dcp_safe.load(state, folder)
    except CheckpointError:
        raise
    except Exception as exc:  # DCP raises CheckpointException / RuntimeError with per-rank details
        first = first_line(exc)
        raise CheckpointError(f"checkpoint {path} does not fit this model/optimizer ({first[:300]}).") from None
    name, module = model
    set_model_state_dict(module, state[name], options=_options())
    for key, opt in optims.items():
        set_optimizer_state_dict(module, opt, state[key], options=_options())


@contextlib.contextmanager
def _quiet(coll: Collectives):
    """One process without a process group is what we mean; DCP warns that it assumes so."""
    with warnings.catch_warnings():
        if not coll.world.distributed:
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def consolidated(path: str) -> dict[str, Any]:
    """The whole of a sharded checkpoint's ``sharded/`` folder as plain tensors, in this process
    (no process group): ``{"model": {name: tensor}, "optimizer": {...}}``."""
    folder = os.path.join(path, SHARDED_DIR)
    if not os.path.isdir(folder):
        raise CheckpointError(f"checkpoint {path} has no {SHARDED_DIR}/ folder; it is not a sharded checkpoint.")
    try:
        return dcp_safe.load_whole(folder)
    except CheckpointError:
        raise
    except Exception as exc:  # DCP wraps what failed in a CheckpointException
        first = first_line(exc)
        raise CheckpointError(f"checkpoint {path}: its {SHARDED_DIR}/ folder cannot be read ({first[:300]}).") from None

"""``--init-from DIR``: a transformers folder's safetensors weights read into a model the layout
has already split, each rank reading only the rows and columns it holds (safetensors' ``get_slice``
of its DTensor chunk); nothing is communicated.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..errors import CheckpointError
from . import hf

# Module wrappers that add a name segment (activation checkpointing, a whole-model
# ``torch.compile`` of a wrapper): the file's names never have them.
WRAPPERS = ("_checkpoint_wrapped_module", "_orig_mod")
INDEX = "model.safetensors.index.json"


@dataclass(frozen=True)
class Read:
    tensors: int
    bytes_read: int
    """The bytes this rank read from the files: its shards' and the whole tensors'."""
    bytes_total: int
    """The bytes of the tensors it read from, whole."""


def tensors(what: str, path: str) -> dict[str, tuple[str, tuple[int, ...], str]]:
    """Each tensor name of folder ``path`` -> (its safetensors file, its shape, its dtype)."""
    from safetensors import SafetensorError, safe_open

    single = os.path.join(path, "model.safetensors")
    if os.path.isfile(single):
        files = [single]
    else:
        try:
            with open(os.path.join(path, INDEX)) as f:
                files = sorted({os.path.join(path, name) for name in json.load(f)["weight_map"].values()})
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise CheckpointError(f"{what}: {os.path.join(path, INDEX)} cannot be read ({exc}); give the folder save_pretrained wrote.") from None
    found: dict[str, tuple[str, tuple[int, ...], str]] = {}
    for file in files:
        try:
            with safe_open(file, framework="pt") as f:
                for k in f.keys():
                    s = f.get_slice(k)
                    found[k] = (file, tuple(s.get_shape()), s.get_dtype())
        except (OSError, SafetensorError) as exc:
            raise CheckpointError(f"{what}: {file} is not a readable safetensors file ({exc}); give the folder save_pretrained wrote.") from None
    return found


def _fqn(name: str) -> str:
    return ".".join(part for part in name.split(".") if part not in WRAPPERS)


def _own(module: nn.Module, prefix: str) -> tuple[dict[str, torch.Tensor], dict[str, list[str]]]:
    """The module's state by the file's names (``prefix`` and wrappers' segments dropped), with
    the storage of its parameters (this rank's shards), and each name's tied names."""
    from ..parallel.apply import tied_groups

    state = {_fqn(k)[len(prefix):]: v for k, v in module.state_dict().items() if _fqn(k).startswith(prefix)}
    groups = [[_fqn(n)[len(prefix):] for n in names if _fqn(n).startswith(prefix)] for names in tied_groups(module)]
    return state, hf.tie_map(groups)


def _chunk(value: torch.Tensor) -> tuple[torch.Tensor, tuple[slice, ...]]:
    """Where this rank's part of ``value`` lives, and which part of the whole tensor it is."""
    from torch.distributed.tensor import DTensor

    if not isinstance(value, DTensor):
        return value, tuple(slice(0, n) for n in value.shape)
    chunks = value.__create_chunk_list__()  # as torch.distributed.checkpoint loads a DTensor
    assert len(chunks) == 1, f"a DTensor with {len(chunks)} local chunks"  # FSDP2 and TP hold one
    c = chunks[0]
    return value.to_local(), tuple(slice(o, o + s) for o, s in zip(c.offsets, c.sizes))


def read_into(what: str, model: nn.Module, path: str, prefix: str = "") -> Read:
    """Copy folder ``path``'s weights into ``model``, each rank reading its own shards only; names
    and whole shapes must match (tied names may be saved once). Not collective."""
    from safetensors import safe_open

    state, tied = _own(model, prefix)
    found = tensors(what, path)
    hf.check_fit(what, {k: tuple(v.shape) for k, v in state.items()}, {k: m[1] for k, m in found.items()}, tied, path)
    # a tied weight (a head sharing the embedding) is one storage: read it once, by a name the file has
    todo: dict[str, str] = {}
    for name in state:
        if not any(o in todo for o in tied.get(name, ())):
            todo[name] = name if name in found else next(o for o in tied[name] if o in found)
    read = total = 0
    with torch.no_grad():
        for file in sorted({found[src][0] for src in todo.values()}):
            with safe_open(file, framework="pt") as f:
                for name, src in todo.items():
                    if found[src][0] != file:
                        continue
                    local, index = _chunk(state[name])
                    total += state[name].numel() * _ITEMSIZE.get(found[src][2], 4)
                    if local.numel():  # an uneven FSDP split can leave a rank no rows
                        part = f.get_slice(src)[index]
                        local.copy_(part)
                        read += part.numel() * part.element_size()
    return Read(tensors=len(todo), bytes_read=read, bytes_total=total)


_ITEMSIZE = {"F64": 8, "I64": 8, "F32": 4, "I32": 4, "F16": 2, "BF16": 2, "I16": 2, "U8": 1, "I8": 1, "BOOL": 1}


def model_module(model: Any) -> nn.Module:
    """The user's module of a set-up model (dtrain's wrappers keep it as ``original``)."""
    return getattr(model, "original", model)

"""``dtrain ckpt export --hf DIR``: an ``hf:PATH`` task's checkpoint (any layout; sharded ones
read whole) as a folder ``AutoModelForCausalLM.from_pretrained(DIR)`` loads. The model is rebuilt
from PATH's config and written by ``save_pretrained`` (which knows its tied weights) into a
staging folder renamed to DIR at the end, so DIR is either whole or absent."""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass

import torch

from .. import _check as check
from ..errors import CheckpointError, ConfigError
from . import hf
from .validate import read_whole, resolve

PREFIX = "hf."  # the hf:PATH task's model holds the transformers model as its child ``hf``


@dataclass(frozen=True)
class Exported:
    path: str
    checkpoint: str
    tensors: int
    tokenizer_files: list[str]


def check_target(out: str) -> None:
    """DIR is new and can be created (before a large checkpoint is read)."""
    if os.path.lexists(out):
        raise ConfigError(f"ckpt export --hf {out}: it exists already; give a new folder (nothing is overwritten).")
    check.output_dir("ckpt export --hf", out)


def model_state(path: str) -> dict[str, torch.Tensor]:
    """The model's whole state dict from checkpoint ``path`` (a folder or .pt file; sharded
    entries read whole)."""
    state = read_whole(path)
    objects = state.get("objects", state) if isinstance(state, dict) else None
    model = objects.get("model") if isinstance(objects, dict) else None
    if not isinstance(model, dict) or not any(torch.is_tensor(v) for v in model.values()):
        raise CheckpointError(f"checkpoint {path} holds no model state dict; give a checkpoint of `dtrain train --task hf:PATH`.")
    return {k: v for k, v in model.items() if torch.is_tensor(v)}


def strip_prefix(state: dict[str, torch.Tensor], path: str) -> dict[str, torch.Tensor]:
    inner = {k[len(PREFIX):]: v for k, v in state.items() if k.startswith(PREFIX)}
    if not inner:
        first = next(iter(state), "?")
        raise CheckpointError(f"checkpoint {path} is not of an hf:PATH task (its model's names start like {first!r}, "
                              f"not {PREFIX!r}); export the checkpoint of a `dtrain train --task hf:PATH` run.")
    return inner


def export(checkpoint: str, config_dir: str, out: str) -> Exported:
    """Write checkpoint ``checkpoint``'s model, whose architecture ``config_dir`` describes (the
    PATH of ``--task hf:PATH``), as a transformers folder ``out``."""
    what = "ckpt export"
    check_target(out)
    hf.check_folder(f"{what} --config", config_dir)
    path = resolve(checkpoint)
    config = hf.load_config(f"{what} --config", config_dir)
    state = strip_prefix(model_state(path), path)
    model = hf.build_causal_lm(what, config_dir, config, weights=False)
    hf.fit(f"{what} {path}", model, state, path)
    staging = f"{out.rstrip(os.sep)}.exporting"
    shutil.rmtree(staging, ignore_errors=True)  # an interrupted export's leftovers
    try:
        with hf.offline():
            model.save_pretrained(staging, safe_serialization=True)
        files = hf.copy_tokenizer(config_dir, staging)
        os.replace(staging, out)
    except OSError as exc:
        shutil.rmtree(staging, ignore_errors=True)
        raise CheckpointError(f"ckpt export --hf {out}: cannot write it ({exc.strerror or exc}); give a folder you can write.") from None
    return Exported(path=out, checkpoint=path, tensors=len(state), tokenizer_files=files)


"""Hugging Face model folders (``config.json``, safetensors weights, tokenizer files), read and
written through ``transformers`` (the optional extra ``hf``), never over the network: every call
runs inside ``offline()`` with ``local_files_only=True``, and a folder is checked before the import."""

from __future__ import annotations

import contextlib
import logging
import os
import re
from typing import Any

import torch
from torch import nn

from ..errors import CheckpointError, ConfigError, first_line

INSTALL = "pip install 'dtrain[hf]'"
WEIGHTS = ("model.safetensors", "model.safetensors.index.json")  # not pytorch_model.bin (a pickle)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "merges.txt",
                   "special_tokens_map.json", "added_tokens.json")
_HUB_NAME = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")


@contextlib.contextmanager
def offline():
    """``HF_HUB_OFFLINE=1`` for the calls inside (restored after), and torch's pytree warnings
    about torchao's Enums held back, as ``precision.check_torchao`` does."""
    old = os.environ.get("HF_HUB_OFFLINE")
    os.environ["HF_HUB_OFFLINE"] = "1"
    quiet = logging.getLogger("torch.utils._pytree")
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        yield
    finally:
        quiet.setLevel(level)
        if old is None:
            os.environ.pop("HF_HUB_OFFLINE", None)
        else:
            os.environ["HF_HUB_OFFLINE"] = old


def transformers() -> Any:
    """The ``transformers`` module, offline for the rest of the process; one line where it is missing."""
    with offline():
        try:
            import huggingface_hub.constants as hub
            import transformers as tf
        except ImportError as exc:
            raise ConfigError(f"Hugging Face models need transformers and safetensors ({exc}); install them: {INSTALL}.") from None
    hub.HF_HUB_OFFLINE = True  # imported earlier by someone else: read the variable then; dtrain never downloads
    tf.utils.logging.disable_progress_bar()  # per-file bars on every rank's stderr
    return tf


def check_folder(what: str, path: str) -> str:
    """``path`` is a local folder holding ``config.json``; else one line that says what it is."""
    if not os.path.exists(path):
        if not os.path.isabs(path) and _HUB_NAME.match(path) and "/" in path:
            raise ConfigError(f"{what}: no folder {path} here, and dtrain never downloads a model; fetch it first "
                              f"(e.g. hf download {path} --local-dir DIR) and give that folder.")
        raise ConfigError(f"{what}: no folder {path}; give a folder with config.json (one written by save_pretrained).")
    if not os.path.isdir(path):
        raise ConfigError(f"{what}: {path} is a file; give the folder that holds config.json.")
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ConfigError(f"{what}: {path} has no config.json; give a folder written by save_pretrained "
                          "(config.json, and model.safetensors for trained weights).")
    return path


def load_config(what: str, path: str) -> Any:
    """The folder's config, read by transformers; one line where transformers does not know it."""
    tf = transformers()
    with offline():
        try:
            return tf.AutoConfig.from_pretrained(path, local_files_only=True)
        except (ValueError, KeyError, OSError, TypeError) as exc:
            first = first_line(exc, 240)
            raise ConfigError(f"{what}: transformers {tf.__version__} cannot read {os.path.join(path, 'config.json')} "
                              f"({first}); give a config of a model transformers knows (model_type llama, gpt2, ...).") from None


def has_weights(path: str) -> bool:
    return any(os.path.isfile(os.path.join(path, name)) for name in WEIGHTS)


def build_causal_lm(what: str, path: str, config: Any, *, weights: bool) -> nn.Module:
    """The folder's causal LM in fp32 on the CPU: all its safetensors weights where ``weights``
    and it has them (a missing one is an error), else transformers' random initialisation."""
    tf = transformers()
    auto = tf.AutoModelForCausalLM
    with offline():
        try:
            if not (weights and has_weights(path)):
                return auto.from_config(config, dtype=torch.float32)
            model, info = auto.from_pretrained(path, config=config, dtype=torch.float32, local_files_only=True,
                                               output_loading_info=True)
        except (ValueError, KeyError, OSError, TypeError) as exc:
            first = first_line(exc, 240)
            raise ConfigError(f"{what}: transformers {tf.__version__} cannot build a causal language model from {path} "
                              f"({first}); give a decoder model's folder (AutoModelForCausalLM).") from None
    wrong = sorted(info.get("missing_keys") or ()) + sorted(str(k) for k in info.get("mismatched_keys") or ())
    if wrong:
        raise CheckpointError(f"{what}: the weights in {path} do not fit its config.json ({len(wrong)} missing or of "
                              f"another shape, e.g. {wrong[0]}); give the folder save_pretrained wrote.")
    return model


def fit(what: str, model: nn.Module, state: dict[str, torch.Tensor], source: str) -> None:
    """``model.load_state_dict(state)``, strict by name and shape except for names tied to a
    weight ``state`` has (a head tied to the embedding is saved once)."""
    from ..parallel.apply import tied_groups

    check_fit(what, {k: tuple(v.shape) for k, v in model.state_dict().items()}, {k: tuple(v.shape) for k, v in state.items()},
              tie_map(tied_groups(model)), source)
    model.load_state_dict(state, strict=False)  # strict but for the tied names checked above


def check_fit(what: str, own: dict[str, tuple[int, ...]], theirs: dict[str, tuple[int, ...]], tied: dict[str, list[str]],
              source: str) -> None:
    """The shapes ``theirs`` (by name) fit the model's ``own`` (whole shapes): every name, no other,
    each of the same shape, but for a name whose tied names (``tied``) ``theirs`` has; else one line."""
    missing = [k for k in own if k not in theirs and not any(o in theirs for o in tied.get(k, ()))]
    unexpected = [k for k in theirs if k not in own]
    shapes = [k for k in theirs if k in own and tuple(theirs[k]) != tuple(own[k])]
    if missing or unexpected or shapes:
        detail = (f"missing {missing[0]}" if missing else f"unexpected {unexpected[0]}" if unexpected else
                  f"{shapes[0]} is {tuple(theirs[shapes[0]])}, the model's {tuple(own[shapes[0]])}")
        raise CheckpointError(f"{what}: the weights of {source} do not fit the model of the config ({detail}; "
                              f"{len(missing)} missing, {len(unexpected)} unexpected, {len(shapes)} of another shape); "
                              "give the config the weights were trained with.")


def tie_map(groups: list[list[str]]) -> dict[str, list[str]]:
    """Each name of a tie -> the other names of the same tensor."""
    return {n: [o for o in names if o != n] for names in groups for n in names}


def copy_tokenizer(source: str, out: str) -> list[str]:
    """Copy the tokenizer files of ``source`` (if any) into ``out``; the names copied."""
    import shutil

    copied = []
    for name in TOKENIZER_FILES:
        if os.path.isfile(os.path.join(source, name)):
            shutil.copyfile(os.path.join(source, name), os.path.join(out, name))
            copied.append(name)
    return copied

"""A byte-level GPT-style language model on the bytes of ``--data-dir`` (by default the Python
standard library's sources). Samples are fixed, non-overlapping windows of ``context`` tokens, so
the sampler's exact resume and exact-once evaluation hold unchanged.
"""

from __future__ import annotations

import math
import os
import sysconfig
from typing import Any

import torch
from torch.utils.data import Dataset

from .._log import logger
from ..errors import ConfigError, DataError
from . import Task
from .gpt import gpt, gpt_blocks, gpt_tp_plan, sample_loss, token_loss

VOCAB = 256  # byte-level: every byte is a token, no tokenizer to download or train


class Windows(Dataset):
    """Non-overlapping windows of a token stream: sample i is (tokens[iT : iT+T], tokens[iT+1 : iT+T+1])."""

    in_memory = True  # slicing a tensor in memory: DataLoader workers would only add copies

    def __init__(self, tokens: torch.Tensor, context: int) -> None:
        self.tokens, self.context = tokens, context
        self.count = (len(tokens) - 1) // context

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= i < self.count:
            raise IndexError(i)
        chunk = self.tokens[i * self.context: (i + 1) * self.context + 1].long()
        return chunk[:-1], chunk[1:]


def corpus_files(data_dir: str | None) -> tuple[str, list[str]]:
    """(root, files): the files of ``data_dir`` (a file, or a folder's files recursively, sorted),
    or the standard library's ``*.py`` files when no folder is given."""
    if data_dir is None:
        root = sysconfig.get_paths()["stdlib"]
        return root, sorted(_walk(root, suffix=".py"))
    if os.path.isfile(data_dir):
        return data_dir, [data_dir]
    if not os.path.isdir(data_dir):
        raise DataError(f"--data-dir {data_dir} does not exist; give a text file or a folder of text files (or none: the Python standard library's sources).")
    return data_dir, sorted(_walk(data_dir, suffix=""))


def _walk(root: str, suffix: str) -> list[str]:
    out = []
    for folder, dirs, names in os.walk(root):
        dirs[:] = [d for d in dirs if not d.startswith(".") and d not in ("__pycache__", "site-packages", "dist-packages")]
        out += [os.path.join(folder, n) for n in names if n.endswith(suffix) and not n.startswith(".")]
    return out


def read_corpus(files: list[str], max_bytes: int) -> tuple[bytes, int]:
    """The files' bytes concatenated, cut at ``max_bytes`` (0: no cap); also how many files were read."""
    parts, size, used = [], 0, 0
    for path in files:
        try:
            with open(path, "rb") as fh:
                data = fh.read(max_bytes - size if max_bytes else -1)
        except OSError as exc:
            raise DataError(f"cannot read corpus file {path} ({exc.strerror}); fix its permissions or leave it out of --data-dir.") from None
        parts.append(data)
        size += len(data)
        used += 1
        if max_bytes and size >= max_bytes:
            break
    return b"".join(parts), used


def _check_sizes(layers: int, heads: int, width: int, context: int, dropout: float, val_fraction: float, max_bytes: int,
                 vocab: int = VOCAB, ffn: int = 0) -> None:
    for name, value in (("layers", layers), ("heads", heads), ("width", width), ("context", context)):
        if value < 1:
            raise ConfigError(f"task 'lm': {name}={value} must be >= 1; e.g. --task-arg {name}=4.")
    if vocab < VOCAB:
        raise ConfigError(f"task 'lm': vocab={vocab} is smaller than the {VOCAB} byte values its tokens take; use vocab >= {VOCAB}.")
    if ffn < 0:
        raise ConfigError(f"task 'lm': ffn={ffn} must be >= 1 (the MLP's hidden width), or 0 for 4 x width.")
    if width % heads:
        lo = width // heads * heads or heads
        raise ConfigError(f"task 'lm': width={width} is not divisible by heads={heads}; use a multiple of {heads} (e.g. width={lo}).")
    if not 0.0 <= dropout < 1.0:
        raise ConfigError(f"task 'lm': dropout={dropout} must be in [0, 1).")
    if not 0.0 < val_fraction < 1.0:
        raise ConfigError(f"task 'lm': val_fraction={val_fraction} must be in (0, 1), e.g. 0.05.")
    if max_bytes < 0:
        raise ConfigError(f"task 'lm': max_bytes={max_bytes} must be >= 0 (0: the whole corpus).")


def make_task(data_dir: str | None = None, layers: int = 4, heads: int = 4, width: int = 128, context: int = 128,
              dropout: float = 0.0, tie: bool = True, max_bytes: int = 2_000_000, val_fraction: float = 0.05,
              vocab: int = VOCAB, ffn: int = 0) -> Task:
    """``vocab`` > 256 and ``ffn`` (the MLP's hidden width; 0: 4 x width) shape the model as a
    published one for `dtrain plan` and `dtrain dry-run`; tokens stay bytes."""
    _check_sizes(layers, heads, width, context, dropout, val_fraction, max_bytes, vocab, ffn)
    root, files = corpus_files(data_dir)
    data, used = read_corpus(files, max_bytes)
    tokens = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.zeros(0, dtype=torch.uint8)
    n_val = max(context + 1, int(len(tokens) * val_fraction))
    train, val = tokens[: len(tokens) - n_val], tokens[len(tokens) - n_val:]
    capped = 0 < max_bytes <= len(tokens)
    if len(train) < context + 1:
        where = data_dir or f"the standard library ({root})"
        read = f"{len(tokens)} bytes (capped at max_bytes={max_bytes})" if capped else f"{len(tokens)} bytes"
        more = "raise --task-arg max_bytes= (0 reads all)" if capped else "give more text"
        raise DataError(
            f"task 'lm': the corpus of {where} has {read}, too few for a training and a validation "
            f"window of context={context} ({2 * (context + 1)} bytes at least); {more} or a smaller --task-arg context=."
        )
    cap = f"; capped at max_bytes={max_bytes:,} (--task-arg max_bytes=0 reads all)" if capped else ""
    logger.info(f"lm: {len(tokens):,} bytes from {used} of {len(files)} file(s) under {root}{cap}; "
                f"{len(train):,} training and {len(val):,} validation tokens (the last {val_fraction:.0%})")
    return causal_lm_task(
        name="lm",
        build_model=lambda: gpt(vocab=vocab, context=context, layers=layers, heads=heads, width=width, dropout=dropout, tie=tie,
                                ffn=ffn or None),
        train=train, val=val, context=context, blocks=gpt_blocks, tp_plan=gpt_tp_plan, batch_size=16,
    )


def causal_lm_task(*, name: str, build_model: Any, train: torch.Tensor, val: torch.Tensor, context: int, blocks: Any,
                   tp_plan: Any, batch_size: int, load_weights: Any = None) -> Task:
    """A next-token task over windows of ``context`` tokens: the lm task's and every hf:PATH model's."""
    return Task(
        name=name,
        build_model=build_model,
        train_set=Windows(train, context),
        test_set=Windows(val, context),
        loss_fn=token_loss,
        metric=sample_loss,
        metric_name="val_loss",
        derived_metrics=lambda val_loss: {"perplexity": math.exp(min(val_loss, 700.0))},
        tokens_per_sample=context,
        blocks=blocks,
        tp_plan=tp_plan,
        load_weights=load_weights,
        optimizer="adamw",
        lr=1e-3,
        batch_size=batch_size,
    )

"""Write checkpoints atomically and read them without unpickling arbitrary objects."""

from __future__ import annotations

import contextlib
import os
import pickle
import re
import tempfile
import zipfile
from collections.abc import Iterator
from typing import IO, Any

import torch

from ..errors import CheckpointError, first_line


def atomic_save(obj: Any, path: str | os.PathLike) -> None:
    """Save ``obj`` with torch.save to a temporary file in the same folder, fsync, then rename:
    a crash at any moment leaves either the old file or the new one, never a torn one."""
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):  # os.replace would fail after the whole write (IsADirectoryError)
        raise CheckpointError(f"cannot write checkpoint {path}: it is a folder; give a file path, "
                              f"e.g. {os.path.join(path, 'state.pt')}.")
    try:
        os.makedirs(folder, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=folder)
    except OSError as exc:
        raise CheckpointError(f"cannot write checkpoint {path}: {exc.strerror}; choose a writable --checkpoint-dir.") from None
    try:
        os.close(fd)
        with synced(tmp, "wb") as fh:
            torch.save(obj, fh)
        os.replace(tmp, path)
        _fsync_dir(folder)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


@contextlib.contextmanager
def synced(path: str, mode: str) -> Iterator[IO[Any]]:
    """``open(path, mode)``, its contents flushed to disk (fsync) before it closes."""
    with open(path, mode) as fh:
        yield fh
        fh.flush()
        os.fsync(fh.fileno())


def _fsync_dir(folder: str) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def safe_load(path: str | os.PathLike, map_location: str | torch.device = "cpu", *, mmap: bool = False) -> Any:
    """torch.load with ``weights_only=True``; every failure is a CheckpointError naming the file.
    ``mmap``: map the tensors' bytes rather than read them (a check of what the file holds)."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise CheckpointError(f"checkpoint {path} does not exist.")
    try:
        return torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
    except (pickle.UnpicklingError, zipfile.BadZipFile, EOFError, RuntimeError, ValueError, TypeError, AttributeError) as exc:
        raise CheckpointError(f"checkpoint {path} cannot be read ({load_refusal(exc)}); it is truncated, corrupt or not a dtrain checkpoint.") from None


def load_refusal(exc: BaseException) -> str:
    """One short reason from torch.load's error (its weights_only refusal is a paragraph)."""
    named = re.search(r"(?:unsupported|Unsupported global:) GLOBAL (\S+)", str(exc))
    if named:
        return f"it names {named.group(1).rstrip('.:,')}, which weights_only loading refuses"
    return first_line(exc, 200)

"""Write checkpoints atomically and read them without unpickling arbitrary objects."""

from __future__ import annotations

import os
import pickle
import tempfile
import zipfile
from typing import Any

import torch

from ..errors import CheckpointError


def atomic_save(obj: Any, path: str | os.PathLike) -> None:
    """Save ``obj`` with torch.save to a temporary file in the same folder, fsync, then rename.

    A crash at any moment leaves either the old file or the new one, never a torn one.
    """
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    try:
        os.makedirs(folder, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=folder)
    except OSError as exc:
        raise CheckpointError(f"cannot write checkpoint {path}: {exc.strerror}; choose a writable --checkpoint-dir.") from None
    try:
        with os.fdopen(fd, "wb") as fh:
            torch.save(obj, fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
        _fsync_dir(folder)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def _fsync_dir(folder: str) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def safe_load(path: str | os.PathLike, map_location: str | torch.device = "cpu") -> Any:
    """torch.load with ``weights_only=True``; every failure is a CheckpointError naming the file."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise CheckpointError(f"checkpoint {path} does not exist.")
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except (pickle.UnpicklingError, zipfile.BadZipFile, EOFError, RuntimeError, ValueError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CheckpointError(f"checkpoint {path} cannot be read ({first}); it is truncated, corrupt or not a dtrain checkpoint.") from None

"""A folder of checkpoints: ``step-NNNNNNNN/`` each with its files and ``manifest.json``
(sha256 and size of every file), a ``latest`` pointer written last, the last K kept.

A checkpoint folder is written as ``.tmp-step-NNNNNNNN/``, each file fsynced, then renamed into
place, then ``latest`` is replaced: a crash at any moment leaves the previous checkpoint and
pointer intact. Reading verifies the checksums before anything is unpickled, and unpickles with
``weights_only=True`` only.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import CheckpointError
from .io import _fsync_dir, safe_load

STEP_DIR = re.compile(r"^step-(\d{8,})$")
STEP_OLD = re.compile(r"^step-\d{8,}\.old-\d+$")
STATE_FILE = "state.pt"
MANIFEST = "manifest.json"
FORMAT = 1


def step_name(step: int) -> str:
    return f"step-{step:08d}"


def sha256_of(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _write_file(path: str, payload: Any) -> dict[str, Any]:
    with open(path, "wb") as fh:
        torch.save(payload, fh)
        fh.flush()
        os.fsync(fh.fileno())
    return {"sha256": sha256_of(path), "bytes": os.path.getsize(path)}


def write_checkpoint(folder: str, step: int, files: dict[str, Any], meta: dict[str, Any]) -> str:
    """Write ``files`` (name -> object for torch.save) as checkpoint ``step`` in ``folder``;
    returns the checkpoint's path. Point ``latest`` at it with ``set_latest`` afterwards."""
    final = os.path.join(folder, step_name(step))
    tmp = os.path.join(folder, f".tmp-{step_name(step)}-{os.getpid()}")
    try:
        os.makedirs(folder, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
        manifest = {"format": FORMAT, "step": step, **meta, "files": {}}
        for name, payload in files.items():
            manifest["files"][name] = _write_file(os.path.join(tmp, name), payload)
        with open(os.path.join(tmp, MANIFEST), "w") as fh:
            json.dump(manifest, fh, indent=1)
            fh.flush()
            os.fsync(fh.fileno())
        _fsync_dir(tmp)
        if os.path.isdir(final):  # the same step saved again (e.g. after a restart): replace it
            old = final + f".old-{os.getpid()}"
            os.replace(final, old)
            os.replace(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, final)
        _fsync_dir(folder)
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(f"cannot write checkpoint {final}: {exc.strerror or exc}; choose a writable --checkpoint-dir.") from None
    return final


def set_latest(folder: str, path: str) -> None:
    tmp = os.path.join(folder, f".latest.tmp-{os.getpid()}")
    with open(tmp, "w") as fh:
        fh.write(os.path.basename(path) + "\n")
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, os.path.join(folder, "latest"))
    _fsync_dir(folder)


def clean_leftovers(folder: str) -> list[str]:
    """Remove what saves killed midway left behind (``.tmp-*`` folders, ``.old-*`` folders,
    ``.latest.tmp-*`` files). Call only from the one process that writes to ``folder``."""
    if not os.path.isdir(folder):
        return []
    removed = []
    for name in os.listdir(folder):
        path = os.path.join(folder, name)
        if name.startswith(".tmp-step-") or name.startswith(".latest.tmp-") or (STEP_OLD.match(name) is not None):
            if os.path.isdir(path):
                shutil.rmtree(path, ignore_errors=True)
            else:
                with contextlib.suppress(OSError):
                    os.unlink(path)
            removed.append(path)
    return removed


def list_checkpoints(folder: str) -> list[tuple[int, str]]:
    """(step, path) of every complete-looking checkpoint folder, oldest first."""
    if not os.path.isdir(folder):
        return []
    out = []
    for name in os.listdir(folder):
        m = STEP_DIR.match(name)
        if m and os.path.isdir(os.path.join(folder, name)):
            out.append((int(m.group(1)), os.path.join(folder, name)))
    return sorted(out)


def prune(folder: str, keep: int) -> list[str]:
    """Delete all but the newest ``keep`` checkpoints (never the one ``latest`` names)."""
    latest = read_latest(folder)
    ckpts = list_checkpoints(folder)
    removed = []
    for _, path in ckpts[: max(0, len(ckpts) - keep)]:
        if latest and os.path.abspath(path) == os.path.abspath(latest):
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


def read_latest(folder: str) -> str | None:
    try:
        with open(os.path.join(folder, "latest")) as fh:
            name = fh.read().strip()
    except OSError:
        return None
    return os.path.join(folder, name) if name else None


@dataclass(frozen=True)
class Verdict:
    path: str
    step: int | None
    ok: bool
    problem: str = ""
    bytes: int = 0
    meta: dict[str, Any] | None = None


def verify(path: str) -> Verdict:
    """Check a checkpoint folder (or a single legacy ``.pt`` file) without unpickling it."""
    if os.path.isfile(path):
        return Verdict(path, None, True, "single file, no checksum", os.path.getsize(path))
    manifest_path = os.path.join(path, MANIFEST)
    try:
        with open(manifest_path) as fh:
            manifest = json.load(fh)
    except FileNotFoundError:
        return Verdict(path, None, False, f"{manifest_path} is missing (an incomplete save?)")
    except (OSError, ValueError) as exc:
        return Verdict(path, None, False, f"{manifest_path} is unreadable ({exc})")
    total = 0
    for name, info in manifest.get("files", {}).items():
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            return Verdict(path, manifest.get("step"), False, f"{file} is missing", meta=manifest)
        size = os.path.getsize(file)
        total += size
        if size != info["bytes"]:
            return Verdict(path, manifest.get("step"), False, f"{file} has {size} bytes, the manifest says {info['bytes']} (truncated?)", total, manifest)
        if sha256_of(file) != info["sha256"]:
            return Verdict(path, manifest.get("step"), False, f"{file} fails its sha256 checksum (corrupted)", total, manifest)
    return Verdict(path, manifest.get("step"), True, "", total, manifest)


def read_checkpoint(path: str, name: str = STATE_FILE, map_location: Any = "cpu") -> Any:
    """Verify, then load one file of a checkpoint safely. CheckpointError names file and problem."""
    if os.path.isfile(path):
        return safe_load(path, map_location=map_location)
    verdict = verify(path)
    if not verdict.ok:
        raise CheckpointError(f"checkpoint {path}: {verdict.problem}.")
    return safe_load(os.path.join(path, name), map_location=map_location)


def resolve(path: str) -> str:
    """A checkpoint folder, a checkpoint directory (its ``latest``), or a file."""
    if os.path.isdir(path) and not os.path.isfile(os.path.join(path, MANIFEST)):
        latest = read_latest(path)
        if latest is None:
            ckpts = list_checkpoints(path)
            if not ckpts:
                raise CheckpointError(f"{path} holds no checkpoints (no step-* folders, no 'latest').")
            latest = ckpts[-1][1]
        return latest
    if not os.path.exists(path):
        raise CheckpointError(f"checkpoint {path} does not exist.")
    return path

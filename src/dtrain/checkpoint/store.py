"""A folder of checkpoints: ``step-NNNNNNNN/`` each with its files and ``manifest.json``
(sha256 and size of every file), a ``latest`` pointer written last, the last K kept. Every step is
written under a dot-name and renamed into place (deleted likewise), so a crash at any moment
leaves the previous checkpoint and pointer intact and nothing half-written that looks like one."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
from typing import Any

import torch

from ..errors import CheckpointError
from .io import _fsync_dir, synced

STEP_DIR = re.compile(r"^step-(\d{8,})$")
STEP_OLD = re.compile(r"^step-\d{8,}\.old-\d+$")
DELETING = ".deleting-"
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
    with synced(path, "wb") as fh:
        torch.save(payload, fh)
    return _entry(path)


def _entry(path: str) -> dict[str, Any]:
    return {"sha256": sha256_of(path), "bytes": os.path.getsize(path)}


def write_checkpoint(folder: str, step: int, files: dict[str, Any], meta: dict[str, Any],
                     staged: dict[str, str] | None = None) -> str:
    """Write ``files`` (name -> object for torch.save) as checkpoint ``step`` in ``folder``; returns
    its path. ``staged`` (subfolder name -> a folder already written, e.g. by a sharded save) is
    moved in as that subfolder and checksummed like the rest."""
    final = os.path.join(folder, step_name(step))
    tmp = os.path.join(folder, f".tmp-{step_name(step)}-{os.getpid()}")
    try:
        os.makedirs(folder, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
        manifest = {"format": FORMAT, "step": step, **meta, "files": {}}
        for name, payload in files.items():
            manifest["files"][name] = _write_file(os.path.join(tmp, name), payload)
        for sub, source in (staged or {}).items():
            os.replace(source, os.path.join(tmp, sub))
            for root, _, names in os.walk(os.path.join(tmp, sub)):
                for n in sorted(names):
                    file = os.path.join(root, n)
                    manifest["files"][os.path.relpath(file, tmp)] = _entry(file)
        with synced(os.path.join(tmp, MANIFEST), "w") as fh:
            json.dump(manifest, fh, indent=1)
        _fsync_dir(tmp)
        if os.path.isdir(final):  # the same step saved again (e.g. after a restart): replace it
            old = os.path.join(folder, f"{DELETING}{step_name(step)}-{os.getpid()}")  # cleaned up if killed now
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
    with synced(tmp, "w") as fh:
        fh.write(os.path.basename(path) + "\n")
    os.replace(tmp, os.path.join(folder, "latest"))
    _fsync_dir(folder)


def clean_leftovers(folder: str) -> list[str]:
    """Remove what saves killed midway left behind (``.tmp-*``, ``.old-*``, ``.latest.tmp-*``,
    ``.deleting-*``). Call only from the one process that writes to ``folder``."""
    if not os.path.isdir(folder):
        return []
    removed = []
    for name in os.listdir(folder):
        path = os.path.join(folder, name)
        if name.startswith((".tmp-step-", ".latest.tmp-", DELETING)) or STEP_OLD.match(name) is not None:
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
        # Rename first: a kill during rmtree then leaves a dot-folder that nothing lists, not a
        # half-deleted step-* that looks like a checkpoint. clean_leftovers removes it later.
        doomed = os.path.join(folder, f"{DELETING}{os.path.basename(path)}-{os.getpid()}")
        try:
            os.replace(path, doomed)
        except OSError:
            continue
        shutil.rmtree(doomed, ignore_errors=True)
        removed.append(path)
    return removed


def read_latest(folder: str) -> str | None:
    try:
        with open(os.path.join(folder, "latest")) as fh:
            name = fh.read().strip()
    except OSError:
        return None
    return os.path.join(folder, name) if name else None

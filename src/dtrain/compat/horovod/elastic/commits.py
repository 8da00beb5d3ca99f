"""Durable copies of the last committed state, so a restarted worker resumes: local rank 0 of each
node writes the newest commit into the launcher's private folder from a background thread,
atomically, skipping to the newest when commits come faster than the disk."""

from __future__ import annotations

import atexit
import os
import threading
from typing import Any

import torch

from dtrain.options import launch_link

_PREFIX, _SUFFIX = "hvd-elastic-commit-", ".pt"


def folder_from_env() -> str | None:
    """Where this node keeps its commits, or None when not started by ``dtrain run``."""
    launch_dir = launch_link().launch_dir
    return launch_dir if launch_dir and os.path.isdir(launch_dir) else None


class CommitStore:
    """The newest commit on this node's disk: ``put`` (non-blocking), ``flush``, ``latest``, ``load``."""

    def __init__(self, folder: str, writer: bool) -> None:
        self.folder = folder
        self.writer = writer
        self._pending: tuple[int, Any] | None = None
        self._written = -1
        self._error: BaseException | None = None
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._closing = False

    def _path(self, number: int) -> str:
        return os.path.join(self.folder, f"{_PREFIX}{number:09d}{_SUFFIX}")

    def latest(self) -> int:
        """The number of the newest commit on disk (-1: none yet); the number is in the name."""
        numbers = [int(name[len(_PREFIX):-len(_SUFFIX)]) for name in os.listdir(self.folder)
                   if name.startswith(_PREFIX) and name.endswith(_SUFFIX)]
        return max(numbers, default=-1)

    def load(self) -> dict[str, Any]:
        """``{"number": n, "size": world size then, "state": {...}}`` of the newest commit on disk."""
        return torch.load(self._path(self.latest()), map_location="cpu", weights_only=False)

    def put(self, number: int, state: dict[str, Any], size: int) -> None:
        """Write ``state`` (already a private copy) as commit ``number``, in the background."""
        if not self.writer:
            return
        with self._cond:
            self._raise()
            self._pending = (number, {"number": number, "size": size, "state": state})
            if self._thread is None:
                self._closing = False
                self._thread = threading.Thread(target=self._run, name="dtrain-hvd-commit", daemon=True)
                self._thread.start()
                # A daemon thread inside torch.save at the interpreter's exit aborts the process: stop it first.
                atexit.register(self.close)
            self._cond.notify_all()

    def flush(self, timeout: float = 300.0) -> int:
        """Wait until the newest ``put`` is on disk; returns its number (-1: nothing written)."""
        with self._cond:
            self._cond.wait_for(lambda: self._pending is None or self._error is not None, timeout=timeout)
            self._raise()
            return self._written

    def close(self) -> None:
        """Finish the write in progress (and the newest pending one), then stop the writer."""
        with self._cond:
            if self._thread is None:
                return
            self._closing = True
            self._cond.notify_all()
        self._thread.join()
        self._thread = None
        atexit.unregister(self.close)

    def _raise(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            raise OSError(f"hvd.elastic could not write its commit to {self.folder}: {error}") from error

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._pending is not None or self._closing)
                if self._pending is None:
                    return
                number, payload = self._pending
            tmp = os.path.join(self.folder, f".tmp-{os.getpid()}{_SUFFIX}")
            try:
                old = self.latest()
                torch.save(payload, tmp)
                os.replace(tmp, self._path(number))
                if old not in (-1, number):
                    os.remove(self._path(old))
            except BaseException as exc:  # handed to the next put/flush on the main thread
                with self._cond:
                    self._error, self._pending = exc, None
                    self._cond.notify_all()
                continue
            with self._cond:
                self._written = number
                if self._pending is not None and self._pending[0] == number:
                    self._pending = None
                self._cond.notify_all()

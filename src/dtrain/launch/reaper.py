"""End a stalled or frozen worker at once, rather than after torch's fixed 30 s shutdown grace: a
stopped worker (state ``T``) never acts on the agent's SIGTERM, and one blocked in native code
holding the GIL never runs its handler. A launcher thread, every ``POLL_S``, kills a worker that is
stopped while a SIGTERM waits for it, and ``GRACE_S`` after a worker's stall watchdog reported
(``STALL_MARKER``), the workers alive when the marker was seen (never those of a restart).
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Callable

from ..diag.watchdog import STALL_MARKER, DaemonThread

POLL_S = 0.2
GRACE_S = 1.0
_SIGTERM_BIT = 1 << (signal.SIGTERM - 1)


class StallReaper(DaemonThread):
    """The launcher's thread that applies the two rules above to ``workers()`` of ``launch_dir``."""

    def __init__(self, launch_dir: str, workers: Callable[[], list[int]]) -> None:
        super().__init__("dtrain-stall-reaper")
        self.launch_dir = launch_dir
        self.workers = workers
        self.killed: list[int] = []

    def stop(self) -> None:
        super().stop()
        self._thread.join(5)

    def _run(self) -> None:
        marker = os.path.join(self.launch_dir, STALL_MARKER)
        doomed: list[int] = []
        deadline = 0.0
        while not self._stop.wait(POLL_S):
            for pid in self.workers():
                if stopped_with_sigterm_pending(pid):
                    self._kill(pid)
            if not doomed and os.path.exists(marker):
                doomed, deadline = self.workers(), time.monotonic() + GRACE_S
                with contextlib.suppress(OSError):
                    os.remove(marker)
            if doomed and time.monotonic() >= deadline:
                alive = set(self.workers())
                for pid in doomed:
                    if pid in alive:
                        self._kill(pid)
                doomed = []

    def _kill(self, pid: int) -> None:
        if kill(pid, signal.SIGKILL):
            self.killed.append(pid)


def kill(pid: int, sig: int) -> bool:
    """Send ``sig`` to ``pid``; False when it is gone (or not ours)."""
    try:
        os.kill(pid, sig)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def stopped_with_sigterm_pending(pid: int) -> bool:
    """``pid`` is stopped (SIGSTOP, SIGTSTP, ...) and a SIGTERM waits for it."""
    try:
        with open(f"/proc/{pid}/status") as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
    except OSError:
        return False
    if not fields.get("State", "").strip().startswith("T"):
        return False
    try:  # pending for the thread or for the whole process
        pending = int(fields.get("SigPnd", "0"), 16) | int(fields.get("ShdPnd", "0"), 16)
    except ValueError:
        return False
    return bool(pending & _SIGTERM_BIT)

"""The launcher's side of the workers' life cycle (the workers' side is ``lifecycle``).

The launcher owns SIGINT, SIGTERM, SIGHUP and SIGUSR1 rather than torch's elastic agent (which
waits its 30 s shutdown timeout even for workers that finished): the signal is forwarded to every
worker and the agent keeps running, so a worker that stops is collected at once. A worker still
running after the grace period is killed; a second Ctrl-C kills at once.
"""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from ..options import LAUNCH_DIR_ENV, hand_over, put_back
from .lifecycle import STOP_MARKER, read_errors
from .reaper import StallReaper, kill

#: Signals the launcher forwards to its workers, and how long it then waits before killing them
#: (SIGTERM/SIGUSR1 leave time for a checkpoint; a scheduler kills after ~30 s anyway).
GRACE_S = {signal.SIGINT: 10.0, signal.SIGHUP: 10.0, signal.SIGTERM: 30.0, signal.SIGUSR1: 30.0}
#: What torch's agent still handles itself (LaunchConfig.signals_to_handle).
AGENT_SIGNALS = "SIGQUIT"


class Stopped(BaseException):
    """Raised in the launcher's main thread once its workers are gone after a stop signal (not an
    ``Exception``: torch's agent lets it through)."""


class Supervisor:
    """One launch: the link and private folder the workers bind to, the signal handlers, and no
    worker left behind on the way out."""

    def __init__(self, *, interrupt_main: bool = False, on_stop: Callable[[], None] | None = None) -> None:
        self.dir = ""
        self.signum = 0
        self.killed: list[int] = []
        self._interrupt_main = interrupt_main  # the agent may restart stopped workers: end its loop
        self._on_stop = on_stop  # an elastic node: leave the job rather than end it
        self._armed = False
        self._done = False
        self._previous: dict[int, Any] = {}
        self._env: dict[str, str | None] = {}
        self._reaper: StallReaper | None = None

    def __enter__(self) -> Supervisor:
        _remove_stale_dirs()
        self.dir = tempfile.mkdtemp(prefix=f"{_DIR_PREFIX}{os.getpid()}-")
        self._env = hand_over(link={"launcher_pid": os.getpid(), "launch_dir": self.dir})
        if threading.current_thread() is threading.main_thread():
            for sig in GRACE_S:
                self._previous[sig] = signal.signal(sig, self._on_signal)
        self._reaper = StallReaper(self.dir, self.workers).start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._armed = False
        if self._reaper is not None:
            self._reaper.stop()
        for sig, prev in self._previous.items():
            signal.signal(sig, prev)
        self.kill_workers()
        put_back(self._env)
        shutil.rmtree(self.dir, ignore_errors=True)

    @contextlib.contextmanager
    def armed(self) -> Iterator[None]:
        """While the workers run: a stop may end this block with ``Stopped``."""
        self._armed = True
        try:
            yield
        finally:
            self._armed = False

    # -- signals -------------------------------------------------------------------------

    def _on_signal(self, signum: int, frame: object) -> None:
        if self._done:
            if self._armed:
                raise Stopped
            return
        if self.signum:
            if signum == signal.SIGINT:
                self.kill_workers()  # a second Ctrl-C: do not wait
            return
        self.signum = signum
        if self._on_stop is not None:
            self._on_stop()
        with open(os.path.join(self.dir, STOP_MARKER), "w"):
            pass  # a worker the agent restarts from now on exits at once
        for pid in self.workers():
            kill(pid, signum)
        threading.Thread(target=self._reap, args=(GRACE_S[signum],), name="dtrain-stop", daemon=True).start()

    def _reap(self, grace_s: float) -> None:
        deadline = time.monotonic() + grace_s
        while self.workers() and time.monotonic() < deadline:
            time.sleep(0.05)
        self.kill_workers()
        self._done = True
        if self._interrupt_main and self._armed:
            os.kill(os.getpid(), self.signum)  # runs _on_signal in the main thread: Stopped

    def stopped(self) -> int:
        """Say why the launch ended (one line) and return the exit status for the signal."""
        name = signal.Signals(self.signum).name
        extra = f"; killed {len(self.killed)} worker(s) still running after {GRACE_S[self.signum]:g} s" if self.killed else ""
        if self._on_stop is not None:
            extra += "; this node left the elastic job (the other nodes go on without it)"
        print(f"dtrain: stopped by {name}{extra}.", file=sys.stderr, flush=True)
        return 128 + self.signum

    # -- workers -------------------------------------------------------------------------

    def workers(self) -> list[int]:
        """Live workers of this launch (a pid's environment must name this folder: a reused pid is never signalled)."""
        out = []
        try:
            names = os.listdir(self.dir)
        except OSError:
            return out
        marker = f"{LAUNCH_DIR_ENV}={self.dir}".encode()
        for name in names:
            if not name.startswith("pid-"):
                continue
            pid = int(name[4:])
            try:
                with open(f"/proc/{pid}/environ", "rb") as f:
                    env = f.read().split(b"\0")
                with open(f"/proc/{pid}/stat", "rb") as f:
                    state = f.read().rsplit(b")", 1)[1].split()[0]
            except OSError:
                continue  # gone
            if marker in env and state != b"Z":
                out.append(pid)
        return out

    def kill_workers(self) -> None:
        for pid in self.workers():
            if kill(pid, signal.SIGKILL):
                self.killed.append(pid)

    def first_error(self) -> dict[str, Any] | None:
        """The earliest error a worker reported (its traceback, or a user error's one line)."""
        errors = read_errors(self.dir) if self.dir else []
        return errors[0] if errors else None


_DIR_PREFIX = "dtrain-launch-"


def _remove_stale_dirs() -> None:
    """A launcher killed with -9 cannot remove its folder; the next launch removes it."""
    for path in glob.glob(os.path.join(tempfile.gettempdir(), f"{_DIR_PREFIX}*-*")):
        try:
            pid = int(os.path.basename(path)[len(_DIR_PREFIX):].split("-", 1)[0])
            os.kill(pid, 0)
        except ProcessLookupError:
            shutil.rmtree(path, ignore_errors=True)
        except (ValueError, PermissionError):
            continue

"""A ``dtrain`` launcher started as a separate job, for tests and benchmarks of its life cycle:
start it, wait until its workers train, signal it, and see which of its processes outlive it.

    with LaunchedJob(["run", "-n", "2", "script.py"]) as job:
        job.wait_for(lambda: ready_file.exists(), timeout=60)
        job.signal(signal.SIGKILL)
        alive = job.survivors(after_s=5)          # processes of the job still running
    # leaving the block kills every process the job started, whatever happened
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence

import psutil

from . import SRC


class LaunchedJob:
    """``python -m dtrain ARGS`` in its own session, its output in files under ``out_dir``;
    ``prefix`` is a command that ends by exec-ing it (e.g. ``unshare ... sh -c 'exec "$@"'``);
    ``src`` the folder dtrain is imported from (default: this process's; another to compare versions)."""

    def __init__(self, args: Sequence[str], *, out_dir: str, env: dict[str, str] | None = None, cwd: str | None = None,
                 prefix: Sequence[str] = (), src: str | None = None) -> None:
        src = src or SRC
        full_env = {**os.environ, **(env or {})}
        full_env["PYTHONPATH"] = os.pathsep.join(p for p in (src, full_env.get("PYTHONPATH")) if p)
        self.stdout_path = os.path.join(out_dir, "stdout.txt")
        self.stderr_path = os.path.join(out_dir, "stderr.txt")
        with open(self.stdout_path, "w") as out, open(self.stderr_path, "w") as err:
            self.proc = subprocess.Popen(
                [*prefix, sys.executable, "-m", "dtrain", *args], stdout=out, stderr=err, stdin=subprocess.DEVNULL,
                env=full_env, cwd=cwd, start_new_session=True,
            )
        self.seen: dict[int, psutil.Process] = {}
        self.signalled_at: float | None = None

    def __enter__(self) -> LaunchedJob:
        return self

    def __exit__(self, *exc: object) -> None:
        self.kill_all()

    def descendants(self) -> list[psutil.Process]:
        """The launcher's processes now (remembered, so they can be checked after it is gone)."""
        try:
            for p in psutil.Process(self.proc.pid).children(recursive=True):
                self.seen.setdefault(p.pid, p)
        except psutil.NoSuchProcess:
            pass
        return list(self.seen.values())

    def wait_for(self, ready: Callable[[], bool], *, timeout: float) -> None:
        """Poll ``ready()`` until true; fails (with the job's stderr) if the job ends or time runs out."""
        deadline = time.monotonic() + timeout
        while not ready():
            self.descendants()
            if self.proc.poll() is not None:
                raise AssertionError(f"job ended with {self.proc.returncode} before it was ready:\n{self.stderr()}")
            if time.monotonic() > deadline:
                raise AssertionError(f"job not ready within {timeout:.0f} s:\n{self.stderr()}")
            time.sleep(0.1)
        self.descendants()

    def signal(self, sig: int) -> None:
        self.descendants()
        self.signalled_at = time.monotonic()
        self.proc.send_signal(sig)

    def wait(self, timeout: float) -> tuple[int, float]:
        """The launcher's exit status and the seconds from ``signal`` to its exit."""
        rc = self.proc.wait(timeout)
        return rc, time.monotonic() - (self.signalled_at or time.monotonic())

    def survivors(self, after_s: float) -> list[psutil.Process]:
        """The job's processes still running ``after_s`` seconds from now (zombies do not count)."""
        time.sleep(after_s)
        alive = []
        for p in self.seen.values():
            try:
                if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                    alive.append(p)
            except psutil.NoSuchProcess:
                pass
        return alive

    def stderr(self) -> str:
        with open(self.stderr_path) as f:
            return f.read()

    def stdout(self) -> str:
        with open(self.stdout_path) as f:
            return f.read()

    def kill_all(self) -> None:
        self.descendants()
        for p in [*self.seen.values()]:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

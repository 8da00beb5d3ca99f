"""The stall watchdog: when some rank makes no progress for ``timeout`` seconds, every rank dumps
its stacks and recent collectives, one merged report names the lagging rank(s) and their line,
and the job exits with status ``STALL_EXIT`` (so ``--max-restarts`` turns a hang into a restart).
One daemon thread per rank; the ranks meet in the job's rendezvous store (a flag, then snapshots
that the lowest rank still answering merges)."""

from __future__ import annotations

import datetime
import json
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, Self, TypeVar

import torch.distributed as dist

from ..options import launch_link
from .tracker import Tracker

STALL_EXIT = 124
"""Exit status of a rank stopped by the watchdog (like timeout(1))."""
STALL_MARKER = "stalled"
"""File a rank leaves in its launcher's folder (``$DTRAIN_LAUNCH_DIR``) as it exits on a stall: the
launcher then kills the node's workers still alive (``launch/reaper.py``), frozen ones included."""

STORE_ERRORS = (RuntimeError, OSError, ValueError)
"""What a store call may raise while a job is going down (torch's store errors, a reset socket, a
torn snapshot); the watchdog then reports this rank alone. Anything else is a bug and propagates."""

T = TypeVar("T")


class DaemonThread:
    """A daemon thread that runs ``self._run`` (which returns once ``self._stop`` is set) from
    ``start()`` until ``stop()``: the watchdog, the start-up watch, the launcher's stall reaper."""

    def __init__(self, name: str) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> Self:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()


class Watchdog(DaemonThread):
    def __init__(self, tracker: Tracker, *, rank: int, size: int, timeout_s: float, run_dir: str,
                 master_addr: str, master_port: int, attempt: int = 0, poll_s: float | None = None) -> None:
        super().__init__("dtrain-watchdog")
        self.tracker = tracker
        self.rank, self.size = rank, size
        self.timeout_s = timeout_s
        self.run_dir = run_dir
        self.poll_s = poll_s if poll_s is not None else max(0.2, min(2.0, timeout_s / 10))
        self._addr, self._port, self._prefix = master_addr, master_port, f"/dtrain/watchdog/attempt_{attempt}"
        self._store: dist.Store | None = None
        self.report: str | None = None

    # -- the thread -------------------------------------------------------------------------
    def _connect(self) -> dist.Store | None:
        try:
            client = dist.TCPStore(self._addr, self._port, self.size, False, datetime.timedelta(seconds=30))
            return dist.PrefixStore(self._prefix, client)
        except STORE_ERRORS:  # no store: the watchdog still reports this rank alone
            return None

    def _run(self) -> None:
        self._store = self._connect() if self.size > 1 else None
        while not self._stop.wait(self.poll_s):
            idle = time.monotonic() - self.tracker.last_beat
            flagged = self._call(lambda s: s.check(["stall"]), False)
            if idle > self.timeout_s and self.tracker.armed and not flagged:
                self._set("stall", json.dumps({"rank": self.rank, "idle_s": round(idle, 1)}))
                flagged = True
            if flagged:
                self._handle_stall()
                return

    def _call(self, op: Callable[[dist.Store], T], default: T) -> T:
        """``op(store)``, or ``default`` without a store or when the store fails as expected."""
        if self._store is None:
            return default
        try:
            return op(self._store)
        except STORE_ERRORS:
            return default

    def _handle_stall(self) -> None:
        snap = self.tracker.snapshot(self.rank)
        os.makedirs(self.run_dir, exist_ok=True)
        dump_path = os.path.join(self.run_dir, f"stall-rank{self.rank}.txt")
        with open(dump_path, "w") as fh:
            fh.write(self.tracker.dump(self.rank))
        snap["dump"] = dump_path
        snaps = {self.rank: snap}
        if self._store is not None:
            self._set(f"snap/{self.rank}", json.dumps(snap))
            # A frozen rank never answers: wait for the snapshots no longer than needed, so the
            # job ends (or restarts) within about the stall timeout plus a few seconds.
            snaps = self._collect(snap, wait_s=min(5.0, max(1.0, self.timeout_s / 10)))
        if self.rank == min(snaps):  # the lowest rank still answering reports
            self.report = merge_report(snaps, self.size, self.timeout_s)
            with open(os.path.join(self.run_dir, "stall-report.txt"), "w") as fh:
                fh.write(self.report + "\n")
            print(self.report, file=sys.stderr, flush=True)
            self._set("reported", "1")
        else:
            self._wait_for("reported", 10.0)
        sys.stderr.flush()
        sys.stdout.flush()
        _leave_marker()
        os._exit(STALL_EXIT)

    def _collect(self, mine: dict[str, Any], wait_s: float = 5.0) -> dict[int, dict[str, Any]]:
        snaps = {self.rank: mine}
        deadline = time.monotonic() + wait_s
        while len(snaps) < self.size and time.monotonic() < deadline:
            for r in range(self.size):
                if r in snaps:
                    continue
                key = f"snap/{r}"
                found = self._call(lambda s: json.loads(s.get(key)) if s.check([key]) else None, None)
                if found is not None:
                    snaps[r] = found
            time.sleep(0.1)
        return snaps

    def _set(self, key: str, value: str) -> None:
        self._call(lambda s: s.set(key, value), None)

    def _wait_for(self, key: str, wait_s: float) -> None:
        deadline = time.monotonic() + wait_s
        while self._store is not None and time.monotonic() < deadline:
            # a failing store ends the wait as if the key were there: nobody is left to set it
            if self._call(lambda s: s.check([key]), True):
                return
            time.sleep(0.1)


def _leave_marker() -> None:
    folder = launch_link().launch_dir
    if folder and os.path.isdir(folder):
        try:
            with open(os.path.join(folder, STALL_MARKER), "w"):
                pass
        except OSError:
            pass


def merge_report(snaps: dict[int, dict[str, Any]], size: int, timeout_s: float) -> str:
    """One report from every rank's snapshot: the lagging ranks first, then who waits for them.

    A rank lags when it is not inside a collective while others are, or has reached fewer steps
    or collectives than the rest."""
    missing = [r for r in range(size) if r not in snaps]
    present = [dict(s) for s in snaps.values()]
    for s in present:
        if not s["current"] and s.get("in_backward"):
            # A plain loss.backward() (not ctx.backward) all-reduces gradients untracked.
            s["current"] = f"backward (gradient all-reduce) at {s['at']}"
    waiting = [s for s in present if s["current"]]
    ahead = max((s["step"], s["last_done_seq"]) for s in present)
    lagging = [s for s in present if not s["current"]]
    if not lagging:  # everyone waits: the ones behind are the culprits
        lagging = [s for s in present if (s["step"], s["last_done_seq"]) < ahead] or present
    lag_ranks = {s["rank"] for s in lagging}
    lines = [f"dtrain: stall: no progress for more than {timeout_s:g} s"]
    for s in sorted(lagging, key=lambda s: s["rank"]):
        doing = f"in {s['current']}" if s["current"] else f"no collective since #{s['last_done_seq']}"
        lines.append(f"  rank {s['rank']} at {s['at']} (step {s['step']}, {doing}; innermost {s['innermost']})")
    others = [s for s in waiting if s["rank"] not in lag_ranks]
    by_what: dict[str, list[int]] = {}
    for s in others:
        what = s["current"]
        by_what.setdefault(what, []).append(s["rank"])
    for what, ranks in by_what.items():
        lines.append(f"  {'ranks' if len(ranks) > 1 else 'rank'} {','.join(map(str, sorted(ranks)))} waiting in {what}")
    if missing:
        lines.append(f"  {'ranks' if len(missing) > 1 else 'rank'} {','.join(map(str, missing))} did not answer "
                     "(dead, unreachable, or blocked in native code that holds Python's GIL)")
    dumps = sorted({os.path.dirname(s["dump"]) for s in present})
    lines.append(f"  stacks and recent collectives of every rank: {', '.join(dumps)}/stall-rank*.txt")
    lines.append(f"  every rank exits with status {STALL_EXIT}; with --max-restarts the job restarts from its last checkpoint.")
    return "\n".join(lines)

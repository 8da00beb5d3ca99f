"""The moments benchmarks/ft_kill_bed.py kills a host at, and the evidence that a kill landed there.

- random: uniform over 1-4 s after the host is back in the quorum (a step, its all-reduce, its vote);
- save: the moment the host's checkpoint folder holds a save being written (``.tmp-step-*-PID``);
  afterwards that folder still being there shows the save was cut;
- heal: after a restart, once the host has received a drawn share of a peer's state (the bytes its
  network namespace received; the task's frozen ``pad_mb`` makes the state, so the heal, large);
- startup: after a (re)start, before its first quorum: at a drawn share of the time the host took
  to reach the Lighthouse the last time (the Lighthouse connection, read from the namespace's
  sockets, is recorded at the kill).

The readers here look from outside (``/proc``, the files): nothing in the product knows of them.
"""

from __future__ import annotations

import json
import os
import signal
import time
from typing import Any

import torch

from dtrain.checkpoint import list_checkpoints, read_checkpoint

MOMENTS = ("random", "save", "heal", "startup")


class Tail:
    """The records of a JSON-lines file, read incrementally (the metrics file grows to ~10^4 lines
    and is polled every few ms: re-reading it whole would take the cores the job needs)."""

    def __init__(self, path: str) -> None:
        self.path, self.rows, self._offset, self._rest = path, [], 0, ""

    def __call__(self) -> list[dict]:
        if os.path.exists(self.path):
            with open(self.path) as f:
                f.seek(self._offset)
                chunk = f.read()
                self._offset = f.tell()
            lines = (self._rest + chunk).split("\n")
            self._rest = lines.pop()
            for line in lines:
                try:
                    self.rows.append(json.loads(line))
                except ValueError:
                    pass
        return self.rows


class Host:
    """The killed host as seen from outside: its processes, its namespace's sockets and bytes."""

    def __init__(self, bed: Any, index: int, ckpt_folder: str) -> None:
        self.bed, self.index, self.ckpt_folder = bed, index, ckpt_folder
        self.pid: int | None = None
        self.started = 0.0

    def started_now(self, proc: Any) -> None:
        self.pid, self.started = proc.pid, time.time()

    def kill(self) -> float:
        """SIGKILL the processes known now at once (a save or a heal is cut at this moment, not
        after `ip netns pids` ran), then every process of the namespace; returns the moment."""
        for pid in self.bed.pids(self.index) if self.pid is None else [self.pid]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        killed = time.time()
        self.bed.kill_host(self.index)
        return killed

    def in_namespace(self) -> bool:
        """Whether the started program runs in the host's namespace yet (`ip netns exec` enters it,
        then execs it: until then /proc/PID/net shows the machine's own)."""
        try:
            return os.stat(f"/proc/{self.pid}/ns/net").st_ino == os.stat(f"/run/netns/{self.bed.namespaces[self.index]}").st_ino
        except OSError:
            return False

    def _proc_net(self, name: str) -> list[str]:
        if not self.in_namespace():
            return []
        try:
            with open(f"/proc/{self.pid}/net/{name}") as f:
                return f.read().splitlines()
        except OSError:
            return []

    def rx_bytes(self) -> int:
        """Bytes received on the namespace's links (not loopback) since it was made."""
        total = 0
        for line in self._proc_net("dev")[2:]:
            dev, _, fields = line.partition(":")
            if dev.strip() != "lo" and fields.split():
                total += int(fields.split()[0])
        return total

    def connected(self, addr: str, port: int) -> bool:
        """Whether a TCP connection to ``addr:port`` is established in the namespace."""
        want = "%s:%04X" % ("".join(f"{int(b):02X}" for b in reversed(addr.split("."))), port)
        return any(len(f := line.split()) > 3 and f[2] == want and f[3] == "01" for line in self._proc_net("tcp")[1:])

    def saving(self) -> bool:
        """A save of this start being written (a save cut by an earlier kill leaves its folder, with
        its writer's pid, until the next start's first save)."""
        try:
            return any(n.startswith(".tmp-step-") and n.endswith(f"-{self.pid}") for n in os.listdir(self.ckpt_folder))
        except OSError:
            return False


def add_outages(rows: list[dict], records: list[dict], survivor: str = "h0", within: float = 10.0) -> None:
    """Each kill's ``outage_s``: the longest wait between two of the survivor's consecutive committed
    steps, the wait that spans the kill and those that start up to ``within`` s after it (``gap_s`` can be a step whose
    vote was in before the kill, written just after it; the step after that one waits for the quorum)."""
    times = sorted(r["time"] for r in records if r["replica"] == survivor)
    for row in rows:
        killed = row.get("killed_at")
        if killed is None:  # older rows: the kill was gap_s before the survivor's next step
            killed = next((r["time"] for r in records if r["replica"] == survivor and r["step"] == row["next_step"]), None)
            killed = None if killed is None else killed - row["gap_s"]
        waits = [b - a for a, b in zip(times, times[1:]) if killed is not None and b > killed and a <= killed + within]
        row["outage_s"] = round(max(waits), 3) if waits and row.get("step_at_kill") is not None else None


def emit(out: dict, path: str | None) -> None:
    """A kill series' summary on stdout (its per-kill rows were printed as they came), the whole in ``path``."""
    print(json.dumps({k: v for k, v in out.items() if k != "rows"}, indent=1))
    if path:
        with open(path, "w") as f:
            json.dump(out, f, indent=1)


def poll_until(ready, timeout: float, every: float = 0.005) -> bool:
    deadline = time.monotonic() + timeout
    while not ready():
        if time.monotonic() > deadline:
            return False
        time.sleep(every)
    return True


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return a == b


def states_equal(ckpt: str, replicas: tuple[str, str], at_least: int, timeout: float = 60.0) -> tuple[int | None, bool | None]:
    """The first step >= ``at_least`` both replicas saved, and whether their model and optimizer
    states there (model, optimizer, data order) are equal bit for bit; (None, None) when none came within ``timeout``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        steps = [dict(list_checkpoints(f"{ckpt}/replica-{r}")) for r in replicas]
        common = sorted(s for s in steps[0] if s in steps[1] and s >= at_least)
        for step in common:
            try:
                a, b = (read_checkpoint(s[step])["objects"] for s in steps)
            except Exception:  # pruned while being read: try a newer one
                continue
            return step, _equal(a, b)  # model, optimizer, data order
        time.sleep(0.5)
    return None, None

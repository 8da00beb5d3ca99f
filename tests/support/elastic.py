"""Drive an elastic job (``dtrain train --nnodes MIN:MAX``) on the network test bed, and read its
samples ledger: each attempt (generation) of the job, its world size, the step it resumed from,
and when each of its steps was committed. The elastic tests and ``benchmarks/elastic_cycles.py``
use it.

    with NetBed(hosts=3) as bed:
        job = BedJob(bed, lambda host: [sys.executable, "-m", "dtrain", "train", "--nnodes", "1:3",
                     "--master-addr", bed.addresses[0], ..., "--ledger", led], ledger=led, workdir=tmp)
        job.start(0); job.start(1)
        two = job.wait_generation(2)            # the first attempt at world size 2 that committed a step
        job.kill(1)                             # kill -9 of every process of host 1: a node lost
        one = job.wait_generation(1, after=two.number)
        job.start(1)                            # the node comes back
        codes = job.wait(timeout=300)           # {host: exit status} once every launcher ended
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from .netbed import NetBed

_FILE = re.compile(r"^gen(\d+)-rank(\d+)\.jsonl$")


@dataclass
class Generation:
    """One attempt of the job, as its ranks' ledger files tell it."""

    number: int
    world_size: int | None = None
    begin: int | None = None
    """The step it resumed from (0: a fresh start)."""
    commits: list[tuple[float, int]] = field(default_factory=list)
    """(time, step) of every step a rank of it committed."""

    @property
    def last_step(self) -> int | None:
        return max((s for _, s in self.commits), default=None)

    @property
    def first_commit(self) -> float | None:
        """When its first step was committed (the first step at its world size)."""
        return min((t for t, _ in self.commits), default=None)

    def steps_done(self) -> int:
        """Steps it committed beyond the one it resumed from."""
        return 0 if self.last_step is None else self.last_step - (self.begin or 0)


def generations(ledger: str) -> dict[int, Generation]:
    """Every generation in the ledger folder ``ledger`` (torn lines ignored), by number."""
    out: dict[int, Generation] = {}
    try:
        names = os.listdir(ledger)
    except OSError:
        return out
    for name in names:
        match = _FILE.match(name)
        if not match:
            continue
        gen = out.setdefault(int(match.group(1)), Generation(int(match.group(1))))
        with open(os.path.join(ledger, name)) as f:
            for line in f:
                try:
                    rec = json.loads(line)
                except ValueError:
                    continue
                if "begin" in rec:
                    gen.world_size, gen.begin = rec["world_size"], rec["begin"]
                elif "t" in rec:
                    gen.commits.append((rec["t"], rec["s"]))
    return dict(sorted(out.items()))


class BedJob:
    """The launchers of one job, one per host of ``bed``; ``command(host)`` is a host's command line.
    Each host's output goes to ``workdir/host<i>.log`` (appended when a host starts again)."""

    def __init__(self, bed: NetBed, command: Callable[[int], Sequence[str]], *, ledger: str, workdir: str,
                 env: dict[str, str] | None = None, cwd: str | None = None) -> None:
        self.bed = bed
        self.command = command
        self.ledger = ledger
        self.workdir = workdir
        self.env = env
        self.cwd = cwd
        self.procs: dict[int, subprocess.Popen] = {}
        self.ended: dict[int, list[int | None]] = {}
        """Per host, the exit status of each launcher of it that ended (None: killed by the bed)."""

    def start(self, host: int) -> subprocess.Popen:
        with open(self.log_path(host), "a") as log:
            log.write(f"--- started at {time.time():.3f} ---\n")
            log.flush()
            self.procs[host] = self.bed.popen(host, list(self.command(host)), env=self.env, cwd=self.cwd, stdout=log)
        return self.procs[host]

    def kill(self, host: int) -> float:
        """``kill -9`` every process of ``host`` (a node lost); returns when, by ``time.time()``."""
        when = time.time()
        self.bed.kill_host(host)
        proc = self.procs.pop(host, None)
        if proc is not None:
            self.ended.setdefault(host, []).append(None)
        return when

    def signal(self, host: int, sig: int = signal.SIGTERM) -> float:
        """Send ``sig`` to ``host``'s launcher only (a scheduler stopping that node); returns when."""
        when = time.time()
        os.kill(self.procs[host].pid, sig)
        return when

    def log_path(self, host: int) -> str:
        return os.path.join(self.workdir, f"host{host}.log")

    def logs(self) -> str:
        """Every host's output, for a failure message."""
        parts = []
        for host in range(self.bed.hosts):
            if os.path.exists(self.log_path(host)):
                with open(self.log_path(host)) as f:
                    parts.append(f"=== host {host} ===\n{f.read()[-6000:]}")
        return "\n".join(parts)

    def generations(self) -> dict[int, Generation]:
        return generations(self.ledger)

    def wait_for(self, cond: Callable[[], Any], timeout: float, what: str, poll: float = 0.2) -> Any:
        """``cond()``'s first true value within ``timeout`` seconds; else TimeoutError naming ``what``."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            got = cond()
            if got:
                return got
            self._collect()
            if not self.procs:
                raise TimeoutError(f"{what}: every launcher has ended ({self.ended})")
            time.sleep(poll)
        raise TimeoutError(f"{what}: not within {timeout:g} s")

    def wait_generation(self, world_size: int, *, after: int = 0, timeout: float = 300.0) -> Generation:
        """The first generation numbered above ``after`` at ``world_size`` that committed a step."""
        def found() -> Generation | None:
            return next((g for n, g in self.generations().items() if n > after and g.world_size == world_size and g.commits), None)
        return self.wait_for(found, timeout, f"no step at world size {world_size} after generation {after}")

    def wait_steps(self, gen: int, steps: int, timeout: float = 300.0) -> Generation:
        """Generation ``gen`` once it committed ``steps`` steps beyond the one it resumed from."""
        def found() -> Generation | None:
            g = self.generations().get(gen)
            return g if g is not None and g.steps_done() >= steps else None
        return self.wait_for(found, timeout, f"generation {gen} did not reach {steps} step(s)")

    def wait(self, timeout: float) -> dict[int, int | None]:
        """Wait until every running launcher ended; the last exit status of each host."""
        deadline = time.monotonic() + timeout
        for host, proc in list(self.procs.items()):
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.bed.kill_host(host)
        self._collect(all_ended=True)
        return {host: codes[-1] for host, codes in self.ended.items()}

    def _collect(self, all_ended: bool = False) -> None:
        for host, proc in list(self.procs.items()):
            code = proc.poll()
            if code is not None or all_ended:
                self.ended.setdefault(host, []).append(code)
                del self.procs[host]

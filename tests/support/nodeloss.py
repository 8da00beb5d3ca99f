"""A node lost at a random moment of an elastic job (``--nnodes 1:2``) on the network test bed: the
trial behind ``tests/multiprocess/launch/test_multinode.py`` and ``benchmarks/node_loss_random.py``.

Host 0 hosts the rendezvous and stays up; every process of host 1 is killed (``kill -9``) at a
moment drawn over the whole life of the job, so it lands before the process group forms, in a
step, in a save, in the evaluation or after the end. In some trials host 1 then starts again
(a rejoin), and in some of those it is killed again while it rejoins. What counts:

* host 0 finishes (exit 0) and the samples ledger says every sample was trained exactly once;
* ``kill_to_next_step_s``: from the (last) kill to the survivors' next committed step (None when
  the job had no step left to take).

    with NetBed(hosts=2, shared_name="vm") as bed:
        trial(bed, work, kill_at_s=7.5, rejoin_after_s=2.0, second_kill_s=4.0)
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Sequence
from typing import Any

from dtrain.data.ledger import check_ledger
from dtrain.errors import ConfigError

from .elastic import BedJob, generations
from .netbed import NetBed

#: A small paced job: 3 epochs of 16 steps (256 samples, batch 16 a rank at world size 1),
#: a save every 4 steps and an evaluation after each epoch.
JOB_ARGS = ("--task", "tests.user_task:make_slow", "--task-arg", "epochs=3", "--save-every", "4", "--log-every", "1",
            "--rdzv-last-call", "2", "--startup-timeout", "30")


def command(bed: NetBed, work: str, *, port: int, delay: float, extra: Sequence[str] = ()) -> Any:
    """The launcher command of each host (a function of the host index)."""
    def build(host: int) -> list[str]:
        return [sys.executable, "-m", "dtrain", "train", *JOB_ARGS, "--task-arg", f"delay={delay}", "--nnodes", "1:2",
                "--master-addr", bed.addresses[0], "--master-port", str(port), "--checkpoint-dir", os.path.join(work, "ck"),
                "--ledger", os.path.join(work, "ledger"), *extra]
    return build


def next_commit_after(ledger: str, when: float) -> float | None:
    """The first step any generation committed after ``when`` (``time.time()``), or None."""
    times = [t for g in generations(ledger).values() for t, _ in g.commits if t > when]
    return min(times, default=None)


def trial(bed: NetBed, work: str, *, kill_at_s: float | None = None, kill_after_step: int | None = None,
          rejoin_after_s: float | None = None,
          second_kill_s: float | None = None, port: int = 29731, delay: float = 0.004, timeout: float = 240.0,
          env: dict[str, str] | None = None, cwd: str | None = None) -> dict[str, Any]:
    """One job on ``bed`` (two hosts) with host 1 killed ``kill_at_s`` after both started, or once the
    job committed step ``kill_after_step`` (plus ``kill_at_s`` more seconds, if given); returns what
    happened (see the module's docstring)."""
    ledger = os.path.join(work, "ledger")
    job = BedJob(bed, command(bed, work, port=port, delay=delay), ledger=ledger, workdir=work, env=env, cwd=cwd)
    out: dict[str, Any] = {"kill_at_s": kill_at_s and round(kill_at_s, 2), "kill_after_step": kill_after_step,
                           "rejoin_after_s": rejoin_after_s, "second_kill_s": second_kill_s}
    start = time.time()
    job.start(0)
    job.start(1)
    anchor = start
    if kill_after_step is not None:
        anchor = _wait_step(job, kill_after_step, start + timeout / 2)
    kills = [_kill_at(job, anchor + (kill_at_s or 0.0))]
    out["phase_at_kill"] = _phase(ledger, kills[0], start)
    out["world_size_at_kill"] = _world_size_at(ledger, kills[0])
    if rejoin_after_s is not None and job.procs.get(0) is not None and job.procs[0].poll() is None:
        _sleep_until(kills[-1] + rejoin_after_s)
        restart = time.time()
        job.start(1)
        if second_kill_s is not None:
            kills.append(_kill_at(job, restart + second_kill_s))
    codes = job.wait(timeout=max(10.0, timeout - (time.time() - start)))
    try:
        report = check_ledger(ledger)
    except ConfigError:  # no ledger at all: the job never committed a step
        report = None
    nxt = next_commit_after(ledger, kills[-1])
    out.update(exit_host0=codes.get(0), exit_host1=codes.get(1), kills=len(kills),
               exactly_once=bool(report and report.ok and report.epochs and all(e.complete for e in report.epochs)),
               kill_to_next_step_s=None if nxt is None else round(nxt - kills[-1], 1),
               wall_s=round(time.time() - start, 1))
    out["completed"] = out["exit_host0"] == 0
    if not (out["completed"] and out["exactly_once"]):
        out["logs"] = job.logs()[-4000:]
    return out


def _kill_at(job: BedJob, when: float) -> float:
    _sleep_until(when)
    if 1 in job.procs:
        return job.kill(1)
    return time.time()  # host 1 had ended already: nothing to kill


def _wait_step(job: BedJob, step: int, deadline: float) -> float:
    """When the job (any generation) committed ``step``, or the deadline / host 0's end."""
    while time.time() < deadline and job.procs.get(0) is not None and job.procs[0].poll() is None:
        if any(s >= step for g in job.generations().values() for _, s in g.commits):
            return time.time()
        time.sleep(0.05)
    return time.time()


def _world_size_at(ledger: str, when: float) -> int | None:
    """The world size of the newest generation that committed a step before ``when``."""
    before = [(min(t for t, _ in g.commits), g.world_size) for g in generations(ledger).values()
              if g.commits and min(t for t, _ in g.commits) <= when]
    return max(before)[1] if before else None


def _sleep_until(when: float) -> None:
    time.sleep(max(0.0, when - time.time()))


def _phase(ledger: str, when: float, start: float) -> str:
    """Roughly where the job was at ``when``: 'start-up' (no step yet) or 'training'."""
    first = min((t for g in generations(ledger).values() for t, _ in g.commits), default=None)
    return "start-up" if first is None or first > when else "training"

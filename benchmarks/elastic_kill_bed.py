"""The job of benchmarks/ft_kill_bed.py on today's elastic path, for the comparison table: `dtrain
train --nnodes 1:2 --max-restarts K` (no --fault-tolerance) on the network test bed, two hosts sharing
one host name (by default), host 0 holding the rendezvous, the same task (`tests.user_task:make_paced`
with a frozen ``--pad-mb`` parameter), a checkpoint every ``--save-every`` steps. Every process of host 1
is killed (kill -9) ``--kills`` times and its command started again ``--restart-after`` seconds after
each kill. The moments, in turn, as far as they apply to this path:

- random: 1-4 s after host 1 is back in the job (its first step in a round of 2);
- save: while a checkpoint of the job is being written (a ``.tmp-step-*`` folder in --checkpoint-dir);
- rejoin (ft's heal has no counterpart: nothing is sent from a peer's memory): after a restart, once
  host 1's agent reached the rendezvous, before the round with it committed a step (the survivors'
  workers are being stopped and both hosts' workers started and reloading the checkpoint);
- startup: after a (re)start, before host 1's agent reached the rendezvous (the first kill, when its
  moment is startup, lands in the job's own start-up).

Per kill, read from the samples ledger (every rank's commits with their times; nothing in the product
knows of this): gap_s (kill -> the survivors' next committed step: after the restart of their workers
and the reload, unless the kill did not touch a round they were in), lost (steps redone: the last step
committed before the kill + 1 - the next one), restarted (the next step came from a new round),
outage_s (the longest wait between two committed steps, spanning the kill or starting up to 10 s after),
back_s (restart -> host 1's first committed step in a round of 2), join_pause_s (the survivors' wait for
that round: a join restarts every worker too). At the end: exit statuses, and the ledger's verdict.

    flock /tmp/dtrain-bench.lock nice -n 5 python3 benchmarks/elastic_kill_bed.py --kills 20 \\
        --moments startup,random,rejoin,save --pad-mb 24 --save-every 50 --json FILE     # root, iproute2
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "src"))
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)

import torch  # noqa: E402
from ft_kill_bed import summary  # noqa: E402
from ft_moments import Host, add_outages, emit, poll_until  # noqa: E402
from tests.support.elastic import BedJob, generations  # noqa: E402
from tests.support.netbed import NetBed, unavailable_reason  # noqa: E402

from dtrain.data.ledger import check_ledger  # noqa: E402

MOMENTS = ("random", "save", "rejoin", "startup")
MARGIN = 400  # no kill in the job's last steps: it must still be running to be hit


def command(tmp: str, bed: NetBed, a: argparse.Namespace):
    def build(host: int) -> list[str]:
        return [sys.executable, "-m", "dtrain", "train", "--nnodes", "1:2", "--master-addr", bed.addresses[0],
                "--master-port", str(a.port), "--max-restarts", str(2 * a.kills + 5), "--rdzv-last-call", "2",
                "--startup-timeout", "120", "--task", "tests.user_task:make_paced", "--task-arg", f"pace_file={tmp}/pace",
                "--task-arg", f"pad_mb={a.pad_mb:g}", "--epochs", "1000", "--max-steps", str(a.steps),
                "--ledger", f"{tmp}/ledger", "--log-every", "1", "--checkpoint-dir", f"{tmp}/ckpt",
                "--save-every", str(a.save_every)]
    return build


class Run:
    """One elastic job on the bed and its kills (see the module's docstring)."""

    def __init__(self, bed: NetBed, tmp: str, a: argparse.Namespace) -> None:
        self.bed, self.tmp, self.a = bed, tmp, a
        self.rng = random.Random(a.seed)
        self.job = BedJob(bed, command(tmp, bed, a), ledger=f"{tmp}/ledger", workdir=tmp, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join([os.path.join(ROOT, "src"), ROOT])})
        self.host = Host(bed, 1, f"{tmp}/ckpt")
        self.connect_s: list[float] = []  # start -> rendezvous connection
        self.commit_s: list[float] = []  # rendezvous connection -> first step in a round of 2

    def commits(self) -> list[tuple[float, int, int, int | None]]:
        """(time, step, generation, world size) of every committed step, in time order."""
        return sorted((t, s, n, g.world_size) for n, g in generations(self.job.ledger).items() for t, s in g.commits)

    def step(self) -> int:
        return max((c[1] for c in self.commits()), default=0)

    def start(self) -> None:
        self.host.started_now(self.job.start(1))

    def in_round_of_2(self) -> tuple | None:
        return next((c for c in self.commits() if c[0] > self.host.started and c[3] == 2), None)

    def rendezvous(self) -> bool:
        return self.host.connected(self.bed.addresses[0], self.a.port)

    def saving(self) -> bool:
        try:
            return any(n.startswith(".tmp-step-") for n in os.listdir(f"{self.tmp}/ckpt"))
        except OSError:
            return False

    def kill(self) -> float:
        self.job.procs.pop(1, None)
        return self.host.kill()

    def land(self, moment: str) -> tuple[float, dict]:
        """Kill host 1 at ``moment``; the kill's time and the evidence of where it landed."""
        if moment == "random":
            time.sleep(self.rng.uniform(1.0, 4.0))
        elif moment == "save":
            found = poll_until(self.saving, 120)
            killed = self.kill()
            return killed, {"save_found": found, "save_cut": self.saving()}
        elif moment == "rejoin":
            poll_until(lambda: self.rendezvous() or bool(self.in_round_of_2()), 300, 0.01)
            est = statistics.median(self.commit_s) if self.commit_s else 10.0
            until = time.time() + self.rng.uniform(0.1, 0.9) * est
            poll_until(lambda: time.time() >= until or bool(self.in_round_of_2()), 300, 0.01)
            evidence = {"after_start_s": round(time.time() - self.host.started, 2), "rendezvous_connected": self.rendezvous(),
                        "victim_committed": bool(self.in_round_of_2())}
            return self.kill(), evidence
        elif moment == "startup":
            est = statistics.median(self.connect_s) if self.connect_s else 4.0
            until = self.host.started + self.rng.uniform(0.1, 0.95) * est
            poll_until(lambda: time.time() >= until or self.rendezvous(), 300, 0.01)
            evidence = {"after_start_s": round(time.time() - self.host.started, 2), "rendezvous_connected": self.rendezvous()}
            return self.kill(), evidence
        return self.kill(), {}

    def back(self, row: dict) -> None:
        """Wait for host 1's first step in a round of 2 since its start; what it took."""
        connected = None
        def ready() -> bool:
            nonlocal connected
            if connected is None and self.rendezvous():
                connected = time.time()
            return bool(self.in_round_of_2())
        if not poll_until(ready, 300, 0.02):
            raise SystemExit(f"kill {row.get('kill')}: host 1 not back in a round of 2 within 300 s")
        first = self.in_round_of_2()
        before = [c for c in self.commits() if c[0] < first[0]]
        if connected is not None:
            self.connect_s.append(connected - self.host.started)
            self.commit_s.append(first[0] - connected)
        row.update(back_s=round(first[0] - self.host.started, 3), back_step=first[1],
                   join_pause_s=round(first[0] - before[-1][0], 3) if before else None)

    def one_kill(self, i: int, moment: str, then: str | None) -> dict:
        killed, evidence = self.land(moment)
        before = [c for c in self.commits() if c[0] <= killed]
        if not poll_until(lambda: any(c[0] > killed for c in self.commits()), 300, 0.02):
            raise SystemExit(f"kill {i}: no step within 300 s")
        after = next(c for c in self.commits() if c[0] > killed)
        last = before[-1] if before else None
        row = {"kill": i, "moment": moment, **evidence, "killed_at": round(killed, 3), "gap_s": round(after[0] - killed, 3),
               "step_at_kill": last[1] if last else None, "next_step": after[1],
               "lost": max(0, (last[1] if last else 0) + 1 - after[1]), "restarted": bool(last) and after[2] != last[2],
               "world_size_at_kill": last[3] if last else None, "load1": round(os.getloadavg()[0], 2)}
        time.sleep(max(0.0, self.a.restart_after - (time.time() - killed)))
        self.start()
        if then not in ("rejoin", "startup"):  # else the next kill lands in this start
            self.back(row)
        print(json.dumps(row), flush=True)
        return row

    def kills(self) -> list[dict]:
        moments, rows, t0 = self.a.moments, [], time.time()
        if moments[0] != "startup":
            self.back({"kill": "job start"})
        for i in range(self.a.kills):
            if self.step() > self.a.steps - MARGIN or time.time() - t0 > self.a.budget_s:
                break
            then = moments[(i + 1) % len(moments)] if i + 1 < self.a.kills else None
            rows.append(self.one_kill(i, moments[i % len(moments)], then))
        if rows and "back_s" not in rows[-1]:  # stopped before the kill meant to land in the last start
            self.back(rows[-1])
        return rows


def run(a: argparse.Namespace) -> dict:
    tmp = tempfile.mkdtemp(prefix="elastic_kill_bed-")
    with open(f"{tmp}/pace", "w") as f:
        f.write("0.004")
    load = [os.getloadavg()[0]]
    with NetBed(hosts=2, shared_name=a.shared_name or None) as bed:
        job = Run(bed, tmp, a)
        job.job.start(0)
        job.start()
        rows = job.kills()
        load.append(os.getloadavg()[0])
        with open(f"{tmp}/pace", "w") as f:
            f.write("0")
        codes = job.job.wait(timeout=900)
        commits = job.commits()
    ledger = check_ledger(f"{tmp}/ledger")
    add_outages(rows, [{"replica": "h0", "time": c[0], "step": c[1]} for c in commits])
    return {
        "date": time.strftime("%Y-%m-%d"), "machine": f"{os.cpu_count()} cores; NetBed 2 hosts, shared host name {a.shared_name!r}",
        "torch": torch.__version__, "command": " ".join(["python3", "benchmarks/elastic_kill_bed.py", *sys.argv[1:]]),
        "load1_start_end": [round(x, 2) for x in load], "kills": len(rows), "exit_status": codes,
        "completed": all(c == 0 for c in codes.values()), "last_step": max((c[1] for c in commits), default=None),
        **summary(rows), "by_moment": {m: {"kills": len(of), "gap_s": _spread([r["gap_s"] for r in of]), "lost": sum(r["lost"] for r in of)}
                                      for m in MOMENTS if (of := [r for r in rows if r["moment"] == m])},
        "join_pause_s": _spread([r["join_pause_s"] for r in rows if r.get("join_pause_s") is not None]),
        "restarted": sum(r["restarted"] for r in rows),
        "ledger_exactly_once": ledger.ok, "ledger_generations": ledger.generations, "ledger_steps": ledger.steps_kept,
        "rows": rows, "folder": tmp,
    }


def _spread(values: list[float]) -> dict | None:
    return {"median": round(statistics.median(values), 3), "max": max(values), "n": len(values)} if values else None


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kills", type=int, default=5)
    p.add_argument("--moments", default="random", help=f"comma list, taken in turn: {', '.join(MOMENTS)}")
    p.add_argument("--restart-after", type=float, default=5.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=12000, help=f"the job's length (kills stop {MARGIN} steps before its end)")
    p.add_argument("--save-every", type=int, default=50)
    p.add_argument("--pad-mb", type=float, default=0.0, help="a frozen parameter of this size: slow saves and reloads")
    p.add_argument("--port", type=int, default=29741, help="the rendezvous port on host 0")
    p.add_argument("--budget-s", type=float, default=1200.0, help="no new kill after this many seconds (a locked run stays short)")
    p.add_argument("--shared-name", default="vm", help="the host name both hosts share ('' for names of their own)")
    p.add_argument("--json", default=None)
    a = p.parse_args()
    a.moments = a.moments.split(",")
    if set(a.moments) - set(MOMENTS):
        p.error(f"--moments takes {', '.join(MOMENTS)}")
    reason = unavailable_reason()
    if reason:
        print(f"the network test bed is unavailable here: {reason}")
        return 2
    out = run(a)
    emit(out, a.json)
    return 0 if out["completed"] and out["ledger_exactly_once"] else 1


if __name__ == "__main__":
    sys.exit(main())

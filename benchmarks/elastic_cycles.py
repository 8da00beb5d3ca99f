"""Node loss, rejoin and a planned leave under `dtrain train --nnodes 1:3`, on the network test bed
(`tests.support.netbed`: each node a network namespace host behind a bridge; needs root and
`ip netns`). Per job (one cycle):

1. hosts 0 and 1 start (world size 2); host 0 hosts the rendezvous and stays up;
2. after a random 3-12 steps at size 2, every process of host 1 is killed (kill -9): an
   unplanned loss; the survivor goes on at size 1;
3. 2-6 s after the survivor's first step at size 1, host 1 starts again: the job grows to 2;
4. after a random 2-6 steps at size 2, host 1's launcher gets SIGTERM (a scheduler taking the
   node back): a planned leave; the survivor goes on at size 1 and finishes.

Reported per job, from the samples ledger (commit times) and the driver's clock: the exits
(host 0 finishes with 0, host 1's leaving launcher with 143), the ledger's verdict, steps redone
after the loss (the lost generation's last committed step minus the step the next one resumed
from; goal <= --save-every), after the join and after the planned leave (goal 0), and seconds
from the loss, the join and the leave to the first step at the new size.

    flock /tmp/dtrain-bench.lock python3 benchmarks/elastic_cycles.py --jobs 5 --json benchmarks/results/x.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "src"))
sys.path.insert(0, ROOT)  # tests.support: the harness that only tests and benchmarks use

from tests.support.elastic import BedJob  # noqa: E402
from tests.support.netbed import NetBed, unavailable_reason  # noqa: E402

from dtrain.data.ledger import check_ledger  # noqa: E402

SAVE_EVERY = 5


def _command(work: str, port: int, delay: float, epochs: int, master: str) -> list[str]:
    return [sys.executable, "-m", "dtrain", "train", "--task", "tests.user_task:make_slow", "--task-arg", f"delay={delay}",
            "--task-arg", f"epochs={epochs}", "--nnodes", "1:3", "--master-addr", master, "--master-port", str(port),
            "--checkpoint-dir", os.path.join(work, "ck"), "--save-every", str(SAVE_EVERY), "--ledger", os.path.join(work, "ledger"),
            "--log-every", "1"]


def _redone(job: BedJob, old: int, new: int) -> int:
    gens = job.generations()
    return gens[old].last_step - gens[new].begin


def one_job(bed: NetBed, port: int, delay: float, epochs: int, timeout: float) -> dict:
    work = tempfile.mkdtemp(prefix="dtrain-elastic-")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.join(ROOT, "src"), ROOT])}
    job = BedJob(bed, lambda host: _command(work, port, delay, epochs, bed.addresses[0]), ledger=os.path.join(work, "ledger"),
                 workdir=work, env=env, cwd=ROOT)
    out: dict = {"dir": work}
    try:
        job.start(0)
        job.start(1)
        two = job.wait_generation(2, timeout=timeout)
        job.wait_steps(two.number, random.randint(3, 12), timeout=timeout)
        lost_at = job.kill(1)
        one = job.wait_generation(1, after=two.number, timeout=timeout)
        out["loss_to_first_step_s"] = round(one.first_commit - lost_at, 1)
        out["steps_redone_on_loss"] = _redone(job, two.number, one.number)
        time.sleep(random.uniform(2, 6))
        joined_at = time.time()
        job.start(1)
        two_again = job.wait_generation(2, after=one.number, timeout=timeout)
        out["join_to_first_step_s"] = round(two_again.first_commit - joined_at, 1)
        out["steps_redone_on_join"] = _redone(job, one.number, two_again.number)
        job.wait_steps(two_again.number, random.randint(2, 6), timeout=timeout)
        left_at = job.signal(1, signal.SIGTERM)
        alone = job.wait_generation(1, after=two_again.number, timeout=timeout)
        out["leave_to_first_step_s"] = round(alone.first_commit - left_at, 1)
        out["steps_redone_on_leave"] = _redone(job, two_again.number, alone.number)
        codes = job.wait(timeout)
        out["exit_host0"], out["exit_host1"] = codes.get(0), codes.get(1)
    except TimeoutError as exc:
        out["error"] = str(exc)
    finally:
        for host in list(job.procs):
            job.kill(host)
    try:
        report = check_ledger(job.ledger)
        out["exactly_once"] = report.ok and len(report.epochs) == epochs and all(e.complete for e in report.epochs)
    except Exception as exc:  # noqa: BLE001 -- no ledger at all: not exactly-once
        out["exactly_once"], out["ledger_error"] = False, str(exc)
    out["completed"] = out.get("exit_host0") == 0 and out.get("exit_host1") == 128 + signal.SIGTERM
    return out


def summarize(rows: list[dict]) -> dict:
    summary: dict = {"jobs": len(rows), "completed": sum(r["completed"] for r in rows),
                     "exactly_once": sum(r["exactly_once"] for r in rows)}
    for key in ("steps_redone_on_loss", "steps_redone_on_join", "steps_redone_on_leave", "loss_to_first_step_s",
                "join_to_first_step_s", "leave_to_first_step_s"):
        vals = [r[key] for r in rows if key in r]
        summary[key] = {"median": statistics.median(vals), "max": max(vals), "all": vals} if vals else None
    return summary


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", type=int, default=10)
    ap.add_argument("--delay", type=float, default=0.01, help="seconds per sample (16 per step at size 1)")
    ap.add_argument("--epochs", type=int, default=8)
    ap.add_argument("--port", type=int, default=29640)
    ap.add_argument("--timeout", type=float, default=300, help="seconds for each phase")
    ap.add_argument("--json", default=None, help="append each job's row (and the summary) to this JSON-lines file")
    args = ap.parse_args()
    reason = unavailable_reason()
    if reason:
        print(f"dtrain: error: the network test bed is unavailable: {reason}.", file=sys.stderr)
        return 2
    rows = []
    with NetBed(hosts=2) as bed:
        for i in range(args.jobs):
            row = one_job(bed, args.port + i, args.delay, args.epochs, args.timeout)
            rows.append(row)
            _emit(row, args.json)
    _emit({"summary": summarize(rows)}, args.json)
    return 0


def _emit(record: dict, path: str | None) -> None:
    line = json.dumps(record)
    print(line, flush=True)
    if path:
        with open(path, "a") as f:
            f.write(line + "\n")


if __name__ == "__main__":
    sys.exit(main())

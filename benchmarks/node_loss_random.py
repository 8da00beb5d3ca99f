"""A node lost at a random moment, many times: `dtrain train --nnodes 1:2` on the network test bed
whose hosts share one host name resolving to 127.0.0.1 (`NetBed(shared_name="vm")`, as many
Debian/Ubuntu images and containers are), every process of host 1 killed (kill -9) at a moment
drawn uniformly over the whole life of the job (a calibration run measures it; after the first
step the moment is taken as the step reached at that share of the training, so that a loaded
machine's slower start does not push every kill into the start-up); in a third of the
trials host 1 then starts again, and in half of those it is killed again while it rejoins.
Per trial (`tests.support.nodeloss.trial`): host 0's exit, the ledger's exactly-once verdict,
seconds from the (last) kill to the survivors' next committed step.

    flock /tmp/dtrain-bench.lock python3 benchmarks/node_loss_random.py --trials 20 --json benchmarks/results/x.jsonl
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
sys.path.insert(0, ROOT)  # tests.support: the harness that only tests and benchmarks use

from tests.support.elastic import BedJob  # noqa: E402
from tests.support.netbed import NetBed, unavailable_reason  # noqa: E402
from tests.support.nodeloss import command, trial  # noqa: E402


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.join(ROOT, "src"), ROOT])}


def calibrate(bed: NetBed, port: int, delay: float) -> tuple[float, float, int]:
    """An uninterrupted job: seconds from both launchers' start to host 0's exit, to its first
    committed step, and its last step."""
    work = tempfile.mkdtemp(prefix="dtrain-nodeloss-cal-")
    job = BedJob(bed, command(bed, work, port=port, delay=delay), ledger=os.path.join(work, "ledger"), workdir=work,
                 env=_env(), cwd=ROOT)
    start = time.time()
    job.start(0)
    job.start(1)
    codes = job.wait(timeout=300)
    if codes != {0: 0, 1: 0}:
        raise SystemExit(f"calibration run failed: {codes}\n{job.logs()}")
    commits = [(t, s) for g in job.generations().values() for t, s in g.commits]
    return time.time() - start, min(commits)[0] - start, max(s for _, s in commits)


def draw(rng: random.Random, life: float, first_step: float, last_step: int) -> dict:
    """A moment over the job's whole life, by its progress (robust to the machine's load): a point
    drawn uniformly in [0, life]; before the first step it is a time from the start, after it the
    step reached at that share of training plus up to 0.5 s (inside a step, a save, the evaluation)."""
    at = rng.uniform(0, life)
    if at < first_step:
        return {"kill_at_s": at}
    share = (at - first_step) / max(1e-9, life - first_step)
    return {"kill_after_step": min(last_step, int(share * last_step)), "kill_at_s": rng.uniform(0, 0.5)}


def _stats(values: list[float]) -> dict:
    return {"median": round(statistics.median(values), 1), "max": max(values), "all": values} if values else {}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trials", type=int, default=20)
    p.add_argument("--port", type=int, default=29731)
    p.add_argument("--delay", type=float, default=0.004, help="seconds per sample (paces the job)")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--json", default=None, help="append each trial and the summary here (JSON lines)")
    args = p.parse_args()
    reason = unavailable_reason()
    if reason:
        print(f"node_loss_random: {reason}", file=sys.stderr)
        return 2
    rng = random.Random(args.seed)
    rows = []
    out = open(args.json, "a") if args.json else None
    with NetBed(hosts=2, shared_name="vm") as bed:
        life, first_step, last_step = calibrate(bed, args.port, args.delay)
        print(json.dumps({"calibration_life_s": round(life, 1), "first_step_s": round(first_step, 1), "last_step": last_step,
                          "load": os.getloadavg()}), flush=True)
        for i in range(args.trials):
            rejoin = rng.uniform(1, 4) if rng.random() < 1 / 3 else None
            second = rng.uniform(0, 12) if rejoin is not None and rng.random() < 0.5 else None
            work = tempfile.mkdtemp(prefix="dtrain-nodeloss-")
            row = trial(bed, work, **draw(rng, life, first_step, last_step), rejoin_after_s=rejoin, second_kill_s=second,
                        port=args.port, delay=args.delay, env=_env(), cwd=ROOT)
            row.update(trial=i, dir=work, load1=round(os.getloadavg()[0], 2))
            rows.append(row)
            line = json.dumps({k: v for k, v in row.items() if k != "logs"})
            print(line, flush=True)
            if out:
                out.write(line + "\n")
            if "logs" in row:
                print(row["logs"], file=sys.stderr)
    waits = [r["kill_to_next_step_s"] for r in rows if r["kill_to_next_step_s"] is not None]
    summary = {"summary": {"trials": len(rows), "completed": sum(r["completed"] for r in rows),
                           "exactly_once": sum(r["exactly_once"] for r in rows), "calibration_life_s": round(life, 1),
                           "kill_to_next_step_s": _stats(waits),
                           "kill_to_next_step_s_in_a_round_of_2": _stats([r["kill_to_next_step_s"] for r in rows
                                                                        if r["kill_to_next_step_s"] is not None
                                                                        and r.get("world_size_at_kill") == 2]),
                           "phases": {ph: sum(r["phase_at_kill"] == ph for r in rows) for ph in ("start-up", "training")},
                           "with_rejoin": sum(r["rejoin_after_s"] is not None for r in rows),
                           "killed_while_rejoining": sum(r["second_kill_s"] is not None for r in rows)}}
    print(json.dumps(summary), flush=True)
    if out:
        out.write(json.dumps(summary) + "\n")
        out.close()
    return 0 if all(r["completed"] and r["exactly_once"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())

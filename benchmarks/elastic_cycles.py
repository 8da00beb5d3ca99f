"""Node loss and rejoin under `dtrain train --nnodes 1:2`, two "nodes" on this host (two launchers
on 127.0.0.1, one process each): per job, node B is killed (kill -9 of its launcher and worker)
at a random step, then started again; the job must finish with an exactly-once ledger.

Reports per cycle: the job's exit, the ledger's verdict, steps redone after the loss, seconds from
the loss to the first step at world size 1, and from the rejoin to the first step at world size 2
(both from the times the ledger records).

    python benchmarks/elastic_cycles.py --jobs 3
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "src"))

from dtrain.data.ledger import check_ledger  # noqa: E402


def _generations(led: str) -> dict[int, dict]:
    """Per generation: world size, begin step, and (time, step) of each committed step."""
    gens: dict[int, dict] = {}
    for path in glob.glob(os.path.join(led, "gen*-rank*.jsonl")):
        gen = int(os.path.basename(path)[3:8])
        g = gens.setdefault(gen, {"steps": []})
        with open(path) as f:
            for line in f:
                try:
                    rec = json.loads(line)
                except ValueError:
                    continue
                if "begin" in rec:
                    g.update(world=rec["world_size"], begin=rec["begin"])
                elif "t" in rec:
                    g["steps"].append((rec["t"], rec["s"]))
    return gens


def _wait(cond, timeout: float, what: str):
    deadline = time.time() + timeout
    while time.time() < deadline:
        got = cond()
        if got:
            return got
        time.sleep(0.2)
    raise TimeoutError(what)


def _first_step_of_new_gen(led: str, after_gen: int, world: int):
    for gen, g in sorted(_generations(led).items()):
        if gen > after_gen and g.get("world") == world and g["steps"]:
            return gen, min(g["steps"])
    return None


def one_job(port: int, delay: float, epochs: int, timeout: float) -> dict:
    work = tempfile.mkdtemp(prefix="dtrain-elastic-")
    led, ck = os.path.join(work, "ledger"), os.path.join(work, "ck")
    args = [sys.executable, "-m", "dtrain", "train", "--task", "tests.user_task:make_slow", "--task-arg", f"delay={delay}",
            "--task-arg", f"epochs={epochs}", "--nnodes", "1:2", "--master-addr", "127.0.0.1", "--master-port", str(port),
            "--checkpoint-dir", ck, "--save-every", "5", "--ledger", led, "--log-every", "5", "--rdzv-last-call", "2", *os.environ.get("ELASTIC_BENCH_EXTRA", "").split()]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.join(ROOT, "src"), ROOT])}

    def start(name: str) -> subprocess.Popen:
        out = open(os.path.join(work, f"{name}.log"), "w")
        return subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT, start_new_session=True)

    a = start("a")
    time.sleep(2)
    b = start("b")
    out: dict = {"dir": work}
    try:
        gen2, _ = _wait(lambda: _first_step_of_new_gen(led, 0, 2), timeout, "no step at world size 2")
        target = random.randrange(3, 12)
        _wait(lambda: len(_generations(led)[gen2]["steps"]) >= 2 * target, timeout, "no progress at world size 2")
        os.killpg(b.pid, signal.SIGKILL)  # every process of node B
        lost_at = time.time()
        b.wait()
        done = max(s for _, s in _generations(led)[gen2]["steps"])
        gen1, (t1, _) = _wait(lambda: _first_step_of_new_gen(led, gen2, 1), timeout, "no step at world size 1 after the loss")
        out["loss_to_first_step_s"] = round(t1 - lost_at, 1)
        out["steps_redone"] = done - _generations(led)[gen1]["begin"]
        time.sleep(random.uniform(2, 6))
        b = start("b2")
        joined = time.time()
        gen3, (t2, _) = _wait(lambda: _first_step_of_new_gen(led, gen1, 2), timeout, "no step at world size 2 after the join")
        out["join_to_first_step_s"] = round(t2 - joined, 1)
        gens = _generations(led)  # a join is planned: the survivor saves before its workers stop
        out["steps_redone_on_join"] = max(s for _, s in gens[gen1]["steps"]) - gens[gen3]["begin"]
        out["exit_a"], out["exit_b"] = a.wait(timeout), b.wait(timeout)
    except (TimeoutError, subprocess.TimeoutExpired) as exc:
        out["error"] = str(exc)
    finally:
        for p in (a, b):
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    report = check_ledger(led)
    out["exactly_once"] = report.ok and all(e.complete for e in report.epochs) and len(report.epochs) == epochs
    out["completed"] = out.get("exit_a") == 0 and out.get("exit_b") == 0
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", type=int, default=3)
    ap.add_argument("--delay", type=float, default=0.01, help="seconds per sample (16 per step)")
    ap.add_argument("--epochs", type=int, default=8)
    ap.add_argument("--port", type=int, default=29640)
    ap.add_argument("--timeout", type=float, default=240)
    args = ap.parse_args()
    rows = []
    for i in range(args.jobs):
        row = one_job(args.port + i, args.delay, args.epochs, args.timeout)
        rows.append(row)
        print(json.dumps(row), flush=True)
    ok = [r for r in rows if "loss_to_first_step_s" in r]
    summary = {"jobs": len(rows), "completed": sum(r["completed"] for r in rows),
               "exactly_once": sum(r["exactly_once"] for r in rows)}
    for key in ("steps_redone", "steps_redone_on_join", "loss_to_first_step_s", "join_to_first_step_s"):
        vals = [r[key] for r in ok if key in r]
        summary[key] = {"median": statistics.median(vals), "max": max(vals), "all": vals} if vals else None
    print(json.dumps(summary))


if __name__ == "__main__":
    main()

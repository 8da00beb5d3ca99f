"""Replica groups killed at random moments under `dtrain train --fault-tolerance` (torchft), on this
host: replica group "a" runs under the launcher that also holds the Lighthouse; replica group "b" is
started by hand (`--lighthouse`), killed with SIGKILL at a random moment (uniform over 1-4 s after it
is back in the quorum), and started again ``--restart-after`` seconds later, ``--kills`` times.

Per kill, from the --metrics-file records (`--log-every 1`: one per committed step, with `time` and
the process's `wall_s`):
- gap_s: kill -> the survivor's next committed step (its `time`);
- stall_s: the survivor's `wall_s` between its last step before the kill and its first after;
- back_s: b's restart -> b's first committed step (it healed from a's memory, over torchft's transport);
  back_in_run_s: the part of it after the process's imports (its record's wall_s: the model and
  optimizer, torchft's Manager, the quorum, the healing transfer and the step); join_s: from reaching
  the Lighthouse to that first commit (the group's own log line: the quorum, the healing, the step).
At the end: both groups' exit status, the steps each committed, the ledger's verdict (every committed
step's samples exactly once), and whether b's final model equals a's bit for bit.

    python3 benchmarks/ft_kill.py --kills 10 --json benchmarks/results/ft_kill-DATE.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "src"))
sys.path.insert(0, ROOT)  # tests.support: the harness that only tests and benchmarks use

import torch  # noqa: E402
from tests.support.procs import LaunchedJob  # noqa: E402

from dtrain.checkpoint import newest_valid, read_checkpoint  # noqa: E402
from dtrain.ft.ledger import check_ft_ledger  # noqa: E402


def records(path: str) -> list[dict]:
    out = []
    if os.path.exists(path):
        with open(path) as f:
            for line in f:
                try:
                    out.append(json.loads(line))
                except ValueError:
                    pass
    return out


MAX_STEPS = 1500
"""The job's length; kills stop when fewer than ``MARGIN`` steps are left, so the restarted group joins a running job."""
MARGIN = 400
ONE_THREAD = {"OMP_NUM_THREADS": "1"}
"""Two groups on one host, each started as its own job: one intra-op thread each, as `--nproc 2` gives them."""


def args_for(tmp: str, replica: str, spec: str, *extra: str, steps: int = MAX_STEPS) -> list[str]:
    return ["train", "--fault-tolerance", spec, "--task", "tests.user_task:make_paced",
            "--task-arg", f"pace_file={tmp}/pace", "--epochs", "1000", "--max-steps", str(steps), "--replica-id", replica,
            "--ledger", f"{tmp}/ledger", "--metrics-file", f"{tmp}/metrics.jsonl", "--log-every", "1",
            "--checkpoint-dir", f"{tmp}/ckpt", "--save-every", "200", *extra]


def join_s(stderr: str) -> float | None:
    """The returning group's own figure: seconds from reaching the Lighthouse to its first commit (healed)."""
    found = re.findall(r"([0-9.]+) s after reaching the Lighthouse", stderr)
    return float(found[-1]) if found else None


def lighthouse(job: LaunchedJob) -> str | None:
    for line in job.stderr().splitlines():
        if "--lighthouse " in line:
            return line.rsplit("--lighthouse ", 1)[1].split()[0]
    return None


def one_kill(tmp: str, b: LaunchedJob, rng: random.Random, restart_after: float, spec: str, addr: str, i: int, steps: int):
    metrics = f"{tmp}/metrics.jsonl"
    time.sleep(rng.uniform(1.0, 4.0))
    b.signal(signal.SIGKILL)
    killed = time.time()
    b.wait(timeout=30)
    before = [r for r in records(metrics) if r["replica"] == "a" and r["time"] <= killed]
    deadline = time.time() + 120
    while not any(r["replica"] == "a" and r["time"] > killed for r in records(metrics)):
        if time.time() > deadline:
            raise SystemExit(f"kill {i}: the survivor committed no step within 120 s")
        time.sleep(0.05)
    after = next(r for r in records(metrics) if r["replica"] == "a" and r["time"] > killed)
    time.sleep(max(0.0, restart_after - (time.time() - killed)))
    os.makedirs(f"{tmp}/b{i + 1}")
    nb = LaunchedJob(args_for(tmp, "b", spec, "--lighthouse", addr, steps=steps), out_dir=f"{tmp}/b{i + 1}", env=ONE_THREAD)
    restarted = time.time()
    nb.wait_for(lambda: any(r["replica"] == "b" and r["time"] > restarted for r in records(metrics)), timeout=180)
    back = next(r for r in records(metrics) if r["replica"] == "b" and r["time"] > restarted)
    row = {"kill": i, "gap_s": round(after["time"] - killed, 3),
           "stall_s": round(after["wall_s"] - before[-1]["wall_s"], 3) if before else None,
           "back_s": round(back["time"] - restarted, 3), "back_in_run_s": back["wall_s"],
           "join_s": join_s(nb.stderr()), "step_at_kill": before[-1]["step"] if before else 0,
           "healed_to_step": back["step"] - 1}
    print(json.dumps(row), flush=True)
    return nb, row


def final_models_equal(tmp: str, replicas: tuple[str, str] = ("a", "b")) -> bool:
    states = [read_checkpoint(newest_valid(f"{tmp}/ckpt/replica-{r}")[0])["objects"]["model"] for r in replicas]
    return states[0].keys() == states[1].keys() and all(torch.equal(states[0][k], states[1][k]) for k in states[0])


def run(kills: int, restart_after: float, seed: int, heartbeat: float, steps: int) -> dict:
    rng = random.Random(seed)
    spec = f"min=1,heartbeat={heartbeat:g},timeout=60"
    tmp = tempfile.mkdtemp(prefix="ft_kill-")
    with open(f"{tmp}/pace", "w") as f:
        f.write("0.004")  # 16 samples a step: ~65 ms of input per step
    os.makedirs(f"{tmp}/a")
    os.makedirs(f"{tmp}/b0")
    rows = []
    with LaunchedJob(args_for(tmp, "a", spec, steps=steps), out_dir=f"{tmp}/a", env=ONE_THREAD) as a:
        a.wait_for(lambda: lighthouse(a) is not None, timeout=120)
        addr = lighthouse(a)
        jobs = [LaunchedJob(args_for(tmp, "b", spec, "--lighthouse", addr, steps=steps), out_dir=f"{tmp}/b0", env=ONE_THREAD)]
        try:
            # Both groups in one quorum (the first one up may have started alone, min=1) before the first kill.
            jobs[-1].wait_for(lambda: {r["replica"] for r in records(f"{tmp}/metrics.jsonl")[-10:] if r["participants"] == 2}
                              == {"a", "b"}, timeout=180)
            for i in range(kills):
                if max((r["step"] for r in records(f"{tmp}/metrics.jsonl")), default=0) > steps - MARGIN:
                    break
                b, row = one_kill(tmp, jobs[-1], rng, restart_after, spec, addr, i, steps)
                jobs.append(b)
                rows.append(row)
            with open(f"{tmp}/pace", "w") as f:
                f.write("0")  # let the job finish
            rc_b = jobs[-1].wait(timeout=900)[0]
            rc_a = a.wait(timeout=900)[0]
            results = [json.loads(line) for job in (a, jobs[-1]) for line in job.stdout().splitlines() if line.startswith("{")]
        finally:
            for job in jobs:  # interrupted or done: no replica group outlives the benchmark
                job.kill_all()
    report, disagree = check_ft_ledger(f"{tmp}/ledger")
    gaps = [r["gap_s"] for r in rows]
    backs = [r["back_s"] for r in rows]
    return {
        "date": time.strftime("%Y-%m-%d"), "machine": f"{os.cpu_count()} cores, this host (localhost, no network bed)",
        "torch": torch.__version__, "torchft": __import__("torchft").__version__ if hasattr(__import__("torchft"), "__version__") else "0.2.0",
        "command": " ".join(["python3", "benchmarks/ft_kill.py", "--kills", str(kills), "--restart-after", str(restart_after),
                             "--seed", str(seed), "--heartbeat", str(heartbeat), "--steps", str(steps)]),
        "kills": len(rows), "completed": [rc_a, rc_b] == [0, 0], "exit_status": {"a": rc_a, "b": rc_b},
        "gap_s": {"median": statistics.median(gaps), "max": max(gaps)},
        "stall_s": {"median": statistics.median([r["stall_s"] for r in rows if r["stall_s"] is not None]),
                    "max": max(r["stall_s"] for r in rows if r["stall_s"] is not None)},
        "back_s": {"median": statistics.median(backs), "max": max(backs)},
        "join_s": _spread([r["join_s"] for r in rows if r["join_s"] is not None]),
        "steps": [r.get("steps") for r in results], "test_acc": [r.get("test_acc") for r in results],
        "ledger_exactly_once": report.ok and not disagree, "ledger_steps": report.steps_kept,
        "final_models_equal": final_models_equal(tmp), "rows": rows, "folder": tmp,
    }


def _spread(values: list[float]) -> dict[str, float] | None:
    return {"median": statistics.median(values), "max": max(values)} if values else None


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kills", type=int, default=10)
    p.add_argument("--restart-after", type=float, default=5.0, help="seconds from a kill to the restart (default 5)")
    p.add_argument("--heartbeat", type=float, default=1.0, help="the Lighthouse's heartbeat timeout, --fault-tolerance heartbeat=S")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=MAX_STEPS, help="the job's length (kills stop 400 steps before its end)")
    p.add_argument("--json", default=None, help="also write the summary here")
    a = p.parse_args()
    out = run(a.kills, a.restart_after, a.seed, a.heartbeat, a.steps)
    print(json.dumps({k: v for k, v in out.items() if k != "rows"}, indent=1))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0 if out["completed"] and out["ledger_exactly_once"] and out["final_models_equal"] else 1


if __name__ == "__main__":
    sys.exit(main())

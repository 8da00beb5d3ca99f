"""`dtrain train --fault-tolerance` on the network test bed: ``--hosts`` hosts (namespaces, by default
sharing one host name that resolves to loopback, as many images do), node 0 holding the Lighthouse
and replica group h0, node i replica group hi. Every process of the last host is killed (kill -9) at
a random moment (uniform over 1-4 s after it is back in the quorum) and its command started again
``--restart-after`` seconds later, ``--kills`` times; then the job runs to its end. Below, h1 is the
last host.

Per kill (as benchmarks/ft_kill.py): gap_s (kill -> h0's next committed step), stall_s (h0's wall_s
between its last step before and its first after), back_s (restart -> h1's first committed step,
after healing from h0 over the bed's network). At the end: exit statuses, steps, the ledger's
verdict, and whether h1's final model equals h0's bit for bit.

    python3 benchmarks/ft_kill_bed.py --kills 5 --json benchmarks/results/ft_kill_bed-DATE.json    # root, iproute2
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
from ft_kill import MARGIN, MAX_STEPS, final_models_equal, join_s, records  # noqa: E402
from tests.support.netbed import NetBed, unavailable_reason  # noqa: E402

from dtrain.ft.ledger import check_ft_ledger  # noqa: E402


def command(tmp: str, rank: int, master: str, spec: str, steps: int, hosts: int) -> list[str]:
    return [sys.executable, "-m", "dtrain", "train", "--fault-tolerance", spec, "--nnodes", str(hosts), "--node-rank", str(rank),
            "--master-addr", master, "--replica-id", f"h{rank}", "--task", "tests.user_task:make_paced",
            "--task-arg", f"pace_file={tmp}/pace", "--epochs", "1000", "--max-steps", str(steps),
            "--ledger", f"{tmp}/ledger", "--metrics-file", f"{tmp}/metrics.jsonl", "--log-every", "1",
            "--checkpoint-dir", f"{tmp}/ckpt", "--save-every", "200"]


def wait_for(ready, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        if time.monotonic() > deadline:
            raise SystemExit(f"not within {timeout:.0f} s: {what}")
        time.sleep(0.05)


def one_kill(bed: NetBed, tmp: str, rng: random.Random, restart_after: float, i: int) -> dict:
    metrics, victim = f"{tmp}/metrics.jsonl", bed.hosts - 1
    name = f"h{victim}"
    time.sleep(rng.uniform(1.0, 4.0))
    bed.kill_host(victim)
    killed = time.time()
    before = [r for r in records(metrics) if r["replica"] == "h0" and r["time"] <= killed]
    wait_for(lambda: any(r["replica"] == "h0" and r["time"] > killed for r in records(metrics)), 120, f"kill {i}: h0's next step")
    after = next(r for r in records(metrics) if r["replica"] == "h0" and r["time"] > killed)
    time.sleep(max(0.0, restart_after - (time.time() - killed)))
    bed.restart(victim)
    restarted = time.time()
    wait_for(lambda: any(r["replica"] == name and r["time"] > restarted for r in records(metrics)), 180, f"kill {i}: {name} back")
    back = next(r for r in records(metrics) if r["replica"] == name and r["time"] > restarted)
    row = {"kill": i, "gap_s": round(after["time"] - killed, 3),
           "stall_s": round(after["wall_s"] - before[-1]["wall_s"], 3) if before else None,
           "back_s": round(back["time"] - restarted, 3), "back_in_run_s": back["wall_s"],
           "join_s": join_s(open(f"{tmp}/{name}.txt").read()), "step_at_kill": before[-1]["step"] if before else 0,
           "healed_to_step": back["step"] - 1}
    print(json.dumps(row), flush=True)
    return row


def run(kills: int, restart_after: float, seed: int, heartbeat: float, shared_name: str | None, steps: int, hosts: int) -> dict:
    rng = random.Random(seed)
    spec = f"min=1,heartbeat={heartbeat:g},timeout=60"
    tmp = tempfile.mkdtemp(prefix="ft_kill_bed-")
    with open(f"{tmp}/pace", "w") as f:
        f.write("0.004")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.join(ROOT, "src"), ROOT])}
    rows = []
    names = {f"h{r}" for r in range(hosts)}
    outs = [open(f"{tmp}/h{r}.txt", "w") for r in range(hosts)]
    with NetBed(hosts=hosts, shared_name=shared_name) as bed:
        procs = [bed.popen(r, command(tmp, r, bed.addresses[0], spec, steps, hosts), env=env, stdout=outs[r]) for r in range(hosts)]
        # Every group in one quorum (the first one up may have started alone, min=1) before the first kill.
        wait_for(lambda: {r["replica"] for r in records(f"{tmp}/metrics.jsonl")[-5 * hosts:] if r["participants"] == hosts} == names,
                 300, "every group in the quorum")
        for i in range(kills):
            if max((r["step"] for r in records(f"{tmp}/metrics.jsonl")), default=0) > steps - MARGIN:
                break
            rows.append(one_kill(bed, tmp, rng, restart_after, i))
        with open(f"{tmp}/pace", "w") as f:
            f.write("0")
        codes = [p.wait(timeout=900) for p in procs[:-1]] + [bed._procs[-1].wait(timeout=900)]  # the victim's last start
    for f in outs:
        f.close()
    results = []
    for r in range(hosts):
        with open(f"{tmp}/h{r}.txt") as f:
            results += [json.loads(line) for line in f if line.startswith("{")]
    report, disagree = check_ft_ledger(f"{tmp}/ledger")
    gaps, backs = [r["gap_s"] for r in rows], [r["back_s"] for r in rows]
    stalls = [r["stall_s"] for r in rows if r["stall_s"] is not None]
    return {
        "date": time.strftime("%Y-%m-%d"), "machine": f"{os.cpu_count()} cores; NetBed {hosts} hosts, shared host name {shared_name!r}",
        "torch": torch.__version__, "command": " ".join(["python3", "benchmarks/ft_kill_bed.py", *sys.argv[1:]]),
        "kills": len(rows), "exit_status": codes, "completed": all(c == 0 for c in codes),
        "gap_s": {"median": statistics.median(gaps), "max": max(gaps)} if gaps else None,
        "stall_s": {"median": statistics.median(stalls), "max": max(stalls)} if stalls else None,
        "back_s": {"median": statistics.median(backs), "max": max(backs)} if backs else None,
        "join_s": _spread([r["join_s"] for r in rows if r["join_s"] is not None]),
        "results": [{k: r.get(k) for k in ("replica", "steps", "test_acc", "fault_tolerance")} for r in results],
        "ledger_exactly_once": report.ok and not disagree, "ledger_steps": report.steps_kept,
        "final_models_equal": final_models_equal(tmp, ("h0", f"h{hosts - 1}")), "rows": rows, "folder": tmp,
    }


def _spread(values: list[float]) -> dict[str, float] | None:
    return {"median": statistics.median(values), "max": max(values)} if values else None


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kills", type=int, default=5)
    p.add_argument("--hosts", type=int, default=2, help="hosts of the bed; the last one is killed and restarted")
    p.add_argument("--restart-after", type=float, default=5.0)
    p.add_argument("--heartbeat", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=MAX_STEPS, help="the job's length (kills stop 400 steps before its end)")
    p.add_argument("--shared-name", default="vm", help="the host name both hosts share ('' for names of their own)")
    p.add_argument("--json", default=None)
    a = p.parse_args()
    reason = unavailable_reason()
    if reason:
        print(f"the network test bed is unavailable here: {reason}")
        return 2
    out = run(a.kills, a.restart_after, a.seed, a.heartbeat, a.shared_name or None, a.steps, a.hosts)
    print(json.dumps({k: v for k, v in out.items() if k != "rows"}, indent=1))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0 if out["completed"] and out["ledger_exactly_once"] and out["final_models_equal"] else 1


if __name__ == "__main__":
    sys.exit(main())

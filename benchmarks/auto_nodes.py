"""`dtrain train --parallel auto --nnodes 2` on two hosts of the network test bed (needs root): node 0
plans for the whole world and posts its pick in the rendezvous store, node 1 takes it, and both
train it. Each run checks what the multi-process test checks on 127.0.0.1
(tests/multiprocess/launch/test_autopick.py): node 1 names node 0's pick and plans nothing itself,
the job ends 0 on both nodes, rank 0's result names the pick, node 1's rank commits every step in
the ledger; and reports the seconds: the plan on node 0, node 1's wait for the pick, the whole run.
A bed run takes over a minute on 2 cores, more than a test may (docs/testing.md).

    python3 benchmarks/auto_nodes.py                      # hosts with their own names, and sharing "vm"
    python3 benchmarks/auto_nodes.py --cases own --steps 20
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT))  # tests.support: the harness that only tests and benchmarks use

PICKED = "dtrain: --parallel auto: the plan picked "
TOOK = "dtrain: --parallel auto: node 0's pick for "


def _train(rank: int, master: str, port: int, steps: int, ledger: str, task: str) -> list[str]:
    return [sys.executable, "-m", "dtrain", "train", "--task", task, "--parallel", "auto", "--nnodes", "2", "-n", "1",
            "--node-rank", str(rank), "--master-addr", master, "--master-port", str(port), "--max-steps", str(steps),
            "--log-every", str(max(1, steps // 2)), "--ledger", ledger, "--startup-timeout", "180"]


def _stamped(proc: subprocess.Popen, start: float) -> list[tuple[float, str]]:
    """The lines of ``proc``'s stderr with the second each arrived (after ``start``)."""
    return [(time.monotonic() - start, line.rstrip("\n")) for line in proc.stderr]


def one(shared_name: str | None, steps: int, task: str, port: int) -> dict:
    import threading

    from tests.support.netbed import NetBed

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)])}
    with tempfile.TemporaryDirectory() as tmp, NetBed(hosts=2, shared_name=shared_name) as bed:
        ledger = os.path.join(tmp, "ledger")
        start = time.monotonic()
        procs = [bed.popen(r, _train(r, bed.addresses[0], port, steps, ledger, task), stderr=subprocess.PIPE, env=env, cwd=tmp)
                 for r in (0, 1)]
        errs: list[list[tuple[float, str]]] = [[], []]
        readers = [threading.Thread(target=lambda r=r: errs[r].extend(_stamped(procs[r], start))) for r in (0, 1)]
        for t in readers:
            t.start()
        out0 = procs[0].stdout.read()
        codes = [p.wait(timeout=600) for p in procs]
        wall = time.monotonic() - start
        for t in readers:
            t.join()
        rank1 = Path(ledger, "gen00001-rank00001.jsonl").read_text().splitlines() if os.path.exists(ledger) else []
    picked = next(((s, x.removeprefix(PICKED).split(" (")[0]) for s, x in errs[0] if x.startswith(PICKED)), (None, None))
    took = next(((s, x) for s, x in errs[1] if x.startswith(TOOK)), (None, ""))
    result = next((json.loads(x) for x in reversed(out0.splitlines()) if x.startswith("{")), {})
    steps1 = [json.loads(x)["s"] for x in rank1[1:]]
    ok = (codes == [0, 0] and picked[1] is not None and took[1].endswith(f": {picked[1]}; node 1 trains it.")
          and not any(x.startswith(PICKED) for _, x in errs[1]) and result.get("strategy") == picked[1]
          and steps1 == list(range(1, steps + 1)))
    return {"case": shared_name or "own names", "ok": ok, "codes": codes, "pick": picked[1], "trained": result.get("strategy"),
            "world_size": result.get("world_size"), "node1_line": took[1], "rank1_steps": len(steps1),
            "plan_s": round(picked[0], 1) if picked[0] else None, "node1_has_pick_s": round(took[0], 1) if took[0] else None,
            "wall_s": round(wall, 1), "samples_per_s": result.get("samples_per_s"),
            "tail": "" if ok else "\n".join(x for _, x in (errs[0] + errs[1])[-12:])}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", default="own,vm", help="own (each host its own name) and/or a shared host name (e.g. vm)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--task", default="digits")
    p.add_argument("--port", type=int, default=29741)
    args = p.parse_args()
    rows = [one(None if case == "own" else case, args.steps, args.task, args.port) for case in args.cases.split(",")]
    for row in rows:
        print(json.dumps(row), flush=True)
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())

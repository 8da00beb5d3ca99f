"""The survivors' stall when a replica group dies after the Lighthouse put it in a quorum (issue 55's
30.5 s stall on 3 hosts), on this host: ``--groups - 1`` live groups (h0 starts the Lighthouse) train
``tests.user_task:make_paced``; a group ``c`` started ``--tries`` times under
tests/scripts/ft_dies_in_quorum.py kills itself (-9) once it is in a quorum, before it reaches the
quorum's store. Per try: ``gap_s``, from its death to h0's next committed step (--metrics-file
``time``), and ``outage_s``, h0's longest wait between two commits around it.

    measure python3 benchmarks/ft_stall.py --tries 5 --json FILE                  # this checkout
    measure python3 benchmarks/ft_stall.py --tries 5 --src /tmp/base/src         # the old code
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

from tests.support.procs import LaunchedJob  # noqa: E402

DIES = os.path.join(ROOT, "tests", "scripts", "ft_dies_in_quorum.py")


def _records(path: str, replica: str) -> list[dict]:
    rows = []
    if os.path.exists(path):
        for line in open(path):
            try:
                row = json.loads(line)
            except ValueError:
                continue  # a line being written
            if row.get("replica") == replica:
                rows.append(row)
    return rows


def _args(tmp: str, replica: str, spec: str, *extra: str) -> list[str]:
    return ["train", "--fault-tolerance", spec, "--task", "tests.user_task:make_paced", "--task-arg", f"pace_file={tmp}/pace",
            "--epochs", "1000", "--replica-id", replica, "--metrics-file", f"{tmp}/m.jsonl", "--log-every", "1", *extra]


def one_try(i: int, tmp: str, spec: str, lighthouse: str, src: str | None, h0: LaunchedJob) -> dict:
    """Start c, wait for its death, then for h0's next commits; the figures of this try, and why
    h0's step in between was not committed (its warning line)."""
    seen = len(h0.stderr())
    out = os.path.join(tmp, f"c{i}")
    os.makedirs(out)
    with LaunchedJob(_args(tmp, "c", spec, "--lighthouse", lighthouse), out_dir=out, src=src, cwd=ROOT,
                     prefix=[sys.executable, DIES]) as c:
        code = c.proc.wait(timeout=180)
        died = time.time()
        err = c.stderr()
    if "in a quorum" not in err:
        return {"try": i, "error": f"c ended with {code} before it was in a quorum: {err.strip().splitlines()[-1:]}"}
    deadline = time.time() + 120
    while time.time() < deadline and sum(r["time"] > died for r in _records(f"{tmp}/m.jsonl", "h0")) < 3:
        time.sleep(0.1)
    times = [r["time"] for r in _records(f"{tmp}/m.jsonl", "h0")]
    after = [t for t in times if t > died]
    around = [t for t in times if died - 30 < t]
    why = [line.split("not committed ", 1)[1][:200] for line in h0.stderr()[seen:].splitlines() if "not committed" in line]
    row = {"try": i, "died": round(died, 3), "c_exit": code, "load": round(os.getloadavg()[0], 1), "h0_not_committed": why}
    if not after:
        return {**row, "error": "h0 committed no step within 120 s of c's death"}
    return {**row, "gap_s": round(after[0] - died, 3),
            "outage_s": round(max(b - a for a, b in zip(around, around[1:])), 3) if len(around) > 1 else None}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tries", type=int, default=5)
    p.add_argument("--groups", type=int, default=3, help="live groups + the dying one (default 3: h0, h1, c)")
    p.add_argument("--spec", default="min=1,heartbeat=1,timeout=60", help="--fault-tolerance's settings (the bed's)")
    p.add_argument("--src", default=None, help="the src/ folder dtrain is imported from (default this checkout's)")
    p.add_argument("--json", default=None)
    a = p.parse_args()
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="ft_stall-") as tmp:
        with open(f"{tmp}/pace", "w") as f:
            f.write("0.002")  # a step every ~0.1 s, as on the bed
        live, lighthouse = [], ""
        try:
            for k in range(a.groups - 1):
                extra = () if k == 0 else ("--lighthouse", lighthouse)
                os.makedirs(f"{tmp}/h{k}")
                live.append(LaunchedJob(_args(tmp, f"h{k}", a.spec, *extra), out_dir=f"{tmp}/h{k}", src=a.src, cwd=ROOT))
                if k == 0:
                    live[0].wait_for(lambda: "--lighthouse " in live[0].stderr(), timeout=180)
                    lighthouse = live[0].stderr().split("--lighthouse ", 1)[1].split()[0]
            live[0].wait_for(lambda: len({r["participants"] for r in _records(f"{tmp}/m.jsonl", "h0")[-3:]} - {a.groups - 1}) == 0
                             and len(_records(f"{tmp}/m.jsonl", "h0")) >= 5, timeout=240)
            for i in range(a.tries):
                rows.append(one_try(i, tmp, a.spec, lighthouse, a.src, live[0]))
                print(json.dumps(rows[-1]), flush=True)
                time.sleep(3)  # the dead member's heartbeat long expired before the next try
        finally:
            for job in live:
                job.kill_all()
    gaps = [r["gap_s"] for r in rows if "gap_s" in r]
    summary = {"tries": len(rows), "measured": len(gaps), "gap_s_median": round(statistics.median(gaps), 3) if gaps else None,
               "gap_s_max": max(gaps) if gaps else None, "outage_s_max": max((r["outage_s"] or 0) for r in rows if "gap_s" in r) if gaps else None}
    print(json.dumps(summary))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": f"{os.cpu_count()} cores, this host",
                       "command": " ".join(["python3", "benchmarks/ft_stall.py", *sys.argv[1:]]), "src": a.src or "checkout",
                       "tries": rows, "summary": summary}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

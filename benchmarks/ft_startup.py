"""Where a returning replica group's seconds go, from its (re)start to its first committed step, on
this host: a job of two replica groups (h0 starts the Lighthouse and runs throughout; h1 is started
``--restarts`` times, each time killed -9 after its first commit), the task and settings of
benchmarks/ft_kill_bed.py (``tests.user_task:make_paced``, ``--pad-mb``).

h1 runs `dtrain train --fault-tolerance` (its own command, as the bed's host restarts it) under a
thin wrapper (``--child``) that stamps the phases with time.time(): the interpreter up, ``import
torch``, ``import torchft``, dtrain's modules, the task built (``load_task``), the Context
(``init``), the model and its optimizer (torch's first optimizer imports torch._dynamo), torchft's
Manager up and connected to the Lighthouse (``Session``), the first quorum
back (healing included), and the first committed step (its --metrics-file record). The wrapper
imports in that order, so each import's figure is what it adds to the ones before.

    flock /tmp/dtrain-bench.lock nice -n 5 python3 benchmarks/ft_startup.py --restarts 5 --json FILE
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
PHASES = ("python", "torch", "torchft", "dtrain", "task", "init", "optimizer", "manager", "quorum", "commit")


def child(stamps: str, argv: list[str]) -> int:
    """h1's process: dtrain's CLI, its phases stamped into ``stamps`` (one ``name time`` a line)."""
    out = open(stamps, "a", buffering=1)

    def stamp(name: str) -> None:
        out.write(f"{name} {time.time():.4f}\n")

    stamp("python")
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")  # as dtrain's __main__, before torch loads
    import torch  # noqa: F401

    stamp("torch")
    import torchft  # noqa: F401

    stamp("torchft")
    from dtrain import cli
    from dtrain.ft import session
    from dtrain.train import ft_replica

    stamp("dtrain")

    def after(owner: object, name: str, label: str, once: bool = True) -> None:
        real, done = getattr(owner, name), []

        def wrapped(*args, **kwargs):
            result = real(*args, **kwargs)
            if not (once and done):
                done.append(1)
                stamp(label)
            return result

        setattr(owner, name, wrapped)

    after(ft_replica, "load_task", "task")
    after(ft_replica, "init", "init")
    after(ft_replica, "make_optimizer", "optimizer")  # its first one imports torch._dynamo
    after(ft_replica, "Session", "manager")
    after(session.Session, "quorum", "quorum")
    return cli.main(argv)


def _lighthouse(log: str, deadline: float) -> str:
    while time.time() < deadline:
        found = re.findall(r"--lighthouse (\S+)", open(log).read()) if os.path.exists(log) else []
        if found:
            return found[0]
        time.sleep(0.2)
    raise SystemExit(f"h0 printed no Lighthouse address in {log}")


def _first_record(metrics: str, replica: str, after: float, deadline: float) -> dict | None:
    while time.time() < deadline:
        if os.path.exists(metrics):
            for line in open(metrics):
                row = json.loads(line)
                if row.get("replica") == replica and row["time"] > after:
                    return row
        time.sleep(0.05)
    return None


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--restarts", type=int, default=5)
    p.add_argument("--pad-mb", type=float, default=24)
    p.add_argument("--spec", default="min=1,heartbeat=1,timeout=60")
    p.add_argument("--json", default=None)
    p.add_argument("--child", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        return child(a.child[0], a.child[1:])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.join(ROOT, "src"), ROOT])}
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        task = ["--task", "tests.user_task:make_paced", "--task-arg", f"pace_file={tmp}/pace", "--task-arg", f"pad_mb={a.pad_mb:g}",
                "--epochs", "1000", "--metrics-file", f"{tmp}/m.jsonl", "--log-every", "1"]
        with open(f"{tmp}/pace", "w") as f:
            f.write("0.002")  # h0 steps every ~0.1 s (batch 32 x 2 ms... of pace, as on the bed)
        h0 = subprocess.Popen([sys.executable, "-m", "dtrain", "train", "--fault-tolerance", a.spec, "--replica-id", "h0", *task],
                              env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=open(f"{tmp}/h0.txt", "w"))
        try:
            lighthouse = _lighthouse(f"{tmp}/h0.txt", time.time() + 120)
            if _first_record(f"{tmp}/m.jsonl", "h0", 0, time.time() + 180) is None:
                raise SystemExit("h0 did not commit a step within 180 s")
            for i in range(a.restarts):
                rows.append(one(i, tmp, lighthouse, a.spec, task, env))
                print(json.dumps(rows[-1]), flush=True)
                time.sleep(2)
        finally:
            h0.send_signal(signal.SIGKILL)
            h0.wait()
    out = {"date": time.strftime("%Y-%m-%d"), "machine": f"{os.cpu_count()} cores, this host",
           "command": " ".join(["python3", "benchmarks/ft_startup.py", *sys.argv[1:]]), "restarts": rows,
           "median_s": {k: round(statistics.median(r[k] for r in rows if k in r), 3) for k in (*PHASES[1:], "total")}}
    print(json.dumps(out["median_s"]))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


def one(i: int, tmp: str, lighthouse: str, spec: str, task: list[str], env: dict) -> dict:
    """Start h1 once, to its first commit (then kill it -9): the seconds each phase took."""
    stamps = f"{tmp}/stamps{i}"
    load = round(os.getloadavg()[0], 2)
    started = time.time()
    h1 = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--child", stamps, "train", "--fault-tolerance", spec,
                           "--lighthouse", lighthouse, "--replica-id", "h1", *task],
                          env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=open(f"{tmp}/h1-{i}.txt", "w"))
    first = _first_record(f"{tmp}/m.jsonl", "h1", started, started + 300)
    h1.send_signal(signal.SIGKILL)
    h1.wait()
    if first is None:
        return {"restart": i, "load1": load, "error": "no commit within 300 s"}
    t = {"start": started, **{k: float(v) for k, v in (line.split() for line in open(stamps))}, "commit": first["time"]}
    row = {"restart": i, "load1": load}
    prev = "start"
    for name in PHASES:
        if name in t:
            row[name] = round(t[name] - t[prev], 3)
            prev = name
    row["total"] = round(first["time"] - started, 3)
    return row


if __name__ == "__main__":
    sys.exit(main())

"""What is left when the launcher goes: R times, start a 2-process job, wait until both ranks
train, then SIGKILL the launcher and count the job's processes still alive 5 s later (goal 0);
and time SIGTERM -> launcher exit and SIGINT -> launcher exit (medians).

Jobs: `dtrain run -n 2 tests/scripts/allreduce_forever.py` ("run") and `dtrain train -n 2
--task synthetic` with a checkpoint folder ("train"), each on both launchers.

    python benchmarks/launcher_kill.py --rounds 10
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import platform
import signal
import statistics
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "src"))
sys.path.insert(0, ROOT)  # tests.support: the harness that only tests and benchmarks use

from tests.support.procs import LaunchedJob  # noqa: E402

SCRIPT = os.path.join(ROOT, "tests", "scripts", "allreduce_forever.py")


def job_args(kind: str, launcher: str, work: str) -> tuple[list[str], callable]:
    if kind == "run":
        ready = lambda: len(glob.glob(os.path.join(work, "ready-*"))) == 2  # noqa: E731
        return ["run", "-n", "2", "--launcher", launcher, SCRIPT], ready
    metrics = os.path.join(work, "metrics.jsonl")
    ready = lambda: os.path.exists(metrics) and os.path.getsize(metrics) > 0  # noqa: E731
    return ["train", "-n", "2", "--launcher", launcher, "--task", "synthetic", "--task-arg", "samples=100000",
            "--task-arg", "hidden=64", "--epochs", "100", "--log-every", "5", "--metrics-file", metrics,
            "--checkpoint-dir", os.path.join(work, "ckpt")], ready


def one(kind: str, launcher: str, sig: int, src: str | None) -> dict:
    with tempfile.TemporaryDirectory(prefix="dtrain-kill-bench-") as work:
        args, ready = job_args(kind, launcher, work)
        with LaunchedJob(args, out_dir=work, env={"READY_DIR": work}, src=src) as job:
            job.wait_for(ready, timeout=180)
            job.signal(sig)
            try:
                rc, exit_s = job.wait(timeout=120)
            except Exception:
                rc, exit_s = None, None
            alive = job.survivors(after_s=5)
            saved = sorted(os.path.basename(p) for p in glob.glob(os.path.join(work, "ckpt", "step-*")))
            err = job.stderr().strip().splitlines()
            return {"kind": kind, "launcher": launcher, "signal": signal.Signals(sig).name, "rc": rc,
                    "exit_s": round(exit_s, 3) if exit_s is not None else None, "processes": len(job.seen),
                    "alive_after_5s": len(alive), "checkpoints": saved, "stderr_lines": len(err),
                    "stderr_last": err[-1] if err else "", "traceback": "Traceback" in job.stderr() or "frame #" in job.stderr()}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--kinds", default="run,train")
    p.add_argument("--launchers", default="torchrun,spawn")
    p.add_argument("--signals", default="KILL,TERM,INT")
    p.add_argument("--out", default=None, help="append one JSON line per run here")
    p.add_argument("--alternate", action="store_true", help="one launcher per round, in turn (instead of each launcher every round)")
    p.add_argument("--src", default=None, help="import dtrain from this src folder (e.g. an older checkout's, for a baseline)")
    args = p.parse_args()
    # `timeout`/a scheduler ends this with SIGTERM: unwind, so every job's processes are killed.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    rows = []
    for r in range(args.rounds):
        for kind in args.kinds.split(","):
            launchers = args.launchers.split(",")
            for launcher in [launchers[r % len(launchers)]] if args.alternate else launchers:
                for name in args.signals.split(","):
                    row = one(kind, launcher, getattr(signal, f"SIG{name}"), args.src)
                    row["round"] = r
                    rows.append(row)
                    print(json.dumps(row), flush=True)
                    if args.out:
                        with open(args.out, "a") as f:
                            f.write(json.dumps(row) + "\n")
    print(f"\n{platform.node()} {os.cpu_count()} CPUs, python {platform.python_version()}, load average {os.getloadavg()[0]:.1f}, src {args.src or 'this checkout'}")
    print("| job | launcher | signal | runs | orphans after 5 s (total) | exit s (median) | exit s (max) | rc | stderr tracebacks |")
    print("|---|---|---|---|---|---|---|---|---|")
    keys = sorted({(x["kind"], x["launcher"], x["signal"]) for x in rows}, key=lambda k: (k[0], k[1], "KILL TERM INT".index(k[2][3:])))
    for kind, launcher, sig in keys:
        sel = [x for x in rows if (x["kind"], x["launcher"], x["signal"]) == (kind, launcher, sig)]
        times = [x["exit_s"] for x in sel if x["exit_s"] is not None]
        rcs = sorted({x["rc"] for x in sel}, key=str)
        med = f"{statistics.median(times):.2f} | {max(times):.2f}" if times else "no exit within 120 s | -"
        print(f"| {kind} | {launcher} | {sig} | {len(sel)} | {sum(x['alive_after_5s'] for x in sel)} | "
              f"{med} | {','.join(map(str, rcs))} | {sum(x['traceback'] for x in sel)} |")


if __name__ == "__main__":
    main()

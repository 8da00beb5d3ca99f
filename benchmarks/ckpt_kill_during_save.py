"""kill -9 during checkpoint saves and retention deletes, N times: does every checkpoint folder
that looks complete verify, and does `--resume` always work?

Each trial starts `dtrain train --task digits --save-every 1 --keep 2` (a save, and from the
third on a retention delete, after every step) in a fresh folder and SIGKILLs it at a moment
chosen at random within one of five kinds, in turn:

    random         any moment after the first checkpoint exists (a timer in this process)
    mid-write      the N-th save, right after state.pt is written into its .tmp- folder
    fsync          the N-th directory fsync of the store (after a manifest, a rename or `latest`)
    before-latest  the N-th save, renamed into place but before `latest` points at it
    mid-delete     the N-th retention delete, half of the folder's files removed

The kinds other than `random` kill the process from inside dtrain's own functions (patched in
the child only, by this script), so the kill lands exactly there. Then every step-* folder must
pass `verify` (what `dtrain ckpt verify DIR` runs, called in this process), and `dtrain train
--resume` must resume (exit 0, "resumed from") and leave no dot-leftovers behind.

    flock /tmp/dtrain-bench.lock nice -n 5 python benchmarks/ckpt_kill_during_save.py --trials 20
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
SRC = os.path.join(os.path.dirname(HERE), "src")
KINDS = ("random", "mid-write", "fsync", "before-latest", "mid-delete")


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def child(kind: str, n: int, argv: list[str]) -> int:
    """Run `dtrain ARGV` with a kill planted at the n-th call of the chosen point."""
    import dtrain.checkpoint.manager as manager
    import dtrain.checkpoint.store as store
    from dtrain.cli import main

    calls = {"n": 0}

    def nth() -> bool:
        calls["n"] += 1
        return calls["n"] == n

    if kind == "mid-write":
        write = store._write_file
        store._write_file = lambda path, payload: (write(path, payload), nth() and _die())[0]
    elif kind == "fsync":
        fsync = store._fsync_dir
        store._fsync_dir = lambda folder: (fsync(folder), nth() and _die())[0]
    elif kind == "before-latest":
        set_latest = manager.set_latest
        manager.set_latest = lambda folder, path: (nth() and _die(), set_latest(folder, path))[1]
    elif kind == "mid-delete":
        class HalfDeleting:
            def __getattr__(self, name):
                return getattr(shutil, name)

            def rmtree(self, path, ignore_errors=False):
                if os.path.basename(path).startswith(".deleting-") and nth():
                    files = sorted(os.path.join(r, f) for r, _, fs in os.walk(path) for f in fs)
                    for f in files[: max(1, len(files) // 2)]:
                        os.unlink(f)
                    _die()
                return shutil.rmtree(path, ignore_errors=ignore_errors)

        store.shutil = HalfDeleting()
    return main(argv)


def _dtrain(args: list[str], timeout: float = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": SRC}
    return subprocess.run([sys.executable, "-m", "dtrain", *args], capture_output=True, text=True, timeout=timeout,
                          env=env, stdin=subprocess.DEVNULL)


def trial(i: int, kind: str, rng: random.Random, steps: int) -> dict:
    folder = tempfile.mkdtemp(prefix=f"dtrain-kill-{i}-")
    ck = os.path.join(folder, "ck")
    train = ["train", "--task", "digits", "--checkpoint-dir", ck, "--save-every", "1", "--keep", "2", "--log-every", "5"]
    n = rng.randrange(2, steps - 2)
    env = {**os.environ, "PYTHONPATH": SRC}
    cmd = [sys.executable, os.path.abspath(__file__), "--child", kind, str(n), "--", *train, "--max-steps", str(steps)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    delay = None
    if kind == "random":
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None:
            if os.path.isdir(ck) and any(p.startswith("step-") for p in os.listdir(ck)):
                break
            time.sleep(0.005)
        delay = rng.uniform(0.0, 1.5)
        time.sleep(delay)
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
    try:
        _, err = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate()
    killed = proc.returncode == -signal.SIGKILL
    left = sorted(os.listdir(ck)) if os.path.isdir(ck) else []
    from dtrain.checkpoint import list_checkpoints, verify  # what `dtrain ckpt verify DIR` runs, in this process

    bad = [f"{p}: {v.problem}" for _, p in list_checkpoints(ck) for v in [verify(p)] if not v.ok]
    resume = _dtrain([*train, "--max-steps", str(steps + 2), "--resume"])
    resumed = next((line for line in resume.stderr.splitlines() if "resumed from" in line), "")
    after = sorted(p for p in os.listdir(ck) if p.startswith(".")) if os.path.isdir(ck) else []
    row = {
        "trial": i, "kind": kind, "n": n, "delay_s": round(delay, 3) if delay is not None else None,
        "killed": killed, "left": left, "step_folders": len(list_checkpoints(ck)), "invalid_step_folders": len(bad),
        "verify_fail": bad[:2], "resume_rc": resume.returncode, "resumed": resumed.split("resumed from ")[-1] if resumed else None,
        "stale_lock_warning": "no longer running; taking it over" in resume.stderr, "leftovers_after_resume": after,
        "resume_err": resume.stderr.strip().splitlines()[-1:] if resume.returncode else [],
        "kill_err": err.strip().splitlines()[-1:] if not killed else [],
    }
    shutil.rmtree(folder, ignore_errors=True)
    return row


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        sys.exit(child(sys.argv[2], int(sys.argv[3]), sys.argv[5:]))
    sys.path.insert(0, SRC)
    p = argparse.ArgumentParser()
    p.add_argument("--trials", type=int, default=20)
    p.add_argument("--steps", type=int, default=24, help="--max-steps of each killed run (one save per step)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="write the rows here (JSON lines)")
    args = p.parse_args()
    rng = random.Random(args.seed)
    rows = []
    for i in range(args.trials):
        row = trial(i, KINDS[i % len(KINDS)], rng, args.steps)
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.out:
        with open(args.out, "w") as fh:
            fh.writelines(json.dumps(r) + "\n" for r in rows)
    ok = sum(r["resume_rc"] == 0 and r["resumed"] is not None for r in rows)
    print("\n| kind | trials | killed | step-* folders failing verify | resumed | stale lock taken over | dot-leftovers after resume |")
    print("|---|---|---|---|---|---|---|")
    for kind in KINDS:
        rs = [r for r in rows if r["kind"] == kind]
        if rs:
            print(f"| {kind} | {len(rs)} | {sum(r['killed'] for r in rs)} | {sum(r['invalid_step_folders'] for r in rs)} | "
                  f"{sum(r['resume_rc'] == 0 and r['resumed'] is not None for r in rs)} | {sum(r['stale_lock_warning'] for r in rs)} | "
                  f"{sum(bool(r['leftovers_after_resume']) for r in rs)} |")
    print(f"| **all** | {len(rows)} | {sum(r['killed'] for r in rows)} | {sum(r['invalid_step_folders'] for r in rows)} | {ok} | "
          f"{sum(r['stale_lock_warning'] for r in rows)} | {sum(bool(r['leftovers_after_resume']) for r in rows)} |")


if __name__ == "__main__":
    main()

"""--batch-split speed against even on ranks of unequal CPU speed (issue 54, item 1).

Two modes. Without ``--hosts`` (the first passes): 2 ranks, each its own `dtrain train` process
(torchrun's environment, set here), pinned to its own core (taskset), with one torch thread; the
slow rank's process is put in a cgroup v1 cpu controller group with a CFS quota (``--quota 50``:
50 ms of CPU per 100 ms period, half a core). Each round runs even and speed on both sides (rank 1
slowed, then rank 0; ``--sides``), the order of even and speed alternating, and with ``--alone``
each rank's own rate with one process on its core at the same per-rank batch (the sum of the two
is what a perfect split would reach).

With ``--hosts N``: N hosts of the namespace bed (``tests.support.netbed``), one `dtrain train
--nnodes N` node of one rank on each, host ``h`` pinned to core ``--cores[h]`` with the CPU quota
``--quotas[h]`` (percent of one core; its launcher and worker are in the host's cgroup). The bed
machine has 2 cores, so 3 hosts at 100/70/40% are scaled to 60/42/24% of a core, host 0 alone on
core 0 and hosts 1 and 2 sharing core 1 (66% of it). ``--names own,vm`` runs each round with the
hosts' own names and again with every host named ``vm`` (the shared-host-name case). ``--alone``
runs each host's rank alone (one process, its core and quota). ``--modes`` takes fixed splits too
(``24:16:8``), and ``--bucket-mb`` sets DDP's bucket size in the bed's runs (benchmark-only:
``batch_split_site/sitecustomize.py``), to see how much of the all-reduce a smaller last bucket hides.
``--change STEP:HOST:PERCENT`` sets a host's quota when rank 0's log reaches STEP (a rank slowed
mid-run); ``--ledger`` records the samples ledger and checks it with `dtrain ckpt ledger` (exactly once).

The figure is the run's steady samples/s (after ``--warmup-steps``, which covers the split's
measurement); ``--epochs`` trains whole epochs instead of ``--steps`` and the row keeps the test
loss (``--seeds 0,1,2``: one round per seed). Medians over rounds; every run is one JSON line in
``--out``, with the load average before and after it (the machine is shared), and each rank's
median step breakdown over the run (``breakdown_ms``).

    python benchmarks/batch_split.py --task lm --rounds 3 --out benchmarks/results/batch_split-DATE.jsonl
    python benchmarks/batch_split.py --task lm --hosts 3 --quotas 60,42,24 --cores 0,1,1 --names own,vm --alone
    python benchmarks/batch_split.py --task lm --hosts 3 --modes speed --steps 220 --change 60:0:24 --ledger
    python benchmarks/batch_split.py --task lm --epochs 1 --seeds 0,1,2 --sides 1 --task-arg max_bytes=200000

Needs root (the cgroup, the bed); Linux with cgroup v1's cpu controller at /sys/fs/cgroup/cpu.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shlex
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # tests.support: the bed, which only tests and benchmarks use
CPU_CGROUP = Path("/sys/fs/cgroup/cpu")
TASKS = {
    "lm": ["--task", "lm", "--task-arg", "layers=2", "--task-arg", "width=128", "--task-arg", "heads=4",
           "--task-arg", "context=64", "--batch-size", "16"],
    "images": ["--task", "images", "--task-arg", "source=synthetic", "--task-arg", "size=32", "--batch-size", "16"],
}
STEP_LINE = re.compile(r"\bstep (\d+)/\d+")


class Quota:
    """A cgroup v1 cpu group with a CFS quota (percent of one core); removed on exit."""

    def __init__(self, percent: int, tag: str = "", shares: int = 1024, period_ms: int = 100) -> None:
        self.path = CPU_CGROUP / f"dtrain-bench-{os.getpid()}{tag}"
        self.path.mkdir(exist_ok=True)
        # A quota is a budget per period: a rank that waits in the all-reduce saves it and then
        # computes at the core's full speed until it is spent. With 100 ms periods and ~200 ms
        # steps a rank given fewer samples ran faster per sample; a short period slows it evenly.
        self.period_us = period_ms * 1000
        (self.path / "cpu.cfs_period_us").write_text(str(self.period_us))
        # The group's weight against the machine's other processes (1024 each): at a load of 10-30 a
        # group of weight 1024 got ~20% of a core, below a 60% or 42% quota, which then never bound.
        (self.path / "cpu.shares").write_text(str(shares))
        self.set(percent)

    def set(self, percent: int) -> None:
        (self.path / "cpu.cfs_quota_us").write_text(str(percent * self.period_us // 100))

    def add(self, pid: int) -> None:
        (self.path / "cgroup.procs").write_text(str(pid))

    def close(self) -> None:
        for pid in (self.path / "cgroup.procs").read_text().split():
            try:
                (CPU_CGROUP / "cgroup.procs").write_text(pid)
            except OSError:
                pass
        self.path.rmdir()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _train_args(args: argparse.Namespace, *, world: int, split: str, seed: int) -> list[str]:
    length = (["--epochs", str(args.epochs)] if args.epochs else []) + (["--max-steps", str(args.steps)] if args.steps else [])
    extra = [x for kv in args.task_arg for x in ("--task-arg", kv)]
    extra += ["--batch-size", str(args.batch_size)] if args.batch_size else []  # the last --batch-size wins
    extra += shlex.split(args.train_args)  # e.g. --comm bf16, --grad-accum 4: what a user would try on a slow link
    out = ["-m", "dtrain", "train", *TASKS[args.task], *extra, *length, "--warmup-steps", str(args.warmup), "--log-every",
           str(args.log_every or args.steps or 1000), "--num-workers", "0", "--seed", str(seed)]
    # A fixed split is written 24:16:8 in --modes (commas separate the modes there).
    return out + (["--batch-split", split.replace(":", ",")] if world > 1 else [])


def _record(result: dict, err: str) -> dict:
    """What a row keeps of a run: rate, steps, test loss, the split's and stragglers' lines, each rank's breakdown."""
    lines = [ln.split("batch split: ", 1)[1] for ln in err.splitlines() if "batch split: " in ln]
    stragglers = [ln.split("straggler: ", 1)[1] for ln in err.splitlines() if "straggler: " in ln]
    # Each rank's median phase times (ms) over the run: where the step goes, per rank.
    per_rank = [((w or {}).get("median_ms") or {}) for w in (result.get("breakdown") or [])]
    breakdown = [{k: round(v, 1) for k, v in m.items() if v is not None} for m in per_rank]
    return {"samples_per_s": result["samples_per_s"], "steps": result["steps"], "val_loss": result.get("val_loss"),
            "split_lines": lines, "straggler_lines": stragglers, "breakdown_ms": breakdown}


def _run(args: argparse.Namespace, *, cores: list[int], quotas: dict[int, Quota], split: str, seed: int) -> dict:
    """One training run of ``len(cores)`` ranks on this machine (rank r on core ``cores[r]``, in ``quotas[r]``)."""
    port, procs, world = _free_port(), [], len(cores)
    for rank, core in enumerate(cores):
        env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1", "RANK": str(rank), "LOCAL_RANK": str(rank),
               "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        p = subprocess.Popen(["taskset", "-c", str(core), sys.executable, *_train_args(args, world=world, split=split, seed=seed)],
                             env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        if rank in quotas:
            quotas[rank].add(p.pid)
        procs.append(p)
    outs = [p.communicate(timeout=args.timeout) for p in procs]
    if any(p.returncode for p in procs):
        raise SystemExit(f"run failed ({split}, cores {cores}):\n{outs[0][1][-2000:]}\n{outs[-1][1][-2000:]}")
    return _record(json.loads(outs[0][0].strip().splitlines()[-1]), outs[0][1])


def _cpu_s(quota: Quota) -> float:
    """CPU seconds (user + system, every thread) the processes in ``quota``'s group have used so far."""
    total = 0
    for pid in (quota.path / "cgroup.procs").read_text().split():
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14, 15 of proc(5))
    return total / os.sysconf("SC_CLK_TCK")


def _watch(procs: list[subprocess.Popen], log: Path, change: tuple[int, int, int] | None, quotas: list[Quota],
           timeout: float, cpu: list | None = None) -> dict | None:
    """Wait for the hosts' programs; with ``change`` (step, host, percent), set that host's quota
    once rank 0's log names that step (the step it saw is recorded: the log is every --log-every).
    With ``cpu`` (a list), append ``(step, [CPU s per host])`` as each new step is logged: the
    timer of where each host's CPU goes (compute and gloo's all-reduce share one quota)."""
    deadline, done, last = time.monotonic() + timeout, None, 0
    while any(p.poll() is None for p in procs):
        if time.monotonic() > deadline:
            raise SystemExit(f"bed run timed out after {timeout} s:\n{log.read_text()[-2000:]}")
        if change or cpu is not None:
            seen = [int(m.group(1)) for m in map(STEP_LINE.search, log.read_text().splitlines()) if m]
            if cpu is not None and seen and seen[-1] > last:
                last = seen[-1]
                cpu.append((last, [_cpu_s(q) for q in quotas]))
            if change and done is None and seen and seen[-1] >= change[0]:
                quotas[change[1]].set(change[2])
                done = {"at_step": seen[-1], "host": change[1], "quota_percent": change[2]}
        time.sleep(0.2)
    return done


def _cpu_per_step(cpu: list, after: int) -> list[float] | None:
    """Each host's CPU ms per step between the first logged step past ``after`` and the last."""
    rows = [(s, c) for s, c in cpu if s > after]
    if len(rows) < 2 or rows[-1][0] == rows[0][0]:
        return None
    (s0, c0), (s1, c1) = rows[0], rows[-1]
    return [round((b - a) * 1e3 / (s1 - s0), 1) for a, b in zip(c0, c1)]


def _bed_run(args: argparse.Namespace, quotas: list[Quota], *, shared: str | None, split: str, seed: int) -> dict:
    """One run on ``--hosts`` bed hosts (one rank each), host h on core ``--cores[h]`` in ``quotas[h]``."""
    from tests.support.netbed import NetBed

    n, cores = args.hosts, args.cores
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)]), "OMP_NUM_THREADS": "1"}
    if args.bucket_mb:  # the bench's own DDP bucket size (batch_split_site/sitecustomize.py), inherited by the workers
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "benchmarks" / "batch_split_site"), env["PYTHONPATH"]])
        env["BATCH_SPLIT_BENCH_BUCKET_MB"] = str(args.bucket_mb)
    with tempfile.TemporaryDirectory(prefix="dtrain-split-") as tmp, NetBed(hosts=n, shared_name=shared) as bed:
        port, outs, errs = 29000 + os.getpid() % 1000, [Path(tmp, f"h{h}.out") for h in range(n)], [Path(tmp, f"h{h}.err") for h in range(n)]
        ledger = ["--ledger", str(Path(tmp, "ledger"))] if args.ledger else []
        procs = []
        for h in range(n):
            argv = ["taskset", "-c", str(cores[h]), sys.executable, *_train_args(args, world=n, split=split, seed=seed), *ledger,
                    "--nnodes", str(n), "-n", "1", "--node-rank", str(h), "--master-addr", bed.addresses[0],
                    "--master-port", str(port), "--startup-timeout", "180"]
            with open(outs[h], "w") as o, open(errs[h], "w") as e:
                procs.append(bed.popen(h, argv, env=env, cwd=tmp, stdout=o, stderr=e))
            quotas[h].add(procs[-1].pid)  # before it starts its worker (after the rendezvous): the worker inherits it
        cpu: list = []
        changed = _watch(procs, errs[0], args.change, quotas, args.timeout, cpu)
        if any(p.returncode for p in procs):
            raise SystemExit(f"bed run failed ({split}, {shared or 'own names'}):\n" + "\n".join(e.read_text()[-1500:] for e in errs))
        result = next(json.loads(x) for x in reversed(outs[0].read_text().splitlines()) if x.startswith("{"))
        # Past the split's measurement and refinement (warm-up + REFINE_ROWS + a few), when --log-every is short.
        rec = {**_record(result, errs[0].read_text()), "quota_change": changed,
               "cpu_ms_per_step": _cpu_per_step(cpu, args.warmup + 10)}
        if args.ledger:
            check = subprocess.run([sys.executable, "-m", "dtrain", "ckpt", "ledger", str(Path(tmp, "ledger"))], env=env,
                                   capture_output=True, text=True)
            rec["ledger_rc"], rec["ledger"] = check.returncode, check.stdout.strip().splitlines()
    return rec


def _load() -> float:
    return float(Path("/proc/loadavg").read_text().split()[0])


def _ordered(modes: list[str], flip: int) -> list[str]:
    """Even and speed, their order alternating between rounds and sides (the load moves)."""
    return modes if flip % 2 == 0 else modes[::-1]


def _plan(args: argparse.Namespace, quotas: list[Quota], rnd: int) -> list[tuple[dict, object]]:
    """This round's runs: (what the row says of it, the call that runs it)."""
    seed = args.seeds[rnd % len(args.seeds)]
    out: list[tuple[dict, object]] = []
    if args.hosts:
        for i, name in enumerate(args.names):
            shared = None if name == "own" else name
            for mode in _ordered(args.modes, rnd + i):
                out.append(({"case": name, "mode": mode, "seed": seed},
                            lambda s=shared, m=mode: _bed_run(args, quotas, shared=s, split=m, seed=seed)))
        for h in range(args.hosts) if args.alone else ():
            out.append(({"case": "alone", "mode": f"alone-h{h}", "seed": seed},
                        lambda h=h: _run(args, cores=[args.cores[h]], quotas={0: quotas[h]}, split="even", seed=seed)))
        return out
    for slow in args.sides:
        for mode in _ordered(args.modes, rnd + slow):
            out.append(({"mode": mode, "slow_rank": slow, "seed": seed},
                        lambda s=slow, m=mode: _run(args, cores=[0, 1], quotas={s: quotas[0]}, split=m, seed=seed)))
        if args.alone:
            out.append(({"mode": "alone-fast", "slow_rank": slow, "seed": seed},
                        lambda: _run(args, cores=[0], quotas={}, split="even", seed=seed)))
            out.append(({"mode": "alone-slow", "slow_rank": slow, "seed": seed},
                        lambda s=slow: _run(args, cores=[s], quotas={0: quotas[0]}, split="even", seed=seed)))
    return out


def _summary(args: argparse.Namespace, rows: list[dict]) -> dict:
    """Medians of samples/s per case and mode, and the ratios the issue asks for."""
    med = {}
    for key in sorted({(r.get("case", "-"), r["mode"]) for r in rows}):
        med["/".join(key)] = statistics.median(r["samples_per_s"] for r in rows if (r.get("case", "-"), r["mode"]) == key)
    alone = ([med.get(f"alone/alone-h{h}") for h in range(args.hosts)] if args.hosts
             else [med.get("-/alone-fast"), med.get("-/alone-slow")])
    out: dict = {"median_samples_per_s": med}
    for case in (args.names if args.hosts else ["-"]):
        even, speed = med.get(f"{case}/even"), med.get(f"{case}/speed")
        if even and speed:
            out[f"{case}: speed_over_even"] = round(speed / even, 3)
        if speed and all(alone):
            out[f"{case}: speed_over_sum_alone"] = round(speed / sum(alone), 3)
    if args.epochs:
        out["val_loss"] = {m: [r["val_loss"] for r in rows if r["mode"] == m] for m in args.modes}
    return out


def _args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--task", default="lm", choices=sorted(TASKS))
    ap.add_argument("--task-arg", action="append", default=[], metavar="KEY=VALUE", help="more --task-arg for every run")
    ap.add_argument("--batch-size", type=int, default=None, help="samples per rank (default 16): more compute per all-reduce")
    ap.add_argument("--train-args", default="", help="more dtrain train flags for every run (alone too), e.g. '--comm bf16'")
    ap.add_argument("--rounds", type=int, default=None, help="default 3 (or one per --seeds)")
    ap.add_argument("--first-round", type=int, default=0, help="number the rounds from here (a later run's orders continue)")
    ap.add_argument("--steps", type=int, default=80)
    ap.add_argument("--epochs", type=int, default=None, help="epochs to train (--steps 0: all of them; default: the task's)")
    ap.add_argument("--seeds", default="0", help="--seed of the rounds' runs, round r takes the r-th (cycling)")
    ap.add_argument("--warmup", type=int, default=15, help="steps left out of the rate (the split is measured after them)")
    ap.add_argument("--log-every", type=int, default=None, help="default: --steps (one line); --change reads rank 0's log")
    ap.add_argument("--modes", default="even,speed")
    ap.add_argument("--quota", type=int, default=50, help="2 ranks: the slow rank's CPU quota, percent of one core")
    ap.add_argument("--sides", default="1,0", help="2 ranks: the slowed rank of each run, in turn")
    ap.add_argument("--hosts", type=int, default=0, help="run on this many bed hosts, one rank each (0: the 2-rank mode)")
    ap.add_argument("--quotas", default="60,42,24", help="bed: each host's CPU quota, percent of one core")
    ap.add_argument("--cores", default="0,1,1", help="bed: each host's core (taskset)")
    ap.add_argument("--names", default="own", help="bed: own (n0, n1, ...) and/or a host name every host shares (vm)")
    ap.add_argument("--change", default=None, metavar="STEP:HOST:PERCENT", help="bed: set HOST's quota when rank 0 logs STEP")
    ap.add_argument("--ledger", action="store_true", help="bed: record the samples ledger and check it (dtrain ckpt ledger)")
    ap.add_argument("--cpu-shares", type=int, default=1024,
                    help="the quota groups' cpu.shares (1024: a process's weight); more lets the quota, not the load, bind")
    ap.add_argument("--period-ms", type=int, default=100, help="the quota's CFS period (the quota is a share of it)")
    ap.add_argument("--bucket-mb", type=float, default=None,
                    help="bed: DDP's bucket size for the runs (benchmark-only, see batch_split_site/); default: dtrain's 25")
    ap.add_argument("--alone", action="store_true", help="also each rank's own rate, one process on its core under its quota")
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    ints = (lambda s: [int(x) for x in s.split(",")])  # noqa: E731
    args.seeds, args.sides, args.quotas, args.cores = ints(args.seeds), ints(args.sides), ints(args.quotas), ints(args.cores)
    args.modes, args.names = [m for m in args.modes.split(",") if m], args.names.split(",")  # --modes= --alone: alone only
    args.change = tuple(ints(args.change.replace(":", ","))) if args.change else None
    args.rounds = args.rounds or (len(args.seeds) if len(args.seeds) > 1 else 3)
    if args.hosts and not (len(args.quotas) == len(args.cores) == args.hosts):
        ap.error(f"--quotas and --cores need one value per host ({args.hosts})")
    return args


def main() -> None:
    args = _args()
    out = open(args.out, "a") if args.out else None
    quotas = ([Quota(q, f"-h{h}", args.cpu_shares, args.period_ms) for h, q in enumerate(args.quotas)] if args.hosts
              else [Quota(args.quota, shares=args.cpu_shares, period_ms=args.period_ms)])
    rows: list[dict] = []
    try:
        for rnd in range(args.first_round, args.first_round + args.rounds):
            for what, call in _plan(args, quotas, rnd):
                for q, percent in zip(quotas, args.quotas if args.hosts else [args.quota]):
                    q.set(percent)  # a --change of the last run is undone
                load0, t0 = _load(), time.time()
                rec = call()
                row = {"date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"), "task": args.task,
                       "round": rnd, **what, "batch_per_rank": args.batch_size or 16, "train_args": args.train_args, "bucket_mb": args.bucket_mb, "period_ms": args.period_ms, "quota_percent": args.quotas if args.hosts else args.quota,
                       **({"cores": args.cores} if args.hosts else {}), **rec,
                       "wall_s": round(time.time() - t0, 1), "loadavg_before": load0, "loadavg_after": _load()}
                rows.append(row)
                print(json.dumps(row), flush=True)
                if out:
                    out.write(json.dumps(row) + "\n")
                    out.flush()
    finally:
        for q in quotas:
            q.close()
    summary = {"summary": _summary(args, rows), "task": args.task, "rounds": args.rounds, "hosts": args.hosts}
    print(json.dumps(summary), flush=True)
    if out:
        out.write(json.dumps(summary) + "\n")


if __name__ == "__main__":
    main()

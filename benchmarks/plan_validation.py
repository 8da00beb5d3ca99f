"""`dtrain plan` against real `dtrain train` runs on the network test bed (tests.support.netbed).

Per group (task x hosts x link), on one bed:

1. `dtrain doctor --links-out` on every host: every collective timed between the hosts over the
   group's shaped link (the plan's link figures, measured, not given);
2. `dtrain plan --json --links` of the whole group (its profile: the plain step and each layout's
   own CPU cost in a world of one, a worker's memory): the plan's pick, as a user gets it, with the
   bed's shared cores and its shaper's per-size link rates modelled here (``plan_bed.on_bed``, run
   through ``plan_bed.py plan``: the plan itself models the user's cluster);
3. each configuration, ``--repeats`` times in alternating order: `dtrain plan` of that
   configuration alone right before its `dtrain train` run, so the profile sees the load the run
   sees (this machine is shared: its speed changes by 2x within minutes), then the run; medians
   of the repeats, the machine's load average noted at each run's end;
4. ``--contest`` more runs each, alternating, of the contenders for the pick (the group plan's
   fastest and the two fastest measured so far), so the fastest measured is a median of several
   runs where it decides the pick; the other configurations keep their ``--repeats`` runs.

Measured step time: wall time per step over steps 10 to --steps (from the --metrics-file records'
wall_s: everything a step costs, local SGD's periodic averaging and the loss all-reduce of each
log interval included; 32 steps by default, two local SGD periods); the breakdown's median step
beside it. Memory:
the parameter + gradient + optimizer bytes each rank reports after its first step, and the peak
resident set of the busiest rank over the training steps (the last log interval's ``peak_mib``,
before the final evaluation), against the plan's state and peak per rank. Links are shaped in rate
(tbf) and, in the groups named ``-<N>ms``, delayed by N ms on what each host sends (netem, or where
the kernel has none, as here, the bed's user-space delay line). Needs root and iproute2.

    PYTHONPATH=src python3 benchmarks/plan_validation.py [--groups lm-1g,mlp-100m] [--repeats 1] [--contest 2] [--out rows.jsonl]
    PYTHONPATH=src python3 benchmarks/plan_validation.py --table rows.jsonl      # the table of saved rows
    PYTHONPATH=src python3 benchmarks/plan_validation.py --picks run1.jsonl run2.jsonl ...   # the picks of several runs
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from typing import NamedTuple

HERE = os.path.dirname(os.path.abspath(__file__))
SRC = os.path.join(os.path.dirname(HERE), "src")
sys.path.insert(0, SRC)
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))  # tests.support: the harness that only tests and benchmarks use

from plan_bed import on_bed  # noqa: E402
from plan_validation_table import pick_tally, print_table  # noqa: E402
from tests.support.netbed import NetBed  # noqa: E402

LM = ["layers=2", "width=64", "heads=2", "context=64", "max_bytes=200000", "tie=false"]
MLP = ["hidden=512", "samples=8192"]
"""8192 samples: 64 steps an epoch at batch 64 on 2 ranks, so a run reaches ``--steps`` (runs 1-17 had 4096:
one epoch of 32 steps ended the run there, and local SGD averaged once in its 22-step window, not once in 16)."""


class Group(NamedTuple):
    hosts: int
    rate: float
    """Mbit/s of every host's link."""
    task: str
    args: list[str]
    batch: int
    configs: list[tuple[str, str]]
    """(layout, comm) of each configuration run."""
    delay_ms: float = 0.0
    """Added to what each host sends (a round trip between two hosts: twice this)."""


GROUPS = {
    "lm-1g": Group(2, 1000, "lm", LM, 16, [("ddp", "none"), ("ddp", "bf16"), ("zero1", "none"), ("fsdp", "none"), ("pp=2", "none"), ("tp=2", "none")]),
    "lm-20m": Group(2, 20, "lm", LM, 16, [("ddp", "none"), ("ddp", "bf16"), ("ddp", "powersgd:2"), ("ddp", "localsgd:16"), ("fsdp", "none"),
                                          ("pp=2", "none")]),
    "mlp-100m": Group(2, 100, "synthetic", MLP, 64, [("ddp", "none"), ("ddp", "fp16"), ("ddp", "powersgd:2"), ("ddp", "localsgd:16"),
                                                     ("zero1", "none"), ("fsdp", "none")]),
    "mlp-1g": Group(2, 1000, "synthetic", MLP, 64, [("ddp", "none"), ("ddp", "bf16"), ("zero1", "none"), ("fsdp", "none")]),
    "lm-4h-100m": Group(4, 100, "lm", LM, 16, [("ddp", "none"), ("ddp", "bf16"), ("fsdp", "none"), ("pp=2,dp_replicate=2", "none")]),
    # With a delay (from run 28, 2026-11-27: the bed's delay line; the five above have none).
    "lm-100m-10ms": Group(2, 100, "lm", LM, 16, [("ddp", "none"), ("ddp", "bf16"), ("ddp", "powersgd:2"), ("ddp", "localsgd:16"),
                                                 ("fsdp", "none"), ("pp=2", "none")], delay_ms=10),
    "mlp-3h-50m-5ms": Group(3, 50, "synthetic", MLP, 64, [("ddp", "none"), ("ddp", "fp16"), ("ddp", "powersgd:2"), ("ddp", "localsgd:16"),
                                                          ("zero1", "none"), ("fsdp", "none")], delay_ms=5),
    # The longest delay (from run 30): 20 ms each way, 40 ms between two hosts.
    "lm-3h-50m-20ms": Group(3, 50, "lm", LM, 16, [("ddp", "none"), ("ddp", "bf16"), ("ddp", "localsgd:16"), ("zero1", "none"),
                                                  ("fsdp", "none")], delay_ms=20),
}

RAW: str | None = None
EVERY = 10
"""The runs' --log-every (and the plan's: each log step's collectives)."""


def task_flags(task: str, args: list[str], batch: int) -> list[str]:
    out = ["--task", task, "--batch-size", str(batch)]
    for a in args:
        out += ["--task-arg", a]
    return out


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (SRC, os.environ.get("PYTHONPATH")) if p)}


WAIT = ("import os, socket, sys, time\n"
        "for _ in range(240):\n"
        "    try:\n"
        "        socket.create_connection((sys.argv[1], int(sys.argv[2])), 1).close(); break\n"
        "    except OSError: time.sleep(0.5)\n"
        "os.execv(sys.executable, [sys.executable, '-m', 'dtrain', *sys.argv[3:]])\n")
"""Wait until node 0 listens, then become `dtrain ARGS` (the doctor on another node checks node 0's
port once, at once; under load node 0's may not be up yet)."""


def measure_links(bed: NetBed, hosts: int, port: int, path: str) -> dict:
    """`dtrain doctor --links-out` on every host of the bed: the collectives between them."""
    def command(r: int, master: str) -> list[str]:
        doctor = ["doctor", "--nnodes", str(hosts), "--node-rank", str(r), "--master-addr", master, "--master-port", str(port),
                  "--timeout", "120", "--links-out", path]
        return [sys.executable, "-m", "dtrain", *doctor] if r == 0 else [sys.executable, "-c", WAIT, master, str(port), *doctor]
    outs = bed.run_nodes(command, timeout=900, env=_env())
    if any(o.returncode for o in outs) or not os.path.exists(path):
        raise RuntimeError("doctor failed: " + "\n".join(o.output[-1500:] for o in outs))
    with open(path) as fh:
        return json.load(fh)


def plan(group: Group, links: str, cores: int, profile_s: float) -> tuple[dict, dict]:
    layouts = ";".join(dict.fromkeys(lay for lay, _ in group.configs))
    comms = ",".join(dict.fromkeys(c for _, c in group.configs))
    cmd = [sys.executable, os.path.join(HERE, "plan_bed.py"), "plan", "--json", *task_flags(group.task, group.args, group.batch), "--nnodes", str(group.hosts),
           "-n", "1", "--inter-gbit", str(group.rate / 1000), "--links", links, "--profile-threads", "1",
           "--profile-seconds", str(profile_s), "--layouts", layouts, "--comm-methods", comms, "--log-every", str(EVERY)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=_env())
    if out.returncode:
        raise RuntimeError(f"plan failed: {out.stderr[-2000:]}")
    data = json.loads(out.stdout)
    # the plan is for the user's cluster; the bed's hosts share this machine's cores (plan_bed)
    return {(canonical(r["layout"]), r["comm"]): on_bed(r, group.hosts, cores) for r in data["layouts"]}, data


def canonical(layout: str) -> str:
    from dtrain.parallel.dims import parse

    return str(parse(layout)) if "=" in layout else layout


def train(bed: NetBed, group: Group, layout: str, comm: str, steps: int, port: int) -> dict:
    hosts = group.hosts
    where = ["--strategy", layout] if "=" not in layout else ["--parallel", layout]
    every = EVERY
    with tempfile.TemporaryDirectory() as tmp:
        outs = bed.run_nodes(lambda r, master: [
            sys.executable, "-m", "dtrain", "train", *task_flags(group.task, group.args, group.batch), *where, "--comm", comm, "--comm-warmup", "2",
            "--max-steps", str(steps), "--log-every", str(every), "--nnodes", str(hosts), "--node-rank", str(r), "--master-addr", master,
            "--master-port", str(port), "-v", "--metrics-file", os.path.join(tmp, "m.jsonl")], timeout=900, env=_env())
        if any(o.returncode for o in outs):
            raise RuntimeError(f"{layout} {comm}: " + "\n".join(o.output[-1500:] for o in outs))
        with open(os.path.join(tmp, "m.jsonl")) as fh:
            records = [json.loads(line) for line in fh if line.strip()]
    result = json.loads(next(line for line in reversed(outs[0].output.splitlines()) if line.startswith("{")))
    first, last = records[0], records[-1]
    if result["steps"] != steps:  # an epoch ended it: the window would hold another share of periodic work
        raise RuntimeError(f"{layout} {comm}: the run stopped after {result['steps']} steps, not --steps {steps}; "
                           "give the task more samples")
    state = [_state_mib(line) for o in outs for line in o.output.splitlines() if "memory after the first step" in line]
    return {"window_ms": (last["wall_s"] - first["wall_s"]) / (last["step"] - first["step"]) * 1e3,
            "median_ms": statistics.mean(b["median_ms"]["step"] for b in result["breakdown"]),
            "state_mib": max(state) if state else None, "peak_mib": max(last.get("peak_mib") or [0]) or None,
            "peak_mib_ranks": last.get("peak_mib"), "load": os.getloadavg()[0], "result": result}


def keep_raw(name: str, layout: str, comm: str, pred: dict, profile: dict, run: dict) -> None:
    """The run's result line (breakdown per rank), the prediction's phases and its profile: small,
    kept beside the table (``--raw``)."""
    if RAW:
        with open(RAW, "a") as fh:
            fh.write(json.dumps({"group": name, "layout": layout, "comm": comm, "load": run["load"], "peak_mib": run["peak_mib_ranks"],
                                 "predicted": {k: pred[k] for k in ("step_ms", "phases_ms", "memory_mib", "peak_mib_per_rank")},
                                 "profile": profile, "result": run["result"]}) + "\n")


def _state_mib(line: str) -> float:
    """``total 2.1 MiB`` from a `memory after the first step` line, in MiB."""
    text = line.split("total ", 1)[1].split(";", 1)[0].strip()
    value, unit = text.split()
    return float(value) * {"B": 2**-20, "KiB": 2**-10, "MiB": 1.0, "GiB": 1024.0}[unit]


def run_group(name: str, args: argparse.Namespace, port: int) -> list[dict]:
    group = GROUPS[name]
    measured: dict[tuple[str, str], list[tuple[dict, dict]]] = {}
    with tempfile.TemporaryDirectory() as tmp, NetBed(hosts=group.hosts, rate_mbit=group.rate, delay_ms=group.delay_ms or None) as bed:
        links_path = os.path.join(tmp, "links.json")
        links = measure_links(bed, group.hosts, port, links_path)
        print(f"# {name}: links {json.dumps(links['seconds'])} load {links['load']:.2f}", flush=True)
        whole, data = plan(group, links_path, args.cores, args.profile_seconds)
        print(f"# {name}: group plan {json.dumps(data['model'])} load {os.getloadavg()[0]:.2f}", flush=True)

        def once(layout: str, comm: str) -> None:
            nonlocal port
            port += 1
            by_key, data = plan(group._replace(configs=[(layout, comm)]), links_path, args.cores, args.profile_seconds)
            pred, run = by_key[(canonical(layout), comm)], train(bed, group, layout, comm, args.steps, port)
            keep_raw(name, layout, comm, pred, data["model"], run)
            measured.setdefault((layout, comm), []).append((pred, run))

        for rep in range(args.repeats):
            for layout, comm in (group.configs if rep % 2 == 0 else group.configs[::-1]):
                once(layout, comm)
        rows = [row(name, layout, comm, whole[(canonical(layout), comm)], measured[(layout, comm)]) for layout, comm in group.configs]
        final = contenders(rows)
        if args.contest and len(final) > 1:
            print(f"# {name}: contest of {final}, {args.contest} more runs each, alternating", flush=True)
            for rep in range(args.contest):
                for layout, comm in (final if rep % 2 == 0 else final[::-1]):
                    once(layout, comm)
    return [row(name, layout, comm, whole[(canonical(layout), comm)], measured[(layout, comm)]) for layout, comm in group.configs]


def contenders(rows: list[dict]) -> list[tuple[str, str]]:
    """The configurations whose measured order decides the pick: the group plan's fastest and the two
    fastest measured (one run each is 10-25% noise on this 2-core machine: more runs of these,
    alternating, settle which is fastest; the others keep their runs)."""
    pick = max(rows, key=lambda r: r["pred_samples_per_s"])
    top = sorted(rows, key=lambda r: r["meas_samples_per_s"], reverse=True)[:2]
    return list(dict.fromkeys((r["layout"], r["comm"]) for r in (pick, *top)))


def row(name: str, layout: str, comm: str, group_plan: dict, runs: list[tuple[dict, dict]]) -> dict:
    pred_ms = statistics.median(p["step_ms"] for p, _ in runs)
    m = statistics.median(r["window_ms"] for _, r in runs)
    per_step = group_plan["samples_per_s"] * group_plan["step_ms"] / 1e3  # samples per step
    peak = [r["peak_mib"] for _, r in runs if r["peak_mib"]]
    return {"group": name, "layout": layout, "comm": comm, "predicted_ms": round(pred_ms, 3),
            "predicted_runs_ms": [round(p["step_ms"], 2) for p, _ in runs], "group_plan_ms": group_plan["step_ms"],
            "measured_ms": round(m, 2), "measured_runs_ms": [round(r["window_ms"], 2) for _, r in runs],
            "median_step_ms": round(statistics.median(r["median_ms"] for _, r in runs), 2), "error": round((pred_ms - m) / m, 4),
            "pred_samples_per_s": group_plan["samples_per_s"], "meas_samples_per_s": round(per_step / m * 1e3, 2),
            "pred_state_mib": group_plan["state_mib_per_rank"], "meas_state_mib": runs[0][1]["state_mib"],
            "pred_peak_mib": statistics.median(p["peak_mib_per_rank"] for p, _ in runs),
            "meas_peak_mib": statistics.median(peak) if peak else None,
            "load": [round(r["load"], 2) for _, r in runs]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--groups", default=",".join(GROUPS), help=f"comma-separated, of: {', '.join(GROUPS)} (default: all)")
    p.add_argument("--steps", type=int, default=42, help="training steps per run; the window is steps 10..STEPS (42: 32 steps, two "
                   "local SGD periods of 16, so its averaging counts as often as it runs)")
    p.add_argument("--repeats", type=int, default=1, help="runs of each configuration (median; alternating order)")
    p.add_argument("--contest", type=int, default=2, help="more runs (alternating) of the group plan's pick and the two fastest "
                   "measured, so the pick is judged on medians of several runs (0: none; runs 1-16 had none)")
    p.add_argument("--profile-seconds", type=float, default=4.0, help="the plan's per-layout profile (dtrain plan --profile-seconds)")
    p.add_argument("--cores", type=int, default=len(os.sched_getaffinity(0)))
    p.add_argument("--out", default=None, help="append each row as a JSON line here")
    p.add_argument("--raw", default=None, help="append each run's result line (with its breakdown) here")
    p.add_argument("--table", default=None, metavar="JSONL", help="only print the table of rows saved by --out")
    p.add_argument("--picks", nargs="+", default=None, metavar="JSONL", help="only tally the picks of several runs' rows (one "
                   "file each, saved by --out): each group of each run, right, unsettled or missed")
    args = p.parse_args()
    if args.picks:
        runs = {}
        for path in args.picks:
            with open(path) as fh:
                runs[os.path.basename(path).removesuffix(".jsonl")] = [json.loads(line) for line in fh if line.strip()]
        pick_tally(runs)
        return 0
    if args.table:
        with open(args.table) as fh:
            print_table([json.loads(line) for line in fh if line.strip()])
        return 0
    global RAW
    RAW = args.raw
    rows, port = [], 29850
    for name in args.groups.split(","):
        group_rows = run_group(name, args, port)
        port += 100
        for r in group_rows:
            print(json.dumps(r), flush=True)
            if args.out:
                with open(args.out, "a") as fh:
                    fh.write(json.dumps(r) + "\n")
        rows += group_rows
    print_table(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""`dtrain plan` against real `dtrain train` runs on the network test bed (dtrain.testing.netbed):
per configuration the predicted step time (the plan's --json, made right before the group's runs
and again right after them, so its compute profile sees the machine load the runs saw: the mean of
the two), the measured one, and the error; per group
(task x hosts x link), whether the layout the plan ranks fastest was the fastest measured.

Measured step time: wall time per step over the steps after the first log interval (from the
--metrics-file records' wall_s; it includes everything a step costs, also local SGD's periodic
averaging and the loss all-reduce of each log interval); the breakdown's median step is printed
beside it. Memory: the parameter + gradient + optimizer bytes each rank reports after its first
step against the plan's (peak RSS is mostly the interpreter and torch, ~700 MiB, not modelled).

Links: the bed's rate (tbf) x 0.94, TCP's payload share at MTU 1500 (1448 of 1538 bytes on the
wire); latency as `dtrain doctor` measured it between two bed hosts (--latency-us). The kernel
here has no netem, so no added delay. Needs root and iproute2.

    PYTHONPATH=src python3 benchmarks/plan_validation.py [--groups lm-1g,mlp-100m] [--repeats 1]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
SRC = os.path.join(os.path.dirname(HERE), "src")
sys.path.insert(0, SRC)

from dtrain.testing.netbed import NetBed  # noqa: E402

LM = ["layers=2", "width=64", "heads=2", "context=64", "max_bytes=200000", "tie=false"]
MLP = ["hidden=512", "samples=4096"]
# name: (hosts, rate Mbit/s, task, task args, batch, [(layout, comm)])
GROUPS = {
    "lm-1g": (2, 1000, "lm", LM, 16, [("ddp", "none"), ("ddp", "bf16"), ("zero1", "none"), ("fsdp", "none"), ("pp=2", "none"), ("tp=2", "none")]),
    "lm-20m": (2, 20, "lm", LM, 16, [("ddp", "none"), ("ddp", "bf16"), ("ddp", "powersgd:2"), ("ddp", "localsgd:16"), ("fsdp", "none"), ("pp=2", "none")]),
    "mlp-100m": (2, 100, "synthetic", MLP, 64, [("ddp", "none"), ("ddp", "fp16"), ("ddp", "powersgd:2"), ("ddp", "localsgd:16"), ("zero1", "none"), ("fsdp", "none")]),
    "mlp-1g": (2, 1000, "synthetic", MLP, 64, [("ddp", "none"), ("ddp", "bf16"), ("zero1", "none"), ("fsdp", "none")]),
    "lm-4h-100m": (4, 100, "lm", LM, 16, [("ddp", "none"), ("ddp", "bf16"), ("fsdp", "none"), ("pp=2,dp_replicate=2", "none")]),
}
TCP_PAYLOAD = 1448 / 1538
RAW: str | None = None


def task_flags(task: str, args: list[str], batch: int) -> list[str]:
    out = ["--task", task, "--batch-size", str(batch)]
    for a in args:
        out += ["--task-arg", a]
    return out


def plan(group: tuple, latency_us: float, cores: int) -> dict[tuple[str, str], dict]:
    hosts, rate, task, targs, batch, configs = group
    layouts = ";".join(dict.fromkeys(lay for lay, _ in configs))
    comms = ",".join(dict.fromkeys(c for _, c in configs))
    cmd = [sys.executable, "-m", "dtrain", "plan", "--json", *task_flags(task, targs, batch), "--nnodes", str(hosts), "-n", "1",
           "--inter-gbit", str(rate / 1000 * TCP_PAYLOAD), "--inter-latency-us", str(latency_us), "--shared-cores", str(cores),
           "--profile-threads", "1", "--layouts", layouts, "--comm-methods", comms]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=_env())
    if out.returncode:
        raise RuntimeError(f"plan failed: {out.stderr[-2000:]}")
    data = json.loads(out.stdout)
    return {(canonical(r["layout"]), r["comm"]): r for r in data["layouts"]}, data


def canonical(layout: str) -> str:
    from dtrain.parallel.dims import parse

    return str(parse(layout)) if "=" in layout else layout


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (SRC, os.environ.get("PYTHONPATH")) if p)}


def train(group: tuple, layout: str, comm: str, steps: int, port: int) -> dict:
    hosts, rate, task, targs, batch, _ = group
    where = ["--strategy", layout] if "=" not in layout else ["--parallel", layout]
    with tempfile.TemporaryDirectory() as tmp, NetBed(hosts=hosts, rate_mbit=rate) as bed:
        outs = bed.run_nodes(lambda r, master: [
            sys.executable, "-m", "dtrain", "train", *task_flags(task, targs, batch), *where, "--comm", comm, "--comm-warmup", "2",
            "--max-steps", str(steps), "--log-every", "20", "--nnodes", str(hosts), "--node-rank", str(r), "--master-addr", master,
            "--master-port", str(port), "-v", "--metrics-file", os.path.join(tmp, "m.jsonl")], timeout=600, env=_env())
        if any(o.returncode for o in outs):
            raise RuntimeError(f"{layout} {comm}: " + "\n".join(o.output[-1500:] for o in outs))
        with open(os.path.join(tmp, "m.jsonl")) as fh:
            records = [json.loads(line) for line in fh if line.strip()]
    result = json.loads(next(line for line in reversed(outs[0].output.splitlines()) if line.startswith("{")))
    first, last = records[0], records[-1]
    window_ms = (last["wall_s"] - first["wall_s"]) / (last["step"] - first["step"]) * 1e3
    median_ms = statistics.mean(b["median_ms"]["step"] for b in result["breakdown"])
    state = [_state_mib(line) for o in outs for line in o.output.splitlines() if "memory after the first step" in line]
    if RAW:
        with open(RAW, "a") as fh:  # the run's result line (breakdown per rank): small, kept beside the table
            fh.write(json.dumps({"layout": layout, "comm": comm, "hosts": hosts, "rate_mbit": rate, "result": result}) + "\n")
    return {"window_ms": window_ms, "median_ms": median_ms, "state_mib": max(state) if state else None}


def _state_mib(line: str) -> float:
    """``total 2.1 MiB`` from a `memory after the first step` line, in MiB."""
    text = line.split("total ", 1)[1].split(";", 1)[0].strip()
    value, unit = text.split()
    return float(value) * {"B": 2**-20, "KiB": 2**-10, "MiB": 1.0, "GiB": 1024.0}[unit]


def load() -> str:
    return open("/proc/loadavg").read().split()[0]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--groups", default=",".join(GROUPS))
    p.add_argument("--steps", type=int, default=80)
    p.add_argument("--repeats", type=int, default=1, help="runs of each configuration (median; alternating order)")
    p.add_argument("--latency-us", type=float, default=250.0, help="per message, as `dtrain doctor` measured on the bed")
    p.add_argument("--cores", type=int, default=len(os.sched_getaffinity(0)))
    p.add_argument("--out", default=None, help="append each row as a JSON line here")
    p.add_argument("--raw", default=None, help="append each run's result line (with its breakdown) here")
    p.add_argument("--table", default=None, metavar="JSONL", help="only print the table of rows saved by --out")
    args = p.parse_args()
    if args.table:
        with open(args.table) as fh:
            saved = [json.loads(line) for line in fh if line.strip()]
        print_table(saved, picks_of(saved))
        return 0
    global RAW
    RAW = args.raw
    rows, picks, port = [], [], 29850
    for name in args.groups.split(","):
        group = GROUPS[name]
        before, whole = plan(group, args.latency_us, args.cores)
        print(f"# {name}: plan profile before {json.dumps(whole['model']['measured'])} load {load()}", flush=True)
        measured: dict[tuple[str, str], list[dict]] = {}
        for rep in range(args.repeats):
            order = group[5] if rep % 2 == 0 else group[5][::-1]
            for layout, comm in order:
                port += 1
                measured.setdefault((layout, comm), []).append(train(group, layout, comm, args.steps, port))
        after, whole = plan(group, args.latency_us, args.cores)
        print(f"# {name}: plan profile after {json.dumps(whole['model']['measured'])} load {load()}", flush=True)
        group_rows = []
        for layout, comm in group[5]:
            key = (canonical(layout), comm)
            pr = dict(after[key], step_ms=(before[key]["step_ms"] + after[key]["step_ms"]) / 2,
                      samples_per_s=2 / (1 / before[key]["samples_per_s"] + 1 / after[key]["samples_per_s"]))
            runs = measured[(layout, comm)]
            m = statistics.median(r["window_ms"] for r in runs)
            dp = pr["samples_per_s"] * pr["step_ms"] / 1e3
            row = {"group": name, "layout": layout, "comm": comm, "predicted_ms": round(pr["step_ms"], 3),
                   "predicted_before_after_ms": [before[key]["step_ms"], after[key]["step_ms"]], "measured_ms": round(m, 2),
                   "median_step_ms": round(statistics.median(r["median_ms"] for r in runs), 2),
                   "error": round((pr["step_ms"] - m) / m, 4), "pred_samples_per_s": pr["samples_per_s"],
                   "meas_samples_per_s": round(dp / m * 1e3, 2), "pred_state_mib": round(sum(pr["memory_mib"][k] for k in ("params", "grads", "optimizer")), 3),
                   "meas_state_mib": runs[0]["state_mib"], "load": load()}
            group_rows.append(row)
            print(json.dumps(row), flush=True)
            if args.out:
                with open(args.out, "a") as fh:
                    fh.write(json.dumps(row) + "\n")
        best_pred = max(group_rows, key=lambda r: r["pred_samples_per_s"])
        best_meas = max(group_rows, key=lambda r: r["meas_samples_per_s"])
        picks.append((name, best_pred, best_meas))
        rows += group_rows
    print_table(rows, picks)
    return 0


def picks_of(rows: list[dict]) -> list:
    groups: dict[str, list[dict]] = {}
    for r in rows:
        groups.setdefault(r["group"], []).append(r)
    return [(g, max(rs, key=lambda r: r["pred_samples_per_s"]), max(rs, key=lambda r: r["meas_samples_per_s"]))
            for g, rs in groups.items()]


def ratio_errors(rows: list[dict]) -> dict[tuple[str, str, str], float]:
    """Error of each configuration's step time relative to its group's first (ddp none), predicted
    against measured: the machine's load, common to both, cancels."""
    out, first = {}, {}
    for r in rows:
        base = first.setdefault(r["group"], r)
        pred = r["predicted_ms"] / base["predicted_ms"]
        meas = r["measured_ms"] / base["measured_ms"]
        out[(r["group"], r["layout"], r["comm"])] = pred / meas - 1
    return out


def print_table(rows: list[dict], picks: list) -> None:
    ratios = ratio_errors(rows)
    print("\n| group | layout | comm | predicted ms (before / after) | measured ms (median step) | error | error of ratio to group's first | state MiB pred / meas | load |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        state = f"{r['pred_state_mib']:.2f} / {r['meas_state_mib']:.2f}" if r["meas_state_mib"] is not None else "-"
        ba = " / ".join(f"{v:.0f}" for v in r.get("predicted_before_after_ms", []))
        print(f"| {r['group']} | {r['layout']} | {r['comm']} | {r['predicted_ms']:.1f} ({ba}) | {r['measured_ms']:.1f} ({r['median_step_ms']:.1f}) "
              f"| {r['error']:+.1%} | {ratios[(r['group'], r['layout'], r['comm'])]:+.1%} | {state} | {r['load']} |")
    errs = [abs(r["error"]) for r in rows]
    rel = [abs(v) for k, v in ratios.items() if v != 0.0]
    if rel:
        print(f"\nstep time relative to the group's first configuration: median |error| {statistics.median(rel):.1%}, max {max(rel):.1%}")
    mem = [abs(r["pred_state_mib"] / r["meas_state_mib"] - 1) for r in rows if r["meas_state_mib"]]
    print(f"step time: median |error| {statistics.median(errs):.1%}, max {max(errs):.1%} over {len(rows)} configurations")
    if mem:
        print(f"state memory per rank: median |error| {statistics.median(mem):.1%}, max {max(mem):.1%}")
    right = sum(bp["layout"] == bm["layout"] and bp["comm"] == bm["comm"] for _, bp, bm in picks)
    for name, bp, bm in picks:
        regret = bm["meas_samples_per_s"] / bp["meas_samples_per_s"] - 1
        print(f"{name}: plan picks {bp['layout']} {bp['comm']}; fastest measured {bm['layout']} {bm['comm']} "
              f"(the pick measured {regret:.0%} slower than the fastest)")
    print(f"fastest picked right in {right} of {len(picks)} groups")


if __name__ == "__main__":
    sys.exit(main())

"""The merged trace against the breakdown, on two hosts of the network test bed (needs root and
``ip netns``): does the exposed communication the trace shows agree with the breakdown's figure
for the same steps?

One 2-host run with the path between the hosts shaped (``--rate-mbit``) so that communication
shows, traced for ``--trace`` steps whose log interval is exactly those steps. Per rank:

- *trace, buckets*: per step, from the end of backward's compute (the ``backward`` span) to the
  completion of the step's last gradient bucket's all-reduce (the collectives' track, from
  torch.profiler), over the step's length; summed over the traced steps;
- *trace, phases*: the ``comm`` spans (the breakdown's laps as drawn) over the steps' length;
- *breakdown*: the metrics record of the same steps, median ``comm`` over median ``step``.

    python3 benchmarks/trace_exposed_comm.py --rate-mbit 100 --task mnist --data-dir ../shared/data/mnist
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from collections import defaultdict

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def shares(doc: dict, rank: int) -> dict[str, float]:
    """The trace's two figures for one rank (fractions of the traced steps' summed length)."""
    spans = [e for e in doc["traceEvents"] if e["ph"] == "X" and e["pid"] == rank]
    steps: dict[int, dict[str, list[dict]]] = defaultdict(lambda: defaultdict(list))
    for e in spans:
        steps[e["args"]["step"]][e["name"] if e["tid"] == 0 else "bucket" if "bucket" in e["name"] else "other"].append(e)
    total = exposed = comm = 0.0
    for phases in steps.values():
        start = min(e["ts"] for name in ("data_wait", "forward", "backward", "comm", "optimizer", "rest") for e in phases.get(name, []))
        end = max(e["ts"] + e["dur"] for name in ("data_wait", "forward", "backward", "comm", "optimizer", "rest") for e in phases.get(name, []))
        total += end - start
        comm += sum(e["dur"] for e in phases.get("comm", []))
        compute_end = max(e["ts"] + e["dur"] for e in phases["backward"])
        last_bucket = max((e["ts"] + e["dur"] for e in phases.get("bucket", [])), default=compute_end)
        exposed += max(0.0, last_bucket - compute_end)
    return {"steps": len(steps), "buckets": exposed / total, "phases": comm / total,
            "buckets_per_step": round(sum(len(p.get("bucket", [])) for p in steps.values()) / max(1, len(steps)), 2)}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rate-mbit", type=float, default=100.0)
    p.add_argument("--task", default="mnist")
    p.add_argument("--data-dir", default=None)
    p.add_argument("--trace", default="21:31", help="START:END; the log interval is END - START so one record covers them")
    args = p.parse_args()
    start, end = (int(v) for v in args.trace.split(":"))
    sys.path.insert(0, os.path.join(ROOT, "src"))
    sys.path.insert(0, ROOT)  # tests.support: the harness that only tests and benchmarks use
    from tests.support import netbed

    env = {**os.environ, "PYTHONPATH": os.path.join(ROOT, "src")}
    with tempfile.TemporaryDirectory(prefix="dtrain-trace-bench-") as tmp:
        trace, metrics = os.path.join(tmp, "trace.json"), os.path.join(tmp, "m.jsonl")
        cmd = ["-m", "dtrain", "train", "--task", args.task, "--max-steps", str(end - 1), "--log-every", str(end - start),
               "--trace", args.trace, "--trace-file", trace, "--metrics-file", metrics, "--nnodes", "2"]
        if args.data_dir:
            cmd += ["--data-dir", os.path.abspath(args.data_dir)]
        with netbed.NetBed(hosts=2, rate_mbit=args.rate_mbit) as bed:
            outs = bed.run_nodes(lambda r, m: [sys.executable, *cmd, "--node-rank", str(r), "--master-addr", m], timeout=900, env=env)
        if any(o.returncode != 0 for o in outs):
            raise SystemExit("\n".join(o.output[-3000:] for o in outs))
        with open(trace) as f:
            doc = json.load(f)
        with open(metrics) as f:
            record = next(r for r in map(json.loads, f) if r["step"] == end - 1)
    print(f"2 hosts on the bed, path shaped to {args.rate_mbit:g} Mbit/s, {args.task}, traced steps {start}..{end - 1} "
          f"(the record of step {end - 1} covers the same steps); clock error bound {doc['otherData']['clock_error_bound_us']} us")
    for rank, window in enumerate(record["breakdown"]):
        t = shares(doc, rank)
        bd = window["median_ms"]["comm"] / window["median_ms"]["step"]
        print(f"  rank {rank}: exposed communication, share of the step: trace (buckets) {t['buckets']:.1%}, trace (phases) "
              f"{t['phases']:.1%}, breakdown (medians) {bd:.1%}; {t['steps']} steps, {t['buckets_per_step']} buckets per step; "
              f"breakdown medians comm {window['median_ms']['comm']:.1f} ms of step {window['median_ms']['step']:.1f} ms")


if __name__ == "__main__":
    main()

"""Straggler detection: does ``dtrain train`` name the slowed rank and the right cause within the
window, and stay quiet on healthy runs? Each trial runs one job per case, interleaved, and the
slowed rank moves round the ranks from trial to trial:

- ``input``: the rank's loader sleeps before each batch (``DTRAIN_SLOW_INJECT=R:input:MS``, tests/support/slowdown.py),
  expected cause input;
- ``hog``: a thread of pure-Python work in the rank's process (``R:hog``), expected cause compute;
- ``network``: the rank's host link shaped to ``--rate-mbit`` (20) on the network test bed, one
  host per rank (``--bed``; needs root and ``ip netns``), expected cause network;
- ``healthy``: nothing slowed; any report is a false one.

    python3 benchmarks/straggler_detection.py --ranks 2 --trials 10 --cases input,hog,healthy
    python3 benchmarks/straggler_detection.py --ranks 4 --trials 10 --cases input,hog,healthy
    python3 benchmarks/straggler_detection.py --ranks 4 --trials 10 --cases network,healthy --bed
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # tests.support: the harness (the slowness driver, a dtrain train plugin; the bed)
from tests.support import slowdown  # noqa: E402

EXPECTED = {"input": "input", "hog": "compute", "network": "network", "healthy": None}


def _env(inject: str | None) -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": os.path.join(ROOT, "src")}
    env.pop("DTRAIN_SLOW_INJECT", None)
    if inject:
        env.update(slowdown.env(inject))
    return env


def _train_args(args: argparse.Namespace) -> list[str]:
    return ["train", "--task", args.task, "--max-steps", str(args.steps), "--log-every", str(args.log_every),
            "--straggler-window", str(args.window), "--straggler-threshold", str(args.threshold)]


def _result(output: str, what: str) -> dict:
    line = next((x for x in reversed(output.strip().splitlines()) if x.startswith("{")), None)
    if line is None:
        raise SystemExit(f"job failed ({what}): {output[-3000:]}")
    return json.loads(line)


def run_local(args: argparse.Namespace, inject: str | None) -> dict:
    cmd = [sys.executable, "-m", "dtrain", *_train_args(args), "-n", str(args.ranks)]
    r = subprocess.run(cmd, capture_output=True, text=True, env=_env(inject), timeout=900, stdin=subprocess.DEVNULL)
    if r.returncode != 0:
        raise SystemExit(f"job failed ({inject}): {r.stderr[-3000:]}")
    return _result(r.stdout, str(inject))


def run_bed(args: argparse.Namespace, slow: int | None) -> dict:
    from tests.support import netbed

    links = {slow: netbed.Link(rate_mbit=args.rate_mbit)} if slow is not None else {}
    with netbed.NetBed(hosts=args.ranks, links=links) as bed:
        outs = bed.run_nodes(lambda r, master: [sys.executable, "-m", "dtrain", *_train_args(args), "--nnodes", str(args.ranks),
                                                "--node-rank", str(r), "--master-addr", master], timeout=900, env=_env(None))
    if any(o.returncode != 0 for o in outs):
        raise SystemExit("bed job failed:\n" + "\n".join(o.output[-2000:] for o in outs))
    return _result(outs[0].output, f"bed, slow {slow}")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--trials", type=int, default=10)
    p.add_argument("--cases", default="input,hog,healthy", help="comma-separated: input, hog, network, healthy")
    p.add_argument("--bed", action="store_true", help="run every case on the network test bed, one host per rank")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--window", type=int, default=50)
    p.add_argument("--threshold", type=float, default=1.3)
    p.add_argument("--sleep-ms", type=float, default=10.0)
    p.add_argument("--rate-mbit", type=float, default=20.0)
    p.add_argument("--task", default="digits")
    args = p.parse_args()
    cases = args.cases.split(",")
    if "network" in cases and not args.bed:
        p.error("the network case needs --bed (a host per rank on the network test bed)")
    tally = {c: {"runs": 0, "named": 0, "right_rank": 0, "right_cause": 0, "false_reports": 0, "first_step": [], "wall_s": []}
             for c in cases}
    for trial in range(args.trials):
        slow = trial % args.ranks
        for case in cases:
            cause = EXPECTED[case]
            t0 = time.perf_counter()
            if args.bed:
                if case in ("input", "hog"):
                    raise SystemExit("on the bed only network and healthy are run")
                result = run_bed(args, slow if cause else None)
            else:
                inject = {"input": f"{slow}:input:{args.sleep_ms:g}", "hog": f"{slow}:hog"}.get(case)
                result = run_local(args, inject)
            found = result.get("stragglers") or []
            t = tally[case]
            t["runs"] += 1
            t["wall_s"].append(round(time.perf_counter() - t0, 1))
            if cause is None:
                t["false_reports"] += bool(found)
            else:
                mine = [s for s in found if s["rank"] == slow]
                t["named"] += bool(found)
                t["right_rank"] += bool(mine)
                t["right_cause"] += bool(mine) and mine[0]["cause"] == cause
                t["false_reports"] += any(s["rank"] != slow for s in found)
                if mine:
                    t["first_step"].append(mine[0]["step"])
            print(json.dumps({"trial": trial, "case": case, "slow_rank": slow if cause else None,
                              "stragglers": [(s["rank"], s["host"], s["cause"], s["ratio"], s["step"]) for s in found],
                              "samples_per_s": result.get("samples_per_s"), "load": os.getloadavg()[0],
                              "first_line": found[0]["line"] if found else None}), flush=True)
    where = f"{args.ranks} hosts on the network test bed ({args.rate_mbit:g} Mbit/s on the slowed one)" if args.bed else "one machine"
    print(f"{args.ranks} ranks, {where}, {args.task}, {args.steps} steps, log every {args.log_every}, window {args.window}, "
          f"threshold {args.threshold}, loader sleep {args.sleep_ms:g} ms:")
    for case, t in tally.items():
        print(f"  {case:8s} runs {t['runs']}: named {t['named']}, right rank {t['right_rank']}, right cause {t['right_cause']}, "
              f"false reports {t['false_reports']}, first named at steps {t['first_step']}")


if __name__ == "__main__":
    main()

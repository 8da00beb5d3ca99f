"""Draw the timeline of a traced two-host run: `dtrain train --trace` on the namespace test bed
(host 1's link at --rate-mbit), then `dtrain report` on its folder (timeline.png among the
figures). Needs root and `ip netns`; run from the repository root.

    PYTHONPATH=src python3 benchmarks/trace_timeline_bed.py --data-dir ../shared/data/mnist --out /tmp/trace-run
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.support: the harness that only tests and benchmarks use
from tests.support import netbed  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data-dir", required=True, help="MNIST's IDX files")
    p.add_argument("--out", type=Path, required=True, help="the run's folder (metrics, trace, report/)")
    p.add_argument("--rate-mbit", type=float, default=100.0)
    p.add_argument("--trace", default="11:14")
    p.add_argument("--port", type=int, default=29533)
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    src = str(Path(__file__).resolve().parents[1] / "src")
    env = {**os.environ, "PYTHONPATH": src}
    with netbed.NetBed(hosts=2, links={1: netbed.Link(rate_mbit=args.rate_mbit)}) as bed:
        outs = bed.run_nodes(lambda rank, master: [
            sys.executable, "-m", "dtrain", "train", "--task", "mnist", "--data-dir", args.data_dir, "--max-steps", "20",
            "--log-every", "5", "--nnodes", "2", "--node-rank", str(rank), "--master-addr", master,
            "--master-port", str(args.port), "--trace", args.trace, "--trace-file", str(args.out / "trace.json"),
            "--metrics-file", str(args.out / "metrics.jsonl")], timeout=300, env=env)
    if any(o.returncode for o in outs):
        sys.exit(f"a node failed: exit codes {[o.returncode for o in outs]}")
    result = next(line for line in reversed(outs[0].output.splitlines()) if line.startswith("{"))
    (args.out / "result.json").write_text(result + "\n")
    done = subprocess.run([sys.executable, "-m", "dtrain", "report", str(args.out)], env=env, capture_output=True, text=True)
    print(done.stdout.strip() or done.stderr.strip())
    sys.exit(done.returncode)


if __name__ == "__main__":
    main()

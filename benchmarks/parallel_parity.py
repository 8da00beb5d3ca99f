"""A composed --parallel layout against one process, for the layouts too big for the test suite's
time budget on 2 cores (HSDP x TP on 8 processes, --compile with TP): the same check as
tests/multiprocess/parallel/test_parallel.py (4 SGD steps of the tiny lm with global-norm clipping, in fp32 and in
bf16 autocast; losses, norms, every weight and ctx.evaluate's result), with its tolerances.

Usage (from the repository root):

    PYTHONPATH=src:. python3 benchmarks/parallel_parity.py --layout dp_replicate=2,dp_shard=2,tp=2 -n 8
    PYTHONPATH=src:. python3 benchmarks/parallel_parity.py --layout tp=2 -n 2 --compile

Prints, per rank and precision, the largest difference from one process, then PASS or the
first difference over the tolerance (exit status 1).
"""

from __future__ import annotations

import argparse
import sys
import time

from tests.multiprocess.parallel.test_parallel import TOL, TOL_BF16, _assert_close, train

from dtrain.launch.local import run_distributed

# Inductor fuses and reorders float operations: tests/multiprocess/tasks/test_lm.py allows 1e-4 after 4 steps.
TOL_COMPILE = 1e-4


def largest(got: dict, ref: dict) -> str:
    losses = max(abs(a - b) for a, b in zip(got["losses"], ref["losses"]))
    norms = max(abs(a - b) for a, b in zip(got["norms"], ref["norms"]))
    weights = max((got["state"][k].float() - ref["state"][k].float()).abs().max().item() for k in ref["state"])
    return f"losses {losses:.2e}, norms {norms:.2e}, weights {weights:.2e}, eval count {got['eval']['count']}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layout", required=True)
    ap.add_argument("-n", "--nproc", type=int, required=True)
    ap.add_argument("--compile", action="store_true", help="torch.compile each block (after TP)")
    ap.add_argument("--task-arg", action="append", default=[], metavar="KEY=VALUE", help="e.g. tie=false (pp layouts)")
    ap.add_argument("--timeout", type=float, default=1800)
    a = ap.parse_args()
    task_args = dict(kv.split("=", 1) for kv in a.task_arg)
    switches = {"compile": True} if a.compile else None
    t0 = time.perf_counter()
    ref32, ref16 = train(None, None, task_args)
    ranks = run_distributed(train, a.layout, switches, task_args, world_size=a.nproc, timeout=a.timeout)
    print(f"--parallel {a.layout} on {a.nproc} processes{' with --compile' if a.compile else ''}: "
          f"{time.perf_counter() - t0:.0f} s wall", flush=True)
    failed = None
    for rank, (fp32, bf16) in enumerate(ranks):
        for name, got, ref, tol in (("fp32", fp32, ref32, TOL), ("bf16", bf16, ref16, TOL_BF16)):
            tol = max(tol, TOL_COMPILE) if a.compile else tol
            print(f"rank {rank} {name} (tolerance {tol:g}): {largest(got, ref)}")
            try:
                _assert_close(got, ref, tol)
            except AssertionError as exc:
                failed = failed or f"rank {rank} {name}: {str(exc).splitlines()[0][:300]}"
    print("FAIL: " + failed if failed else "PASS")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

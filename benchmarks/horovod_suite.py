"""Run Horovod's own PyTorch test file, unmodified, against ``dtrain.compat.horovod``.

    python benchmarks/horovod_suite.py --test-file PATH/test/parallel/test_torch.py -n 2 3

Fetches nothing: PATH is a copy of horovod/horovod's ``test/parallel/test_torch.py`` that the user
has. The script writes, in a temporary folder that goes first on ``sys.path``,

- a thin ``horovod`` package: ``horovod.torch`` re-exports ``dtrain.compat.horovod``;
- ``common.py`` with the three helpers the test file imports from Horovod's ``test/utils``
  (``mpi_env_rank_and_size``, ``skip_or_fail_gpu_test``, ``temppath``), written from their
  documented behaviour, so Horovod's own ``common.py`` (which needs ``horovod.runner``) is not used;
- ``worker.py``, which every rank runs under ``dtrain run -n N``: it sets the ``HOROVOD_*`` rank
  variables Horovod's gloo launcher would set (the tests read ``HOROVOD_RANK``), then runs the
  test file with pytest and writes one line per test outcome to ``rank<R>.jsonl`` as it goes
  (so a run killed by the time limit still reports what finished).

A test passes when it passed on every rank, fails when it failed on any rank, and is skipped when
every rank skipped it (Horovod's tests skip themselves without a GPU, MPI or CCL). The summary
and, with ``--json``, every test's outcome and first failure line are printed per world size.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"

SHIM_TORCH = '''"""horovod.torch, pointed at dtrain.compat.horovod (written by benchmarks/horovod_suite.py)."""
from dtrain.compat.horovod import *  # noqa: F401,F403
from dtrain.compat.horovod import __all__  # noqa: F401
'''

SHIM_ROOT = '''"""A thin horovod package for running Horovod's tests on dtrain (benchmarks/horovod_suite.py)."""
from dtrain.compat.horovod import __version__  # noqa: F401
'''

COMMON = '''"""The helpers Horovod's test_torch.py imports from test/utils/common.py, re-written."""
import contextlib
import os
import tempfile


def mpi_env_rank_and_size():
    """(rank, size) from an MPI launcher's variables; (0, 1) when not started by MPI."""
    for rank_var, size_var in (("PMI_RANK", "PMI_SIZE"), ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE")):
        if rank_var in os.environ and size_var in os.environ:
            return int(os.environ[rank_var]), int(os.environ[size_var])
    return 0, 1


def skip_or_fail_gpu_test(test, message):
    """A GPU test without a GPU fails when HOROVOD_TEST_GPU=1, else is skipped."""
    if int(os.environ.get("HOROVOD_TEST_GPU", 0)):
        test.fail(message)
    test.skipTest(message)


@contextlib.contextmanager
def temppath():
    with tempfile.TemporaryDirectory() as folder:
        yield os.path.join(folder, "temp_test_file")
'''

WORKER = '''"""Every rank: Horovod's gloo variables, then pytest on the test file, outcomes to rank<R>.jsonl."""
import json
import os
import sys

import pytest

env = os.environ
for hvd_name, name in (("HOROVOD_RANK", "RANK"), ("HOROVOD_SIZE", "WORLD_SIZE"),
                       ("HOROVOD_LOCAL_RANK", "LOCAL_RANK"), ("HOROVOD_LOCAL_SIZE", "LOCAL_WORLD_SIZE")):
    env[hvd_name] = env[name]
env["HOROVOD_CROSS_RANK"], env["HOROVOD_CROSS_SIZE"] = "0", "1"
test_file, out_dir, extra = sys.argv[1], sys.argv[2], sys.argv[3:]
log = open(os.path.join(out_dir, "rank%s.jsonl" % env["RANK"]), "w", buffering=1)


class Record:
    def pytest_runtest_logreport(self, report):
        if report.when == "call" or report.outcome != "passed":
            reason = ""
            if report.skipped and isinstance(report.longrepr, tuple):
                reason = report.longrepr[2]
            elif report.failed:
                reason = report.longreprtext.strip().splitlines()[-1:] and report.longreprtext.strip().splitlines()[-1]
            log.write(json.dumps({"test": report.nodeid.split("::")[-1], "when": report.when,
                                  "outcome": report.outcome, "reason": reason[:300]}) + "\\n")


ini = os.path.join(os.path.dirname(__file__), "pytest.ini")
code = pytest.main([test_file, "-c", ini, "--rootdir", os.path.dirname(ini), "--noconftest",
                    "-p", "no:cacheprovider", "-q", "-rN", *extra], plugins=[Record()])
sys.exit(0)
'''


def write_shim(folder: Path) -> None:
    (folder / "horovod" / "torch").mkdir(parents=True)
    (folder / "horovod" / "__init__.py").write_text(SHIM_ROOT)
    (folder / "horovod" / "torch" / "__init__.py").write_text(SHIM_TORCH)
    (folder / "common.py").write_text(COMMON)
    (folder / "worker.py").write_text(WORKER)
    (folder / "pytest.ini").write_text("[pytest]\naddopts =\n")


def merge(out_dir: Path, nproc: int) -> dict[str, dict]:
    """One verdict per test from every rank's outcomes."""
    per_test: dict[str, dict] = {}
    for r in range(nproc):
        path = out_dir / f"rank{r}.jsonl"
        lines = path.read_text().splitlines() if path.exists() else []
        for line in lines:
            rec = json.loads(line)
            entry = per_test.setdefault(rec["test"], {"outcomes": {}, "reason": ""})
            previous = entry["outcomes"].get(r)
            if previous != "failed":
                entry["outcomes"][r] = rec["outcome"]
            if rec["outcome"] != "passed" and not entry["reason"]:
                entry["reason"] = f"rank {r}: {rec['reason']}"
    for entry in per_test.values():
        seen = [entry["outcomes"].get(r, "missing") for r in range(nproc)]
        if all(s == "passed" for s in seen):
            entry["verdict"] = "passed"
        elif all(s == "skipped" for s in seen):
            entry["verdict"] = "skipped"
        else:
            entry["verdict"] = "failed"
            if "missing" in seen and not entry["reason"]:
                entry["reason"] = f"no outcome from rank(s) {[r for r, s in enumerate(seen) if s == 'missing']}"
        if entry["verdict"] == "passed":
            entry["reason"] = ""
    return per_test


def run_once(test_file: Path, nproc: int, timeout: float, extra: list[str], gloo_timeout: int) -> tuple[dict, float, int]:
    with tempfile.TemporaryDirectory(prefix="hvd-suite-") as tmp:
        folder = Path(tmp)
        write_shim(folder)
        out_dir = folder / "out"
        out_dir.mkdir()
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([str(folder), str(SRC), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        env.setdefault("HOROVOD_GLOO_TIMEOUT_SECONDS", str(gloo_timeout))
        cmd = [sys.executable, "-m", "dtrain", "run", "-n", str(nproc), "--run-dir", str(folder / "run"),
               str(folder / "worker.py"), str(test_file.resolve()), str(out_dir), *extra]
        start = time.perf_counter()
        try:
            proc = subprocess.run(cmd, env=env, cwd=folder, timeout=timeout, capture_output=True, text=True)
            rc = proc.returncode
            tail = (proc.stdout + proc.stderr)[-3000:]
        except subprocess.TimeoutExpired as exc:
            rc, tail = 124, f"timed out after {timeout:.0f} s\n{(exc.stderr or b'')[-2000:]!r}"
        elapsed = time.perf_counter() - start
        results = merge(out_dir, nproc)
        if rc != 0 or not results:
            print(f"-- dtrain run exited {rc}; last output:\n{tail}", file=sys.stderr)
        return results, elapsed, rc


def summarize(nproc: int, results: dict, elapsed: float) -> dict:
    counts = {v: sum(1 for e in results.values() if e["verdict"] == v) for v in ("passed", "failed", "skipped")}
    ran = counts["passed"] + counts["failed"]
    rate = counts["passed"] / ran if ran else 0.0
    print(f"== {nproc} processes: {len(results)} tests, {counts['passed']} passed, {counts['failed']} failed, "
          f"{counts['skipped']} skipped (need CUDA/MPI/CCL); pass rate of the tests that ran {rate:.1%}; "
          f"{elapsed:.0f} s")
    for name, e in sorted(results.items()):
        if e["verdict"] == "failed":
            print(f"   FAIL {name}: {e['reason'][:200]}")
    return {"nproc": nproc, "counts": counts, "pass_rate": rate, "seconds": round(elapsed, 1),
            "tests": {k: {"verdict": v["verdict"], "reason": v["reason"]} for k, v in sorted(results.items())}}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--test-file", required=True, type=Path, help="a copy of Horovod's test/parallel/test_torch.py")
    p.add_argument("-n", "--nproc", type=int, nargs="+", default=[2], help="world sizes to run (default 2)")
    p.add_argument("-k", default=None, help="pytest -k expression to run a subset")
    p.add_argument("--timeout", type=float, default=1500, help="seconds one world size may take (default 1500)")
    p.add_argument("--gloo-timeout", type=int, default=60,
                   help="HOROVOD_GLOO_TIMEOUT_SECONDS: how long a collective waits for a missing rank (default 60)")
    p.add_argument("--rerun-failed", action="store_true",
                   help="run each failed test again alone, in a fresh job, and report that outcome")
    p.add_argument("--show-skips", action="store_true", help="list each skipped test and its reason")
    p.add_argument("--json", type=Path, default=None, help="write every test's verdict here")
    args = p.parse_args()
    if not args.test_file.is_file():
        print(f"horovod_suite: error: --test-file {args.test_file} does not exist; give a copy of Horovod's "
              "test/parallel/test_torch.py.", file=sys.stderr)
        return 2
    extra = ["-k", args.k] if args.k else []
    report = []
    for n in args.nproc:
        results, elapsed, _ = run_once(args.test_file, n, args.timeout, extra, args.gloo_timeout)
        summary = summarize(n, results, elapsed)
        if args.rerun_failed:
            # A test that fails on some ranks only (e.g. an assertion on one rank's slice) leaves
            # the others waiting in a collective: the next tests then fail by timeout. Each failed
            # test alone, in a fresh job, says whether it fails by itself.
            failed = sorted(k for k, e in results.items() if e["verdict"] == "failed")
            start = time.perf_counter()
            for name in failed:
                alone, _, _ = run_once(args.test_file, n, 300, ["-k", f"{name} and not {name}_"], args.gloo_timeout)
                if name in alone:
                    results[name] = dict(alone[name], rerun=True)
            print(f"-- re-ran {len(failed)} failed test(s) one job each ({time.perf_counter() - start:.0f} s):")
            summary = summarize(n, results, elapsed)
            summary["rerun"] = failed
        report.append(summary)
        if args.show_skips:
            for name, e in sorted(results.items()):
                if e["verdict"] == "skipped":
                    print(f"   skip {name}: {e['reason'][:160]}")
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

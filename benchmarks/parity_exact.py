"""Every layout and named strategy, bit for bit, in two trees: each rank's exact results (losses,
gradient norms, evaluation, a hash of every weight, the comm record) of the tiny LM of
tests/multiprocess/parallel/test_parallel.py, as JSON, so a refactoring that promises "no change
of behaviour" (issue 30: one apply path for every layout) can be compared before and after.
A layout also runs the test's own check against one process (``pass``).

    # in each tree (a checkout of the commit before, and of the one after):
    PYTHONPATH=src:. python3 benchmarks/parity_exact.py run --out /tmp/parity/before
    PYTHONPATH=src:. python3 benchmarks/parity_exact.py compare /tmp/parity/before /tmp/parity/after

Runs are 1-8 gloo processes each (about 35 minutes for all on 2 cores); ``--only NAME`` picks some.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import pathlib
import sys
import time

#: (kind, name, processes, options): layouts go through dtrain.init(parallel=...), named ones by name.
CASES = [
    ("layout", "dp_replicate=2", 2, {}), ("layout", "dp_shard=2", 2, {}), ("layout", "pp=2", 2, {"tie": "false"}),
    ("layout", "tp=2", 2, {}), ("layout", "dp_shard=2,tp=2", 4, {}), ("layout", "dp_replicate=2,tp=2", 4, {}),
    ("layout", "dp_replicate=2,dp_shard=2", 4, {}), ("layout", "pp=2,dp_shard=2", 4, {"tie": "false"}),
    ("layout", "pp=2,dp_replicate=2", 4, {"tie": "false"}), ("layout", "pp=2,tp=2", 4, {"tie": "false"}),
    ("layout", "dp_replicate=2,dp_shard=2,tp=2", 8, {}),
    ("named", "ddp", 2, {}), ("named", "ddp", 2, {"comm": "powersgd:2"}), ("named", "zero1", 2, {}), ("named", "hvd", 2, {}),
    ("named", "fsdp", 2, {}), ("named", "hsdp", 2, {}), ("named", "hsdp", 2, {"shard_size": 1}),
    ("named", "pipeline", 2, {"tie": "false"}), ("named", "single", 1, {}),
]


def _tag(kind: str, name: str, opts: dict) -> str:
    return (f"{kind}-{name}" + "".join(f"-{k}_{v}" for k, v in sorted(opts.items()))).replace(",", "_").replace("=", "-")


def _digest(res: dict) -> dict:
    state = {k: hashlib.sha1(v.float().contiguous().numpy().tobytes()).hexdigest()[:16] for k, v in sorted(res["state"].items())}
    return {"losses": res["losses"], "norms": res["norms"], "eval": res["eval"], "strategy": res["strategy"], "state": state}


def _named(name: str, options: dict, task_args: dict, comm: str | None) -> tuple:
    import torch
    from tests.multiprocess.parallel.test_parallel import TINY, _steps

    import dtrain
    from dtrain.tasks import load_task

    task = load_task("lm", options={**TINY, **task_args})
    ctx = dtrain.init(name, seed=0, comm=comm, **options)
    out = _steps(ctx, task, torch.float32), _steps(ctx, task, torch.bfloat16)
    record = ctx.strategy.comm_record()
    ctx.close()
    return (*out, record)


def run_case(kind: str, name: str, n: int, opts: dict) -> dict:
    from tests.multiprocess.parallel.test_parallel import TOL, TOL_BF16, _assert_close, train

    from dtrain.launch.local import run_distributed

    task_args = {k: v for k, v in opts.items() if k == "tie"}
    start = time.perf_counter()
    out: dict = {"kind": kind, "name": name, "n": n, "opts": opts}
    if kind == "layout":
        ref = train(None, None, task_args)
        ranks = run_distributed(train, name, None, task_args, world_size=n, timeout=2400)
        ok = True
        for fp32, bf16 in ranks:
            for got, want, tol in ((fp32, ref[0], TOL), (bf16, ref[1], TOL_BF16)):
                try:
                    _assert_close(got, want, tol)
                except AssertionError:
                    ok = False
        out["pass"] = ok
        out["ranks"] = [{"fp32": _digest(f), "bf16": _digest(b)} for f, b in ranks]
    else:
        options = {k: v for k, v in opts.items() if k not in ("tie", "comm")}
        ranks = run_distributed(_named, name, options, task_args, opts.get("comm"), world_size=n, timeout=2400)
        out["ranks"] = [{"fp32": _digest(f), "bf16": _digest(b), "comm_record": r} for f, b, r in ranks]
    out["wall_s"] = round(time.perf_counter() - start)
    return out


def compare(before: pathlib.Path, after: pathlib.Path) -> int:
    differ = 0
    for b in sorted(before.glob("*.json")):
        a = after / b.name
        if not a.exists():
            print(f"{b.stem}: missing in {after}")
            differ += 1
            continue
        jb, ja = json.loads(b.read_text()), json.loads(a.read_text())
        diffs = [f"rank {r} {key}" for r, (rb, ra) in enumerate(zip(jb["ranks"], ja["ranks"]))
                 for key in ("fp32", "bf16", "comm_record") if rb.get(key) != ra.get(key)]
        verdict = "identical" if not diffs else "DIFFERS: " + ", ".join(diffs[:4])
        checks = f" (one-process check: before {jb['pass']}, after {ja['pass']})" if "pass" in jb else ""
        print(f"{b.stem}: {verdict}{checks}; wall {jb['wall_s']} s -> {ja['wall_s']} s")
        differ += bool(diffs)
    return 1 if differ else 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--out", required=True, type=pathlib.Path)
    r.add_argument("--only", action="append", default=[], help="a case's tag (see the file names); repeatable")
    c = sub.add_parser("compare")
    c.add_argument("before", type=pathlib.Path)
    c.add_argument("after", type=pathlib.Path)
    a = p.parse_args()
    if a.cmd == "compare":
        return compare(a.before, a.after)
    a.out.mkdir(parents=True, exist_ok=True)
    for kind, name, n, opts in CASES:
        tag = _tag(kind, name, opts)
        if (a.only and tag not in a.only) or (a.out / f"{tag}.json").exists():
            continue
        (a.out / f"{tag}.json").write_text(json.dumps(run_case(kind, name, n, opts), indent=1))
        print("done", tag, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

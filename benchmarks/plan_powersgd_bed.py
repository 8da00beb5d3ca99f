"""Where `dtrain plan`'s PowerSGD step differs from a real one (issue 52, item 2): on a two-host bed
(tests.support.netbed), each host one gloo rank, the LM (or MLP) of plan_validation.py under
``--comm powersgd:2``, this prints per step, medians over the steps after the warm-up:

* ``hook_ms``: from DDP calling the hook (backward done) to its future's end: the compression's
  work plus its three all-reduces (uncompressed tensors, P, Q), as training pays them;
* ``chain_ms``: the three all-reduces alone, of the same sizes, issued one after another after a
  compute-long pause (``--gap-ms``), as the hook issues them;
* ``compress_ms``: the hook's work in a world of one on the same model (what the plan's profile
  measures as backward's extra);
* the plan's figure for the three: ``3 x t(64 B) + bytes / bandwidth`` from `dtrain doctor`'s own
  timing of the all-reduce at 64 B, 1 MiB and 4 MiB (diag.probe).

    flock /tmp/dtrain-bench.lock nice -n 5 python3 benchmarks/plan_powersgd_bed.py [--rate 20] [--task lm]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
SRC = os.path.join(os.path.dirname(HERE), "src")
sys.path.insert(0, SRC)
sys.path.insert(0, os.path.dirname(HERE))

TASKS = {"lm": (["layers=2", "width=64", "heads=2", "context=64", "max_bytes=200000", "tie=false"], 16),
         "synthetic": (["hidden=512", "samples=8192"], 64)}


def sizes(model, rank: int) -> tuple[int, int, int]:
    """Elements of the uncompressed tensors, P and Q (torch's hook's rule)."""
    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import _should_compress

    unc = p = q = 0
    for t in model.parameters():
        n = t.shape[0] if t.dim() else 1
        m = t.numel() // max(1, n)
        r = min(n, m, rank)
        if _should_compress(n, m, r, 2)[0]:
            p, q = p + n * r, q + m * r
        else:
            unc += t.numel()
    return unc, p, q


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from dtrain.comm import CommSpec, bucket_mb
    from dtrain.comm.methods import build
    from dtrain.diag.probe import LINK_SIZES, _sized_time
    from dtrain.plan.costs import fit
    from dtrain.plan.machinery import sample_batch
    from dtrain.tasks import load_task, make_optimizer
    from dtrain.world import netif

    torch.set_num_threads(1)
    os.environ.update(netif.socket_env(args.master, os.environ))
    world = 1 if args.single else 2
    dist.init_process_group("gloo", init_method=f"tcp://{args.master}:{args.port}", rank=args.rank, world_size=world)
    task_args, batch = TASKS[args.task]
    task = load_task(args.task, data_dir=None, options=dict(a.split("=", 1) for a in task_args))
    x, y = sample_batch(task, batch)
    torch.manual_seed(0)
    model = task.new_model()
    comm = CommSpec.parse("powersgd:2", warmup=2)
    ddp = DistributedDataParallel(model, bucket_cap_mb=bucket_mb(model, comm, 25), gradient_as_bucket_view=True)
    method = build("powersgd", rank=2, period=0, warmup=2)
    marks: list[float] = []

    def timed(state, bucket):  # noqa: ANN001, ANN202 - DDP checks a hook's annotations against its own classes
        t0 = time.perf_counter()

        def done(f):  # noqa: ANN001, ANN202
            marks.append(time.perf_counter() - t0)
            return f.value()
        return method.communicate(bucket).then(done)
    ddp.register_comm_hook(None, timed)
    opt = make_optimizer("adamw", ddp.parameters(), task.lr)
    steps = []
    for i in range(args.steps):
        t0 = time.perf_counter()
        loss = task.loss_fn(ddp(x), y)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        opt.step()
        opt.zero_grad(set_to_none=True)
        steps.append((t1 - t0, t2 - t1, time.perf_counter() - t2))
    skip = 5
    out = {"hook_ms": statistics.median(marks[skip:]) * 1e3,
           "backward_ms": statistics.median(s[1] for s in steps[skip:]) * 1e3,
           "forward_ms": statistics.median(s[0] for s in steps[skip:]) * 1e3,
           "step_ms": statistics.median(sum(s) for s in steps[skip:]) * 1e3}
    if world > 1:
        unc, p, q = sizes(model, 2)
        bufs = [torch.ones(max(1, k)) for k in (unc, p, q)]
        chain = []
        for _ in range(args.steps):
            time.sleep(args.gap_ms / 1e3)
            t0 = time.perf_counter()
            for b in bufs:
                dist.all_reduce(b)
            chain.append(time.perf_counter() - t0)
        cpu = torch.device("cpu")
        probe = {s: _sized_time(lambda s=s: dist.all_reduce(torch.ones(max(1, s // 4))), cpu, s, 3) for s in LINK_SIZES}
        f = fit("all_reduce", probe, 2)
        sent = (unc + p + q) * 4
        out |= {"chain_ms": statistics.median(chain[skip:]) * 1e3, "elements": [unc, p, q],
                "probe_ms": {s: round(v * 1e3, 3) for s, v in probe.items()},
                "plan_three_ms": (3 * 2 * f.lat + sent / f.bw) * 1e3, "plan_latency_ms": 3 * 2 * f.lat * 1e3}
    if args.rank == 0:
        print(json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in out.items()}), flush=True)
    dist.destroy_process_group()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rate", type=float, default=20.0, help="Mbit/s of each host's link")
    p.add_argument("--task", default="lm", choices=sorted(TASKS))
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--gap-ms", type=float, default=40.0)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--single", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--master", default="127.0.0.1", help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=29710, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args)
        return 0
    import subprocess

    from tests.support.netbed import NetBed

    env = {**os.environ, "PYTHONPATH": SRC}
    base = [sys.executable, os.path.abspath(__file__), "--worker", "--task", args.task, "--steps", str(args.steps),
            "--gap-ms", str(args.gap_ms)]
    single = subprocess.run([*base, "--single", "--port", "29709"], capture_output=True, text=True, env=env, timeout=600)
    print("world of one:", single.stdout.strip() or single.stderr[-2000:], flush=True)
    with NetBed(hosts=2, rate_mbit=args.rate) as bed:
        outs = bed.run_nodes(lambda r, master: [*base, "--rank", str(r), "--master", master], timeout=600, env=env)
    for o in outs:
        if o.returncode:
            print(o.output[-3000:])
    print(f"bed {args.rate:g} Mbit/s:", outs[0].output.strip().splitlines()[-1] if outs[0].output.strip() else "-", flush=True)
    print(f"load {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The parts of a PowerSGD step and a local SGD step on the network test bed, beside what `dtrain plan`
counts for them (issue 52, item 2: the plan's pick between ``ddp --comm powersgd:2`` and ``ddp --comm
localsgd:16`` flipped from run to run of benchmarks/plan_validation.py).

On two bed hosts (tests.support.netbed), one gloo rank each, the validation's model and batch (``lm``:
its LM at 20 Mbit/s, ``synthetic``: its MLP at 100 Mbit/s), each method as `dtrain train` builds it
(``dtrain.comm.attach``, ``--comm-warmup 2``), 42 steps; every ``torch.distributed.all_reduce`` is
timed from its issue to its end. Per method, medians over steps 10-42 unless said:

* ``backward_ms``: from backward's start to DDP calling the hook (the gradients ready);
* PowerSGD: ``compress_ms`` (the hook's own call: error feedback, the uncompressed rest's all-reduce
  issued, P = M Q), ``allreduce_ms`` (each of its three from its issue: the uncompressed rest, whose
  time holds P = M Q, then P, then Q), ``between_ms`` (the work between
  them: orthogonalising P, Q = M^T P), ``decompress_ms`` (the last all-reduce's end -> the hook's end);
* local SGD: ``average_ms`` (the averaging step's parameter all-reduce, on the steps that run it);
* ``step_mean_ms`` (wall time over the window, as plan_validation.py measures a run: each 16th
  step's average included) and ``step_median_ms`` (the median step, which leaves the average out);
* in a world of one (``single``): the same step, what the plan's profile sees of each method's work.

Beside them, the plan's figures from the link as `dtrain doctor` measures it (diag.probe: the all-reduce
at 64 B, 1 MiB and 4 MiB, ``costs.fit``): PowerSGD's three all-reduces and local SGD's average.

    measure env PYTHONPATH=src python3 benchmarks/plan_comm_parts.py [--task lm|synthetic|both] [--steps 42]
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
sys.path.insert(0, HERE)

TASKS = {"lm": (["layers=2", "width=64", "heads=2", "context=64", "max_bytes=200000", "tie=false"], 16, 20.0),
         "synthetic": (["hidden=512", "samples=8192"], 64, 100.0)}
"""Task args, batch per rank and the link's Mbit/s of plan_validation.py's lm-20m and mlp-100m groups."""
WINDOW = 10
"""Steps before the window (plan_validation.py's first --metrics-file record)."""


def med(xs: list[float]) -> float | None:
    return round(statistics.median(xs) * 1e3, 3) if xs else None


def one_method(comm_text: str, task, x, y, steps: int) -> dict:  # noqa: ANN001
    """``steps`` steps of ``comm_text`` with every all-reduce and the hook timed; medians (ms) of the parts."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from dtrain.comm import CommSpec, attach, bucket_mb
    from dtrain.tasks import make_optimizer

    torch.manual_seed(0)
    model = task.new_model()
    spec = CommSpec.parse(comm_text, warmup=2)
    ddp = DistributedDataParallel(model, bucket_cap_mb=bucket_mb(model, spec, 25), gradient_as_bucket_view=True)
    method = attach(ddp, spec)
    events: list[tuple[str, float, float | None, int]] = []  # (what, start, end, bytes); end None until done
    real = dist.all_reduce

    def timed_all_reduce(tensor, *a, **kw):  # noqa: ANN001, ANN002, ANN003, ANN202
        t0 = time.perf_counter()
        work = real(tensor, *a, **kw)
        idx = len(events)
        events.append(("all_reduce", t0, None, tensor.numel() * tensor.element_size()))
        if kw.get("async_op"):
            def done(f):  # noqa: ANN001, ANN202
                events[idx] = (*events[idx][:2], time.perf_counter(), events[idx][3])
                return f.value()
            work.get_future().then(done)
        else:
            events[idx] = (*events[idx][:2], time.perf_counter(), events[idx][3])
        return work
    dist.all_reduce = timed_all_reduce

    marks: dict[str, float] = {}
    inner = method.communicate if method is not None else None

    def hooked(bucket):  # noqa: ANN001, ANN202
        marks["hook"] = time.perf_counter()
        fut = inner(bucket)
        marks["hook_returned"] = time.perf_counter()

        def end(f):  # noqa: ANN001, ANN202
            marks["hook_end"] = time.perf_counter()
            return f.value()
        return fut.then(end)
    if method is not None:
        method.communicate = hooked
    opt = make_optimizer("adamw", ddp.parameters(), task.lr)
    rows = []
    try:
        for i in range(steps):
            events.clear()
            marks.clear()
            t0 = time.perf_counter()
            loss = task.loss_fn(ddp(x), y)
            t1 = time.perf_counter()
            loss.backward()
            t2 = time.perf_counter()
            opt.step()
            t3 = time.perf_counter()
            if method is not None:
                method.after_step(opt)
            t4 = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            t5 = time.perf_counter()
            in_hook = [e for e in events if e[1] < t2]
            after = [e for e in events if e[1] >= t3]
            rows.append({"step": i + 1, "forward": t1 - t0, "backward_call": t2 - t1, "optimizer": t3 - t2,
                         "after_step": t4 - t3, "total": t5 - t0,
                         "to_hook": marks.get("hook", t2) - t1, "hook_sync": marks.get("hook_returned", t2) - marks.get("hook", t2), "hook": marks.get("hook_end", t2) - marks.get("hook", t2),
                         "hook_ars": [(s - marks.get("hook", t1), (e or t2) - s, b) for _, s, e, b in in_hook],
                         "after_ars": [((e or t4) - s, b) for _, s, e, b in after]})
    finally:
        dist.all_reduce = real
    return summarise(comm_text, rows)


def summarise(comm_text: str, rows: list[dict]) -> dict:
    win = [r for r in rows if r["step"] > WINDOW]
    out = {"comm": comm_text, "steps": len(win),
           "forward_ms": med([r["forward"] for r in win]), "backward_ms": med([r["to_hook"] for r in win]),
           "hook_ms": med([r["hook"] for r in win]), "optimizer_ms": med([r["optimizer"] for r in win]),
           "step_mean_ms": round(statistics.mean(r["total"] for r in win) * 1e3, 3),
           "step_median_ms": med([r["total"] for r in win])}
    if comm_text.startswith("powersgd"):
        full = [r for r in win if len(r["hook_ars"]) == 3]
        if full:
            ars = [[a for _, a, _ in r["hook_ars"]] for r in full]
            out["compress_ms"] = med([r["hook_sync"] for r in full])
            out["allreduce_ms"] = [med([a[k] for a in ars]) for k in range(3)]
            out["allreduce_bytes"] = [b for _, _, b in full[0]["hook_ars"]]
            out["between_ms"] = [med([r["hook_ars"][k + 1][0] - r["hook_ars"][k][0] - r["hook_ars"][k][1] for r in full]) for k in range(2)]
            out["decompress_ms"] = med([r["hook"] - r["hook_ars"][2][0] - r["hook_ars"][2][1] for r in full])
    if comm_text.startswith("localsgd"):
        avg = [r for r in win if r["after_ars"]]
        out["averages_in_window"] = [r["step"] for r in avg]
        out["average_ms"] = med([r["after_step"] for r in avg])
        out["average_allreduce_ms"] = med([sum(a for a, _ in r["after_ars"]) for r in avg])
        out["average_bytes"] = sum(b for _, b in avg[0]["after_ars"]) if avg else None
        out["after_step_other_ms"] = med([r["after_step"] for r in win if not r["after_ars"]])
    return out


def small_all_reduces(calls: int = 45, gap_s: float = 0.02) -> dict:
    """A 64-byte all-reduce timed three ways (ms, mean of the middle 90% as diag.probe keeps it): after a
    barrier (the doctor's way), after ``gap_s`` of idle (a step's compute; no barrier), and the second and
    third of three issued back to back (PowerSGD's chain)."""
    import torch
    import torch.distributed as dist

    from dtrain.diag.probe import expected_time

    t = torch.ones(16)
    dist.all_reduce(t)
    barrier, gap, chained = [], [], []
    for _ in range(calls):
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_reduce(t)
        barrier.append(time.perf_counter() - t0)
        dist.barrier()
        time.sleep(gap_s)
        t0 = time.perf_counter()
        dist.all_reduce(t)
        t1 = time.perf_counter()
        dist.all_reduce(t)
        dist.all_reduce(t)
        gap.append(t1 - t0)
        chained.append((time.perf_counter() - t1) / 2)
    def spread(v: list[float]) -> list[float]:  # p10, p50, p90 (ms)
        v = sorted(v)
        return [round(v[int(q * (len(v) - 1))] * 1e3, 3) for q in (0.1, 0.5, 0.9)]
    named = (("after_barrier", barrier), ("after_gap", gap), ("chained", chained))
    return {**{f"{k}_ms": round(expected_time(v) * 1e3, 3) for k, v in named}, **{f"{k}_p10_p50_p90": spread(v) for k, v in named}}


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from plan_bed import sized_fit

    from dtrain.diag.probe import LINK_SIZES, _sized_time
    from dtrain.plan.costs import fit
    from dtrain.plan.machinery import sample_batch
    from dtrain.tasks import load_task
    from dtrain.world import netif

    torch.set_num_threads(1)
    os.environ.update(netif.socket_env(args.master, os.environ))
    world = 1 if args.single else 2
    dist.init_process_group("gloo", init_method=f"tcp://{args.master}:{args.port}", rank=args.rank, world_size=world)
    task_args, batch, _ = TASKS[args.task]
    task = load_task(args.task, data_dir=None, options=dict(a.split("=", 1) for a in task_args))
    x, y = sample_batch(task, batch)
    out: dict = {"task": args.task, "world": world}
    if args.small_only:
        print(json.dumps({**out, "small": small_all_reduces(args.steps)}) if args.rank == 0 else "", flush=True)
        dist.destroy_process_group()
        return
    for comm in ("powersgd:2", "localsgd:16", "none"):
        out[comm] = one_method(comm, task, x, y, args.steps)
    if world > 1:
        cpu = torch.device("cpu")
        probe = {s: _sized_time(lambda s=s: dist.all_reduce(torch.ones(max(1, s // 4))), cpu, s, 3) for s in LINK_SIZES}
        f, bed = fit("all_reduce", probe, 2), sized_fit("all_reduce", probe, 2)
        sent = sum(out["powersgd:2"].get("allreduce_bytes") or [0])
        params = out["localsgd:16"].get("average_bytes") or 0
        # the plan's: one all-reduce of what PowerSGD sends plus two of 4 bytes; the parameters' all-reduce
        # (per 16 steps); the bed's plan (plan_bed.sized_fit: its shaper's per-size rates and burst) beside it
        three = lambda g: g.seconds("all_reduce", sent, 2) + 2 * g.seconds("all_reduce", 4, 2)  # noqa: E731
        out["plan"] = {"probe_ms": {s: round(v * 1e3, 3) for s, v in probe.items()}, "latency_ms": round(f.lat * 1e3, 3),
                       "gbit": round(f.bw * 8 / 1e9, 4), "powersgd_three_ms": round(three(f) * 1e3, 3),
                       "average_ms": round(f.seconds("all_reduce", params, 2) * 1e3, 3),
                       "bed_powersgd_three_ms": round(three(bed) * 1e3, 3),
                       "bed_average_ms": round(bed.seconds("all_reduce", params, 2) * 1e3, 3)}
        out["small"] = small_all_reduces()
    if args.rank == 0:
        print(json.dumps(out), flush=True)
    dist.destroy_process_group()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--task", default="both", choices=[*sorted(TASKS), "both"])
    p.add_argument("--steps", type=int, default=42)
    p.add_argument("--rate", type=float, default=None, help="Mbit/s of each host's link (default: the group's, 20 or 100)")
    p.add_argument("--out", default=None, help="append each result as a JSON line here")
    p.add_argument("--small-only", action="store_true", help="only the 64-byte all-reduce, --steps times each way")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--single", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--master", default="127.0.0.1", help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=29720, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args)
        return 0
    import subprocess

    from tests.support.netbed import NetBed

    env = {**os.environ, "PYTHONPATH": SRC}
    for task in (sorted(TASKS) if args.task == "both" else [args.task]):
        base = [sys.executable, os.path.abspath(__file__), "--worker", "--task", task, "--steps", str(args.steps)]
        base += ["--small-only"] if args.small_only else []
        lines = []
        if not args.small_only:
            single = subprocess.run([*base, "--single", "--port", "29719"], capture_output=True, text=True, env=env, timeout=600)
            lines.append(single.stdout.strip() or json.dumps({"error": single.stderr[-2000:]}))
        rate = args.rate or TASKS[task][2]
        with NetBed(hosts=2, rate_mbit=rate) as bed:
            outs = bed.run_nodes(lambda r, master: [*base, "--rank", str(r), "--master", master], timeout=600, env=env)
        for o in outs:
            if o.returncode:
                print(o.output[-3000:], file=sys.stderr)
        lines.append(next((ln for ln in reversed(outs[0].output.splitlines()) if ln.startswith("{")), "{}"))
        for ln in lines:
            rec = {**json.loads(ln), "rate_mbit": rate, "load": round(os.getloadavg()[0], 2),
                   "utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime())}
            print(json.dumps(rec), flush=True)
            if args.out:
                with open(args.out, "a") as fh:
                    fh.write(json.dumps(rec) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

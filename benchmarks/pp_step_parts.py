"""The parts of one 2-stage pipeline step on two bed hosts (issue 52 item 2: the plan's ``pp=2`` on
lm-20m came out 38% under its measured step in bed run 44, 123 against 199 ms).

Each host runs one stage of the validation's LM (benchmarks/plan_validation.py's ``lm-20m``: batch 16,
4 micro-batches, torch's Schedule1F1B, the stage cut as ``dtrain train --strategy pipeline`` cuts it),
then the loss broadcast and the optimizer, as dtrain's ``Pipe`` does. torch's schedule helpers are
wrapped with timers (nothing in src/ changes): each forward, backward and loss; each send fired,
receive posted and each wait's end. Both hosts' processes share this machine's monotonic clock, so
each hand-off is followed from its send to its arrival: it starts at the later of the send and the
receive's post, and arrives where the receiver's wait ends. Per step (medians over ``--steps``):
compute per stage, each hand-off's time alone or while one goes the other way, the step; then the
plan's schedule (``dtrain.plan.steps.makespan``) fed with these measured parts, with and without
the crossing hand-offs' own measured time.

    python benchmarks/pp_step_parts.py --rate 20 [--steps 15] [--out rows.jsonl]

(root, ``ip netns``; under the lock: ``measure python3 benchmarks/pp_step_parts.py ...``)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bed_pair import on_bed  # noqa: E402

LM = {"layers": "2", "width": "64", "heads": "2", "context": "64", "max_bytes": "200000", "tie": "false"}


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B
    from torch.distributed.pipelining import schedules as sched

    from dtrain.parallel.pipeline import PipelineConfig, split_stage
    from dtrain.plan.machinery import sample_batch
    from dtrain.tasks import load_task, make_optimizer

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://{args.master}:{args.port}", rank=args.rank, world_size=2)
    task = load_task("lm", options=LM)
    torch.manual_seed(0)
    model = task.new_model()
    module = split_stage(model, args.rank, 2, PipelineConfig(), list(task.blocks(model)))
    m = args.microbatches
    stage = PipelineStage(module, args.rank, 2, torch.device("cpu"))
    schedule = Schedule1F1B(stage, n_microbatches=m, loss_fn=lambda out, t: task.loss_fn(out, t) / m, scale_grads=False)
    opt = make_optimizer("adamw", module.parameters(), task.lr)
    x, y = sample_batch(task, args.batch)
    events: list[tuple] = []  # (what, micro-batch or kind, start, end)
    tags: dict[int, tuple[str, int]] = {}  # id(P2POp) -> ("act"|"grad", micro-batch)

    def tagged(fn, kind):
        def get(mb, *a, **k):
            ops = fn(mb, *a, **k)
            for op in ops:
                tags[id(op)] = (kind, mb)
            return ops
        return get
    stage.get_fwd_send_ops = tagged(stage.get_fwd_send_ops, "act")
    stage.get_fwd_recv_ops = tagged(stage.get_fwd_recv_ops, "act")
    stage.get_bwd_send_ops = tagged(stage.get_bwd_send_ops, "grad")
    stage.get_bwd_recv_ops = tagged(stage.get_bwd_recv_ops, "grad")

    def timed(fn, what):
        def run(mb, *a, **k):
            t0 = time.perf_counter()
            out = fn(mb, *a, **k)
            events.append((what, mb, t0, time.perf_counter()))
            return out
        return run
    stage.forward_one_chunk = timed(stage.forward_one_chunk, "F")
    stage.backward_one_chunk = timed(stage.backward_one_chunk, "B")

    batch_p2p, owner = sched._batch_p2p, {}

    def fire(ops, desc=None):
        t = time.perf_counter()
        works = batch_p2p(ops, desc)
        for op in ops:
            kind, mb = tags.get(id(op), ("?", -1))
            events.append(("send" if op.op is dist.isend else "post", (kind, mb), t, t))
        if len(works) == len(ops):
            for w, op in zip(works, ops):
                owner[id(w)] = ("send" if op.op is dist.isend else "recv", tags.get(id(op), ("?", -1)))
        return works

    def wait(works):
        for w in works:
            t0 = time.perf_counter()
            w.wait()
            what, key = owner.pop(id(w), ("wait", ("?", -1)))
            events.append((what + "_done", key, t0, time.perf_counter()))
    sched._batch_p2p, sched._wait_batch_p2p = fire, wait

    steps = []
    for i in range(args.warmup + args.steps):
        events.clear()
        dist.barrier()
        t0 = time.perf_counter()
        losses: list = []
        if args.rank == 0:
            schedule.step(x)
        else:
            schedule.step(target=y, losses=losses)
        t1 = time.perf_counter()
        mean = torch.stack([v.detach() for v in losses]).sum() if losses else torch.zeros(())
        dist.broadcast(mean, src=1)
        t2 = time.perf_counter()
        opt.step()
        opt.zero_grad(set_to_none=True)
        t3 = time.perf_counter()
        if i >= args.warmup:
            steps.append({"start": t0, "schedule": t1 - t0, "loss_bcast": t2 - t1, "optimizer": t3 - t2, "step": t3 - t0,
                          "events": [list(e) for e in events]})
    both = [None, None]
    dist.all_gather_object(both, steps)
    if args.rank == 0:
        print(json.dumps({"ranks": both}), flush=True)
    dist.destroy_process_group()


def transfers(r0: dict, r1: dict) -> list[dict]:
    """Each hand-off of one step: sender's fire, receiver's post, start (the later), arrival (the receiver's wait end)."""
    out = []
    for kind, sender, receiver in (("act", r0, r1), ("grad", r1, r0)):
        fired = {tuple(e[1])[1]: e[2] for e in sender["events"] if e[0] == "send" and e[1][0] == kind}
        posted = {tuple(e[1])[1]: e[2] for e in receiver["events"] if e[0] == "post" and e[1][0] == kind}
        arrived = {tuple(e[1])[1]: e[3] for e in receiver["events"] if e[0] == "recv_done" and e[1][0] == kind}
        for mb in sorted(fired):
            if mb in posted and mb in arrived:
                start = max(fired[mb], posted[mb])
                out.append({"kind": kind, "mb": mb, "start": start, "end": arrived[mb], "ms": (arrived[mb] - start) * 1e3})
    for t in out:  # the time it overlapped a hand-off going the other way
        t["crossed_ms"] = sum(max(0.0, min(t["end"], o["end"]) - max(t["start"], o["start"])) for o in out
                              if o["kind"] != t["kind"]) * 1e3
    return out


def summarise(ranks: list[list[dict]], rate: float, hop_bytes: int, microbatches: int) -> dict:
    from dtrain.plan.steps import makespan

    med = statistics.median
    rows = []
    for r0, r1 in zip(*ranks):
        xs = transfers(r0, r1)
        comp = [{w: sum(e[3] - e[2] for e in r["events"] if e[0] == w) * 1e3 for w in ("F", "B")} for r in (r0, r1)]
        rows.append({"step": max(r0["step"], r1["step"]) * 1e3, "schedule": max(r0["schedule"], r1["schedule"]) * 1e3,
                     "optimizer": [r0["optimizer"] * 1e3, r1["optimizer"] * 1e3], "loss_bcast": r0["loss_bcast"] * 1e3,
                     "compute": comp, "alone": [t["ms"] for t in xs if t["crossed_ms"] < 0.5],
                     "crossing": [t["ms"] for t in xs if t["crossed_ms"] >= 0.5],
                     **{f"crossing_{k}": [t["ms"] for t in xs if t["crossed_ms"] >= 0.5 and t["kind"] == k] for k in ("act", "grad")},
                     "crossed_share": [t["crossed_ms"] / t["ms"] for t in xs if t["crossed_ms"] >= 0.5 and t["ms"] > 0],
                     "handoffs": [(t["kind"], t["mb"], round((t["start"] - r0["start"]) * 1e3, 2), round(t["ms"], 2)) for t in xs]})
    flat = lambda key: [v for r in rows for v in r[key]]  # noqa: E731
    out = {"rate_mbit": rate, "steps": len(rows), "hop_bytes": hop_bytes, "bytes_ms": round(hop_bytes * 8 / (rate * 1e6) * 1e3, 2),
           "step_ms": med(r["step"] for r in rows), "schedule_ms": med(r["schedule"] for r in rows),
           "loss_bcast_ms": med(r["loss_bcast"] for r in rows),
           "optimizer_ms": [med(r["optimizer"][s] for r in rows) for s in (0, 1)],
           "compute_ms": [{w: med(r["compute"][s][w] for r in rows) for w in ("F", "B")} for s in (0, 1)],
           "handoff_alone_ms": med(flat("alone")) if flat("alone") else None,
           "handoff_crossing_ms": med(flat("crossing")) if flat("crossing") else None,
           "crossing_handoffs": len(flat("crossing")) / len(rows),
           "crossing_by_kind_ms": {k: med(flat(f"crossing_{k}")) if flat(f"crossing_{k}") else None for k in ("act", "grad")}, "example_step": rows[len(rows) // 2]["handoffs"]}
    # the plan's schedule fed with these parts: the busiest stage's compute per micro-batch, each hand-off its time alone
    busy = max(out["compute_ms"], key=lambda c: c["F"] + c["B"])
    fwd, bwd = busy["F"] / microbatches / 1e3, busy["B"] / microbatches / 1e3
    alone = (out["handoff_alone_ms"] or out["bytes_ms"]) / 1e3
    out["makespan_alone_ms"] = makespan(2, microbatches, fwd, bwd, alone) * 1e3
    if out["handoff_crossing_ms"]:  # every hand-off at its crossing time where hand-offs cross
        crossing = out["handoff_crossing_ms"] / 1e3
        n_cross = out["crossing_handoffs"]
        mean_hop = (n_cross * crossing + (2 * microbatches - n_cross) * alone) / (2 * microbatches)
        out["makespan_mean_hop_ms"] = makespan(2, microbatches, fwd, bwd, mean_hop) * 1e3
    return {k: round(v, 2) if isinstance(v, float) else v for k, v in out.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--master", default="127.0.0.1", help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=29861)
    p.add_argument("--rate", type=float, default=20.0, help="Mbit/s of each host's link (the validation's lm-20m: 20)")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--steps", type=int, default=15)
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if args.worker:
        worker(args)
        return
    me = [sys.executable, os.path.abspath(__file__), "--worker", "--port", str(args.port), "--batch", str(args.batch),
          "--microbatches", str(args.microbatches), "--warmup", str(args.warmup), "--steps", str(args.steps)]
    got = on_bed(lambda r, master: [*me, "--rank", str(r), "--master", master], args.rate, args.timeout, "pp_step_parts")
    hop = args.batch // args.microbatches * int(LM["context"]) * int(LM["width"]) * 4
    row = {**summarise(got["ranks"], args.rate, hop, args.microbatches), "load1": round(os.getloadavg()[0], 2),
           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    print(json.dumps(row))
    if args.out:
        with open(args.out, "a") as fh:
            fh.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()

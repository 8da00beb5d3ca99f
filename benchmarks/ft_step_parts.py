"""What fault tolerance adds to a step, without the step: two replica groups (one process each, one
thread) against a Lighthouse on this host, each "step" dtrain's per-step calls with no forward or
backward (``Session.quorum``, ``Session.average_gradients`` of the MNIST net's 1.2M gradients, the
vote ``Session.should_commit``), against a plain gloo all-reduce of the same buffer between two
processes (what a DDP step all-reduces). Medians over ``--steps`` after 20, per process, in ms.

``--backward B`` times the average with the step's backward too (the MNIST net on B random images
a group): forward+backward alone (``fb``), then followed by the flat average (``fb_flat``), then with
the average overlapped (``fb_overlap``, ``dtrain.ft.overlap``): ``fb_x - fb`` is what stays exposed.

    flock /tmp/dtrain-bench.lock nice -n 5 python3 benchmarks/ft_step_parts.py --json FILE
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "src"))
SKIP = 20


def _ms(values: list[float]) -> float:
    return round(statistics.median(values[SKIP:]) * 1000, 2)


def _grads():
    import torch

    from dtrain.tasks.models import MnistNet

    torch.set_num_threads(1)
    model = MnistNet()
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    return model


def ft_side(replica: str, lighthouse: str, steps: int, out, backward: int = 0) -> None:
    from dtrain.ft.session import Session, quiet_torchft
    from dtrain.ft.spec import FaultTolerance

    quiet_torchft()
    model = _grads()
    session = Session(FaultTolerance(min_replicas=2), replica_id=replica, lighthouse=lighthouse, host="127.0.0.1",
                      state_dict=lambda: {}, load_state_dict=lambda state: None)
    parts: dict[str, list[float]] = {"quorum": [], "average": [], "vote": []}
    with_backward = _with_backward(session, model, backward) if backward else None
    for _ in range(steps):
        t0 = time.perf_counter()
        session.quorum()
        t1 = time.perf_counter()
        session.average_gradients(model.parameters())
        t2 = time.perf_counter()
        if with_backward is not None:
            for key, value in with_backward().items():
                parts.setdefault(key, []).append(value)
        t3 = time.perf_counter()
        session.should_commit(2)
        t4 = time.perf_counter()
        for key, value in zip(("quorum", "average", "vote"), (t1 - t0, t2 - t1, t4 - t3)):
            parts[key].append(value)
    out.put({"side": f"ft {replica}", **{k: _ms(v) for k, v in parts.items()}})
    session.shutdown()


def _with_backward(session, model, batch: int):
    """One call: the step's forward+backward alone, with the flat average after it, with the average
    overlapped; seconds each (every group runs the same, so the all-reduces pair up)."""
    import torch

    from dtrain.ft.overlap import Overlap

    x, overlap = torch.randn(batch, 1, 28, 28), Overlap(session.manager, model.parameters())

    def fb() -> None:
        model.zero_grad(set_to_none=True)
        model(x).sum().backward()

    def run() -> dict[str, float]:
        t0 = time.perf_counter()
        fb()
        t1 = time.perf_counter()
        fb()
        session.average_gradients(model.parameters())
        t2 = time.perf_counter()
        overlap.arm()
        fb()
        overlap.finish()
        t3 = time.perf_counter()
        return {"fb": t1 - t0, "fb_flat": t2 - t1, "fb_overlap": t3 - t2}

    return run


def plain_side(rank: int, port: int, steps: int, out) -> None:
    import torch
    import torch.distributed as dist

    model = _grads()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    flat = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    took = []
    for _ in range(steps):
        t0 = time.perf_counter()
        dist.all_reduce(flat)
        took.append(time.perf_counter() - t0)
    out.put({"side": f"plain {rank}", "allreduce": _ms(took), "numel": flat.numel()})
    dist.destroy_process_group()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--json", default=None)
    p.add_argument("--backward", type=int, default=0, metavar="B",
                   help="also time forward+backward on B images a group, alone, with the flat average, overlapped")
    a = p.parse_args()
    os.environ.setdefault("RUST_LOG", "warn")
    os.environ["OMP_NUM_THREADS"] = "1"
    from torchft.coordination import LighthouseServer

    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=2, join_timeout_ms=1000, quorum_tick_ms=100, heartbeat_timeout_ms=2000)
    address = "http://127.0.0.1:" + lighthouse.address().rpartition(":")[2]
    ctx, rows, load = mp.get_context("spawn"), [], round(os.getloadavg()[0], 2)
    out = ctx.Queue()
    port = 29000 + os.getpid() % 1000
    for target, args in ((ft_side, [(r, address) for r in "ab"]), (plain_side, [(r, port) for r in (0, 1)])):
        extra = (a.backward,) if target is ft_side else ()
        procs = [ctx.Process(target=target, args=(*x, a.steps, out, *extra)) for x in args]
        for proc in procs:
            proc.start()
        rows += [out.get(timeout=600) for _ in procs]
        for proc in procs:
            proc.join(60)
    lighthouse.shutdown()
    result = {"date": time.strftime("%Y-%m-%d"), "command": " ".join(["python3", "benchmarks/ft_step_parts.py", *sys.argv[1:]]),
              "load1": [load, round(os.getloadavg()[0], 2)], "rows": rows}
    print(json.dumps(result, indent=1))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

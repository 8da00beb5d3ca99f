"""The average over the quorum overlapped with backward (``dtrain.ft.overlap``) on torchft for real:
two replica groups (one process each) and a Lighthouse on this host. A step's buckets leave during
backward and both groups end with the mean of their gradients, bit for bit the same; a group that
dies after sending its first bucket of a step fails that step for the survivor, whose wait for the
buckets returns (a failed all-reduce is reported, not raised) and whose vote is False."""

from __future__ import annotations

import io
import multiprocessing as mp
import os

import pytest
import torch
from torch import nn

pytest.importorskip("torchft")


def _mlp() -> nn.Module:
    torch.manual_seed(0)  # two DDP buckets: the last two layers (1 MiB), the first
    return nn.Sequential(nn.Linear(3, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 2))


def _local_grads(model: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    model(x).pow(2).sum().backward()
    return [p.grad.clone() for p in model.parameters()]


def _group(rank: int, lighthouse: str, out) -> None:
    torch.set_num_threads(1)
    from dtrain.ft.overlap import Overlap
    from dtrain.ft.session import Session, quiet_torchft
    from dtrain.ft.spec import FaultTolerance

    quiet_torchft()
    model = _mlp()
    xs = [torch.randn(4, 3, generator=torch.Generator().manual_seed(g)) for g in (1, 2)]  # each group's batch
    mine, peer = _local_grads(model, xs[rank]), _local_grads(model, xs[1 - rank])
    # step-timeout 600: a survivor that waited it out would outlast the test's timeout
    session = Session(FaultTolerance(min_replicas=2, heartbeat_s=1.0, step_timeout_s=600), replica_id=f"g{rank}",
                      lighthouse=lighthouse, host="127.0.0.1", state_dict=lambda: {}, load_state_dict=lambda state: None)
    overlap = Overlap(session.manager, model.parameters())
    first = model[0].weight
    launch, during_backward = session.manager.allreduce, []

    def allreduce(tensor):
        during_backward.append(first.grad is None)  # the first layer's gradient is backward's last
        work = launch(tensor)
        if rank == 1 and session.step == 1:
            os._exit(9)  # dies with its first bucket of step 2 sent
        return work

    session.manager.allreduce = allreduce
    results = []
    for _ in range(2):
        session.quorum()
        model.zero_grad(set_to_none=True)
        overlap.arm()
        model(xs[rank]).pow(2).sum().backward()
        overlap.finish()
        committed = session.should_commit(2)
        results.append((committed, [p.grad.clone() for p in model.parameters()]))
    buffer = io.BytesIO()  # bytes, not tensors: a queue shares a tensor's memory, gone when this process ends
    torch.save((rank, during_backward, results, [(a + b) / 2 for a, b in zip(mine, peer)]), buffer)
    out.put(buffer.getvalue())
    session.shutdown()


@pytest.mark.timeout(240)
def test_overlapped_buckets_average_on_torchft_and_a_peer_lost_mid_step_fails_the_step():
    from torchft.coordination import LighthouseServer

    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=2, join_timeout_ms=1000, quorum_tick_ms=100,
                                  heartbeat_timeout_ms=1000)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    address = "http://127.0.0.1:" + lighthouse.address().rpartition(":")[2]
    procs = [ctx.Process(target=_group, args=(rank, address, out), daemon=True) for rank in (0, 1)]
    try:
        for proc in procs:
            proc.start()
        rank, during_backward, results, expected = torch.load(io.BytesIO(out.get(timeout=200)))
        procs[1].join(30)
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
            proc.join(10)
        lighthouse.shutdown()
    assert rank == 0 and procs[1].exitcode == 9
    # step 1: both buckets sent, the first while backward still had the first layer to do; the mean, committed
    assert during_backward[:2] == [True, False]
    (committed, grads), (committed_2, _) = results
    assert committed and all(torch.equal(g, e) for g, e in zip(grads, expected))
    # step 2: the peer died after sending its first bucket: the survivor's wait returned, nobody commits
    assert committed_2 is False

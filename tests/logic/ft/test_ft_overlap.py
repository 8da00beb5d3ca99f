"""The average over the quorum overlapped with backward (``dtrain.ft.overlap``), against a fake
torchft Manager: DDP's buckets, each launched during backward in bucket order, the same averages
as the flat all-reduce after backward, only a window's last micro-batch sends, and a failed bucket
reported without a hang."""

from __future__ import annotations

import types

import torch
import torch.distributed as dist
from torch import nn

from dtrain.ft.order import StepPlan
from dtrain.ft.overlap import Overlap, ddp_buckets
from dtrain.ft.session import average_gradients
from dtrain.tasks.models import MnistNet
from dtrain.train.config import BatchConfig
from dtrain.train.ft_replica import _Replica


class FakeManager:
    """``Manager.allreduce`` as torchft's: returns a Work whose ``wait()`` completes the tensor in
    place (here ``2x + 1``, elementwise: any bucketing gives the same bits) and returns False after
    reporting an error (``fail``: the launches whose wait fails)."""

    def __init__(self, probe=lambda: None, fail: tuple[int, ...] = ()) -> None:
        self.probe, self.fail = probe, fail
        self.launched: list[tuple[int, object]] = []
        """Each all-reduce's element count and what ``probe()`` said when it was launched."""
        self.waited: list[int] = []
        self.errors: list[str] = []

    def allreduce(self, tensor):
        index = len(self.launched)
        self.launched.append((tensor.numel(), self.probe()))
        manager = self

        class Work:
            def wait(self):
                manager.waited.append(index)
                if index in manager.fail:
                    manager.errors.append(f"bucket {index}: peer lost")
                    return False
                tensor.mul_(2).add_(1)
                return True

        return Work()


def _mlp() -> nn.Module:
    torch.manual_seed(0)  # 512x512 fp32 is DDP's first bucket (1 MiB): two buckets
    return nn.Sequential(nn.Linear(3, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 2))


def test_the_buckets_are_ddps_as_it_rebuilds_them_after_its_first_step():
    for model in (MnistNet(), _mlp()):
        params = list(model.parameters())
        order = list(reversed(range(len(params))))  # the order backward produces the gradients
        expected, _ = dist._compute_bucket_assignment_by_size(
            [params[i] for i in order], [dist._DEFAULT_FIRST_BUCKET_BYTES, 25 * 2**20], [False] * len(params), order)
        index = {id(p): i for i, p in enumerate(params)}
        assert [[index[id(p)] for p in b] for b in ddp_buckets(params)] == expected
    # the MNIST net's fc1 weight (4.7 MB) leaves with the first bucket, before the convolutions' backward
    net = MnistNet()
    buckets = ddp_buckets(list(net.parameters()))
    assert [len(b) for b in buckets] == [4, 4] and any(p is net.fc1.weight for p in buckets[0])


def test_a_bucket_is_sent_during_backward_in_bucket_order():
    model = _mlp()
    first = model[0].weight  # its gradient is backward's last
    manager = FakeManager(probe=lambda: first.grad is None)
    overlap = Overlap(manager, model.parameters())
    overlap.arm()
    model(torch.randn(4, 3)).sum().backward()
    # the first bucket left while backward was still to produce the first layer's gradient
    assert manager.launched == [(512 * 512 + 512 + 2 * 512 + 2, True), (3 * 512 + 512, False)]
    assert manager.waited == []  # nothing waited for inside backward
    overlap.finish()
    assert manager.waited == [0, 1]


def test_the_averages_are_the_flat_all_reduces_bit_for_bit():
    def run(overlapped: bool):
        torch.manual_seed(1)
        model = nn.Sequential(nn.Linear(3, 600), nn.BatchNorm1d(600), nn.Linear(600, 500), nn.Linear(500, 2))
        unused = nn.Linear(2, 2)  # no gradient this step: sent as zeros by both paths
        model.add_module("unused", unused)
        x = torch.randn(8, 3)
        manager = FakeManager()
        overlap = Overlap(manager, model.parameters()) if overlapped else None
        if overlap is not None:
            overlap.arm()
        nn.Sequential(*list(model)[:4])(x).pow(2).mean().backward()
        if overlap is not None:
            overlap.finish(model.buffers())
        else:
            average_gradients(manager, model.parameters(), model.buffers())
        return model.state_dict(), [p.grad for p in model.parameters()], len(manager.launched)

    (flat_state, flat_grads, flat_sends), (state, grads, sends) = run(False), run(True)
    assert (flat_sends, sends) == (1, 3)  # two buckets and the BatchNorm statistics
    assert all(torch.equal(a, b) for a, b in zip(flat_grads, grads))
    assert all(torch.equal(flat_state[k], state[k]) for k in flat_state)


def _replica(grad_accum: int, manager: FakeManager) -> tuple[_Replica, list[int]]:
    """``dtrain train --fault-tolerance``'s step on one group's share, its average overlapped."""
    data = torch.utils.data.TensorDataset(torch.randn(16, 3), torch.randint(0, 2, (16,)))
    rep = _Replica.__new__(_Replica)
    plain = types.SimpleNamespace(capabilities=types.SimpleNamespace(staged_step=False))
    rep.ctx = types.SimpleNamespace(device=torch.device("cpu"), strategy=plain)
    rep.cfg = types.SimpleNamespace(batch=BatchConfig(size=8, grad_accum=grad_accum), parallel=types.SimpleNamespace(layout=None))
    rep.task = types.SimpleNamespace(train_set=data, loss_fn=torch.nn.functional.cross_entropy)
    rep.model = _mlp()
    rep.rank, rep.dp_rank, rep.batch = 0, 0, 8
    rep.session = types.SimpleNamespace(average_gradients=lambda params, buffers=(): manager.launched.append((-1, None)))
    rep.overlap = Overlap(manager, rep.model.parameters())
    forwards: list[int] = []
    rep.model.register_forward_hook(lambda *_: forwards.append(1))
    return rep, forwards


def test_the_train_loop_sends_during_the_last_micro_batchs_backward_only():
    for k in (1, 4):
        manager = FakeManager()
        rep, forwards = _replica(k, manager)
        first = rep.model[0].weight
        manager.probe = lambda: (len(forwards), first.grad is None)
        rep._forward_backward(StepPlan(epoch=0, start=0, step_indices=list(range(8)), mine=list(range(8))))
        # after the window's last forward, before its backward reached the first layer; no flat all-reduce
        assert [probe for _, probe in manager.launched] == [(k, k == 1), (k, False)], k
        assert manager.waited == [0, 1]


def test_a_failed_bucket_is_reported_and_every_other_one_still_waited_for():
    model = _mlp()
    manager = FakeManager(fail=(0,))
    overlap = Overlap(manager, model.parameters())
    for _ in range(2):  # the next step arms again after a failed one
        overlap.arm()
        model(torch.randn(4, 3)).sum().backward()
        overlap.finish()
    assert manager.waited == [0, 1, 2, 3] and manager.errors == ["bucket 0: peer lost"]
    overlap.remove()
    overlap.arm()
    model(torch.randn(4, 3)).sum().backward()
    assert len(manager.launched) == 4  # no hooks left: nothing sent
